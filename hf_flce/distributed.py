"""The fused head under distributed training: sharded weights and a vocabulary-parallel (tensor-parallel) head.

Two entry points:

* :func:`head_linear_cross_entropy` computes the fused loss of ``head(hidden)`` by calling *through* the head module.
  The engines that shard parameters make a module's weight whole only around that module's own call: FSDP1 inside
  its wrapper, FSDP2 in its pre-forward hook when the head is its own ``fully_shard`` unit, DeepSpeed ZeRO-3 in its
  forward hooks (and again before the module's backward, through hooks on the module's outputs). Reading
  ``lm_head.weight`` outside that call sees a flat-parameter view, a shard or a ``numel() == 0`` placeholder.
  Running the op as the head's forward gets the real weight, and the engines' gradient reduction stays wired to it.
  A weight that is still a ``DTensor`` inside the call is a tensor-parallel layout (the data-parallel engines have
  unsharded theirs by then): a vocabulary shard ``Shard(0)`` on a 1-D mesh goes to the vocabulary-parallel op, any
  other layout is gathered with ``full_tensor`` (its gradient flows back to the ``DTensor``).
* :func:`vocab_parallel_linear_cross_entropy` is the op for a head split along the vocabulary: each rank of
  ``process_group`` holds rows ``[vocab_start, vocab_start + V_r)`` of ``W``, and the same ``hidden`` and ``target``.

Vocabulary-parallel math, per row, with ``t`` the transformed logits and rank ``r`` holding the columns ``S_r``,
each sum taken against a max so that no offset the row's logits share enters a difference:

    m_r = max_{j in S_r} t_j    s_r = sum_{j in S_r} e^{t_j - m_r}    a_r = sum_{j in S_r} (e^{t_j - m_r} / s_r)(t_j - m_r)
    M = max_r m_r               S = sum_r s_r e^{m_r - M}              lse = M + log S   (a float32 pair, base.lse_pair)
    sum_j p_j (t_j - M) = sum_r (s_r e^{m_r - M} / S)(a_r + m_r - M)    H = log S - sum_j p_j (t_j - M)
    log p_y = (t_y - M) - log S, t_y from the rank that owns y,  sum_j t_j = sum_r sum_{j in S_r} t_j,
    sum_j p_j^2 = sum_r (s_r e^{m_r - M} / S)^2 q_r

(``q_r`` the local ``sum p^2``). Forward is one GEMM per chunk plus three small all-reduces over per-row vectors (max,
sum, and an int64 min for the first global argmax when stats are asked for). The gradient of the local logits uses
the global ``lse`` and ``H`` (formulas in :mod:`hf_flce.backends.base`); the one-hot terms land only on the rank that
owns the target. A scalar loss's gradient is known in forward up to the upstream scalar: each chunk's statistics are
all-reduced as soon as its logits are, and ``dX_r = G_r W_r`` and ``dW_r = G_r^T X`` are formed there (three GEMMs;
every rank plans the same chunks, from the largest shard). Per-token upstream gradients are applied in backward, which
recomputes each of the forward's chunks (GEMMs of the forward's shapes, which round alike, so that the p_j sum to 1
against the forward's lse) or reuses the logits when the local ``[rows, V_r]`` block fits the memory budget. ``dX`` is
all-reduced in backward. The tile contract of
:mod:`hf_flce.backends` assumes the target column is in the tile, so this op does its passes with torch ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from .api import FLCEStats, fused_linear_cross_entropy, loss_denominator
from .backends import cdiv
from .backends.base import TileParams, lse_pair
from .backends.torch_tiles import TorchTileOps
from .engine import _chunks, _GradBuffers, _scatter_rows, compute_logits, first_derivative_only, kept_rows
from .options import FLCEOptions, check_num_items, check_tensors, stats_request

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch builds without distributed
    DTensor, Shard = (), None

__all__ = ["head_linear_cross_entropy", "linear_of", "vocab_parallel_linear_cross_entropy"]

# Bytes per logit of one forward chunk: the float32 logits, the transformed copy, the local softmax and a temporary.
_BYTES_PER_LOGIT = 16
_TILES = TorchTileOps()


# --------------------------------------------------------------------------------------------------------------------
# The vocabulary-parallel op
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _VPPlan:
    """Everything about one vocabulary-parallel call that autograd does not track."""

    group: dist.ProcessGroup | None
    vocab_start: int
    params: TileParams  # vocab is the full (global) V
    reduction: str  # "none" or "scalar"
    denominator: torch.Tensor | None
    budget: int
    grad_mode: bool
    need_top1: bool
    # the largest shard's rows: every rank plans its forward chunks from it, so that the per-chunk collectives of a
    # scalar loss (its gradient is formed in forward) line up on shards of different sizes
    chunk_vocab: int


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=group)
    return t


def _shard_sizes(local_vocab: int, device: torch.device, group) -> list[int]:
    """Every rank's shard rows, in rank order (one tiny all-gather)."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([local_vocab], dtype=torch.int64, device=device), group=group)
    return [int(s) for s in sizes]


