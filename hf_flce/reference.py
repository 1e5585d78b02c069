"""The materialised reference: exactly what the fused op computes, written with full logits.

It defines the semantics that every backend is tested against (in float64 by the tests):
``F.cross_entropy(F.linear(hidden, weight, bias)`` with softcap, then temperature, applied to the logits, plus the
z-loss term ``z_loss * lse**2`` on each non-ignored token. ``mean`` divides the summed loss by the summed class
weight of the non-ignored targets (the token count without class weights), as ``F.cross_entropy`` does; when nothing
is left to average over (a denominator of 0) the loss is 0, not NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def reference_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    prob_weighted: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns ``(loss, stats)``; stats holds the per-token ``logprobs``, ``entropy``, ``lse``, ``is_top1`` and
    ``mean_logit`` in the shape of ``target`` (0 at ignored positions). Differentiable in ``dtype``."""
    vocab = weight.shape[0]
    logits = reference_logits(hidden, weight, bias, softcap=softcap, temperature=temperature, dtype=dtype)
    logits = logits.reshape(-1, vocab)
    flat_target = target.reshape(-1).long()
    valid = flat_target != ignore_index
    cw = None if class_weight is None else class_weight.to(dtype)
    per_token = F.cross_entropy(
        logits, flat_target, weight=cw, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.logsumexp(logits, dim=-1)
    if z_loss:
        per_token = per_token + z_loss * lse.square()
    zero = torch.zeros((), dtype=dtype, device=logits.device)
    per_token = torch.where(valid, per_token, zero)

    safe_target = torch.where(valid, flat_target, 0)
    log_softmax = logits - lse[:, None]
    logprobs = log_softmax.gather(1, safe_target[:, None]).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    stats = {
        "logprobs": torch.where(valid, logprobs, zero),
        "entropy": torch.where(valid, entropy, zero),
        "lse": torch.where(valid, lse, zero).detach(),
        "is_top1": (valid & (logits.argmax(-1) == flat_target)).detach(),
        "mean_logit": torch.where(valid, logits.mean(-1), zero).detach(),
        "log_sum_sq_probs": torch.where(valid, torch.logsumexp(2 * log_softmax, dim=-1), zero).detach(),
    }
    stats = {k: v.reshape(target.shape) for k, v in stats.items()}
    if prob_weighted:
        per_token = per_token * stats["logprobs"].reshape(-1).exp().detach()

    if reduction == "none" and num_items_in_batch is None:
        return per_token.reshape(target.shape), stats
    total = per_token.sum()
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, dtype=dtype, device=logits.device)
    elif reduction == "sum":
        return total, stats
    else:
        weights = torch.ones_like(per_token) if cw is None else cw[safe_target]
        denominator = torch.where(valid, weights, zero).sum()
    # nothing to average over: the loss is 0 (the sum divided by inf), whatever the sum
    denominator = torch.where(denominator == 0, torch.full_like(denominator, float("inf")), denominator)
    return total / denominator, stats
