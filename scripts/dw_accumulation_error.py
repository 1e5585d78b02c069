#!/usr/bin/env python3
"""Why hf_flce sums dW across chunks in fp32: dW error against float64 when k chunk products are summed in fp32
versus in bf16 (Liger's choice), next to stock HF's one-GEMM dW from bf16-rounded logits. CPU, about a minute.

    python scripts/dw_accumulation_error.py

Every product is computed from bf16 operands with fp32 accumulation (as cuBLAS does); only the summation across
chunks differs. Flat logits, and peaked ones (target logit raised by 14).
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


def main(n: int = 4096, h: int = 512, v: int = 8192, chunk_counts: tuple[int, ...] = (1, 2, 4, 8, 32)) -> None:
    torch.manual_seed(0)
    print(f"N={n} H={h} V={v}: dW relative error against float64")
    for peak in (0.0, 14.0):
        x = torch.randn(n, h).bfloat16()
        w = (torch.randn(v, h) / h**0.5).bfloat16()
        y = torch.randint(0, v, (n,))
        rows = torch.arange(n)
        z = x.double() @ w.double().T
        z[rows, y] += peak
        ref = logits_grad(z, y).T @ x.double()

        z_stock = (x.float() @ w.float().T).bfloat16().float()  # stock rounds the logits to bf16
        z_stock[rows, y] += peak
        stock = (logits_grad(z_stock, y).bfloat16().float().T @ x.float()).bfloat16()
        grad = logits_grad(z.float(), y).bfloat16()  # ours: fp32 logits, bf16 gradient for the GEMMs
        print(f"{'peaked' if peak else 'flat'}: stock {rel_err(stock, ref):.2e}")
        for k in chunk_counts:
            size = n // k
            acc32, acc16 = torch.zeros(v, h), torch.zeros(v, h, dtype=torch.bfloat16)
            for s in range(0, n, size):
                product = grad[s : s + size].float().T @ x[s : s + size].float()
                acc32 += product
                acc16 = (acc16.float() + product).bfloat16()
            print(
                f"  {k:2d} chunks: fp32 sums {rel_err(acc32.bfloat16(), ref):.2e}, bf16 sums {rel_err(acc16, ref):.2e}"
            )


if __name__ == "__main__":
    main()
