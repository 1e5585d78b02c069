"""The scalar loss's gradient as ``E`` and row scales (``hf_flce/backends/triton_scaled.py``) against the float64
reference and against the gradient pass it replaces (``HF_FLCE_SCALED_GRAD=0``), on bf16 inputs.

Without a GPU the kernels run in the Triton interpreter (conftest sets it).
"""

import contextlib
import os
from unittest import mock

import pytest
import torch
from test_triton_backend import DEVICE, build, check, make_inputs, rel_err
from test_triton_backend import float64_grads as reference_grads
from test_triton_gemm import epilogue_on, params_for  # noqa: F401 (autouse: the epilogue path on every device)

import hf_flce
from hf_flce import engine
from hf_flce.backends import triton_gemm, triton_scaled


@pytest.fixture
def scaled_calls():
    """How many chunks took the scaled gradient (the tests check that the engine did)."""
    calls = {"chunks": 0}
    real = triton_scaled.row_scales

    def spy(*args, **kwargs):
        calls["chunks"] += 1
        return real(*args, **kwargs)

    with mock.patch.object(triton_scaled, "row_scales", spy):
        yield calls


def grads(hidden, weight, target, scaled, upstream=1.0, column_apart=False, **opts):
    """Loss and the gradients of hidden and weight, with the scaled gradient on, or off with the gradient pass it
    replaces: the column-in one (``HF_FLCE_TARGET_APART=0``; since v50 that pass can carry the target column in
    float32 too), the baseline the scaled gradient's errors are held to, or with ``column_apart`` that v50 pass
    (its dW summed in the 16-bit gradient across chunks, as the scaled gradient's)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    apart = "1" if column_apart else "0"
    env = {"HF_FLCE_SCALED_GRAD": "1"} if scaled else {"HF_FLCE_SCALED_GRAD": "0", "HF_FLCE_TARGET_APART": apart}
    with mock.patch.dict(os.environ, env):
        loss = hf_flce.fused_linear_cross_entropy(*leaves, target, backend="triton", **opts)
        (loss * upstream).backward()
    return loss.detach(), leaves[0].grad, leaves[1].grad


# The interpreter casts float32 to bf16 by truncation (a GPU rounds to nearest, and Triton's rounding option is ignored
# there): E's relative error is then up to 2**-7, twice the GPU's, and a one-chunk dW's target rows, rounded once
# by the GEMM and once more after their float32 term, are biased. The GPU run holds the tight margins.
INTERPRETED = DEVICE.type != "cuda"


def scaled_row_bytes(v: int, h: int) -> int:
    """What a bf16 scalar loss's chunk takes per row: E and the partial statistics, and its ``[rows, H]`` buffers."""
    return int(v * triton_gemm.bytes_per_logit(v, params_for(v, stats=frozenset())) + engine._scaled_row_bytes(h, 2))


def assert_no_worse(hidden, weight, target, margin=1.1, interpreted_margin=2.0, column_apart=False, **opts):
    """The scaled gradient's errors against float64 are within ``margin`` of the gradient pass's (both round the
    gradient to bf16 once; on a GPU the scaled one should be the smaller, its target column being exact); with
    ``column_apart``, of v50's pass (``grads``)."""
    margin = max(margin, interpreted_margin) if INTERPRETED else margin
    ref = reference_grads(hidden, weight, target, **opts)
    new = grads(hidden, weight, target, True, **opts)
    old = grads(hidden, weight, target, False, column_apart=column_apart, **opts)
    torch.testing.assert_close(new[0].double(), ref[0], rtol=1e-5, atol=1e-5)
    for name, n, o, r in zip(("dX", "dW"), new[1:], old[1:], ref[1:]):
        assert torch.isfinite(n).all(), name
        assert n.dtype == o.dtype, name
        assert rel_err(n, r) <= margin * rel_err(o, r) + 1e-4, (name, rel_err(n, r), rel_err(o, r))
    return new


