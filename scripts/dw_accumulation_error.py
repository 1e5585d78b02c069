#!/usr/bin/env python3
"""How summing dW across chunks affects its error against float64: the k chunk products summed in float32 or in bf16,
each with the target column in the bf16 logits gradient (Liger sums that in bf16) or apart (hf_flce: each row's target
term ``g_y x`` added in float32 once after the last chunk, so the sums carry only the softmax part; summed in bf16 by
default on Hopper, in float32 with ``HF_FLCE_DW_FP32_SUM=1``), next to stock HF's one-GEMM dW from bf16-rounded
logits. CPU, about 15 s.

    python scripts/dw_accumulation_error.py

Every product is computed from bf16 operands with fp32 accumulation (as cuBLAS does); a bf16 sum rounds once per
chunk (cuBLAS adding a product into a bf16 output). Three regimes:
  flat        random logits and uniformly random targets;
  peaked      the same with each target logit raised by 14 (p_y near 1);
  calibrated  logits at 3x scale plus a Zipf prior over the vocabulary, targets drawn from the softmax, as a trained
              model's: the softmax terms of frequent classes are then as large as their target terms.
"""

from __future__ import annotations

import torch


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


def main(n: int = 4096, h: int = 256, v: int = 8192, chunk_counts: tuple[int, ...] = (1, 2, 4, 8, 32)) -> None:
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
        print(f"{regime}: stock {rel_err(stock, ref):.2e}; chunks: sums in fp32 / in bf16, target column in · apart")
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
            errors = [
                rel_err(acc32.bfloat16(), ref),
                rel_err((acc32_apart + target_terms).bfloat16(), ref),
                rel_err(acc16, ref),
                rel_err((acc16_apart.float() + target_terms).bfloat16(), ref),
            ]
            print(f"  {k:2d}: fp32 {errors[0]:.2e} · {errors[1]:.2e} / bf16 {errors[2]:.2e} · {errors[3]:.2e}")


if __name__ == "__main__":
    main()
