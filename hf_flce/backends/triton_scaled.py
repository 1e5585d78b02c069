"""The scalar loss's logits gradient as a row-scaled matrix, so that no pass over ``[rows, V]`` runs between the
logits GEMM and the two gradient GEMMs.

The gradient of a scalar loss (``base.py``) is

    G_ij = (p_ij P_i + [j == y_i] O_i) dt_ij + u_i,    p_ij = exp(t_ij - lse_i)

with per-row coefficients ``P_i`` (the upstream scale, times ``1 + 2 z lse_i`` with a z-loss), ``O_i = -(1 - eps)
upstream`` and, with label smoothing ``eps`` (no softcap: ``dt`` is the constant ``1 / temperature``), the uniform
term ``u_i = -(eps / V) dt upstream``.
The epilogue GEMM (``triton_gemm``, ``MODE_SCALED``) cannot write ``G`` (``lse_i`` is known only once every column
tile of the row is done), so it writes, in bf16,

    E_ij = exp(t_ij - m_i) dt_ij,    m_i = t_y,i + REF_OFFSET

against a reference fixed before the GEMM (the one the GEMM's statistics are taken against when the call asks for
no optional statistic, so that ``E`` is the epilogue's ``exp`` itself). Then ``G_ij = s_i E_ij`` off the target
column, with ``s_i = P_i exp(m_i - lse_i)``, and the target column is taken out of ``E`` (set to 0) and carried
exactly in float32 as ``c_i = (p_y P_i + O_i) dt_y``:

    dX = diag(s) (E W) + diag(c) W[y]        dW = E^T diag(s) X + sum_i c_i e_{y_i} x_i^T

``E W`` comes from cuBLAS with a float32 output and ``E^T (s X)`` from cuBLAS as before; the row scaling, the target
terms and the scatter of the rows are ``[rows, H]`` passes. The old way (fp16 ``e`` relative to each tile's max, then
a pass turning it into ``G``) read and wrote 4 bytes per logit more: 2.5-2.9 ms of qwen3-0.6b's 25 ms fwd+bwd on an
H200. The target term in float32 also removes ``G_iy``'s bf16 rounding, which dominates the error of the target rows
(a float64 simulation: dW error 1.66e-3 against 1.72e-3 flat and 2.3e-3 peaked before; stock 1.73e-3 / 1.6e-2).

Label smoothing's uniform term is rank one. It adds ``u_i 1^T W`` to dX's rows: on the epilogue path ``1^T W``, W's
column sum, is taken once per call, and it also gives the loss's ``sum_j t_ij`` as ``x_i . 1^T W``; the tile path's
sweep sums ``t`` itself and takes ``1^T W`` from dX's GEMM, as the product's row for a row of ones under ``E``
(``dx_operand``). It adds ``u^T X`` to every row of dW, which each chunk's dW GEMM adds itself: ``E`` gets that row of
ones, over that chunk's ``u^T X`` (summed in float32 by the pass that writes ``s X``, then rounded to bf16) under
``s X`` (``dw_operands``). No pass over ``[rows, V]`` or ``[V, H]`` is made for it. Unlike the target terms, it stays
in dW's 16-bit sum across chunks (``engine._dw_sum_in_weight_dtype``). For a flat row it offsets much of the softmax
part (``p_j - eps / V``): summed apart from it and added once, by the last chunk's GEMM, it made that sum's running
values, and so their roundings, larger. At V = 300 (H100) dW's error was 2.74e-3 against 2.61e-3 at ``eps = 0.6``,
and 2.16e-3 at ``eps = 0.1``, past 1.1 times the column-in gradient pass's 1.84e-3, which this sum stays within.

Range. ``E_ij <= exp(lse_i - t_y,i - REF_OFFSET)`` and ``s_i x_i ~ exp(REF_OFFSET - (lse_i - t_y,i))``: while the row's
loss ``lse - t_y`` stays below ``REPAIR_ABOVE`` (64 nats) both lie well inside bf16's range (``exp(+-32)``), and the
entries that matter (within ~40 nats of the row max) stay normal numbers. A row past it (``p_y < e^-64``) is written
again by ``_row_scales_kernel`` with ``m_i = lse_i`` (then ``E_ij = p_ij dt_ij``), recomputing its logits with a
float32 dot per column: slow, and never met in practice, but exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import cdiv, next_power_of_2
from .base import TileParams
from .triton_launch import launch
from .triton_tiles import TritonTileOps, fast_exp

REF_OFFSET = 32.0
REPAIR_ABOVE = 64.0
# rows per program of ``scale_rows``
SCALE_ROWS_BLOCK = 16


def supports(x_dtype: torch.dtype, bias: torch.Tensor | None, params: TileParams, scalar: bool = True) -> bool:
    """Whether a loss's gradient can be carried as ``E`` and row scales: bf16 operands (fp16 cannot hold
    ``exp(+-32)``) and no bias (its gradient would need ``E^T s``). Label smoothing only for a scalar loss (its
    ``-eps/V`` term is carried as the uniform term, which the per-token backward does not take) and without a softcap
    (then ``dt`` differs by column and the term is no longer rank one). ``HF_FLCE_SCALED_GRAD=0`` turns it off (for
    A/B measurements: the epilogue path's gradient pass over stored e, the tile path's two sweeps)."""
    if os.environ.get("HF_FLCE_SCALED_GRAD", "1") == "0":
        return False
    smoothing_ok = params.label_smoothing == 0.0 or (scalar and params.softcap is None)
    return x_dtype == torch.bfloat16 and bias is None and smoothing_ok


@triton.jit(do_not_specialize=["N"])
def _row_scales_kernel(
    e_ptr,
    stride_en,
    y_ptr,
    ty_ptr,
    lse_ptr,
    g_ptr,
    r_ptr,
    q_ptr,
    u_ptr,
    N,
    e_cols,
    ignore_index,
    t_scale,
    inv_temperature,
    smoothing,
    smooth_over_v,
    z_loss,
    ref_offset,
    repair_above,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    HAS_UPSTREAM: tl.constexpr,
    BR: tl.constexpr,
):
    """Per row, per unit of upstream gradient (times the 0-d ``g`` with ``HAS_UPSTREAM``): the scale
    ``r = exp(m - lse) (1 + 2 z lse)`` of ``E``, the target column's gradient less the uniform term,
    ``q = (p_y (1 + 2 z lse) - (1 - eps)) dt_y``, and with label smoothing the uniform term ``u = -(eps / V) dt``
    (all 0 at ignored rows); ``E``'s target column is set to 0 where ``E`` holds it (its ``e_cols`` leading columns:
    all, or those a per-token loss keeps). Rows whose loss exceeds ``repair_above`` had ``E``
    written again with ``m = lse`` by the merge (``exact_row``), so ``r = 1 + 2 z lse`` there."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (y != ignore_index)
    lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
    t_y = tl.load(ty_ptr + rows, mask=valid, other=0.0)
    repair = valid & (lse - t_y > repair_above)
    z_factor = tl.full((BR,), 1.0, tl.float32)
    if HAS_ZLOSS:
        z_factor += 2.0 * z_loss * lse
    # the merge clamps log p_y at 0 (t_y comes from its own dot): so does p_y here
    p_y = fast_exp(tl.minimum(t_y - lse, 0.0))
    if HAS_SOFTCAP:
        th = t_y * (1.0 / t_scale)
        dt_y = tl.maximum(1.0 - th * th, 0.0) * inv_temperature
    elif HAS_TEMPERATURE:
        dt_y = tl.full((BR,), 1.0, tl.float32) * inv_temperature
    else:
        dt_y = tl.full((BR,), 1.0, tl.float32)
    ref = tl.where(repair, lse, t_y + ref_offset)
    r = tl.where(valid, fast_exp(ref - lse) * z_factor, 0.0)
    q = tl.where(valid, (p_y * z_factor - (1.0 - smoothing)) * dt_y, 0.0)
    # no softcap with label smoothing (supports): dt_y is the row's dt at every column
    u = tl.where(valid, -smooth_over_v * dt_y, 0.0)
    if HAS_UPSTREAM:
        g = tl.load(g_ptr)
        r *= g
        q *= g
        u *= g
    tl.store(r_ptr + rows, r, mask=row_ok)
    tl.store(q_ptr + rows, q, mask=row_ok)
    if HAS_SMOOTHING:
        tl.store(u_ptr + rows, u, mask=row_ok)
    e_rows = e_ptr + rows.to(tl.int64) * stride_en
    in_e = valid & (y < e_cols)
    tl.store(e_rows + tl.where(in_e, y, 0), tl.zeros((BR,), tl.float32).to(e_ptr.dtype.element_ty), mask=in_e)


