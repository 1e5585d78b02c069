"""dW summed across chunks into the 16-bit gradient plus an 8-bit residual (CUDA; CPU under ``TRITON_INTERPRET=1``).

With several chunks, ``dW = sum_c G_c^T X_c``. A float32 accumulator costs ``4 V H`` bytes (1.96 GiB on llama3-8b),
and it lives from the forward (where scalar losses compute their gradients) into the backward, over the training
step's activation peak. Summing straight into the 16-bit gradient instead rounds every partial sum, so the dW error
grows with the chunk count (``scripts/dw_accumulation_error.py``).

Here each chunk's GEMM adds its float32 tile into ``(hi, lo)`` in its epilogue:

    s  = G_c^T X_c + hi + lo * u(hi)          (float32)
    hi = round_to_16_bits(s)                  (the gradient buffer itself)
    lo = round((s - hi) / u(hi))              (int8)

with ``u(hi) = ulp(hi) / 256``, a power of two read off ``hi``'s exponent. ``|s - hi| <= ulp(hi) / 2``, so ``lo``
fits in [-128, 128] (128 is clamped to 127) and ``hi + lo u`` carries 8 bits more than ``hi``: about 16 significant
bits for bf16, 19 for fp16. The sums across chunks then lose nothing that matters, and ``hi`` is rounded once more than
a one-GEMM dW only by the residual's 2^-17 relative step. The last chunk folds ``lo`` into ``hi`` and ``lo`` is freed:
``V H`` bytes for the duration of the forward instead of ``4 V H`` until the backward.

The GEMM is persistent with the tile loop flattened into the K loop (``triton_gemm`` explains why). ``G_c`` is
``[rows, V]`` and ``X_c`` is ``[rows, H]``: both operands are loaded along their rows and the ``G`` tile is transposed
in shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv, triton_interpreting
from .triton_gemm import _program_limit, _tma_scratch, _tma_usable, grouped_tile
from .triton_launch import launch
from .triton_tiles import TritonTileOps

# Bits of the 16-bit dtypes' significands, and the smallest float32 biased exponent whose residual unit is a normal
# float32 (bf16), or of fp16's normal numbers (their subnormals share that ulp). Smaller gradients get that unit.
_FORMAT = {torch.bfloat16: (7, 16), torch.float16: (10, 113)}


def _config() -> triton.Config:
    if triton_interpreting():
        return triton.Config({"BM": 16, "BN": 32, "BK": 16, "GROUP_M": 4, "FLATTEN": False}, num_warps=4, num_stages=1)
    return tile_config(128, 128, 64, 8, 4)


def tile_config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "FLATTEN": True}, num_warps=warps, num_stages=stages
    )


@triton.jit
def _residual_unit(hi, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``ulp(hi) / 256`` and its reciprocal, as float32 powers of two built from ``hi``'s exponent bits."""
    exponent = (hi.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, MIN_EXP)
    # ulp(hi) = 2^(e - 127 - MANT): the unit's biased exponent is e - MANT - 8, its reciprocal's 254 - that
    unit_exp = exponent - MANT - 8
    unit = (unit_exp << 23).to(tl.float32, bitcast=True)
    inv_unit = ((254 - unit_exp) << 23).to(tl.float32, bitcast=True)
    return unit, inv_unit


