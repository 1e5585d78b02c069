#!/usr/bin/env python3
"""How summing dW across chunks affects its error against float64: the k chunk products summed in float32 or in bf16,
each with the target column in the bf16 logits gradient (Liger sums that in bf16) or apart (hf_flce: each row's target
term ``g_y x`` added in float32 once after the last chunk, so the sums carry only the softmax part; summed in bf16 by
default on Hopper, in float32 with ``HF_FLCE_DW_FP32_SUM=1``), next to stock HF's one-GEMM dW from bf16-rounded logits.
From ``engine._FrequentClassRows.MIN_CHUNKS`` chunks on, the default's bf16 sum keeps the rows of the call's most
frequent target classes in float32: the last column, which takes them at every chunk count. CPU, about 15 s at the
default size, 2 min at the second.

    python scripts/dw_accumulation_error.py
    python scripts/dw_accumulation_error.py --rows 8192 --hidden 128 --vocab 32768 --chunks 1,8,16,64

``--op`` measures hf_flce's own op instead (on a GPU: its Hopper path), in the calibrated regime at a real head's
shape, at each ``--budgets`` (bytes; the chunk count is reported), against float64, with stock HF's error next to it:

    python scripts/dw_accumulation_error.py --op --rows 8192 --hidden 1024 --vocab 151936 --budgets 1073741824,134217728

Every product is computed from bf16 operands with fp32 accumulation (as cuBLAS does); a bf16 sum rounds once per
chunk (cuBLAS adding a product into a bf16 output). Three regimes:
  flat        random logits and uniformly random targets;
  peaked      the same with each target logit raised by 14 (p_y near 1);
  calibrated  logits at 3x scale plus a Zipf prior over the vocabulary, targets drawn from the softmax, as a trained
              model's: the softmax terms of frequent classes are then as large as their target terms.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_flce.engine import _FrequentClassRows  # noqa: E402

FREQUENT_CLASSES = _FrequentClassRows.COUNT


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def logits_grad(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d(mean CE)/dz: softmax minus the one-hot target, over the rows."""
    g = torch.softmax(z, -1)
    g[torch.arange(z.shape[0]), y] -= 1
    return g / z.shape[0]


def inputs(regime: str, n: int, h: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x and W, the float64 logits' offset added to x W^T (peaked/calibrated), and the targets."""
    x = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / h**0.5).bfloat16()
    offset = torch.zeros(n, v, dtype=torch.float64)
    y = torch.randint(0, v, (n,))
    if regime == "peaked":
        offset[torch.arange(n), y] = 14.0
    elif regime == "calibrated":
        scale = 3.0
        zipf = -torch.log(torch.arange(1, v + 1, dtype=torch.float64))
        offset = (scale - 1) * (x.double() @ w.double().T) + zipf
        y = torch.multinomial(torch.softmax(x.double() @ w.double().T + offset, -1).float(), 1).squeeze(1)
    return x, w, offset, y