@triton.jit(do_not_specialize=["n", "row0"])
def _scaled_rows_kernel(
    src_ptr,
    stride_src,
    s_ptr,
    c_ptr,
    y_ptr,
    w_ptr,
    stride_wv,
    u_ptr,
    w_sum_ptr,
    u_sum_ptr,
    dst_rows_ptr,
    out_ptr,
    stride_out,
    n,
    H,
    row0,
    HAS_SCALE: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    HAS_UNIFORM: tl.constexpr,
    HAS_UNIFORM_SUM: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BR: tl.constexpr,
    BH: tl.constexpr,
):
    """``out[dst_i] = s_i src_i (+ c_i W[y_i]) (+ u_i w_sum)`` in float32 (``s_i = 1`` without ``HAS_SCALE``),
    stored in ``out``'s dtype; ``dst_i`` is ``dst_rows[i]`` (a compacted batch's rows, scattered into the full dX) or
    ``row0 + i``. HAS_UNIFORM_SUM: also this block of rows' ``sum_i u_i src_i`` (float32) at ``u_sum``'s row of the
    block, for ``u^T src`` without a float32 copy of ``src``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    row_ok = rows < n
    mask = row_ok[:, None] & (cols < H)[None, :]
    src = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    value = src.to(tl.float32)
    if HAS_UNIFORM_SUM:
        u_src = tl.load(u_ptr + rows, mask=row_ok, other=0.0)[:, None] * value
        tl.store(u_sum_ptr + tl.program_id(0) * H + cols, tl.sum(u_src, 0), mask=cols < H)
    if HAS_SCALE:
        value *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_TARGET:
        c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
        y = tl.load(y_ptr + rows, mask=row_ok, other=0)
        # c = 0 at ignored rows (whose y may lie outside W)
        w_mask = mask & (c != 0.0)[:, None]
        w_y = tl.load(w_ptr + y.to(tl.int64)[:, None] * stride_wv + cols[None, :], mask=w_mask, other=0.0)
        value += c[:, None] * w_y.to(tl.float32)
    if HAS_UNIFORM:
        u = tl.load(u_ptr + rows, mask=row_ok, other=0.0)
        value += u[:, None] * tl.load(w_sum_ptr + cols, mask=cols < H, other=0.0)[None, :]
    if HAS_ROWS:
        dst = tl.load(dst_rows_ptr + rows, mask=row_ok, other=0)
    else:
        dst = row0 + rows
    tl.store(
        out_ptr + dst.to(tl.int64)[:, None] * stride_out + cols[None, :], value.to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _add_segments(value, start, other_value, other_start):
    """Combine of a segmented sum: a segment start drops everything before it."""
    return tl.where(other_start, other_value, value + other_value), start | other_start


@triton.jit
def _target_terms(
    order_ptr,
    pos,
    ok,
    c_ptr,
    x_ptr,
    stride_xn,
    x_rows_ptr,
    cols,
    col_ok,
    HAS_ROWS: tl.constexpr,
    X_FP16: tl.constexpr,
    X_ROUND: tl.constexpr,
):
    """``c_i x_i`` (float32 ``[positions, cols]``) of the kept rows at sorted positions ``pos``, 0 where not ``ok``.
    Kept row ``i`` is row ``x_rows[i]`` of ``x`` (a compacted batch) or row ``i``; with ``X_ROUND`` a float32 ``x``
    is rounded to bf16 (fp16 with ``X_FP16``) first, as the dW GEMM's operand was (a 16-bit one is that operand)."""
    row = tl.load(order_ptr + pos, mask=ok, other=0)
    c = tl.load(c_ptr + row, mask=ok, other=0.0)
    if HAS_ROWS:
        row = tl.load(x_rows_ptr + row, mask=ok, other=0)
    x = tl.load(
        x_ptr + row.to(tl.int64)[:, None] * stride_xn + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
    )
    if X_ROUND and x_ptr.dtype.element_ty == tl.float32:
        x = x.to(tl.float16 if X_FP16 else tl.bfloat16)
    return c[:, None] * x.to(tl.float32)