@triton.jit
def _round_to_bf16(v):
    """``v`` rounded to the nearest bf16 (ties to even), still as float32: the cast that follows is then exact. Done
    on the bits because Triton's interpreter truncates float32 -> bf16 casts (the GPU rounds either way)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v == v, bits.to(tl.float32, bitcast=True), v)  # NaN stays NaN


@triton.jit(do_not_specialize=["K"])
def _dw_accumulate_kernel(
    g_ptr,
    stride_gn,
    x_ptr,
    stride_xn,
    hi_ptr,
    lo_ptr,
    M,
    N,
    K,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_EPILOGUE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """``(hi, lo) += g^T x`` for ``g`` ``[K, M]`` and ``x`` ``[K, N]``; ``hi``/``lo`` are ``[M, N]``, contiguous.
    ``FIRST``: ``hi``/``lo`` hold nothing yet. ``LAST``: ``lo`` is folded into ``hi`` and not written.
    ``TMA_EPILOGUE``: ``hi``/``lo`` tiles move by TMA (whole tiles through shared memory, the stores asynchronous)
    instead of per-thread 2- and 4-byte accesses in the tensor cores' register layout."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    ks = tl.arange(0, BK)
    if USE_TMA:
        # out-of-range rows (the K tail) and columns come back as zeros
        g_desc = tl.make_tensor_descriptor(g_ptr, shape=[K, M], strides=[stride_gn, 1], block_shape=[BK, BM])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[K, N], strides=[stride_xn, 1], block_shape=[BK, BN])
    if TMA_EPILOGUE:
        # out-of-range rows and columns load as zeros, and TMA stores drop them
        hi_desc = tl.make_tensor_descriptor(hi_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        lo_desc = tl.make_tensor_descriptor(lo_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n, rows, cols, row_ok, col_ok = grouped_tile(tile, tiles_m, per_group, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if USE_TMA:
            for k in range(0, K, BK):
                a = g_desc.load([k, pid_m * BM])
                b = x_desc.load([k, pid_n * BN])
                acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
        else:
            # out-of-range columns read column 0 (in bounds); their results are masked at the end
            g_ptrs = g_ptr + ks.to(tl.int64)[:, None] * stride_gn + tl.where(row_ok, rows, 0)[None, :]
            x_ptrs = x_ptr + ks.to(tl.int64)[:, None] * stride_xn + tl.where(col_ok, cols, 0)[None, :]
            for k in range(0, K, BK):
                k_ok = (k + ks) < K
                a = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
                b = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
                g_ptrs += BK * stride_gn
                x_ptrs += BK * stride_xn

        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        total = acc
        if not FIRST:
            if TMA_EPILOGUE:
                hi = hi_desc.load([pid_m * BM, pid_n * BN])
                lo = lo_desc.load([pid_m * BM, pid_n * BN])
            else:
                hi = tl.load(hi_ptr + offs, mask=mask, other=0.0)
                lo = tl.load(lo_ptr + offs, mask=mask, other=0)
            unit, _ = _residual_unit(hi, MANT, MIN_EXP)
            # float32 is exact enough here: hi + lo * unit has ~16 significant bits, the sum keeps 24
            total += hi.to(tl.float32) + lo.to(tl.float32) * unit
        if MANT == 7:
            new_hi = _round_to_bf16(total).to(hi_ptr.dtype.element_ty)
        else:
            new_hi = total.to(hi_ptr.dtype.element_ty)
        if TMA_EPILOGUE:
            hi_desc.store([pid_m * BM, pid_n * BN], new_hi)
        else:
            tl.store(hi_ptr + offs, new_hi, mask=mask)
        if not LAST:
            _, inv_unit = _residual_unit(new_hi, MANT, MIN_EXP)
            # (total - new_hi) * inv_unit is exact (a power-of-two scale of a float32 difference)
            q = tl.floor((total - new_hi.to(tl.float32)) * inv_unit + 0.5)
            new_lo = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
            if TMA_EPILOGUE:
                lo_desc.store([pid_m * BM, pid_n * BN], new_lo)
            else:
                tl.store(lo_ptr + offs, new_lo, mask=mask)


def supports(grad_dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the chunks' dW can be summed here: a 16-bit gradient and GEMM operands of the weight's dtype."""
    return (
        weight_dtype in _FORMAT
        and grad_dtype == weight_dtype
        and (device.type == "cuda" or (device.type == "cpu" and triton_interpreting()))
    )


class ResidualDW:
    """``dW = sum_c G_c^T X_c`` over ``n_chunks`` calls of ``add``, kept as the 16-bit gradient plus an int8
    residual (see the module docstring). ``result()`` is the gradient once every chunk was added.

    Example (CPU under ``TRITON_INTERPRET=1``; CUDA tensors on a GPU)::

        acc = ResidualDW((64, 32), torch.bfloat16, torch.device("cpu"), n_chunks=2)
        for g, x in ((g1, x1), (g2, x2)):  # [rows, 64] and [rows, 32] bf16
            acc.add(g, x)
        dw = acc.result()  # [64, 32] bf16
    """

    tma_epilogue = True
    config: triton.Config | None = None  # scripts/probe_dw_accumulate.py tries others
    # Hopper: the warp-specialized Gluon kernel of hopper_dw where it takes the chunk; its keyword options
    pingpong = True
    pingpong_options: dict = {}

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, n_chunks: int):
        self.hi = torch.empty(shape, dtype=dtype, device=device)
        self.lo = torch.empty(shape, dtype=torch.int8, device=device) if n_chunks > 1 else None
        self.n_chunks = n_chunks
        self.added = 0

    def add(self, grad_logits: torch.Tensor, x_chunk: torch.Tensor) -> None:
        """Adds ``grad_logits^T x_chunk`` (``[rows, M]`` and ``[rows, N]``)."""
        if self.added == self.n_chunks:
            raise RuntimeError(f"ResidualDW: a chunk beyond the {self.n_chunks} announced")
        first, last = self.added == 0, self.added == self.n_chunks - 1
        self.added += 1
        grad_logits, x_chunk = (t if t.stride(-1) == 1 else t.contiguous() for t in (grad_logits, x_chunk))
        from . import hopper_dw  # it builds on this module's jit functions

        if self.pingpong and hopper_dw.supports(grad_logits, x_chunk, self.hi):
            hopper_dw.accumulate(grad_logits, x_chunk, self.hi, self.lo, first, last, **self.pingpong_options)
        else:
            self._add_triton(grad_logits, x_chunk, first, last)
        if last:
            self.lo = None

    def _add_triton(self, grad_logits: torch.Tensor, x_chunk: torch.Tensor, first: bool, last: bool) -> None:
        rows = grad_logits.shape[0]
        m, n = self.hi.shape
        # Row strides in multiples of 16 elements, not just 16 bytes: with a stride Triton does not specialise as
        # divisible by 16, the 128x256 TMA configuration needed 272 KiB of shared memory on an H200 (over the limit).
        use_tma = (
            rows > 0
            and _tma_usable(grad_logits, x_chunk)
            and grad_logits.stride(0) % 16 == 0
            and x_chunk.stride(0) % 16 == 0
        )
        config = self.config or _config()
        # hi/lo by TMA: their rows (N elements) 16-byte aligned for both, and the base addresses
        tma_epilogue = (
            self.tma_epilogue
            and _tma_usable(self.hi, self.hi)
            and n % 16 == 0
            and (self.lo is None or self.lo.data_ptr() % 16 == 0)
        )
        if use_tma or tma_epilogue:
            triton.set_allocator(_tma_scratch)
        bm, bn = config.kwargs["BM"], config.kwargs["BN"]
        programs = _program_limit(self.hi.device)
        mant, min_exp = _FORMAT[self.hi.dtype]
        lo = self.hi if self.lo is None else self.lo  # unused pointer when there is one chunk
        with TritonTileOps._device_guard(self.hi.device):
            launch(
                _dw_accumulate_kernel,
                (min(programs, cdiv(m, bm) * cdiv(n, bn)),),
                grad_logits,
                grad_logits.stride(0),
                x_chunk,
                x_chunk.stride(0),
                self.hi,
                lo,
                m,
                n,
                rows,
                FIRST=first,
                LAST=last,
                MANT=mant,
                MIN_EXP=min_exp,
                UPCAST=x_chunk.device.type == "cpu",
                DOT_PRECISION="tf32",
                USE_TMA=use_tma,
                TMA_EPILOGUE=tma_epilogue,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
                **config.kwargs,
            )

    def result(self) -> torch.Tensor:
        if self.added != self.n_chunks:
            raise RuntimeError(f"ResidualDW: {self.n_chunks - self.added} of {self.n_chunks} chunks not added yet")
        return self.hi
