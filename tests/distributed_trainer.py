"""``transformers.Trainer`` on a patched model under ``accelerate launch``: a correctness check and a throughput run.

    accelerate launch --config_file examples/accelerate/ddp.yaml tests/distributed_trainer.py check OUT_DIR
    accelerate launch --config_file examples/accelerate/fsdp2.yaml tests/distributed_trainer.py bench OUT_DIR [--stock]

``check``: a tiny Llama, one SGD step on a batch that the ranks split; the logged loss and the gradients (read before
the optimizer step) must equal a single-process reference on the whole batch. Writes ``OUT_DIR/rank{r}.json`` in the
format of ``distributed_workers.py``.

``bench``: a Qwen3-0.6B-sized model (random weights, bf16 mixed precision), sequences of 4096 tokens whose first
quarter is masked as prompt; reports tokens/s (all ranks, after warm-up steps) and each rank's peak memory, with hf_flce
or, with ``--stock``, the stock loss. Writes ``OUT_DIR/bench_{flce|stock}.json`` from rank 0.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch
from distributed_workers import BATCH, check, llama, lm_batch, reference_lm
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class GradCapture(TrainerCallback):
    """The full gradients right before the optimizer step (DDP: on every rank; FSDP2: gathered from the shards)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


class StepTimer(TrainerCallback):
    """Wall time of the steps after ``warmup``, and the peak memory of this rank."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._start = warmup, [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        if state.global_step == self.warmup:
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def training_args(out: str, **overrides) -> TrainingArguments:
    base = dict(
        output_dir=out,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        lr_scheduler_type="constant",
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        seed=0,
    )
    return TrainingArguments(**{**base, **overrides})


def run_check(out_dir: Path) -> None:
    from hf_flce import apply_flce

    model = llama()
    ref_loss, ref_grads = reference_lm(model)
    ids, labels = (t.cpu() for t in lm_batch())
    dataset = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]
    capture = GradCapture()
    fused = []
    model.register_forward_hook(lambda module, args, output: fused.append(output.logits is None))
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp, per_device_train_batch_size=1, max_steps=1, optim="sgd", max_grad_norm=0.0)
        # One step covers the whole batch: every rank takes BATCH / world rows of it.
        args.per_device_train_batch_size = BATCH // args.world_size
        trainer = Trainer(
            model=apply_flce(model),
            args=args,
            train_dataset=dataset,
            data_collator=default_data_collator,
            callbacks=[capture],
        )
        result = {"errors": {}, "notes": [f"world size {args.world_size}"], "failure": None}
        try:
            result["notes"].append(str(trainer.accelerator.distributed_type))
            loss = trainer.train().training_loss
            if not (fused and all(fused)):
                raise AssertionError(f"the fused path was not taken: {fused}")
            check(result, "loss", torch.tensor(loss), ref_loss.cpu())
            for name, want in ref_grads.items():
                check(result, f"grad {name}", capture.grads[name], want)
        except Exception:
            result["failure"] = traceback.format_exc()
        rank = args.process_index
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"trainer": result}, indent=1))


def bench_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def run_bench(out_dir: Path, stock: bool, seq: int, steps: int, warmup: int) -> None:
    from hf_flce import apply_flce

    model = bench_model()
    if not stock:
        apply_flce(model)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(64):
        ids = torch.randint(0, model.config.vocab_size, (seq,), generator=gen)
        labels = ids.clone()
        labels[: seq // 4] = -100
        rows.append({"input_ids": ids, "labels": labels})
    timer = StepTimer(warmup)
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(
            tmp, per_device_train_batch_size=1, max_steps=warmup + steps, bf16=True, learning_rate=1e-5
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=rows, data_collator=default_data_collator, callbacks=[timer]
        )
        trainer.train()
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        peaks = trainer.accelerator.gather(peak).tolist()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if trainer.accelerator.is_main_process:
            step_s = sum(timer.times) / len(timer.times)
            summary = {
                "label": "stock" if stock else "hf_flce",
                "distributed_type": str(trainer.accelerator.distributed_type),
                "world_size": args.world_size,
                "seq": seq,
                "tokens_per_s": args.world_size * seq / step_s,
                "step_s": step_s,
                "peak_gib_per_rank": peaks,
                "losses": losses,
            }
            print(json.dumps(summary))
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"bench_{'stock' if stock else 'flce'}.json").write_text(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("check", "bench"))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--stock", action="store_true", help="bench the unpatched model")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.mode == "check":
        run_check(args.out_dir)
    else:
        run_bench(args.out_dir, args.stock, args.seq, args.steps, args.warmup)


if __name__ == "__main__":
    main()