def _local_target(target: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of the target in this shard (0 when elsewhere) and whether this shard owns it."""
    owned = (target >= start) & (target < start + size)
    return torch.where(owned, target - start, 0), owned


def _chunk_stats(t: torch.Tensor, y_local: torch.Tensor, owned: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row statistics of one chunk of transformed local logits ``t`` ``[rows, V_r]``, against the local max
    ``m_r``: ``s_r = sum_j e^{t_j - m_r}`` and ``a_r = sum_j p_j (t_j - m_r)`` (local softmax) hold no offset that
    the row's logits share, which ``_combine`` then removes exactly against the global max."""
    local_max, local_arg = t.max(dim=1)  # first maximal column, as argmax
    shift = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
    shifted = t - shift[:, None]
    e = torch.exp(shifted)
    sum_exp = e.sum(dim=1)
    target_logit = t.gather(1, y_local[:, None]).squeeze(1)
    return {
        "shift": shift,
        "sum_exp": sum_exp,
        "expected_shifted": torch.bmm(e.unsqueeze(1), shifted.unsqueeze(2)).view(-1) / sum_exp,
        "sum_sq": (torch.linalg.vector_norm(e, dim=1) / sum_exp).square(),
        "sum_t": t.sum(dim=1),
        "target_logit": torch.where(owned, target_logit, torch.zeros_like(target_logit)),
        "max": local_max,
        "argmax": local_arg,
    }


def _combine(local: dict[str, torch.Tensor], plan: _VPPlan) -> dict[str, torch.Tensor]:
    """Global per-row statistics from every rank's partial ones (see the module docstring). With ``M`` the global
    max (an exact logit) and ``S = sum_r s_r e^{m_r - M}``, the lse is the float32 pair ``M + log S``
    (``base.lse_pair``), and the log-prob and entropy are formed from ``t_y - M``, ``log S`` and
    ``sum_j p_j (t_j - M)``: no difference of two numbers near a shared logit offset."""
    vocab, group = plan.params.vocab, plan.group
    global_max = _all_reduce(local["max"].clone(), dist.ReduceOp.MAX, group)
    row_max = torch.where(torch.isfinite(global_max), global_max, torch.zeros_like(global_max))
    offset = local["shift"] - row_max  # <= 0
    w = local["sum_exp"] * torch.exp(offset)
    sums = torch.stack(
        [
            w,
            w * (local["expected_shifted"] + offset),
            w.square() * local["sum_sq"],
            local["sum_t"],
            local["target_logit"],
        ]
    )
    sum_w, sum_wa, sum_sq, sum_t, target_logit = _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_sum_exp = torch.log(sum_w)
    lse, lse_low = lse_pair(row_max, log_sum_exp)
    out = {
        "lse": lse,
        "lse_low": lse_low,
        "log_sum_exp": log_sum_exp,
        "target_minus_max": target_logit - row_max,
        "entropy": log_sum_exp - sum_wa / sum_w,
        "log_sum_sq_probs": torch.log(sum_sq) - 2.0 * log_sum_exp,
        "mean_logit": sum_t / vocab,
        "sum_t": sum_t,
    }
    if plan.need_top1:
        # The first global argmax: the smallest global column among the ranks whose local max is the global max.
        candidate = torch.where(local["max"] == global_max, local["argmax"] + plan.vocab_start, vocab)
        out["argmax"] = _all_reduce(candidate, dist.ReduceOp.MIN, group)
    return out


def _row_loss(stats: dict[str, torch.Tensor], params: TileParams) -> torch.Tensor:
    """``(1 - eps)(lse - t_y) + eps/V sum_j (lse - t_j) + z lse^2`` (no class weights), the first term as
    ``log S - (t_y - M)``."""
    eps, lse = params.label_smoothing, stats["lse"]
    loss = (1.0 - eps) * (stats["log_sum_exp"] - stats["target_minus_max"])
    if eps:
        loss = loss + (eps / params.vocab) * (params.vocab * lse - stats["sum_t"])
    if params.z_loss:
        loss = loss + params.z_loss * lse.square()
    return loss


def _logits_grad(t, tanh, y_local, owned, lse, lse_low, entropy, g_loss, g_logp, g_ent, params: TileParams):
    """Gradient of the local logits chunk for per-row upstream gradients (float32 ``[rows]``, ``None`` for zero),
    with the global lse pair and entropy; ``t, tanh`` are the chunk's transformed logits (``TorchTileOps._transform``).
    Overwrites nothing it does not own; returns a new float32 tensor."""
    eps = params.label_smoothing
    p_coef = g_loss * (1.0 + 2.0 * params.z_loss * lse) if params.z_loss else g_loss
    onehot_coef = -(1.0 - eps) * g_loss
    if g_logp is not None:
        p_coef = p_coef - g_logp
        onehot_coef = onehot_coef + g_logp
    # p_j = e^{d_j} c with d_j = t_j - lse and c = e^{-lse_low}: the pair's low part is a row factor, folded into the
    # row coefficients (no pass over the chunk for it), and log p_j = d_j - lse_low
    shifted = t - lse[:, None]
    low_factor = torch.exp(-lse_low)
    if g_ent is not None:
        # dH/dt_j = -p_j (log p_j + H): p_coef p_j - g_H p_j (log p_j + H) = e^{d_j} (a - b d_j)
        row_const = low_factor * (p_coef - g_ent * (entropy - lse_low))
        row_slope = low_factor * g_ent
        grad = torch.exp(shifted)
        grad.mul_(torch.addcmul(row_const[:, None], shifted, row_slope[:, None], value=-1.0, out=shifted))
    else:
        grad = shifted.exp_().mul_((low_factor * p_coef)[:, None])
    grad.scatter_add_(1, y_local[:, None], torch.where(owned, onehot_coef, 0.0)[:, None])
    if eps:
        grad -= (g_loss * (eps / params.vocab))[:, None]
    if params.inv_temperature != 1.0:
        grad *= params.inv_temperature
    if tanh is not None:
        grad *= 1.0 - tanh.square()
    return grad


class _VocabParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, plan: _VPPlan):
        ctx.set_materialize_grads(False)
        n, local_vocab = x.shape[0], weight.shape[0]
        # Every rank holds the same target, so every rank keeps the same rows and the collectives line up.
        rows, ys = kept_rows(target, plan.params.vocab, plan.params.ignore_index)
        if rows is None:
            rows = torch.arange(n, device=target.device)
        xs = x.index_select(0, rows)
        y_local, owned = _local_target(ys, plan.vocab_start, local_vocab)
        n_valid = xs.shape[0]
        need = ctx.needs_input_grad[:3]
        need_grad = plan.grad_mode and any(need)
        # A scalar loss's logits gradient is known in forward up to the upstream scalar: dX and dW are formed there,
        # three GEMMs in all, and backward only scales them (the single-device op's path).
        eager = need_grad and plan.reduction == "scalar"
        keep = need_grad and not eager and 0 < n_valid * local_vocab * 4 <= plan.budget
        # Where the rows' float32 logits fit the budget, one chunk (a per-token loss keeps them for backward; a scalar
        # loss then needs no float32 dW sum); the passes over it take ~4x that for a moment, as they did in backward.
        whole = keep or (eager and 0 < n_valid * plan.chunk_vocab * 4 <= plan.budget)
        chunk = max(n_valid, 1) if whole else max(1, plan.budget // (plan.chunk_vocab * _BYTES_PER_LOGIT))
        grads = None
        if eager:
            n_chunks = max(1, cdiv(n_valid, chunk))
            chunk_bytes = chunk * local_vocab * _BYTES_PER_LOGIT
            grads = _GradBuffers(n_valid, xs.dtype, weight, weight.dtype, n_chunks, *need, chunk_bytes=chunk_bytes)
            per_unit = (1.0 / plan.denominator).to(torch.float32).expand(n_valid)

        parts: list[dict[str, torch.Tensor]] = []
        kept = None
        # With no valid row, one empty chunk: every rank still joins the collectives, on empty tensors.
        for start, end in list(_chunks(n_valid, chunk)) or [(0, 0)]:
            logits = compute_logits(xs[start:end], weight, bias)
            t, tanh = _TILES._transform(logits, plan.params)
            part = _chunk_stats(t, y_local[start:end], owned[start:end])
            if eager:
                # the chunk's global statistics now (its all-reduces), for its gradient per unit upstream gradient
                part = _combine(part, plan)
                rows_of = slice(start, end)
                grad = _logits_grad(
                    t,
                    tanh,
                    y_local[rows_of],
                    owned[rows_of],
                    part["lse"],
                    part["lse_low"],
                    part["entropy"],
                    per_unit[rows_of],
                    None,
                    None,
                    plan.params,
                )
                grads.add(start, end, grad.to(x.dtype), xs[rows_of])
                del grad
            parts.append(part)
            kept = logits if keep else None
            del logits, t, tanh
        joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        stats = joined if eager else _combine(joined, plan)
        loss_v = _row_loss(stats, plan.params)
        top1 = stats["argmax"] == ys if plan.need_top1 else torch.zeros_like(ys, dtype=torch.bool)

        if plan.reduction == "none":
            loss = _scatter_rows(loss_v, rows, n)
        else:
            loss = loss_v.sum() / plan.denominator
        logp = stats["target_minus_max"] - stats["log_sum_exp"]
        per_row = (logp, stats["entropy"], stats["lse"], top1, stats["mean_logit"], stats["log_sum_sq_probs"])
        outputs = (loss, *(_scatter_rows(v, rows, n) for v in per_row))
        ctx.mark_non_differentiable(*outputs[3:])
        ctx.plan, ctx.n, ctx.need_grad = plan, n, need_grad
        if need_grad:
            ctx.save_for_backward(
                x, weight, bias, rows, y_local, owned, stats["lse"], stats["lse_low"], stats["entropy"]
            )
            # backward recomputes the logits by the same row chunks: GEMMs of the same shapes round alike, so its
            # p_j sum to 1 against the forward's lse as the forward's did
            ctx.chunk = chunk
            ctx.kept = kept  # reused once, then recomputed (a second backward under retain_graph)
            ctx.eager_grads = grads  # handed out by the first backward; a second one recomputes
        return outputs

    @staticmethod
    @first_derivative_only
    def backward(ctx, g_loss, g_logp, g_ent, *unused):
        if not ctx.need_grad:
            return None, None, None, None, None
        kept, ctx.kept = ctx.kept, None
        eager_grads, ctx.eager_grads = ctx.eager_grads, None
        if g_loss is None and g_logp is None and g_ent is None:
            return None, None, None, None, None
        x, weight, bias, rows, y_local, owned, lse, lse_low, entropy = ctx.saved_tensors
        plan = ctx.plan
        n_valid = rows.numel()
        need = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if eager_grads is not None and g_loss is not None:
            dx, dw, db = eager_grads.finish(g_loss.to(torch.float32))
            g_loss = None

        def per_row(g):
            return None if g is None else g.reshape(-1).to(torch.float32).index_select(0, rows)

        if g_loss is not None or g_logp is not None or g_ent is not None:
            if g_loss is None:
                gl = torch.zeros_like(lse)
            elif plan.reduction == "scalar":
                gl = (g_loss.to(torch.float32) / plan.denominator).expand(n_valid)
            else:
                gl = per_row(g_loss)
            upstream = (gl, per_row(g_logp), per_row(g_ent))
            row_stats = (y_local, owned, lse, lse_low, entropy)
            pdx, pdw, pdb = _recompute_grads(x, weight, bias, rows, row_stats, upstream, kept, ctx.chunk, plan, need)
            dx = pdx if dx is None else (dx if pdx is None else dx + pdx)
            dw = pdw if dw is None else (dw if pdw is None else dw + pdw)
            db = pdb if db is None else (db if pdb is None else db + pdb)
        if dx is not None:
            # Each rank holds the part of dX that flows through its vocabulary columns.
            dx = _scatter_rows(_all_reduce(dx, dist.ReduceOp.SUM, plan.group), rows, ctx.n)
        if db is not None:
            db = db.to(bias.dtype)
        return dx, dw, db, None, None


def _recompute_grads(x, weight, bias, rows, row_stats, upstream, kept, chunk: int, plan: _VPPlan, need):
    """This rank's dX part (kept rows), dW and db for per-row upstream gradients ``(loss, logp, entropy)``, the
    logits recomputed by the forward's row chunks of ``chunk`` rows (or ``kept``, the forward's own when they fitted
    the budget). ``row_stats`` are the kept rows' ``(y_local, owned, lse, lse_low, entropy)``."""
    n_valid = rows.numel()
    xs = x.index_select(0, rows)
    n_chunks = cdiv(n_valid, chunk)
    chunk_bytes = chunk * weight.shape[0] * _BYTES_PER_LOGIT
    grads = _GradBuffers(n_valid, xs.dtype, weight, weight.dtype, n_chunks, *need, chunk_bytes=chunk_bytes)
    for start, end in _chunks(n_valid, chunk):
        sl = slice(start, end)
        logits = kept if kept is not None else compute_logits(xs[sl], weight, bias)
        grad = _logits_grad(
            *_TILES._transform(logits, plan.params),
            *(v[sl] for v in row_stats),
            *(None if g is None else g[sl] for g in upstream),
            plan.params,
        )
        grads.add(start, end, grad.to(x.dtype), xs[sl])
    return grads.finish()


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    process_group: dist.ProcessGroup | None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    return_stats: bool | Collection[str] = False,
    memory_budget: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, FLCEStats]:
    """:func:`hf_flce.fused_linear_cross_entropy` for a head split along the vocabulary across ``process_group``.

    Every rank passes the same ``hidden`` and ``target`` and its own rows of the head: ``weight`` is ``W[s:s+V_r]``
    (and ``bias`` ``b[s:s+V_r]``) with ``s = vocab_start``. The loss, the stats and the gradient of ``hidden`` equal
    the unsharded op's on every rank; ``weight.grad`` (``bias.grad``) is this rank's rows of the unsharded gradient.

    Args:
        hidden: ``[..., H]``, identical on every rank of the group.
        weight: ``[V_r, H]``, this rank's vocabulary shard.
        target: global class indices (``[0, V)`` or ``ignore_index``), identical on every rank.
        bias: optional ``[V_r]`` shard.
        process_group: the tensor-parallel group (``None``: the default group).
        vocab_start: the first global class of this shard; ``None`` assumes contiguous shards in rank order and
            finds it with one small all-gather.
        ignore_index, reduction, num_items_in_batch, label_smoothing, z_loss, softcap, temperature, return_stats,
            memory_budget: as :func:`hf_flce.fused_linear_cross_entropy`. ``class_weight`` and ``backend`` are not
            supported (the passes are torch ops).

    Returns:
        The loss, and an :class:`hf_flce.FLCEStats` when ``return_stats`` (``logprobs`` and ``entropy``
        differentiable).

    Raises:
        ValueError / TypeError: bad options or tensors, as the single-device op; ``num_items_in_batch`` with a
            reduction other than ``"mean"``.
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
    check_num_items(num_items_in_batch, reduction)
    wanted_stats = stats_request(return_stats)
    if not dist.is_initialized():
        raise RuntimeError("vocab_parallel_linear_cross_entropy needs torch.distributed to be initialised")
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    check_tensors(hidden, weight, target, bias, None)

    local_vocab, size = weight.shape
    sizes = _shard_sizes(local_vocab, weight.device, process_group)
    vocab = sum(sizes)
    if vocab_start is None:  # contiguous shards in rank order
        vocab_start = sum(sizes[: dist.get_rank(process_group)])
    x = hidden.reshape(-1, size)
    y = target.reshape(-1).long().contiguous()
    valid_count = (y != ignore_index).sum().to(torch.float32)
    params = TileParams(
        vocab=vocab,
        ignore_index=ignore_index,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        softcap=None if softcap is None else float(softcap),
        inv_temperature=1.0 / float(temperature),
        class_weight=None,
        class_weight_sum=None,
    )
    plan = _VPPlan(
        group=process_group,
        vocab_start=int(vocab_start),
        params=params,
        reduction="none" if reduction == "none" and num_items_in_batch is None else "scalar",
        denominator=loss_denominator(valid_count, opts, num_items_in_batch, x.device),
        budget=opts.budget_bytes(x.device),
        grad_mode=torch.is_grad_enabled(),
        need_top1=wanted_stats is not None and "is_top1" in wanted_stats,
        chunk_vocab=max(sizes),
    )
    with torch.autocast(x.device.type, enabled=False):
        loss, *per_token = _VocabParallelFunction.apply(x, weight, bias, y, plan)
    if plan.reduction == "none":
        loss = loss.reshape(target.shape)
    if wanted_stats is None:
        return loss
    names = ("logprobs", "entropy", "lse", "is_top1", "mean_logit", "log_sum_sq_probs")
    return loss, FLCEStats(**{k: v.reshape(target.shape) for k, v in zip(names, per_token)})


# --------------------------------------------------------------------------------------------------------------------
# Calling the op through the head module (FSDP1, FSDP2, DeepSpeed ZeRO-3, tensor-parallel DTensor heads)
# --------------------------------------------------------------------------------------------------------------------


def linear_of(head: nn.Module) -> nn.Linear | None:
    """The plain :class:`torch.nn.Linear` that ``head`` applies, looking through FSDP1's wrapper and PEFT's
    ``modules_to_save`` wrapper (its active copy); ``None`` for anything else (a LoRA or other adapter on the head, a
    quantized layer), where logits must come from the head's own forward."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(head, FullyShardedDataParallel):
        return linear_of(head.module)
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:  # FSDP2's subclass keeps it
        return head
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:
        return None
    if isinstance(head, ModulesToSaveWrapper):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return linear_of(head.original_module)
        return linear_of(head.modules_to_save[active[0]])
    return None


