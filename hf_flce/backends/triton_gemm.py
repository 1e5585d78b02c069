"""The logits GEMM with the softmax in its epilogue (CUDA; CPU tensors under ``TRITON_INTERPRET=1`` for tests).

The default on Hopper and newer GPUs (``HF_FLCE_GEMM_EPILOGUE=0`` switches it off, ``=1`` uses it on every GPU).
Persistent programs walk the tiles with the tile loop flattened into the K loop, so the next tile's loads overlap this
tile's epilogue. On an H200 the engine's fwd+bwd runs at 1.00-1.12x the 3-GEMM floor for H >= 3584 and 1.13-1.21x for
thin H (qwen3-0.6b, gemma2-2b), where the per-logit epilogue decides (docs/PERF_NOTES.md, v6, v10, v13 to v17).

The tile path (``triton_tiles``) has cuBLAS write float32 logits and reads them back twice: 12 bytes per logit more
than the floor's bf16 GEMM. Here each ``[BM, BN]`` tile of ``t``, the logits ``z = x W^T + b`` after softcap and
temperature (``base.py``), stays in registers in float32, and the epilogue reduces it to per-row partial statistics of
its BN columns: the max ``m``, and with ``e = exp(t - m)``, ``sum e``, ``sum e (t - m)``, ``sum e**2``, ``sum t`` and
the first argmax. A merge kernel combines the partials of a row as online softmax does (a partial's sums are rescaled
by ``exp(m - max of all m)``). Only the statistics the caller asked for (``TileParams.optional_stats``) are computed;
the others come back as 0.

``MODE_SCALED`` (below) with no optional statistic needs no tile max: every tile's sum is taken against the row's
``t_y + 32``, the reference E is stored against, which saves the max, its cross-thread reduction and the rescaling
multiply per logit (``FIXED_REF``; ``HF_FLCE_ROW_REFERENCE=0`` keeps the tile max). ``exp(t - t_y - 32)`` stays in
float32's range while the row's loss is below ~120 nats; past that the sum overflows to inf and the merge computes
that row's lse again from float32 dots (``triton_tiles.exact_row``), as it rewrites E for rows past 64 nats.

For gradients the epilogue also stores ``e`` in fp16: ``e`` lies in (0, 1], where fp16 keeps 11 significant bits
(bf16 keeps 8), and it comes from the float32 tile, so the logits are never rounded before the softmax. Once the
row's lse is known, the gradient pass turns ``e`` into the logits gradient in place (2 bytes read and 2 written per
logit), with ``p_j = e_j exp(m_tile - lse)``:

    g_j = (p_j * (p_coef - g_entropy * t_j) + [j == y] * onehot_coef - smooth_coef) * dt_j/dz_j

(``base.py`` derives the coefficients.) With a softcap, ``dt_j/dz_j = (1 - (t_j temperature / softcap)**2) /
temperature`` needs ``t_j``: the pass takes it as ``m_tile + log e_j`` (off by e's fp16 rounding, about 2**-11, which
matters only where tanh saturates and ``dt`` is tiny), except at the target column, whose ``e_y`` may have underflowed:
there it uses ``t_y``, kept from the forward (a float32 dot of the row with the target's weight row, outside the
GEMM). Where ``e_j`` underflowed to 0, ``t_j`` is lost, but every term left there carries ``p_j < 2**-24`` and
vanishes, except label smoothing's ``-smooth_coef * dt_j``: softcap with label smoothing keeps the tile path. When the
lse is already known (a per-token backward that recomputes the logits), the epilogue writes ``g`` itself, with the
exact ``dt`` (by vocabulary chunks and without a bias, 0 at each row's target column, which ``target_gradient``
gives in float32: bf16 would round ``p_y - 1`` to 2^-9); where e passes the keep limit, the forward keeps it for as
many leading columns as fit (``keep_columns``), so backward recomputes only the others. Class weights are not
handled here: the engine keeps the tile path for them.

A scalar loss on bf16 operands (no bias; with label smoothing too, as a rank-one term) skips the gradient pass:
``MODE_SCALED`` stores ``E = exp(t - t_y - 32) dt`` in bf16 against one reference per row, known before the GEMM, and
the gradient GEMMs take ``E`` with row scales (``triton_scaled.py``). So do the leading columns a bf16 per-token loss
keeps past the keep limit (``keep_columns`` with ``scaled``), their row scales times each row's upstream gradient in
backward. The pass over stored ``e`` remains for the other calls.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import cdiv, cuda_properties, triton_interpreting, triton_scaled
from .base import TileParams, TileStats, check_columns
from .triton_launch import launch
from .triton_tiles import (
    HW_TANH,
    TritonTileOps,
    _transform,
    exact_row,
    fast_exp,
    fast_log,
    logit_grad,
    row_grad_coefs,
)

MODE_STATS = 0  # partial statistics only (no gradient wanted: eval, reference models)
MODE_KEEP = 1  # partial statistics and e = exp(t - m_tile) in fp16, for the gradient pass
MODE_GRAD = 2  # the logits gradient, from a known lse
MODE_SCALED = 3  # partial statistics and E = exp(t - t_y - REF_OFFSET) dt in bf16: the gradient up to a row scale
# Vocabulary chunks (``recompute_gradient(first_column=)``) and the leading columns ``forward(keep_columns=)`` keeps
# come in multiples of this many columns, a multiple of every configuration's BN: whole tiles, and only the last
# chunk has a ragged one
COLUMN_ALIGN = 256

_NEG_BIG = tl.constexpr(-3.0e38)
# The merge's rows per program and tiles per step. On an H100 (docs/PERF_NOTES.md v33) 16 x 64 took 0.58-0.73 of
# 32 x 32's time in fwd+bwd calls at five shapes (0.53-0.83 in no-grad ones): twice the programs (a thin-H chunk of
# ~3300 rows had 103 of them for 132 SMs) and twice the loads in flight per step.
MERGE_ROWS, MERGE_TILES = 16, 64


def partial_stride(rows: int) -> int:
    """Elements between two tiles' partial statistics of a row (``[stat, tile, row]`` layout): the row count rounded
    up to 16, so that a row block's partials start 64-byte aligned for every count (vectorized loads and stores)
    while the kernels take the count itself unspecialized (``triton_launch``)."""
    return cdiv(rows, 16) * 16


def _configs():
    if triton_interpreting():
        return [
            triton.Config(
                {"BM": 16, "BN": 32, "BK": 16, "GROUP_M": 4, "USE_TMA": False, "FLATTEN": False},
                num_warps=4,
                num_stages=1,
            )
        ]
    # Persistent programs (one per SM) with the tile loop flattened into the K loop, so the software pipeliner
    # loads the next tile's first operands while this tile's epilogue runs. On an H200 (scripts/
    # probe_gemm_mainloop.py) 128x256 and 256x128 tiles brought the statistics GEMM to 1.00x (H = 4096) and 1.04x
    # (H = 1024) of cuBLAS, against 1.04x / 1.22x with one program per tile; automatic warp specialization gained
    # nothing over flattening there. With TMA, 128x256 then beat 256x128 at every reference shape, with and without e
    # stored (by 1.4-6%, the two forced in turn; docs/PERF_NOTES.md v13), while the autotuner, timing one after the
    # other, picked 256x128 in 4 of 12 cases: one configuration, so every process runs the same tile.
    plain = ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4))
    tma = ((128, 256, 64, 8, 3),)
    return [
        triton.Config(
            {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "USE_TMA": use_tma, "FLATTEN": True}, num_warps=w, num_stages=s
        )
        for use_tma, table in ((False, plain), (True, tma))
        for bm, bn, bk, w, s in table
    ]


# L2 bytes the X tiles of one group of row blocks may take (an H100/H200 has 50 MB of L2): with the W tiles the
# group's programs load meanwhile, the working set stays well inside it. On an H200 (docs/PERF_NOTES.md v17) the thin-H
# chunks (qwen3-0.6b's 6 MB of X, gemma2-2b's 9 MB) then sweep W once instead of 3-4 times.
L2_GROUP_BYTES = 16 << 20


def _tma_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA tile loads (device-side tensor descriptors): Hopper or newer, 16-byte aligned rows and bases."""
    if (
        os.environ.get("HF_FLCE_GEMM_TMA", "1") == "0"
        or x.device.type != "cuda"
        or not hasattr(tl, "make_tensor_descriptor")
    ):
        return False
    if cuda_properties(x.device).major < 9:
        return False
    return all(_tma_aligned(t) for t in (x, weight))