# label smoothing strong enough that its uniform term is most of each off-target gradient
SMOOTHED = dict(label_smoothing=0.6, z_loss=1e-3, temperature=0.8)
NAMES = [
    (),
    ("z_loss",),
    ("temperature",),
    ("softcap",),
    ("softcap", "z_loss", "temperature"),
    ("smoothing",),
    ("smoothing", "z_loss", "temperature"),
]


@pytest.fixture(params=["1", "0"], ids=["row-reference", "tile-max"])
def row_reference(request):
    """The GEMM's sums against the row's t_y + REF_OFFSET (the default) or against each tile's max."""
    with mock.patch.dict(os.environ, {"HF_FLCE_ROW_REFERENCE": request.param}):
        yield request.param


@pytest.fixture(params=["in-gradient", "fp32-split", "fp32-whole"])
def dw_sum(request):
    """How a 16-bit dW is summed over chunks: in the gradient itself (the default), or in float32
    (``HF_FLCE_DW_FP32_SUM=1``) as two row blocks (``engine._SplitDWSum``, its target rows added into both by one
    launch) or as one accumulator."""
    fp32 = "1" if request.param.startswith("fp32") else "0"
    split = request.param == "fp32-split"
    with (
        mock.patch.dict(os.environ, {"HF_FLCE_DW_FP32_SUM": fp32}),
        mock.patch.object(engine._SplitDWSum, "lowers_the_peak", staticmethod(lambda *args: split)),
    ):
        yield request.param


