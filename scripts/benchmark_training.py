#!/usr/bin/env python3
"""End-to-end training-step benchmark: the same randomly initialised model trained with each lm_head + loss provider.

Step: bf16 weights, AdamW, sdpa attention, sequences of ``--seq`` tokens (4096) with the first quarter of each masked
as prompt (label -100); ``model(input_ids, labels=labels).loss``, backward, optimizer step. Only the head differs:
  stock  transformers' own forward (full logits, fp32 upcast in the loss)
  liger  ``liger_kernel.transformers.apply_liger_kernel_to_<family>`` with ``fused_linear_cross_entropy=True`` and every
         other kernel (rope, rms_norm, swiglu, ...) off
  trl    ``trl.trainer.utils.add_fused_lm_head(model)``, called with ``fused_lm_head=True`` (its ``.loss``)
  ours   ``hf_flce.apply_flce(model)``
  ours_lean  the same with dW summed in the bf16 gradient plus an int8 residual (what ``HF_FLCE_DW_RESIDUAL=1`` does)

Each provider runs in its own fresh process (class-level patches cannot leak, and memory starts clean); inside it,
every model and token count is built afresh from the same seed. Reported: tokens/s (tokens per step over the median
step time, after warm-up steps that also allocate the optimizer state), peak allocated memory over all steps (weights,
gradients and optimizer state included), and the step losses (the first should agree across providers). Out of
memory is caught and reported as ``OOM``.

Output under ``--out``: ``training.json``, ``training.md`` and ``training.png``. ``--device cpu`` runs tiny configs
as a smoke test.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import bench_common as bc  # noqa: E402

IGNORE = -100
PROVIDERS = ("stock", "liger", "trl", "ours", "ours_lean")
CUDA_ONLY = {"liger": "n/a: Liger's kernels need CUDA", "ours_lean": "n/a: the residual dW GEMM is a CUDA kernel"}

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
# (model_type, config kwargs): the published sizes, randomly initialised.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": (
        "qwen2",
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
    "llama3.2-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 5e5,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-0.6b": (
        "qwen3",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen2": ("qwen2", _TINY),
    "tiny-qwen3": ("qwen3", _TINY),
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": {"models": ["qwen2.5-1.5b", "llama3.2-1b", "qwen3-0.6b"], "tokens": [8192, 32768], "seq": 4096},
    "cpu": {"models": ["tiny-llama", "tiny-qwen3"], "tokens": [256], "seq": 128},
}


def make_model(name: str, dev: bc.Device, dtype: torch.dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = MODELS[name]
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    with dev.torch_device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def make_batch(vocab: int, tokens: int, seq: int, dev: bc.Device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens // seq`` random sequences; labels copy the inputs with the first quarter of each masked as prompt."""
    gen = torch.Generator(device=dev.torch_device).manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (max(1, tokens // seq), seq), device=dev.torch_device, generator=gen)
    labels = ids.clone()
    labels[:, : seq // 4] = IGNORE
    return ids, labels


def _apply_liger(model) -> None:
    import liger_kernel.transformers as lk

    apply = getattr(lk, f"apply_liger_kernel_to_{model.config.model_type}")
    params = inspect.signature(apply).parameters
    # Every kernel switch off except the fused head, so that only the head differs from stock.
    kwargs: dict[str, Any] = {k: False for k, p in params.items() if isinstance(p.default, bool)}
    kwargs["fused_linear_cross_entropy"] = True
    if "model" in params:
        kwargs["model"] = model
    apply(**kwargs)


def patch(provider: str, model) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Patch ``model`` for ``provider``; returns ``loss_fn(ids, labels)``."""
    if provider == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
        return lambda ids, labels: model(input_ids=ids, labels=labels, fused_lm_head=True).loss
    if provider == "liger":
        _apply_liger(model)
    elif provider in ("ours", "ours_lean"):
        from hf_flce import apply_flce

        model = apply_flce(model) or model
    elif provider != "stock":
        raise ValueError(f"unknown provider {provider!r}")
    loss_fn = lambda ids, labels: model(input_ids=ids, labels=labels).loss  # noqa: E731
    return bc.with_residual_dw(loss_fn) if provider == "ours_lean" else loss_fn


def train_config(provider: str, name: str, tokens: int, args: argparse.Namespace, dev: bc.Device) -> dict[str, Any]:
    model = make_model(name, dev, torch.bfloat16, args.seed)
    loss_fn = patch(provider, model)
    param_bytes = sum(p.nbytes for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True if dev.kind == "cuda" else None)
    ids, labels = make_batch(model.config.vocab_size, tokens, args.seq, dev, args.seed)
    losses: list[torch.Tensor] = []

    def step() -> None:
        loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    dev.reset_peak()
    if dev.accelerator:
        times = dev.time_ms(step, args.warmup, args.steps)
        memory = {"peak_bytes": dev.peak()}
    else:
        times, extra, method = bc.cpu_peak_rss_delta(lambda: dev.time_ms(step, args.warmup, args.steps))
        memory = {"rss_extra_bytes": extra, "rss_method": method}
    step_ms = bc.median(times)
    real_tokens = ids.numel()
    return {
        "status": "ok",
        "tokens_per_step": real_tokens,
        "step_ms": step_ms,
        "step_times": times,
        "tokens_per_s": real_tokens / (step_ms / 1e3),
        "param_bytes": param_bytes,
        "losses": [float(x) for x in losses],
        **memory,
    }


def run_provider(provider: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every model x token count for one provider, in this process."""
    dev = bc.Device(args.device)
    rows = []
    for name in args.models:
        for tokens in args.tokens:
            rec, err = bc.guarded(dev, lambda name=name, tokens=tokens: train_config(provider, name, tokens, args, dev))
            dev.free()
            row = {"model": name, "tokens": tokens, "provider": provider, **(rec or {"status": err})}
            print(f"[train] {name} {tokens} {provider}: {_summary(row)}", flush=True)
            rows.append(row)
    return rows


def _summary(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return str(row.get("status"))
    mem = row.get("peak_bytes", row.get("rss_extra_bytes"))
    return f"{row['tokens_per_s'] / 1e3:.1f}k tok/s, {bc.fmt_gb(mem)} GiB, step {bc.fmt_ms(row['step_ms'])} ms"


# ---------------------------------------------------------------- tables and plots


def render_tables(data: dict[str, Any]) -> str:
    rows_in = data["results"]
    providers = list(dict.fromkeys(r["provider"] for r in rows_in))
    by = {(r["model"], r["tokens"], r["provider"]): r for r in rows_in}
    mem_key = "peak_bytes" if data["env"]["device"] != "cpu" else "rss_extra_bytes"
    mem_label = "peak GiB" if mem_key == "peak_bytes" else "peak RSS Δ GiB"
    parts = [f"# Training-step benchmark: {data['env']['device_name']} ({data['env']['device']})", ""]
    parts.append("Versions: " + ", ".join(f"{k} {v}" for k, v in data["env"]["packages"].items() if v))
    parts.append(f"Cells: tokens/s · {mem_label}. Loss Δ: first-step loss minus stock's.")
    parts.append("")
    rows = []
    for model, tokens in dict.fromkeys((r["model"], r["tokens"]) for r in rows_in):
        stock = by.get((model, tokens, "stock"), {})
        cells, deltas = [], []
        for p in providers:
            r = by.get((model, tokens, p), {})
            if r.get("status") != "ok":
                cells.append(str(r.get("status", "")))
                continue
            cells.append(f"{r['tokens_per_s'] / 1e3:.1f}k · {bc.fmt_gb(r.get(mem_key))}")
            if p != "stock" and stock.get("status") == "ok" and r["losses"] and stock["losses"]:
                deltas.append(f"{p} {r['losses'][0] - stock['losses'][0]:+.1e}")
        rows.append([model, tokens, *cells, ", ".join(deltas)])
    parts.append(bc.markdown_table(["model", "tokens", *providers, "loss Δ"], rows))
    return "\n".join(parts) + "\n"


def render_plots(data: dict[str, Any], path: Path) -> None:
    rows_in = data["results"]
    if not rows_in:
        return
    providers = list(dict.fromkeys(r["provider"] for r in rows_in))
    keys = list(dict.fromkeys((r["model"], r["tokens"]) for r in rows_in))
    by = {(r["model"], r["tokens"], r["provider"]): r for r in rows_in}
    mem_key = "peak_bytes" if data["env"]["device"] != "cpu" else "rss_extra_bytes"

    def series(value: Callable[[dict[str, Any]], float]) -> dict[str, list[float | None]]:
        out: dict[str, list[float | None]] = {}
        for p in providers:
            recs = [by.get((m, t, p), {}) for m, t in keys]
            out[p] = [value(r) if r.get("status") == "ok" else None for r in recs]
        return out

    fig, axes = bc.new_figure(2, width=10)
    if fig is None:
        return
    groups = [f"{m}\n{t} tok" for m, t in keys]
    bc.bar_groups(axes[0], groups, series(lambda r: r["tokens_per_s"] / 1e3), "k tokens/s", "Training throughput")
    bc.bar_groups(axes[1], groups, series(lambda r: (r.get(mem_key) or 0) / 2**30), "GiB", "Peak memory (missing: OOM)")
    bc.save_figure(fig, path)


def finish(data: dict[str, Any], out: Path) -> None:
    bc.finish_report(data, out, "training", render_tables, render_plots)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__, "training")
    p.add_argument("--models", help=f"comma list from {list(MODELS)}")
    p.add_argument("--tokens", help="comma list of tokens per step (default 8192,32768; CPU 256)")
    p.add_argument("--seq", type=int, help="sequence length (default 4096; CPU 128)")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--steps", type=int, help="timed steps (default 5, quick 2); warm-up default 2, quick 1")
    p.add_argument("--timeout", type=float, default=None, help="seconds per provider process")
    p.add_argument("--no-isolate", action="store_true", help="run every provider in this process (CPU smoke tests)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bc.setup_run(args)
    defaults = DEFAULTS["cpu" if args.device == "cpu" else "gpu"]
    args.models = args.models.split(",") if args.models else defaults["models"]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else defaults["tokens"]
    args.seq = args.seq or defaults["seq"]
    args.providers = [x for x in args.providers.split(",") if x]
    bad = [x for x in args.providers if x not in PROVIDERS]
    if bad:
        p.error(f"unknown providers {bad}; choose from {list(PROVIDERS)}")
    args.steps = args.steps if args.steps is not None else 2 if args.quick else 5
    args.warmup = args.warmup if args.warmup is not None else 1 if args.quick else 2
    return args


def worker_argv(provider: str, args: argparse.Namespace) -> list[str]:
    return [
        str(Path(__file__).resolve()),
        "--worker",
        provider,
        "--device",
        args.device,
        "--models",
        ",".join(args.models),
        "--tokens",
        ",".join(str(t) for t in args.tokens),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        finish(bc.load_json(args.from_json), out)
        return 0
    if args.worker:
        bc.write_json(Path(args.worker_out), {"results": run_provider(args.worker, args)})
        return 0

    dev = bc.Device(args.device)
    data: dict[str, Any] = {
        "env": bc.env_info(dev),
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")},
        "results": [],
    }
    print(f"[env] {json.dumps(data['env'])}", flush=True)
    for provider in args.providers:
        if args.device != "cuda" and provider in CUDA_ONLY:
            res: dict[str, Any] = {"error": CUDA_ONLY[provider]}
        elif args.no_isolate:
            res = {"results": run_provider(provider, args)}
        else:
            res = bc.run_worker(worker_argv(provider, args), timeout=args.timeout, stream=True)
        if "error" in res:  # the whole provider failed (import error, crash): one row per configuration
            res = {
                "results": [{"model": m, "tokens": t, "status": res["error"]} for m in args.models for t in args.tokens]
            }
            for row in res["results"]:
                row["provider"] = provider
                print(f"[train] {row['model']} {row['tokens']} {provider}: {row['status']}", flush=True)
        data["results"] += res["results"]
        bc.write_json(out / "training.json", data)
    finish(data, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
