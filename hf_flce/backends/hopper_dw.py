"""The residual dW GEMM of ``triton_dw`` as a warp-specialized Hopper kernel (Gluon; CUDA, compute capability 9.x).

``triton_dw``'s Triton GEMM adds each chunk's ``G_c^T X_c`` into the bf16 gradient ``hi`` plus an int8 residual ``lo``
in its epilogue, and nothing overlaps that epilogue with the next tile's mainloop: 1.5-1.7x cuBLAS per chunk. Here
the ping-pong skeleton of ``hopper_pingpong`` runs it: a loader warp streams the ``G`` and ``X`` tiles, and two
consumer warpgroups take the tiles in turn, so one consumer's epilogue runs under the other's mainloop. Each consumer
fetches its tile's ``hi``/``lo`` by TMA when the tile starts, so the epilogue finds them in shared memory.

The arithmetic of the epilogue is ``triton_dw``'s (the same jit functions).
"""

from __future__ import annotations

import torch

from . import hopper_pingpong, triton_dw

AVAILABLE = hopper_pingpong.AVAILABLE
if AVAILABLE:
    from .hopper_pingpong import fence_async_shared, gl, gluon, mbarrier, tma

BM, BN, BK = 128, 128, 64

if AVAILABLE:
    _residual_unit = gluon.jit(triton_dw._residual_unit.fn)
    _round_to_bf16 = gluon.jit(triton_dw._round_to_bf16.fn)
    _grouped_block = hopper_pingpong.grouped_block

    @gluon.jit
    def _split_columns(x, SPLIT: gl.constexpr):
        """``x`` ``[BM, BN]`` as ``SPLIT`` column slices, in order; each thread keeps its own elements."""
        parts = (x,)
        for _ in gl.static_range(SPLIT.bit_length() - 1):
            halves = ()
            for j in gl.static_range(len(parts)):
                part = parts[j]
                # [BM, 2, BN/2] with the halves last: a thread holds column c and c + BN/2 alike
                halves += part.reshape([part.shape[0], 2, part.shape[1] // 2]).permute(0, 2, 1).split()
            parts = halves
        return parts

    @gluon.jit
    def _add_into_residual(
        acc, hi_smem, lo_smem, FIRST: gl.constexpr, LAST: gl.constexpr, MANT: gl.constexpr, MIN_EXP: gl.constexpr
    ):
        """``(hi, lo) += acc`` for one slice of a tile, ``hi``/``lo`` in shared memory; the arithmetic of
        ``triton_dw._dw_accumulate_kernel``'s epilogue."""
        layout: gl.constexpr = acc.type.layout
        total = acc
        if not FIRST:
            hi = hi_smem.load(layout)
            lo = lo_smem.load(layout)
            unit, _ = _residual_unit(hi, MANT, MIN_EXP)
            total += hi.to(gl.float32) + lo.to(gl.float32) * unit
        if MANT == 7:
            new_hi = _round_to_bf16(total).to(hi_smem.dtype)
        else:
            new_hi = total.to(hi_smem.dtype)
        hi_smem.store(new_hi)
        if not LAST:
            _, inv_unit = _residual_unit(new_hi, MANT, MIN_EXP)
            q = gl.floor((total - new_hi.to(gl.float32)) * inv_unit + 0.5)
            lo_smem.store(gl.minimum(gl.maximum(q, -127.0), 127.0).to(gl.int8))

    @gluon.jit
    def _consumer_partition(
        mainloop,
        epilogue,
        sizes,
        FIRST: gl.constexpr,
        LAST: gl.constexpr,
        MANT: gl.constexpr,
        MIN_EXP: gl.constexpr,
        SPLIT: gl.constexpr,
        WHICH: gl.constexpr,
    ):
        """Consumer ``WHICH`` (0 or 1): the mainloop and epilogue of every other tile of this program."""
        g_desc, a_bufs, b_bufs, ready, empty, turn = mainloop
        hi_desc, lo_desc, hi_bufs, lo_bufs, epi = epilogue
        M, N, K, GROUP_M = sizes
        BK: gl.constexpr = g_desc.block_type.shape[0]
        BM: gl.constexpr = hi_desc.block_type.shape[0]
        BN: gl.constexpr = hi_desc.block_type.shape[1]
        acc_layout: gl.constexpr = hopper_pingpong.accumulator_layout(BN)
        hi_smem = hi_bufs.index(WHICH)
        lo_smem = lo_bufs.index(WHICH)
        epi_bar = epi.index(WHICH)
        epi_bytes: gl.constexpr = hi_desc.block_type.nbytes + lo_desc.block_type.nbytes
        width: gl.constexpr = BN // SPLIT
        tiles_m = gl.cdiv(M, BM)
        k_steps = gl.cdiv(K, BK)
        per_group = GROUP_M * gl.cdiv(N, BN)
        programs = gl.num_programs(0)
        mine = 0
        for tile in range(gl.program_id(0) + WHICH * programs, tiles_m * gl.cdiv(N, BN), 2 * programs):
            pid_m, pid_n = _grouped_block(tile, tiles_m, per_group, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            # the previous tile's TMA stores read hi_smem/lo_smem: they must be done before the buffers are refilled
            tma.store_wait(0)
            if not FIRST:
                mbarrier.expect(epi_bar, epi_bytes)
                tma.async_copy_global_to_shared(hi_desc, [off_m, off_n], epi_bar, hi_smem)
                tma.async_copy_global_to_shared(lo_desc, [off_m, off_n], epi_bar, lo_smem)

            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            acc = hopper_pingpong.mainloop(a_bufs, b_bufs, ready, empty, turn, acc, k_steps, mine, False, False, WHICH)

            # the epilogue in column slices: a whole tile of hi and lo next to the accumulator would spill
            if not FIRST:
                mbarrier.wait(epi_bar, mine & 1)
            parts = _split_columns(acc, SPLIT)
            for i in gl.static_range(len(parts)):
                hi_part = hi_smem.slice(i * width, width, dim=1)
                lo_part = lo_smem.slice(i * width, width, dim=1)
                _add_into_residual(parts[i], hi_part, lo_part, FIRST, LAST, MANT, MIN_EXP)
            fence_async_shared()
            tma.async_copy_shared_to_global(hi_desc, [off_m, off_n], hi_smem)
            if not LAST:
                tma.async_copy_shared_to_global(lo_desc, [off_m, off_n], lo_smem)
            mine += 1
        tma.store_wait(0)

    @gluon.jit
    def _dw_pingpong_kernel(
        g_desc,
        x_desc,
        hi_desc,
        lo_desc,
        M,
        N,
        K,
        FIRST: gl.constexpr,
        LAST: gl.constexpr,
        MANT: gl.constexpr,
        MIN_EXP: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        SPLIT: gl.constexpr,
    ):
        """``(hi, lo) += g^T x`` for ``g`` ``[K, M]`` and ``x`` ``[K, N]`` (see ``triton_dw._dw_accumulate_kernel``)."""
        a_bufs, b_bufs, ready, empty, turn = hopper_pingpong.allocate_ring(g_desc, x_desc, STAGES)
        hi_bufs = gl.allocate_shared_memory(hi_desc.dtype, [2] + hi_desc.block_type.shape, hi_desc.layout)
        lo_bufs = gl.allocate_shared_memory(lo_desc.dtype, [2] + lo_desc.block_type.shape, lo_desc.layout)
        epi = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(epi.index(i), count=1)
        mainloop = (g_desc, a_bufs, b_bufs, ready, empty, turn)
        epilogue = (hi_desc, lo_desc, hi_bufs, lo_bufs, epi)
        sizes = (M, N, K, GROUP_M)
        gl.warp_specialize(
            [
                (_consumer_partition, (mainloop, epilogue, sizes, FIRST, LAST, MANT, MIN_EXP, SPLIT, 0)),
                (_consumer_partition, (mainloop, epilogue, sizes, FIRST, LAST, MANT, MIN_EXP, SPLIT, 1)),
                (
                    hopper_pingpong.load_partition,
                    (g_desc, x_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, False, False),
                ),
            ],
            [4, 1],
            [232, 40],
        )


def supports(grad_logits: torch.Tensor, x_chunk: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether this kernel can take the chunk: Gluon present, a Hopper GPU, 16-bit operands of ``hi``'s dtype, and
    rows that TMA can address (16-byte aligned bases and row strides, unit column strides, for ``hi`` and for an int8
    residual of its shape)."""
    tensors = (grad_logits, x_chunk, hi)
    return (
        grad_logits.shape[0] > 0
        and hi.shape[1] % 16 == 0  # the int8 residual's rows, 16-byte aligned for TMA
        and all(t.dtype == hi.dtype for t in tensors)
        and hi.dtype in (torch.bfloat16, torch.float16)
        and hopper_pingpong.usable(*tensors)
    )


def accumulate(
    grad_logits: torch.Tensor,
    x_chunk: torch.Tensor,
    hi: torch.Tensor,
    lo: torch.Tensor | None,
    first: bool,
    last: bool,
    stages: int = 4,
    group_m: int = 8,
    split: int = 2,
) -> None:
    """``(hi, lo) += grad_logits^T x_chunk`` (``[rows, M]``, ``[rows, N]``); ``lo`` ``[M, N]`` int8, ``None`` when
    ``first and last``. Only where ``supports`` holds."""
    rows, m = grad_logits.shape
    n = x_chunk.shape[1]
    if lo is None:  # one chunk: lo is never read or written, but its descriptor has the tile's shape
        lo = torch.empty((BM, BN), dtype=torch.int8, device=hi.device)
    desc = hopper_pingpong.descriptor
    g_desc = desc(grad_logits, [BK, BM])
    x_desc = desc(x_chunk, [BK, BN])
    hi_desc = desc(hi, [BM, BN])
    lo_desc = desc(lo, [BM, BN])
    mant, min_exp = triton_dw._FORMAT[hi.dtype]
    programs = hopper_pingpong.programs(hi.device, m, n, BM, BN)
    with torch.cuda.device(hi.device):
        _dw_pingpong_kernel[(programs,)](
            g_desc,
            x_desc,
            hi_desc,
            lo_desc,
            m,
            n,
            rows,
            FIRST=first,
            LAST=last,
            MANT=mant,
            MIN_EXP=min_exp,
            GROUP_M=group_m,
            STAGES=stages,
            SPLIT=split,
            num_warps=4,
            maxnreg=168,
        )
