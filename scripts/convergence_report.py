"""Markdown summary and PNG plots of convergence runs.

Reads the JSON written by ``make test-convergence`` (``outputs/convergence/cpu/*.json``: stock against ours, fp32)
and by ``scripts/convergence_gpu.py`` (``<out>/gpu.json``: fp32, stock bf16, stock bf16 with float32 logits and
ours bf16). For every run it plots the loss curves overlaid and their per-step differences from the reference run
(stock on CPU, fp32 on GPU), and writes ``report.md`` with the pass/fail state, the summary numbers and the
tolerance table.

Usage::

    python scripts/convergence_report.py                                   # outputs/convergence -> .../report
    python scripts/convergence_report.py outputs/convergence/gpu --out /tmp/report
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLORS = {"fp32": "black", "stock": "tab:blue", "fp32-logits": "tab:green", "ours": "tab:orange"}
STYLES = {"ours": "--", "fp32-logits": ":"}  # broken lines, so that a curve on top of stock's still shows both


def load_runs(paths: list[Path]) -> list[dict]:
    """Every run of every suite file under ``paths`` (files or folders, searched recursively), with its suite."""
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.json"))})
    runs = []
    for file in files:
        data = json.loads(file.read_text())
        if not isinstance(data, dict) or "runs" not in data:
            continue
        for run in data["runs"]:
            runs.append({**run, "suite": data["suite"], "source": str(file), "device": data.get("device", "cpu")})
    return runs


def plot_run(run: dict, out: Path) -> Path:
    """``<out>/<suite>-<name>.png``: the loss curves (left) and each curve minus the reference (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, reference = run["curves"], run["reference"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, values in curves.items():
        steps = range(1, len(values) + 1)
        style = dict(color=COLORS.get(label), linestyle=STYLES.get(label, "-"))
        left.plot(steps, values, label=label, linewidth=1.2, alpha=0.85, **style)
        if label != reference:
            diff = [a - b for a, b in zip(values, curves[reference])]
            right.plot(steps, diff, label=f"{label} − {reference}", linewidth=1.0, **style)
    right.axhline(0.0, color="grey", linewidth=0.6)
    left.set(title=f"{run['name']} ({run['suite']}): training loss", xlabel="optimizer step", ylabel="loss")
    right.set(title=f"per-step difference from {reference}", xlabel="optimizer step", ylabel="Δ loss")
    right.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / f"{run['suite']}-{run['name']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return "—" if value is None else str(value)


def _max_diff(ours: list[float], stock: list[float]) -> tuple[float, float]:
    """``(max |ours - stock|, max |ours - stock| / |stock|)`` over the logged values."""
    diffs = [abs(a - b) for a, b in zip(ours, stock)]
    rel = [d / abs(b) for d, b in zip(diffs, stock) if b]
    return max(diffs, default=0.0), max(rel, default=0.0)


def run_section(run: dict, image: Path, out: Path) -> list[str]:
    status = "PASS" if run["passed"] else "FAIL"
    lines = [f"### {run['name']} — {status}", "", f"![{run['name']}]({image.relative_to(out)})", ""]
    lines += [*(f"- {problem}" for problem in run.get("problems", [])), ""]
    summary = run.get("summary", {})
    if "distance_to_fp32" in summary:
        # each bf16 run's distance to the fp32 run, and its ratio to stock bf16's (older records: stock and ours)
        rows = dict(summary["distance_to_fp32"])
        for point, errors in summary.get("gradient_error", {}).items():
            rows.update({f"gradient error, {point} weights, {part}": values for part, values in errors.items()})
        runs = list(next(iter(rows.values())))
        others = [k for k in runs if k != "stock"]
        lines += [
            "| distance to fp32 | " + " | ".join(runs) + " | " + " | ".join(f"{k} / stock" for k in others) + " |",
            "|---" * (1 + len(runs) + len(others)) + "|",
        ]
        for key, values in rows.items():
            ratio = [values[k] / values["stock"] if values["stock"] else None for k in others]
            cells = [f"{values[k]:.4g}" for k in runs] + [_fmt(r) for r in ratio]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines.append("")
    # shown in the table above (the ratios, which records of earlier versions stored, computed there)
    skipped = ("distance_to_fp32", "gradient_error", "logged_keys")
    skipped += ("ratio_ours_to_stock", "ratio_to_stock", "gradient_error_ratio_to_stock")
    rest = {k: v for k, v in summary.items() if k not in skipped}
    lines += [f"- {key}: {_fmt(value)}" for key, value in rest.items()]
    if run.get("metrics"):
        lines += ["", "| logged metric | values | max abs diff | max rel diff |", "|---|---|---|---|"]
        for key, values in run["metrics"].items():
            diff, rel = _max_diff(values["ours"], values["stock"])
            lines.append(f"| {key} | {len(values['stock'])} | {diff:.3g} | {rel:.3g} |")
    return [*lines, ""]


def tolerance_table() -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from convergence_utils import tolerance_table_markdown

    return tolerance_table_markdown()


def write_report(runs: list[dict], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    passed = sum(r["passed"] for r in runs)
    lines = ["# Convergence report", "", f"{passed} of {len(runs)} runs pass.", ""]
    lines += ["| suite | run | device | reference | steps | result |", "|---|---|---|---|---|---|"]
    for run in runs:
        steps = len(run["curves"][run["reference"]])
        result = "pass" if run["passed"] else "**FAIL**"
        lines.append(f"| {run['suite']} | {run['name']} | {run['device']} | {run['reference']} | {steps} | {result} |")
    lines += ["", "## Tolerances", "", tolerance_table(), ""]
    for suite in dict.fromkeys(r["suite"] for r in runs):
        lines += [f"## {suite}", ""]
        for run in (r for r in runs if r["suite"] == suite):
            lines += run_section(run, plot_run(run, out), out)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path, default=[Path("outputs/convergence")])
    parser.add_argument("--out", type=Path, default=Path("outputs/convergence/report"))
    args = parser.parse_args(argv)
    runs = load_runs(args.inputs)
    if not runs:
        parser.error(f"no convergence JSON found under {[str(p) for p in args.inputs]}")
    path = write_report(runs, args.out)
    print(f"wrote {path} ({len(runs)} runs, {sum(not r['passed'] for r in runs)} failing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