def main(n: int, h: int, v: int, chunk_counts: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    print(f"N={n} H={h} V={v}: dW relative error against float64")
    for regime in ("flat", "peaked", "calibrated"):
        x, w, offset, y = inputs(regime, n, h, v)
        rows = torch.arange(n)
        z = x.double() @ w.double().T + offset
        ref = logits_grad(z, y).T @ x.double()

        z_stock = ((x.float() @ w.float().T).double() + offset).bfloat16().float()  # stock rounds the logits to bf16
        stock = (logits_grad(z_stock, y).bfloat16().float().T @ x.float()).bfloat16()
        grad32 = logits_grad(z.float(), y)
        grad = grad32.bfloat16()  # fp32 logits, bf16 gradient for the GEMMs
        apart = grad32.clone()  # the same without the target column, whose terms are added in float32 at the end
        apart[rows, y] = 0
        apart = apart.bfloat16()
        target_terms = torch.zeros(v, h).index_add_(0, y, grad32[rows, y, None] * x.float())
        frequent = torch.bincount(y, minlength=v).topk(min(FREQUENT_CLASSES, v)).indices
        print(
            f"{regime}: stock {rel_err(stock, ref):.2e}; chunks: sums in fp32 / in bf16, target column in · apart"
            f" · apart with the {len(frequent)} most frequent targets' rows in fp32"
        )
        for k in chunk_counts:
            size = n // k
            acc32, acc32_apart = torch.zeros(v, h), torch.zeros(v, h)
            acc16, acc16_apart = torch.zeros(v, h, dtype=torch.bfloat16), torch.zeros(v, h, dtype=torch.bfloat16)
            for s in range(0, n, size):
                chunk = slice(s, s + size)
                product = grad[chunk].float().T @ x[chunk].float()
                product_apart = apart[chunk].float().T @ x[chunk].float()
                acc32 += product
                acc32_apart += product_apart
                acc16 = (acc16.float() + product).bfloat16()
                acc16_apart = (acc16_apart.float() + product_apart).bfloat16()
            mixed = acc16_apart.float()
            mixed[frequent] = acc32_apart[frequent]
            errors = [
                rel_err(acc32.bfloat16(), ref),
                rel_err((acc32_apart + target_terms).bfloat16(), ref),
                rel_err(acc16, ref),
                rel_err((acc16_apart.float() + target_terms).bfloat16(), ref),
                rel_err((mixed + target_terms).bfloat16(), ref),
            ]
            print(
                f"  {k:2d}: fp32 {errors[0]:.2e} · {errors[1]:.2e} / bf16 {errors[2]:.2e} · {errors[3]:.2e}"
                f" · {errors[4]:.2e}"
            )


def calibrated_head(n: int, h: int, v: int, device: str, chunk: int = 2048):
    """bf16 hidden states and head weights whose logits are ``3 x W^T`` (std ~3) plus a Zipf prior over the
    vocabulary (carried by the last hidden feature, set to 1), and targets drawn from their softmax."""
    x = torch.randn(n, h, device=device) * 3
    x[:, -1] = 1
    w = torch.randn(v, h, device=device) / h**0.5
    w[:, -1] = -torch.log(torch.arange(1, v + 1, device=device, dtype=torch.float32))
    x, w = x.bfloat16(), w.bfloat16()
    y = torch.cat([torch.multinomial(torch.softmax(x[s : s + chunk].float() @ w.float().T, -1), 1).squeeze(1)
                   for s in range(0, n, chunk)])  # fmt: skip
    return x, w, y


def float64_dw(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """d(mean CE)/dW in float64, over row chunks."""
    dw = torch.zeros(w.shape, dtype=torch.float64, device=w.device)
    wd = w.double()
    for s in range(0, x.shape[0], chunk):
        xd, yc = x[s : s + chunk].double(), y[s : s + chunk]
        dw += (logits_grad(xd @ wd.T, yc) * len(yc)).T @ xd
    return dw / x.shape[0]


def op_errors(n: int, h: int, v: int, budgets: list[int], device: str) -> None:
    """dW's error against float64 of stock HF and of hf_flce at each budget: its default (the most frequent target
    classes' rows summed in float32), every row in the 16-bit sum, and the float32 sum."""
    import hf_flce
    from hf_flce.backends import triton_scaled

    torch.manual_seed(0)
    x, w, y = calibrated_head(n, h, v, device)
    ref = float64_dw(x, w, y)
    print(f"N={n} H={h} V={v} on {device}, calibrated: dW relative error against float64")
    wl = w.clone().requires_grad_()
    torch.nn.functional.cross_entropy((x @ wl.T).float(), y).backward()
    print(f"  stock HF: {rel_err(wl.grad, ref):.2e}")
    modes = {
        "default": {},
        "every row in the 16-bit sum": {"HF_FLCE_DW_FREQUENT_CLASSES": "0"},
        "float32 sum": {"HF_FLCE_DW_FP32_SUM": "1"},
    }
    chunks = [0]  # the scaled gradient's chunks (its row scales are formed once per chunk)
    row_scales = triton_scaled.row_scales

    def counted(*args, **kwargs):
        chunks[0] += 1
        return row_scales(*args, **kwargs)

    for budget in budgets:
        for label, env in modes.items():
            chunks[0] = 0
            wl = w.clone().requires_grad_()
            with mock.patch.dict(os.environ, env), mock.patch.object(triton_scaled, "row_scales", counted):
                hf_flce.fused_linear_cross_entropy(x, wl, y, memory_budget=budget).backward()
            print(f"  budget {budget / 2**20:g} MiB, {chunks[0]} chunks, {label}: {rel_err(wl.grad, ref):.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--chunks", default="1,2,4,8,32", help="comma-separated chunk counts")
    parser.add_argument("--op", action="store_true", help="measure hf_flce's op (module docstring)")
    parser.add_argument("--budgets", default="1073741824", help="comma-separated memory budgets for --op")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.op:
        op_errors(args.rows, args.hidden, args.vocab, [int(b) for b in args.budgets.split(",")], args.device)
    else:
        main(args.rows, args.hidden, args.vocab, tuple(int(c) for c in args.chunks.split(",")))
