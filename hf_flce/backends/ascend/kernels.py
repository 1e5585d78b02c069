"""Triton kernels for triton-ascend: one forward and one backward pass over rows of float32 logits.

Each program owns a contiguous range of rows (``tiling.grid``) and walks each row in ``BLOCK``-column steps, so only
``[BLOCK]`` temporaries ever sit in the unified buffer. Row offsets are int64. The constexpr flags specialise the
kernels; with ``SOFTCAP``, ``HAS_WEIGHT`` and ``SMOOTH`` all off (vanilla CE, optionally with temperature or z-loss,
which only cost scalar work) the compiled kernel is the lean fast path.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Rows of the [8, rows] float32 statistics buffer the forward kernel writes.
STAT_LOSS = tl.constexpr(0)
STAT_LSE = tl.constexpr(1)
STAT_LOGPROB = tl.constexpr(2)
STAT_ENTROPY = tl.constexpr(3)
STAT_TOP1 = tl.constexpr(4)
STAT_MEAN = tl.constexpr(5)
STAT_LSSP = tl.constexpr(6)
STAT_LSE_LOW = tl.constexpr(7)  # lse's rounding error (``backends.base.lse_pair``)
N_STATS = 8

# Start of the running max: finite, so that rescaling an empty sum gives 0 rather than -inf * 0.
_FLOOR = tl.constexpr(-3.0e38)


@triton.jit
def _tanh(x):
    # From exp: instructions every backend lowers; saturates to +-1 without overflow.
    e = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -th, th)


@triton.jit
def forward_kernel(
    logits_ptr,
    logits_stride,
    target_ptr,
    weight_ptr,
    weight_sum_ptr,
    stats_ptr,
    stats_stride,
    rows_per_program,
    extra_rows,
    vocab,
    ignore_index,
    eps,
    z_loss,
    softcap,
    inv_temp,
    SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Loss and statistics of each row in one online pass (running max, sums rescaled as the max grows)."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program + tl.minimum(pid, extra_rows)
    my_rows = rows_per_program + tl.where(pid < extra_rows, 1, 0)
    cols = tl.arange(0, BLOCK)
    for r in range(0, my_rows):
        row = row_start + r
        row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
        y = tl.load(target_ptr + row)
        valid = y != ignore_index
        y = tl.where(valid, y, 0)
        # The target logit is one direct load rather than a selection inside the scan.
        t_y = tl.load(row_ptr + y)
        if SOFTCAP:
            t_y = _tanh(t_y / softcap) * softcap
        t_y *= inv_temp
        m = tl.full((), _FLOOR, tl.float32)
        s = tl.zeros((), tl.float32)  # sum_j e_j, e_j = exp(t_j - m)
        a = tl.zeros((), tl.float32)  # sum_j e_j (t_j - m): entropy without cancellation
        q = tl.zeros((), tl.float32)  # sum_j e_j^2
        sum_t = tl.zeros((), tl.float32)
        sum_wt = tl.zeros((), tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.zeros((), tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            mask = offs < vocab
            t = tl.load(row_ptr + offs, mask=mask, other=0.0)
            if SOFTCAP:
                t = _tanh(t / softcap) * softcap
            t *= inv_temp
            t_in = tl.where(mask, t, float("-inf"))
            # First argmax: the lowest column holding the block max; a later block wins only when strictly larger.
            block_max, block_arg = tl.max(t_in, 0, return_indices=True, return_indices_tie_break_left=True)
            m_new = tl.maximum(m, block_max)
            alpha = tl.exp(m - m_new)
            e = tl.exp(t_in - m_new)
            a = alpha * (a + (m - m_new) * s) + tl.sum(tl.where(e > 0, e * (t - m_new), 0.0), 0)
            q = q * alpha * alpha + tl.sum(e * e, 0)
            s = s * alpha + tl.sum(e, 0)
            m = m_new
            sum_t += tl.sum(tl.where(mask, t, 0.0), 0)
            if HAS_WEIGHT and SMOOTH:
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
                sum_wt += tl.sum(w * tl.where(mask, t, 0.0), 0)
            best_idx = tl.where(block_max > best, start + block_arg, best_idx)
            best = tl.maximum(best, block_max)
        log_s = tl.log(s)
        lse = m + log_s
        # two-sum: the exact rounding error of m + log s
        b = lse - m
        lse_low = (m - (lse - b)) + (log_s - b)
        if HAS_WEIGHT:
            w_y = tl.load(weight_ptr + y)
        else:
            w_y = 1.0
        # against m, not lse: t_y - m holds no large offset the logits share (base.py)
        loss = (1.0 - eps) * w_y * (log_s - (t_y - m)) + z_loss * lse * lse
        if SMOOTH:
            if HAS_WEIGHT:
                loss += eps / vocab * (tl.load(weight_sum_ptr) * lse - sum_wt)
            else:
                loss += eps / vocab * (vocab * lse - sum_t)
        out = stats_ptr + row
        tl.store(out + STAT_LOSS * stats_stride, tl.where(valid, loss, 0.0))
        tl.store(out + STAT_LSE * stats_stride, tl.where(valid, lse, 0.0))
        tl.store(out + STAT_LOGPROB * stats_stride, tl.where(valid, (t_y - m) - log_s, 0.0))
        tl.store(out + STAT_LSE_LOW * stats_stride, tl.where(valid & (lse_low == lse_low), lse_low, 0.0))
        tl.store(out + STAT_ENTROPY * stats_stride, tl.where(valid, log_s - a / s, 0.0))
        tl.store(out + STAT_TOP1 * stats_stride, tl.where(valid & (best_idx == y), 1.0, 0.0))
        tl.store(out + STAT_MEAN * stats_stride, tl.where(valid, sum_t / vocab, 0.0))
        tl.store(out + STAT_LSSP * stats_stride, tl.where(valid, tl.log(q) - 2.0 * log_s, 0.0))


@triton.jit
def backward_kernel(
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    target_ptr,
    lse_ptr,
    lse_low_ptr,
    entropy_ptr,
    grad_loss_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    target_coef_ptr,
    weight_ptr,
    weight_sum_ptr,
    rows_per_program,
    extra_rows,
    vocab,
    n_cols,
    col_offset,
    ignore_index,
    eps,
    z_loss,
    softcap,
    inv_temp,
    HAS_GRAD_LOSS: tl.constexpr,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    TARGET_COEF: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Logits gradient of each row for per-row upstream gradients; ignored rows get zeros.

    ``dL/dt_j = p_j (c - g_H (log p_j + H)) + k [j == y] - g eps / V w_j`` with the row constants ``c`` and ``k`` below
    (see ``backends/base.py``), times ``dt/dz``. Each block is read before it is written, so ``grad`` may alias
    ``logits``. A row holds ``n_cols`` logits, the vocabulary's from ``col_offset`` on (all ``vocab`` of them but in
    a vocabulary chunk). ``TARGET_COEF``: the target column's gradient goes to ``target_coef_ptr`` in float32 and is
    written as 0, so that a 16-bit ``grad`` rounds only the softmax part (``AscendTileOps.forward_target_apart``).
    """
    pid = tl.program_id(0)
    row_start = pid * rows_per_program + tl.minimum(pid, extra_rows)
    my_rows = rows_per_program + tl.where(pid < extra_rows, 1, 0)
    cols = tl.arange(0, BLOCK)
    for r in range(0, my_rows):
        row = row_start + r
        row64 = row.to(tl.int64)
        row_ptr = logits_ptr + row64 * logits_stride
        out_ptr = grad_ptr + row64 * grad_stride
        y = tl.load(target_ptr + row)
        valid = y != ignore_index
        y = tl.where(valid, y, 0)
        lse = tl.where(valid, tl.load(lse_ptr + row), 0.0)
        lse_low = tl.where(valid, tl.load(lse_low_ptr + row), 0.0)
        if HAS_WEIGHT:
            w_y = tl.load(weight_ptr + y)
        else:
            w_y = 1.0
        if HAS_GRAD_LOSS:
            g = tl.where(valid, tl.load(grad_loss_ptr + row), 0.0)
        else:
            g = tl.zeros((), tl.float32)
        p_coef = g * (1.0 - eps) * w_y + 2.0 * z_loss * g * lse
        onehot = -g * (1.0 - eps) * w_y
        if SMOOTH:
            if HAS_WEIGHT:
                p_coef += g * eps / vocab * tl.load(weight_sum_ptr)
            else:
                p_coef += g * eps
        if HAS_GRAD_LOGPROB:
            g_lp = tl.where(valid, tl.load(grad_logprob_ptr + row), 0.0)
            p_coef -= g_lp
            onehot += g_lp
        if HAS_GRAD_ENTROPY:
            g_h = tl.where(valid, tl.load(grad_entropy_ptr + row), 0.0)
            entropy = tl.where(valid, tl.load(entropy_ptr + row), 0.0)
        target_coef = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            t = tl.load(row_ptr + offs, mask=mask, other=0.0)
            if SOFTCAP:
                th = _tanh(t / softcap)
                t = th * softcap
            t *= inv_temp
            # log p_j: t_j - lse first (exact where p_j counts), then lse's rounding error (base.py)
            log_p = (t - lse) - lse_low
            p = tl.exp(log_p)
            if HAS_GRAD_ENTROPY:
                grad = p * (p_coef - g_h * (log_p + entropy))
            else:
                grad = p * p_coef
            grad += tl.where(offs == y - col_offset, onehot, 0.0)
            if SMOOTH:
                if HAS_WEIGHT:
                    grad -= g * eps / vocab * tl.load(weight_ptr + col_offset + offs, mask=mask, other=0.0)
                else:
                    grad -= g * eps / vocab
            grad *= inv_temp
            if SOFTCAP:
                grad *= 1.0 - th * th
            grad = tl.where(valid, grad, 0.0)
            if TARGET_COEF:
                at_target = offs == y - col_offset
                target_coef += tl.sum(tl.where(at_target & mask, grad, 0.0), 0)
                grad = tl.where(at_target, 0.0, grad)
            tl.store(out_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=mask)
        if TARGET_COEF:
            tl.store(target_coef_ptr + row, target_coef)