@contextlib.contextmanager
def _as_forward(module: nn.Module, fn):
    """Make ``fn`` the forward of ``module`` for a while. accelerate's device-placement hooks keep the real forward
    in ``_old_forward`` behind an instance wrapper: replace that one, so the hook still runs around ``fn``."""
    slot = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    saved = module.__dict__.get(slot)
    setattr(module, slot, fn)
    try:
        yield
    finally:
        if saved is None:
            delattr(module, slot)
        else:
            setattr(module, slot, saved)


def _operands(hidden, weight, bias):
    """Plain tensors for the op, or the process group and local shard of a vocabulary-parallel ``DTensor`` head."""
    if not isinstance(weight, DTensor):
        return hidden, weight, bias, None
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    mesh = weight.device_mesh
    vocab_sharded = mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),)
    if vocab_sharded and (bias is None or tuple(bias.placements) == (Shard(0),)):
        local_bias = None if bias is None else bias.to_local()
        return hidden, weight.to_local(), local_bias, mesh.get_group()
    return hidden, weight.full_tensor(), None if bias is None else bias.full_tensor(), None


def _returns_stats(options: dict) -> bool:
    return stats_request(options.get("return_stats", False)) is not None


def _linear_ce(hidden, weight, target, bias, options: dict):
    """The single-device or the vocabulary-parallel op, by the weight's layout; a flat tuple ``(loss, *stats)``
    (ZeRO-3's hooks look for tensors in the module's outputs, and they do not look inside dataclasses)."""
    hidden, weight, bias, group = _operands(hidden, weight, bias)
    if weight.is_meta:
        raise RuntimeError("hf_flce: the lm_head weight is on the meta device inside its own forward")
    if group is None:
        out = fused_linear_cross_entropy(hidden.to(weight.device), weight, target.to(weight.device), bias, **options)
    else:
        vp_options = {k: v for k, v in options.items() if k != "backend"}
        out = vocab_parallel_linear_cross_entropy(
            hidden.to(weight.device), weight, target.to(weight.device), bias, process_group=group, **vp_options
        )
    outputs = (out,) if not _returns_stats(options) else (out[0], *(getattr(out[1], f.name) for f in fields(out[1])))
    # FSDP2 skips its pre-backward hook for a module output that is a view (and warns): return per-token vectors
    # (a few bytes per token) as their own tensors.
    return tuple(t.clone() if t._base is not None else t for t in outputs)


