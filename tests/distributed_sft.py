"""FLCESFTTrainer across processes against FLCESFTTrainer in one process on the concatenated batch.

    python tests/distributed_sft.py OUT_DIR single                              # the reference: batch 2B, one process
    torchrun --nproc_per_node 2 tests/distributed_sft.py OUT_DIR ddp fsdp2      # batch B on each of 2 ranks
    accelerate launch --config_file examples/accelerate/fsdp2.yaml --mixed_precision no \\
        tests/distributed_sft.py OUT_DIR launch_fsdp2                           # GPUs: accelerate's own FSDP2
    accelerate launch --config_file examples/accelerate/zero3.yaml --mixed_precision no \\
        tests/distributed_sft.py OUT_DIR launch_zero3                           # GPUs: DeepSpeed ZeRO-3
    python tests/distributed_sft.py compare OUT_DIR ddp fsdp2 [--json FILE]     # each scenario against `single`

(``trainer_check`` among the scenarios runs ``distributed_trainer.py``'s HF Trainer check in the same launch, into
``OUT_DIR/trainer_check/``.)

Every run trains the same tiny Qwen2 (fp32, seed 0) on the bundled chat data for a few SGD steps, with TRL's defaults
otherwise (``average_tokens_across_devices``, gradient clipping at 1.0, random sampling). Scenarios:

* ``single``: no process group; ``per_device_train_batch_size`` is the global batch.
* ``ddp``: the trainer as launched (accelerate reads torchrun's environment and wraps the model in DDP).
* ``fsdp2``: accelerate ignores its FSDP setting on CPU, so the model is sharded here with accelerate's own
  ``fsdp2_prepare_model`` (decoder layers, the input embedding, and the final norm with ``lm_head`` as units, then the
  root) and marked as prepared so that accelerate does not wrap it in DDP as well.
* ``launch_fsdp2`` / ``launch_zero3``: nothing is set up here; the trainer must find the engine that ``accelerate
  launch`` configured (FSDP2, or DeepSpeed ZeRO-3 with every parameter partitioned), on GPUs. Under ZeRO-3 the
  gradients are read inside ``DeepSpeedEngine.step`` (which also clips them), clipped here as ``Trainer`` clips.

Every scenario also checks where ``lm_head.weight`` lives: at the start of each step (a sharded ``DTensor`` under
FSDP2, a ``numel() == 0`` placeholder under ZeRO-3, the whole matrix otherwise) and as hf_flce's fused head sees it
inside the head's call (always the whole matrix, never a ``DTensor``: a sharded one there would be taken for a
vocabulary-parallel head).

Each rank writes ``OUT_DIR/{scenario}_rank{r}.pt``: ``{"logs": [...], "grads": {...}, "params": {...}, "initial":
{...}, "notes": [...], "failure": traceback or None}`` with the gradients before the first optimizer step (after
clipping) and the full parameters at the start and the end. A failing rank prints its traceback, writes it, and exits
with status 1 so that the launcher stops the other rank; a rank stuck longer than ``HANG_S`` (environment variable
``HF_FLCE_HANG_S``) dumps its stacks and exits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
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
HANG_S = int(os.environ.get("HF_FLCE_HANG_S", "240"))  # a rank that takes longer dumps its stacks and exits
COLLECTIVE_TIMEOUT_S = 90
LOG_RTOL, LOG_ATOL = 1e-5, 1e-8  # every logged value
TENSOR_TOL = 1e-4  # gradients, parameters and updates: relative to each tensor's largest entry
# Runtimes differ, and `total_flos` counts each rank's padded length.
UNCOMPARED_LOGS = ("_runtime", "_per_second", "total_flos")

# The wrapper the trainer must end up with, and the accelerate distributed type it must report.
EXPECTED_WRAPPER = {
    "single": "Qwen2ForCausalLM",
    "ddp": "DistributedDataParallel",
    "fsdp2": "FSDPQwen2ForCausalLM",
    "launch_fsdp2": "FSDPQwen2ForCausalLM",
    "launch_zero3": "DeepSpeedEngine",
}
EXPECTED_TYPE = {"launch_fsdp2": "FSDP", "launch_zero3": "DEEPSPEED"}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU: FSDP2's ``DTensor`` shards gathered, ZeRO-3's partitions gathered (a
    collective: every rank calls this)."""
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: full(p) for name, p in params.items()}
    return {name: full(p) for name, p in params.items()}


