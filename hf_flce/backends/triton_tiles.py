"""Triton tile passes: one program per row of logits, looping over the vocabulary in blocks.

Forward reads each float32 row once for every statistic (online softmax) and, when the gradient is wanted, once more
to write it; backward reads each row once. A bf16 scalar loss (but label smoothing with class weights) needs one
read (``SCALED``): the sweep that takes the statistics also writes the gradient up to a row scale, as the Hopper
GEMM's epilogue does (``triton_scaled``). A 16-bit gradient can be written over the row's own bytes, so a chunk costs
4 bytes per logit in all. Options switch code on through ``tl.constexpr`` flags, so vanilla cross-entropy compiles to
the lean kernel. Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import cdiv, cuda_properties, next_power_of_2, triton_interpreting
from .base import TileParams, TileStats, check_columns
from .triton_launch import launch

if TYPE_CHECKING:
    from .triton_scaled import ScaledGradient

# Start of the running max: finite, so that exp(m_old - m_new) and (m_old - m_new) * 0 never give NaN.
_NEG_BIG = tl.constexpr(-3.0e38)
# Compiled kernels take libdevice's fast log and division (one hardware instruction each); the interpreter has no
# libdevice. Triton decides interpretation when a kernel is defined, as this does.
_COMPILED = tl.constexpr(not triton_interpreting())
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def fast_exp(x):
    """exp(x) as one hardware ex2. ``tl.exp`` adds a fix-up for results below 2**-126 (three more instructions per
    element); here they flush to 0, below anything a float32 sum or a 16-bit store can hold."""
    return tl.exp2(x * _LOG2E)


@triton.jit
def fast_log(x):
    """log(x) for x > 0 by the hardware lg2 (absolute error ~1e-7). ``tl.log`` is libdevice's ~30-instruction
    ``logf``."""
    if _COMPILED:
        return libdevice.fast_log2f(x) * _LN2
    else:
        return tl.log(x)


@triton.jit
def _reciprocal(x):
    """1 / x by the hardware's approximate division (within 2 ulp), without the range checks of ``tl.fdiv``."""
    if _COMPILED:
        return libdevice.fast_dividef(1.0, x)
    else:
        return 1.0 / x


# The epilogue GEMM's softcap (16-bit operands) takes the hardware's tanh.approx.f32: one MUFU instruction instead
# of exp, a reciprocal and five more instructions per logit. Measured on an H200 over [-6, 6] against float64: |error|
# <= 7.7e-6 (relative <= 1.1e-5), the slope 1 - tanh**2 within 1.3e-5, below the bf16 operands' own rounding
# (docs/PERF_NOTES.md v19). The tile passes, which read float32 logits, keep the exp form (float32-exact); so does
# the interpreter, and HF_FLCE_HW_TANH=0 (for A/Bs).
HW_TANH = tl.constexpr(not triton_interpreting() and os.environ.get("HF_FLCE_HW_TANH", "1") != "0")


@triton.jit
def _tanh_and_slope(x, HW: tl.constexpr):
    """tanh(x) and its derivative 1 - tanh(x)**2, by the hardware's tanh with ``HW``. The exp form takes
    e = exp(-2|x|) in (0, 1], which never overflows; near 0, 1 - e cancels: tanh is then good to ~1e-7 absolute, not
    relative, which is what a softcapped logit needs (its softmax reads differences of logits)."""
    if HW:
        th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        # |th| can round past 1 by its error; the slope stays >= 0
        slope = tl.maximum(1.0 - th * th, 0.0)
    else:
        e = fast_exp(-2.0 * tl.abs(x))
        r = _reciprocal(1.0 + e)
        big = (1.0 - e) * r
        th = tl.where(x < 0, -big, big)
        slope = 4.0 * e * r * r
    return th, slope


@triton.jit
def _transform(
    z,
    inv_softcap,
    t_scale,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HW: tl.constexpr = False,
):
    """Transformed logits t and dt/dz (unused, and folded away, in the plain case); ``HW``: the hardware's tanh."""
    if HAS_SOFTCAP:
        th, slope = _tanh_and_slope(z * inv_softcap, HW)
        t = th * t_scale
        dt = slope * inv_temperature
    elif HAS_TEMPERATURE:
        t = z * inv_temperature
        dt = inv_temperature
    else:
        t = z
        dt = 1.0
    return t, dt