@pytest.mark.parametrize("names", NAMES, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize("budget", [None, 8192], ids=["one-chunk", "chunks"])
def test_matches_reference(names, budget, row_reference, scaled_calls, dw_sum):
    hidden, weight, target, _, opts = build(names, n=60, v=300, ignore_every=4)
    assert_no_worse(hidden.bfloat16(), weight.bfloat16(), target, memory_budget=budget, **opts)
    assert scaled_calls["chunks"] >= (3 if budget else 1)


@pytest.mark.parametrize("peaked", [False, True], ids=["flat", "peaked"])
def test_target_column_in_float32(peaked, scaled_calls):
    """The target column is carried exactly, so peaked rows (p_y near 1, G_y = p_y - 1 tiny) keep their accuracy."""
    hidden, weight, target, _ = make_inputs(48, 32, 200, ignore_every=0)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    if peaked:
        # make each row's target the clear maximum: add its weight row to the hidden row
        hidden = (hidden.float() + 3.0 * weight.float()[target]).bfloat16()
    assert_no_worse(hidden, weight, target, margin=1.0)
    assert scaled_calls["chunks"] == 1


@pytest.mark.parametrize("names", [(), ("softcap", "z_loss", "temperature")], ids=["plain", "softcap+z+temp"])
def test_every_row_recomputed(names, row_reference, scaled_calls):
    """Rows whose loss exceeds REPAIR_ABOVE nats get E recomputed against their lse: here every row, by a negative
    threshold."""
    hidden, weight, target, _, opts = build(names, n=24, v=150, ignore_every=5)
    with mock.patch.object(triton_scaled, "REPAIR_ABOVE", -1.0):
        assert_no_worse(hidden.bfloat16(), weight.bfloat16(), target, **opts)
    assert scaled_calls["chunks"] == 1


def test_rows_past_the_range_are_recomputed(row_reference, scaled_calls):
    """Rows with logits of hundreds and their least likely class as target: a loss far past REPAIR_ABOVE, where E
    against t_y would overflow (with the row reference, the GEMM's sums overflow too, and the lse is recomputed)."""
    hidden, weight, target, _ = make_inputs(24, 16, 150, ignore_every=5)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    hidden[:6] *= 60.0
    logits = hidden[:6].double() @ weight.double().T
    target = target.clone()
    target[:6] = logits.argmin(1)
    assert (torch.logsumexp(logits, 1) - logits.min(1).values > 2 * triton_scaled.REPAIR_ABOVE).all()
    # those rows' E is p itself, ~1 at their argmax: truncated to 1 - 2**-8 by the interpreter
    # (six rows dominate this dW: one rounding more or less there shows; the GPU run measured 1.16x)
    assert_no_worse(hidden, weight, target, margin=1.3, interpreted_margin=3.0)
    assert scaled_calls["chunks"] == 1


def test_repeated_targets_sum_in_a_fixed_order(scaled_calls, dw_sum):
    """Many rows sharing a target (runs longer than the correction kernel's block, and one run per chunk border):
    dW's target rows are right, and two calls give identical bits. One of the targets is in dW's second row block
    when it is split. Summed in the 16-bit gradient over these 9 chunks, dW's error is up to 1.4x the float32 sum's
    (H100 and a CPU emulation): with V = 64 and three targets, most of dW's rows are softmax terms alone, which
    those sums round once per chunk."""
    hidden, weight, target, _ = make_inputs(150, 16, 64, ignore_every=7)
    position = torch.arange(150, device=DEVICE) % 3
    target = torch.where(target == -100, target, torch.where(position == 0, 5, torch.where(position == 1, 40, 9)))
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    margin = 1.5 if dw_sum == "in-gradient" else 1.1
    first = assert_no_worse(hidden, weight, target, margin=margin, memory_budget=4096)
    second = grads(hidden, weight, target, True, memory_budget=4096)
    assert torch.equal(first[2], second[2]) and torch.equal(first[1], second[1])
    assert scaled_calls["chunks"] >= 2


def calibrated_inputs(n, h, v, seed=4):
    """bf16 inputs whose targets are drawn from the softmax, as a trained model's are."""
    hidden, weight, _, _ = make_inputs(n, h, v, ignore_every=0, seed=seed)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    probs = torch.softmax(hidden.double() @ weight.double().T, -1)
    target = torch.multinomial(probs.float().cpu(), 1, generator=torch.Generator().manual_seed(seed + 1)).squeeze(1)
    return hidden, weight, target.to(DEVICE)


@contextlib.contextmanager
def frequent_classes(count, min_chunks=2):
    """``count`` of the most frequent target classes' dW rows summed in float32 (``engine._FrequentClassRows``) from
    ``min_chunks`` chunks on. The budget is not cut for those rows (``engine._plan_rows_beside``), so that calls
    with any count take the same chunks and their sums compare bit for bit."""
    with (
        mock.patch.dict(os.environ, {engine._FrequentClassRows.COUNT_ENV: str(count)}),
        mock.patch.object(engine._FrequentClassRows, "MIN_CHUNKS", min_chunks),
        mock.patch.object(engine._FrequentClassRows, "bytes_beside", lambda weight, used: 0),
    ):
        yield


@pytest.mark.parametrize("calibrated", [False, True], ids=["random-targets", "calibrated"])
def test_dw_summed_in_the_16bit_gradient(calibrated, scaled_calls):
    """Across 8 chunks a bf16 dW is summed in the gradient itself: no float32 ``[V, H]`` sum is made (``dw_product``
    is not called), and the target column is added in float32 once per call. Its error against float64 stays near
    the float32 sum's (``HF_FLCE_DW_FP32_SUM=1``): within 1.25x with random targets, 1.5x with targets drawn from the
    softmax. Those sums round dW's softmax part once per chunk; at V = 300 it carries more of dW than at an LLM's
    vocabulary, where the benchmark's dW error is the float32 sum's (H100: 1.16x here, the same in a CPU emulation of
    the rounding; ``scripts/dw_accumulation_error.py``). No row is taken out of the 16-bit sum here (at V = 300 the
    default would take every one, ``test_frequent_classes_summed_in_float32``)."""
    n, h, v = 160, 32, 300
    if calibrated:
        hidden, weight, target = calibrated_inputs(n, h, v)
    else:
        hidden, weight, target, _ = make_inputs(n, h, v, ignore_every=0, seed=4)
        hidden, weight = hidden.bfloat16(), weight.bfloat16()
    budget = 20 * scaled_row_bytes(v, h)
    ref = reference_grads(hidden, weight, target)[2]
    with (
        frequent_classes(0),
        mock.patch.object(engine, "dw_product", side_effect=AssertionError("a float32 dW sum")),
    ):
        dw = grads(hidden, weight, target, True, memory_budget=budget)[2]
    assert scaled_calls["chunks"] == 8 and dw.dtype == torch.bfloat16
    with mock.patch.dict(os.environ, {"HF_FLCE_DW_FP32_SUM": "1"}):
        dw_fp32_sum = grads(hidden, weight, target, True, memory_budget=budget)[2]
    margin = 1.5 if calibrated else 1.25
    assert rel_err(dw, ref) <= margin * rel_err(dw_fp32_sum, ref), (rel_err(dw, ref), rel_err(dw_fp32_sum, ref))


@pytest.mark.parametrize("ignored", [0, 5], ids=["all-kept", "every-5th-ignored"])
@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "not-compacted"])
def test_frequent_classes_summed_in_float32(ignored, compact, scaled_calls):
    """With targets drawn from the softmax, the dW rows of the most frequent target classes are summed across the 8
    chunks (7 where rows are dropped) in float32 with their target terms: they are the float32 sum's rows
    (``HF_FLCE_DW_FP32_SUM=1``) up to the order of the float32 additions, the other rows are the plain 16-bit sum's
    bit for bit, and dW's error against float64 is no larger than that sum's. With every class taken, dW is the
    float32 sum's. Below ``MIN_CHUNKS`` chunks nothing is taken out of the 16-bit sum."""
    n, h, v = 160, 32, 300
    hidden, weight, target = calibrated_inputs(n, h, v, seed=6)
    if ignored:
        target[::ignored] = -100
    counts = torch.bincount(target[target >= 0].cpu(), minlength=v).sort(descending=True)
    # the most frequent classes up to a count that the next class does not tie
    count = max(i for i in range(4, 40) if counts.values[i - 1] > counts.values[i])
    frequent = counts.indices[:count].to(DEVICE)
    budget = 20 * scaled_row_bytes(v, h)
    kept = contextlib.nullcontext() if compact else mock.patch.object(engine, "_can_compact", lambda device: False)
    ref = reference_grads(hidden, weight, target)[2]
    with kept:
        with frequent_classes(count):
            dw = grads(hidden, weight, target, True, memory_budget=budget)[2]
        with frequent_classes(0):
            dw_16bit_sum = grads(hidden, weight, target, True, memory_budget=budget)[2]
        with frequent_classes(v):
            dw_every_class = grads(hidden, weight, target, True, memory_budget=budget)[2]
        with mock.patch.dict(os.environ, {"HF_FLCE_DW_FP32_SUM": "1"}):
            dw_fp32_sum = grads(hidden, weight, target, True, memory_budget=budget)[2]
        with frequent_classes(count, min_chunks=9):
            assert torch.equal(grads(hidden, weight, target, True, memory_budget=budget)[2], dw_16bit_sum)
    assert scaled_calls["chunks"] >= 5 * 7  # 7 chunks of the 128 kept rows
    others = torch.ones(v, dtype=torch.bool, device=DEVICE)
    others[frequent] = False
    assert torch.equal(dw[others], dw_16bit_sum[others])
    assert not torch.equal(dw[frequent], dw_16bit_sum[frequent])
    # one bf16 rounding of float32 sums taken in another order
    for got in (dw[frequent], dw_every_class):
        expected = dw_fp32_sum[frequent] if got.shape[0] == count else dw_fp32_sum
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert rel_err(dw, ref) <= rel_err(dw_16bit_sum, ref) * 1.02, (rel_err(dw, ref), rel_err(dw_16bit_sum, ref))


