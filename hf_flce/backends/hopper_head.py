"""``triton_gemm``'s logits GEMM as a warp-specialized Hopper kernel (Gluon; CUDA, compute capability 9.x). Opt-in:
``HF_FLCE_HOPPER_HEAD=1``.

``hopper_pingpong``'s skeleton runs the GEMM: a loader warp streams the ``x`` and ``W`` tiles (both K-major), and two
consumer warpgroups take the ``[128, 128]`` tiles in turn, so one consumer's epilogue (row max, ``exp``, row sum, and
for gradients ``e`` stored in fp16) runs under the other's mainloop. Same outputs as
``triton_gemm._head_gemm_kernel`` in its statistics modes with no optional statistics: per ``[128, 128]`` tile the
row max ``m`` and ``sum exp(t - m)`` of its columns (``[stat, tile, row]`` partials), and with ``keep`` the fp16
``e = exp(t - m)``.

Why it is not the default: measured on an H200 inside the engine (docs/PERF_NOTES.md, v10), it equals the Triton
kernel once that one stopped spilling registers (qwen3-0.6b 2% faster, llama3-8b 4-6% slower, qwen2.5-7b 4% either
way), and with a softcap, whose tanh the one consumer warpgroup computes for a whole tile, it was 1.4-1.5x slower, so
a softcap is refused.
"""

from __future__ import annotations

import os

import torch
import triton

from . import hopper_pingpong, triton_gemm, triton_tiles
from .base import TileParams

AVAILABLE = hopper_pingpong.AVAILABLE
if AVAILABLE:
    from .hopper_pingpong import fence_async_shared, gl, gluon, tma

BM, BN, BK = 128, 128, 64

if AVAILABLE:
    _transform = gluon.jit(triton_tiles._transform.fn)

    @gluon.jit
    def _consumer_partition(
        mainloop,
        epilogue,
        sizes,
        KEEP: gl.constexpr,
        HAS_SOFTCAP: gl.constexpr,
        HAS_TEMPERATURE: gl.constexpr,
        WHICH: gl.constexpr,
    ):
        """Consumer ``WHICH`` (0 or 1): the mainloop and epilogue of every other tile of this program."""
        x_desc, w_desc, a_bufs, b_bufs, ready, empty, turn = mainloop
        e_desc, e_bufs, part_ptr, inv_softcap, t_scale, inv_temperature = epilogue
        N, V, K, GROUP_M = sizes
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        acc_layout: gl.constexpr = hopper_pingpong.accumulator_layout(BN)
        tiles_m = gl.cdiv(N, BM)
        tiles_n = gl.cdiv(V, BN)
        k_steps = gl.cdiv(K, BK)
        per_group = GROUP_M * tiles_n
        stat_stride = tiles_n * N
        programs = gl.num_programs(0)
        mine = 0
        for tile in range(gl.program_id(0) + WHICH * programs, tiles_m * tiles_n, 2 * programs):
            pid_m, pid_n = hopper_pingpong.grouped_block(tile, tiles_m, per_group, GROUP_M)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            acc = hopper_pingpong.mainloop(a_bufs, b_bufs, ready, empty, turn, acc, k_steps, mine, True, True, WHICH)
            t, _ = _transform(acc, inv_softcap, t_scale, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE)
            if (pid_n + 1) * BN > V:
                # the ragged last column block: TMA filled the columns past V with zeros
                cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
                t = gl.where(gl.expand_dims(cols < V, 0), t, float("-inf"))
            m = gl.max(t, axis=1)
            e = gl.exp(t - gl.expand_dims(m, 1))
            rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
            part = part_ptr + pid_n * N + rows
            gl.store(part, m, mask=rows < N)
            gl.store(part + stat_stride, gl.sum(e, axis=1), mask=rows < N)
            if KEEP:
                e_smem = e_bufs.index(WHICH)
                # this consumer's previous TMA store reads e_smem: it must be done before the buffer is rewritten
                tma.store_wait(0)
                e_smem.store(e.to(gl.float16))
                fence_async_shared()
                tma.async_copy_shared_to_global(e_desc, [pid_m * BM, pid_n * BN], e_smem)
            mine += 1
        tma.store_wait(0)

    @gluon.jit
    def _head_pingpong_kernel(
        x_desc,
        w_desc,
        e_desc,
        part_ptr,
        N,
        V,
        K,
        inv_softcap,
        t_scale,
        inv_temperature,
        KEEP: gl.constexpr,
        HAS_SOFTCAP: gl.constexpr,
        HAS_TEMPERATURE: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """Partial statistics (and with ``KEEP`` the fp16 ``e``) of ``t(x W^T)``, ``x`` ``[N, K]``, ``W`` ``[V, K]``."""
        a_bufs, b_bufs, ready, empty, turn = hopper_pingpong.allocate_ring(x_desc, w_desc, STAGES)
        if KEEP:
            e_bufs = gl.allocate_shared_memory(e_desc.dtype, [2] + e_desc.block_type.shape, e_desc.layout)
        else:
            e_bufs = a_bufs  # never touched
        mainloop = (x_desc, w_desc, a_bufs, b_bufs, ready, empty, turn)
        epilogue = (e_desc, e_bufs, part_ptr, inv_softcap, t_scale, inv_temperature)
        sizes = (N, V, K, GROUP_M)
        gl.warp_specialize(
            [
                (_consumer_partition, (mainloop, epilogue, sizes, KEEP, HAS_SOFTCAP, HAS_TEMPERATURE, 0)),
                (_consumer_partition, (mainloop, epilogue, sizes, KEEP, HAS_SOFTCAP, HAS_TEMPERATURE, 1)),
                (
                    hopper_pingpong.load_partition,
                    (x_desc, w_desc, a_bufs, b_bufs, ready, empty, N, V, K, GROUP_M, True, True),
                ),
            ],
            [4, 1],
            [232, 40],
        )


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: TileParams, stat_flags) -> bool:
    """Whether this kernel takes a statistics-mode call of ``triton_gemm``: switched on (``HF_FLCE_HOPPER_HEAD=1``),
    Gluon present, a Hopper GPU, 16-bit operands of one dtype whose rows TMA can address, no bias, no softcap and no
    optional statistics (``stat_flags``, from ``triton_gemm._stat_flags``)."""
    return (
        os.environ.get("HF_FLCE_HOPPER_HEAD", "0") == "1"
        and x.shape[0] > 0
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and bias is None
        and params.softcap is None
        and not any(stat_flags.values())
        and hopper_pingpong.usable(x, weight)
    )


