"""Pure-PyTorch tile passes: run on any device, and define the behaviour the kernels must match.

On CPU a chunk is processed in blocks of rows small enough to stay in cache (``_CPU_BLOCK_ELEMS``), through scratch
buffers allocated once per chunk: the chain of elementwise passes over a block then reads the logits from memory once,
and no pass allocates (a fresh multi-MiB buffer per op costs its page faults). Elsewhere a block is the whole chunk.
"""

from __future__ import annotations

import torch

from .base import TileParams, TileStats, check_columns, lse_pair

# float32 elements of one CPU row block (4 MiB per scratch buffer; 32 rows at V = 32k timed best on 2 cores)
_CPU_BLOCK_ELEMS = 1 << 20
_LOG2_E = 1.4426950408889634


def _blocked(t: torch.Tensor) -> bool:
    """CPU: row blocks, exp2, no argmax pass (see the module docstring); elsewhere whole-chunk passes."""
    return t.device.type == "cpu"


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """16-bit logits are computed on in float32 (float32 and float64 ones in their own dtype)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _Blocks:
    """Row blocks of a ``[rows, V]`` chunk, each with the scratch buffers asked for (None where ``needed`` is
    False): ``t`` (the transformed logits, or the float32 copy of 16-bit ones), ``tanh`` (softcap), ``e`` (the
    softmax numerator, the gradient is written over it) and ``tmp``."""

    def __init__(self, logits: torch.Tensor, params: TileParams, tmp: bool):
        rows, vocab = logits.shape
        cpu = _blocked(logits)
        self.step = max(1, min(rows, _CPU_BLOCK_ELEMS // max(vocab, 1))) if cpu else max(rows, 1)
        self.rows = rows
        transformed = params.softcap is not None or params.inv_temperature != 1.0
        needed = (
            transformed or logits.dtype != _compute_dtype(logits),
            params.softcap is not None,
            True,
            tmp or cpu,
        )
        shape = (min(rows, self.step), vocab)
        kw = dict(dtype=_compute_dtype(logits), device=logits.device)
        self.buffers = [torch.empty(shape, **kw) if need else None for need in needed]

    def __iter__(self):
        for start in range(0, self.rows, self.step):
            end = min(start + self.step, self.rows)
            yield slice(start, end), [None if buf is None else buf[: end - start] for buf in self.buffers]


def _exp_shifted(
    t: torch.Tensor,
    shift: torch.Tensor,
    out: torch.Tensor,
    shift_low: torch.Tensor | None = None,
    exponent_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``exp((t - shift[:, None]) - shift_low[:, None])`` into ``out`` (the exponent kept in ``exponent_out`` where
    given). On CPU as ``exp2((t - shift) log2(e))``, about 3x cheaper there than exp, to a few float32 ulp. The
    difference is taken first, so it is exactly 0 at ``t == shift`` (the row max gives exactly 1, and the log-sum-exp
    is never below the max), and ``shift_low`` (an lse's rounding error, ``base.lse_pair``) is subtracted from it,
    not from ``shift``."""
    exponent = torch.sub(t, shift[:, None], out=out if exponent_out is None else exponent_out)
    if shift_low is not None:
        exponent.sub_(shift_low[:, None])
    if not _blocked(t):
        return torch.exp(exponent, out=out)
    return torch.mul(exponent, _LOG2_E, out=out).exp2_()


def _row_dot_shifted(e: torch.Tensor, t: torch.Tensor, shift: torch.Tensor, scratch: torch.Tensor | None):
    """``sum_j e_ij (t_ij - shift_i)`` per row (through ``scratch`` where given)."""
    return torch.sub(t, shift[:, None], out=scratch).mul_(e).sum(dim=1)


def _is_top1(t, row_max, target_logit, target, scratch) -> torch.Tensor:
    """``t.argmax(dim=1) == target`` (the first index wins a tie; NaN counts as the max, as argmax has it). On CPU
    argmax is a slow unvectorised pass, so only rows whose target logit equals the row max are looked at: those
    holding that max once are hits, and argmax decides the rest (ties, NaN rows)."""
    if not _blocked(t):
        return t.argmax(dim=1) == target
    hit = target_logit == row_max
    candidates = (hit | torch.isnan(row_max)).nonzero().squeeze(1)
    if candidates.numel() == 0:
        return hit
    sub = t.index_select(0, candidates)
    count = torch.eq(sub, row_max[candidates, None], out=scratch[: candidates.numel()]).sum(dim=1)
    unsure = (count != 1).nonzero().squeeze(1)
    if unsure.numel():
        hit[candidates[unsure]] = sub.index_select(0, unsure).argmax(dim=1) == target[candidates[unsure]]
    return hit


