#!/usr/bin/env python3
"""Where hf_flce's time goes at the benchmark shapes: the numbers behind docs/PERF_NOTES.md (one GPU, bf16, ~1 min).

    python3 scripts/profile_head.py --out outputs/profile          # writes profile.json, prints the tables

1. ``budget``: fwd+bwd time ÷ the 3-GEMM floor, chunk count and extra memory (gradients excluded) for a sweep of
   ``memory_budget`` (the default is 1 GiB): what bigger chunks buy.
2. ``tiles``: the Triton forward-with-gradient pass over one chunk, writing the bf16 gradient into a separate buffer
   or over the second half of each float32 row (the engine's default, with a barrier per block): ms and TB/s.
3. ``kernels``: torch.profiler's CUDA time per kernel for one fwd+bwd at the default budget and for the floor's
   three GEMMs, each profiled after 0.5 s of both in turns: which kernel the gap to the floor is in.
   ``kernels_pertoken``: the same for the per-token path (``reduction="none"``, a random upstream gradient).
4. ``sweep``: the three tile passes (statistics, forward with gradient, backward) for several (block, num_warps) at
   a few chunk sizes: the data behind ``launch_config``.
5. ``epilogue``: the logits GEMM with the softmax in its epilogue (``backends/triton_gemm.py``) against cuBLAS at
   the same shape (statistics only, statistics + stored e, gradient pass, gradient from the epilogue, the autotuned
   tile), and the engine with it on and off: fwd+bwd, no-grad forward and the per-token path, each ÷ its floor.
6. ``host``: the host's share. Per shape, one no-grad call under torch.profiler: the logits GEMM kernel against one
   cuBLAS GEMM, and how long after the call's first kernel it started (the launches and the compaction sync before
   it, which an isolated call waits for). Then the host time per call at a shape whose GPU work is tiny.
7. ``timeline``: one no-grad call, one fwd+bwd call and one per-token call under torch.profiler (host and GPU):
   every kernel's start and duration from the moment the call was entered, and when the call returned: what an
   isolated call's time is made of.
8. ``scaled``: fwd+bwd with the scalar loss's gradient as E and row scales (``backends/triton_scaled.py``, the
   default) against the gradient pass over stored e (``HF_FLCE_SCALED_GRAD=0``), timed in turns, with each one's CUDA
   time per kernel; then the per-token path, whose kept leading columns are E in the same way (or fp16 e and the
   pass with the switch off). With ``HF_FLCE_GEMM_EPILOGUE=0`` in the environment (the tile path, as before Hopper):
   the one sweep over the float32 logits against two. ``--label-smoothing 0.1``: the scalar calls smoothed.
9. ``reference``: fwd+bwd, the no-grad forward and the per-token path with every tile's softmax sums relative to the
   row's ``t_y + 32`` (``HF_FLCE_ROW_REFERENCE=1``, the default) against the tile's own max (``=0``), in turns.
10. ``power``: at one chunk of the engine's default plan (for N rows, all kept), cuBLAS's logits GEMM, the epilogue
   GEMM's forward (statistics only, and E stored for the scaled gradient, each with its small kernels) and cuBLAS's dX GEMM, each run for ~1.5 s after 0.5 s of the same load, with the
   GPU's clock and power draw sampled by ``nvidia-smi``: ms, MHz, W and mJ per call. At its power limit a GPU's time
   per call follows the call's energy, not its latency.
11. ``enqueue``: per shape, isolated no-grad and fwd+bwd calls (each after a synchronisation, as the benchmark times
   them) with a CUDA event recorded just before the head GEMM's launch: on an idle GPU that event completes when the
   host gets there, so its time after the call's start event is the host time the GEMM waits for. Median of 25 calls,
   with the calls' own times. To compare two commits, run it from a checkout of each in turn (the host's speed varies
   between processes by up to 2x; alternate them and take several).
12. ``columns``: the per-token path whose backward recomputes, with that backward in vocabulary chunks
   (``HF_FLCE_VOCAB_CHUNKS=1``, the default) against row chunks (``=0``), timed in turns, with each one's CUDA time
   per kernel and memory beyond the inputs and gradients.
13. ``queued``: fwd+bwd at budgets of 0.5 (the in-model default), 1, 1.5 and 2 GiB, each call queued behind the
   floor as the benchmark times it (``Device.time_queued``'s pattern) and paired with it: ÷ floor, the chunk plan
   (rows per chunk) and extra memory beyond the gradients. Then the same pattern under torch.profiler, a marker
   kernel before each: the call's kernel time against the floor's, and the GPU's idle time inside the queued call
   (what host steps after a host read cost).
14. ``dx_rows``: cuBLAS's dX GEMM of one chunk (``E [rows, V] @ W [V, H]``, float32 out, as ``mm_fp32`` runs it) for
   rows from 1024 to 8192 in steps of 128, each timed in turns with the same GEMM at 4096 rows: time per row ÷ that
   reference's. cuBLAS picks its kernel by shape, and this output (rows × H) fills few waves of tiles.
15. ``trainer_stats``: fwd+bwd of the scalar loss alone and with the statistics ``FLCESFTTrainer`` logs every step
   (``return_stats=("entropy", "is_top1")``), timed in turns with the floor's three GEMMs, with each call's CUDA time
   per kernel: what TRL's ``entropy`` and ``mean_token_accuracy`` metrics cost the head.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import Device, median  # noqa: E402

import hf_flce  # noqa: E402
from hf_flce import engine  # noqa: E402
from hf_flce.backends import resolve_backend, triton_gemm  # noqa: E402
from hf_flce.backends.base import TileParams  # noqa: E402
from hf_flce.backends.triton_tiles import TritonTileOps, launch_config  # noqa: E402
from hf_flce.engine import plan_chunk_rows  # noqa: E402

SHAPES = {
    "llama3-8b": (8192, 4096, 128256),
    "qwen3-0.6b": (16384, 1024, 151936),
    "mistral-7b": (8192, 4096, 32768),
    "qwen2.5-7b": (8192, 3584, 152064),
    "gemma2-2b": (8192, 2304, 256000),
    # the head of benchmark_training.py's gemma3-1b SFT step at 8192 tokens (a quarter masked): thin H, V = 2^18
    "gemma3-1b-sft": (6144, 1152, 262144),
    # benchmark_kernel.py's per-token shapes whose logits fit the keep limit (mistral-7b's fit too)
    "llama3-8b-3k": (3072, 4096, 128256),
    "qwen3-0.6b-3k": (3072, 1024, 151936),
}
BUDGETS_MIB = (256, 512, 1024, 2048, 4096)


def shape_softcap(name: str) -> float | None:
    """gemma2-2b's final-logit softcap; the other shapes have none."""
    return 30.0 if name == "gemma2-2b" else None