def empty_e(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, vocab]`` fp16 for ``e``, rows padded to 16 bytes (TMA's row alignment)."""
    return torch.empty(n, triton.cdiv(vocab, 8) * 8, dtype=torch.float16, device=device)[:, :vocab]


def statistics(
    x: torch.Tensor,
    weight: torch.Tensor,
    params: TileParams,
    partials: torch.Tensor,
    e: torch.Tensor | None,
    stages: int = 4,
    group_m: int = 8,
) -> None:
    """Fills ``partials`` (``[2, tiles, rows]`` at least: max and sum of exp per ``BN``-column tile) and ``e`` (when
    given, from ``empty_e``). Only where ``supports`` holds. ``stages``: the operand ring's depth (32 KiB each; 4
    measured best on an H200, against 5 and 6)."""
    n, k = x.shape
    vocab = params.vocab
    keep = e is not None
    if e is None:  # never read or written, but the descriptor has the tile's shape
        e = torch.empty((BM, BN), dtype=torch.float16, device=x.device)
    desc = hopper_pingpong.descriptor
    with torch.cuda.device(x.device):
        _head_pingpong_kernel[(hopper_pingpong.programs(x.device, n, vocab, BM, BN),)](
            desc(x, [BM, BK]),
            desc(weight, [BN, BK]),
            desc(e, [BM, BN]),
            partials,
            n,
            vocab,
            k,
            *triton_gemm.transform_args(params),
            KEEP=keep,
            HAS_SOFTCAP=params.softcap is not None,
            HAS_TEMPERATURE=params.inv_temperature != 1.0,
            GROUP_M=group_m,
            STAGES=stages,
            num_warps=4,
            maxnreg=168,
        )