def head_linear_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, *, upcast: bool = False, **options
) -> torch.Tensor | tuple[torch.Tensor, FLCEStats]:
    """The fused loss of ``head(hidden)`` against ``target``, run as ``head``'s own forward so that FSDP1, FSDP2
    and DeepSpeed ZeRO-3 gather its weight for the call (and ZeRO-3 again for a backward that recomputes).

    Args:
        head: the ``lm_head`` as the model holds it (an ``nn.Linear``, FSDP1's wrapper around one, an FSDP2 unit,
            PEFT's ``modules_to_save`` wrapper); :func:`linear_of` must find its linear map.
        hidden: ``[..., H]``; passed as the head's input, so FSDP1 mixed precision casts it as it would for logits.
        target: class indices in the shape of ``hidden.shape[:-1]``.
        upcast: compute in float32 (hidden, weight and bias cast, autocast off), as TRL's ``cast_lm_head_to_fp32``.
        options: keyword options of :func:`hf_flce.fused_linear_cross_entropy`. A weight that is a vocabulary-sharded
            ``DTensor`` inside the call goes to :func:`vocab_parallel_linear_cross_entropy` (``backend`` and
            ``class_weight`` are not supported there).

    Returns:
        As :func:`hf_flce.fused_linear_cross_entropy`.

    Example:
        >>> import torch, hf_flce.distributed as D
        >>> head = torch.nn.Linear(16, 50, bias=False)
        >>> hidden, target = torch.randn(4, 16), torch.randint(0, 50, (4,))
        >>> loss = D.head_linear_cross_entropy(head, hidden, target)
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(head(hidden), target))
        True
    """
    linear = linear_of(head)
    if linear is None:
        raise ValueError(f"head_linear_cross_entropy: {type(head).__name__} is not a plain linear head")

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight, bias = linear.weight, linear.bias
        if options.get("save_for_weight_grad") is not None:
            weight = weight.detach()  # the caller computes its gradient later (patches.late_head_grad)
        if not upcast:
            return _linear_ce(x, weight, target, bias, options)
        with torch.autocast(x.device.type, enabled=False):
            return _linear_ce(x.float(), weight.float(), target, None if bias is None else bias.float(), options)

    with _as_forward(linear, forward):
        out = head(hidden)
    if not _returns_stats(options):
        return out[0]
    return out[0], FLCEStats(*out[1:])