class TargetApartForward:
    """``forward_target_apart`` for a tile backend whose ``forward`` takes ``target_coef``: the torch and Ascend ones
    (Triton's writes ``E`` with row scales in one sweep instead)."""

    def forward_target_apart(
        self, logits, target, params, grad_scale, grad_out, x=None, weight=None
    ) -> tuple[TileStats, TargetApartGradient]:
        """``forward`` with the gradient's target column taken out of ``grad_out`` (0 there) and carried per row in
        float32: a 16-bit ``grad_out`` then rounds only the softmax part, so dW can be summed across chunks in the
        16-bit gradient itself (``engine._dw_sum_in_weight_dtype``) with no float32 ``[V, H]`` sum. ``x`` and
        ``weight`` (the logits GEMM's operands) are not used."""
        coef = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        stats = self.forward(logits, target, params, grad_scale, grad_out, coef)
        return stats, TargetApartGradient(grad_out, coef, target, params.ignore_index)


class TorchTileOps(TargetApartForward):
    name = "torch"
    # Scratch per logit: on CPU none that grows with the chunk (three row-block buffers, a few MiB); elsewhere t
    # (or tanh), exp(t - max) and one temporary of the chunk's size.
    scratch_bytes_per_logit = 12
    # The gradient of a block is written only after the block's logits were read (see base.py).
    grad_in_row_tail = True
    # On CPU, 16-bit logits are taken as they are and promoted to float32 one row block at a time (see base.py).
    cpu_16bit_logits = True

    def _transform(
        self, logits: torch.Tensor, params: TileParams, out: torch.Tensor | None = None, tanh_out=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the transformed logits ``t`` (in ``out`` when given; untransformed float32 logits as they are)
        and, with a softcap, ``tanh(z / softcap)`` for the chain rule (in ``tanh_out``). 16-bit logits are
        promoted to float32 first."""
        if logits.dtype != _compute_dtype(logits):
            logits = logits.to(_compute_dtype(logits)) if out is None else out.copy_(logits)
        if params.softcap is None:
            if params.inv_temperature == 1.0:
                return logits, None
            return torch.mul(logits, params.inv_temperature, out=out), None
        tanh = torch.div(logits, params.softcap, out=tanh_out).tanh_()
        return torch.mul(tanh, params.softcap * params.inv_temperature, out=out), tanh

    def _weights(self, safe_target: torch.Tensor, params: TileParams, like: torch.Tensor):
        if params.class_weight is None:
            return torch.ones_like(like), None
        return params.class_weight[safe_target], params.class_weight_sum

    def forward(self, logits, target, params, grad_scale=None, grad_out=None, target_coef=None) -> TileStats:
        """``TileOps.forward``; with ``target_coef`` ([rows] float32) the gradient's target column goes there and is
        0 in ``grad_out`` (``forward_target_apart``)."""
        rows = logits.shape[0]
        stats = TileStats.empty(rows, logits.device, _compute_dtype(logits), lse_low=True)
        for b, scratch in _Blocks(logits, params, tmp=False):
            self._forward_block(
                logits[b],
                target[b],
                params,
                None if grad_scale is None else grad_scale[b],
                None if grad_out is None else grad_out[b],
                None if target_coef is None else target_coef[b],
                stats,
                b,
                scratch,
            )
        return stats

    def _forward_block(self, logits, target, params, grad_scale, grad_out, target_coef, stats, b, scratch) -> None:
        t_buf, tanh_buf, e_buf, tmp = scratch
        t, tanh = self._transform(logits, params, t_buf, tanh_buf)
        valid = target != params.ignore_index
        safe_target = torch.where(valid, target, 0)
        row_max = t.amax(dim=1)
        target_logit = t.gather(1, safe_target[:, None]).squeeze(1)
        is_top1 = _is_top1(t, row_max, target_logit, safe_target, tmp) & valid
        # Rows of -inf (or NaN) propagate as stock does; keep finite rows exact.
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        mean_logit = t.mean(dim=1)
        eps, vocab = params.label_smoothing, params.vocab
        if eps:
            smooth_sum = t.sum(dim=1) if params.class_weight is None else t @ params.class_weight
        # e = exp(t - max): the softmax times sum_exp, which the gradient is written over
        e = _exp_shifted(t, row_max, e_buf)
        sum_exp = e.sum(dim=1)
        log_sum_exp = torch.log(sum_exp)
        lse, lse_low = lse_pair(row_max, log_sum_exp)
        # Against the max, not lse: t_y - max and sum_j p_j (t_j - max) hold no large offset shared by the logits.
        target_minus_max = target_logit - row_max
        expected_t_minus_max = _row_dot_shifted(e, t, row_max, tmp) / sum_exp
        log_sum_sq = 2.0 * (torch.log(torch.linalg.vector_norm(e, dim=1)) - log_sum_exp)  # log sum_j p_j^2

        w_y, w_sum = self._weights(safe_target, params, lse)
        loss = (1.0 - eps) * w_y * (log_sum_exp - target_minus_max)
        if eps:
            smooth = (vocab if w_sum is None else w_sum) * lse - smooth_sum
            loss = loss + (eps / vocab) * smooth
        if params.z_loss:
            loss = loss + params.z_loss * lse.square()
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        entropy = torch.where(valid, log_sum_exp - expected_t_minus_max, zero)
        stats.loss[b] = torch.where(valid, loss, zero)
        stats.lse[b] = torch.where(valid, lse, zero)
        stats.lse_low[b] = torch.where(valid, lse_low, zero)
        stats.logprob[b] = torch.where(valid, target_minus_max - log_sum_exp, zero)
        stats.entropy[b] = entropy
        stats.is_top1[b] = is_top1
        stats.mean_logit[b] = torch.where(valid, mean_logit, zero)
        stats.log_sum_sq_probs[b] = torch.where(valid, log_sum_sq, zero)
        if grad_scale is not None:
            grad_loss = torch.where(valid, grad_scale, zero)
            grads = (grad_loss, None, None)
            inputs = (t, tanh, e, sum_exp, safe_target, lse, entropy, params, grads, grad_out, tmp)
            self._write_grad(*inputs, target_coef=target_coef)

    def backward(
        self,
        logits,
        target,
        lse,
        entropy,
        params,
        grad_loss,
        grad_logprob,
        grad_entropy,
        grad_out,
        first_column=0,
        lse_low=None,
    ) -> None:
        check_columns(first_column, logits.shape[1], params.vocab)
        for b, (t_buf, tanh_buf, p_buf, tmp) in _Blocks(logits, params, tmp=grad_entropy is not None):
            t, tanh = self._transform(logits[b], params, t_buf, tanh_buf)
            valid = target[b] != params.ignore_index
            safe_target = torch.where(valid, target[b], 0)
            zero = torch.zeros((), dtype=t.dtype, device=t.device)
            low = None if lse_low is None else lse_low[b].to(t.dtype)
            # log p_j, kept in tmp for the entropy's gradient
            log_p = tmp if grad_entropy is not None else None
            p = _exp_shifted(t, lse[b], p_buf, low, log_p).masked_fill_(~valid[:, None], 0.0)
            masked = [
                None if g is None else torch.where(valid, g[b].to(t.dtype), zero)
                for g in (grad_loss, grad_logprob, grad_entropy)
            ]
            inputs = (t, tanh, p, None, safe_target, lse[b], entropy[b], params, masked, grad_out[b], tmp)
            self._write_grad(*inputs, first_column, log_p=log_p)

    def _write_grad(
        self,
        t,
        tanh,
        e,
        sum_exp,
        safe_target,
        lse,
        entropy,
        params,
        upstream,
        grad_out,
        tmp,
        first_column=0,
        target_coef=None,
        log_p=None,
    ):
        """The logits gradient of one block into ``grad_out``. ``e`` is the softmax times ``sum_exp`` per row (the
        softmax itself when ``sum_exp`` is None); it is overwritten, and so are ``tanh`` and ``tmp``. The block's
        columns are the vocabulary's from ``first_column`` on (a vocabulary chunk: ``t``, ``lse`` and ``entropy``
        are still the whole row's). With ``target_coef`` (whole rows only) the target column goes there instead.
        ``upstream`` holds the rows' gradients of loss, logprob and entropy (None for 0); an entropy gradient needs
        ``log_p``, the block's log p_j, which it overwrites (it may be ``tmp``)."""
        grad_loss, grad_logprob, grad_entropy = upstream
        eps, vocab = params.label_smoothing, params.vocab
        zeros = torch.zeros_like(lse)
        g_loss = zeros if grad_loss is None else grad_loss
        w_y, w_sum = self._weights(safe_target, params, lse)
        # Per-row coefficient of p_j, and the weight of the one-hot target entry (see base.py for the formulas).
        p_coef = g_loss * (1.0 - eps) * w_y
        if eps:
            p_coef = p_coef + g_loss * (eps / vocab) * (vocab if w_sum is None else w_sum)
        if params.z_loss:
            p_coef = p_coef + g_loss * (2.0 * params.z_loss) * lse
        onehot_coef = -g_loss * (1.0 - eps) * w_y
        if grad_logprob is not None:
            p_coef = p_coef - grad_logprob
            onehot_coef = onehot_coef + grad_logprob
        if grad_entropy is not None:
            # -g_H * p_j * (log p_j + H), with log p_j from lse's pair: no difference of two large numbers
            if sum_exp is not None:
                e.div_(sum_exp[:, None])
            grad = e.mul_(log_p.add_(entropy[:, None]).mul_(-grad_entropy[:, None]).add_(p_coef[:, None]))
        else:
            grad = e.mul_((p_coef if sum_exp is None else p_coef / sum_exp)[:, None])
        if first_column or grad.shape[1] != vocab:
            # the target's one-hot entry only where it falls in this vocabulary chunk
            local = safe_target - first_column
            in_chunk = (local >= 0) & (local < grad.shape[1])
            safe_target = torch.where(in_chunk, local, 0)
            onehot_coef = torch.where(in_chunk, onehot_coef, 0.0)
        grad.scatter_add_(1, safe_target[:, None], onehot_coef[:, None])
        if eps:
            if params.class_weight is None:
                grad -= (g_loss * (eps / vocab))[:, None]
            else:
                class_weight = params.class_weight[first_column : first_column + grad.shape[1]]
                grad.addr_(g_loss * (eps / vocab), class_weight, alpha=-1.0)
        if params.inv_temperature != 1.0:
            grad *= params.inv_temperature
        if tanh is not None:
            grad.mul_(tanh.square_().neg_().add_(1.0))
        if target_coef is not None:
            # 0 at ignored rows, whose gradient is 0
            target_coef.copy_(grad.gather(1, safe_target[:, None]).squeeze(1))
            grad.scatter_(1, safe_target[:, None], 0.0)
        grad_out.copy_(grad)


class TargetApartGradient:
    """A chunk's logits gradient ``G`` with each row's target column apart (``TargetApartForward``): ``e`` is ``G``
    with 0 at that column, in 16 bits, and ``target_coef`` the column's value ``c`` in float32. dX is ``E W + c W[y]``
    and dW is ``E^T X`` plus ``c x`` at the target rows (``add_target_rows``, once per call): a 16-bit dW summed
    across chunks then rounds only the softmax part. It is ``triton_scaled.ScaledGradient`` with unit row scales, in
    torch ops, for ``engine._GradBuffers``."""

    row_scale = None
    # dW's target rows are summed in float32 over this many sorted kept rows at a time
    TARGET_ROWS_BLOCK = 2048

    def __init__(self, e: torch.Tensor, target_coef: torch.Tensor, target: torch.Tensor, ignore_index: int):
        self.e = e
        self.target_coef = target_coef
        self.target = target
        self.ignore_index = ignore_index

    def dx_operand(self) -> torch.Tensor:
        return self.e

    def write_dx(
        self, ew: torch.Tensor, weight: torch.Tensor, dx: torch.Tensor, dst_rows: torch.Tensor | None, row0: int
    ) -> None:
        """``dx[dst] = ew + c W[y]``, rounded once to dx's dtype, from ``ew = E W`` (float32), at ``dst_rows``
        (compacted rows) or rows ``row0:``."""
        safe_target = torch.where(self.target != self.ignore_index, self.target, 0)
        ew.addcmul_(self.target_coef[:, None], weight.index_select(0, safe_target))
        if dst_rows is None:
            dx[row0 : row0 + ew.shape[0]] = ew
        else:
            dx.index_copy_(0, dst_rows, ew.to(dx.dtype))

    def dw_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.e, x.to(self.e.dtype)

    @classmethod
    def add_target_rows(
        cls, dw, x, x_rows, target, target_coef, ignore_index, dw_upper=None, hot=None, operand_dtype=torch.bfloat16
    ) -> None:
        """``dW[y_i] += c_i x_i`` over every kept row of a call, after its last chunk (``ScaledGradient.
        add_target_rows``' arguments): row ``i`` is row ``x_rows[i]`` of ``x``, or row ``i`` without ``x_rows``; a
        float32 ``x`` is rounded to ``operand_dtype`` first, as the dW GEMM's operand was. A float32 dW (with
        ``dw_upper``, its rows past ``dw``'s) takes the terms as they are. A 16-bit one gets each target row once,
        ``dW[v] + sum_{y_i = v} c_i x_i`` summed in float32 and rounded, with no host read: the rows sorted by target,
        summed by runs of one target within blocks of rows, a run cut by a block's end carried on in float32 to the
        next block. With ``hot = (slot, rows)``, class ``v`` with ``slot[v] >= 0`` has its row at ``rows[slot[v]]``
        (float32) instead."""
        n, hidden = target.shape[0], x.shape[1]
        kept = target != ignore_index
        y = torch.where(kept, target, 0)

        def terms(idx: torch.Tensor) -> torch.Tensor:
            """``c_i x_i`` in float32 for rows ``idx`` (0 at ignored rows, whatever their x)."""
            xs = x.index_select(0, idx if x_rows is None else x_rows[idx])
            xs = (xs.to(operand_dtype) if xs.dtype == torch.float32 else xs).float()
            return torch.where(kept[idx, None], xs * target_coef[idx, None], 0.0)

        if dw.dtype == torch.float32:
            for start in range(0, n, cls.TARGET_ROWS_BLOCK):
                idx = torch.arange(start, min(start + cls.TARGET_ROWS_BLOCK, n), device=target.device)
                c_x, yb = terms(idx), y[idx]
                if dw_upper is None:
                    dw.index_add_(0, yb, c_x)
                    continue
                lower = yb < dw.shape[0]
                dw.index_add_(0, torch.where(lower, yb, 0), torch.where(lower[:, None], c_x, 0.0))
                upper_rows = torch.where(lower, 0, yb - dw.shape[0])
                dw_upper.index_add_(0, upper_rows, torch.where(lower[:, None], 0.0, c_x))
            return
        assert dw_upper is None, "a 16-bit dW is one block"
        order = torch.sort(y, stable=True).indices
        carry = None  # (class, its float32 row so far) of the run the previous block's end cut
        for start in range(0, n, cls.TARGET_ROWS_BLOCK):
            idx = order[start : start + cls.TARGET_ROWS_BLOCK]
            c_x, yb = terms(idx), y[idx]
            if hot is not None:
                slot = hot[0][yb].long()
                is_hot = slot >= 0
                hot[1].index_add_(0, torch.where(is_hot, slot, 0), torch.where(is_hot[:, None], c_x, 0.0))
                c_x = torch.where(is_hot[:, None], 0.0, c_x)
            # run r holds the block's r-th distinct target (yb is sorted)
            new_run = torch.ones_like(yb, dtype=torch.bool)
            new_run[1:] = yb[1:] != yb[:-1]
            run = new_run.cumsum(0) - 1
            run_sum = torch.zeros((yb.shape[0], hidden), dtype=torch.float32, device=dw.device)
            run_sum.index_add_(0, run, c_x)
            run_class = torch.zeros_like(yb).scatter_(0, run, yb)
            value = dw.index_select(0, run_class).float().add_(run_sum)
            if carry is not None:
                value[0] = torch.where(run_class[0] == carry[0], carry[1] + run_sum[0], value[0])
            # the slots past the last run repeat it, so every row written is a real run's, and a repeated one gets
            # the same value each time
            last_run = torch.minimum(torch.arange(yb.shape[0], device=dw.device), run[-1])
            run_class, value = run_class[last_run], value[last_run]
            dw.index_copy_(0, run_class, value.to(dw.dtype))
            carry = (run_class[-1], value[-1])
