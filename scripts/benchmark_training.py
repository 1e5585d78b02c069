#!/usr/bin/env python3
"""End-to-end training-step benchmark: the same randomly initialised model trained with each lm_head + loss provider.

Step: bf16 weights, AdamW, sdpa attention, sequences of ``--seq`` tokens (4096) with the first quarter of each masked
as prompt (label -100); ``model(input_ids, labels=labels).loss``, backward, optimizer step. Only the head differs:
  stock  transformers' own forward (full logits, fp32 upcast in the loss)
  liger  ``liger_kernel.transformers.apply_liger_kernel_to_<family>`` with ``fused_linear_cross_entropy=True`` and every
         other kernel (rope, rms_norm, swiglu, ...) off
  trl    ``trl.trainer.utils.add_fused_lm_head(model)``, called with ``fused_lm_head=True`` (its ``.loss``)
  ours   ``hf_flce.apply_flce(model)``
  ours_late  ``hf_flce.apply_flce(model, defer_head_grad=True)``: lm_head's dW at the end of the backward
  ours_fp32_sum  ``ours`` with dW summed across chunks in float32 (``HF_FLCE_DW_FP32_SUM=1``), the default before
         v46; not in the default list

Each provider runs in its own fresh process (class-level patches cannot leak, and memory starts clean); inside it,
every model and token count is built afresh from the same seed. Reported: tokens/s (tokens per step over the median
step time, after warm-up steps that also allocate the optimizer state), peak allocated memory over all steps (weights,
gradients and optimizer state included), and the step losses. The first step's loss is also computed with the head
in float64 on the same bf16 hidden states (``exact_loss``): every provider shares the backbone, so its first loss
minus that one is its head's error. Out of memory is caught and reported as ``OOM``.

``--task dpo`` times a DPO step instead (TRL 1.16's ``DPOTrainer`` step without the trainer): each batch is
``[chosen; rejected]`` sequences of ``--seq`` tokens (2048) that share their prompt (the first quarter, label -100);
the policy's per-token log-probabilities with gradients, the reference model's (built from another seed) under
``torch.no_grad``, the sigmoid loss with beta 0.1, backward, optimizer step:
  stock  full logits of both models and TRL's ``selective_log_softmax`` (TRL's DPO before its fused head)
  liger  ``liger_kernel.chunked_loss.LigerFusedLinearDPOLoss`` on both backbones' hidden states
  trl    ``add_fused_lm_head`` on both models, the policy's with the fields ``DPOTrainer`` asks for (TRL's default)
  ours   ``hf_flce.trainers.add_flce_lm_head`` in the same places (what ``FLCEDPOTrainer`` does)

``--task grpo`` times a GRPO step (TRL 1.16's ``GRPOTrainer`` loss on given completions, without generation): the
sequences of ``--seq`` tokens (4096) are prompts (the first quarter, label -100) and completions, each sequence with
a fixed random advantage; the policy's per-token log-probabilities with gradients and its entropies (the metric),
TRL's default loss (``dapo``: ``-exp(logp - logp.detach()) * advantage`` summed over completion tokens and divided by
their count; one iteration, so the ratio is 1 and nothing is clipped; ``beta`` 0, so no reference model), backward,
optimizer step:
  stock  full logits, TRL's ``selective_log_softmax`` and ``entropy_from_logits``
  liger  ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (``loss_type="dapo"``, no reference) on the hidden
         states
  trl    ``add_fused_lm_head`` with the fields ``GRPOTrainer`` asks for (log-probs and entropy)
  ours   ``hf_flce.trainers.add_flce_lm_head`` in the same place (what ``FLCEGRPOTrainer`` does)
The first step's loss does not depend on the log-probabilities' values (the ratio is 1), so GRPO rows have no head
error.

``--processes N`` runs each provider in N fresh processes, in N rounds that take the providers in turn (each round
starting one provider later), and reports per cell the tokens/s at the median of the processes' step times, their
spread (``process_tokens_per_s``, and ``±`` half its range in the table) and the largest peak. One process's host can
run a few percent faster or slower than the next one's (README, "End to end, DPO"), which one process per provider
cannot tell from a difference between providers.

Output under ``--out``: ``training.json``, ``training.md`` and ``training.png`` (``training_dpo.*`` for
``--task dpo``). ``--device cpu`` runs tiny configs as a smoke test.
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
PROVIDERS = ("stock", "liger", "trl", "ours", "ours_late")
DPO_PROVIDERS = ("stock", "liger", "trl", "ours")
GRPO_PROVIDERS = DPO_PROVIDERS
TASK_PROVIDERS = {"sft": PROVIDERS, "dpo": DPO_PROVIDERS, "grpo": GRPO_PROVIDERS}
# run only where named in --providers
OPTIONAL_PROVIDERS = {"sft": ("ours_fp32_sum",)}
DPO_BETA = 0.1
# The per-token fields TRL 1.16's DPOTrainer asks of the policy's fused head (its reference asks for log_probs only).
DPO_POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
# ... and those GRPOTrainer asks of the policy's (the entropy for its metric and the optional entropy bonus).
GRPO_POLICY_OUTPUTS = ("log_probs", "entropy")
CUDA_ONLY = {"liger": "n/a: Liger's kernels need CUDA"}

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
    # Not one of design.md's configurations: the largest vocabulary with a thin H, where the head weighs most.
    "gemma3-1b": (
        "gemma3_text",
        {
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 262144,
            "max_position_embeddings": 32768,
            "sliding_window": 512,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen2": ("qwen2", _TINY),
    "tiny-qwen3": ("qwen3", _TINY),
}
# ``dpo_seq``: DPO's sequences (2048 tokens, a common max_length), chosen and rejected in equal numbers.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": {
        "models": ["qwen2.5-1.5b", "llama3.2-1b", "qwen3-0.6b"],
        "tokens": [8192, 32768],
        "seq": 4096,
        "dpo_seq": 2048,
    },
    "cpu": {"models": ["tiny-llama", "tiny-qwen3"], "tokens": [256], "seq": 128, "dpo_seq": 64},
}


def make_model(name: str, dev: bc.Device, dtype: torch.dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = MODELS[name]
    # use_cache=False as in a Trainer run (``Trainer`` writes its ``args.use_cache``, default False, to the config) and
    # as TRL's fused head passes it: otherwise the forwards that read the config (stock, Liger, the patched forward)
    # would build a KV cache each step, copying every layer's keys and values, where TRL's does not.
    config = AutoConfig.for_model(model_type, use_cache=False, **kwargs)
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


def make_preference_batch(
    vocab: int, tokens: int, seq: int, dev: bc.Device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[chosen; rejected]``: ``make_batch``'s sequences, at least two and an even number, the second half with the
    first half's prompts."""
    ids, labels = make_batch(vocab, max(tokens, 2 * seq), seq, dev, seed)
    pairs = ids.shape[0] // 2
    ids, labels = ids[: 2 * pairs].clone(), labels[: 2 * pairs].clone()
    ids[pairs:, : seq // 4] = ids[:pairs, : seq // 4]
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
    elif provider in ("ours", "ours_late", "ours_fp32_sum"):
        from hf_flce import apply_flce

        model = apply_flce(model, defer_head_grad=provider == "ours_late") or model
    elif provider != "stock":
        raise ValueError(f"unknown provider {provider!r}")
    loss_fn = lambda ids, labels: model(input_ids=ids, labels=labels).loss  # noqa: E731
    if provider == "ours_fp32_sum":
        return bc.with_env(loss_fn, HF_FLCE_DW_FP32_SUM="1")
    return loss_fn


def _sigmoid_dpo_loss(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    chosen, rejected = (logps - ref_logps).chunk(2)
    return -torch.nn.functional.logsigmoid(DPO_BETA * (chosen - rejected)).mean()


def patch_dpo(provider: str, policy, ref) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Patch ``policy`` and the frozen ``ref`` for ``provider``; returns ``loss_fn(ids, labels)``, the sigmoid DPO loss
    of a ``[chosen; rejected]`` batch."""
    if provider == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        dpo = LigerFusedLinearDPOLoss(ignore_index=IGNORE, beta=DPO_BETA, use_ref_model=True, average_log_prob=False)

        def liger_loss(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            hidden = policy.model(input_ids=ids).last_hidden_state[:, :-1]
            with torch.no_grad():
                ref_hidden = ref.model(input_ids=ids).last_hidden_state[:, :-1]
            target = labels[:, 1:].contiguous()
            return dpo(policy.lm_head.weight, hidden, target, ref_input=ref_hidden, ref_weight=ref.lm_head.weight)[0]

        return liger_loss
    if provider == "stock":
        from trl.trainer.utils import selective_log_softmax

        def sequence_logps(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            target = labels[:, 1:]
            mask = target != IGNORE
            logps = selective_log_softmax(model(input_ids=ids).logits[:, :-1], target.masked_fill(~mask, 0))
            return (logps * mask).sum(1)
    elif provider in ("trl", "ours"):
        if provider == "trl":
            from trl.trainer.utils import add_fused_lm_head as add_head
        else:
            from hf_flce.trainers import add_flce_lm_head as add_head
        add_head(policy, outputs=DPO_POLICY_OUTPUTS)
        add_head(ref)

        def sequence_logps(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs.sum(1)
    else:
        raise ValueError(f"unknown DPO provider {provider!r}")

    def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logps = sequence_logps(policy, ids, labels)
        with torch.no_grad():
            ref_logps = sequence_logps(ref, ids, labels)
        return _sigmoid_dpo_loss(logps, ref_logps)

    return loss_fn


def patch_grpo(provider: str, policy, advantages: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Patch ``policy`` for ``provider``; returns ``loss_fn(ids, labels)``, TRL's default GRPO loss (``dapo``, one
    iteration, no KL) of completions with per-sequence ``advantages``, the policy's entropies computed as TRL logs
    them."""
    if provider == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo")

        def liger_loss(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            hidden = policy.model(input_ids=ids).last_hidden_state[:, :-1]
            target = labels[:, 1:]
            mask = target != IGNORE
            return grpo(hidden, policy.lm_head.weight, target.masked_fill(~mask, 0), mask, advantages)[0]

        return liger_loss
    if provider == "stock":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        def per_token(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = policy(input_ids=ids).logits[:, :-1]
            with torch.no_grad():
                entropy_from_logits(logits)
            return selective_log_softmax(logits, labels[:, 1:].clamp(min=0))
    elif provider in ("trl", "ours"):
        if provider == "trl":
            from trl.trainer.utils import add_fused_lm_head as add_head
        else:
            from hf_flce.trainers import add_flce_lm_head as add_head
        add_head(policy, outputs=GRPO_POLICY_OUTPUTS)

        def per_token(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return policy(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    else:
        raise ValueError(f"unknown GRPO provider {provider!r}")

    def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = labels[:, 1:] != IGNORE
        logps = per_token(ids, labels)
        ratio = torch.exp(logps - logps.detach())
        return (-ratio * advantages[:, None] * mask).sum() / mask.sum().clamp(min=1)

    return loss_fn


@torch.no_grad()
def exact_first_loss(task: str, policy, ref, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """The first step's loss with the head (``lm_head`` and log-softmax) in float64, on the bf16 backbone's hidden
    states of the whole batch, one sequence's logits at a time."""

    def sequence_logps(model) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        weight = model.lm_head.weight.double()
        sums, counts = [], []
        for row_hidden, row_labels in zip(hidden, labels[:, 1:]):
            kept = row_labels != IGNORE
            logps = (row_hidden[kept].double() @ weight.T).log_softmax(-1)
            sums.append(logps.gather(1, row_labels[kept][:, None]).sum())
            counts.append(kept.sum())
        return torch.stack(sums), torch.stack(counts)

    logps, counts = sequence_logps(policy)
    if task == "dpo":
        return float(_sigmoid_dpo_loss(logps, sequence_logps(ref)[0]))
    return float(-logps.sum() / counts.sum().clamp(min=1))


def train_config(provider: str, name: str, tokens: int, args: argparse.Namespace, dev: bc.Device) -> dict[str, Any]:
    model = make_model(name, dev, torch.bfloat16, args.seed)
    vocab = model.config.vocab_size
    ref = None
    if args.task == "dpo":
        ref = make_model(name, dev, torch.bfloat16, args.seed + 7).eval().requires_grad_(False)
        ids, labels = make_preference_batch(vocab, tokens, args.seq, dev, args.seed)
    else:
        ids, labels = make_batch(vocab, tokens, args.seq, dev, args.seed)
    if args.task == "grpo":
        gen = torch.Generator(device=dev.torch_device).manual_seed(args.seed + 2)
        advantages = torch.randn(ids.shape[0], device=dev.torch_device, generator=gen)
        exact_loss = None  # the first step's loss does not depend on the log-probs (ratio 1)
        loss_fn = patch_grpo(provider, model, advantages)
    else:
        exact_loss = exact_first_loss(args.task, model, ref, ids, labels)
        dev.free()
        loss_fn = patch_dpo(provider, model, ref) if args.task == "dpo" else patch(provider, model)
    param_bytes = sum(p.nbytes for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True if dev.kind == "cuda" else None)
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
        "exact_loss": exact_loss,
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
    task = data["args"].get("task", "sft").upper()
    parts = [f"# Training-step benchmark, {task}: {data['env']['device_name']} ({data['env']['device']})", ""]
    parts.append("Versions: " + ", ".join(f"{k} {v}" for k, v in data["env"]["packages"].items() if v))
    head_error = (
        "Head error: first-step loss minus the same loss with the head in float64 on the same bf16 hidden states."
        if task != "GRPO"
        else "No head error: at the first step the ratio is 1 and the loss does not depend on the log-probs."
    )
    processes = data["args"].get("processes", 1)
    spread = (
        f" Each cell is the median over {processes} processes (± half their range of tokens/s) and their largest peak."
        if processes > 1
        else ""
    )
    parts.append(f"Cells: tokens/s · {mem_label}. {head_error}{spread}")
    parts.append("")
    rows = []
    for model, tokens in dict.fromkeys((r["model"], r["tokens"]) for r in rows_in):
        cells, deltas = [], []
        for p in providers:
            r = by.get((model, tokens, p), {})
            if r.get("status") != "ok":
                cells.append(str(r.get("status", "")))
                continue
            spread = ""
            if len(r.get("process_tokens_per_s", ())) > 1:
                low, high = min(r["process_tokens_per_s"]), max(r["process_tokens_per_s"])
                spread = f" ±{50 * (high - low) / r['tokens_per_s']:.1f}%"
            cells.append(f"{r['tokens_per_s'] / 1e3:.1f}k{spread} · {bc.fmt_gb(r.get(mem_key))}")
            if r["losses"] and r.get("exact_loss") is not None:
                deltas.append(f"{p} {r['losses'][0] - r['exact_loss']:+.1e}")
        rows.append([model, tokens, *cells, ", ".join(deltas)])
    parts.append(bc.markdown_table(["model", "tokens", *providers, "head error"], rows))
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


def report_stem(task: str) -> str:
    return "training" if task == "sft" else f"training_{task}"


def finish(data: dict[str, Any], out: Path) -> None:
    task = data["args"].get("task", "sft")
    bc.finish_report(data, out, report_stem(task), render_tables, render_plots)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__, "training")
    p.add_argument("--task", choices=tuple(TASK_PROVIDERS), default="sft", help="the step timed (default sft)")
    p.add_argument("--models", help=f"comma list from {list(MODELS)}")
    p.add_argument("--tokens", help="comma list of tokens per step (default 8192,32768; CPU 256)")
    p.add_argument("--seq", type=int, help="sequence length (default 4096, CPU 128; dpo 2048, CPU 64)")
    p.add_argument(
        "--providers",
        help="comma list (default: " + "; ".join(f"{t} {','.join(p)}" for t, p in TASK_PROVIDERS.items()) + ")",
    )
    p.add_argument("--steps", type=int, help="timed steps (default 5, quick 2); warm-up default 2, quick 1")
    p.add_argument("--timeout", type=float, default=None, help="seconds per provider process")
    p.add_argument("--processes", type=int, default=1, help="processes per provider, in interleaved rounds (default 1)")
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
    args.seq = args.seq or defaults["dpo_seq" if args.task == "dpo" else "seq"]
    known = TASK_PROVIDERS[args.task] + OPTIONAL_PROVIDERS.get(args.task, ())
    args.providers = [x for x in args.providers.split(",") if x] if args.providers else list(TASK_PROVIDERS[args.task])
    bad = [x for x in args.providers if x not in known]
    if bad:
        p.error(f"unknown providers {bad} for --task {args.task}; choose from {list(known)}")
    if args.processes < 1:
        p.error(f"--processes must be at least 1, got {args.processes}")
    args.steps = args.steps if args.steps is not None else 2 if args.quick else 5
    args.warmup = args.warmup if args.warmup is not None else 1 if args.quick else 2
    return args


def worker_argv(provider: str, args: argparse.Namespace) -> list[str]:
    return [
        str(Path(__file__).resolve()),
        "--worker",
        provider,
        "--task",
        args.task,
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
    runs: list[list[dict[str, Any]]] = []  # one list of rows per process
    for round_ in range(args.processes):
        shift = round_ % len(args.providers)
        for provider in args.providers[shift:] + args.providers[:shift]:
            runs.append(run_provider_process(provider, args))
            data["results"] = merge_processes(runs)
            bc.write_json(out / f"{report_stem(args.task)}.json", data)
    finish(data, out)
    return 0


def run_provider_process(provider: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One provider's rows from one fresh process (this one with ``--no-isolate``); a provider that fails as a whole
    (import error, crash) gives one row per configuration with its error."""
    if args.device != "cuda" and provider in CUDA_ONLY:
        res: dict[str, Any] = {"error": CUDA_ONLY[provider]}
    elif args.no_isolate:
        res = {"results": run_provider(provider, args)}
    else:
        res = bc.run_worker(worker_argv(provider, args), timeout=args.timeout, stream=True)
    if "error" not in res:
        return res["results"]
    rows = [
        {"model": m, "tokens": t, "provider": provider, "status": res["error"]}
        for m in args.models
        for t in args.tokens
    ]
    for row in rows:
        print(f"[train] {row['model']} {row['tokens']} {provider}: {row['status']}", flush=True)
    return rows


def merge_processes(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (model, tokens, provider) from every process's rows: as is where one process ran it; otherwise the
    first process's row (its losses, head error and step times), with the step time the median over the processes,
    tokens/s from it, ``process_tokens_per_s``, ``process_step_ms`` and ``process_step_times`` every process's, and
    the largest peak. A cell any process failed keeps that failure as its status."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            cells.setdefault((row["model"], row["tokens"], row["provider"]), []).append(row)
    merged = []
    for rows in cells.values():
        ok = [r for r in rows if r.get("status") == "ok"]
        if len(rows) == 1 or len(ok) < len(rows):
            merged.append(next((r for r in rows if r.get("status") != "ok"), rows[0]))
            continue
        row = dict(ok[0])
        row["process_tokens_per_s"] = [r["tokens_per_s"] for r in ok]
        row["process_step_ms"] = [r["step_ms"] for r in ok]
        row["process_step_times"] = [r["step_times"] for r in ok]
        row["step_ms"] = bc.median(row["process_step_ms"])
        row["tokens_per_s"] = row["tokens_per_step"] / (row["step_ms"] / 1e3)
        for key in ("peak_bytes", "rss_extra_bytes"):
            if key in row:
                row[key] = max(r[key] for r in ok)
        merged.append(row)
    return merged


if __name__ == "__main__":
    sys.exit(main())
