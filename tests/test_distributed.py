"""Two-process checks (torchrun, gloo on CPU) that hf_flce gives single-process losses and gradients under DDP,
FSDP1, FSDP2, DeepSpeed ZeRO-3 and a vocabulary-parallel head. The workers live in ``distributed_workers.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).with_name("distributed_workers.py")
TRAINER = Path(__file__).with_name("distributed_trainer.py")
ROOT = WORKERS.parent.parent
NPROC = 2
TOL = 2e-5  # relative error of float32 results against the single-process reference
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

TORCH_SCENARIOS = [
    "vocab_parallel",
    "vocab_parallel_offset",
    "dtensor_head",
    "ddp",
    "ddp_defer_head_grad",
    "ddp_defer_head_grad_tied",
    "fsdp2_defer_head_grad",
    "fsdp2_head_unit_defer_head_grad_refused",
    "fsdp2",
    "fsdp2_head_unit",
    "fsdp2_tied",
    "fsdp2_per_token",
    "fsdp1",
    "fsdp1_orig_params_head_unit",
    "fsdp1_per_token",
    "fsdp1_defer_head_grad_refused",
]
ZERO3_SCENARIOS = ["zero3", "zero3_per_token"]


def launch(command: list[str], out_dir: Path, args: list[str] = (), extra_env: dict[str, str] | None = None):
    """Run ``*command OUT_DIR *args`` in one ``torchrun`` of NPROC processes; each rank's results by rank."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(extra_env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}"]
    proc = subprocess.run([*cmd, *command, str(out_dir), *args], env=env, capture_output=True, text=True, timeout=600)
    files = sorted(out_dir.glob("rank*.json"))
    if proc.returncode != 0 or len(files) != NPROC:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in files}


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory) -> dict[int, dict]:
    return launch([str(WORKERS)], tmp_path_factory.mktemp("dist"), TORCH_SCENARIOS)


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory) -> dict[int, dict]:
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    env = {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}
    return launch([str(WORKERS)], tmp_path_factory.mktemp("zero3"), ZERO3_SCENARIOS, env)


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory) -> dict[int, dict]:
    # torchrun sets the environment accelerate reads (accelerate launch on CPU starts one process without MPI).
    return launch([str(TRAINER), "check"], tmp_path_factory.mktemp("trainer"))


