"""Multi-process checks of hf_flce under DDP, FSDP1, FSDP2, DeepSpeed ZeRO-3 and a vocabulary-parallel head.

Launched by ``tests/test_distributed.py`` (and ``scripts/distributed_gpu.sh``) as

    torchrun --nproc_per_node 2 tests/distributed_workers.py OUT_DIR [SCENARIO ...]

Every rank builds the same tiny model and batch from one seed, computes a single-process reference on the whole batch
with stock PyTorch / transformers code (no hf_flce), then runs its half of the batch through the engine with hf_flce
and compares the loss and the gradients. Each rank writes ``OUT_DIR/rank{r}.json``:
``{scenario: {"errors": {check: relative error}, "notes": [...], "failure": traceback or null}}``.
The backend is NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SCENARIOS: dict[str, Callable[[dict], None]] = {}
VOCAB, HIDDEN, BATCH, SEQ = 96, 32, 4, 12


def scenario(fn: Callable[[dict], None]) -> Callable[[dict], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (absolute when ``want`` is 0)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    den = want.norm().item()
    return (got - want).norm().item() / (den if den > 0 else 1.0)


def check(result: dict, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    result["errors"][name] = rel_err(got, want)


def my_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous share of the batch dimension."""
    return t.chunk(world())[rank()]


# --------------------------------------------------------------------------------------------------------------------
# Models and data
# --------------------------------------------------------------------------------------------------------------------


def llama(tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).to(device())
    if tied:
        model.tie_weights()
    return model.train()


def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with a prompt of a different length in every row (so the ranks hold different token
    counts, as with prompt masking)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    for row in range(BATCH):
        labels[row, : 2 + 3 * row] = -100
    return ids.to(device()), labels.to(device())


def global_items(labels: torch.Tensor) -> torch.Tensor:
    """What ``Trainer`` passes as ``num_items_in_batch`` with ``average_tokens_across_devices``: the label count
    (after the shift) summed over ranks."""
    count = (labels[:, 1:] != -100).sum().to(torch.float32)
    dist.all_reduce(count)
    return count


def reference_lm(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stock loss (mean over the whole batch) and gradients of an unpatched copy on one process."""
    ref = copy.deepcopy(model)
    ids, labels = lm_batch()
    loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def sharded_lm_step(model: nn.Module, backward: Callable = torch.Tensor.backward) -> torch.Tensor:
    """This rank's half of the batch through ``model`` (patched, wrapped by an engine), scaled as ``Trainer`` scales
    it, ``backward``; returns the whole batch's loss (all ranks)."""
    ids, labels = lm_batch()
    ids, labels = my_rows(ids), my_rows(labels)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=global_items(labels))
    assert out.logits is None, "the fused path was not taken"
    # The engines average gradients over ranks; Trainer multiplies by the world size to undo it.
    backward(out.loss * world())
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    return loss


def compare_lm(result: dict, loss, ref_loss, grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]):
    check(result, "loss", loss, ref_loss)
    missing = set(ref_grads) - set(grads)
    if missing:
        raise AssertionError(f"no gradient for {sorted(missing)}")
    for name, want in ref_grads.items():
        check(result, f"grad {name}", grads[name], want)


def flce(model: nn.Module, **options) -> nn.Module:
    from hf_flce import apply_flce

    return apply_flce(model, **options)


