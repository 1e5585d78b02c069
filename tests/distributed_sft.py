"""FLCESFTTrainer across processes against FLCESFTTrainer in one process on the concatenated batch.

    python tests/distributed_sft.py OUT_DIR single                              # the reference: batch 2B, one process
    torchrun --nproc_per_node 2 tests/distributed_sft.py OUT_DIR ddp fsdp2      # batch B on each of 2 ranks

Every run trains the same tiny Qwen2 (fp32, seed 0) on the bundled chat data for a few SGD steps, with TRL's defaults
otherwise (``average_tokens_across_devices``, gradient clipping at 1.0, random sampling). Scenarios:

* ``single``: no process group; ``per_device_train_batch_size`` is the global batch.
* ``ddp``: the trainer as launched (accelerate reads torchrun's environment and wraps the model in DDP).
* ``fsdp2``: accelerate ignores its FSDP setting on CPU, so the model is sharded here with accelerate's own
  ``fsdp2_prepare_model`` (decoder layers, the input embedding, and the final norm with ``lm_head`` as units, then the
  root) and marked as prepared so that accelerate does not wrap it in DDP as well.

Each rank writes ``OUT_DIR/{scenario}_rank{r}.pt``: ``{"logs": [...], "grads": {...}, "params": {...}, "initial":
{...}, "notes": [...], "failure": traceback or None}`` with the gradients before the first optimizer step (after
clipping) and the full parameters at the start and the end. A failing rank prints its traceback, writes it, and exits
with status 1 so that torchrun stops the other rank; a rank stuck longer than ``HANG_S`` dumps its stacks and exits.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import traceback
import types
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback
from trl import SFTConfig

from hf_flce import FLCESFTTrainer
from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset

GLOBAL_BATCH = 4  # rows per optimizer step, split over the ranks
STEPS = 3
ROWS = GLOBAL_BATCH * STEPS
LR = 1.0  # SGD; clipping keeps each step's update at norm <= 1
HANG_S = 240  # a rank that takes longer dumps its stacks and exits
COLLECTIVE_TIMEOUT_S = 90


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


class Capture(TrainerCallback):
    """Every log row, and the full gradients right before the first optimizer step."""

    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def shard_like_accelerate(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 units exactly as ``accelerate`` lays them out for a transformers model (transformer-based auto wrap,
    FULL_SHARD, fp32), through accelerate's own ``fsdp2_prepare_model``."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
    )
    state = types.SimpleNamespace(fsdp_plugin=plugin)
    stub = types.SimpleNamespace(state=state, torch_device_mesh=None, mixed_precision="no", is_main_process=True)
    model = fsdp2_prepare_model(stub, model)
    # Under MULTI_CPU, accelerate would otherwise wrap the sharded model in DDP too.
    model._is_accelerate_prepared = True
    return model


def run(scenario: str, tmp: str) -> dict:
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    notes = [f"world size {world}"]
    if scenario == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        model = shard_like_accelerate(model)
        units = [n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        notes.append(f"FSDP2 units: {units}")
    initial = full_params(model)
    args = SFTConfig(
        output_dir=tmp,
        max_steps=STEPS,
        logging_steps=1,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        optim="sgd",
        learning_rate=LR,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        ddp_timeout=COLLECTIVE_TIMEOUT_S,
    )
    capture = Capture()
    trainer = FLCESFTTrainer(
        model=model,
        args=args,
        train_dataset=load_toy_dataset("sft_chat").select(range(ROWS)),
        processing_class=tokenizer,
        callbacks=[capture],
    )
    notes.append(
        f"distributed type {trainer.accelerator.distributed_type}, average tokens across devices "
        f"{args.average_tokens_across_devices}"
    )
    if args.world_size != world:
        raise AssertionError(f"the trainer sees {args.world_size} processes, torchrun started {world}")
    trainer.train()
    notes.append(f"trained model {type(trainer.model_wrapped).__name__}")
    expected = {"single": "Qwen2ForCausalLM", "ddp": "DistributedDataParallel", "fsdp2": "FSDPQwen2ForCausalLM"}
    if type(trainer.model_wrapped).__name__ != expected[scenario]:
        raise AssertionError(f"{scenario}: the trainer ran {type(trainer.model_wrapped).__name__}")
    if not capture.grads:
        raise AssertionError("no gradients were captured before the first optimizer step")
    return {
        "logs": capture.logs,
        "grads": capture.grads,
        "params": full_params(trainer.model),
        "initial": initial,
        "notes": notes,
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    scenarios = sys.argv[2:]
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    rank = int(os.environ.get("RANK", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for scenario in scenarios:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                result = {**run(scenario, tmp), "failure": None}
            except Exception:
                failure = traceback.format_exc()
                print(f"rank {rank}, scenario {scenario} failed:\n{failure}", file=sys.stderr, flush=True)
                torch.save({"failure": failure}, out_dir / f"{scenario}_rank{rank}.pt")
                # Leaving at once makes torchrun stop the other ranks rather than let them wait in a collective.
                os._exit(1)
        torch.save(result, out_dir / f"{scenario}_rank{rank}.pt")
    faulthandler.cancel_dump_traceback_later()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