def weight_layout(weight: torch.Tensor) -> str:
    """``"DTensor(Shard(dim=0),) 32768"`` (the local shard's size), ``"Parameter 65536"``, ``"Parameter 0 of 65536"``
    (a ZeRO-3 partition outside its module's call)."""
    if isinstance(weight, DTensor):
        return f"DTensor{tuple(weight.placements)} {weight.to_local().numel()}"
    if hasattr(weight, "ds_numel") and weight.numel() != weight.ds_numel:
        return f"{type(weight).__name__} {weight.numel()} of {weight.ds_numel}"
    return f"{type(weight).__name__} {weight.numel()}"


class Capture(TrainerCallback):
    """Every log row, the full gradients right before the first optimizer step, and the layout of ``lm_head.weight``
    at the start of every step."""

    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.head_at_step_begin: list[str] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.head_at_step_begin.append(weight_layout(model.get_output_embeddings().weight))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # Under ZeRO-3 the gradients were taken inside DeepSpeedEngine.step (`zero3_gradients`); `.grad` is None.
        if state.global_step == 0 and not self.grads:
            self.grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def head_weights_seen_by_flce(seen: list[str]):
    """Record the layout of the weight that hf_flce's fused head gets inside ``lm_head``'s call."""
    import hf_flce.distributed as hf_dist

    original = hf_dist._operands

    def recording(hidden, weight, bias):
        seen.append(weight_layout(weight))
        return original(hidden, weight, bias)

    hf_dist._operands = recording
    try:
        yield
    finally:
        hf_dist._operands = original


@contextlib.contextmanager
def zero3_gradients(capture: Capture, max_grad_norm: float):
    """Read the full gradients in the first ``DeepSpeedEngine.step`` (accelerate calls it inside ``backward``, before
    ``Trainer``'s pre-optimizer callback), and clip them as ``Trainer`` (and DeepSpeed) would."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    original = DeepSpeedEngine.step

    def step(engine, *args, **kwargs):
        if not capture.grads:
            grads = {n: safe_get_full_grad(p).detach().float().cpu() for n, p in engine.module.named_parameters()}
            norm = torch.stack([g.double().norm() for g in grads.values()]).norm().item()
            coef = min(1.0, max_grad_norm / (norm + 1e-6)) if max_grad_norm > 0 else 1.0
            capture.grads = {n: g * coef for n, g in grads.items()}
        return original(engine, *args, **kwargs)

    DeepSpeedEngine.step = step
    try:
        yield
    finally:
        DeepSpeedEngine.step = original


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


def check_head_layouts(scenario: str, full_numel: int, at_step_begin: list[str], in_call: list[str]) -> None:
    """``lm_head.weight`` outside the head's call is sharded as the engine shards it; inside, hf_flce gets it whole."""
    if not at_step_begin or not in_call:
        raise AssertionError(f"lm_head.weight was not observed (step begin {at_step_begin}, in call {in_call})")
    whole = {f"Parameter {full_numel}", f"Tensor {full_numel}"}
    bad_inside = sorted({s for s in in_call if s not in whole})
    if bad_inside:
        raise AssertionError(f"hf_flce got lm_head.weight as {bad_inside} inside the head's call, not whole")
    for layout in set(at_step_begin):
        if scenario in ("fsdp2", "launch_fsdp2"):
            ok = layout.startswith("DTensor(Shard(dim=0),)") and not layout.endswith(f" {full_numel}")
        elif scenario == "launch_zero3":
            ok = layout == f"Parameter 0 of {full_numel}"
        else:
            ok = layout in whole
        if not ok:
            raise AssertionError(f"{scenario}: lm_head.weight at step begin is {layout}")