def assert_scenario(results: dict[int, dict], name: str) -> None:
    for rank, by_name in results.items():
        result = by_name[name]
        assert result["failure"] is None, f"rank {rank}:\n{result['failure']}"
        assert result["errors"], f"rank {rank}: nothing was compared"
        bad = {k: v for k, v in result["errors"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("name", TORCH_SCENARIOS)
def test_torch_engines(torch_results, name):
    assert_scenario(torch_results, name)


@pytest.mark.parametrize("name", ZERO3_SCENARIOS)
def test_deepspeed_zero3(zero3_results, name):
    assert_scenario(zero3_results, name)


def test_trainer_ddp(trainer_results):
    """HF Trainer (DDP, gloo) on a patched model: logged loss and gradients equal one process on the whole batch."""
    assert_scenario(trainer_results, "trainer")


def test_head_call_matches_op_and_restores_forward():
    """In one process the head call is the plain op; the head's forward is restored, also after an error."""
    from hf_flce import fused_linear_cross_entropy
    from hf_flce.distributed import head_linear_cross_entropy

    head = torch.nn.Linear(16, 40)
    hidden, target = torch.randn(3, 5, 16), torch.randint(0, 40, (3, 5))
    loss, stats = head_linear_cross_entropy(head, hidden, target, return_stats=True, label_smoothing=0.1)
    want, want_stats = fused_linear_cross_entropy(
        hidden, head.weight, target, head.bias, return_stats=True, label_smoothing=0.1
    )
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(stats.entropy, want_stats.entropy)
    assert "forward" not in head.__dict__
    with pytest.raises(ValueError, match="target shape"):
        head_linear_cross_entropy(head, hidden, target[:, :2])
    assert "forward" not in head.__dict__
    torch.testing.assert_close(head(hidden), torch.nn.functional.linear(hidden, head.weight, head.bias))


def test_head_call_upcast_under_autocast():
    from hf_flce.distributed import head_linear_cross_entropy

    head = torch.nn.Linear(16, 40).to(torch.bfloat16)
    hidden, target = torch.randn(6, 16, dtype=torch.bfloat16), torch.randint(0, 40, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head_linear_cross_entropy(head, hidden, target, upcast=True)
    want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, head.weight, head.bias).float(), target)
    torch.testing.assert_close(loss, want, atol=1e-2, rtol=1e-2)


def test_head_call_refuses_non_linear_heads():
    from hf_flce.distributed import head_linear_cross_entropy, linear_of

    head = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert linear_of(head) is None
    with pytest.raises(ValueError, match="not a plain linear head"):
        head_linear_cross_entropy(head, torch.randn(2, 8), torch.zeros(2, dtype=torch.long))


def test_vocab_parallel_rejects_bad_calls():
    from hf_flce.distributed import vocab_parallel_linear_cross_entropy

    x, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        vocab_parallel_linear_cross_entropy(x, w, y, process_group=None, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_linear_cross_entropy(x, w, y, process_group=None, reduction="avg")
    with pytest.raises(TypeError):
        vocab_parallel_linear_cross_entropy(x, w, y, process_group=None, class_weight=torch.ones(10))
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="initialised"):
            vocab_parallel_linear_cross_entropy(x, w, y, process_group=None)


@pytest.mark.distributed
def test_flce_sft_trainer_matches_one_process(tmp_path):
    """FLCESFTTrainer with batch B on each of two ranks (DDP as accelerate sets it up from torchrun's environment, and
    FSDP2 laid out by accelerate's ``fsdp2_prepare_model``) against one process with batch 2B: every logged value of
    three SGD steps to rtol 1e-5; the gradients before the first step, the final parameters and their updates to 1e-4
    of each tensor's largest entry; where ``lm_head.weight`` is a DTensor (FSDP2, outside its call) and that hf_flce gets
    it whole. The worker and the comparison are in ``distributed_sft.py``."""
    import signal

    worker = Path(__file__).with_name("distributed_sft.py")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("OMP_NUM_THREADS", "1")

    def run_worker(prefix: list[str], scenarios: list[str], timeout: int, one_gpu: bool = False) -> None:
        # A session of its own, so that a timeout ends torchrun's workers too; the worker itself dumps its stacks and
        # exits after HANG_S (below this timeout), and a failing rank makes torchrun stop the others. One process
        # sees one GPU: with several, Trainer would wrap the model in nn.DataParallel.
        proc = subprocess.Popen(
            [*prefix, str(worker), str(tmp_path), *scenarios],
            env={**env, "CUDA_VISIBLE_DEVICES": "0"} if one_gpu and torch.cuda.is_available() else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"{' '.join(scenarios)} did not finish in {timeout} s:\n{output[-8000:]}")
        failures = [torch.load(f)["failure"] for f in sorted(tmp_path.glob("*_rank*.pt"))]
        failures = [f for f in failures if f]
        if proc.returncode != 0 or failures:
            pytest.fail(f"{' '.join(scenarios)} failed ({proc.returncode}):\n{''.join(failures)}\n{output[-8000:]}")

    run_worker([sys.executable], ["single"], timeout=300, one_gpu=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}"]
    scenarios = ["ddp", "fsdp2"]
    run_worker(torchrun, scenarios, timeout=300)

    import distributed_sft

    for scenario in scenarios:
        report = distributed_sft.compare(tmp_path, scenario, NPROC)
        assert not report["problems"], f"{scenario} ({'; '.join(report['notes'])}):\n" + "\n".join(report["problems"])
