"""Training throughput and peak memory per rank, hf_flce against stock, in one ``accelerate launch``:

    accelerate launch --config_file examples/accelerate/fsdp2.yaml tests/distributed_bench.py OUT.json [RUN ...]

Runs (the first four by default, in this order):

* ``trainer_stock`` / ``trainer_flce``: ``transformers.Trainer`` on the model as built, or patched by ``apply_flce``.
* ``sft_stock`` / ``sft_flce``: TRL's ``SFTTrainer`` (its own chunked fused head) against ``FLCESFTTrainer``.
* ``trainer_flce_late`` / ``sft_flce_late``: the same with lm_head's gradient at the end of the backward
  (``defer_head_grad=True``, ``flce_defer_head_grad=True``): under DDP, or FSDP2 with lm_head in the root unit.

Every run trains a Qwen3-0.6B-sized model (random weights, tied embeddings, sdpa; bf16 mixed precision as the launch
config sets it) on the same rows: one sequence of ``--seq`` random tokens per rank and step, whose first quarter is
masked as prompt. Tokens/s is every rank's tokens per median step time over the steps after ``--warmup``; the peak memory of each
rank is taken over those steps too. Gradient checkpointing is off in both trainers (TRL turns it on by default).

Rank 0 rewrites ``OUT.json`` after every run: ``{"config": {...}, "runs": {name: {...}}, "ratios": {"trainer":
{...}, "sft": {...}}}`` with ratios ours ÷ stock. A run that raises is recorded with its traceback and the next one
starts (an error on one rank only leaves the other in a collective: the caller's timeout ends that).
``--tiny`` shrinks the model and sequence for a smoke test on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback

DEFAULT_RUNS = ("trainer_stock", "trainer_flce", "sft_stock", "sft_flce")
# lm_head's gradient at the end of the backward (``defer_head_grad``): DDP and FSDP2 with lm_head in the root unit
LATE_RUNS = ("trainer_flce_late", "sft_flce_late")
RUNS = DEFAULT_RUNS + LATE_RUNS


def bench_config(tiny: bool):
    from transformers import Qwen3Config

    size = (
        dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
        if tiny
        else dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, head_dim=128)
    )
    heads = (
        dict(num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(num_attention_heads=16, num_key_value_heads=8)
    )
    config = Qwen3Config(**size, **heads, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return config


def bench_model(config):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def bench_rows(vocab: int, seq: int, count: int) -> list[dict[str, list[int]]]:
    """The same rows for every run: random token ids, labels with the first quarter masked."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        labels = ids.clone()
        labels[: seq // 4] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Wall time of the steps after ``warmup``, with this rank's peak memory reset when they start."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._start = warmup, [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        if state.global_step == self.warmup and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def make_trainer(name: str, model, rows, out: str, opts, timer: StepTimer):
    common = dict(
        output_dir=out,
        per_device_train_batch_size=1,
        max_steps=opts.warmup + opts.steps,
        learning_rate=1e-5,
        bf16=torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        dataloader_drop_last=True,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
    )
    if name.startswith("trainer_"):
        from transformers import Trainer, TrainingArguments, default_data_collator

        if name.startswith("trainer_flce"):
            from hf_flce import apply_flce

            apply_flce(model, defer_head_grad=name in LATE_RUNS)
        data = [{k: torch.tensor(v) for k, v in row.items()} for row in rows]
        return Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            data_collator=default_data_collator,
            callbacks=[timer],
        )
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_flce import FLCESFTTrainer
    from hf_flce.data import build_tokenizer

    extra = {}
    trainer_cls = SFTTrainer
    if name.startswith("sft_flce"):
        trainer_cls, extra = FLCESFTTrainer, {"flce_defer_head_grad": name in LATE_RUNS}
    return trainer_cls(
        **extra,
        model=model,
        args=SFTConfig(**common, max_length=opts.seq),
        train_dataset=Dataset.from_list(rows),
        processing_class=build_tokenizer(),  # only its pad token is used: the rows are already token ids
        callbacks=[timer],
    )


def run_one(name: str, opts, config, rows) -> dict:
    timer = StepTimer(opts.warmup)
    resident = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(name, bench_model(config), rows, tmp, opts, timer)
        try:
            trainer.train()
            acc = trainer.accelerator
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
            peaks = acc.gather(torch.tensor([peak], device=acc.device)).tolist()
            step_s = statistics.median(timer.times) if timer.times else float("inf")
            return {
                "trainer": type(trainer).__name__,
                "distributed_type": str(acc.distributed_type),
                "world_size": acc.num_processes,
                "tokens_per_s": acc.num_processes * opts.seq / step_s,
                "step_s": step_s,
                "step_times_s": timer.times,
                "peak_gib_per_rank": peaks,
                "resident_gib_before": resident,
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                "failure": None,
            }
        finally:
            trainer.accelerator.free_memory()
            del trainer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def ratios(runs: dict) -> dict:
    """Ours ÷ stock per family (``trainer``, ``sft``), and the deferred head's ÷ stock and ÷ ours (``trainer_late``,
    ``trainer_late_vs_flce``, ...) where those runs were made."""
    out = {}
    for family in ("trainer", "sft"):
        pairs = {
            family: (f"{family}_flce", f"{family}_stock"),
            f"{family}_late": (f"{family}_flce_late", f"{family}_stock"),
            f"{family}_late_vs_flce": (f"{family}_flce_late", f"{family}_flce"),
        }
        for key, (ours_name, base_name) in pairs.items():
            ours, base = runs.get(ours_name), runs.get(base_name)
            if not base or not ours or base["failure"] or ours["failure"]:
                continue
            peak_base, peak_ours = max(base["peak_gib_per_rank"]), max(ours["peak_gib_per_rank"])
            out[key] = {
                "tokens_per_s": ours["tokens_per_s"] / base["tokens_per_s"],
                "peak_gib": peak_ours / peak_base if peak_base else None,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="JSON file written by rank 0")
    parser.add_argument(
        "runs", nargs="*", metavar="RUN", help=f"any of {', '.join(RUNS)} (default: {', '.join(DEFAULT_RUNS)})"
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small model for a smoke test")
    opts = parser.parse_args()
    unknown = sorted(set(opts.runs) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {RUNS}")
    opts.runs = opts.runs or list(DEFAULT_RUNS)
    if opts.tiny:
        opts.seq = min(opts.seq, 128)
    config = bench_config(opts.tiny)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    rows = bench_rows(config.vocab_size, opts.seq, (opts.warmup + opts.steps) * world)
    report = {
        "config": {
            "model": "Qwen3-0.6B-sized" if not opts.tiny else "tiny Qwen3",
            "vocab": config.vocab_size,
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "seq_per_rank": opts.seq,
            "warmup": opts.warmup,
            "steps": opts.steps,
            "world_size": world,
            "bf16": torch.cuda.is_available(),
            "gradient_checkpointing": False,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        "runs": {},
        "ratios": {},
    }
    for name in opts.runs:
        try:
            result = run_one(name, opts, config, rows)
        except Exception:
            result = {"failure": traceback.format_exc()}
            print(f"rank {rank}: {name} failed:\n{result['failure']}", flush=True)
        report["runs"][name] = result
        report["ratios"] = ratios(report["runs"])
        if rank == 0:
            brief = {k: v for k, v in result.items() if k not in ("step_times_s", "failure")}
            print(f"{name}: {json.dumps(brief)}", flush=True)
            opts.out.parent.mkdir(parents=True, exist_ok=True)
            opts.out.write_text(json.dumps(report, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