@triton.jit(do_not_specialize=["n"])
def _target_rows_kernel(
    sorted_y_ptr,
    order_ptr,
    c_ptr,
    x_ptr,
    stride_xn,
    x_rows_ptr,
    dw_ptr,
    stride_dw,
    upper_ptr,
    stride_upper,
    slot_ptr,
    hot_ptr,
    stride_hot,
    split,
    n,
    H,
    ignore_index,
    HAS_ROWS: tl.constexpr,
    HAS_HOT: tl.constexpr,
    X_FP16: tl.constexpr,
    X_ROUND: tl.constexpr,
    BP: tl.constexpr,
    BH: tl.constexpr,
):
    """``dW[v] += sum of c_i x_i over the rows i with target v``, the targets sorted (``order`` gives their rows). A
    block of BP sorted positions sums each run of equal targets by a segmented scan; the position ending a run adds
    the run's sum to its dW row, once, in float32. A run that began in an earlier block (a long run) also sums those
    blocks' rows, walking back. The order of every sum is fixed: deterministic, no atomics. dW rows from ``split`` on
    are those of ``upper``. ``HAS_HOT``: the classes with a ``slot`` (``>= 0``) have their row in the float32 ``hot``
    instead, at that slot."""
    first = tl.program_id(0) * BP
    pos = first + tl.arange(0, BP)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    col_ok = cols < H
    in_range = pos < n
    v = tl.load(sorted_y_ptr + pos, mask=in_range, other=ignore_index)
    before = tl.load(sorted_y_ptr + pos - 1, mask=in_range & (pos > 0), other=ignore_index)
    after = tl.load(sorted_y_ptr + pos + 1, mask=pos + 1 < n, other=ignore_index)
    ends = in_range & (v != ignore_index) & ((pos + 1 == n) | (after != v))
    starts = (pos == first) | (before != v)
    segment_starts = tl.broadcast_to(starts[:, None], (BP, BH))
    terms = _target_terms(
        order_ptr, pos, in_range, c_ptr, x_ptr, stride_xn, x_rows_ptr, cols, col_ok, HAS_ROWS, X_FP16, X_ROUND
    )
    sums, _ = tl.associative_scan((terms, segment_starts), 0, _add_segments)
    # the block's first run may have begun in an earlier block
    first_v = tl.load(sorted_y_ptr + first)
    if (first > 0) & (first_v != ignore_index):
        if tl.load(sorted_y_ptr + first - 1) == first_v:
            earlier = tl.zeros((BH,), tl.float32)
            offs = tl.arange(0, BP)
            last = first - 1
            more = last >= 0
            while more:
                idx = last - BP + 1 + offs
                in_run = idx >= 0
                in_run &= tl.load(sorted_y_ptr + idx, mask=in_run, other=ignore_index) == first_v
                terms = _target_terms(
                    order_ptr, idx, in_run, c_ptr, x_ptr, stride_xn, x_rows_ptr, cols, col_ok, HAS_ROWS, X_FP16, X_ROUND
                )
                earlier += tl.sum(terms, 0)
                # the run goes on below this block only if all of the block is in it
                more = tl.sum(in_run.to(tl.int32), 0) == BP
                last -= BP
            sums += tl.where((v == first_v)[:, None], earlier[None, :], 0.0)
    row = tl.where(ends, v, 0).to(tl.int64)[:, None]
    mask = ends[:, None] & col_ok[None, :]
    if HAS_HOT:
        slot = tl.load(slot_ptr + tl.where(ends, v, 0), mask=ends, other=-1)
        hot = mask & (slot >= 0)[:, None]
        hot_rows = hot_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * stride_hot + cols[None, :]
        tl.store(hot_rows, tl.load(hot_rows, mask=hot, other=0.0) + sums, mask=hot)
        mask &= ~hot
    lower = row < split
    dw_rows = tl.where(
        lower,
        dw_ptr + row * stride_dw + cols[None, :],
        upper_ptr + (row - split) * stride_upper + cols[None, :],
    )
    value = tl.load(dw_rows, mask=mask, other=0.0).to(tl.float32) + sums
    tl.store(dw_rows, value.to(dw_ptr.dtype.element_ty), mask=mask)