GiB = 1 << 30


def timed(fn, reps: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of ``reps`` calls, each timed with CUDA events."""
    return median(Device("cuda").time_ms(fn, warmup, reps))


def inputs(n: int, h: int, v: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    y[::17] = -100
    return x, w, y


def floor_gemms(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple:
    """The floor's three cuBLAS GEMMs as calls: the logits ``X W^T`` into ``g``, then ``g W`` and ``g^T X``."""
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    return (
        lambda: torch.mm(x, w.T, out=g),
        lambda: torch.mm(g, w, out=dx),
        lambda: torch.mm(g.T, x, out=dw),
    )


def floor_ms(n: int, h: int, v: int) -> float:
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    return sum(timed(gemm) for gemm in floor_gemms(x, w, g))


def _planned_call(step) -> tuple[list[int], int]:
    """One fwd+bwd ``step`` (returning its gradients): the rows of each chunk its plan took, and its peak memory
    beyond what was allocated before it and beyond the gradients. The rows are recorded as ints: a mock's call list
    would keep each chunk's tensors alive and raise the peak."""
    chunk_rows: list[int] = []
    add = engine._GradBuffers.add

    def recorded(buffers, start, end, *rest):
        chunk_rows.append(end - start)
        return add(buffers, start, end, *rest)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with mock.patch.object(engine._GradBuffers, "add", recorded):
        grads = step()
    extra = torch.cuda.max_memory_allocated() - base - sum(g.nbytes for g in grads)
    return chunk_rows, extra


def budget_sweep(name: str) -> list[dict]:
    n, h, v = SHAPES[name]
    floor = floor_ms(n, h, v)
    x, w, y = inputs(n, h, v)
    rows = []
    for mib in BUDGETS_MIB:
        budget = mib << 20

        def step(budget=budget):
            loss = hf_flce.fused_linear_cross_entropy(x, w, y, memory_budget=budget, softcap=shape_softcap(name))
            return torch.autograd.grad(loss, (x, w))

        ms = timed(step)
        chunk_rows, extra = _planned_call(step)
        rows.append(
            dict(
                shape=name,
                budget_mib=mib,
                ms=ms,
                ratio=ms / floor,
                floor_ms=floor,
                chunks=len(chunk_rows),
                extra_minus_grads_gib=extra / GiB,
            )
        )
        print(
            f"{name:>11} budget {mib:5d} MiB: {ms:7.2f} ms = {ms / floor:.3f}x floor, {rows[-1]['chunks']:3d} chunks, "
            f"extra-grads {extra / GiB:.2f} GiB",
            flush=True,
        )
    return rows


def tile_pass(name: str, rows: int = 2048) -> list[dict]:
    _, _, v = SHAPES[name]
    logits = torch.randn(rows, v, device="cuda") * 3
    target = torch.randint(0, v, (rows,), device="cuda")
    params = TileParams(v, -100, 0.0, 0.0, None, 1.0, None, None)
    scale = torch.full((rows,), 1.0 / rows, device="cuda")
    tiles = TritonTileOps()
    separate = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
    work = logits.clone()
    # the row-tail pass overwrites its input: every timed call restores it first, and the copy is timed alone
    copy_ms = timed(lambda: work.copy_(logits), reps=10)
    out = []
    for mode in ("separate", "row-tail"):
        grad = separate if mode == "separate" else work.view(torch.bfloat16)[:, v:]

        def call(grad=grad):
            work.copy_(logits)
            tiles.forward(work, target, params, scale, grad)

        ms = timed(call, reps=10) - copy_ms
        moved = rows * v * (4 + 4 + 2)  # read for the statistics, read again and write the gradient
        out.append(dict(shape=name, rows=rows, mode=mode, ms=ms, tb_s=moved / ms / 1e9))
        print(f"{name:>11} tile pass {rows} rows, {mode:>8}: {ms:.3f} ms, {moved / ms / 1e9:.2f} TB/s", flush=True)
    return out


SWEEP_CONFIGS = ((512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))


def tile_sweep(vocab: int, rows: int) -> list[dict]:
    """Every (block, num_warps) of SWEEP_CONFIGS for the three tile passes at one chunk size: TB/s of each."""
    logits = torch.randn(rows, vocab, device="cuda") * 3
    target = torch.randint(0, vocab, (rows,), device="cuda")
    params = TileParams(vocab, -100, 0.0, 0.0, None, 1.0, None, None)
    scale = torch.full((rows,), 1.0 / rows, device="cuda")
    work = logits.clone()
    grad = work.view(torch.bfloat16)[:, vocab:]
    stats = TritonTileOps().forward(logits, target, params)
    copy_ms = timed(lambda: work.copy_(logits), reps=10)
    default = launch_config(vocab, rows, torch.device("cuda"))
    out = []
    for block, warps in SWEEP_CONFIGS:
        tiles = TritonTileOps(block=block, num_warps=warps)

        def fwd_grad(tiles=tiles):
            work.copy_(logits)
            tiles.forward(work, target, params, scale, grad)

        def bwd(tiles=tiles):
            work.copy_(logits)
            tiles.backward(work, target, stats.lse, stats.entropy, params, scale, None, None, grad)

        passes = {
            "stats": (timed(lambda tiles=tiles: tiles.forward(logits, target, params), reps=10), 4),
            "fwd+grad": (timed(fwd_grad, reps=10) - copy_ms, 10),
            "bwd": (timed(bwd, reps=10) - copy_ms, 6),
        }
        row = dict(vocab=vocab, rows=rows, block=block, warps=warps, default=(block, warps) == default)
        for name, (ms, bytes_per_logit) in passes.items():
            row[name + "_ms"] = ms
            row[name + "_tb_s"] = rows * vocab * bytes_per_logit / ms / 1e9
        out.append(row)
        print(
            f"sweep V={vocab} rows={rows} block={block:5d} warps={warps}{' (default)' if row['default'] else ''}: "
            + ", ".join(f"{k} {row[k + '_tb_s']:.2f} TB/s" for k in passes),
            flush=True,
        )
    return out


def _kernel_ms(fn) -> dict[str, float]:
    """CUDA time per kernel name (ms) of one call of ``fn`` under torch.profiler (after one untimed call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us:
            times[evt.key] = times.get(evt.key, 0.0) + us / 1e3
    return times


def _kernel_role(name: str) -> str:
    key = name.lower()
    if "_head_gemm_kernel" in key:
        return "head GEMM (epilogue)"
    if any(s in key for s in ("gemm", "cutlass", "sm90", "xmma", "nvjet")):
        # cuBLAS's Hopper kernels name the beta mode: bz writes C, badd adds into it (the dW accumulator)
        return "cuBLAS " + ("beta=1 " if "badd" in key else "") + name.split("(")[0][-48:]
    return name.split("(")[0][:60]


def kernel_breakdown(name: str, rounds: int = 3, reduction: str = "mean") -> dict:
    """Per kernel, the CUDA time of one fwd+bwd at the default budget and of the floor's three GEMMs (``X W^T``,
    ``G W``, ``G^T X`` with ``G`` those logits, as ``benchmark_kernel.py`` times it), in turns under one profiler
    session after 0.5 s of the same load: both run at the clocks the pair settles at (at its power limit a GPU's clock
    follows the load's power, which depends on the operands' data). ``reduction="none"`` profiles the per-token path
    with a random upstream gradient, as the benchmark's ``pertoken`` section times it."""
    n, h, v = SHAPES[name]
    x, w, y = inputs(n, h, v)
    softcap = shape_softcap(name)
    upstream = torch.randn(n, device="cuda") if reduction == "none" else None

    def step():
        loss = hf_flce.fused_linear_cross_entropy(x, w, y, softcap=softcap, reduction=reduction)
        return torch.autograd.grad(loss, (x, w), grad_outputs=upstream)

    gemms = floor_gemms(x.detach(), w.detach(), torch.empty(n, v, device="cuda", dtype=torch.bfloat16))

    def floor():
        for gemm in gemms:
            gemm()

    phases = (("ours", step), ("floor", floor))
    stop = time.perf_counter() + 0.5
    while time.perf_counter() < stop:
        for _, fn in phases:
            fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(rounds):
            for label, fn in phases:
                with torch.profiler.record_function(label):
                    fn()
                    torch.cuda.synchronize()
    events = prof.events()
    ranges = [(e.name, e.time_range) for e in events if e.name in dict(phases)]
    result = dict(shape=name, softcap=softcap, rounds=rounds, reduction=reduction)
    by_phase: dict[str, dict[str, list]] = {label: {} for label, _ in phases}
    by_range: dict[int, list] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name in dict(phases):
            continue
        index = next((i for i, (_, r) in enumerate(ranges) if r.start <= e.time_range.start <= r.end), None)
        if index is None:
            continue
        by_range.setdefault(index, []).append(e)
        role = by_phase[ranges[index][0]].setdefault(_kernel_role(e.name), [0.0, 0])
        role[0] += (e.time_range.end - e.time_range.start) / 1e3 / rounds
        role[1] += 1
    # the GPU's idle time inside a call: from its first kernel's start to its last kernel's end, less the kernels
    # (where the host falls behind the GPU, or waits for it), and the longest gaps with the kernels around them
    for label, _ in phases:
        kernels = [ks for i, ks in by_range.items() if ranges[i][0] == label]
        span = sum(ks[-1].time_range.end - ks[0].time_range.start for ks in kernels) / 1e3 / rounds
        busy = sum(e.time_range.end - e.time_range.start for ks in kernels for e in ks) / 1e3 / rounds
        result[label + "_span_ms"] = span
        result[label + "_idle_ms"] = span - busy
        gaps = [
            ((b.time_range.start - a.time_range.end) / 1e3, _kernel_role(a.name), _kernel_role(b.name))
            for ks in kernels[-1:]
            for a, b in zip(ks, ks[1:])
        ]
        result[label + "_longest_gaps"] = sorted(gaps, reverse=True)[:6]
    for label, roles in by_phase.items():
        for role in roles.values():
            role[1] //= rounds
        result[label] = dict(sorted(roles.items(), key=lambda kv: -kv[1][0]))
        result[label + "_total_ms"] = sum(ms for ms, _ in roles.values())
    print(
        f"{name:>11} ({reduction}): kernels ours {result['ours_total_ms']:.2f} ms, floor {result['floor_total_ms']:.2f} ms "
        f"({result['ours_total_ms'] / result['floor_total_ms']:.3f}x); first kernel to last, ours "
        f"{result['ours_span_ms']:.2f} ms (idle {result['ours_idle_ms']:.2f}), floor {result['floor_span_ms']:.2f} ms "
        f"(idle {result['floor_idle_ms']:.2f})",
        flush=True,
    )
    for label, _ in phases:
        for role, (ms, count) in result[label].items():
            if ms >= 0.01:
                print(f"    {label:>5} {ms:7.3f} ms  x{count:<3d} {role}", flush=True)
    for gap, before, after in result["ours_longest_gaps"]:
        print(f"    gap {gap:6.3f} ms after {before} before {after}", flush=True)
    return result