class HeadModel(nn.Module):
    """Embedding, one hidden layer and a biased head whose loss is per-token (``reduction="none"``) with a gradient
    through the entropy: the op recomputes the logits in backward, so the head's weight is needed there too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed(ids)))

    def forward(self, ids: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
        from hf_flce.distributed import head_linear_cross_entropy

        loss, stats = head_linear_cross_entropy(
            self.head, self.hidden(ids), target, reduction="none", return_stats=True, memory_budget=2048
        )
        return ((loss + 0.5 * stats.entropy) * token_weights(target)).sum() * scale


def token_weights(target: torch.Tensor) -> torch.Tensor:
    return (target % 3 + 1).to(torch.float32)


def head_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (8, 5), generator=gen)
    target = torch.randint(0, VOCAB, (8, 5), generator=gen)
    target[::3, 1] = -100
    return ids.to(device()), target.to(device())


def reference_head(model: HeadModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model)
    ids, target = head_batch()
    logits = ref.head(ref.hidden(ids)).float()
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    valid = target != -100
    nll = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)
    loss = (((nll + 0.5 * entropy) * valid) * token_weights(target)).sum() / target.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def sharded_head_step(model: nn.Module, backward: Callable = torch.Tensor.backward) -> torch.Tensor:
    ids, target = head_batch()
    # Sum over this rank's tokens / all tokens, times the world size the engines average over.
    loss = model(my_rows(ids), my_rows(target), world() / target.numel())
    backward(loss)
    total = loss.detach() / world()
    dist.all_reduce(total)
    return total


# --------------------------------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------------------------------


VP_CASES = {
    "mean_bias": dict(bias=True),
    "sum_smooth_zloss_softcap_temp_chunked": dict(
        reduction="sum",
        label_smoothing=0.1,
        z_loss=1e-3,
        softcap=5.0,
        temperature=0.7,
        memory_budget=1024,
        stats_grad=True,
        explicit_start=True,
    ),
    "none_stats_grads": dict(reduction="none", ignore_index=-1, stats_grad=True, bias=True),
    "num_items_in_batch": dict(num_items_in_batch=40.0, label_smoothing=0.2),
    "all_ignored": dict(all_ignored=True, stats_grad=True),
    # The scalar loss forms dX and dW in forward, with collectives per chunk: the 19- and 18-row shards must take the
    # same chunks (900 bytes: 2 rows against 3 if each planned by its own rows); then a second backward recomputes.
    "mean_chunked_uneven_twice": dict(memory_budget=900, stats_grad=True, bias=True, twice=True),
}
VP_TOKENS, VP_VOCAB = 23, 37


def vp_inputs(case: dict):
    gen = torch.Generator().manual_seed(3)
    ignore = case.get("ignore_index", -100)
    x = torch.randn(VP_TOKENS, HIDDEN, generator=gen)
    w = torch.randn(VP_VOCAB, HIDDEN, generator=gen) * 0.3
    b = torch.randn(VP_VOCAB, generator=gen) if case.get("bias") else None
    y = torch.randint(0, VP_VOCAB, (VP_TOKENS,), generator=gen)
    y[::4] = ignore
    if case.get("all_ignored"):
        y[:] = ignore
    up = torch.randn(3, VP_TOKENS, generator=gen)
    return [t if t is None else t.to(device()) for t in (x, w, b, y, up)]


def vp_objective(loss, stats, up: torch.Tensor, case: dict) -> torch.Tensor:
    total = (loss * up[0]).sum() if loss.dim() else loss
    if case.get("stats_grad"):
        total = total + (stats.logprobs * up[1]).sum() + (stats.entropy * up[2]).sum()
    return total


def vp_run(op, x, w, b, y, up, case: dict, **extra):
    options = {k: case[k] for k in ("reduction", "ignore_index", "label_smoothing", "z_loss", "softcap") if k in case}
    options.update({k: case[k] for k in ("temperature", "memory_budget", "num_items_in_batch") if k in case})
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    loss, stats = op(leaves[0], leaves[1], y, leaves[2], return_stats=True, **options, **extra)
    objective = vp_objective(loss, stats, up, case)
    for _ in range(2 if case.get("twice") else 1):
        objective.backward(retain_graph=True)
    return loss, stats, leaves


@scenario
def vocab_parallel(result: dict) -> None:
    """The vocabulary-parallel op on uneven shards against the single-device op on the whole head."""
    from hf_flce import fused_linear_cross_entropy
    from hf_flce.distributed import vocab_parallel_linear_cross_entropy

    for name, case in VP_CASES.items():
        x, w, b, y, up = vp_inputs(case)
        ref_loss, ref_stats, ref_leaves = vp_run(fused_linear_cross_entropy, x, w, b, y, up, case, backend="torch")
        shard = slice(*((0, 19) if rank() == 0 else (19, VP_VOCAB)))
        w_local, b_local = w[shard], None if b is None else b[shard]
        start = {"vocab_start": shard.start} if case.get("explicit_start") else {}
        loss, stats, leaves = vp_run(
            vocab_parallel_linear_cross_entropy, x, w_local, b_local, y, up, case, process_group=None, **start
        )
        check(result, f"{name} loss", loss, ref_loss)
        for field in ("logprobs", "entropy", "lse", "mean_logit", "log_sum_sq_probs"):
            check(result, f"{name} {field}", getattr(stats, field), getattr(ref_stats, field))
        check(result, f"{name} is_top1", stats.is_top1.float(), ref_stats.is_top1.float())
        check(result, f"{name} grad hidden", leaves[0].grad, ref_leaves[0].grad)
        check(result, f"{name} grad weight shard", leaves[1].grad, ref_leaves[1].grad[shard])
        if b is not None:
            check(result, f"{name} grad bias shard", leaves[2].grad, ref_leaves[2].grad[shard])
    # A backward that reaches the op with no gradient (a Function after it gives the loss none) lets the dX and dW
    # formed in forward go, though the caller keeps the loss.
    x, w, _, y, _ = vp_inputs({})
    shard = slice(*((0, 19) if rank() == 0 else (19, VP_VOCAB)))
    x, w_local = x.requires_grad_(), w[shard].clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x, w_local, y, process_group=None)
    _GradientToTheSecondOnly.apply(loss, torch.zeros((), device=x.device, requires_grad=True)).backward()
    if loss.grad_fn.eager_grads is not None or x.grad is not None or w_local.grad is not None:
        raise AssertionError("the vocabulary-parallel op kept its dX and dW after a backward that gave it no gradient")


@scenario
def vocab_parallel_offset(result: dict) -> None:
    """The vocabulary-parallel op in float32 at logits sharing an offset of 168 (``offset_utils``): the value, dX and
    this shard's dW against float64 are within 1.5x stock float32's error (+1e-6), with the lse formed as a pair
    from the shards' maxima and sums, and a per-token backward recomputing its logits by the forward's chunks. With
    one float32 lse formed from the shards' lse they were 20-565x stock's. Each check is the excess over that bound
    (0 when met)."""
    from offset_utils import offset_errors

    from hf_flce.distributed import vocab_parallel_linear_cross_entropy

    shard = slice(*((0, 480) if rank() == 0 else (480, 1000)))

    def ours(output: str, budget: int | None):
        def call(x, w, y):
            x, w, y = x.to(device()), w[shard].to(device()), y.to(device())
            options = dict(process_group=None, memory_budget=budget)
            if output == "mean":
                return vocab_parallel_linear_cross_entropy(x, w, y, **options).cpu()
            loss, stats = vocab_parallel_linear_cross_entropy(x, w, y, reduction="none", return_stats=True, **options)
            return {"loss": loss, "logprob": stats.logprobs, "entropy": stats.entropy}[output].cpu()

        return call

    for output in ("mean", "loss", "logprob", "entropy"):
        for peak in (0.0, 14.0):
            for budget in (None, 20000):  # 20000 bytes: row chunks of two rows, recomputed in backward
                torch.manual_seed(11)  # the same problem on every rank
                errors = offset_errors(output, peak, ours(output, budget), weight_rows=shard)
                case = f"{output} {'peaked' if peak else 'flat'} budget={budget}"
                for what, got, stock in zip(("value", "dX", "dW shard"), errors["ours"], errors["stock"]):
                    check_excess = max(0.0, got - (1.5 * stock + 1e-6))
                    result["errors"][f"{case} {what} ({got:.2e} vs stock {stock:.2e})"] = check_excess


class _GradientToTheSecondOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return first.detach() + second

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


@scenario
def dtensor_head(result: dict) -> None:
    """A head whose weight is a DTensor (tensor parallelism): Shard(0) takes the vocabulary-parallel op, Replicate
    is gathered; the loss and the DTensor gradients equal a plain head's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hf_flce.distributed import head_linear_cross_entropy

    mesh = init_device_mesh(device().type, (world(),))
    case = {"stats_grad": True, "bias": True}
    x, w, b, y, up = vp_inputs(case)
    for name, placement in (("shard0", Shard(0)), ("replicate", Replicate())):
        plain = nn.Linear(HIDDEN, VP_VOCAB).to(device())
        dtensor = nn.Linear(HIDDEN, VP_VOCAB).to(device())
        with torch.no_grad():
            plain.weight.copy_(w)
            plain.bias.copy_(b)
        dtensor.weight = nn.Parameter(distribute_tensor(w, mesh, [placement]))
        dtensor.bias = nn.Parameter(distribute_tensor(b, mesh, [placement]))
        for head in (plain, dtensor):
            loss, stats = head_linear_cross_entropy(head, x, y, return_stats=True)
            vp_objective(loss, stats, up, case).backward()
            head.loss = loss.detach()
        check(result, f"{name} loss", dtensor.loss, plain.loss)
        check(result, f"{name} grad weight", dtensor.weight.grad.full_tensor(), plain.weight.grad)
        check(result, f"{name} grad bias", dtensor.bias.grad.full_tensor(), plain.bias.grad)