def _tma_aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0


def _program_limit(device: torch.device) -> int:
    """Persistent grid: one program per SM (the interpreter runs a few, so tests still walk several tiles each)."""
    return cuda_properties(device).multi_processor_count if device.type == "cuda" else 3


def _prune_configs(configs, named_args, **kwargs):
    use_tma = _tma_usable(named_args["x_ptr"], named_args["w_ptr"])
    kept = [c for c in configs if c.kwargs["USE_TMA"] == use_tma] or configs
    if named_args["x_ptr"].element_size() == 4:
        # float32 operands (tests): twice the bytes per stage and per output tile. Half the K step over two stages
        # keeps them in shared memory (the 16-bit configurations needed 320-384 KiB of the H200's 227).
        kept = [
            triton.Config({**c.kwargs, "BK": c.kwargs["BK"] // 2}, num_warps=c.num_warps, num_stages=2) for c in kept
        ]
    return kept


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


@triton.jit
def grouped_block(tile, tiles_m, per_group, GROUP_M):
    """Row and column block of tile ``tile`` in grouped order (``per_group = GROUP_M * tiles_n``): GROUP_M row blocks
    sweep the columns together, so each column block's operand tile is read from L2 that often."""
    first_m = (tile // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _row_coefs(
    rows,
    valid,
    lse_ptr,
    entropy_ptr,
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
):
    """The rows' lse, entropy and gradient coefficients (``triton_tiles.row_grad_coefs``; no class weights here)."""
    lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
    entropy = lse
    if HAS_GE:
        entropy = tl.load(entropy_ptr + rows, mask=valid, other=0.0)
    p_coef, onehot_coef, smooth_coef, g_entropy = row_grad_coefs(
        rows,
        valid,
        lse,
        entropy,
        1.0,
        lse_ptr,
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
        False,
    )
    return lse, entropy[:, None], p_coef[:, None], onehot_coef[:, None], smooth_coef[:, None], g_entropy[:, None]


@triton.jit
def _grad_of_t(
    t,
    dt,
    is_y,
    rows,
    valid,
    lse_ptr,
    entropy_ptr,
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
    HAS_DT: tl.constexpr,
):
    """The logits gradient at the transformed logits ``t`` (``[rows, columns]``, ``is_y`` marking each row's target
    column, ``dt`` = dt/dz beside them where ``HAS_DT``) of rows whose lse is known: ``MODE_GRAD``'s epilogue, and
    the target column alone (``target_gradient``)."""
    lse, entropy, p_coef, onehot_coef, smooth_coef, g_entropy = _row_coefs(
        rows,
        valid,
        lse_ptr,
        entropy_ptr,
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
    )
    # ignored rows: p = exp(-inf) = 0, so nothing overflows against their placeholder lse, and log p = 0 keeps the
    # entropy's term p log p at 0
    log_p = tl.where(valid[:, None], t - lse[:, None], 0.0)
    p = fast_exp(tl.where(valid[:, None], log_p, float("-inf")))
    g = logit_grad(p, log_p, is_y, p_coef, onehot_coef, g_entropy, entropy, HAS_GE) - smooth_coef
    if HAS_DT:
        g *= dt
    return g


@triton.jit
def _scaled_half(
    z,
    m,
    rows,
    row_ok,
    col0,
    V,
    out_ptr,
    stride_on,
    inv_softcap,
    t_scale,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    RAGGED: tl.constexpr,
    HALF: tl.constexpr,
    FAST_TANH: tl.constexpr,
):
    """MODE 3's epilogue with one reference per row on columns ``col0 + [0, HALF)`` of a tile: stores
    E = exp(t - m) dt from registers and returns each row's sum of exp(t - m)."""
    t, dt = _transform(z, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE, FAST_TANH)
    e = fast_exp(t - m[:, None])
    cols = col0 + tl.arange(0, HALF)
    col_ok = cols < V
    if RAGGED:
        e = tl.where(col_ok[None, :], e, 0.0)
    stored = (e * dt).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :], stored, mask=row_ok[:, None] & col_ok[None, :]
    )
    return tl.sum(e, 1)


def _time_configs(kernel_call: Callable[[], None], quantiles) -> list[float]:
    """The autotuner's timer: CUDA events around a few calls, median and quantiles in ms. Triton's ``do_bench``
    allocates a 256 MB buffer to flush the L2 between calls, which would raise the peak memory of the first training
    step (the model's activations are alive when the head first runs) and take ~0.1 s of calls per configuration."""
    kernel_call()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel_call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ordered = torch.tensor(times).quantile(torch.tensor(quantiles, dtype=torch.float32))
    return ordered.tolist()


