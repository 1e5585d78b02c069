"""The warp-specialized Hopper GEMM skeleton (Gluon) that ``hopper_dw`` runs on.

Per program (one per SM):

- a loader warp streams the two operands' tiles of every K step through one ring of shared-memory stages, in the
  program's tile order (``load_partition``);
- two consumer warpgroups take the program's tiles in turn (even, odd). Because the ring is filled in tile order,
  consumer 1's operands arrive as consumer 0's mainloop ends, so one runs its tensor-core mainloop (``mainloop``)
  while the other runs its epilogue: the "ping-pong" schedule of CUTLASS's Hopper kernels. The epilogue is each
  kernel's own.

An operand is "K-major" when its tile is stored ``[rows, K]`` (the logits GEMM's ``x`` and ``W``); otherwise it is
``[K, rows]`` (the dW GEMM's ``G`` and ``X``, whose rows are the chunk's tokens) and the MMA reads it transposed.
"""

from __future__ import annotations

import torch

from . import cdiv, cuda_properties, triton_gemm

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = True
except ImportError:  # Triton without Gluon's Hopper API
    AVAILABLE = False

__all__ = ["AVAILABLE", "fence_async_shared", "gl", "gluon", "mbarrier", "tma"]


def usable(*tensors: torch.Tensor) -> bool:
    """Gluon present, the tensors on one Hopper GPU, each with rows TMA can address."""
    device = tensors[0].device
    return (
        AVAILABLE
        and device.type == "cuda"
        and cuda_properties(device).major == 9
        and all(t.device == device and triton_gemm._tma_aligned(t) for t in tensors)
    )


def descriptor(t: torch.Tensor, block: list[int]):
    """A host-side TMA descriptor of ``t`` (bf16, fp16 or int8) for ``block``-shaped tiles, with the default
    shared-memory layout."""
    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int8: gl.int8}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, elem)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def programs(device: torch.device, m: int, n: int, bm: int, bn: int) -> int:
    """Persistent grid: one program per SM, at most one per ``[bm, bn]`` tile of an ``[m, n]`` output."""
    return min(triton_gemm._program_limit(device), cdiv(m, bm) * cdiv(n, bn))


if AVAILABLE:
    grouped_block = gluon.jit(triton_gemm.grouped_block.fn)

    @gluon.jit
    def _fetch(desc, offset, k, bar, buf, K_MAJOR: gl.constexpr):
        """TMA copy of the tile at ``offset`` (rows of the output) and ``k`` into ``buf``, signalling ``bar``."""
        if K_MAJOR:
            tma.async_copy_global_to_shared(desc, [offset, k], bar, buf)
        else:
            tma.async_copy_global_to_shared(desc, [k, offset], bar, buf)

    @gluon.jit
    def load_partition(
        a_desc,
        b_desc,
        a_bufs,
        b_bufs,
        ready,
        empty,
        M,
        N,
        K,
        GROUP_M: gl.constexpr,
        A_K_MAJOR: gl.constexpr,
        B_K_MAJOR: gl.constexpr,
    ):
        """The loader warp: both operands' tiles of every K step of every tile of this program (``[M, N]`` output
        tiles in grouped order), in order."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        BM: gl.constexpr = a_desc.block_type.shape[0] if A_K_MAJOR else a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0] if B_K_MAJOR else b_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1] if A_K_MAJOR else a_desc.block_type.shape[0]
        tiles_m = gl.cdiv(M, BM)
        k_steps = gl.cdiv(K, BK)
        per_group = GROUP_M * gl.cdiv(N, BN)
        step_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        step = 0
        for tile in range(gl.program_id(0), tiles_m * gl.cdiv(N, BN), gl.num_programs(0)):
            pid_m, pid_n = grouped_block(tile, tiles_m, per_group, GROUP_M)
            for k in range(k_steps):
                stage = step % STAGES
                # a stage's empty barrier starts out completed (phase 1): the first pass through the ring waits for
                # nothing
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(stage), step_bytes)
                _fetch(a_desc, pid_m * BM, k * BK, ready.index(stage), a_bufs.index(stage), A_K_MAJOR)
                _fetch(b_desc, pid_n * BN, k * BK, ready.index(stage), b_bufs.index(stage), B_K_MAJOR)
                step += 1

    @gluon.jit
    def mainloop(
        a_bufs,
        b_bufs,
        ready,
        empty,
        turn,
        acc,
        k_steps,
        mine,
        A_K_MAJOR: gl.constexpr,
        B_K_MAJOR: gl.constexpr,
        WHICH: gl.constexpr,
    ):
        """Consumer ``WHICH``'s mainloop for its ``mine``-th tile: ``acc`` plus the tile's ``k_steps`` products."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        # The mainloops take turns: this one starts when the other consumer's previous one has ended. Besides giving
        # the tensor cores to one warpgroup at a time, this keeps every wait on a stage's barrier within one phase of
        # it (an mbarrier's parity cannot tell phase k from phase k - 2).
        if WHICH == 0:
            mbarrier.wait(turn.index(1), (mine - 1) & 1, pred=mine > 0)
        else:
            mbarrier.wait(turn.index(0), mine & 1)
        # this tile's K steps sit at ring positions (2 mine + WHICH) k_steps + k
        step = (2 * mine + WHICH) * k_steps
        for k in range(k_steps):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            a = a_bufs.index(stage)
            b = b_bufs.index(stage)
            if not A_K_MAJOR:
                a = a.permute((1, 0))
            if B_K_MAJOR:
                b = b.permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # at most one MMA in flight: the previous step's is done, so its stage goes back to the loader
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
            step += 1
        mbarrier.arrive(turn.index(WHICH))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        return acc

    @gluon.jit
    def allocate_ring(a_desc, b_desc, STAGES: gl.constexpr):
        """The operand ring and its barriers (``ready``/``empty`` per stage, ``turn`` per consumer), initialised."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        return a_bufs, b_bufs, ready, empty, turn

    @gluon.constexpr_function
    def accumulator_layout(BN):
        """One warpgroup's ``[BM, BN]`` accumulator, tensor-core instructions 16 x BN x 16."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
