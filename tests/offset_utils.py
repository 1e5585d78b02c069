"""Float32 precision at logits sharing a large offset, against float64 and stock float32: the problem and the
error measure shared by ``test_core.py`` (the single-device op) and ``distributed_workers.py`` (the
vocabulary-parallel op)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

OFFSET = 168.0  # lse ~ 170, as in the large-lse rows of some trained models; half a float32 ulp there is 7.6e-6


def offset_logits_problem(offset: float, peak: float, n: int = 48, h: int = 32, v: int = 1000):
    """float64 leaves whose logits share ``offset`` (through a column of ones in x against a column of ``offset`` in
    W, as a trained model's share one along W's mean row), with each target's logit raised by ``peak``; one row in
    seven ignored (-100). Drawn from torch's global generator."""
    w = torch.randn(v, h, dtype=torch.float64) / h**0.5
    y = torch.randint(0, v, (n,))
    y[::7] = -100
    x = torch.randn(n, h, dtype=torch.float64) + peak * w[y] / w[y].square().sum(1, keepdim=True)
    x = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    w = torch.cat([w, torch.full((v, 1), offset, dtype=torch.float64)], 1)
    return x, w, y


def stock_output(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, output: str) -> torch.Tensor:
    """Stock PyTorch's ``mean`` loss, per-token ``loss``, target ``logprob`` or ``entropy`` (0 at ignored rows)."""
    z = x @ w.T
    if output == "mean":
        return F.cross_entropy(z, y)
    if output == "loss":
        return F.cross_entropy(z, y, reduction="none")
    keep = (y != -100).to(z.dtype)
    log_p = z.log_softmax(-1)
    if output == "logprob":
        return log_p.gather(1, y.clamp(min=0)[:, None]).squeeze(1) * keep
    return -(log_p.exp() * log_p).sum(-1) * keep


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def offset_errors(
    output: str,
    peak: float,
    ours: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    in_backward: dict | None = None,
    weight_rows: slice = slice(None),
) -> dict[str, list[float]]:
    """Relative errors against float64 of the value, dX and dW (its rows ``weight_rows``), stock float32's and ours
    (``ours(x32, w32, y)``), at logits sharing an offset of 168 (``offset_logits_problem``) under a random upstream
    gradient. ``in_backward`` (a switch ``{"on": bool}``) is on during our backward."""
    x, w, y = offset_logits_problem(OFFSET, peak)
    upstream = torch.randn(y.shape, dtype=torch.float64) if output != "mean" else torch.tensor(1.0, dtype=torch.float64)
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = stock_output(x64, w64, y, output)
    (want * upstream).sum().backward()
    errors = {}
    for name in ("stock", "ours"):
        x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
        got = stock_output(x32, w32, y, output) if name == "stock" else ours(x32, w32, y)
        if in_backward is not None:
            in_backward["on"] = name == "ours"
        (got * upstream.float()).sum().backward()
        if in_backward is not None:
            in_backward["on"] = False
        pairs = ((got, want), (x32.grad, x64.grad), (w32.grad[weight_rows], w64.grad[weight_rows]))
        errors[name] = [rel_err(a.detach(), b.detach()) for a, b in pairs]
    return errors