@triton.autotune(
    configs=_configs(),
    key=["V", "K", "MODE"],
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=_time_configs,
)
@triton.jit(do_not_specialize=["N"])
def _head_gemm_kernel(
    x_ptr,
    stride_xn,
    w_ptr,
    stride_wv,
    bias_ptr,
    y_ptr,
    ty_ptr,
    out_ptr,
    stride_on,
    part_ptr,
    best_ptr,
    lse_ptr,
    entropy_ptr,
    gl_ptr,
    stride_gl,
    glp_ptr,
    stride_glp,
    ge_ptr,
    stride_ge,
    rows_ptr,
    N,
    stride_pt,
    V,
    K,
    ignore_index,
    inv_softcap,
    t_scale,
    inv_temperature,
    smoothing,
    smooth_over_v,
    z_loss,
    ref_offset,
    group_rows,
    col_offset,
    out_cols,
    MODE: tl.constexpr,
    ROWS_ON_DEVICE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA_OUT: tl.constexpr,
    ENTROPY: tl.constexpr,
    TOP1: tl.constexpr,
    SUM_T: tl.constexpr,
    SUM_E2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    FIXED_REF: tl.constexpr,
    SPLIT: tl.constexpr,
    PARTIAL_OUT: tl.constexpr,
    TARGET_APART: tl.constexpr,
):
    """[BM, BN] tiles of the transformed logits t of x W^T + b, each reduced in the epilogue (see the module docstring).
    Persistent: each program takes every ``num_programs``-th tile of the full column blocks, then of the ragged last
    one (if V % BN), the only tiles that mask columns. ``ROWS_ON_DEVICE``: only the first ``*rows_ptr`` of the N rows
    (all N if that count is larger: a first chunk) are computed, a count the host never reads; N stays the stride
    of the partials. ``PARTIAL_OUT`` (MODE 1 or 3): ``e`` or ``E`` is stored for the first ``out_cols`` columns only (a
    multiple of BN; ``out`` is ``[N, out_cols]``), the kept part of a per-token loss whose logits pass the budget.
    ``TARGET_APART`` (MODE 2): 0 at each row's target column (``target_gradient`` gives it in float32)."""
    # the hardware's tanh for 16-bit operands; float32 ones (tests) get the float32-exact form
    FAST_TANH: tl.constexpr = HW_TANH and x_ptr.dtype.element_ty != tl.float32
    M = N
    if ROWS_ON_DEVICE:
        M = tl.minimum(tl.load(rows_ptr), N).to(tl.int32)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(V, BN)
    full_n = V // BN
    # Grouped order: a group of row blocks sweeps the vocabulary together, so each W tile is read from HBM once per
    # group and from L2 by every row block of it. As many row blocks as ``group_rows`` (their X tiles held in L2), at
    # least GROUP_M: a thin-H chunk is one group, and W comes from HBM once.
    group_m = tl.maximum(group_rows // BM, GROUP_M)
    stat_stride = tiles_n * stride_pt
    programs = tl.num_programs(0)
    x_desc = x_ptr
    w_desc = w_ptr
    out_desc = out_ptr
    if USE_TMA:
        # TMA: the copy engine fetches the tiles (out-of-range rows and columns come back as zeros, and a TMA store
        # drops them)
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[N, K], strides=[stride_xn, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, K], strides=[stride_wv, 1], block_shape=[BN, BK])
        if TMA_OUT:
            out_desc = tl.make_tensor_descriptor(
                out_ptr, shape=[N, out_cols], strides=[stride_on, 1], block_shape=[BM, BN]
            )
    full_tiles = tiles_m * full_n
    # the full column blocks (no column mask), then the ragged last one if V % BN; its tiles go first to the programs
    # that had one full tile fewer. With PARTIAL_OUT the full blocks whose e is stored take a loop of their own: a
    # branch on the column block inside one flattened loop fails Triton 3.6's loop fusion (TritonGPUFuseNestedLoops).
    stored_n = full_n
    if PARTIAL_OUT:
        stored_n = out_cols // BN
    # the segment of the ragged column block: 2 with PARTIAL_OUT (after the stored and the other full blocks), else 1
    RAGGED: tl.constexpr = 1 + PARTIAL_OUT
    for SEG in tl.static_range(RAGGED + 1):
        if SEG == 0:
            first_n = 0
            seg_n = stored_n
            start = tl.program_id(0)
            stop = tiles_m * stored_n
        elif SEG != RAGGED:
            first_n = stored_n
            seg_n = full_n - stored_n
            start = (tl.program_id(0) + programs - (tiles_m * stored_n) % programs) % programs
            stop = tiles_m * seg_n
        else:
            start = (tl.program_id(0) + programs - full_tiles % programs) % programs
            stop = tiles_m * (tiles_n - full_n)
        for tile in tl.range(start, stop, programs, flatten=FLATTEN):
            if SEG != RAGGED:
                pid_m, pid_n = grouped_block(tile, tiles_m, group_m * seg_n, group_m)
                pid_n += first_n
            else:
                pid_m = tile
                pid_n = full_n
            rows = pid_m * BM + tl.arange(0, BM)
            cols = pid_n * BN + tl.arange(0, BN)
            row_ok = rows < M
            col_ok = cols < V
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if USE_TMA:
                for k in range(0, K, BK):
                    a = x_desc.load([pid_m * BM, k])
                    b = w_desc.load([pid_n * BN, k])
                    acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
            else:
                # Out-of-range rows and columns read row 0 (in bounds); their results are masked at the end.
                ks = tl.arange(0, BK)
                x_ptrs = x_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_xn + ks[None, :]
                w_rows = tl.where(col_ok, cols, 0) if SEG == RAGGED else cols
                w_ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * stride_wv + ks[None, :]
                for k in range(0, K, BK):
                    k_ok = (k + ks) < K
                    a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                    if UPCAST:
                        a = a.to(tl.float32)
                        b = b.to(tl.float32)
                    acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
                    x_ptrs += BK
                    w_ptrs += BK

            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            t, dt = _transform(acc, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE, FAST_TANH)
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :]
            out_mask = row_ok[:, None] & col_ok[None, :] if SEG == RAGGED else row_ok[:, None]

            if MODE == 2:
                y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index)
                valid = row_ok & (y != ignore_index)
                # ``col_offset``: W holds the head's rows from there (a vocabulary chunk), so y is shifted into it
                is_y = cols[None, :] == tl.where(valid, y - col_offset, -1)[:, None]
                g = _grad_of_t(
                    t,
                    dt,
                    is_y,
                    rows,
                    valid,
                    lse_ptr,
                    entropy_ptr,
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
                    HAS_SOFTCAP or HAS_TEMPERATURE,
                )
                if TARGET_APART:
                    # bf16 keeps p_y - 1 to 2^-9 only, which loses p_y below that (most rows of a flat distribution):
                    # the caller adds this column in float32 (target_gradient)
                    g = tl.where(is_y, 0.0, g)
                if TMA_OUT:
                    out_desc.store([pid_m * BM, pid_n * BN], g.to(out_ptr.dtype.element_ty))
                else:
                    tl.store(out_ptrs, g.to(out_ptr.dtype.element_ty), mask=out_mask)
            elif SPLIT and (SEG == 0 or SEG == RAGGED and not PARTIAL_OUT):
                # MODE 3 with FIXED_REF where E is stored (with PARTIAL_OUT the tiles past the kept columns take the
                # whole-tile branch below: its sum alone, with no split of the tile): no statistic but sum e, and the
                # halves' sums add. In two column halves, E stored from registers: with a softcap, dt/dz is a second
                # tile of float32 registers beside e, and at 128x256 the whole-tile epilogue took 255 registers and
                # spilled 34 (H200, Triton 3.6); a TMA store stages the tile in shared memory between CTA barriers,
                # which were 35-39% of the warps' stalls (Nsight Compute). Against whole tiles with a TMA store:
                # gemma2-2b 2.7% faster, llama3-8b 1.4%, qwen3-0.6b 0.2%, mistral-7b 0.9% slower (docs/PERF_NOTES.md
                # v18).
                m = tl.load(ty_ptr + rows, mask=row_ok, other=float("inf")) + ref_offset
                z_left, z_right = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                sum_e = tl.zeros((BM,), tl.float32)
                for half in tl.static_range(2):
                    z = z_left if half == 0 else z_right
                    sum_e += _scaled_half(
                        z,
                        m,
                        rows,
                        row_ok,
                        pid_n * BN + half * (BN // 2),
                        V,
                        out_ptr,
                        stride_on,
                        inv_softcap,
                        t_scale,
                        inv_temperature,
                        HAS_SOFTCAP,
                        HAS_TEMPERATURE,
                        SEG == RAGGED,
                        BN // 2,
                        FAST_TANH,
                    )
                tl.store(part_ptr + pid_n * stride_pt + rows + stat_stride, sum_e, mask=row_ok)
            else:
                # Only the statistics asked for are computed; the target logit comes from _target_kernel.
                part = part_ptr + pid_n * stride_pt + rows
                if FIXED_REF:
                    # One reference per row fixed before the GEMM, m = t_y + ref_offset (+inf at ignored rows: e = 0
                    # there), instead of the tile's max: no max and no rescaling per logit, and MODE 3's E is e
                    # itself. Where the row's loss passes ~120 nats exp overflows and the sum becomes inf; the merge
                    # then computes that row's lse again (_merge_kernel).
                    m = tl.load(ty_ptr + rows, mask=row_ok, other=float("inf")) + ref_offset
                    e = fast_exp(t - m[:, None])
                    if SEG == RAGGED:
                        e = tl.where(col_ok[None, :], e, 0.0)
                else:
                    if SEG == RAGGED:
                        t = tl.where(col_ok[None, :], t, float("-inf"))
                    m = tl.max(t, 1)
                    e = fast_exp(t - m[:, None])
                    tl.store(part, m, mask=row_ok)
                tl.store(part + stat_stride, tl.sum(e, 1), mask=row_ok)
                if ENTROPY:
                    t_minus_m = t - m[:, None]
                    if SEG == RAGGED:
                        t_minus_m = tl.where(col_ok[None, :], t_minus_m, 0.0)
                    tl.store(part + 2 * stat_stride, tl.sum(e * t_minus_m, 1), mask=row_ok)
                if SUM_E2:
                    tl.store(part + 3 * stat_stride, tl.sum(e * e, 1), mask=row_ok)
                if SUM_T:
                    t_in = tl.where(col_ok[None, :], t, 0.0) if SEG == RAGGED else t
                    tl.store(part + 4 * stat_stride, tl.sum(t_in, 1), mask=row_ok)
                if TOP1:
                    # the first column holding the tile's max
                    first = tl.min(tl.where(t == m[:, None], cols[None, :], 2147483647), 1)
                    tl.store(best_ptr + pid_n * stride_pt + rows, first, mask=row_ok)
                if MODE != 0:
                    stored = e
                    if MODE == 3:
                        # E = exp(t - m_ref) dt with one reference per row, m_ref = t_y + ref_offset (+inf at
                        # ignored rows: E = 0 there), so the gradient is E times a row scale (triton_scaled.py).
                        # Loaded here: on an H200 a load before the K loop made the softcap tile 3% slower and the
                        # others no faster.
                        if not FIXED_REF:
                            m_ref = tl.load(ty_ptr + rows, mask=row_ok, other=float("inf")) + ref_offset
                            stored = e * fast_exp(m - m_ref)[:, None]
                        if HAS_SOFTCAP or HAS_TEMPERATURE:
                            stored *= dt
                    # MODE 1: e in fp16; MODE 3: E in the operands' bf16
                    if SEG == 0 or SEG == RAGGED and not PARTIAL_OUT:
                        if TMA_OUT:
                            out_desc.store([pid_m * BM, pid_n * BN], stored.to(out_ptr.dtype.element_ty))
                        else:
                            tl.store(out_ptrs, stored.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["N"])
def _kept_order_kernel(y_ptr, N, V, ignore_index, order_ptr, y_out_ptr, summary_ptr, BLOCK: tl.constexpr):
    """One program over the N targets: the kept rows' indices and targets first, in order (slots from a running
    prefix sum), then ``N - 1`` and ``ignore_index`` in the remaining slots; ``summary`` = (kept count, lowest kept
    target, highest), the targets' range being 0 where none is kept. A kept target outside ``[0, V)`` is written out
    as ``ignore_index``: the kernels launched before the host reads the summary (and raises) never index W with it."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((), tl.int32)
    low = tl.zeros((), tl.int64)
    high = tl.zeros((), tl.int64)
    for start in range(0, N, BLOCK):
        idx = start + offs
        y = tl.load(y_ptr + idx, mask=idx < N, other=ignore_index)
        keep = y != ignore_index
        k = keep.to(tl.int32)
        slot = count + tl.cumsum(k, 0) - k
        tl.store(order_ptr + slot, idx.to(tl.int64), mask=keep)
        tl.store(y_out_ptr + slot, tl.where((y >= 0) & (y < V), y, ignore_index), mask=keep)
        y_kept = tl.where(keep, y, 0)
        low = tl.minimum(low, tl.min(y_kept, 0))
        high = tl.maximum(high, tl.max(y_kept, 0))
        count += tl.sum(k, 0)
    for start in range(0, N, BLOCK):
        idx = start + offs
        rest = (idx >= count) & (idx < N)
        tl.store(order_ptr + idx, tl.full((BLOCK,), N - 1, tl.int64), mask=rest)
        tl.store(y_out_ptr + idx, tl.full((BLOCK,), ignore_index, tl.int64), mask=rest)
    tl.store(summary_ptr, count.to(tl.int64))
    tl.store(summary_ptr + 1, low)
    tl.store(summary_ptr + 2, high)


def kept_order(target: torch.Tensor, ignore_index: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compaction in one launch that the host need not wait for: ``order`` (int64 [N], the kept rows first and in
    order, then ``N - 1``), their targets (then ``ignore_index``; a target outside ``[0, vocab)`` too) and
    ``summary`` (int64 [3]: the kept count, the lowest and the highest kept target), which one host read can bring
    back with the range check."""
    n = target.numel()
    # one allocation (each costs host time the GPU may be waiting on); the parts start 16-byte aligned
    span = n + n % 2
    buffer = torch.empty(2 * span + 3, dtype=torch.int64, device=target.device)
    order, kept, summary = buffer[:n], buffer[span : span + n], buffer[2 * span :]
    with TritonTileOps._device_guard(target.device):
        launch(_kept_order_kernel, (1,), target, n, vocab, ignore_index, order, kept, summary, BLOCK=4096, num_warps=8)
    return order, kept, summary


def read_later(summary: torch.Tensor) -> Callable[[], list[int]]:
    """``summary``'s values for the host without waiting for what is launched after this call: on CUDA a copy into
    pinned host memory with an event behind it, and the returned function waits for that event alone, so GEMMs
    launched in between keep the GPU busy while the host reads. (A ``tolist()`` would wait for all of them.)"""
    if summary.device.type != "cuda":
        return summary.tolist
    host = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True)
    host.copy_(summary, non_blocking=True)
    # on the stream the copy went to: that of summary's device, which need not be the current device
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(summary.device))

    def read() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return read