@triton.jit
def exact_row(
    x_row,
    w_ptr,
    stride_wv,
    V,
    K,
    inv_softcap,
    t_scale,
    inv_temperature,
    e_row,
    e_cols,
    row_y,
    row_ty,
    row_lse,
    repair_above,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
):
    """The slow exact path for a row the scaled gradient's range cannot serve (the epilogue GEMM's merge and the tile
    pass's one sweep call it; never met by a model that trains), its logits ``t`` recomputed BV columns at a time by
    float32 dots. Returns the row's lse: ``row_lse`` unless that is inf (a sum against ``t_y + REF_OFFSET`` that
    overflowed), then computed again by online softmax (the running sum rescaled by ``exp(m_old - m_new)`` whenever a
    block raises the running max). Then a row whose loss exceeds ``repair_above`` gets ``E = exp(t - lse) dt`` written
    to ``e_row``'s ``e_cols`` leading columns (all V, or those a per-token loss keeps), 0 at ``row_y``."""
    FAST_TANH: tl.constexpr = HW_TANH and x_row.dtype.element_ty != tl.float32  # as the GEMM's epilogue
    cols = tl.arange(0, BV)
    ks = tl.arange(0, BK)
    # pass 0: the lse, where it overflowed; pass 1: E, where the loss is past the bf16 range of E and s x
    for p in range(2):
        if ((p == 0) & (row_lse == float("inf"))) | ((p == 1) & (row_lse - row_ty > repair_above)):
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.zeros((), tl.float32)
            for v0 in range(0, V, BV):
                col = v0 + cols
                col_ok = col < V
                acc = tl.zeros((BV,), tl.float32)
                for k0 in range(0, K, BK):
                    k_ok = (k0 + ks) < K
                    xk = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                    w = tl.load(
                        w_ptr + col.to(tl.int64)[:, None] * stride_wv + (k0 + ks)[None, :],
                        mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    acc += tl.sum(w * xk[None, :], 1)
                t, dt = _transform(acc, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE, FAST_TANH)
                if p == 0:
                    t = tl.where(col_ok, t, float("-inf"))
                    m_new = tl.maximum(m, tl.max(t, 0))
                    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(t - m_new), 0)
                    m = m_new
                else:
                    e = fast_exp(t - row_lse)
                    if HAS_SOFTCAP or HAS_TEMPERATURE:
                        e *= dt
                    e = tl.where(col == row_y, 0.0, e)
                    tl.store(e_row + col, e.to(e_row.dtype.element_ty), mask=col < e_cols)
            if p == 0:
                row_lse = m + tl.log(s)
    return row_lse