def run(scenario: str, tmp: str) -> dict:
    if scenario not in EXPECTED_WRAPPER:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {sorted(EXPECTED_WRAPPER)}")
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    full_numel = model.get_output_embeddings().weight.numel()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    notes = [f"world size {world}"]
    if scenario == "fsdp2":
        model = shard_like_accelerate(model)
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
    distributed_type = trainer.accelerator.distributed_type
    notes.append(
        f"distributed type {distributed_type}, average tokens across devices {args.average_tokens_across_devices}"
    )
    if args.world_size != world:
        raise AssertionError(f"the trainer sees {args.world_size} processes, the launcher started {world}")
    if scenario in EXPECTED_TYPE and distributed_type.name != EXPECTED_TYPE[scenario]:
        raise AssertionError(
            f"{scenario} needs `accelerate launch` with the {EXPECTED_TYPE[scenario]} config on GPUs; the trainer "
            f"got {distributed_type}"
        )
    with contextlib.ExitStack() as stack:
        if scenario == "launch_fsdp2":
            version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
            if version != 2:
                raise AssertionError(f"the launch config selected FSDP{version}, not FSDP2 (fsdp_version: 2)")
        if scenario == "launch_zero3":
            import deepspeed

            plugin = trainer.accelerator.state.deepspeed_plugin
            notes.append(f"deepspeed {deepspeed.__version__}")
            for config in {id(c): c for c in (plugin.deepspeed_config, plugin.hf_ds_config.config)}.values():
                zero = config["zero_optimization"]
                if zero.get("stage") != 3:
                    raise AssertionError(f"the launch config selected ZeRO stage {zero.get('stage')}, not 3")
                # Partition every parameter (the tiny head is below DeepSpeed's default persistence threshold of
                # 1e5 elements), so that the fused head has to be gathered in its call.
                zero["stage3_param_persistence_threshold"] = 0
            stack.enter_context(zero3_gradients(capture, args.max_grad_norm))
        in_call: list[str] = []
        stack.enter_context(head_weights_seen_by_flce(in_call))
        trainer.train()
    wrapper = type(trainer.model_wrapped).__name__
    notes.append(f"trained model {wrapper}")
    if "fsdp2" in scenario:
        from torch.distributed.fsdp import FSDPModule

        units = [n or "<root>" for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
        notes.append(f"FSDP2 units: {units}")
    if scenario == "launch_zero3":  # the client optimizer inside DeepSpeed's ZeRO-3 optimizer: torch's SGD
        inner = getattr(getattr(trainer.model_wrapped, "optimizer", None), "optimizer", None)
        notes.append(f"optimizer {type(trainer.model_wrapped.optimizer).__name__} around {type(inner).__name__}")
    notes.append(f"lm_head.weight at step begin: {sorted(set(capture.head_at_step_begin))}")
    notes.append(f"lm_head.weight in hf_flce's call: {sorted(set(in_call))}")
    if wrapper != EXPECTED_WRAPPER[scenario]:
        raise AssertionError(f"{scenario}: the trainer ran {wrapper}, not {EXPECTED_WRAPPER[scenario]}")
    check_head_layouts(scenario, full_numel, capture.head_at_step_begin, in_call)
    if not capture.grads:
        raise AssertionError("no gradients were captured before the first optimizer step")
    return {
        "logs": capture.logs,
        "grads": capture.grads,
        "params": full_params(trainer.model),
        "initial": initial,
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------------------------------
# Comparison with the single-process run
# --------------------------------------------------------------------------------------------------------------------


def compare(out_dir: Path, scenario: str, nproc: int) -> dict:
    """Every rank's results of ``scenario`` against ``single``: ``{"problems": [...], "worst": {kind: error},
    "notes": [...]}``. Logged values must agree to ``LOG_RTOL`` (relative error reported), tensors to
    ``TENSOR_TOL`` of each tensor's largest entry (that ratio reported)."""
    problems: list[str] = []
    worst: dict[str, float] = {}
    notes: list[str] = []

    def note_error(kind: str, error: float) -> None:
        worst[kind] = max(worst.get(kind, 0.0), error)

    want = torch.load(out_dir / "single_rank0.pt")
    if want.get("failure"):
        return {"problems": [f"the single-process reference failed:\n{want['failure']}"], "worst": {}, "notes": []}
    updates = {n: p - want["initial"][n] for n, p in want["params"].items()}
    for rank in range(nproc):
        path = out_dir / f"{scenario}_rank{rank}.pt"
        if not path.exists():
            problems.append(f"rank {rank}: no results ({path.name})")
            continue
        got = torch.load(path)
        if got.get("failure"):
            problems.append(f"rank {rank} failed:\n{got['failure']}")
            continue
        where = f"{scenario}, rank {rank}"
        if rank == 0:
            notes.extend(got["notes"])
        if not len(got["logs"]) == len(want["logs"]) == STEPS + 1:  # the steps and the summary
            problems.append(f"{where}: {len(got['logs'])} log rows, the reference has {len(want['logs'])}")
        for step, (row, ref_row) in enumerate(zip(got["logs"], want["logs"])):
            if set(row) != set(ref_row):
                problems.append(f"{where}, log {step}: keys {sorted(set(row) ^ set(ref_row))} differ")
            for key, value in ref_row.items():
                if key.endswith(UNCOMPARED_LOGS) or key not in row:
                    continue
                note_error("logs", abs(row[key] - value) / max(abs(value), 1e-30))
                if not math.isclose(row[key], value, rel_tol=LOG_RTOL, abs_tol=LOG_ATOL):
                    problems.append(f"{where}, log {step} {key}: {row[key]} != {value}")
        got_updates = {n: p - got["initial"][n] for n, p in got["params"].items()}
        for kind, ours, ref in (
            ("initial", got["initial"], want["initial"]),
            ("grads", got["grads"], want["grads"]),
            ("params", got["params"], want["params"]),
            ("updates", got_updates, updates),
        ):
            if set(ours) != set(ref) or not ref:
                problems.append(f"{where}: {kind} names differ: {sorted(set(ours) ^ set(ref))}")
                continue
            for name, value in ref.items():
                scale = value.abs().max().item()
                error = (ours[name].float() - value.float()).abs().max().item() / (scale if scale > 0 else 1.0)
                note_error(kind, error)
                if not error <= TENSOR_TOL:
                    problems.append(f"{where}: {kind} {name} off by {error:.3g} of its largest entry")
    return {"problems": problems, "worst": worst, "notes": notes}


def compare_main(argv: list[str]) -> int:
    """``compare OUT_DIR SCENARIO ... [--json FILE] [--nproc N]``: print one line per scenario, exit 1 on a
    mismatch."""
    json_path, nproc = None, 2
    if "--json" in argv:
        i = argv.index("--json")
        json_path, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2 :]
    if "--nproc" in argv:
        i = argv.index("--nproc")
        nproc, argv = int(argv[i + 1]), argv[:i] + argv[i + 2 :]
    out_dir, scenarios = Path(argv[0]), argv[1:]
    report = {}
    for scenario in scenarios:
        result = compare(out_dir, scenario, nproc)
        report[scenario] = result
        worst = ", ".join(f"{k} {v:.1e}" for k, v in result["worst"].items())
        status = "PASS" if not result["problems"] else "FAIL"
        print(f"{status} FLCESFTTrainer {scenario} vs one process: worst {worst or 'n/a'}")
        for line in result["notes"]:
            print(f"    {line}")
        for problem in result["problems"][:20]:
            print(f"    {problem}")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1))
    return int(any(r["problems"] for r in report.values()))


# --------------------------------------------------------------------------------------------------------------------


def main() -> None:
    if sys.argv[1] == "compare":
        sys.exit(compare_main(sys.argv[2:]))
    out_dir = Path(sys.argv[1])
    scenarios = sys.argv[2:]
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    rank = int(os.environ.get("RANK", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for scenario in scenarios:
        if scenario == "trainer_check":
            # distributed_trainer.py's check in this launch (one start-up less); it records its own failures.
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from distributed_trainer import run_check

            run_check(out_dir / "trainer_check")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                result = {**run(scenario, tmp), "failure": None}
            except Exception:
                failure = traceback.format_exc()
                print(f"rank {rank}, scenario {scenario} failed:\n{failure}", file=sys.stderr, flush=True)
                torch.save({"failure": failure}, out_dir / f"{scenario}_rank{rank}.pt")
                # Leaving at once makes the launcher stop the other ranks rather than let them wait in a collective.
                os._exit(1)
        torch.save(result, out_dir / f"{scenario}_rank{rank}.pt")
    faulthandler.cancel_dump_traceback_later()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