@triton.jit(do_not_specialize=["N"])
def _target_kernel(
    x_ptr,
    stride_xn,
    w_ptr,
    stride_wv,
    bias_ptr,
    y_ptr,
    out_ptr,
    lse_ptr,
    entropy_ptr,
    gl_ptr,
    stride_gl,
    glp_ptr,
    stride_glp,
    ge_ptr,
    stride_ge,
    w_sum_ptr,
    sum_t_ptr,
    N,
    K,
    ignore_index,
    inv_softcap,
    t_scale,
    inv_temperature,
    smoothing,
    smooth_over_v,
    z_loss,
    GRAD: tl.constexpr,
    SUM_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
):
    """Each of BR rows' target column from a float32 dot ``x_n . w_y`` (the GEMM's epilogue would pay a compare and a
    select on every logit for one value per row): its transformed logit ``t_y`` (+inf at ignored rows), or with
    ``GRAD`` its logits gradient, with the rows' lse known (0 at ignored rows). ``SUM_T`` (no bias, no softcap): also
    the row's sum of t over the vocabulary, ``x_n . w_sum`` times the inverse temperature (``w_sum``: W's column sum,
    float32), into ``sum_t``."""
    FAST_TANH: tl.constexpr = HW_TANH and x_ptr.dtype.element_ty != tl.float32  # as the GEMM's epilogue
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (y != ignore_index)
    y_row = tl.where(valid, y, 0).to(tl.int64)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BR, BK), tl.float32)
    acc_sum = tl.zeros((BR, BK), tl.float32)
    for k in range(0, K, BK):
        mask = valid[:, None] & ((k + ks) < K)[None, :]
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xn + (k + ks)[None, :], mask=mask, other=0.0)
        b = tl.load(w_ptr + y_row[:, None] * stride_wv + (k + ks)[None, :], mask=mask, other=0.0)
        acc += a.to(tl.float32) * b.to(tl.float32)
        if SUM_T:
            w_sum = tl.load(w_sum_ptr + k + ks, mask=(k + ks) < K, other=0.0)
            acc_sum += a.to(tl.float32) * w_sum[None, :]
    if SUM_T:
        tl.store(sum_t_ptr + rows, tl.where(valid, tl.sum(acc_sum, 1) * inv_temperature, 0.0), mask=row_ok)
    z = tl.sum(acc, 1)
    if HAS_BIAS:
        z += tl.load(bias_ptr + y_row, mask=valid, other=0.0).to(tl.float32)
    t, dt = _transform(z, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE, FAST_TANH)
    if GRAD:
        # a [BR, 1] tile whose one column is each row's target
        g = _grad_of_t(
            t[:, None],
            dt,
            valid[:, None],
            rows,
            valid,
            lse_ptr,
            entropy_ptr,
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
            False,
        )
        # dt/dz after the tile is a row again (dt is [BR], or a scalar with a temperature alone)
        g = tl.sum(g, 1)
        if HAS_SOFTCAP or HAS_TEMPERATURE:
            g *= dt
        tl.store(out_ptr + rows, tl.where(valid, g, 0.0), mask=row_ok)
    else:
        tl.store(out_ptr + rows, tl.where(valid, t, float("inf")), mask=row_ok)


