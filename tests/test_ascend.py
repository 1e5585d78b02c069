"""The Ascend backend: tiling arithmetic, and its Triton kernels run by the Triton interpreter on CPU tensors against
the float64 reference. Kernels on real NPU hardware are covered only by the ``npu`` tests (skipped without one)."""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# The interpreter runs the Ascend kernels on CPU tensors. In a process that also compiles CUDA kernels, importing
# triton under TRITON_INTERPRET=1 turns triton's own helpers into interpreted functions and breaks the compiled ones,
# so on a CUDA machine this module is skipped (the CPU CI runs it).
if torch.cuda.is_available():
    pytest.skip("Ascend interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import hf_flce  # noqa: E402
from hf_flce.backends.ascend import AscendTileOps, kernels, tiling  # noqa: E402
from hf_flce.backends.base import TileParams  # noqa: E402
from hf_flce.backends.torch_tiles import TorchTileOps  # noqa: E402

if type(kernels.forward_kernel).__name__ != "InterpretedFunction":  # imported earlier, compiled for a device
    importlib.reload(kernels)

CPU = torch.device("cpu")
SMALL_UB_BITS = 2048 * 8  # 2 KiB: blocks of 32-64 columns, so V <= 300 takes several blocks
TOL = dict(rtol=2e-5, atol=2e-5)

OPTIONS = {
    "label_smoothing": 0.1,
    "class_weight": None,  # random, drawn per problem
    "z_loss": 1e-2,
    "softcap": 3.0,
    "temperature": 0.7,
    "ignore_index": 3,
    "num_items_in_batch": 29,
    "reduction_sum": None,
    "bias": None,
}


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # backend="ascend" accepts CPU tensors only while interpreting


@pytest.fixture
def small_ub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tiling.UB_ENV, str(SMALL_UB_BITS))
    monkeypatch.setenv(tiling.CORES_ENV, "3")  # each program walks several rows


# --- tiling -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ub_kib", [1, 2, 16, 192, 248, 256])
@pytest.mark.parametrize("kernel_variant", sorted(tiling.BYTES_PER_ELEMENT))
@pytest.mark.parametrize("vocab", [1, 7, 300, 32000, 151936])
def test_block_fits_ub(ub_kib, kernel_variant, vocab):
    ub = ub_kib * 1024
    per_element = tiling.BYTES_PER_ELEMENT[kernel_variant]
    block = tiling.block_size(vocab, ub, per_element)
    assert block & (block - 1) == 0 and block >= tiling.MIN_BLOCK
    assert per_element * block <= ub * tiling.UB_MARGIN
    # Either the whole row fits in one block, or the next power of two would overflow the budget.
    assert block >= vocab or 2 * block * per_element > ub * tiling.UB_MARGIN or block == tiling.MAX_BLOCK


def test_block_sizes_910b():
    ub = tiling.DEFAULT_UB_BYTES
    assert tiling.block_size(151936, ub, tiling.BYTES_PER_ELEMENT[("forward", True)]) == 4096
    assert tiling.block_size(151936, ub, tiling.BYTES_PER_ELEMENT[("forward", False)]) == 2048
    assert tiling.block_size(151936, ub, tiling.BYTES_PER_ELEMENT[("backward", True)]) == 4096
    assert tiling.block_size(300, ub, 24) == 512  # capped at what the row needs
    # The plain path never gets a smaller block than the full one.
    for kernel in ("forward", "backward"):
        lean, full = (tiling.block_size(10**6, ub, tiling.BYTES_PER_ELEMENT[(kernel, b)]) for b in (True, False))
        assert lean >= full


def test_block_too_small_ub():
    with pytest.raises(ValueError, match="too small"):
        tiling.block_size(100, 64, 48)