def scale_rows(
    src: torch.Tensor,
    out: torch.Tensor,
    row_scale: torch.Tensor | None,
    target_coef: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    dst_rows: torch.Tensor | None = None,
    row0: int = 0,
    uniform: tuple[torch.Tensor, torch.Tensor] | None = None,
    uniform_sum: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[dst_i] = s_i src_i`` (``s = row_scale``, or 1 where None), plus ``c_i W[y_i]`` with ``weight``
    (``c = target_coef``, 0 at ignored rows) and ``u_i w_sum`` with ``uniform = (u, w_sum)``, in float32 and stored in
    ``out``'s dtype: ``_scaled_rows_kernel``. ``uniform_sum = (u, partial)`` (without ``uniform``): ``partial``
    (float32 ``[cdiv(n, SCALE_ROWS_BLOCK), H]``) gets ``u^T src`` by blocks of rows, to be summed."""
    n, h = src.shape
    if n == 0:
        return out
    assert uniform is None or uniform_sum is None
    br, bh = SCALE_ROWS_BLOCK, min(256, next_power_of_2(h))
    # unused pointers: src
    u, w_sum = uniform or (src, src)
    u_sum = src
    if uniform_sum is not None:
        u, u_sum = uniform_sum
    with TritonTileOps._device_guard(src.device):
        launch(
            _scaled_rows_kernel,
            (cdiv(n, br), cdiv(h, bh)),
            src,
            src.stride(0),
            src if row_scale is None else row_scale,
            src if target_coef is None else target_coef,
            src if target is None else target,
            src if weight is None else weight,
            0 if weight is None else weight.stride(0),
            u,
            w_sum,
            u_sum,
            src if dst_rows is None else dst_rows,
            out,
            out.stride(0),
            n,
            h,
            row0,
            HAS_SCALE=row_scale is not None,
            HAS_TARGET=weight is not None,
            HAS_UNIFORM=uniform is not None,
            HAS_UNIFORM_SUM=uniform_sum is not None,
            HAS_ROWS=dst_rows is not None,
            BR=br,
            BH=bh,
            num_warps=4,
        )
    return out


@dataclass
class ScaledGradient:
    """A chunk's logits gradient ``G = diag(s) E`` plus the target column ``c`` (module docstring). ``row_scale`` and
    ``target_coef`` are per unit of upstream gradient until ``times`` gives them their per-row upstream scale, unless
    ``row_scales`` formed them for a 0-d upstream gradient already. The tile path's gradient with its target column
    apart (``TritonTileOps.forward_target_apart``) has row scales where it took one sweep, else none: ``E`` is then
    ``G`` off the target column. With ``uniform_coef`` (label smoothing) ``G`` also has ``u_i`` at every column
    (module docstring), and ``E``'s buffer has a spare row after its last (``triton_gemm.forward``; on the tile path
    ``engine.compute_logits``) for ``dw_operands``; ``w_sum`` is W's column sum, which the epilogue path takes for its
    loss anyway, and which the tile path's one sweep (None here) gets from dX's GEMM instead (``dx_operand``)."""

    e: torch.Tensor  # [rows, V] 16-bit, 0 at each row's target column
    row_scale: torch.Tensor | None  # [rows] float32; None: 1
    target_coef: torch.Tensor  # [rows] float32
    target: torch.Tensor  # [rows] int64
    ignore_index: int
    uniform_coef: torch.Tensor | None = None  # [rows] float32
    w_sum: torch.Tensor | None = None  # [H] float32
    # E over its row of ones, once written (dX's and dW's GEMMs both take it on the tile path)
    _e_and_ones: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def _with(self, e, row_scale, target_coef, target, uniform_coef) -> ScaledGradient:
        return ScaledGradient(e, row_scale, target_coef, target, self.ignore_index, uniform_coef, self.w_sum)

    @staticmethod
    def has_spare_row(e: torch.Tensor) -> bool:
        """Whether ``e``'s buffer holds one more row after its last, at its row stride (``dw_operands``)."""
        rows, columns = e.shape
        end = e.storage_offset() + rows * e.stride(0) + (columns - 1) * e.stride(1) + 1
        return e.untyped_storage().nbytes() >= end * e.element_size()

    def head(self, rows: int) -> ScaledGradient:
        """The first ``rows`` rows (views)."""
        row_scale = None if self.row_scale is None else self.row_scale[:rows]
        uniform = None if self.uniform_coef is None else self.uniform_coef[:rows]
        return self._with(self.e[:rows], row_scale, self.target_coef[:rows], self.target[:rows], uniform)

    def times(self, upstream: torch.Tensor) -> ScaledGradient:
        """The gradient times ``upstream`` (float32, 0-d or ``[rows]``); a unit row scale becomes ``upstream``."""
        rows = self.e.shape[0]
        row_scale = upstream.expand(rows).contiguous() if self.row_scale is None else self.row_scale * upstream
        uniform = None if self.uniform_coef is None else self.uniform_coef * upstream
        return self._with(self.e, row_scale, self.target_coef * upstream, self.target, uniform)

    def _rows(self, src, out, weight=None, dst_rows=None, row0=0, uniform=None, uniform_sum=None):
        args = (self.row_scale, self.target_coef, self.target, weight, dst_rows, row0, uniform, uniform_sum)
        return scale_rows(src, out, *args)

    def _with_ones_row(self) -> torch.Tensor:
        """``E`` with a row of ones after its last, in its buffer's spare row (written once)."""
        if self._e_and_ones is None:
            rows, columns = self.e.shape
            # as_strided checks that the spare row lies within E's buffer
            e = self.e.as_strided((rows + 1, columns), self.e.stride(), self.e.storage_offset())
            e[rows].fill_(1.0)
            self._e_and_ones = e
        return self._e_and_ones

    def dx_operand(self) -> torch.Tensor:
        """dX's GEMM operand: ``E``, or for a uniform term without ``w_sum`` (the tile path's) ``E`` with its row of
        ones, whose product with W is W's column sum ``1^T W``, in the same float32 GEMM (no ``[V, H]`` pass)."""
        return self._with_ones_row() if self.uniform_coef is not None and self.w_sum is None else self.e

    def write_dx(
        self, ew: torch.Tensor, weight: torch.Tensor, dx: torch.Tensor, dst_rows: torch.Tensor | None, row0: int
    ) -> None:
        """``dx[dst] = s ew + c W[y] (+ u 1^T W)`` from ``ew = dx_operand() W`` (float32), at ``dst_rows``
        (compacted rows) or rows ``row0:``. Without ``w_sum``, ``1^T W`` is ``ew``'s row after the chunk's."""
        uniform = None
        if self.uniform_coef is not None:
            rows = self.e.shape[0]
            uniform = (self.uniform_coef, ew[rows] if self.w_sum is None else self.w_sum)
            ew = ew[:rows]
        self._rows(ew, dx, weight, dst_rows, row0, uniform)

    def x_operand(self, x: torch.Tensor) -> torch.Tensor:
        """``diag(s) x`` in ``E``'s dtype: dW's second operand."""
        if self.row_scale is None:
            return x.to(self.e.dtype)
        return self._rows(x, torch.empty(x.shape, dtype=self.e.dtype, device=x.device))

    def dw_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` with ``A^T B = E^T diag(s) x`` plus, with a uniform term, ``u^T x`` at every row: ``E`` with a
        row of ones after its last (its buffer's spare row) over ``diag(s) x`` with ``u^T x`` (summed in float32 by
        the same pass over x, then rounded to ``E``'s dtype) after its last. dW's target rows come apart
        (``add_target_rows``)."""
        if self.uniform_coef is None:
            return self.e, self.x_operand(x)
        rows, hidden = self.e.shape[0], x.shape[1]
        e = self._with_ones_row()
        x_operand = torch.empty((rows + 1, hidden), dtype=self.e.dtype, device=x.device)
        partial = torch.empty((cdiv(rows, SCALE_ROWS_BLOCK), hidden), dtype=torch.float32, device=x.device)
        self._rows(x, x_operand[:rows], uniform_sum=(self.uniform_coef, partial))
        x_operand[rows] = partial.sum(0)
        return e, x_operand

    def scale(self, ew: torch.Tensor) -> torch.Tensor:
        """``diag(s) ew`` in place (``ew = E W``, float32): dX without the target column."""
        return scale_rows(ew, ew, self.row_scale)

    @staticmethod
    def add_target_rows(
        dw: torch.Tensor,
        x: torch.Tensor,
        x_rows: torch.Tensor | None,
        target: torch.Tensor,
        target_coef: torch.Tensor,
        ignore_index: int,
        dw_upper: torch.Tensor | None = None,
        hot: tuple[torch.Tensor, torch.Tensor] | None = None,
        operand_dtype: torch.dtype | None = torch.bfloat16,
    ) -> None:
        """``dW[y_i] += c_i x_i`` over every kept row of a call (in float32, each dW row updated once), after its last
        chunk: one sort and one launch per call. Kept row ``i`` is row ``x_rows[i]`` of ``x``, or row ``i`` without
        ``x_rows``; ``target`` and ``target_coef`` are per kept row. With ``dw_upper``, dW is split in two blocks of
        rows: ``dw`` holds its first ``dw.shape[0]`` rows and ``dw_upper`` the rest. With ``hot = (slot, rows)``,
        class ``v`` with ``slot[v] >= 0`` has its row at ``rows[slot[v]]`` (float32) instead. A float32 ``x`` is
        rounded to ``operand_dtype`` first, as the dW GEMM's operand was (None: not rounded)."""
        n, h = target.shape[0], x.shape[1]
        if n == 0:
            return
        # 32-bit keys: the radix sort takes half the passes of int64's (every class id and ignore_index fit)
        sorted_y, order = torch.sort(target.to(torch.int32), stable=True)
        upper = dw if dw_upper is None or not dw_upper.numel() else dw_upper
        bp, bh = 32, min(128, next_power_of_2(h))
        with TritonTileOps._device_guard(x.device):
            launch(
                _target_rows_kernel,
                (cdiv(n, bp), cdiv(h, bh)),
                sorted_y,
                order,
                target_coef,
                x,
                x.stride(0),
                order if x_rows is None else x_rows,
                dw,
                dw.stride(0),
                upper,
                upper.stride(0),
                order if hot is None else hot[0],
                dw if hot is None else hot[1],
                0 if hot is None else hot[1].stride(0),
                dw.shape[0],
                n,
                h,
                ignore_index,
                HAS_ROWS=x_rows is not None,
                HAS_HOT=hot is not None,
                X_FP16=operand_dtype == torch.float16,
                X_ROUND=operand_dtype is not None,
                BP=bp,
                BH=bh,
                num_warps=4,
            )


def row_scales(
    e: torch.Tensor,
    target: torch.Tensor,
    t_y: torch.Tensor,
    lse: torch.Tensor,
    params: TileParams,
    transform: tuple[float, float, float],
    upstream: torch.Tensor | None = None,
    w_sum: torch.Tensor | None = None,
) -> ScaledGradient:
    """The chunk's ``ScaledGradient`` per unit of upstream gradient, or for the 0-d float32 ``upstream`` (what its
    ``times`` would give, without two more launches), once its lse is known (``_row_scales_kernel``; the merge has
    rewritten the rows past ``REPAIR_ABOVE``). With label smoothing, ``w_sum`` is W's column sum (float32 ``[H]``)
    and ``e``'s buffer has a spare row after its last."""
    n = e.shape[0]
    smoothing = params.label_smoothing != 0.0
    r = torch.empty(n, dtype=torch.float32, device=e.device)
    q = torch.empty(n, dtype=torch.float32, device=e.device)
    u = torch.empty(n, dtype=torch.float32, device=e.device) if smoothing else None
    if n:
        br = 32
        with TritonTileOps._device_guard(e.device):
            launch(
                _row_scales_kernel,
                (cdiv(n, br),),
                e,
                e.stride(0),
                target,
                t_y,
                lse,
                r if upstream is None else upstream,
                r,
                q,
                r if u is None else u,
                n,
                e.shape[1],
                params.ignore_index,
                *transform[1:],
                params.label_smoothing,
                params.label_smoothing / params.vocab,
                params.z_loss,
                REF_OFFSET,
                REPAIR_ABOVE,
                HAS_SOFTCAP=params.softcap is not None,
                HAS_TEMPERATURE=params.inv_temperature != 1.0,
                HAS_SMOOTHING=smoothing,
                HAS_ZLOSS=params.z_loss != 0.0,
                HAS_UPSTREAM=upstream is not None,
                BR=br,
                num_warps=4,
            )
    return ScaledGradient(e, r, q, target, params.ignore_index, u, w_sum if smoothing else None)