@triton.jit(do_not_specialize=["N"])
def _merge_kernel(
    part_ptr,
    best_ptr,
    ty_ptr,
    y_ptr,
    x_ptr,
    stride_xn,
    w_ptr,
    stride_wv,
    K,
    inv_softcap,
    t_scale,
    inv_temperature,
    ref_offset,
    e_ptr,
    stride_en,
    e_cols,
    repair_above,
    loss_ptr,
    lse_ptr,
    logprob_ptr,
    entropy_ptr,
    top1_ptr,
    mean_ptr,
    lssp_ptr,
    sum_t_ptr,
    N,
    stride_pt,
    V,
    n_tiles,
    ignore_index,
    smoothing,
    smooth_over_v,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    ENTROPY: tl.constexpr,
    TOP1: tl.constexpr,
    SUM_T: tl.constexpr,
    SUM_E2: tl.constexpr,
    ROW_SUM_T: tl.constexpr,
    FIXED_REF: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    BR: tl.constexpr,
    BT: tl.constexpr,
):
    """Row statistics from the partials of BR rows ([stat, tile, row] layout: loads are contiguous along rows).
    ``FIXED_REF``: every partial sum is relative to the row's ``t_y + ref_offset`` (no optional statistics, no bias).
    ``SCALED``: ``e`` is ``MODE_SCALED``'s E, rewritten at rows past ``repair_above``. ``x`` and ``W`` serve the rows
    the GEMM's float32 range could not (``triton_tiles.exact_row``). ``ROW_SUM_T``: each row's sum of t comes from
    ``sum_t`` (``_target_kernel``'s dot with W's column sum) instead of the partials."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (y != ignore_index)
    stat_stride = n_tiles * stride_pt
    sum_e = tl.zeros((BR,), tl.float32)
    sum_e_tm = tl.zeros((BR,), tl.float32)
    sum_e2 = tl.zeros((BR,), tl.float32)
    sum_t = tl.zeros((BR,), tl.float32)
    best = tl.full((BR,), 2147483647, tl.int32)
    t_y = tl.load(ty_ptr + rows, mask=valid, other=0.0)
    if FIXED_REF:
        row_max = t_y + ref_offset
        for t0 in range(0, n_tiles, BT):
            tiles = t0 + tl.arange(0, BT)
            mask = (tiles[:, None] < n_tiles) & valid[None, :]
            sum_e += tl.sum(
                tl.load(part_ptr + stat_stride + tiles[:, None] * stride_pt + rows[None, :], mask=mask, other=0.0), 0
            )
    else:
        row_max = tl.full((BR,), _NEG_BIG, tl.float32)
        for t0 in range(0, n_tiles, BT):
            tiles = t0 + tl.arange(0, BT)
            # ignored rows' partials are never read: the GEMM may have skipped them (ROWS_ON_DEVICE)
            mask = (tiles[:, None] < n_tiles) & valid[None, :]
            m = tl.load(part_ptr + tiles[:, None] * stride_pt + rows[None, :], mask=mask, other=_NEG_BIG)
            row_max = tl.maximum(row_max, tl.max(m, 0))
        for t0 in range(0, n_tiles, BT):
            tiles = t0 + tl.arange(0, BT)
            mask = (tiles[:, None] < n_tiles) & valid[None, :]
            offs = tiles[:, None] * stride_pt + rows[None, :]
            m = tl.load(part_ptr + offs, mask=mask, other=_NEG_BIG)
            shift = tl.where(mask, m - row_max[None, :], 0.0)
            # a partial with max m holds sums relative to m: relative to the row max they scale by exp(m - row_max)
            scale = tl.where(mask, fast_exp(shift), 0.0)
            s = tl.load(part_ptr + stat_stride + offs, mask=mask, other=0.0)
            sum_e += tl.sum(scale * s, 0)
            if ENTROPY:
                t_m = tl.load(part_ptr + 2 * stat_stride + offs, mask=mask, other=0.0)
                sum_e_tm += tl.sum(scale * (t_m + shift * s), 0)
            if SUM_E2:
                sum_e2 += tl.sum(scale * scale * tl.load(part_ptr + 3 * stat_stride + offs, mask=mask, other=0.0), 0)
            if SUM_T:
                sum_t += tl.sum(tl.load(part_ptr + 4 * stat_stride + offs, mask=mask, other=0.0), 0)
            if TOP1:
                # argmax indices grow with the tile, so the smallest among the tiles holding the max is the first argmax
                cand = tl.load(best_ptr + offs, mask=mask & (m == row_max[None, :]), other=2147483647)
                best = tl.minimum(best, tl.min(cand, 0))
    if ROW_SUM_T:
        sum_t = tl.load(sum_t_ptr + rows, mask=valid, other=0.0)
    sum_e = tl.where(valid, sum_e, 1.0)
    log_sum_exp = tl.log(sum_e)
    lse = tl.where(valid, row_max, 0.0) + log_sum_exp
    if SCALED:
        # The rows the GEMM's float32 range cannot serve, a loss past ~120 nats (FIXED_REF: the sum against
        # t_y + ref_offset overflowed to inf) or, for E, past repair_above: exact_row recomputes their logits by
        # float32 dots.
        slow = valid & ((lse == float("inf")) | (lse - t_y > repair_above))
        if tl.max(slow.to(tl.int32), 0) > 0:
            lanes = tl.arange(0, BR)
            for i in range(BR):
                if tl.sum(tl.where(lanes == i, slow, False).to(tl.int32), 0) > 0:
                    row = tl.program_id(0) * BR + i
                    row_lse = exact_row(
                        x_ptr + row.to(tl.int64) * stride_xn,
                        w_ptr,
                        stride_wv,
                        V,
                        K,
                        inv_softcap,
                        t_scale,
                        inv_temperature,
                        e_ptr + row.to(tl.int64) * stride_en,
                        e_cols,
                        tl.sum(tl.where(lanes == i, y, 0), 0),
                        tl.sum(tl.where(lanes == i, t_y, 0.0), 0),
                        tl.sum(tl.where(lanes == i, lse, 0.0), 0),
                        repair_above,
                        HAS_SOFTCAP,
                        HAS_TEMPERATURE,
                        128,
                        64,
                    )
                    lse = tl.where(lanes == i, row_lse, lse)
    # t_y is a separate float32 dot: where the target holds the row max it can come out an ulp above the GEMM's max,
    # and lse - t_y (>= 0 in exact arithmetic) a rounding error below 0
    logprob = tl.minimum(t_y - lse, 0.0)
    loss = -(1.0 - smoothing) * logprob
    if HAS_SMOOTHING:
        loss += smooth_over_v * (V * lse - sum_t)
    if HAS_ZLOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_ok)
    tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=row_ok)
    tl.store(logprob_ptr + rows, tl.where(valid, logprob, 0.0), mask=row_ok)
    # statistics not computed are written as 0
    entropy = tl.zeros((BR,), tl.float32)
    if ENTROPY:
        # H = log(sum e) - sum e (t - m) / sum e: no cancellation of two large terms
        entropy = log_sum_exp - sum_e_tm / sum_e
    tl.store(entropy_ptr + rows, tl.where(valid, entropy, 0.0), mask=row_ok)
    is_top1 = valid & (best == y)
    if not TOP1:
        is_top1 = tl.zeros_like(valid)
    tl.store(top1_ptr + rows, is_top1.to(tl.int8), mask=row_ok)
    tl.store(mean_ptr + rows, tl.where(valid, sum_t / V, 0.0), mask=row_ok)
    log_sum_sq = tl.zeros((BR,), tl.float32)
    if SUM_E2:
        log_sum_sq = tl.log(tl.where(valid, sum_e2, 1.0)) - 2.0 * log_sum_exp
    tl.store(lssp_ptr + rows, tl.where(valid, log_sum_sq, 0.0), mask=row_ok)


@triton.jit(do_not_specialize=["N"])
def _grad_from_e_kernel(
    e_ptr,
    stride_en,
    g_ptr,
    stride_gn,
    part_ptr,
    stride_pt,
    y_ptr,
    ty_ptr,
    lse_ptr,
    entropy_ptr,
    gl_ptr,
    stride_gl,
    glp_ptr,
    stride_glp,
    ge_ptr,
    stride_ge,
    N,
    V,
    ignore_index,
    t_scale,
    inv_temperature,
    smoothing,
    smooth_over_v,
    z_loss,
    HAS_GL: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    TARGET_APART: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
):
    """The gradient of a [BR, BN] block (BN = the GEMM's tile width, so one m per row) from the stored e, whose V
    columns may be the head's first ones only. ``g`` may be ``e``'s own memory: each element is read before it is
    written, by the same thread. ``TARGET_APART``: 0 at each row's target column, as MODE_GRAD's epilogue."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    tile = tl.program_id(1)
    cols = tile * BN + tl.arange(0, BN)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (y != ignore_index)
    m = tl.load(part_ptr + tile * stride_pt + rows, mask=valid, other=0.0)
    lse, entropy, p_coef, onehot_coef, smooth_coef, g_entropy = _row_coefs(
        rows,
        valid,
        lse_ptr,
        entropy_ptr,
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
    )
    mask = row_ok[:, None] & (cols < V)[None, :]
    e = tl.load(e_ptr + rows.to(tl.int64)[:, None] * stride_en + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # p = e exp(m - lse); m <= lse, so the factor is at most 1
    p = e * tl.where(valid, fast_exp(m - lse), 0.0)[:, None]
    is_y = cols[None, :] == y[:, None]
    log_p = e  # read with entropy gradients only
    t = e  # read with a softcap only
    if HAS_GE or HAS_SOFTCAP:
        log_e = fast_log(tl.maximum(e, 1e-30))
        if HAS_GE:
            # log p_j = log e_j + (m - lse); where e_j underflowed to 0, p_j log p_j -> 0
            log_p = tl.where(e > 0.0, log_e + (m - lse)[:, None], 0.0)
        if HAS_SOFTCAP:
            # t_j = m + log e_j
            t = tl.where(e > 0.0, m[:, None] + log_e, 0.0)
    if HAS_SOFTCAP:
        # the [j == y] term needs dt at t_y even where p_y underflowed: t_y comes from the forward tile
        t = tl.where(is_y, tl.load(ty_ptr + rows, mask=valid, other=0.0)[:, None], t)
    g = logit_grad(p, log_p, is_y, p_coef, onehot_coef, g_entropy, entropy, HAS_GE) - smooth_coef
    if HAS_SOFTCAP:
        # dt/dz = (1 - tanh(z / softcap)**2) / temperature, tanh(z / softcap) = t / t_scale (|t| can round past t_scale)
        th = t * (1.0 / t_scale)
        g *= tl.maximum(1.0 - th * th, 0.0) * inv_temperature
    elif HAS_TEMPERATURE:
        g *= inv_temperature
    if TARGET_APART:
        g = tl.where(is_y, 0.0, g)
    tl.store(g_ptr + rows.to(tl.int64)[:, None] * stride_gn + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)


@dataclass
class KeptSoftmax:
    """What the gradient pass needs of a chunk: e = exp(t - m_tile) in fp16 ``[rows, V]``, the per-tile maxima
    ``[n_tiles, rows]`` (first plane of ``partials``), the tile width and the target logits ``t_y`` (float32
    ``[rows]``, unset at ignored rows; read with a softcap). ``e`` may hold the first columns only
    (``forward(keep_columns=)``): its gradient is then those columns'."""

    e: torch.Tensor
    partials: torch.Tensor
    tile_n: int
    t_y: torch.Tensor

    def head(self, rows: int) -> KeptSoftmax:
        """The first ``rows`` rows (views)."""
        return KeptSoftmax(self.e[:rows], self.partials[:, :rows], self.tile_n, self.t_y[:rows])


def _planes(params: TileParams, scaled: bool = False) -> int:
    """Float32 planes of partial statistics a call needs: m and sum e, then up to the last optional one asked for
    (their planes are fixed: sum e (t - m), sum e**2, sum t)."""
    flags = _stat_flags(params, scaled=scaled)
    return 5 if flags["SUM_T"] else 4 if flags["SUM_E2"] else 3 if flags["ENTROPY"] else 2


@functools.cache
def _max_tiles(vocab: int, tma: bool | None = None) -> int:
    """Column tiles per row at the narrowest tile a launch may pick: among the configurations with TMA or without
    (``tma``, as ``_prune_configs`` keeps them), or among all (None: chunk planning, before the operands are known).
    The partials are sized for it; the kernel indexes them by the tile width it runs. With TMA that is 256 columns,
    half the partials of the narrowest tile without (at 32k rows of a 128k vocabulary, 66 MB less per plane)."""
    configs = _head_gemm_kernel.configs
    configs = [c for c in configs if tma is None or c.kwargs["USE_TMA"] == tma] or configs
    return cdiv(vocab, min(c.kwargs["BN"] for c in configs))


def partial_bytes_per_row(vocab: int, params: TileParams, scaled: bool = False) -> int:
    """Bytes per row of the partial statistics: ``_planes`` float32 values per tile, and an int32 argmax with
    ``is_top1``."""
    return _max_tiles(vocab) * 4 * (_planes(params, scaled) + _stat_flags(params)["TOP1"])


def _row_reference(params: TileParams) -> bool:
    """Whether a ``MODE_SCALED`` launch (no bias: ``triton_scaled.supports``) takes ``t_y + REF_OFFSET`` as every
    tile's reference (``FIXED_REF``) instead of the tile's max: with no optional statistic (entropy and the others are
    relative to the tile max).
    ``HF_FLCE_ROW_REFERENCE=0`` keeps the tile max. Statistics-only launches keep it too: on an H200 the row
    reference gained nothing there (docs/PERF_NOTES.md, v15), and a row past ~120 nats would take the slow exact
    path, which a diverged model's eval could meet on every row."""
    return not any(_stat_flags(params, scaled=True).values()) and os.environ.get("HF_FLCE_ROW_REFERENCE", "1") != "0"


def supports(dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None, params: TileParams) -> bool:
    """Whether this path applies to a call whose GEMM operands are ``dtype`` and ``weight``: 16-bit operands of one
    dtype, a contiguous hidden dimension, no class weights, and no softcap together with label smoothing (whose
    gradient needs every ``t_j``, lost where the stored ``e_j`` underflowed)."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == dtype
        and (weight.device.type == "cuda" or (weight.device.type == "cpu" and triton_interpreting()))
        and weight.stride(-1) == 1
        and (params.softcap is None or params.label_smoothing == 0.0)
        and params.class_weight is None
        and (bias is None or bias.is_contiguous())
    )


def scaled_gradient_supports(dtype: torch.dtype, bias: torch.Tensor | None, plan) -> bool:
    """Whether a loss's gradient comes as a ``triton_scaled.ScaledGradient`` (``forward(scaled=True)``):
    ``triton_scaled.supports`` (``HF_FLCE_SCALED_GRAD=0`` asks for the gradient pass over stored e)."""
    return triton_scaled.supports(dtype, bias, plan.params, scalar=plan.reduction == "scalar")


def bytes_per_logit(vocab: int, params: TileParams, keep: bool = True, scaled: bool = False) -> float:
    """Chunk memory per logit: e (then the gradient) in 16 bits when it is kept, plus the partial statistics (of a
    ``scaled`` launch with ``scaled``)."""
    return (2 if keep else 0) + partial_bytes_per_row(vocab, params, scaled) / vocab


def _vectors(upstream, spare):
    args = []
    for g in upstream:
        g = spare if g is None else g
        args += [g, g.stride(0) if g.dim() else 0]
    return args


def _stat_flags(params: TileParams, wanted: bool = True, scaled: bool = False) -> dict:
    """Which optional partial statistics the epilogue computes (the sum of t also serves label smoothing, except in
    a ``scaled`` launch, which takes it from W's column sum: ``forward``)."""
    stats = params.optional_stats if wanted else frozenset()
    return dict(
        ENTROPY="entropy" in stats,
        TOP1="is_top1" in stats,
        SUM_T="mean_logit" in stats or (params.label_smoothing != 0.0 and not scaled),
        SUM_E2="log_sum_sq_probs" in stats,
    )


def _option_flags(params: TileParams, upstream) -> dict:
    return dict(
        HAS_GL=upstream[0] is not None,
        HAS_GLP=upstream[1] is not None,
        HAS_GE=upstream[2] is not None,
        HAS_SMOOTHING=params.label_smoothing != 0.0,
        HAS_ZLOSS=params.z_loss != 0.0,
        HAS_SOFTCAP=params.softcap is not None,
        HAS_TEMPERATURE=params.inv_temperature != 1.0,
    )


def _t_scale(params: TileParams) -> float:
    """softcap / temperature, the bound of |t| (0 without a softcap)."""
    return 0.0 if params.softcap is None else params.softcap * params.inv_temperature


def transform_args(params: TileParams) -> tuple[float, float, float]:
    """The kernels' ``inv_softcap, t_scale, inv_temperature`` arguments (``triton_tiles._transform``)."""
    return 0.0 if params.softcap is None else 1.0 / params.softcap, _t_scale(params), params.inv_temperature


def _split_epilogue() -> bool:
    """``HF_FLCE_SPLIT_EPILOGUE=0`` keeps MODE 3's epilogue on whole tiles with a TMA store (for A/B measurements)."""
    return os.environ.get("HF_FLCE_SPLIT_EPILOGUE", "1") != "0"


def _gemm(
    x,
    weight,
    bias,
    target,
    params,
    mode,
    out,
    partials,
    best,
    lse,
    entropy,
    upstream,
    rows_on_device=None,
    t_y=None,
    fixed_ref=False,
    first_column=0,
    out_columns=None,
    target_apart=False,
    use_tma=None,
):
    """``weight`` (and ``bias``) may hold the head's rows from ``first_column`` on (MODE_GRAD only): the output's
    columns are theirs, while the statistics' constants still come from the whole vocabulary (``params.vocab``).
    ``out_columns`` (MODE_KEEP or MODE_SCALED, a multiple of every configuration's BN): ``out`` holds e's (E's) first
    columns only.
    ``target_apart`` (MODE_GRAD): the gradient has 0 at each row's target column. ``use_tma``: ``_tma_usable(x,
    weight)`` where the caller has it."""
    n, k = x.shape
    columns = weight.shape[0]
    partial_out = out_columns is not None and out_columns < columns
    use_tma = _tma_usable(x, weight) if use_tma is None else use_tma
    if use_tma:
        # device-side tensor descriptors live in scratch memory that Triton asks its allocator for
        triton.set_allocator(_tma_scratch)
    spare = partials if partials is not None else lse
    programs = _program_limit(x.device)
    split = mode == MODE_SCALED and fixed_ref and _split_epilogue()

    def grid(meta):
        return (min(programs, cdiv(n, meta["BM"]) * cdiv(columns, meta["BN"])),)

    args = (
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        spare if bias is None else bias,
        target,
        spare if t_y is None else t_y,
        spare if out is None else out,
        0 if out is None else out.stride(0),
        spare if partials is None else partials,
        spare if best is None else best,
        spare if lse is None else lse,
        spare if entropy is None else entropy,
        *_vectors(upstream, spare),
        spare if rows_on_device is None else rows_on_device,
        n,
        partial_stride(n),
        columns,
        k,
        params.ignore_index,
        *transform_args(params),
        params.label_smoothing,
        params.label_smoothing / params.vocab,
        params.z_loss,
        triton_scaled.REF_OFFSET,
        L2_GROUP_BYTES // (k * x.element_size()),
        first_column,
        out_columns if partial_out else columns,
    )
    flags = dict(
        MODE=mode,
        ROWS_ON_DEVICE=rows_on_device is not None,
        HAS_BIAS=bias is not None,
        UPCAST=x.device.type == "cpu",
        # float32 operands (tests) get exact products, not TF32; 16-bit ones use the tensor cores either way
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # a TMA store stages the whole output tile in shared memory: not for float32 tiles (tests), which would not fit
        # (and not where MODE 3 stores E from registers in column halves: SPLIT)
        TMA_OUT=use_tma and out is not None and out.element_size() == 2 and _tma_aligned(out) and not split,
        **_option_flags(params, (None, None, None) if mode != MODE_GRAD else upstream),
        **_stat_flags(params, wanted=mode != MODE_GRAD, scaled=mode == MODE_SCALED),
        FIXED_REF=fixed_ref,
        SPLIT=split,
        PARTIAL_OUT=partial_out,
        TARGET_APART=target_apart,
    )
    tuned_key = (
        columns,
        k,
        mode,
        use_tma,
        fixed_ref,
        partial_out,
        target_apart,
        tuple(a.dtype for a in args if isinstance(a, torch.Tensor)),
    )
    return _launch_tuned(grid, args, flags, tuned_key)


# The configuration the autotuner picked, per launch key (finer than its own: vocabulary, K, mode, TMA and every
# tensor argument's dtype).
_TUNED: dict[tuple, triton.Config] = {}


def _launch_tuned(grid, args, flags, key) -> triton.Config:
    """``_head_gemm_kernel``: through the autotuner the first time ``key`` is seen, then straight to the configuration
    it picked. Its per-launch bookkeeping (dicts of every argument, list lookups) costs tens of microseconds of host
    time, which an isolated call's GPU waits for."""
    config = _TUNED.get(key)
    if config is None:
        candidates = _prune_configs(_head_gemm_kernel.configs, dict(zip(_head_gemm_kernel.arg_names, args)))
        if len(candidates) > 1:
            _head_gemm_kernel[grid](*args, **flags)
            _TUNED[key] = _head_gemm_kernel.best_config
            return _TUNED[key]
        # One candidate (Hopper: the TMA configuration): Triton 3.6's autotuner would still time it.
        config = _TUNED[key] = candidates[0]
    _head_gemm_kernel.best_config = config
    launch(_head_gemm_kernel.fn, grid(config.kwargs), *args, **flags, **config.all_kwargs())
    return config


def _launch_target_kernel(x, weight, bias, target, params, out, grad=None, row_sums=None):
    """``_target_kernel``: ``t_y`` into ``out``, or with ``grad = (lse, entropy, upstream)`` the target column's
    gradient; with ``row_sums = (w_sum, sum_t)`` each row's sum of t into ``sum_t`` too."""
    br = 16
    lse, entropy, upstream = grad if grad is not None else (out, out, (None, None, None))
    launch(
        _target_kernel,
        (cdiv(x.shape[0], br),),
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        out if bias is None else bias,
        target,
        out,
        lse,
        entropy,
        *_vectors(upstream, out),
        *((out, out) if row_sums is None else row_sums),
        x.shape[0],
        x.shape[1],
        params.ignore_index,
        *transform_args(params),
        params.label_smoothing,
        params.label_smoothing / params.vocab,
        params.z_loss,
        GRAD=grad is not None,
        SUM_T=row_sums is not None,
        HAS_BIAS=bias is not None,
        **_option_flags(params, upstream),
        BR=br,
        BK=128,
        num_warps=4,
    )


def target_gradient(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    params: TileParams,
    grad_loss: torch.Tensor | None = None,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's logits gradient at its target column, float32 ``[rows]``: the entries that ``recompute_gradient(...,
    target_apart=True)`` and ``gradient(..., target_apart=True)`` write as 0 (no bias); 0 at ignored rows."""
    n = x.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        with TritonTileOps._device_guard(x.device):
            upstream = (grad_loss, grad_logprob, grad_entropy)
            _launch_target_kernel(x, weight, None, target, params, out, (lse, entropy, upstream))
    return out


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    params: TileParams,
    keep: bool,
    rows_on_device: torch.Tensor | None = None,
    scaled: bool = False,
    keep_columns: int | None = None,
    upstream: Callable[[], torch.Tensor] | None = None,
    w_sum: torch.Tensor | None = None,
) -> tuple[TileStats, KeptSoftmax | triton_scaled.ScaledGradient | None]:
    """Statistics of every row of ``x W^T + b`` (and, with ``keep``, what the gradient pass needs), without ever
    materialising the logits. ``rows_on_device`` (an integer tensor; statistics only, or a scaled gradient): the GEMM
    computes only as many leading rows as its first element says (at most N), a count the host need not read; the
    rows after them must have ``ignore_index`` targets, and a scaled gradient's ``E`` is left unwritten there (the
    caller cuts those rows off once it knows the count). ``scaled`` (a scalar loss, ``triton_scaled.supports``): the
    second result is the logits gradient as a ``ScaledGradient`` per unit of upstream gradient, with no pass over the
    logits after the GEMM; with ``upstream`` (a function giving the 0-d float32 upstream gradient, called once the GEMM
    is launched), for that gradient instead. ``keep_columns`` (with ``keep``, a multiple of ``COLUMN_ALIGN``): e is
    kept for the first columns only, the rest of a per-token loss's logits being recomputed in backward; with
    ``scaled`` too, as E with row scales per unit of upstream gradient (``ScaledGradient.times`` gives them the
    per-token upstream), whose target column, where E holds it, is 0 (``target_gradient`` gives it). A label-smoothed
    scaled gradient takes W's column sum ``w_sum`` (float32 ``[H]``, computed here where not given: a caller with
    several chunks passes it once) for each row's sum of t and the gradient's uniform term."""
    n, vocab = x.shape[0], params.vocab
    if keep_columns is not None and (not (keep or scaled) or keep_columns % COLUMN_ALIGN or keep_columns <= 0):
        raise ValueError(
            f"keep_columns must be a positive multiple of {COLUMN_ALIGN} with keep or scaled, got {keep_columns}"
        )
    partial = keep_columns is not None and keep_columns < vocab
    e_columns = keep_columns if partial else vocab
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    f16 = dict(dtype=torch.float16, device=dev)
    if n == 0:
        stats = TileStats.empty(0, dev)
        if scaled:
            empty = torch.empty(0, e_columns, dtype=x.dtype, device=dev)
            return stats, triton_scaled.ScaledGradient(empty, stats.loss, stats.loss, target, params.ignore_index)
        empty = torch.empty(0, e_columns, dtype=torch.float16, device=dev)
        return stats, (KeptSoftmax(empty, stats.loss.view(1, 0), 1, stats.loss) if keep else None)
    mode = MODE_SCALED if scaled else MODE_KEEP if keep else MODE_STATS
    # Sized for the narrowest tile this launch may run; the kernel indexes them by the tile width the autotuner picked.
    use_tma = _tma_usable(x, weight)
    max_tiles = _max_tiles(vocab, use_tma)
    stride = partial_stride(n)
    partials = torch.empty(_planes(params, scaled) * max_tiles * stride, **f32)
    best = torch.empty(max_tiles * stride if _stat_flags(params)["TOP1"] else 1, dtype=torch.int32, device=dev)
    fixed_ref = scaled and _row_reference(params)
    e = t_y = sum_t = None
    smoothed = scaled and params.label_smoothing != 0.0
    if scaled:
        # the GEMM's row references m = t_y + REF_OFFSET come first
        t_y = torch.empty(n, **f32)
        row_sums = None
        if smoothed:
            w_sum = weight.sum(0, dtype=torch.float32) if w_sum is None else w_sum
            sum_t = torch.empty(n, **f32)
            row_sums = (w_sum, sum_t)
        _launch_target_kernel(x, weight, bias, target, params, t_y, row_sums=row_sums)
    if scaled:
        # with label smoothing a spare row after E's last, for ScaledGradient.dw_operands
        e = torch.empty(n + smoothed, e_columns, dtype=x.dtype, device=dev)[:n]
    elif keep:
        e = torch.empty(n, e_columns, **f16)
    with TritonTileOps._device_guard(dev):
        config = _gemm(
            x,
            weight,
            bias,
            target,
            params,
            mode,
            e,
            partials,
            best,
            None,
            None,
            (None,) * 3,
            rows_on_device,
            t_y,
            fixed_ref,
            out_columns=e_columns,
            use_tma=use_tma,
        )
        # the partials' layout follows the tile width the autotuner picked for this launch
        tile_n = config.kwargs["BN"]
        # allocated after the GEMM's launch: in an isolated call the GPU waits for nothing but the host
        stats = TileStats.empty(n, dev)
        if t_y is None:
            t_y = torch.empty(n, **f32)
            _launch_target_kernel(x, weight, bias, target, params, t_y)
        n_tiles = cdiv(vocab, tile_n)
        launch(
            _merge_kernel,
            (cdiv(n, MERGE_ROWS),),
            partials,
            best,
            t_y,
            target,
            x,
            x.stride(0),
            weight,
            weight.stride(0),
            x.shape[1],
            *transform_args(params),
            triton_scaled.REF_OFFSET,
            t_y if e is None else e,
            0 if e is None else e.stride(0),
            0 if e is None else e.shape[1],
            triton_scaled.REPAIR_ABOVE,
            stats.loss,
            stats.lse,
            stats.logprob,
            stats.entropy,
            stats.is_top1.view(torch.int8),
            stats.mean_logit,
            stats.log_sum_sq_probs,
            stats.loss if sum_t is None else sum_t,
            n,
            stride,
            vocab,
            n_tiles,
            params.ignore_index,
            params.label_smoothing,
            params.label_smoothing / vocab,
            params.z_loss,
            HAS_SMOOTHING=params.label_smoothing != 0.0,
            HAS_ZLOSS=params.z_loss != 0.0,
            **_stat_flags(params, scaled=scaled),
            ROW_SUM_T=sum_t is not None,
            FIXED_REF=fixed_ref,
            SCALED=scaled,
            HAS_SOFTCAP=params.softcap is not None,
            HAS_TEMPERATURE=params.inv_temperature != 1.0,
            BR=MERGE_ROWS,
            BT=MERGE_TILES,
            num_warps=4,
        )
    if scaled:
        g = None if upstream is None else upstream()
        return stats, triton_scaled.row_scales(e, target, t_y, stats.lse, params, transform_args(params), g, w_sum)
    if not keep:
        return stats, None
    # the maxima of the tiles e is kept for (the first plane) outlive the call, apart from the other planes
    kept_tiles = cdiv(e.shape[1], tile_n)
    maxima = partials[: kept_tiles * stride].view(kept_tiles, stride).clone()[:, :n]
    return stats, KeptSoftmax(e, maxima, tile_n, t_y)


def gradient(
    kept: KeptSoftmax,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    params: TileParams,
    out_dtype: torch.dtype,
    grad_loss: torch.Tensor | None = None,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    target_apart: bool = False,
) -> torch.Tensor:
    """The logits gradient ``[rows, V]`` (or the columns ``kept.e`` holds) in ``out_dtype`` (16-bit: written over
    ``kept.e``, which is consumed). ``target_apart``: each row's target column is written as 0, for
    ``target_gradient`` to give in float32."""
    e = kept.e
    n, vocab = e.shape
    out = e.view(out_dtype) if out_dtype.itemsize == 2 else torch.empty(n, vocab, dtype=out_dtype, device=e.device)
    if n == 0:
        return out
    upstream = (grad_loss, grad_logprob, grad_entropy)
    br = 16 if kept.tile_n >= 256 else 32
    with TritonTileOps._device_guard(e.device):
        launch(
            _grad_from_e_kernel,
            (cdiv(n, br), cdiv(vocab, kept.tile_n)),
            e,
            e.stride(0),
            out,
            out.stride(0),
            kept.partials,
            kept.partials.stride(0),
            target,
            kept.t_y,
            lse,
            entropy,
            *_vectors(upstream, lse),
            n,
            vocab,
            params.ignore_index,
            _t_scale(params),
            params.inv_temperature,
            params.label_smoothing,
            params.label_smoothing / params.vocab,
            params.z_loss,
            TARGET_APART=target_apart,
            BR=br,
            BN=kept.tile_n,
            num_warps=4,
            **_option_flags(params, upstream),
        )
    kept.e = None
    return out


def gradient_target_apart(
    kept: KeptSoftmax,
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    stats: TileStats,
    params: TileParams,
    grad_loss: torch.Tensor,
) -> triton_scaled.ScaledGradient:
    """A scalar loss's 16-bit logits gradient from stored e (``gradient``) where it is no row scale of ``E`` (fp16
    operands), with each row's target column written as 0 and carried in float32 (``target_gradient``, from ``x``
    and ``weight``: no bias). It comes back as a ``ScaledGradient`` with unit row scales, as the tile path's two
    sweeps give it (``forward_target_apart``): the 16-bit gradient then rounds only the softmax part, so dW can be
    summed across chunks in the 16-bit gradient itself (``engine._dw_sum_in_weight_dtype``)."""
    grad = gradient(kept, target, stats.lse, stats.entropy, params, x.dtype, grad_loss, target_apart=True)
    coef = target_gradient(x, weight, target, stats.lse, stats.entropy, params, grad_loss)
    return triton_scaled.ScaledGradient(grad, None, coef, target, params.ignore_index)


def recompute_gradient(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    params: TileParams,
    grad_loss: torch.Tensor | None = None,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    first_column: int = 0,
    target_apart: bool = False,
) -> torch.Tensor:
    """The logits gradient in ``x``'s dtype straight from the GEMM's epilogue (lse known): ``[rows, V]``, or with
    ``weight`` (and ``bias``) the head's rows ``first_column:first_column + C`` (a vocabulary chunk), those ``C``
    columns of it. ``target_apart``: each row's target column is written as 0, for ``target_gradient`` to give in
    float32."""
    n = x.shape[0]
    check_columns(first_column, weight.shape[0], params.vocab)
    out = torch.empty(n, weight.shape[0], dtype=x.dtype, device=x.device)
    if n:
        with TritonTileOps._device_guard(x.device):
            _gemm(
                x,
                weight,
                bias,
                target,
                params,
                MODE_GRAD,
                out,
                None,
                None,
                lse,
                entropy,
                (grad_loss, grad_logprob, grad_entropy),
                first_column=first_column,
                target_apart=target_apart,
            )
    return out


# ``dW[y_i] += c_i x_i`` in float32 (``c = target_gradient(...)``), each dW row it reaches rounded once more:
# ``triton_scaled``'s sorted, atomic-free sum
add_target_rows = triton_scaled.ScaledGradient.add_target_rows


def write_dx(
    dx_sum: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    target_coef: torch.Tensor,
    dx: torch.Tensor,
    dst_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx[dst_i] = dx_sum_i + c_i W[y_i]``: a float32 sum over vocabulary chunks with its target column
    (``c = target_gradient(...)``) added, in ``dx``'s dtype, at ``dst_rows`` (a compacted batch's rows) or in order."""
    return triton_scaled.scale_rows(dx_sum, dx, None, target_coef, target, weight, dst_rows)