@triton.jit
def _row_stats(
    z_row,
    stride_zc,
    weight_ptr,
    v_read,
    inv_softcap,
    t_scale,
    inv_temperature,
    e_row,
    V,
    y,
    m_ref,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_WT: tl.constexpr,
    STORE_E: tl.constexpr,
    E_OVER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Running max m, sum e, sum e (t - m), sum e**2 (e = exp(t - m)), sum t, sum w t and the first argmax of one
    row, read once (online softmax: the sums are per lane, rescaled when m grows). ``STORE_E``: the same sweep also
    writes the scalar loss's ``E = exp(t - m_ref) dt`` to ``e_row``'s V columns (0 at column ``y`` and past
    ``v_read``), against the fixed reference ``m_ref`` (``triton_scaled``). It then runs from the row's end, so that
    ``E_OVER_ROW``, E in the second half of the row's own float32 bytes, only overwrites logits already read (see
    ``_tile_kernel``'s gradient loop)."""
    cols = tl.arange(0, BLOCK)
    m = tl.full((), _NEG_BIG, tl.float32)
    best = tl.zeros((), tl.int32)
    s = tl.zeros((BLOCK,), tl.float32)
    se = tl.zeros((BLOCK,), tl.float32)
    s2 = tl.zeros((BLOCK,), tl.float32)
    st = tl.zeros((BLOCK,), tl.float32)
    swt = tl.zeros((BLOCK,), tl.float32)
    n_blocks = tl.cdiv(V if STORE_E else v_read, BLOCK)
    for i in range(0, n_blocks):
        start = (n_blocks - 1 - i) * BLOCK if STORE_E else i * BLOCK
        offs = start + cols
        mask = offs < v_read
        z = tl.load(z_row + offs * stride_zc, mask=mask, other=0.0)
        if E_OVER_ROW:
            # another warp's store below may land on elements this block reads: every load first
            tl.debug_barrier()
        t, dt = _transform(z, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE)
        t_or_inf = tl.where(mask, t, float("-inf"))
        block_max = tl.max(t_or_inf, 0)
        # The running max rarely changes after the first blocks: rescale the sums only when it does.
        if block_max > m:
            alpha = fast_exp(m - block_max)
            se = (se + (m - block_max) * s) * alpha
            s = s * alpha
            s2 = s2 * (alpha * alpha)
            # strict >: an earlier block keeps a tie, and tl.argmax takes the first index within a block
            best = start + tl.argmax(t_or_inf, 0)
            m = block_max
        elif STORE_E:
            if block_max == m:
                # from the row's end, a tie goes to the block of lower columns
                best = start + tl.argmax(t_or_inf, 0)
        e = fast_exp(t_or_inf - m)
        se += e * (t - m)
        s += e
        s2 += e * e
        st += t
        if HAS_WT:
            swt += tl.load(weight_ptr + offs, mask=mask, other=0.0) * t
        if STORE_E:
            e_ref = fast_exp(t_or_inf - m_ref)
            if HAS_SOFTCAP or HAS_TEMPERATURE:
                e_ref *= dt
            e_ref = tl.where(offs == y, 0.0, e_ref)
            tl.store(e_row + offs, e_ref.to(e_row.dtype.element_ty), mask=offs < V)
    return m, tl.sum(s, 0), tl.sum(se, 0), tl.sum(s2, 0), tl.sum(st, 0), tl.sum(swt, 0), best


@triton.jit
def row_grad_coefs(
    rows,
    valid,
    lse,
    entropy,
    w_y,
    weight_sum_ptr,
    gl_ptr,
    stride_gl,
    glp_ptr,
    stride_glp,
    ge_ptr,
    stride_ge,
    smoothing,
    smooth_over_v,
    z_loss,
    HAS_GL: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Per-row coefficients (zero at ignored rows; ``rows`` a row index or a vector of them) of the logits gradient
    of g_loss * loss + g_logprob * logp + g_entropy * H (see base.py):
    g_j = p_j * (p_coef - g_entropy * (log p_j + H)) + [j == y] * onehot_coef - smooth_coef * w_j."""
    zero = tl.zeros_like(lse)
    p_coef = zero
    onehot_coef = zero
    smooth_coef = zero
    g_entropy = zero
    if HAS_GL:
        g_loss = tl.load(gl_ptr + rows * stride_gl, mask=valid, other=0.0).to(tl.float32)
        wl = g_loss * (1.0 - smoothing) * w_y
        p_coef = wl
        onehot_coef = -wl
        if HAS_SMOOTHING:
            smooth_coef = g_loss * smooth_over_v
            if HAS_WEIGHT:
                p_coef += smooth_coef * tl.load(weight_sum_ptr)
            else:
                p_coef += g_loss * smoothing
        if HAS_ZLOSS:
            p_coef += g_loss * (2.0 * z_loss) * lse
    if HAS_GLP:
        g_logprob = tl.load(glp_ptr + rows * stride_glp, mask=valid, other=0.0).to(tl.float32)
        p_coef -= g_logprob
        onehot_coef += g_logprob
    if HAS_GE:
        g_entropy = tl.load(ge_ptr + rows * stride_ge, mask=valid, other=0.0).to(tl.float32)
    return p_coef, onehot_coef, smooth_coef, g_entropy


@triton.jit
def logit_grad(p, log_p, is_target, p_coef, onehot_coef, g_entropy, entropy, HAS_GE: tl.constexpr):
    """p_j * (p_coef - g_entropy * (log p_j + H)) + [j == y] * onehot_coef: the gradient before smoothing and dt/dz.
    ``log_p`` (read with HAS_GE) is t_j - lse taken so that no large offset the logits share is left in it: t_j - lse
    as one difference would carry lse's rounding into every p_j's term (base.py)."""
    if HAS_GE:
        g = p * (p_coef - g_entropy * (log_p + entropy))
    else:
        g = p * p_coef
    return g + tl.where(is_target, onehot_coef, 0.0)


@triton.jit
def _tile_kernel(
    z_ptr,
    stride_zr,
    stride_zc,
    target_ptr,
    stride_y,
    weight_ptr,
    weight_sum_ptr,
    lse_ptr,
    stride_lse,
    lse_low_ptr,
    entropy_ptr,
    stride_entropy,
    loss_ptr,
    logprob_ptr,
    top1_ptr,
    mean_ptr,
    lssp_ptr,
    gl_ptr,
    stride_gl,
    glp_ptr,
    stride_glp,
    ge_ptr,
    stride_ge,
    g_ptr,
    stride_gr,
    stride_gc,
    target_coef_ptr,
    row_scale_ptr,
    uniform_ptr,
    x_ptr,
    stride_xn,
    w_ptr,
    stride_wv,
    K,
    ref_offset,
    repair_above,
    V,
    col_offset,
    ignore_index,
    smoothing,
    smooth_over_v,
    z_loss,
    inv_softcap,
    t_scale,
    inv_temperature,
    STATS: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    GRAD_OVER_ROW: tl.constexpr,
    TARGET_APART: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_LSE_LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row. STATS (forward): computes and stores the row's statistics (with HAS_LSE_LOW lse's rounding error at
    ``lse_low_ptr + row``, ``base.lse_pair``), else (backward) reads its lse (and that error, with HAS_LSE_LOW) and
    entropy. Then, with any upstream gradient (HAS_GL, HAS_GLP, HAS_GE), writes
    d/dz of g_loss * loss + g_logprob * logp + g_entropy * H (see base.py). Ignored rows read no logits, and get
    zero statistics and a zero gradient. In backward the row's V logits may be a vocabulary chunk's, the columns from
    ``col_offset`` on (STATS needs the whole row, ``col_offset`` 0). TARGET_APART: the target column is written as 0
    and its gradient stored in float32 at ``target_coef_ptr + row`` (0 at ignored rows). SCALED (with STATS,
    TARGET_APART and HAS_GL alone; label smoothing without class weights): one sweep instead of two, writing the
    scalar loss's ``E = exp(t - m) dt`` against ``m = t_y + ref_offset`` while it takes the statistics, and the row
    scale ``r`` at ``row_scale_ptr + row`` with ``G = r E + u`` off the target column (``triton_scaled``), ``u`` the
    label smoothing's uniform term, stored at ``uniform_ptr + row`` (HAS_SMOOTHING). A row whose loss exceeds
    ``repair_above`` has E written again with ``m = lse`` from ``x`` and ``W`` (``exact_row``)."""
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(target_ptr + row * stride_y)
    valid = y != ignore_index
    y = tl.where(valid, y, 0)
    z_row = z_ptr + row * stride_zr
    v_read = tl.where(valid, V, 0)
    if HAS_WEIGHT:
        w_y = tl.load(weight_ptr + y)
    else:
        w_y = 1.0

    g_row = g_ptr + row * stride_gr
    if STATS:
        # read before the sweep: with SCALED, E may overwrite it
        z_y = tl.load(z_row + y * stride_zc, mask=valid, other=0.0)
        t_y, dt_y = _transform(z_y, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE)
        # +inf at ignored rows: their E is 0
        m_ref = tl.where(valid, t_y + ref_offset, float("inf"))
        m, sum_exp, sum_e_tm, sum_e2, sum_t, sum_wt, best = _row_stats(
            z_row,
            stride_zc,
            weight_ptr,
            v_read,
            inv_softcap,
            t_scale,
            inv_temperature,
            g_row,
            V,
            y,
            m_ref,
            HAS_SOFTCAP,
            HAS_TEMPERATURE,
            HAS_SMOOTHING and HAS_WEIGHT,
            SCALED,
            GRAD_OVER_ROW,
            BLOCK,
        )
        # ignored rows summed nothing: this keeps their (discarded) stats finite
        m = tl.where(valid, m, 0.0)
        sum_exp = tl.where(valid, sum_exp, 1.0)
        log_sum_exp = tl.log(sum_exp)
        lse = m + log_sum_exp
        # log p_j = (t_j - m) - log sum e below: m and the logits near it may share a large offset, which cancels
        # exactly in t_j - m; lse = m + log sum e rounds it back in (base.py)
        ref = m
        ref_low = log_sum_exp
        # H = lse - sum p t = log(sum e) - sum e (t - m) / sum e: no cancellation of two large terms
        entropy = log_sum_exp - sum_e_tm / sum_exp
        loss = (1.0 - smoothing) * w_y * (log_sum_exp - (t_y - m))
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                loss += smooth_over_v * (tl.load(weight_sum_ptr) * lse - sum_wt)
            else:
                loss += smooth_over_v * (V * lse - sum_t)
        if HAS_ZLOSS:
            loss += z_loss * lse * lse
        log_sum_sq = tl.log(tl.where(valid, sum_e2, 1.0)) - 2.0 * log_sum_exp
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row * stride_lse, tl.where(valid, lse, 0.0))
        if HAS_LSE_LOW:
            # two-sum: the exact rounding error of m + log sum e
            b = lse - m
            lse_low = (m - (lse - b)) + (log_sum_exp - b)
            tl.store(lse_low_ptr + row, tl.where(valid & (lse_low == lse_low), lse_low, 0.0))
        tl.store(logprob_ptr + row, tl.where(valid, (t_y - m) - log_sum_exp, 0.0))
        tl.store(entropy_ptr + row * stride_entropy, tl.where(valid, entropy, 0.0))
        tl.store(top1_ptr + row, (valid & (best == y)).to(tl.int8))
        tl.store(mean_ptr + row, tl.where(valid, sum_t / V, 0.0))
        tl.store(lssp_ptr + row, tl.where(valid, log_sum_sq, 0.0))
    else:
        lse = tl.where(valid, tl.load(lse_ptr + row * stride_lse), 0.0)
        ref = lse
        ref_low = 0.0
        if HAS_LSE_LOW:
            ref_low = tl.where(valid, tl.load(lse_low_ptr + row), 0.0)
        entropy = 0.0
        if HAS_GE:
            entropy = tl.where(valid, tl.load(entropy_ptr + row * stride_entropy), 0.0)

    if HAS_GL or HAS_GLP or HAS_GE:
        # grad_j = (p_j * (p_coef - g_entropy * t_j) + [j == y] * onehot_coef - smooth_coef * w_j) * dt_j/dz_j
        p_coef, onehot_coef, smooth_coef, g_entropy = row_grad_coefs(
            row,
            valid,
            lse,
            entropy,
            w_y,
            weight_sum_ptr,
            gl_ptr,
            stride_gl,
            glp_ptr,
            stride_glp,
            ge_ptr,
            stride_ge,
            smoothing,
            smooth_over_v,
            z_loss,
            HAS_GL,
            HAS_GLP,
            HAS_GE,
            HAS_SMOOTHING,
            HAS_ZLOSS,
            HAS_WEIGHT,
        )
    if SCALED:
        repair = valid & (lse - t_y > repair_above)
        if repair:
            exact_row(
                x_ptr + row * stride_xn,
                w_ptr,
                stride_wv,
                V,
                K,
                inv_softcap,
                t_scale,
                inv_temperature,
                g_row,
                V,
                y,
                t_y,
                lse,
                repair_above,
                HAS_SOFTCAP,
                HAS_TEMPERATURE,
                128,
                64,
            )
        # G_j = p_j p_coef dt_j (+ u) = E_j exp(m - lse) p_coef off the target column; at it (p_y p_coef + onehot) dt_y
        scale = fast_exp(tl.where(repair, lse, m_ref) - lse) * p_coef
        p_y = fast_exp(tl.minimum(t_y - lse, 0.0))
        tl.store(row_scale_ptr + row, tl.where(valid, scale, 0.0))
        tl.store(target_coef_ptr + row, tl.where(valid, (p_y * p_coef + onehot_coef) * dt_y, 0.0))
        if HAS_SMOOTHING:
            # -smooth_coef dt_j at every column, the target's too: rank one, as no softcap makes dt the row's constant
            tl.static_assert(not HAS_WEIGHT and not HAS_SOFTCAP)
            tl.store(uniform_ptr + row, tl.where(valid, -smooth_coef * dt_y, 0.0))
    elif HAS_GL or HAS_GLP or HAS_GE:
        cols = tl.arange(0, BLOCK)
        n_blocks = tl.cdiv(V, BLOCK)
        y_col = y - col_offset
        target_grad = tl.zeros((), tl.float32)
        # Backwards from the row's end: in forward the tail was read last, so it is the part most likely still in
        # L2. It also makes a 16-bit gradient written over the second half of the row's own float32 bytes safe: the
        # block at `start` writes bytes [2V + 2 start, ...), i.e. float32 elements >= (V + start) / 2 >= start,
        # which this program has already read (the barrier orders the warps within a block).
        for i in range(0, n_blocks):
            start = (n_blocks - 1 - i) * BLOCK
            offs = start + cols
            in_row = offs < V
            z = tl.load(z_row + offs * stride_zc, mask=offs < v_read, other=0.0)
            if GRAD_OVER_ROW:
                # Another warp's store below may land on elements this block reads: every load first.
                tl.debug_barrier()
            t, dt = _transform(z, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE)
            is_target = offs == y_col
            log_p = (t - ref) - ref_low
            g = logit_grad(fast_exp(log_p), log_p, is_target, p_coef, onehot_coef, g_entropy, entropy, HAS_GE)
            if HAS_GL and HAS_SMOOTHING:
                if HAS_WEIGHT:
                    g -= smooth_coef * tl.load(weight_ptr + col_offset + offs, mask=in_row, other=0.0)
                else:
                    g -= smooth_coef
            if HAS_SOFTCAP or HAS_TEMPERATURE:
                g *= dt
            if TARGET_APART:
                if (y_col >= start) & (y_col < start + BLOCK):
                    target_grad = tl.sum(tl.where(is_target, g, 0.0), 0)
                g = tl.where(is_target, 0.0, g)
            tl.store(g_row + offs * stride_gc, g.to(g_row.dtype.element_ty), mask=in_row)
        if TARGET_APART:
            tl.store(target_coef_ptr + row, target_grad)


@triton.jit
def _scale_kernel(src_ptr, dst_ptr, scale_ptr, n, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src * scale in float32, stored in dst's dtype; the scale is read on the device (no host sync). In place,
    a scale of 1 (a loss's usual upstream gradient) moves no data: every load and store is masked off."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr)
    if IN_PLACE:
        n = tl.where(scale != 1.0, n, 0)
    mask = offs < n
    values = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(dst_ptr + offs, values.to(dst_ptr.dtype.element_ty), mask=mask)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def launch_config(vocab: int, rows: int, device: torch.device) -> tuple[int, int]:
    """Block size and warps per row-program. One program owns a row: with about 12 rows per SM or more, one warp on
    blocks of 512 streams best; with fewer rows each program needs more warps. Measured on an H200
    (``scripts/profile_head.py``, sweep section, V = 128256 and 151936): at 2048 rows one warp reaches 4.0 TB/s for
    the forward with gradient where two warps reached 2.9-3.0; at 1024 rows blocks of 2048 on 4 warps do best
    overall (statistics 2.0, forward with gradient 3.0-3.2, backward 4.0-4.5 TB/s)."""
    if device.type != "cuda":
        # the interpreter: few, wide numpy operations are faster
        return min(next_power_of_2(vocab), 256), 1
    sms = cuda_properties(device).multi_processor_count
    block, num_warps = (512, 1) if rows >= 12 * sms else (2048, 4) if rows >= 4 * sms else (4096, 8)
    return min(next_power_of_2(vocab), block), num_warps


class TritonTileOps:
    """``TileOps`` in Triton. ``block`` and ``num_warps`` override the launch configuration (tests use a small
    block to cover several blocks per row and a ragged tail)."""

    name = "triton"
    # The kernels keep only per-row scalars: no [rows, V] temporaries.
    scratch_bytes_per_logit = 0
    # A 16-bit gradient may live in the second half of each float32 logits row (see the gradient loop).
    grad_in_row_tail = True

    def __init__(
        self,
        block: int | None = None,
        num_warps: int | None = None,
        gemm_epilogue: bool | None = None,
    ):
        self.block = block
        self.num_warps = num_warps
        # The logits GEMM with the softmax in its epilogue (``triton_gemm``), for 16-bit calls without class weights
        # (nor softcap with label smoothing). By default on Hopper and newer GPUs, where it was measured faster than
        # cuBLAS plus the tile passes (docs/PERF_NOTES.md, v6); ``HF_FLCE_GEMM_EPILOGUE=1`` (or ``gemm_epilogue=True``)
        # uses it on every GPU, ``=0`` (``False``) never.
        if gemm_epilogue is None:
            gemm_epilogue = {"1": True, "0": False}.get(os.environ.get("HF_FLCE_GEMM_EPILOGUE", "auto"))
        from . import triton_gemm  # it builds on this module's jit helpers

        self.fused_head = None if gemm_epilogue is False else triton_gemm
        # the compaction in one launch (``triton_gemm.kept_order``), on the tile path too (``engine._compaction``)
        self.compaction = triton_gemm
        self.gemm_min_capability = 9 if gemm_epilogue is None else 0

    def _config(self, vocab: int, rows: int, device: torch.device) -> tuple[int, int]:
        block, num_warps = launch_config(vocab, rows, device)
        if self.block is not None:
            block = min(next_power_of_2(vocab), self.block)
        return block, self.num_warps or num_warps

    @staticmethod
    def _device_guard(device: torch.device):
        """Kernels launch on the current device: make it ``device``'s (no guard when it already is, which saves the
        guard's host time on every launch)."""
        if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(device)

    def _launch(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        params: TileParams,
        lse: torch.Tensor,
        entropy: torch.Tensor,
        upstream: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
        grad_out: torch.Tensor | None,
        stats: TileStats | None,
        first_column: int = 0,
        target_coef: torch.Tensor | None = None,
        scaled: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None,
        lse_low: torch.Tensor | None = None,
    ) -> None:
        """Runs the kernel over every row: ``stats`` given, it fills them (and ``lse``, ``entropy``, which are its
        fields); else it reads ``lse`` and ``entropy``. Any upstream gradient given, it writes ``grad_out``, with
        ``target_coef`` (float32 ``[rows]``) its target column there and 0 in ``grad_out``. ``logits`` holds the
        vocabulary's columns from ``first_column`` on (backward only). ``scaled = (row_scale, uniform, x, weight)``:
        the kernel's SCALED sweep, ``grad_out`` then ``E``, ``row_scale`` (float32 ``[rows]``) its row scales and
        ``uniform`` (float32 ``[rows]``, with label smoothing) the uniform term. ``lse_low``: lse's rounding error,
        written with ``stats`` (``stats.lse_low``), else read (None: 0)."""
        rows, n_cols = logits.shape
        if rows == 0:
            return
        if any(g is not None for g in upstream) and grad_out is None:
            raise ValueError("an upstream gradient needs grad_out")
        # unused pointers: any tensor on the device
        spare = lse
        outputs = [spare] * 5
        if stats is not None:
            outputs = [stats.loss, stats.logprob, stats.is_top1.view(torch.int8), stats.mean_logit]
            outputs.append(stats.log_sum_sq_probs)
            lse_low = stats.lse_low
        vectors = []
        for g in upstream:
            g = spare if g is None else g
            vectors += [g, g.stride(0)]
        grad = logits if grad_out is None else grad_out
        cw, cw_sum = params.class_weight, params.class_weight_sum
        softcap = params.softcap
        block, num_warps = self._config(n_cols, rows, logits.device)
        row_scale, uniform, x, weight = (spare, spare, spare, spare) if scaled is None else scaled
        # without the scaled sweep the hidden size is unused: a constant, not the spare's row count, which Triton
        # would specialize on (a count divisible by 16 would compile another variant)
        hidden = 0 if scaled is None else x.shape[-1]
        ref_offset = repair_above = 0.0
        if scaled is not None:
            from . import triton_scaled  # it builds on this module's kernels

            ref_offset, repair_above = triton_scaled.REF_OFFSET, triton_scaled.REPAIR_ABOVE
        with self._device_guard(logits.device):
            launch(
                _tile_kernel,
                (rows,),
                logits,
                logits.stride(0),
                logits.stride(1),
                target,
                target.stride(0),
                spare if cw is None else cw,
                spare if cw_sum is None else cw_sum,
                lse,
                lse.stride(0),
                spare if lse_low is None else lse_low,
                entropy,
                entropy.stride(0),
                *outputs,
                *vectors,
                grad,
                grad.stride(0),
                grad.stride(1),
                spare if target_coef is None else target_coef,
                row_scale,
                spare if uniform is None else uniform,
                x,
                x.stride(0),
                weight,
                weight.stride(0),
                hidden,
                ref_offset,
                repair_above,
                n_cols,
                first_column,
                params.ignore_index,
                params.label_smoothing,
                params.label_smoothing / params.vocab,
                params.z_loss,
                0.0 if softcap is None else 1.0 / softcap,
                0.0 if softcap is None else softcap * params.inv_temperature,
                params.inv_temperature,
                STATS=stats is not None,
                HAS_GL=upstream[0] is not None,
                HAS_GLP=upstream[1] is not None,
                HAS_GE=upstream[2] is not None,
                HAS_SMOOTHING=params.label_smoothing != 0.0,
                HAS_ZLOSS=params.z_loss != 0.0,
                HAS_SOFTCAP=softcap is not None,
                HAS_TEMPERATURE=params.inv_temperature != 1.0,
                HAS_WEIGHT=cw is not None,
                GRAD_OVER_ROW=grad.dtype != logits.dtype and _same_storage(grad, logits),
                TARGET_APART=target_coef is not None,
                SCALED=scaled is not None,
                HAS_LSE_LOW=lse_low is not None,
                BLOCK=block,
                num_warps=num_warps,
            )

    def scale_into(self, src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = src * scale`` (``scale`` a float32 0-d tensor, ``out`` may be ``src``) in one pass. torch's own
        mixed-dtype multiply takes its slow non-vectorized path here (~1.3 TB/s on an H200)."""
        if not (src.is_contiguous() and out.is_contiguous()) or src.numel() != out.numel():
            return torch.mul(src, scale, out=out)
        n = src.numel()
        if n:
            block = 4096
            with self._device_guard(src.device):
                in_place = src.data_ptr() == out.data_ptr() and src.dtype == out.dtype
                launch(
                    _scale_kernel,
                    (cdiv(n, block),),
                    src,
                    out,
                    scale,
                    n,
                    IN_PLACE=in_place,
                    BLOCK=block,
                    num_warps=8,
                )
        return out

    def forward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        params: TileParams,
        grad_scale: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
    ) -> TileStats:
        rows = logits.shape[0]
        stats = TileStats.empty(rows, logits.device, lse_low=True)
        self._launch(logits, target, params, stats.lse, stats.entropy, (grad_scale, None, None), grad_out, stats)
        return stats

    @staticmethod
    def add_target_rows(
        dw: torch.Tensor, x: torch.Tensor, target: torch.Tensor, coef: torch.Tensor, ignore_index: int
    ) -> None:
        """``dW[y_i] += c_i x_i`` with ``x`` as it is (float32 not rounded), each dW row updated once in a fixed order:
        no atomics, so the result is bitwise the same run to run."""
        from .triton_scaled import ScaledGradient  # it builds on this module's kernels

        ScaledGradient.add_target_rows(dw, x, None, target, coef, ignore_index, operand_dtype=None)

    def forward_target_apart(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        params: TileParams,
        grad_scale: torch.Tensor,
        grad_out: torch.Tensor,
        x: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
    ) -> tuple[TileStats, ScaledGradient]:
        """``forward`` with the gradient's target column taken out of ``grad_out`` (0 there) and carried per row in
        float32: the gradient comes back as a ``ScaledGradient``, whose dX and dW add that column in float32
        (``dX = G W + c W[y]``, ``dW = G^T X + sum_i c_i e_{y_i} x_i^T``). A 16-bit ``grad_out`` then rounds only the
        softmax part, so dW can be summed across chunks in the 16-bit gradient itself (``engine.
        _dw_sum_in_weight_dtype``). Given the logits GEMM's operands ``x`` and ``weight`` where ``one_sweep`` allows,
        ``grad_out`` gets ``E`` and the gradient has row scales, from one sweep over the logits instead of two (the
        slow exact path of a row past ``E``'s range recomputes its logits from them); else it has unit row scales.
        With label smoothing the one sweep also needs a spare row after ``grad_out``'s last in its buffer, for the
        row of ones that carries the uniform term (``ScaledGradient.dx_operand``, ``dw_operands``)."""
        from .triton_scaled import ScaledGradient  # it builds on this module's kernels

        rows = logits.shape[0]
        stats = TileStats.empty(rows, logits.device)
        coef = torch.empty(rows, dtype=torch.float32, device=logits.device)
        sweep = (
            x is not None
            and weight is not None
            and self.one_sweep(grad_out.dtype, params)
            and grad_out.stride(1) == 1
            and x.stride(-1) == 1
            and weight.stride(-1) == 1
        )
        smoothing = params.label_smoothing != 0.0
        if smoothing:
            sweep = sweep and ScaledGradient.has_spare_row(grad_out)
        row_scale = uniform = scaled = None
        if sweep:
            row_scale = torch.empty(rows, dtype=torch.float32, device=logits.device)
            uniform = torch.empty(rows, dtype=torch.float32, device=logits.device) if smoothing else None
            scaled = (row_scale, uniform, x, weight)
        upstream = (grad_scale, None, None)
        self._launch(logits, target, params, stats.lse, stats.entropy, upstream, grad_out, stats, 0, coef, scaled)
        return stats, ScaledGradient(grad_out, row_scale, coef, target, params.ignore_index, uniform)

    @staticmethod
    def one_sweep(dtype: torch.dtype, params: TileParams) -> bool:
        """Whether ``forward_target_apart`` can write ``E`` and row scales in one sweep: a gradient that can be
        carried so (``triton_scaled.supports``: bf16, label smoothing without a softcap; ``HF_FLCE_SCALED_GRAD=0``
        keeps the two sweeps). A class weight is a row scale, ``w_y``, but with label smoothing it makes the
        smoothing term ``-eps w_j / V`` differ by column, no longer the uniform term."""
        from . import triton_scaled  # it builds on this module's kernels

        return triton_scaled.supports(dtype, None, params) and (
            params.label_smoothing == 0.0 or params.class_weight is None
        )

    def backward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        lse: torch.Tensor,
        entropy: torch.Tensor,
        params: TileParams,
        grad_loss: torch.Tensor | None,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        grad_out: torch.Tensor,
        first_column: int = 0,
        lse_low: torch.Tensor | None = None,
    ) -> None:
        check_columns(first_column, logits.shape[1], params.vocab)
        upstream = (grad_loss, grad_logprob, grad_entropy)
        self._launch(logits, target, params, lse, entropy, upstream, grad_out, None, first_column, lse_low=lse_low)
