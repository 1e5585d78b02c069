"""What does summing dW in the 16-bit gradient plus an int8 residual (``backends/triton_dw.py``) cost, next to cuBLAS?

Three questions, one section each (CUDA only):

- ``gemm``: one chunk's dW product ``G^T X`` (``[V, H]``, K = rows per chunk) by cuBLAS with a bf16 output (what one
  chunk costs when nothing is summed: the floor), by cuBLAS adding into a float32 accumulator (the previous default),
  and by the residual GEMM for a first, middle and last chunk, over a few tile shapes;
- ``accuracy``: dW summed over 4 chunks against float64: residual, float32 accumulator, bf16 sums, one GEMM;
- ``engine``: fwd+bwd of the whole op at the default budget, residual on and off: time ÷ the 3-GEMM floor and memory
  beyond the inputs and gradients.

    python scripts/probe_dw_accumulate.py --out /tmp/probe_dw.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_flce  # noqa: E402
from hf_flce.backends import resolve_backend  # noqa: E402
from hf_flce.backends.triton_dw import ResidualDW  # noqa: E402

SHAPES = {
    "llama3-8b": (128256, 4096, 8192),
    "qwen2.5-7b": (152064, 3584, 8192),
    "mistral-7b": (32768, 4096, 8192),
    "qwen3-0.6b": (151936, 1024, 16384),
}
ROWS = (1024, 1639, 2048, 4096)
TILES = ("128,256,64,8,3", "256,128,64,8,3", "128,128,64,4,4", "128,256,64,8,4")


def time_ms(fn, warmup=3, reps=10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def residual_call(acc: ResidualDW, g, x, position: str):
    """One chunk's add as the ``position`` chunk of three (the probe re-runs it, so the count is reset each time)."""
    acc.added = {"first": 0, "middle": 1, "last": 2}[position]
    if acc.lo is None:
        acc.lo = torch.zeros(acc.hi.shape, dtype=torch.int8, device=acc.hi.device)
    acc.add(g, x)


def gemm_section(shapes) -> list[dict]:
    out = []
    for name in shapes:
        v, h, _ = SHAPES[name]
        for rows in ROWS:
            g = (torch.randn(rows, v, device="cuda") * 1e-3).bfloat16()
            x = torch.randn(rows, h, device="cuda").bfloat16()
            floor = time_ms(lambda g=g, x=x: torch.mm(g.t(), x))
            f32 = torch.zeros(v, h, device="cuda")
            addmm = time_ms(lambda g=g, x=x, f=f32: torch.addmm(f, g.t(), x, out_dtype=torch.float32, out=f))
            f32 = None
            acc = ResidualDW((v, h), torch.bfloat16, torch.device("cuda"), n_chunks=3)
            rec = dict(shape=name, v=v, h=h, rows=rows, cublas_bf16_ms=floor, cublas_fp32_acc_ms=addmm)
            for tile in TILES:
                os.environ["HF_FLCE_DW_TILE"] = tile
                positions = ("first", "middle", "last") if tile == TILES[0] else ("middle",)
                for pos in positions:
                    try:
                        rec[f"residual_{pos}_{tile}_ms"] = time_ms(
                            lambda a=acc, g=g, x=x, p=pos: residual_call(a, g, x, p)
                        )
                    except Exception as exc:  # a tile shape that does not fit shared memory
                        rec[f"residual_{pos}_{tile}_ms"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            os.environ.pop("HF_FLCE_DW_TILE", None)
            print(json.dumps(rec), flush=True)
            out.append(rec)
            g = x = acc = None
            torch.cuda.empty_cache()
    return out


def accuracy_section() -> list[dict]:
    v, h, n = 32768, 4096, 8192
    torch.manual_seed(0)
    x = torch.randn(n, h, device="cuda").bfloat16()
    logits = torch.randn(n, v, device="cuda") * 2
    y = torch.randint(0, v, (n,), device="cuda")
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
        acc = ResidualDW((v, h), torch.bfloat16, torch.device("cuda"), n_chunks=4)
        f32 = torch.zeros(v, h, device="cuda")
        b16 = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)
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


def engine_section(shapes) -> list[dict]:
    tiles = resolve_backend("triton", torch.device("cuda"))
    out = []
    for name in shapes:
        v, h, n = SHAPES[name]
        x = torch.randn(n, h, device="cuda").bfloat16()
        w = (torch.randn(v, h, device="cuda") / h**0.5).bfloat16()
        y = torch.randint(0, v, (n,), device="cuda")
        logits = torch.mm(x, w.t())
        floor = time_ms(lambda x=x, w=w, z=logits: (torch.mm(x, w.t()), torch.mm(z, w), torch.mm(z.t(), x)))
        logits = None
        rec = dict(shape=name, n=n, v=v, h=h, floor_3gemm_ms=floor)
        for label, residual in (("on", tiles.residual_dw), ("off", None)):
            with mock.patch.object(tiles, "residual_dw", residual):
                xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

                def step(xg=xg, wg=wg, y=y):
                    xg.grad = wg.grad = None
                    hf_flce.fused_linear_cross_entropy(xg, wg, y).backward()

                rec[f"{label}_ms"] = time_ms(step)
                xg.grad = wg.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                grads = xg.grad.nbytes + wg.grad.nbytes
                rec[f"{label}_extra_beyond_grads_gib"] = (torch.cuda.max_memory_allocated() - base - grads) / 2**30
                rec[f"{label}_ratio"] = rec[f"{label}_ms"] / floor
        print(json.dumps(rec), flush=True)
        out.append(rec)
        x = w = None
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="probe_dw_accumulate.json")
    p.add_argument("--sections", default="gemm,accuracy,engine")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    shapes = args.shapes.split(",")
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    sections = args.sections.split(",")
    if "accuracy" in sections:
        result["accuracy"] = accuracy_section()
    if "gemm" in sections:
        result["gemm"] = gemm_section(shapes)
    if "engine" in sections:
        result["engine"] = engine_section(shapes)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
