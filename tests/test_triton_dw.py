"""dW summed across chunks into the 16-bit gradient plus an int8 residual (``backends/triton_dw.py``), against float64.

The sum of the chunk products must round like one GEMM over all rows does (to the nearest 16-bit value of the exact
sum), which summing in 16 bits does not. On CPU the kernel runs in the Triton interpreter.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from test_triton_backend import DEVICE, assert_close, make_inputs  # noqa: E402

import hf_flce  # noqa: E402
from hf_flce import engine  # noqa: E402
from hf_flce.backends import hopper_dw, resolve_backend, triton_dw  # noqa: E402
from hf_flce.backends.triton_dw import ResidualDW  # noqa: E402
from hf_flce.backends.triton_tiles import TritonTileOps  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


def chunk_products(m, n, rows, dtype, seed, scale=1e-2):
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(r, m, generator=gen) * scale).to(DEVICE, dtype) for r in rows]
    xs = [torch.randn(r, n, generator=gen).to(DEVICE, dtype) for r in rows]
    return grads, xs


def exact_sum(grads, xs):
    return sum(g.double().T @ x.double() for g, x in zip(grads, xs))


def residual_sum(grads, xs, shape, dtype, tma_epilogue=True, pingpong=True):
    acc = ResidualDW(shape, dtype, DEVICE, n_chunks=len(grads))
    acc.tma_epilogue = tma_epilogue  # used on Hopper GPUs where the rows are 16-byte aligned
    acc.pingpong = pingpong
    for g, x in zip(grads, xs):
        acc.add(g, x)
    return acc.result()


def rel_err(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("tma_epilogue", [True, False], ids=["tma-epilogue", "plain-epilogue"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m, n, rows",
    [
        (37, 45, (23, 23, 19)),
        (64, 32, (16,)),
        (50, 33, (40, 40, 40, 7)),
        (17, 1, (1, 5)),
        (1, 40, (9, 9)),
        (300, 272, (64, 48, 37)),
    ],
    ids=["ragged", "one-chunk", "k-tail", "one-column", "one-row", "aligned-rows"],
)
def test_rounds_like_one_gemm(dtype, m, n, rows, tma_epilogue):
    if tma_epilogue and DEVICE.type == "cpu" and (m, n) != (37, 45):
        pytest.skip("the interpreter never takes the TMA epilogue: one case is enough")
    grads, xs = chunk_products(m, n, rows, dtype, seed=len(rows) + m)
    ref = exact_sum(grads, xs)
    out = residual_sum(grads, xs, (m, n), dtype, tma_epilogue)
    assert out.dtype == dtype and out.shape == (m, n)
    once = ref.to(dtype)  # the nearest 16-bit value of the exact sum
    # 8 residual bits: a value off from the round-once one only where the exact sum lies within 2^-9 ulp of a tie
    assert (out != once).float().mean().item() <= 0.02
    assert_close(out, once, 2**-7 if dtype == torch.bfloat16 else 2**-10, "dW")
    assert rel_err(out, ref) <= rel_err(once, ref) * 1.01


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_beats_summing_in_16_bits(dtype):
    """Eight chunks: the plain 16-bit sum rounds every partial sum; the residual keeps round-once accuracy."""
    grads, xs = chunk_products(40, 24, (12,) * 8, dtype, seed=3)
    ref = exact_sum(grads, xs)
    out = residual_sum(grads, xs, (40, 24), dtype)
    plain = torch.zeros(40, 24, dtype=dtype, device=DEVICE)
    for g, x in zip(grads, xs):
        plain = (plain.float() + g.float().T @ x.float()).to(dtype)
    assert rel_err(out, ref) < 0.8 * rel_err(plain, ref)


def test_cancellation():
    """A chunk that cancels the previous one: what is left of them is the residual's resolution, 2^-16 of their
    partial sums, next to the third chunk's product."""
    dtype = torch.bfloat16
    grads, xs = chunk_products(33, 20, (8, 8, 8), dtype, seed=5)
    grads[1], xs[1] = -grads[0], xs[0].clone()
    partial = (grads[0].double().T @ xs[0].double()).abs().max().item()
    ref = exact_sum(grads, xs)
    out = residual_sum(grads, xs, (33, 20), dtype)
    assert (out.double() - ref).abs().max().item() <= ref.abs().max().item() * 2**-8 + partial * 2**-15


def test_magnitudes():
    """Entries spanning 15 decades (the residual unit follows each entry's exponent), and exact zeros: each entry
    within one bf16 rounding of the exact sum, plus the residual's resolution (2^-16) of the partial sums it went
    through (which matters only where the chunks cancel)."""
    dtype = torch.bfloat16
    grads, xs = chunk_products(33, 20, (8, 8, 8), dtype, seed=6)
    spread = torch.logspace(-12, 3, 33, device=DEVICE).to(dtype)[None, :]
    grads = [g * spread for g in grads]
    for g in grads:
        g[:, :3] = 0
    ref = exact_sum(grads, xs)
    out = residual_sum(grads, xs, (33, 20), dtype)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    through = sum((g.double().T @ x.double()).abs() for g, x in zip(grads, xs))
    bound = ref.abs() * 2**-8 + through * 2**-15
    assert ((out.double() - ref).abs() <= bound).all()


