"""What does summing dW in the 16-bit gradient plus an int8 residual (``backends/triton_dw.py``) cost, next to cuBLAS?

Four questions, one section each (CUDA only):

- ``accuracy``: dW summed over 4 chunks against float64: residual, float32 accumulator, bf16 sums, one GEMM;
- ``epilogue``: one chunk's dW product ``G^T X`` (``[V, H]``, K = rows per chunk) by cuBLAS with a bf16 output (the
  floor: nothing summed), by cuBLAS adding into a float32 accumulator (the default), and by the residual GEMM for a
  first, middle and last chunk, with ``hi``/``lo`` moved by TMA or by per-thread accesses, over a few tile shapes;
- ``pingpong``: the warp-specialized Hopper kernel (``backends/hopper_dw.py``) against the Triton one and float64 on
  odd shapes (rows and V off every block size), one and three chunks;
- ``engine``: fwd+bwd of the whole op at the default budget, residual on (Hopper kernel, Triton kernel) and off: time
  ÷ the 3-GEMM floor and memory beyond the inputs and gradients.

    python scripts/probe_dw_accumulate.py --out /tmp/probe_dw.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import Device, median  # noqa: E402

import hf_flce  # noqa: E402
from hf_flce.backends import resolve_backend, triton_dw  # noqa: E402
from hf_flce.backends.triton_dw import ResidualDW, tile_config  # noqa: E402

DEVICE = "cuda"  # a dry run of the script's logic may set "cpu" (with TRITON_INTERPRET=1 and small SHAPES)
SHAPES = {
    "llama3-8b": (128256, 4096, 8192),
    "qwen2.5-7b": (152064, 3584, 8192),
    "mistral-7b": (32768, 4096, 8192),
    "qwen3-0.6b": (151936, 1024, 16384),
}


def time_ms(fn, warmup=3, reps=10) -> float:
    """Median milliseconds of ``reps`` calls, each timed with device events."""
    return median(Device(DEVICE).time_ms(fn, warmup, reps))


def tile_name(tile) -> str:
    return ",".join(str(v) for v in tile)


def try_time(fn):
    try:
        return time_ms(fn)
    except Exception as exc:  # e.g. a tile shape that does not fit shared memory
        return f"{type(exc).__name__}: {str(exc)[:200]}"


EPILOGUE_TILES = ((128, 128, 64, 8, 4),)
PINGPONG_OPTIONS = (dict(stages=4, split=2), dict(stages=4, split=4), dict(stages=4, split=2, group_m=16))


def epilogue_section(shapes) -> list[dict]:
    """The residual GEMM with ``hi``/``lo`` moved by TMA or by per-thread loads and stores, for a first, middle and
    last chunk over a few tile shapes, next to cuBLAS (bf16 output, and adding into float32)."""
    out = []
    for name in shapes:
        for rows in (1639, 4096):
            rec = epilogue_record(name, rows)
            print(json.dumps(rec), flush=True)
            out.append(rec)
            torch.cuda.empty_cache()
    return out


def epilogue_record(name: str, rows: int) -> dict:
    v, h, _ = SHAPES[name]
    g = (torch.randn(rows, v, device=DEVICE) * 1e-3).bfloat16()
    x = torch.randn(rows, h, device=DEVICE).bfloat16()
    rec = dict(shape=name, v=v, h=h, rows=rows)
    rec["cublas_bf16_ms"] = time_ms(lambda: torch.mm(g.t(), x))
    f32 = torch.zeros(v, h, device=DEVICE)
    rec["cublas_fp32_acc_ms"] = time_ms(lambda: torch.addmm(f32, g.t(), x, out_dtype=torch.float32, out=f32))
    f32 = None
    acc = ResidualDW((v, h), torch.bfloat16, torch.device(DEVICE), n_chunks=3)
    single = ResidualDW((v, h), torch.bfloat16, torch.device(DEVICE), n_chunks=1)
    for options in PINGPONG_OPTIONS:
        acc.pingpong_options = single.pingpong_options = options
        label = "pingpong_" + ",".join(f"{k}{v}" for k, v in options.items())
        rec[f"only_{label}_ms"] = try_time(lambda: residual_call(single, g, x, "first"))
        for pos in ("first", "middle", "last"):
            rec[f"{pos}_{label}_ms"] = try_time(lambda p=pos: residual_call(acc, g, x, p))
    acc.pingpong = single.pingpong = False
    for tile in EPILOGUE_TILES:
        acc.config = single.config = tile_config(*tile)
        # one chunk: the mainloop and a bf16 store only (nothing summed)
        rec[f"only_{tile_name(tile)}_ms"] = try_time(lambda: residual_call(single, g, x, "first"))
        for tma in (True, False):
            acc.tma_epilogue = tma
            for pos in ("first", "middle", "last"):
                key = f"{pos}_{'tma' if tma else 'plain'}_{tile_name(tile)}_ms"
                rec[key] = try_time(lambda p=pos: residual_call(acc, g, x, p))
    for pos in ("only", "first", "middle", "last"):
        times = {k: t for k, t in rec.items() if k.startswith(pos + "_") and isinstance(t, float)}
        if times:
            best = min(times, key=times.get)
            rec[f"best_{pos}"] = best
            rec[f"best_{pos}_vs_cublas_bf16"] = times[best] / rec["cublas_bf16_ms"]
            rec[f"best_{pos}_vs_cublas_fp32_acc"] = times[best] / rec["cublas_fp32_acc_ms"]
    return rec


def residual_call(acc: ResidualDW, g, x, position: str):
    """One chunk's add as the ``position`` chunk of three (the probe re-runs it, so the count is reset each time)."""
    acc.added = {"first": 0, "middle": 1, "last": 2}[position]
    if acc.lo is None and acc.n_chunks > 1:
        acc.lo = torch.zeros(acc.hi.shape, dtype=torch.int8, device=acc.hi.device)
    acc.add(g, x)