def _ddp(result: dict, tied: bool = False, **options) -> None:
    model = llama(tied)
    ref_loss, ref_grads = reference_lm(model)
    wrapped = nn.parallel.DistributedDataParallel(flce(model, **options))
    loss = sharded_lm_step(wrapped)
    compare_lm(result, loss, ref_loss, {n: p.grad for n, p in model.named_parameters()}, ref_grads)


@scenario
def ddp(result: dict) -> None:
    """A patched model under DistributedDataParallel."""
    _ddp(result)


@scenario
def ddp_defer_head_grad(result: dict) -> None:
    """``defer_head_grad=True`` under DDP: lm_head's gradient, ready last, is still averaged over the ranks."""
    _ddp(result, defer_head_grad=True)


@scenario
def ddp_defer_head_grad_tied(result: dict) -> None:
    """The same with the head tied to the embedding: DDP sums the two contributions before averaging."""
    _ddp(result, tied=True, defer_head_grad=True)


@scenario
def fsdp2_defer_head_grad(result: dict) -> None:
    """``defer_head_grad=True`` under FSDP2 with the head in the root unit, which stays unsharded until the end of
    the backward: single-process gradients."""
    _fsdp2(result, False, False, defer_head_grad=True)


@scenario
def fsdp2_head_unit_defer_head_grad_refused(result: dict) -> None:
    """``defer_head_grad=True`` with the head its own FSDP2 unit: its weight is a sharded DTensor when the forward
    starts, so the forward raises a ValueError naming the option (checked as a zero error)."""
    from torch.distributed.fsdp import fully_shard

    model = flce(llama(), defer_head_grad=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    _check_defer_refused(result, model)


def _check_defer_refused(result: dict, wrapped: nn.Module) -> None:
    """The forward of ``wrapped`` (patched with ``defer_head_grad=True``) raises the option's ValueError."""
    ids, labels = lm_batch()
    try:
        wrapped(input_ids=my_rows(ids), labels=my_rows(labels))
    except ValueError as err:
        refused = "defer_head_grad=True needs lm_head's weight whole" in str(err)
    else:
        refused = False
    check(result, "refused", torch.tensor(float(refused)), torch.tensor(1.0))


def _fsdp2(result: dict, tied: bool, head_unit: bool, **options) -> None:
    from torch.distributed.fsdp import fully_shard

    model = llama(tied)
    ref_loss, ref_grads = reference_lm(model)
    flce(model, **options)
    for layer in model.model.layers:
        fully_shard(layer)
    if head_unit:  # the head in its own unit: its weight is a sharded DTensor outside its own call
        fully_shard(model.lm_head)
    fully_shard(model)
    result["notes"].append(f"lm_head.weight outside forward: {type(model.lm_head.weight).__name__}")
    loss = sharded_lm_step(model)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    compare_lm(result, loss, ref_loss, grads, ref_grads)


@scenario
def fsdp2(result: dict) -> None:
    _fsdp2(result, tied=False, head_unit=False)


@scenario
def fsdp2_head_unit(result: dict) -> None:
    _fsdp2(result, tied=False, head_unit=True)


@scenario
def fsdp2_tied(result: dict) -> None:
    _fsdp2(result, tied=True, head_unit=False)


@scenario
def fsdp2_per_token(result: dict) -> None:
    """The per-token path (logits recomputed in backward) with the head its own FSDP2 unit."""
    from torch.distributed.fsdp import fully_shard

    model = HeadModel().to(device())
    ref_loss, ref_grads = reference_head(model)
    fully_shard(model.head)
    fully_shard(model)
    loss = sharded_head_step(model)
    compare_lm(result, loss, ref_loss, {n: p.grad.full_tensor() for n, p in model.named_parameters()}, ref_grads)


def _fsdp1_grads(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients of an FSDP1 model (flat parameters hide ``.grad`` of the original ones when
    ``use_orig_params=False``): zero the parameters, take one SGD step of lr 1, and read ``-grad`` back."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with torch.no_grad():
        for p in wrapped.parameters():
            p.zero_()
    torch.optim.SGD(wrapped.parameters(), lr=1.0).step()
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
        return {k: -v.detach() for k, v in wrapped.state_dict().items()}


def _fsdp1(result: dict, model: nn.Module, reference, step, use_orig_params: bool, wrap: set[type]) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    ref_loss, ref_grads = reference(model)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(wrap), device_id=device(), use_orig_params=use_orig_params)
    loss = step(wrapped)
    grads = _fsdp1_grads(wrapped)
    compare_lm(result, loss, ref_loss, {k: grads[k] for k in ref_grads}, ref_grads)


def _llama_layer() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


@scenario
def fsdp1(result: dict) -> None:
    """FSDP1, head in the root unit, flat parameters (``use_orig_params=False``)."""
    _fsdp1(result, flce(llama()), reference_lm, sharded_lm_step, False, {_llama_layer()})


@scenario
def fsdp1_orig_params_head_unit(result: dict) -> None:
    """FSDP1 with ``use_orig_params=True`` and every Linear (the head too) its own unit."""
    _fsdp1(result, flce(llama()), reference_lm, sharded_lm_step, True, {_llama_layer(), nn.Linear})


@scenario
def fsdp1_defer_head_grad_refused(result: dict) -> None:
    """``defer_head_grad=True`` under FSDP1 (flat parameters: the head's weight is a view of the root's flat
    parameter in the forward, which FSDP frees and regathers): refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = flce(llama(), defer_head_grad=True)
    _check_defer_refused(result, FSDP(model, auto_wrap_policy=ModuleWrapPolicy({_llama_layer()}), device_id=device()))


@scenario
def fsdp1_per_token(result: dict) -> None:
    """The per-token path with the head its own FSDP1 unit (resharded after forward, unsharded again in backward)."""
    _fsdp1(result, HeadModel().to(device()), reference_head, sharded_head_step, False, {nn.Linear})


def _zero3(result: dict, model: nn.Module, reference, step, head: Callable[[nn.Module], nn.Module]) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    ref_loss, ref_grads = reference(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    # torch's SGD: DeepSpeed's own optimizers are compiled ops, which a wheel without them would build with nvcc.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    result["notes"].append(f"backend {dist.get_backend()}, engine device {engine.device}")
    if torch.cuda.is_available() and (dist.get_backend() != "nccl" or engine.device != device()):
        raise AssertionError(f"ZeRO-3 on GPU should run NCCL on {device()}: {result['notes'][-1]}")
    numel = head(engine.module).weight.numel()
    result["notes"].append(f"head weight numel outside forward: {numel}")
    if numel != 0:
        raise AssertionError("ZeRO-3 did not partition the head; the test would not exercise the gather")
    loss = step(engine, engine.backward)
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    compare_lm(result, loss, ref_loss, grads, ref_grads)


@scenario
def zero3(result: dict) -> None:
    """DeepSpeed ZeRO-3: the head's weight is partitioned to numel 0 outside its module's hooks."""
    _zero3(result, flce(llama()), reference_lm, sharded_lm_step, lambda m: m.lm_head)


@scenario
def zero3_per_token(result: dict) -> None:
    """ZeRO-3 with the per-token path: the head is gathered again in backward to recompute the logits."""
    _zero3(result, HeadModel().to(device()), reference_head, sharded_head_step, lambda m: m.head)


# --------------------------------------------------------------------------------------------------------------------


def main() -> None:
    out_dir = Path(sys.argv[1])
    names = sys.argv[2:] or list(SCENARIOS)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    results = {}
    for name in names:
        result = {"errors": {}, "notes": [], "failure": None}
        try:
            SCENARIOS[name](result)
        except Exception:
            result["failure"] = traceback.format_exc()
        results[name] = result
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    # Every result is on disk and every rank passed the barrier. Skip the interpreter's teardown: a gloo/FSDP worker
    # thread still being destroyed there once aborted a rank ("terminate called without an active exception") after
    # a clean run, which failed the whole launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
