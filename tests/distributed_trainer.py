"""``transformers.Trainer`` on a patched model under ``accelerate launch`` (or torchrun): a correctness check.

    accelerate launch --config_file examples/accelerate/fsdp2.yaml --mixed_precision no \
        tests/distributed_trainer.py check OUT_DIR

A tiny Llama, one SGD step on a batch that the ranks split; the logged loss and the gradients (read before the
optimizer step) must equal a single-process reference on the whole batch. Writes ``OUT_DIR/rank{r}.json`` in the
format of ``distributed_workers.py``. The throughput comparison is ``distributed_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("check",))
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    run_check(args.out_dir)


if __name__ == "__main__":
    main()