def accuracy_section() -> list[dict]:
    v, h, n = 32768, 4096, 8192
    torch.manual_seed(0)
    x = torch.randn(n, h, device=DEVICE).bfloat16()
    logits = torch.randn(n, v, device=DEVICE) * 2
    y = torch.randint(0, v, (n,), device=DEVICE)
    out = []
    for dist, peak in (("flat", 0.0), ("peaked", 14.0)):
        z = logits.clone()
        z[torch.arange(n), y] += peak
        g = torch.softmax(z, -1)
        g[torch.arange(n), y] -= 1
        g = (g / n).bfloat16()
        del z
        ref = g.double().t() @ x.double()
        chunks = [(g[s : s + n // 4], x[s : s + n // 4]) for s in range(0, n, n // 4)]
        acc = ResidualDW((v, h), torch.bfloat16, torch.device(DEVICE), n_chunks=4)
        f32 = torch.zeros(v, h, device=DEVICE)
        b16 = torch.zeros(v, h, device=DEVICE, dtype=torch.bfloat16)
        for gc, xc in chunks:
            acc.add(gc, xc)
            torch.addmm(f32, gc.t(), xc, out_dtype=torch.float32, out=f32)
            b16 = torch.mm(gc.t(), xc, out_dtype=torch.float32).add_(b16.float()).bfloat16()
        one = torch.mm(g.t(), x)

        def err(a, ref=ref):
            return float((a.double() - ref).norm() / ref.norm())

        rec = dict(
            dist=dist,
            residual=err(acc.result()),
            fp32_acc=err(f32.bfloat16()),
            bf16_sums=err(b16),
            one_gemm=err(one),
            residual_vs_fp32_acc_mismatch=float((acc.result() != f32.bfloat16()).float().mean()),
        )
        print(json.dumps(rec), flush=True)
        out.append(rec)
        ref = g = acc = f32 = b16 = one = None
        torch.cuda.empty_cache()
    return out


def pingpong_section() -> list[dict]:
    """The Hopper kernel's sums next to the Triton kernel's and float64's, for one and three chunks."""
    out = []
    # the first three fit one tile per program; the others give each program (and both consumers) many tiles
    for v, h, rows in ((1000, 512, 1001), (2056, 384, 130), (4096, 256, 64), (8200, 1024, 700), (32000, 4096, 1639)):
        torch.manual_seed(v + rows)
        for n_chunks in (1, 3):
            gs = [(torch.randn(rows, v, device=DEVICE) * 1e-3).bfloat16() for _ in range(n_chunks)]
            xs = [torch.randn(rows, h, device=DEVICE).bfloat16() for _ in range(n_chunks)]
            ref = sum(g.double().t() @ x.double() for g, x in zip(gs, xs))
            results = {}
            for label, pingpong, options in (
                ("triton", False, {}),
                ("pingpong", True, {}),
                ("pingpong_split4", True, dict(split=4)),
            ):
                acc = ResidualDW((v, h), torch.bfloat16, torch.device(DEVICE), n_chunks=n_chunks)
                acc.pingpong, acc.pingpong_options = pingpong, options
                for g, x in zip(gs, xs):
                    acc.add(g, x)
                results[label] = acc.result()
            rec = dict(v=v, h=h, rows=rows, n_chunks=n_chunks)
            for label, result in results.items():
                rec[f"{label}_err"] = float((result.double() - ref).norm() / ref.norm())
                if label != "triton":
                    rec[f"{label}_differ_from_triton"] = float((result != results["triton"]).float().mean())
            rec["one_gemm_err"] = (
                float((sum(torch.mm(g.t(), x) for g, x in zip(gs, xs)).double() - ref).norm() / ref.norm())
                if n_chunks == 1
                else None
            )
            rec["hopper_kernel_taken"] = hopper_taken(gs[0], xs[0], results["pingpong"])
            print(json.dumps(rec), flush=True)
            out.append(rec)
    return out


def hopper_taken(g, x, hi) -> bool:
    from hf_flce.backends import hopper_dw

    return hopper_dw.supports(g, x, hi)


def engine_section(shapes) -> list[dict]:
    tiles = resolve_backend("triton", torch.device(DEVICE))
    out = []
    for name in shapes:
        v, h, n = SHAPES[name]
        x = torch.randn(n, h, device=DEVICE).bfloat16()
        w = (torch.randn(v, h, device=DEVICE) / h**0.5).bfloat16()
        y = torch.randint(0, v, (n,), device=DEVICE)
        logits = torch.mm(x, w.t())
        floor = time_ms(lambda x=x, w=w, z=logits: (torch.mm(x, w.t()), torch.mm(z, w), torch.mm(z.t(), x)))
        logits = None
        rec = dict(shape=name, n=n, v=v, h=h, floor_3gemm_ms=floor)
        on = tiles.residual_dw or triton_dw
        variants = [("off", None, True), ("on", on, True), ("on_triton_kernel", on, False)]
        for label, residual, pingpong in variants:
            with mock.patch.object(tiles, "residual_dw", residual), mock.patch.object(ResidualDW, "pingpong", pingpong):
                xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

                def step(xg=xg, wg=wg, y=y):
                    xg.grad = wg.grad = None
                    hf_flce.fused_linear_cross_entropy(xg, wg, y).backward()

                rec[f"{label}_ms"] = time_ms(step)
                xg.grad = wg.grad = None
                _, extra = Device("cuda").extra_memory(step)
                grads = xg.grad.nbytes + wg.grad.nbytes
                rec[f"{label}_extra_beyond_grads_gib"] = (extra - grads) / 2**30
                rec[f"{label}_ratio"] = rec[f"{label}_ms"] / floor
                if label == "off":
                    ref_grads = (xg.grad.float(), wg.grad.float())
                else:
                    # the same gradients as the float32 accumulator's, up to one bf16 step here and there
                    rec[f"{label}_dw_rel_diff"] = float((wg.grad.float() - ref_grads[1]).norm() / ref_grads[1].norm())
                    rec[f"{label}_dx_rel_diff"] = float((xg.grad.float() - ref_grads[0]).norm() / ref_grads[0].norm())
        print(json.dumps(rec), flush=True)
        out.append(rec)
        x = w = ref_grads = None
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="probe_dw_accumulate.json")
    p.add_argument("--sections", default="pingpong,epilogue,engine")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    shapes = args.shapes.split(",")
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    sections = args.sections.split(",")
    if "accuracy" in sections:
        result["accuracy"] = accuracy_section()
    if "epilogue" in sections:
        result["epilogue"] = epilogue_section(shapes)
    if "pingpong" in sections:
        result["pingpong"] = pingpong_section()
    if "engine" in sections:
        result["engine"] = engine_section(shapes)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