HOPPER = DEVICE.type == "cuda" and hopper_dw.AVAILABLE and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel needs a Hopper GPU and Gluon")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m, n, rows",
    [
        (1000, 512, (1001, 64, 130)),  # V and rows off every block size; one tile per program
        (8200, 1024, (700, 700, 5)),  # many tiles per program: both consumers and the ring across tiles
        (4096, 256, (64,)),  # one chunk: no residual
        (2056, 384, (1, 2)),  # a one-row chunk
    ],
    ids=["ragged", "many-tiles", "one-chunk", "one-row-chunks"],
)
def test_hopper_kernel(dtype, m, n, rows):
    """The warp-specialized Hopper kernel (``hopper_dw``) gives the Triton kernel's sums bit for bit."""
    grads, xs = chunk_products(m, n, rows, dtype, seed=m + n)
    assert hopper_dw.supports(grads[0], xs[0], torch.empty(m, n, dtype=dtype, device=DEVICE))
    out = residual_sum(grads, xs, (m, n), dtype)
    assert torch.equal(out, residual_sum(grads, xs, (m, n), dtype, pingpong=False))
    ref = exact_sum(grads, xs)
    assert rel_err(out, ref) <= rel_err(ref.to(dtype), ref) * 1.01


def test_hopper_kernel_refusals():
    """Where TMA cannot address the operands (or there is no Hopper GPU), the Triton kernel takes the chunk."""
    g = torch.zeros(8, 1000, dtype=torch.bfloat16, device=DEVICE)
    x = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEVICE)
    hi = torch.zeros(1000, 64, dtype=torch.bfloat16, device=DEVICE)
    assert hopper_dw.supports(g, x, hi) == HOPPER
    odd = torch.zeros(8, 999, dtype=torch.bfloat16, device=DEVICE)
    assert not hopper_dw.supports(odd, x, hi[:999])  # rows of 1998 bytes
    assert not hopper_dw.supports(g[:0], x[:0], hi)  # no rows
    assert not hopper_dw.supports(g, x[:, :24], hi[:, :24].contiguous())  # int8 residual rows of 24 bytes
    assert not hopper_dw.supports(g.float(), x, hi)
    assert not hopper_dw.supports(g, x[:, 1:9], hi[:, :8])  # x's rows not 16-byte aligned at their start


def test_misuse_is_an_error():
    grads, xs = chunk_products(8, 8, (4, 4), torch.bfloat16, seed=0)
    acc = ResidualDW((8, 8), torch.bfloat16, DEVICE, n_chunks=2)
    acc.add(grads[0], xs[0])
    with pytest.raises(RuntimeError, match="1 of 2 chunks not added"):
        acc.result()
    acc.add(grads[1], xs[1])
    with pytest.raises(RuntimeError, match="beyond the 2 announced"):
        acc.add(grads[1], xs[1])


def test_supports():
    assert triton_dw.supports(torch.bfloat16, torch.bfloat16, DEVICE)
    assert not triton_dw.supports(torch.bfloat16, torch.float32, DEVICE)  # fp32 master weight: fp32 gradient
    assert not triton_dw.supports(torch.float16, torch.bfloat16, DEVICE)
    assert not triton_dw.supports(torch.float32, torch.float32, DEVICE)


def test_switch():
    """Opt-in: its GEMM runs behind cuBLAS, so the float32 accumulator stays the default."""
    assert TritonTileOps().residual_dw is None
    assert TritonTileOps(dw_residual=True).residual_dw is triton_dw
    with mock.patch.dict("os.environ", {"HF_FLCE_DW_RESIDUAL": "1"}):
        assert TritonTileOps().residual_dw is triton_dw
    with mock.patch.dict("os.environ", {"HF_FLCE_DW_RESIDUAL": "1"}):
        assert TritonTileOps(dw_residual=False).residual_dw is None


# --- through the engine ---------------------------------------------------------------------------------------


@pytest.fixture
def residual_on():
    """Switched on, for the backend the public API resolves to (and the epilogue GEMM on every device)."""
    tiles = resolve_backend("triton", DEVICE)
    with mock.patch.object(tiles, "residual_dw", triton_dw), mock.patch.object(tiles, "gemm_min_capability", 0):
        yield


@pytest.fixture
def residual_chunks():
    """Counts the chunks ``ResidualDW`` summed."""
    calls = {"add": 0}
    real = ResidualDW.add

    def spy(self, *args):
        calls["add"] += 1
        return real(self, *args)

    with mock.patch.object(ResidualDW, "add", spy):
        yield calls


