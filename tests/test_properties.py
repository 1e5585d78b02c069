"""Property-based checks of the op against the float64 reference, and numerical edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_flce
from hf_flce import reference_linear_cross_entropy


@st.composite
def problems(draw):
    n = draw(st.integers(0, 9))
    h = draw(st.integers(1, 9))
    v = draw(st.sampled_from([1, 2, 3, 7, 31, 97, 101, 257]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * draw(st.sampled_from([0.1, 1.0, 3.0]))
    y = torch.randint(0, v, (n,), generator=gen)
    ignored = torch.rand(n, generator=gen) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    y[ignored] = -100
    kw = {
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "label_smoothing": draw(st.sampled_from([0.0, 0.2, 1.0])),
        "z_loss": draw(st.sampled_from([0.0, 1e-2])),
        "softcap": draw(st.sampled_from([None, 1.5, 30.0])),
        "temperature": draw(st.sampled_from([1.0, 0.5, 2.0])),
    }
    if draw(st.booleans()):
        kw["class_weight"] = torch.rand(v, generator=gen) + 0.1
    bias = torch.randn(v, generator=gen) if draw(st.booleans()) else None
    budget = draw(st.sampled_from([None, 64, 4 * v * 3]))
    return x, w, y, bias, kw, budget


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_matches_float64_reference(problem):
    x, w, y, b, kw, budget = problem
    leaves = [t.clone().requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    loss, stats = hf_flce.fused_linear_cross_entropy(
        leaves[0], leaves[1], y, leaves[2] if b is not None else None, return_stats=True, memory_budget=budget, **kw
    )
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_stats = reference_linear_cross_entropy(refs[0], refs[1], y, refs[2] if b is not None else None, **kw)
    scale = 1.0 + ref.abs().max().item() if ref.numel() else 1.0
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5 * scale)
    for name in ("logprobs", "entropy", "lse"):
        torch.testing.assert_close(getattr(stats, name).double(), ref_stats[name], rtol=1e-5, atol=1e-4)
    if not loss.requires_grad:
        return
    upstream = torch.randn(loss.shape)
    grads = torch.autograd.grad((loss * upstream).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), refs)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(
            g.double(), r, rtol=1e-4, atol=1e-4 * (1 + r.abs().amax().item() if r.numel() else 1)
        )


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("scale", [100.0, 500.0])
def test_extreme_logits_are_finite_and_correct(softcap, scale):
    x = torch.randn(16, 32) * scale
    w = torch.randn(300, 32)
    y = torch.randint(0, 300, (16,))
    xs = x.clone().requires_grad_()
    loss = hf_flce.fused_linear_cross_entropy(xs, w, y, softcap=softcap)
    loss.backward()
    ref, _ = reference_linear_cross_entropy(x.double(), w.double(), y, softcap=softcap)
    assert math.isfinite(loss.item()) and torch.isfinite(xs.grad).all()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-3)


def test_nan_in_hidden_propagates_like_stock():
    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    w = torch.randn(20, 8)
    y = torch.randint(0, 20, (6,))
    xs = x.clone().requires_grad_()
    loss = hf_flce.fused_linear_cross_entropy(xs, w, y)
    assert torch.isnan(loss)
    loss.backward()
    stock_x = x.clone().requires_grad_()
    stock = torch.nn.functional.cross_entropy(stock_x @ w.T, y)
    stock.backward()
    assert torch.isnan(stock)
    # The same entries are NaN as in stock; the rows that did not see the NaN keep finite gradients.
    assert torch.equal(torch.isnan(xs.grad), torch.isnan(stock_x.grad))


def test_inf_in_hidden_gives_nan_like_stock():
    x = torch.randn(4, 8)
    x[1, 0] = float("inf")
    w = torch.randn(20, 8)
    y = torch.randint(0, 20, (4,))
    ours = hf_flce.fused_linear_cross_entropy(x, w, y, reduction="none")
    stock = torch.nn.functional.cross_entropy(x @ w.T, y, reduction="none")
    assert torch.equal(torch.isnan(ours), torch.isnan(stock))
    assert torch.isfinite(ours[[0, 2, 3]]).all()


def test_bitwise_deterministic_on_cpu():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(500, 32, requires_grad=True)
    y = torch.randint(0, 500, (64,))
    results = []
    for _ in range(2):
        loss = hf_flce.fused_linear_cross_entropy(x, w, y, memory_budget=500 * 16 * 8)
        gx, gw = torch.autograd.grad(loss, (x, w))
        results.append((loss, gx, gw))
    for a, b in zip(*results):
        assert torch.equal(a, b)
