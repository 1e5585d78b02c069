"""Public API: the fused ``lm_head`` + cross-entropy op, its module form and the per-token statistics."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from .backends import resolve_backend
from .backends.base import TileParams
from .engine import CallPlan, FusedLinearCrossEntropyFunction, SavedForWeightGrad, forward_without_grad
from .options import FLCEOptions, check_num_items, check_tensors, stats_request


@dataclass
class FLCEStats:
    """Per-token statistics in the shape of ``target``; 0 (False) at ignored positions.

    All are computed on the transformed logits (after softcap and temperature).
    ``logprobs`` (log p(target)) and ``entropy`` are differentiable, and their gradients flow through the fused
    backward; ``lse`` (log-sum-exp), ``is_top1`` (target is the first argmax), ``mean_logit`` and
    ``log_sum_sq_probs`` (``log sum_j p_j**2``, the WPO weight of TRL's DPO) are not.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    is_top1: torch.Tensor
    mean_logit: torch.Tensor
    log_sum_sq_probs: torch.Tensor


def loss_denominator(valid_rows_weight, opts: FLCEOptions, num_items_in_batch, device) -> torch.Tensor | None:
    """The scalar loss is ``sum / denominator``: num_items_in_batch, 1 for ``sum``, the (class-weighted) count of
    non-ignored targets for ``mean`` (``valid_rows_weight``, read only then); None for ``reduction="none"``."""
    if num_items_in_batch is not None:
        den = torch.as_tensor(num_items_in_batch, device=device).to(torch.float32).reshape(())
    elif opts.reduction == "sum":
        den = torch.ones((), dtype=torch.float32, device=device)
    elif opts.reduction == "mean":
        den = valid_rows_weight
    else:
        return None
    # Nothing to average over (every label ignored, a zero num_items_in_batch, class weights 0 at every target): the
    # loss and its gradients are 0, not NaN, and not an undivided sum either. Dividing by inf gives that.
    return den.masked_fill(den == 0, float("inf"))


# torch.compile runs the op eagerly (one graph break): its chunk loop sizes GEMMs from the data, which a traced graph
# would have to re-specialise on every batch.
@torch.compiler.disable
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    return_stats: bool | Collection[str] = False,
    backend: str = "auto",
    memory_budget: int | None = None,
    prob_weighted: bool = False,
    save_for_weight_grad: Callable[[SavedForWeightGrad], None] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, FLCEStats]:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target`` without materialising the logits.

    Equal to ``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` (logits transformed by
    ``softcap * tanh(z / softcap)`` then divided by ``temperature``), plus ``z_loss * lse**2`` on every non-ignored
    token. Only ``memory_budget`` bytes of logits (default 1 GiB on accelerators, 256 MiB on CPU, or the
    ``HF_FLCE_MEMORY_BUDGET`` environment variable) are alive at once.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16.
        weight: ``[V, H]``, the ``lm_head`` weight, same dtype as ``hidden`` (or any float dtype under autocast).
        target: integer tensor of shape ``hidden.shape[:-1]``; ``ignore_index`` entries are skipped.
        bias: optional ``[V]``.
        reduction: ``"mean"`` (over non-ignored tokens, class-weighted), ``"sum"`` or ``"none"``.
        num_items_in_batch: HF gradient accumulation: the loss is ``sum / num_items_in_batch``.
        label_smoothing, class_weight: as ``torch.nn.functional.cross_entropy``'s ``label_smoothing`` and ``weight``.
        z_loss: coefficient of the PaLM z-loss ``lse**2``.
        softcap, temperature: logit transforms, softcap first.
        return_stats: also return an :class:`FLCEStats`: ``True`` for every field, or a collection of the field names
            the caller reads (``{"entropy", "is_top1"}``), which lets the GEMM-epilogue path skip the others
            (``logprobs`` and ``lse`` are always there; a field not named may come back as zeros).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"ascend"``.
        memory_budget: bytes of logits alive at once.
        prob_weighted: multiply each token's loss by its detached target probability ``exp(logprobs)`` (DFT, as
            TRL's ``loss_type="dft"``). Needs a scalar reduction; the gradient is still formed during forward.
        save_for_weight_grad: for a caller that computes the weight's gradient later, at a moment of its choosing
            (``apply_flce(..., defer_head_grad=True)`` does, at the end of the backward). Pass ``weight`` detached;
            a forward that computes gradients (those of ``hidden`` or ``bias``) calls this once with an
            :class:`hf_flce.engine.SavedForWeightGrad`, whose ``weight_grad(g)`` returns dW for the loss's upstream
            gradient ``g``. Needs a scalar reduction.

    Returns:
        The loss (0-d, or the shape of ``target`` for ``reduction="none"``, float32), and the stats if asked.

    Example:
        >>> import torch, hf_flce
        >>> hidden = torch.randn(2, 5, 16, requires_grad=True)
        >>> weight = torch.randn(100, 16, requires_grad=True)
        >>> target = torch.randint(0, 100, (2, 5))
        >>> target[0, :2] = -100
        >>> loss = hf_flce.fused_linear_cross_entropy(hidden, weight, target)
        >>> loss.backward()
        >>> ref = torch.nn.functional.cross_entropy((hidden @ weight.T).flatten(0, 1), target.flatten())
        >>> torch.allclose(loss, ref, atol=1e-5)
        True
    """
    opts = FLCEOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        memory_budget=memory_budget,
    )
    wanted_stats = stats_request(return_stats)
    if not isinstance(prob_weighted, bool):
        raise TypeError(f"prob_weighted must be a bool, got {type(prob_weighted).__name__}")
    if prob_weighted and reduction == "none" and num_items_in_batch is None:
        raise ValueError(
            "prob_weighted=True needs a scalar reduction ('mean', 'sum' or num_items_in_batch); with reduction='none' "
            "weight the per-token loss yourself with stats.logprobs.exp().detach()"
        )
    check_num_items(num_items_in_batch, reduction)
    if save_for_weight_grad is not None:
        if not callable(save_for_weight_grad):
            raise TypeError(f"save_for_weight_grad must be callable, got {type(save_for_weight_grad).__name__}")
        if reduction == "none" and num_items_in_batch is None:
            raise ValueError("save_for_weight_grad needs a scalar reduction ('mean', 'sum' or num_items_in_batch)")
        if isinstance(weight, torch.Tensor) and weight.requires_grad:
            raise ValueError("save_for_weight_grad needs the weight detached: its gradient is the caller's to compute")

    compute_dtype = None
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(hidden.device.type):
        # The GEMMs run in the autocast dtype, as F.linear's would; the gradients come back in the inputs' own
        # dtypes (an fp32 master weight receives its fp32 accumulator unrounded).
        compute_dtype = torch.get_autocast_dtype(hidden.device.type)
    check_tensors(hidden, weight, target, bias, class_weight, mixed_dtypes=compute_dtype is not None)

    tiles = resolve_backend(backend, hidden.device)
    vocab, size = weight.shape
    x = hidden.reshape(-1, size)
    # int64 with unit stride, which the kernels index by (a strided view such as labels[::2] is copied once)
    y = target.reshape(-1).long().contiguous()
    cw = cw_sum = None
    if class_weight is not None:
        cw = class_weight.detach().to(torch.float32).contiguous()
        cw_sum = cw.sum()

    device = x.device

    # Holds no reference to x: the plan outlives the forward (autograd keeps it until backward), and x is the
    # model's last hidden state, which a per-token backward does not need whole.
    @functools.cache
    def denominator() -> torch.Tensor | None:
        valid_weight = None
        if num_items_in_batch is None and opts.reduction == "mean":
            valid = y != opts.ignore_index
            if cw is None:
                valid_weight = valid.sum(dtype=torch.float32)
            else:
                valid_weight = torch.where(valid, cw[torch.where(valid, y, 0).clamp(0, vocab - 1)], 0.0).sum()
        return loss_denominator(valid_weight, opts, num_items_in_batch, device)

    params = TileParams(
        vocab=vocab,
        ignore_index=opts.ignore_index,
        label_smoothing=float(opts.label_smoothing),
        z_loss=float(opts.z_loss),
        softcap=None if opts.softcap is None else float(opts.softcap),
        inv_temperature=1.0 / float(opts.temperature),
        class_weight=cw,
        class_weight_sum=cw_sum,
        optional_stats=wanted_stats or frozenset(),
    )
    plan = CallPlan(
        tiles=tiles,
        params=params,
        reduction="none" if reduction == "none" and num_items_in_batch is None else "scalar",
        denominator=denominator,
        budget=opts.budget_bytes(x.device),
        grad_mode=torch.is_grad_enabled(),
        compute_dtype=compute_dtype,
        prob_weighted=prob_weighted,
        want_stats=wanted_stats is not None,
        save_for_weight_grad=save_for_weight_grad,
    )
    needs_grad = plan.grad_mode and any(t is not None and t.requires_grad for t in (x, weight, bias))
    # the GEMMs run in compute_dtype: autocast must not recast them inside
    no_autocast = torch.autocast(x.device.type, enabled=False) if compute_dtype is not None else nullcontext()
    with no_autocast:
        if needs_grad:
            outputs = FusedLinearCrossEntropyFunction.apply(x, weight, bias, y, plan)
        else:
            outputs = forward_without_grad(x, weight, bias, y, plan)
    loss, logprobs, entropy, lse, is_top1, mean_logit, log_sum_sq_probs = outputs
    if plan.reduction == "none":
        loss = loss.reshape(target.shape)
    if wanted_stats is None:
        return loss
    shape = target.shape
    stats = FLCEStats(
        logprobs=logprobs.reshape(shape),
        entropy=entropy.reshape(shape),
        lse=lse.reshape(shape),
        is_top1=is_top1.reshape(shape),
        mean_logit=mean_logit.reshape(shape),
        log_sum_sq_probs=log_sum_sq_probs.reshape(shape),
    )
    return loss, stats


class FusedLinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`; the keyword options are fixed at construction.

    Example:
        >>> import torch, hf_flce
        >>> loss_fn = hf_flce.FusedLinearCrossEntropyLoss(label_smoothing=0.1)
        >>> hidden, weight = torch.randn(8, 16), torch.randn(50, 16)
        >>> loss = loss_fn(hidden, weight, torch.randint(0, 50, (8,)))
        >>> loss.shape
        torch.Size([])
    """

    def __init__(self, **options) -> None:
        super().__init__()
        allowed = {
            name
            for name, param in inspect.signature(fused_linear_cross_entropy).parameters.items()
            if param.kind is inspect.Parameter.KEYWORD_ONLY
        }
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        self.options = options

    def forward(self, hidden, weight, target, bias=None, **overrides):
        return fused_linear_cross_entropy(hidden, weight, target, bias, **{**self.options, **overrides})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