def reference_grads(hidden, weight, target, reduction="mean", upstream=None):
    h, w = hidden.double().detach().requires_grad_(), weight.double().detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(h @ w.T, target, reduction=reduction)
    (loss if upstream is None else (loss * upstream.double()).sum()).backward()
    return h.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("head", ["epilogue", "tiles"])
def test_engine_sums_chunks_in_the_residual(dtype, reduction, head, residual_on, residual_chunks):
    """Several chunks (a small budget), scalar loss (gradients in forward) and per-token loss (gradients in backward,
    recomputing each chunk), with the logits from the epilogue GEMM or from cuBLAS and the tile passes (whose gradient
    lives in the tail of each float32 logits row): dW comes back in the weight's dtype, summed by ``ResidualDW``."""
    hidden, weight, target, _ = make_inputs(48, 24, 70, ignore_every=4)
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    upstream = None if reduction == "mean" else torch.rand(48, device=DEVICE)
    tiles = resolve_backend("triton", DEVICE)
    with mock.patch.object(tiles, "fused_head", tiles.fused_head if head == "epilogue" else None):
        loss = hf_flce.fused_linear_cross_entropy(
            h, w, target, reduction=reduction, memory_budget=4096, backend="triton"
        )
        (loss if upstream is None else (loss * upstream).sum()).backward()
    assert residual_chunks["add"] >= 3
    assert w.grad.dtype == dtype
    ref_dx, ref_dw = reference_grads(hidden, weight, target, reduction, upstream)
    assert_close(w.grad, ref_dw, 1e-2, "dW")
    assert_close(h.grad, ref_dx, 1e-2, "dX")


def test_engine_keeps_float32_weights_and_single_chunks_off_it(residual_on, residual_chunks):
    hidden, weight, target, _ = make_inputs(48, 24, 70)
    w32 = weight.clone().requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = hf_flce.fused_linear_cross_entropy(hidden, w32, target, memory_budget=4096, backend="triton")
    loss.backward()
    assert w32.grad.dtype == torch.float32  # an fp32 master weight's gradient is its own float32 accumulator
    w16 = weight.bfloat16().requires_grad_()
    # one chunk: one GEMM, nothing summed
    hf_flce.fused_linear_cross_entropy(hidden.bfloat16(), w16, target, backend="triton").backward()
    assert residual_chunks["add"] == 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_benchmarks_lean_provider(reduction, residual_chunks):
    """The benchmarks' ``ours_lean`` wrapper: the call and the backward that follows it sum dW in the residual, while
    the process-wide backend keeps its float32 accumulator."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_common import with_residual_dw

    hidden, weight, target, _ = make_inputs(48, 24, 70, ignore_every=4)
    h = hidden.bfloat16().requires_grad_()
    w = weight.bfloat16().requires_grad_()
    upstream = None if reduction == "mean" else torch.rand(48, device=DEVICE)
    lean = with_residual_dw(hf_flce.fused_linear_cross_entropy)
    loss = lean(h, w, target, reduction=reduction, memory_budget=4096, backend="triton")
    (loss if upstream is None else (loss * upstream).sum()).backward()
    assert residual_chunks["add"] >= 3
    assert resolve_backend("triton", DEVICE).residual_dw is None
    ref_dx, ref_dw = reference_grads(hidden, weight, target, reduction, upstream)
    assert_close(w.grad, ref_dw, 1e-2, "dW")
    assert_close(h.grad, ref_dx, 1e-2, "dX")


def test_chunk_plan_budgets_the_residual():
    """With the residual, the budget covers the chunk buffers and the residual (V H bytes); one chunk when that costs
    no more. With a float32 accumulator the chunks get the whole budget."""
    tiles = resolve_backend("triton", DEVICE)
    plan = engine.CallPlan(tiles, None, "scalar", lambda: None, budget=1000, grad_mode=True)
    weight = torch.empty(40, 10, dtype=torch.bfloat16)  # a 400-byte residual
    # 100 rows of 10 bytes: one chunk needs 1000 bytes, no more than 600-byte chunks plus the residual
    assert engine._plan_rows(plan, 100, 10, 1.0, triton_dw, 400, False) == 100
    # 2000 bytes: chunks of at most 60 rows, balanced
    assert engine._plan_rows(plan, 200, 10, 1.0, triton_dw, 400, False) == 50
    # a residual beyond the budget leaves the chunks a quarter of it
    assert engine._plan_rows(plan, 1000, 10, 1.0, triton_dw, 4000, False) == 25
    # a float32 accumulator: chunks of the whole budget, or one chunk when it costs no more than accumulator + chunk
    assert engine._plan_rows(plan, 1000, 10, 1.0, None, 1600, False) == 100
    assert engine._plan_rows(plan, 200, 10, 1.0, None, 1600, False) == 200
    assert engine._accumulator_bytes(triton_dw, weight, True) == 400
    assert engine._accumulator_bytes(None, weight, True) == 1600
    assert engine._accumulator_bytes(None, weight.float(), True) == 1600
    assert engine._accumulator_bytes(triton_dw, weight, False) == 0