@pytest.mark.parametrize("n_rows", [0, 1, 5, 39, 40, 41, 1000, 8193])
@pytest.mark.parametrize("cores", [1, 3, 20, 40, 48])
def test_grid_covers_rows(n_rows, cores):
    programs, per, extra = tiling.grid(n_rows, cores)
    assert programs == min(n_rows, cores)  # one program per vector core while there are rows for it
    starts = [p * per + min(p, extra) for p in range(programs)]
    ranges = [range(start, start + per + (p < extra)) for p, start in enumerate(starts)]
    assert [r for rr in ranges for r in rr] == list(range(n_rows))  # contiguous, disjoint, complete
    if programs:
        assert {len(r) for r in ranges} <= {-(-n_rows // programs), n_rows // programs}  # balanced


def test_device_parameters_from_env(monkeypatch):
    monkeypatch.delenv(tiling.UB_ENV, raising=False)
    monkeypatch.delenv(tiling.CORES_ENV, raising=False)
    assert tiling.ub_capacity_bytes(CPU) == 192 * 1024
    assert tiling.vector_core_count(CPU) == 40
    monkeypatch.setenv(tiling.UB_ENV, str(256 * 1024 * 8))
    monkeypatch.setenv(tiling.CORES_ENV, "48")
    assert tiling.ub_capacity_bytes(CPU) == 256 * 1024
    assert tiling.vector_core_count(CPU) == 48
    launch = tiling.plan_launch("forward", False, 100, 151936, CPU)
    assert launch.block * 48 <= 256 * 1024 * tiling.UB_MARGIN
    assert (launch.programs, launch.rows_per_program, launch.extra_rows) == (48, 2, 4)
    for bad in ("abc", "0", "-8"):
        monkeypatch.setenv(tiling.UB_ENV, bad)
        with pytest.raises(ValueError, match=tiling.UB_ENV):
            tiling.ub_capacity_bytes(CPU)


@pytest.mark.parametrize(
    ("memory_gib", "limit_gib"), [(None, 4), (4, 1), (16, 2), (32, 4), (64, 4), (128, 4), (0.5, 1)]
)
def test_keep_logits_limit(monkeypatch, memory_gib, limit_gib):
    if memory_gib is not None:
        import hf_flce.backends.ascend as ascend

        monkeypatch.setattr(ascend, "_device_memory", lambda device: int(memory_gib * (1 << 30)))
    assert AscendTileOps().keep_logits_limit(CPU) == limit_gib << 30


# --- kernels through the public API -----------------------------------------------------------------------------


def _problem(n: int, v: int, h: int = 16, ignore_index: int = -100, bias: bool = False):
    x = torch.randn(n, h)
    w = torch.randn(v, h) * 0.4
    y = torch.randint(0, v, (n,))
    if n > 2:
        y[1::4] = ignore_index
    b = torch.randn(v) * 0.2 if bias else None
    return x, w, y, b


def _run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, b: torch.Tensor | None, kw: dict, seed_grads: int = 0):
    """Loss, stats and the gradients of hidden / weight / bias for one implementation; the upstream gradients of
    the per-token loss and of logprobs / entropy are random (seeded, so both implementations get the same)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    bias = leaves[2] if b is not None else None
    if "backend" in kw:
        loss, stats = hf_flce.fused_linear_cross_entropy(leaves[0], leaves[1], y, bias, return_stats=True, **kw)
        stats = vars(stats)
    else:
        leaves = [t.double().detach().requires_grad_() for t in leaves]
        bias = leaves[2] if b is not None else None
        loss, stats = hf_flce.reference_linear_cross_entropy(leaves[0], leaves[1], y, bias, **kw)
    gen = torch.Generator().manual_seed(seed_grads)
    objective = (loss.double() * torch.randn(loss.shape, generator=gen, dtype=torch.float64)).sum()
    if seed_grads:
        for name in ("logprobs", "entropy"):
            objective = objective + (stats[name].double() * torch.randn(y.shape, generator=gen).double()).sum()
    objective.backward()
    return loss, stats, [t.grad for t in leaves]


def _check(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, b: torch.Tensor | None = None, seed_grads: int = 0, **kw):
    loss, stats, grads = _run(x, w, y, b, {**kw, "backend": "ascend"}, seed_grads)
    ref_loss, ref_stats, ref_grads = _run(x, w, y, b, kw, seed_grads)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **TOL)
    for name, ref in ref_stats.items():
        if name == "is_top1":
            assert torch.equal(stats[name], ref)
        else:
            torch.testing.assert_close(stats[name].double(), ref.detach(), **TOL, msg=name)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, **TOL)
    return loss, grads


def _option_kwargs(names: tuple[str, ...], v: int) -> tuple[dict, bool]:
    kw: dict = {}
    for name in names:
        if name == "class_weight":
            kw[name] = torch.rand(v) + 0.5
        elif name == "reduction_sum":
            kw["reduction"] = "sum"
        elif name != "bias":
            kw[name] = OPTIONS[name]
    return kw, "bias" in names


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ub", ["npu", "small"])
def test_plain(request, reduction, ub):
    if ub == "small":
        request.getfixturevalue("small_ub")
    _check(*_problem(20, 131), reduction=reduction, seed_grads=3 if reduction == "none" else 0)


PAIRS = [p for p in itertools.combinations(OPTIONS, 2) if p != ("num_items_in_batch", "reduction_sum")]


@pytest.mark.parametrize("names", PAIRS, ids="+".join)
def test_option_pairs(small_ub, names):
    kw, bias = _option_kwargs(names, 50)
    x, w, y, b = _problem(10, 50, ignore_index=kw.get("ignore_index", -100), bias=bias)
    _check(x, w, y, b, **kw)


@pytest.mark.parametrize("ub", ["npu", "small"])
def test_all_options_per_token_and_stat_grads(request, ub):
    if ub == "small":
        request.getfixturevalue("small_ub")
    names = [n for n in OPTIONS if n not in ("num_items_in_batch", "reduction_sum")]
    kw, _ = _option_kwargs(names, 101)
    x, w, y, b = _problem(14, 101, ignore_index=3, bias=True)
    _check(x, w, y, b, reduction="none", seed_grads=7, **kw)
    _check(x, w, y, b, reduction="mean", seed_grads=11, **kw)


@pytest.mark.parametrize(("n", "v"), [(1, 7), (1, 1), (3, 2), (4, 293), (37, 67)])
def test_odd_sizes(small_ub, n, v):
    x, w, y, b = _problem(n, v, bias=True)
    _check(x, w, y, b, seed_grads=5, label_smoothing=0.05)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_and_zero_rows(small_ub, reduction):
    x, w, _, _ = _problem(6, 50)
    y = torch.full((6,), -100)
    loss, grads = _check(x, w, y, reduction=reduction, seed_grads=2)
    assert not loss.any() and all(not g.any() for g in grads)
    loss, grads = _check(x[:0], w, y[:0], reduction=reduction, seed_grads=2)
    assert loss.numel() in (0, 1) and not loss.any() and grads[1].abs().sum() == 0


def test_bfloat16_grad_buffer(small_ub):
    # 16-bit inputs: the kernel writes the logits gradient into a bf16 buffer, as the torch backend does.
    x, w, y, _ = _problem(9, 70)
    results = []
    for backend in ("ascend", "torch"):
        xb, wb = (t.bfloat16().requires_grad_() for t in (x, w))
        loss = hf_flce.fused_linear_cross_entropy(xb, wb, y, backend=backend)
        loss.backward()
        results.append((loss, xb.grad, wb.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


# --- kernels at the tile level: ignored rows kept, in-place gradients, argmax ties ------------------------------


def _params(v: int, **kw) -> TileParams:
    cw = kw.pop("class_weight", None)
    base = dict(label_smoothing=0.0, z_loss=0.0, softcap=None, inv_temperature=1.0)
    return TileParams(
        vocab=v, ignore_index=-100, class_weight=cw, class_weight_sum=None if cw is None else cw.sum(), **base | kw
    )


@pytest.mark.parametrize("full", [False, True])
def test_tiles_match_torch_in_place(small_ub, full):
    v = 83
    extra = dict(label_smoothing=0.2, z_loss=0.01, softcap=4.0, inv_temperature=1.3, class_weight=torch.rand(v) + 0.5)
    params = _params(v, **(extra if full else {}))
    logits = torch.randn(12, v) * 3
    target = torch.randint(0, v, (12,))
    target[::3] = -100  # not compacted: the kernels must zero these rows themselves
    ours, torch_ops = AscendTileOps(), TorchTileOps()
    scale = torch.full((12,), 0.25)
    buf = logits.clone()
    got = ours.forward(buf, target, params, grad_scale=scale, grad_out=buf)  # gradient written over the logits
    want_grad = torch.empty_like(logits)
    want = torch_ops.forward(logits.clone(), target, params, grad_scale=scale, grad_out=want_grad)
    for name in ("loss", "lse", "logprob", "entropy", "mean_logit", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got.is_top1, want.is_top1)
    torch.testing.assert_close(buf, want_grad, rtol=1e-5, atol=1e-6)
    assert not buf[::3].any()

    upstream = [torch.randn(12) for _ in range(3)]
    buf = logits.clone()
    ours.backward(buf, target, got.lse, got.entropy, params, *upstream, grad_out=buf)
    torch_ops.backward(logits.clone(), target, want.lse, want.entropy, params, *upstream, grad_out=want_grad)
    torch.testing.assert_close(buf, want_grad, rtol=1e-5, atol=1e-6)
    assert not buf[::3].any()


def test_backward_over_a_vocabulary_chunk(small_ub):
    """Columns ``first_column:`` of a row: the one-hot entry and class weights placed by the offset, as the torch
    pass places them; a chunk past the vocabulary raises."""
    v, first = 83, 40
    params = _params(v, label_smoothing=0.2, z_loss=0.01, softcap=4.0, class_weight=torch.rand(v) + 0.5)
    logits = torch.randn(12, v) * 3
    target = torch.randint(0, v, (12,))
    target[::3] = -100
    target[1], target[2] = first, first - 1  # the one-hot entry on either side of the chunk's first column
    stats = TorchTileOps().forward(logits, target, params)
    upstream = [torch.randn(12) for _ in range(3)]
    chunk = logits[:, first:].contiguous()
    got, want = torch.empty_like(chunk), torch.empty_like(chunk)
    AscendTileOps().backward(
        chunk, target, stats.lse, stats.entropy, params, *upstream, grad_out=got, first_column=first
    )
    TorchTileOps().backward(
        chunk, target, stats.lse, stats.entropy, params, *upstream, grad_out=want, first_column=first
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pass the vocabulary"):
        AscendTileOps().backward(
            chunk, target, stats.lse, stats.entropy, params, *upstream, got, first_column=first + 1
        )


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("full", [False, True])
def test_target_column_apart_matches_torch(small_ub, full, grad_dtype):
    """``forward_target_apart``: the statistics and gradient of ``forward``, with each row's target column 0 in the
    gradient and its value in float32 apart, as the torch backend gives them; ignored rows give 0 there too."""
    v = 211
    extra = dict(label_smoothing=0.2, z_loss=0.01, softcap=4.0, inv_temperature=1.3, class_weight=torch.rand(v) + 0.5)
    params = _params(v, **(extra if full else {}))
    logits = torch.randn(13, v) * 3
    target = torch.randint(0, v, (13,))
    target[::4] = -100
    target[1], target[2], target[3] = 0, v - 1, 64  # first and last columns, a block's first
    scale = torch.rand(13) + 0.5
    results = []
    for ops in (AscendTileOps(), TorchTileOps()):
        grad = torch.empty(logits.shape, dtype=grad_dtype)
        stats, apart = ops.forward_target_apart(logits.clone(), target, params, scale, grad)
        assert apart.e is grad and apart.target_coef.dtype == torch.float32
        results.append((stats, apart))
    (got, got_apart), (want, want_apart) = results
    for name in ("loss", "lse", "logprob", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)
    tol = dict(rtol=1e-5, atol=1e-6) if grad_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(got_apart.e, want_apart.e, **tol)
    torch.testing.assert_close(got_apart.target_coef, want_apart.target_coef, rtol=1e-5, atol=1e-6)
    kept = target != -100
    assert not got_apart.e[kept].gather(1, target[kept, None]).any()
    assert not got_apart.e[~kept].any() and not got_apart.target_coef[~kept].any()
    full_grad = torch.empty_like(logits)
    AscendTileOps().forward(logits.clone(), target, params, scale, full_grad)
    at_target = full_grad[kept].gather(1, target[kept, None]).squeeze(1)
    torch.testing.assert_close(got_apart.target_coef[kept], at_target, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("names", [(), ("label_smoothing", "z_loss", "softcap", "temperature", "class_weight")])
def test_bfloat16_chunks_sum_dw_in_the_gradient_with_the_target_column_apart(small_ub, names):
    """A bf16 scalar loss in several chunks takes its gradient with the target column apart: dW is summed in the
    bf16 gradient (no float32 ``[V, H]`` sum, no ``dw_product``), each target row's float32 term added once. Its
    results are the torch backend's, which takes the same path, to within bf16 rounding."""
    from unittest import mock

    from hf_flce import engine

    torch.manual_seed(3)
    n, v = 96, 211
    kw, _ = _option_kwargs(names, v)
    x, w, y, _ = _problem(n, v)
    x, w = x.bfloat16(), (w * 0.5).bfloat16()
    results = {}
    for backend in ("ascend", "torch"):
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        spy = mock.patch.object(
            AscendTileOps, "forward_target_apart", autospec=True, side_effect=AscendTileOps.forward_target_apart
        )
        no_fp32_sum = mock.patch.object(engine, "dw_product", side_effect=AssertionError("a float32 dW sum"))
        gemms = mock.patch.object(engine, "compute_logits", wraps=engine.compute_logits)
        with spy as apart, no_fp32_sum, gemms as chunks:
            loss = hf_flce.fused_linear_cross_entropy(xo, wo, y, backend=backend, memory_budget=12 * v * 8, **kw)
            loss.backward()
        if backend == "ascend":
            assert chunks.call_count >= 4 and apart.call_count == chunks.call_count
        results[backend] = (loss.detach(), xo.grad, wo.grad)
    assert results["ascend"][2].dtype == torch.bfloat16
    torch.testing.assert_close(results["ascend"][0], results["torch"][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results["ascend"][1:], results["torch"][1:]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
        assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm()


def test_is_top1_first_argmax_across_blocks(small_ub):
    v = 200
    logits = torch.zeros(4, v)
    logits[:, 5] = logits[:, 150] = 2.0  # tied maximum in different blocks
    target = torch.tensor([5, 150, 0, -100])
    stats = AscendTileOps().forward(logits, target, _params(v))
    assert stats.is_top1.tolist() == [True, False, False, False]


# --- real hardware ----------------------------------------------------------------------------------------------


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available() and torch.npu.device_count() > 0
    except Exception:
        return False


_NPU_SCRIPT = textwrap.dedent(
    """
    import torch, torch_npu, hf_flce
    from hf_flce.backends.ascend import tiling
    dev = torch.device("npu:0")
    assert tiling.ub_capacity_bytes(dev) >= 128 * 1024 and tiling.vector_core_count(dev) > 0
    torch.manual_seed(0)
    for kw in ({}, dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0, temperature=0.8), dict(reduction="none")):
        x, w = torch.randn(300, 64), torch.randn(32003, 64) * 0.1
        y = torch.randint(0, 32003, (300,)); y[::7] = -100
        xn, wn = (t.to(dev).requires_grad_() for t in (x, w))
        loss, stats = hf_flce.fused_linear_cross_entropy(xn, wn, y.to(dev), backend="ascend", return_stats=True, **kw)
        loss.sum().backward()
        xr, wr = (t.double().requires_grad_() for t in (x, w))
        ref, rs = hf_flce.reference_linear_cross_entropy(xr, wr, y, **kw)
        ref.sum().backward()
        torch.testing.assert_close(loss.cpu().double(), ref.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stats.entropy.cpu().double(), rs["entropy"].detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(xn.grad.cpu().double(), xr.grad, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(wn.grad.cpu().double(), wr.grad, rtol=1e-3, atol=1e-4)
    # bf16 in four chunks: dW summed in the bf16 gradient, the target column apart
    xb, wb = (t.bfloat16().to(dev).requires_grad_() for t in (x, w))
    hf_flce.fused_linear_cross_entropy(xb, wb, y.to(dev), backend="ascend", memory_budget=56 * 32003 * 8).backward()
    xr, wr = (t.bfloat16().double().requires_grad_() for t in (x, w))
    hf_flce.reference_linear_cross_entropy(xr, wr, y)[0].backward()
    for got, want in ((xb.grad, xr.grad), (wb.grad, wr.grad)):
        assert got.dtype == torch.bfloat16 and ((got.cpu().double() - want).norm() / want.norm()).item() < 1e-2
    print("ok")
    """
)


@pytest.mark.npu
@pytest.mark.skipif(not _npu_available(), reason="needs torch_npu and an Ascend NPU")
def test_npu_hardware():
    # A fresh process: this module forces the Triton interpreter, the hardware run must compile for the NPU.
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _NPU_SCRIPT], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-4000:]
