"""``make demo``: SFT of a tiny model with hf_flce's trainer and with TRL's stock trainer, side by side.

Runs ``examples/sft.py`` twice on the same seed and data (each in its own process, so each peak memory is its own):
once with :class:`hf_flce.FLCESFTTrainer`, once with ``--stock_trl``. Prints the loss, tokens/s and peak memory of
both and writes the loss curves to ``outputs/demo/loss_curves.png``. About two minutes on two CPU cores; on a GPU
it trains in bf16 and reports CUDA peak memory.

    python examples/demo.py [--max_steps 60] [--vocab_size 8192] [--out outputs/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RUNS = (("hf_flce", "FLCESFTTrainer", []), ("trl", "TRL SFTTrainer", ["--stock_trl"]))


def run_example(name: str, extra: list[str], opts) -> dict:
    out = Path(opts.out)
    metrics = out / f"{name}.json"
    cmd = [
        sys.executable,
        str(HERE / "sft.py"),
        "--metrics_json",
        str(metrics),
        "--output_dir",
        str(out / name),
        "--max_steps",
        str(opts.max_steps),
        "--vocab_size",
        str(opts.vocab_size),
        *extra,
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(metrics.read_text())


def curve(summary: dict, key: str) -> tuple[list[int], list[float]]:
    points = [(log["step"], log[key]) for log in summary["logs"] if key in log]
    return [p[0] for p in points], [p[1] for p in points]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, label, _), style in zip(RUNS, ("-", "--")):
        for key, marker in (("loss", ""), ("eval_loss", "o")):
            steps, values = curve(results[name], key)
            ax.plot(steps, values, style, marker=marker, label=f"{label} {key}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("SFT of a tiny Qwen2: hf_flce vs stock TRL (same seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--vocab_size", type=int, default=8192, help="pad the tiny model's vocabulary to this")
    parser.add_argument("--out", default="outputs/demo")
    opts = parser.parse_args(argv)
    results = {}
    for name, label, extra in RUNS:
        print(f"\n=== {label} ===", flush=True)
        results[name] = run_example(name, extra, opts)

    device = results["hf_flce"]["device"]
    memory_kind = "CUDA peak allocated" if device == "cuda" else "peak RSS"
    header = f"{'trainer':<18} {'final loss':>10} {'eval loss':>10} {'tokens/s':>10} {'first step (s)':>15}"
    print(f"\n{header} {memory_kind + ' (MiB)':>24}")
    for name, label, _ in RUNS:
        r = results[name]
        loss, eval_loss = curve(r, "loss")[1][-1], curve(r, "eval_loss")[1][-1]
        mib = r["peak_memory_bytes"] / 2**20
        row = f"{label:<18} {loss:>10.4f} {eval_loss:>10.4f} {r['tokens_per_second']:>10.0f}"
        print(f"{row} {r['first_step_seconds']:>15.2f} {mib:>24.0f}")
    print("tokens/s: the median over logging intervals after the first (on a GPU the first step compiles kernels).")
    ours, stock = results["hf_flce"], results["trl"]
    speed = ours["tokens_per_second"] / max(stock["tokens_per_second"], 1e-9)
    print(
        f"\nhf_flce / TRL: {speed:.2f}x tokens/s, {ours['peak_memory_bytes'] / stock['peak_memory_bytes']:.2f}x memory"
    )
    png = Path(opts.out) / "loss_curves.png"
    plot(results, png)
    print(f"Loss curves: {png}")


if __name__ == "__main__":
    main()