@pytest.mark.parametrize("value", ["-1", "many"])
def test_bad_frequent_class_count_raises(value):
    hidden, weight, target, _ = make_inputs(16, 8, 40, ignore_every=0)
    with (
        mock.patch.dict(os.environ, {engine._FrequentClassRows.COUNT_ENV: value}),
        pytest.raises(ValueError, match="HF_FLCE_DW_FREQUENT_CLASSES must be an integer >= 0"),
    ):
        grads(hidden.bfloat16(), weight.bfloat16(), target, True)


def test_num_items_prob_weighted_and_upstream(scaled_calls):
    hidden, weight, target, _ = make_inputs(40, 16, 130, ignore_every=3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    assert_no_worse(hidden, weight, target, num_items_in_batch=23)
    assert_no_worse(hidden, weight, target, reduction="sum")
    new = grads(hidden, weight, target, True, upstream=0.37)
    old = grads(hidden, weight, target, False, upstream=0.37)
    for n, o in zip(new[1:], old[1:]):
        torch.testing.assert_close(n.float(), o.float(), rtol=0.05, atol=2e-4)
    check(hidden, weight, target, tol=1e-2, grad_tol=3e-2, prob_weighted=True)
    assert scaled_calls["chunks"] >= 4


def test_without_compaction(scaled_calls):
    # under torch.compile or graph capture every row is processed: ignored rows have E = 0 and no scale
    hidden, weight, target, _, opts = build(("temperature",), n=18, v=100, ignore_every=3)
    with mock.patch.object(engine, "_can_compact", return_value=False):
        assert_no_worse(hidden.bfloat16(), weight.bfloat16(), target, **opts)
    assert scaled_calls["chunks"] == 1


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opts", [{}, SMOOTHED], ids=["plain", "smoothing"])
def test_all_ignored_and_one_row(reduction, opts, scaled_calls):
    hidden, weight, target, _ = make_inputs(5, 16, 70, ignore_every=0)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    loss, dx, dw = grads(hidden, weight, torch.full_like(target, -100), True, reduction=reduction, **opts)
    assert loss.item() == 0.0 and not dx.abs().sum() and not dw.abs().sum()
    assert_no_worse(hidden[:1], weight, target[:1], reduction=reduction, **opts)
    assert scaled_calls["chunks"] >= 1


def test_fp32_inputs_under_autocast(scaled_calls):
    """Autocast to bf16: the GEMMs run in bf16 and the gradients come back in the inputs' float32."""
    if DEVICE.type != "cuda":
        pytest.skip("CPU autocast does not take the epilogue path's bf16 operands the same way")
    hidden, weight, target, _ = make_inputs(32, 16, 90)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = hf_flce.fused_linear_cross_entropy(*leaves, target, backend="triton")
    loss.backward()
    ref = reference_grads(hidden, weight, target)
    assert leaves[0].grad.dtype == torch.float32
    assert rel_err(leaves[0].grad, ref[1]) < 2e-2 and rel_err(leaves[1].grad, ref[2]) < 2e-2
    assert scaled_calls["chunks"] == 1


@pytest.mark.parametrize("names, reduction", [(("bias",), "mean"), (("smoothing",), "none")], ids=["bias", "per-token"])
def test_unsupported_options_keep_the_gradient_pass(names, reduction, scaled_calls):
    """A bias, and label smoothing on a per-token loss (whose backward takes no uniform term), keep the gradient pass
    over stored e, or recompute."""
    hidden, weight, target, bias, opts = build(names, n=20, v=100)
    leaves = [None if t is None else t.bfloat16() for t in (hidden, weight, bias)]
    check(*leaves[:2], target, leaves[2], tol=1e-2, grad_tol=3e-2, reduction=reduction, **opts)
    assert scaled_calls["chunks"] == 0


@pytest.mark.parametrize(
    "extra",
    [{}, dict(prob_weighted=True), dict(reduction="sum"), dict(upstream=0.37), dict(every_class_in_float32=True)],
    ids=["mean", "dft", "sum", "upstream", "frequent-rows"],
)
def test_label_smoothing_uniform_term(extra, scaled_calls):
    """Label smoothing's ``-eps/V`` at every column is a rank-one term of the scaled gradient: ``u_i 1^T W`` in dX's
    rows and ``u^T X`` in every dW row, which the dW GEMM adds from rows of ones under ``E`` (also into the rows
    summed in float32, ``_FrequentClassRows``). At ``eps = 0.6`` it is most of each off-target gradient: without it
    dX's or dW's error against float64 grows ten-fold (0.07 against 0.006 in the interpreter), past the bound that
    the errors of v50's pass set, the path this one replaces (both sum dW across chunks in the 16-bit gradient; at
    V = 300 and this ``eps`` that sum's roundings weigh more than the column-in pass's float32 sum, 2.6e-3 against
    2.0e-3 on an H100). The loss takes each row's sum of logits as ``x_i . 1^T W``."""
    hidden, weight, target, _ = make_inputs(60, 16, 300, ignore_every=4)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    opts = dict(SMOOTHED, memory_budget=8192)
    upstream = extra.pop("upstream", 1.0)
    frequent = frequent_classes(300) if extra.pop("every_class_in_float32", False) else contextlib.nullcontext()
    opts.update(extra)
    with frequent:
        if upstream == 1.0:
            assert_no_worse(hidden, weight, target, column_apart=True, **opts)
        else:
            new = grads(hidden, weight, target, True, upstream=upstream, **opts)
            old = grads(hidden, weight, target, False, upstream=upstream, **opts)
            for n, o in zip(new[1:], old[1:]):
                torch.testing.assert_close(n.float(), o.float(), rtol=0.05, atol=2e-4)
    assert scaled_calls["chunks"] >= 3


def test_fp16_keeps_the_gradient_pass(scaled_calls):
    hidden, weight, target, _ = make_inputs(20, 16, 100)
    check(hidden.half(), weight.half(), target, tol=2e-3, grad_tol=1e-2)
    assert scaled_calls["chunks"] == 0


@pytest.mark.parametrize("upstream_rows", [False, True], ids=["0-d", "per-row"])
def test_unit_row_scale_times_upstream(upstream_rows):
    """A gradient with its target column apart and no row scale (``gradient_target_apart``) times an upstream
    gradient scales ``E`` and the target column alike: dW's operand is ``diag(upstream) x``."""
    rows, h = 5, 8
    e = torch.randn(rows, 12, device=DEVICE).bfloat16()
    coef, target = torch.randn(rows, device=DEVICE), torch.randint(0, 12, (rows,), device=DEVICE)
    upstream = torch.rand(rows if upstream_rows else (), device=DEVICE) + 0.5
    scaled = triton_scaled.ScaledGradient(e, None, coef, target, -100).times(upstream)
    assert torch.equal(scaled.row_scale, upstream.expand(rows)) and torch.equal(scaled.target_coef, coef * upstream)
    x = torch.randn(rows, h, device=DEVICE)
    expected = (x * upstream.expand(rows)[:, None]).bfloat16().float()
    assert torch.allclose(scaled.x_operand(x).float(), expected, rtol=1e-2, atol=1e-3)


def test_dw_operands_add_the_uniform_term():
    """``dw_operands`` puts a row of ones under ``E`` (its buffer's spare row) over ``u^T x`` under ``diag(s) x``: one
    GEMM gives ``E^T diag(s) x`` plus ``u^T x`` at every dW row. ``E`` without the spare row is refused."""
    rows, v, h = 6, 10, 8
    gen = torch.Generator().manual_seed(3)
    buffer = torch.randn(rows + 1, v, generator=gen).bfloat16().to(DEVICE)
    e = buffer[:rows]
    scale, coef, uniform = (torch.rand(rows, generator=gen).to(DEVICE) for _ in range(3))
    target = torch.randint(0, v, (rows,), generator=gen).to(DEVICE)
    x = torch.randn(rows, h, generator=gen).to(DEVICE)
    grad = triton_scaled.ScaledGradient(e, scale, coef, target, -100, uniform, torch.zeros(h, device=DEVICE))
    a, b = grad.dw_operands(x)
    assert a.shape == (rows + 1, v) and b.shape == (rows + 1, h) and a.data_ptr() == e.data_ptr()
    assert torch.equal(a[:rows], e) and torch.equal(a[rows], torch.ones_like(a[rows]))
    # each operand row within one bf16 rounding (the interpreter truncates)
    torch.testing.assert_close(b[:rows].float(), scale[:, None] * x, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(b[rows].float(), uniform @ x, rtol=2**-7, atol=1e-6)
    product = a.double().T @ b.double()
    torch.testing.assert_close(product, e.double().T @ b[:rows].double() + b[rows].double(), rtol=1e-12, atol=1e-12)
    without_spare = torch.randn(rows, v, generator=gen).bfloat16().to(DEVICE)
    with pytest.raises(RuntimeError):
        triton_scaled.ScaledGradient(without_spare, scale, coef, target, -100, uniform, grad.w_sum).dw_operands(x)


def test_dx_operand_gives_the_column_sum():
    """Without ``w_sum`` (the tile path's one sweep) dX's GEMM operand is ``E`` over its row of ones, whose product
    row is W's column sum: ``write_dx`` gives ``s (E W) + c W[y] + u 1^T W``, as with ``w_sum`` given (the epilogue
    path's); with it the operand is ``E`` alone."""
    rows, v, h = 6, 10, 8
    gen = torch.Generator().manual_seed(4)
    e = torch.randn(rows + 1, v, generator=gen).bfloat16().to(DEVICE)[:rows]
    scale, coef, uniform = (torch.rand(rows, generator=gen).to(DEVICE) for _ in range(3))
    target = torch.randint(0, v, (rows,), generator=gen).to(DEVICE)
    weight = torch.randn(v, h, generator=gen).bfloat16().to(DEVICE)
    w64 = weight.double()
    expected = scale.double()[:, None] * (e.double() @ w64) + coef.double()[:, None] * w64[target]
    expected += uniform.double()[:, None] * w64.sum(0)
    for w_sum in (None, weight.float().sum(0)):
        grad = triton_scaled.ScaledGradient(e, scale, coef, target, -100, uniform, w_sum)
        operand = grad.dx_operand()
        assert operand.shape == (rows + (w_sum is None), v) and operand.data_ptr() == e.data_ptr()
        dx = torch.empty(rows, h, device=DEVICE)
        grad.write_dx(operand.float() @ weight.float(), weight, dx, None, 0)
        torch.testing.assert_close(dx.double(), expected, rtol=1e-5, atol=1e-5)
        if w_sum is None:
            # the row of ones is written once, for both GEMMs
            assert grad.dw_operands(torch.randn(rows, h, device=DEVICE))[0] is operand


def _launches_and_reads(hidden, weight, target, deferred=True, **opts):
    """``grads`` with the scaled gradient, recording in order each launch of the head GEMM and each time the host
    reads the kept count; with ``deferred``, the compaction that reads it before any launch (``kept_rows``) must not
    run."""
    events = []
    real_launch, real_read_later = triton_gemm._launch_tuned, triton_gemm.read_later

    def launch(*args, **kwargs):
        events.append("gemm")
        return real_launch(*args, **kwargs)

    def read_later(summary):
        read = real_read_later(summary)

        def recorded():
            events.append("read")
            return read()

        return recorded

    forbidden = AssertionError("compaction read the count first")
    with (
        mock.patch.object(triton_gemm, "_launch_tuned", launch),
        mock.patch.object(triton_gemm, "read_later", read_later),
        mock.patch.object(engine, "kept_rows", side_effect=forbidden) if deferred else contextlib.nullcontext(),
    ):
        result = grads(hidden, weight, target, True, **opts)
    return events, result


@pytest.mark.parametrize(
    "kept",
    [
        "all",
        "fewer than the first chunk",
        "one past the first chunk",
        "a chunk fewer than the first's size takes",
        "none",
    ],
)
def test_first_chunk_is_launched_before_the_kept_count_is_read(kept, scaled_calls):
    """The first chunk's GEMM reads the kept count from device memory, so the host reads it only once that GEMM is
    launched. The first chunk is planned as if every row were kept (48 rows at up to 11 per chunk: 5 chunks of 10),
    the rest of the call from the count, in as few chunks as the budget allows: 33 rows after the first take 3
    chunks of 11, where chunks of the first's size would take 4."""
    n, v, most = 48, 120, 11
    hidden, weight, target, _ = make_inputs(n, 16, v, ignore_every=0)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    row_bytes = scaled_row_bytes(v, 16)
    budget = most * row_bytes + row_bytes // 2  # sized by the budget, not by the accumulator rule
    first = -(-n // -(-n // most))
    positions = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    keep = {
        "all": n,
        "fewer than the first chunk": first - 3,
        "one past the first chunk": first + 1,
        "a chunk fewer than the first's size takes": first + 3 * most,
        "none": 0,
    }[kept]
    target = target.clone()
    target[positions[keep:].to(DEVICE)] = -100
    events, (loss, dx, dw) = _launches_and_reads(hidden, weight, target, memory_budget=budget)
    assert events[:2] == ["gemm", "read"] and events.count("read") == 1
    n_chunks = 1 + -(-max(0, keep - first) // most)
    assert events.count("gemm") == n_chunks
    if keep:
        assert scaled_calls["chunks"] == n_chunks
        assert_no_worse(hidden, weight, target, memory_budget=budget)
    else:
        assert loss.item() == 0.0 and not dx.abs().sum() and not dw.abs().sum()


def test_bad_target_raises_after_the_first_launch():
    """A target outside [0, V) is found by the same host read, after the first GEMM's launch (that GEMM saw it as
    ignored); the ValueError names it, and the next call is unaffected."""
    hidden, weight, target, _ = make_inputs(30, 16, 90)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    for bad in (90, -7):
        wrong = target.clone()
        wrong[4] = bad
        with pytest.raises(ValueError, match=f"target contains {bad}, outside \\[0, V=90\\)"):
            _launches_and_reads(hidden, weight, wrong)
    assert_no_worse(hidden, weight, target)


@pytest.mark.parametrize("fp32_sum", [True, False], ids=["fp32-sum", "sum-in-dw"])
def test_one_chunk_taken_for_the_accumulator_reads_the_count_first(fp32_sum, scaled_calls):
    """With a float32 dW sum (``HF_FLCE_DW_FP32_SUM=1``), where one chunk is taken for costing less than the
    accumulator several would need (not for fitting the budget), sizing it by every row could spend up to that
    accumulator more: the count is read first there. Summed in the 16-bit gradient, dW needs no accumulator: the same
    budget takes several chunks, the first launched before the count is read."""
    n, h, v = 48, 16, 120
    hidden, weight, target, _ = make_inputs(n, h, v, ignore_every=3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    row_bytes = scaled_row_bytes(v, h)
    budget = n * row_bytes - 4 * v * h // 2  # every row: over the budget, within budget + accumulator
    with (
        mock.patch.dict(os.environ, {"HF_FLCE_DW_FP32_SUM": "1" if fp32_sum else "0"}),
        mock.patch.object(engine, "kept_rows", wraps=engine.kept_rows) as compaction,
    ):
        events, _ = _launches_and_reads(hidden, weight, target, deferred=not fp32_sum, memory_budget=budget)
        if fp32_sum:
            assert compaction.called and scaled_calls["chunks"] == 1
            assert events == ["read", "gemm"]
        else:
            assert scaled_calls["chunks"] == 2
            assert events == ["gemm", "read", "gemm"]
        assert_no_worse(hidden, weight, target, memory_budget=budget)