def _extra_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor)) if out else 0
    return (peak - grads) / GiB


def _check_tma() -> None:
    """Drops the TMA tile configurations if this Triton cannot compile them."""
    kernel = triton_gemm._head_gemm_kernel
    x, w, y = inputs(256, 256, 1000)
    params = TileParams(1000, -100, 0.0, 0.0, None, 1.0, None, None)
    saved = list(kernel.configs)
    try:
        kernel.configs[:] = [c for c in saved if c.kwargs["USE_TMA"]]
        if kernel.configs:
            triton_gemm.forward(x.detach(), w.detach(), None, y, params, keep=False)
        kernel.configs[:] = saved
        print(f"TMA configurations compile ({sum(c.kwargs['USE_TMA'] for c in saved)})", flush=True)
    except Exception as exc:  # noqa: BLE001
        kernel.configs[:] = [c for c in saved if not c.kwargs["USE_TMA"]]
        print(f"TMA configurations dropped: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    kernel.cache.clear()


def epilogue(name: str) -> dict:
    """The epilogue GEMM's kernels against cuBLAS, and the engine with the epilogue path on and off."""
    n, h, v = SHAPES[name]
    x, w, y = inputs(n, h, v)
    xd, wd = x.detach(), w.detach()
    one = timed(lambda: torch.mm(xd, wd.T))
    one_f32 = timed(lambda: torch.mm(xd, wd.T, out_dtype=torch.float32))
    floor = floor_ms(n, h, v)
    params = TileParams(v, -100, 0.0, 0.0, None, 1.0, None, None)
    row = dict(shape=name, n=n, h=h, v=v, gemm_ms=one, gemm_fp32_out_ms=one_f32, floor_ms=floor)
    kernel = triton_gemm._head_gemm_kernel
    row["stats_ms"] = timed(lambda: triton_gemm.forward(xd, wd, None, y, params, keep=False))
    row["stats_config"] = str(kernel.best_config)
    timings = getattr(kernel, "configs_timings", None) or {}
    row["stats_config_ms"] = {str(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    row["keep_ms"] = timed(lambda: triton_gemm.forward(xd, wd, None, y, params, keep=True))
    row["keep_config"] = str(kernel.best_config)
    stats, kept = triton_gemm.forward(xd, wd, None, y, params, keep=True)
    e = kept.e
    scale = torch.full((n,), 1.0 / n, device="cuda")

    def grad_pass():
        kept.e = e  # the pass consumes e (values are irrelevant to the timing)
        triton_gemm.gradient(kept, y, stats.lse, stats.entropy, params, torch.bfloat16, scale)

    row["grad_pass_ms"] = timed(grad_pass)
    row["grad_pass_tb_s"] = n * v * 4 / row["grad_pass_ms"] / 1e9
    row["recompute_grad_ms"] = timed(
        lambda: triton_gemm.recompute_gradient(xd, wd, None, y, stats.lse, stats.entropy, params, scale)
    )
    row["recompute_config"] = str(kernel.best_config)
    tiles = resolve_backend("triton", torch.device("cuda"))
    saved = tiles.fused_head
    g = torch.randn(n, device="cuda")

    def fwd_bwd():
        return torch.autograd.grad(hf_flce.fused_linear_cross_entropy(x, w, y), (x, w))

    def pertoken():
        loss, stats = hf_flce.fused_linear_cross_entropy(x, w, y, reduction="none", return_stats=True)
        return torch.autograd.grad((loss * g).sum() + (stats.logprobs * g).sum(), (x, w))

    def no_grad():
        with torch.no_grad():
            hf_flce.fused_linear_cross_entropy(x, w, y)

    try:
        for label, head in (("on", saved or triton_gemm), ("off", None)):
            tiles.fused_head = head
            row[f"fwd_bwd_{label}_ms"] = timed(fwd_bwd)
            row[f"fwd_bwd_{label}_extra_gib"] = _extra_gib(fwd_bwd)
            row[f"pertoken_{label}_ms"] = timed(pertoken)
            row[f"no_grad_{label}_ms"] = timed(no_grad)
            torch.cuda.empty_cache()
    finally:
        tiles.fused_head = saved
    print(
        f"{name:>11} cuBLAS {one:.2f} ms (fp32 out {one_f32:.2f}); epilogue stats {row['stats_ms'] / one:.3f}x, "
        f"+e {row['keep_ms'] / one:.3f}x, grad pass {row['grad_pass_ms']:.2f} ms ({row['grad_pass_tb_s']:.2f} TB/s), "
        f"grad epilogue {row['recompute_grad_ms'] / one:.3f}x | fwd+bwd on {row['fwd_bwd_on_ms'] / floor:.3f}x / off "
        f"{row['fwd_bwd_off_ms'] / floor:.3f}x floor, extra {row['fwd_bwd_on_extra_gib']:.2f} / "
        f"{row['fwd_bwd_off_extra_gib']:.2f} GiB; no-grad on {row['no_grad_on_ms'] / one:.3f}x / off "
        f"{row['no_grad_off_ms'] / one:.3f}x GEMM; per-token on {row['pertoken_on_ms'] / floor:.3f}x / off "
        f"{row['pertoken_off_ms'] / floor:.3f}x floor | configs {row['stats_config']} / {row['keep_config']}",
        flush=True,
    )
    return row


def _interleaved_ms(fns: dict, reps: int = 7) -> dict[str, float]:
    """Median ms of each of ``fns``, timed in turns (one call of each per round), so that clock drift over the run
    falls on all of them alike."""
    dev = Device("cuda")
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        dev.time_ms(fn, 2, 1)
    for _ in range(reps):
        for k, fn in fns.items():
            times[k] += dev.time_ms(fn, 0, 1)
    return {k: median(t) for k, t in times.items()}


def _with_env(variable: str, switch: str, fn):
    """``fn`` called with the environment variable ``variable`` set to ``switch`` (read by hf_flce at each call)."""

    def call():
        saved = os.environ.get(variable)
        os.environ[variable] = switch
        try:
            return fn()
        finally:
            if saved is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = saved

    return call


def switch_ab(name: str, variable: str, whats: tuple[str, ...] = ("fwd_bwd",)) -> dict:
    """The calls ``whats`` (fwd_bwd, no_grad, pertoken) with the environment switch ``variable`` at "1" and at "0",
    timed in turns: ms of each, ``on ÷ off`` and ``÷`` the floor (fwd_bwd, pertoken) or one GEMM (no_grad), and
    each one's CUDA time per kernel. ``scaled``: ``HF_FLCE_SCALED_GRAD``; ``reference``: ``HF_FLCE_ROW_REFERENCE``."""
    n, h, v = SHAPES[name]
    x, w, y = inputs(n, h, v)
    fns = isolated_calls(name, x, w, y)
    xd, wd = x.detach(), w.detach()
    row = dict(shape=name, variable=variable, floor_ms=floor_ms(n, h, v), gemm_ms=timed(lambda: torch.mm(xd, wd.T)))
    for what in whats:
        calls = {label: _with_env(variable, switch, fns[what]) for label, switch in (("on", "1"), ("off", "0"))}
        ms = _interleaved_ms(calls, reps=9)
        unit = row["gemm_ms"] if what == "no_grad" else row["floor_ms"]
        row[what] = dict(
            on_ms=ms["on"],
            off_ms=ms["off"],
            on_over_off=ms["on"] / ms["off"],
            on_over_unit=ms["on"] / unit,
            off_over_unit=ms["off"] / unit,
            **{
                f"kernels_{label}": {
                    k[:60]: round(t, 3) for k, t in sorted(_kernel_ms(fn).items(), key=lambda kv: -kv[1])[:12]
                }
                for label, fn in calls.items()
            },
        )
        torch.cuda.empty_cache()
        r = row[what]
        print(
            f"[{variable}] {name} {what}: on {r['on_ms']:.2f} ms, off {r['off_ms']:.2f} ms, on/off "
            f"{r['on_over_off']:.3f}; ÷ {'GEMM' if what == 'no_grad' else 'floor'} on {r['on_over_unit']:.3f}, "
            f"off {r['off_over_unit']:.3f}",
            flush=True,
        )
    return row


TRAINER_STATS = ("entropy", "is_top1")


def trainer_stats(name: str, reps: int = 15) -> dict:
    """fwd+bwd with and without the SFT trainer's statistics, in turns with the floor: ms, ratios, kernels."""
    n, h, v = SHAPES[name]
    x, w, y = inputs(n, h, v)
    softcap = shape_softcap(name)

    def call(stats):
        def fwd_bwd():
            out = hf_flce.fused_linear_cross_entropy(x, w, y, softcap=softcap, return_stats=stats or False)
            return torch.autograd.grad(out[0] if stats else out, (x, w))

        return fwd_bwd

    xd, wd = x.detach(), w.detach()
    gemms = floor_gemms(xd, wd, torch.empty(n, v, device=x.device, dtype=x.dtype))

    def floor():
        for gemm in gemms:
            gemm()

    fns = {"plain": call(()), "trainer": call(TRAINER_STATS), "floor": floor}
    ms = _interleaved_ms(fns, reps=reps)
    row = dict(
        shape=name,
        **{f"{k}_ms": t for k, t in ms.items()},
        plain_over_floor=ms["plain"] / ms["floor"],
        trainer_over_floor=ms["trainer"] / ms["floor"],
        trainer_over_plain=ms["trainer"] / ms["plain"],
        kernels={
            k: {kk[:60]: round(t, 3) for kk, t in sorted(_kernel_ms(fns[k]).items(), key=lambda kv: -kv[1])[:8]}
            for k in ("plain", "trainer")
        },
    )
    print(
        f"[trainer_stats] {name}: plain {row['plain_over_floor']:.3f}x floor, with entropy and top-1 "
        f"{row['trainer_over_floor']:.3f}x ({row['trainer_over_plain']:.3f}x the plain call)",
        flush=True,
    )
    return row


def columns(name: str) -> dict:
    """``switch_ab`` of the per-token path over ``HF_FLCE_VOCAB_CHUNKS``, plus each side's extra memory."""
    row = switch_ab(name, "HF_FLCE_VOCAB_CHUNKS", ("pertoken",))
    pertoken = isolated_calls(name, *inputs(*SHAPES[name]))["pertoken"]
    for label, switch in (("on", "1"), ("off", "0")):
        row["pertoken"][f"extra_gib_{label}"] = _extra_gib(_with_env("HF_FLCE_VOCAB_CHUNKS", switch, pertoken))
    print(
        f"[columns] {name} extra GiB on {row['pertoken']['extra_gib_on']:.2f}, off {row['pertoken']['extra_gib_off']:.2f}"
    )
    return row


HOST_SHAPE = (256, 4096, 32768)


def _call_inputs(name: str):
    """The shape's softcap, inputs (also detached) and the time of one cuBLAS GEMM of it."""
    n, h, v = SHAPES[name]
    x, w, y = inputs(n, h, v)
    xd, wd = x.detach(), w.detach()
    return shape_softcap(name), x, w, y, xd, wd, timed(lambda: torch.mm(xd, wd.T))


# ``--label-smoothing``: the scalar calls of ``isolated_calls`` take it (scaled, reference, timeline, enqueue)
SCALAR_OPTIONS: dict = {}


def isolated_calls(name: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> dict:
    """The shape's no-grad call, fwd+bwd call (both with ``SCALAR_OPTIONS``) and per-token call with a random
    upstream gradient (gradients of ``x`` and ``w``) on these inputs."""
    softcap = shape_softcap(name)
    xd, wd = x.detach(), w.detach()
    g = torch.randn(x.shape[0], device=x.device)

    def pertoken():
        loss = hf_flce.fused_linear_cross_entropy(x, w, y, reduction="none", softcap=softcap)
        return torch.autograd.grad((loss * g).sum(), (x, w))

    def scalar(xs, ws):
        return hf_flce.fused_linear_cross_entropy(xs, ws, y, softcap=softcap, **SCALAR_OPTIONS)

    return {
        "no_grad": lambda: scalar(xd, wd),
        "fwd_bwd": lambda: torch.autograd.grad(scalar(x, w), (x, w)),
        "pertoken": pertoken,
    }


def host(name: str) -> dict:
    """The no-grad call's GPU timeline: the GEMM kernel against cuBLAS and the time before it starts."""
    softcap, x, w, y, xd, wd, one = _call_inputs(name)

    def no_grad():
        return hf_flce.fused_linear_cross_entropy(xd, wd, y, softcap=softcap)

    call = timed(no_grad)
    no_grad()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        no_grad()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    first = kernels[0].time_range.start
    gemm = next(e for e in kernels if "head_gemm" in e.name)
    gemm_ms = (gemm.time_range.end - gemm.time_range.start) / 1e3
    row = dict(
        shape=name,
        gemm_ms=one,
        no_grad_ms=call,
        no_grad_over_gemm=call / one,
        head_gemm_kernel_over_gemm=gemm_ms / one,
        profiled_gemm_start_ms=(gemm.time_range.start - first) / 1e3,
        kernels_before_gemm=sum(e.time_range.start < gemm.time_range.start for e in kernels),
    )
    print(f"{name:>11} host: " + " ".join(f"{k}={val:.3f}" for k, val in row.items() if k != "shape"), flush=True)
    return row


def _call_timeline(fn) -> dict:
    """Kernels of one call of ``fn`` (after an untimed one): start and duration in µs from the call's entry on the host."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("flce_call"):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    call = next(e for e in events if e.name == "flce_call")
    t0 = call.time_range.start
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "flce_call"),
        key=lambda e: e.time_range.start,
    )
    rows = [
        (e.name[:60], round(e.time_range.start - t0, 1), round(e.time_range.end - e.time_range.start, 1))
        for e in kernels
    ]
    # host calls that wait for the GPU (a host read, a synchronisation)
    waits = [
        (e.name, round(e.time_range.start - t0, 1), round(e.time_range.end - e.time_range.start, 1))
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.name in _HOST_WAITS
    ]
    return dict(host_return_us=round(call.time_range.end - t0, 1), kernels=rows, host_waits=waits)


_HOST_WAITS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def timeline(name: str) -> dict:
    """Where an isolated call's time goes: host work before the first kernel, gaps, every kernel, the end."""
    _, x, w, y, _, _, one = _call_inputs(name)
    calls = isolated_calls(name, x, w, y)
    row = dict(shape=name, gemm_ms=one)
    for label, fn in calls.items():
        row[f"{label}_ms"] = timed(fn)
        row[label] = _call_timeline(fn)
        busy = sum(d for _, _, d in row[label]["kernels"]) / 1e3
        print(f"{name:>11} {label}: {row[f'{label}_ms']:.3f} ms (cuBLAS GEMM {one:.3f}), kernels {busy:.3f} ms")
        for k, start, dur in row[label]["kernels"]:
            print(f"      {start:10.1f} {dur:9.1f}  {k}")
        for k, start, dur in row[label]["host_waits"]:
            print(f"      host {start:10.1f} {dur:9.1f}  {k}")
        print(f"      host returned at {row[label]['host_return_us']:.1f} us", flush=True)
    return row


def host_per_call() -> dict:
    """Host time of one call (µs) where the GPU work is tiny: what a small or CPU-bound step pays per call."""
    n, h, v = HOST_SHAPE
    x, w, y = inputs(n, h, v)
    calls = {
        "no_grad": lambda: hf_flce.fused_linear_cross_entropy(x.detach(), w.detach(), y),
        "fwd_bwd": lambda: torch.autograd.grad(hf_flce.fused_linear_cross_entropy(x, w, y), (x, w)),
    }
    row = dict(shape="x".join(map(str, HOST_SHAPE)))
    for label, fn in calls.items():
        for _ in range(10):
            fn()
        rounds = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(40):
                fn()
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / 40 * 1e6)
        row[f"{label}_us"] = median(rounds)
    print(
        f"host time per call at {row['shape']}: no-grad {row['no_grad_us']:.0f} us, fwd+bwd {row['fwd_bwd_us']:.0f} us"
    )
    return row


def enqueue(name: str) -> dict:
    """Host time before the head GEMM's launch in isolated calls (see the module docstring, section 12)."""
    _, x, w, y, _, _, one = _call_inputs(name)
    marks: list = []
    launch_tuned = triton_gemm._launch_tuned

    def marked(*args, **kwargs):
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        return launch_tuned(*args, **kwargs)

    calls = isolated_calls(name, x, w, y)
    row = dict(shape=name, gemm_ms=one)
    triton_gemm._launch_tuned = marked
    try:
        for label, fn in calls.items():
            for _ in range(3):
                fn()
            before, total = [], []
            for _ in range(25):
                torch.cuda.synchronize()
                marks.clear()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                before.append(start.elapsed_time(marks[0]) * 1e3)
                total.append(start.elapsed_time(end))
            row[f"{label}_gemm_enqueued_us"] = median(before)
            row[f"{label}_ms"] = median(total)
    finally:
        triton_gemm._launch_tuned = launch_tuned
    print(f"{name:>11} enqueue: " + " ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "shape"), flush=True)
    return row


QUEUED_BUDGETS_MIB = (512, 1024, 1536, 2048)  # 512 MiB: the in-model default (half the op's)


def _marker() -> None:
    """A short kernel that marks a place in the GPU's timeline under the profiler (``torch.cuda._sleep``)."""
    torch.cuda._sleep(1000)


def _queued_kernel_times(floor, step, rounds: int) -> tuple[float, float, float]:
    """``rounds`` of the floor twice and then ``step`` queued behind it, under torch.profiler with a marker kernel
    before each part: medians of the step's kernel time, the floor's (one call) and the GPU's idle time from the
    floor's end to the step's last kernel less the step's kernels, in ms."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            _marker()
            floor()
            floor()
            _marker()
            step()
            torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    marks = [i for i, e in enumerate(kernels) if "sleep" in e.name.lower() or "spin" in e.name.lower()]
    ours_busy, floor_busy, idle = [], [], []
    for first, second, nxt in zip(marks[::2], marks[1::2], marks[2::2] + [len(kernels)], strict=True):
        floors, ours = kernels[first + 1 : second], kernels[second + 1 : nxt]
        floor_busy.append(sum(e.time_range.end - e.time_range.start for e in floors) / 2e3)
        busy = sum(e.time_range.end - e.time_range.start for e in ours) / 1e3
        ours_busy.append(busy)
        idle.append((ours[-1].time_range.end - kernels[second].time_range.end) / 1e3 - busy)
    return median(ours_busy), median(floor_busy), median(idle)


def queued(name: str, rounds: int = 12, profiled_rounds: int = 3) -> list[dict]:
    """Section 13: the call queued behind the floor, at several budgets (see the module docstring)."""
    n, h, v = SHAPES[name]
    x, w, y = inputs(n, h, v)
    softcap = shape_softcap(name)
    gemms = floor_gemms(x.detach(), w.detach(), torch.empty(n, v, device="cuda", dtype=torch.bfloat16))

    def floor():
        for gemm in gemms:
            gemm()

    rows = []
    for mib in QUEUED_BUDGETS_MIB:

        def step(budget=mib << 20):
            loss = hf_flce.fused_linear_cross_entropy(x, w, y, memory_budget=budget, softcap=softcap)
            return torch.autograd.grad(loss, (x, w))

        step()
        chunk_rows, extra = _planned_call(step)
        timed_calls = Device("cuda").time_queued(floor, step, 2, rounds, 0.5)
        ratio = median(q / f for q, f in zip(timed_calls["queued"], timed_calls["yardstick"], strict=True))
        ours_ms, floor_ms, idle_ms = _queued_kernel_times(floor, step, profiled_rounds)
        row = dict(
            shape=name,
            budget_mib=mib,
            chunk_rows=chunk_rows,
            extra_minus_grads_gib=extra / GiB,
            queued_ratio=ratio,
            kernels_ratio=ours_ms / floor_ms,
            idle_ms=idle_ms,
            kernels_ms=ours_ms,
        )
        rows.append(row)
        print(
            f"{name:>11} {mib:5d} MiB: queued {ratio:.3f}x floor, kernels {row['kernels_ratio']:.3f}x the floor's, "
            f"idle {row['idle_ms']:.2f} ms, chunks {chunk_rows}, extra-grads {extra / GiB:.2f} GiB",
            flush=True,
        )
    return rows


def dx_rows(name: str, reference_rows: int = 4096, rounds: int = 5) -> dict:
    """Section 14: cuBLAS's dX GEMM per row against rows (see the module docstring)."""
    _, h, v = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    e = (torch.randn(8192, v, device="cuda", generator=gen) * 0.01).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    dev = Device("cuda")

    def gemm(rows: int):
        return lambda: engine.mm_fp32(e[:rows], w)

    reference = gemm(reference_rows)
    dev.time_rounds([reference], 3, 0, settle_s=0.5)
    per_row = {}
    for rows in range(1024, 8193, 128):
        ref_ms, ms = dev.time_rounds([reference, gemm(rows)], 1, rounds)
        per_row[rows] = median((t / rows) / (r / reference_rows) for r, t in zip(ref_ms, ms, strict=True))
    values = sorted(per_row.values())
    result = dict(shape=name, reference_rows=reference_rows, per_row_vs_reference=per_row)
    print(
        f"{name:>11} dX GEMM per row ÷ at {reference_rows} rows, 1024-8192 rows: min {values[0]:.2f}, median "
        f"{values[len(values) // 2]:.2f}, max {values[-1]:.2f} (at {max(per_row, key=per_row.get)} rows)",
        flush=True,
    )
    return result


def _steady_ms(fn, seconds: float = 1.5) -> tuple[float, float, float]:
    """ms per call of ``fn`` run back to back for ``seconds`` after 0.5 s of the same load, and that window's
    wall-clock bounds."""
    Device("cuda").time_rounds([fn], 3, 0, settle_s=0.5)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        fn()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, t0, time.time()


def _smi_samples(path: str) -> list[tuple[float, float, float]]:
    samples = []
    for line in Path(path).read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(fields[1]), float(fields[2])))
        except (ValueError, IndexError):
            continue
    return samples


def power(name: str) -> list[dict]:
    """Energy per call of the head's GEMMs at one chunk of the default plan for the shape's N rows, all counted as kept
    (cuBLAS, and ours through ``triton_gemm.forward`` with its small kernels), from nvidia-smi's clock and power
    samples (every 50 ms) over each call's steady window."""
    n, h, v = SHAPES[name]
    params = _plain(v, shape_softcap(name))
    rows = plan_chunk_rows(n, v, triton_gemm.bytes_per_logit(v, params), GiB, 4 * v * h)
    x, w, y = inputs(rows, h, v)
    x, w = x.detach(), w.detach()
    logits = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
    _, scaled = triton_gemm.forward(x, w, None, y, params, keep=True, scaled=True)
    dx = logits[:, :h]
    calls = {
        "cublas_logits": lambda: torch.mm(x, w.T, out=logits),
        "ours_stats": lambda: triton_gemm.forward(x, w, None, y, params, keep=False),
        "ours_scaled": lambda: triton_gemm.forward(x, w, None, y, params, keep=True, scaled=True),
        "cublas_dx": lambda: torch.mm(scaled.e, w, out=dx),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as log:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=log,
        )
        try:
            windows = {label: _steady_ms(fn) for label, fn in calls.items()}
        finally:
            smi.terminate()
            smi.wait()
    samples = _smi_samples(log.name)
    os.unlink(log.name)
    out = []
    for label, (ms, t0, t1) in windows.items():
        inside = [s for s in samples if t0 + 0.1 <= s[0] <= t1]
        mhz = median([s[1] for s in inside]) if inside else None
        watts = median([s[2] for s in inside]) if inside else None
        row = dict(shape=name, rows=rows, call=label, ms=ms, mhz=mhz, watts=watts, samples=len(inside))
        row["mj_per_call"] = None if watts is None else watts * ms
        out.append(row)
        print(
            f"{name:>11} {rows} rows {label:>14}: {ms:.3f} ms, {mhz} MHz, {watts} W, {row['mj_per_call']} mJ",
            flush=True,
        )
    return out


def _plain(vocab: int, softcap: float | None) -> TileParams:
    """A plain loss's parameters (no optional statistics), as the engine passes them."""
    return TileParams(vocab, -100, 0.0, 0.0, softcap, 1.0, None, None, frozenset())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/profile")
    p.add_argument("--shapes", default="llama3-8b,qwen3-0.6b,mistral-7b")
    p.add_argument("--sections", default="budget,tiles,kernels,sweep")
    p.add_argument(
        "--label-smoothing",
        type=float,
        default=0.0,
        help="for the scalar calls of scaled, reference, timeline, enqueue",
    )
    args = p.parse_args()
    if args.label_smoothing:
        SCALAR_OPTIONS["label_smoothing"] = args.label_smoothing
    if not torch.cuda.is_available():
        sys.exit("profile_head.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    sections = args.sections.split(",")
    result = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        budget=[],
        tiles=[],
        kernels=[],
        sweep=[],
        epilogue=[],
        host=[],
        timeline=[],
        scaled=[],
        reference=[],
        power=[],
        enqueue=[],
        columns=[],
        queued=[],
        dx_rows=[],
        trainer_stats=[],
    )
    for name in args.shapes.split(","):
        if "budget" in sections:
            result["budget"] += budget_sweep(name)
        if "tiles" in sections:
            result["tiles"] += tile_pass(name)
        if "kernels" in sections:
            result["kernels"].append(kernel_breakdown(name))
        if "kernels_pertoken" in sections:
            result["kernels"].append(kernel_breakdown(name, reduction="none"))
        if "epilogue" in sections:
            if not result["epilogue"]:
                _check_tma()
            result["epilogue"].append(epilogue(name))
        if "host" in sections:
            result["host"].append(host(name))
        if "timeline" in sections:
            result["timeline"].append(timeline(name))
        if "scaled" in sections:
            result["scaled"].append(switch_ab(name, "HF_FLCE_SCALED_GRAD", ("fwd_bwd", "pertoken")))
        if "reference" in sections:
            result["reference"].append(switch_ab(name, "HF_FLCE_ROW_REFERENCE", ("fwd_bwd", "no_grad", "pertoken")))
        if "power" in sections:
            result["power"] += power(name)
        if "enqueue" in sections:
            result["enqueue"].append(enqueue(name))
        if "columns" in sections:
            result["columns"].append(columns(name))
        if "queued" in sections:
            result["queued"] += queued(name)
        if "dx_rows" in sections:
            result["dx_rows"].append(dx_rows(name))
        if "trainer_stats" in sections:
            result["trainer_stats"].append(trainer_stats(name))
        torch.cuda.empty_cache()
    if "host" in sections:
        result["host"].append(host_per_call())
    if "sweep" in sections:
        for vocab in (128256, 151936):
            for rows in (1024, 2048, 4096):
                result["sweep"] += tile_sweep(vocab, rows)
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
