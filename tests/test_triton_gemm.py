"""The GEMM-epilogue path (``hf_flce/backends/triton_gemm.py``) against the float64 reference.

It serves 16-bit calls without class weights, nor softcap with label smoothing. Through the public API, every strategy
of the engine that uses it is covered: the scalar loss (gradient from the stored ``e`` during forward), the per-token
loss with ``e`` kept for backward, and the per-token loss whose backward recomputes the GEMM with the gradient in its
epilogue.
Without a GPU the kernels run in the Triton interpreter (conftest sets it), with fp32 tile products.
"""

import warnings
from unittest import mock

import pytest
import torch
from test_triton_backend import (
    DEVICE,
    assert_close,
    build,
    check,
    check_frequent_classes,
    check_target_apart,
    check_target_apart_edge_case,
    make_inputs,
    rel_err,
    target_apart_calls,
)

import hf_flce
from hf_flce import engine
from hf_flce.backends import resolve_backend, triton_gemm, triton_scaled
from hf_flce.backends.base import OPTIONAL_STATS, TileParams
from hf_flce.backends.torch_tiles import TorchTileOps
from hf_flce.backends.triton_tiles import TritonTileOps

FUSABLE = [
    (),
    ("smoothing",),
    ("z_loss",),
    ("temperature",),
    ("bias",),
    ("softcap",),
    ("smoothing", "z_loss", "temperature", "bias"),
    ("softcap", "z_loss", "temperature", "bias"),
]
# fp16 gradients: the stored e carries 11 bits, the gradient itself 11, and CPU fp16 GEMMs round their products
TOL, GRAD_TOL = 2e-3, 1e-2


@pytest.fixture(autouse=True)
def epilogue_on():
    """By default the path serves Hopper and newer GPUs only: switch it on for every device (the interpreter too),
    as ``HF_FLCE_GEMM_EPILOGUE=1`` does, for the backend the public API resolves to."""
    tiles = resolve_backend("triton", DEVICE)
    with mock.patch.object(tiles, "fused_head", triton_gemm), mock.patch.object(tiles, "gemm_min_capability", 0):
        yield


@pytest.fixture
def fused_calls():
    """Counts the epilogue path's entry points (the tests check that the engine took it)."""
    calls = {"forward": 0, "gradient": 0, "recompute_gradient": 0}

    def spy(name):
        real = getattr(triton_gemm, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    with mock.patch.multiple(triton_gemm, **{name: spy(name) for name in calls}):
        yield calls


def half(hidden, weight, bias, dtype=torch.float16):
    return [None if t is None else t.to(dtype) for t in (hidden, weight, bias)]


@pytest.mark.parametrize("names", FUSABLE, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize(
    "reduction, budget, path",
    [
        ("mean", None, "eager"),
        ("mean", 8192, "eager"),
        ("none", None, "kept"),
        ("none", 8192, "recompute-columns"),
        ("none", 8192, "recompute-rows"),
    ],
    ids=["mean", "mean-chunks", "none-kept", "none-recompute-columns", "none-recompute-rows"],
)
def test_engine_paths(names, reduction, budget, path, fused_calls, monkeypatch):
    if path == "recompute-rows":
        monkeypatch.setenv("HF_FLCE_VOCAB_CHUNKS", "0")
    hidden, weight, target, bias, opts = build(names, n=60, v=300)
    check(
        *half(hidden, weight, bias)[:2],
        target,
        half(hidden, weight, bias)[2],
        tol=TOL,
        grad_tol=GRAD_TOL,
        stat_grads=reduction == "none",
        reduction=reduction,
        memory_budget=budget,
        **opts,
    )
    # a forward that keeps nothing for backward holds only the partial statistics: one chunk fits that budget
    assert fused_calls["forward"] >= (3 if budget and path == "eager" else 1)
    if path == "recompute-columns":
        # 300 classes in chunks of 256 columns, every kept row in each
        assert fused_calls["recompute_gradient"] == 2 and fused_calls["gradient"] == 0
    elif path == "recompute-rows":
        assert fused_calls["recompute_gradient"] >= 3 and fused_calls["gradient"] == 0
    else:
        assert fused_calls["gradient"] >= 1 and fused_calls["recompute_gradient"] == 0


def test_bf16_and_num_items(fused_calls):
    hidden, weight, target, bias, opts = build(("smoothing", "bias"), n=16)
    h, w, b = half(hidden, weight, bias, torch.bfloat16)
    check(h, w, target, b, tol=1e-2, grad_tol=3e-2, num_items_in_batch=11, **opts)
    assert fused_calls["forward"] == 1


@pytest.mark.parametrize(
    "n, v, ignore_every",
    [(1, 257, 0), (2, 1, 0), (9, 33, 4), (16, 64, 3), (7, 31, 0)],
    ids=["one-token", "one-class", "ragged-tile", "exact-tiles", "v-below-one-tile"],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_odd_sizes(n, v, ignore_every, reduction, fused_calls):
    hidden, weight, target, bias, opts = build(("smoothing", "bias"), n=n, v=v, ignore_every=ignore_every)
    h, w, b = half(hidden, weight, bias)
    check(h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, reduction=reduction, **opts)
    assert fused_calls["forward"] == 1


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    hidden, weight, target, bias, opts = build(("z_loss",), n=6)
    target = torch.full_like(target, -100)
    h, w, b = half(hidden, weight, bias)
    loss, stats, leaves = check(h, w, target, b, stat_grads=True, reduction=reduction, **opts)
    assert not loss.abs().sum() and not stats["is_top1"].any()
    assert torch.isfinite(leaves[1].grad).all()
    assert not leaves[0].grad.abs().sum() and not leaves[1].grad.abs().sum()


def test_zero_num_items_in_batch_gives_zero(fused_calls):
    """A zero denominator with kept targets: loss and gradients 0 (stock: inf), the scaled gradient's row scales 0."""
    hidden, weight, target, bias, opts = build(("z_loss",), n=12)
    h, w, b = half(hidden, weight, bias)
    loss, _, leaves = check(h, w, target, b, num_items_in_batch=0, tol=TOL, grad_tol=GRAD_TOL, **opts)
    assert loss.item() == 0 and not leaves[0].grad.abs().sum() and not leaves[1].grad.abs().sum()
    assert fused_calls["forward"] == 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_without_compaction(reduction, fused_calls):
    # Under torch.compile or CUDA graph capture every row is processed: the kernels must zero the ignored ones.
    hidden, weight, target, bias, opts = build(("smoothing", "temperature"), n=18, ignore_every=3)
    h, w, b = half(hidden, weight, bias)
    with mock.patch.object(engine, "_can_compact", return_value=False):
        check(h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, reduction=reduction, **opts)
    assert fused_calls["forward"] == 1


@pytest.mark.parametrize("ignore_every", [0, 3], ids=["none-ignored", "some-ignored"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_strided_targets(ignore_every, reduction, fused_calls):
    # labels[::2] is a view with stride 2; the epilogue GEMM's kernels index targets with unit stride
    hidden, weight, target, bias, opts = build((), n=14, ignore_every=ignore_every)
    wide = torch.full((2 * target.numel(),), 7, dtype=target.dtype, device=target.device)
    wide[::2] = target
    strided = wide[::2]
    assert strided.stride() == (2,) and torch.equal(strided, target)
    h, w, b = half(hidden, weight, bias)
    check(h, w, strided, b, tol=TOL, grad_tol=GRAD_TOL, reduction=reduction, **opts)
    with torch.no_grad():
        loss = hf_flce.fused_linear_cross_entropy(h, w, strided, b, backend="triton", reduction=reduction)
    ref, _ = hf_flce.reference_linear_cross_entropy(h.double(), w.double(), target, reduction=reduction)
    assert_close(loss, ref, TOL, "no-grad loss")
    assert fused_calls["forward"] == 2


@pytest.mark.parametrize("names", FUSABLE, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_grad_call_reads_nothing_on_the_host_before_the_gemm(names, reduction, fused_calls):
    # Without gradients the kept rows go first on the device and the GEMM reads their count there: compaction's host
    # read (kept_rows) is never reached, and the GEMM is told to compute the kept rows only.
    hidden, weight, target, bias, opts = build(names, n=37, v=300, ignore_every=5)
    target[20:31] = -100  # a masked prompt
    h, w, b = half(hidden, weight, bias)
    counts = []
    real_forward = triton_gemm.forward

    def forward(*args, **kwargs):
        counts.append(args[6][0].item())
        return real_forward(*args, **kwargs)

    with (
        torch.no_grad(),
        mock.patch.object(engine, "kept_rows", side_effect=AssertionError("synced before the GEMM")),
        mock.patch.object(triton_gemm, "forward", forward),
    ):
        loss, stats = hf_flce.fused_linear_cross_entropy(
            h, w, target, b, backend="triton", reduction=reduction, return_stats=True, **opts
        )
    ref_loss, ref_stats = hf_flce.reference_linear_cross_entropy(
        *(None if t is None else t.double() for t in (h, w)),
        target,
        None if b is None else b.double(),
        reduction=reduction,
        **opts,
    )
    assert counts == [int((target != -100).sum())]
    assert loss.shape == ref_loss.shape and loss.dtype == torch.float32
    assert_close(loss, ref_loss, TOL, "loss")
    for name in ("logprobs", "entropy", "lse", "mean_logit", "log_sum_sq_probs"):
        assert_close(getattr(stats, name), ref_stats[name], TOL, name)
    assert torch.equal(stats.is_top1.cpu(), ref_stats["is_top1"].cpu())


@pytest.mark.parametrize("n", [1, 7, 4096, 5003])
def test_kept_order_matches_torch(n):
    gen = torch.Generator().manual_seed(n)
    target = torch.randint(0, 50, (n,), generator=gen)
    target[torch.rand(n, generator=gen) < 0.3] = -100
    target[n // 3 : n // 2] = -100  # a prompt-like span
    target = target.to(DEVICE)
    for t in (target, torch.full_like(target, -100), target.clamp(min=0)):
        order, kept, summary = triton_gemm.kept_order(t, -100, 50)
        valid = t != -100
        rows = valid.nonzero().squeeze(1)
        count = rows.numel()
        assert summary[0].item() == count
        assert torch.equal(order[:count], rows) and torch.equal(kept[:count], t[rows])
        assert bool((order[count:] == n - 1).all()) and bool((kept[count:] == -100).all())
        low, high = (t[rows].min().item(), t[rows].max().item()) if count else (0, 0)
        assert summary[1:].tolist() == [min(low, 0), max(high, 0)]
    bad = target.clone()
    bad[n - 1] = 2**40
    assert triton_gemm.kept_order(bad, -100, 50)[2][2].item() == 2**40
    bad[0] = -7
    order, kept, summary = triton_gemm.kept_order(bad, -100, 50)
    assert summary[1].item() == -7
    # out-of-range targets stay counted (the host raises on the summary) but reach no kernel as an index into W
    assert summary[0].item() == int((bad != -100).sum())
    assert kept[0].item() == -100 and kept[int(summary[0]) - 1].item() == -100


def test_loss_denominator_is_computed_after_the_gemm_launch(fused_calls):
    from hf_flce import api

    hidden, weight, target, _, _ = build((), n=12, v=70, ignore_every=3)
    h, w = half(hidden, weight, None)[:2]
    h.requires_grad_()
    order = []
    real_forward, real_denominator = triton_gemm.forward, api.loss_denominator

    def forward(*args, **kwargs):
        order.append("gemm")
        return real_forward(*args, **kwargs)

    def denominator(*args, **kwargs):
        order.append("denominator")
        return real_denominator(*args, **kwargs)

    with mock.patch.object(triton_gemm, "forward", forward), mock.patch.object(api, "loss_denominator", denominator):
        loss = hf_flce.fused_linear_cross_entropy(h, w, target, backend="triton")
        (dx,) = torch.autograd.grad(loss, h)
    assert order == ["gemm", "denominator"]
    h64 = h.detach().double().requires_grad_()
    ref, _ = hf_flce.reference_linear_cross_entropy(h64, w.double(), target)
    assert_close(loss, ref, TOL, "loss")
    assert_close(dx, torch.autograd.grad(ref, h64)[0], TOL, "dx")


def test_no_grad_call_bad_targets_and_edge_batches(fused_calls):
    hidden, weight, target, _, _ = build((), n=9, v=50)
    h, w = half(hidden, weight, None)[:2]
    with torch.no_grad():
        for bad in (50, -1, 2**40, -(2**40)):
            wrong = target.clone()
            wrong[4] = bad
            with pytest.raises(ValueError, match=f"target contains {bad}, outside \\[0, V=50\\)"):
                hf_flce.fused_linear_cross_entropy(h, w, wrong, backend="triton")
        ignored = torch.full_like(target, -100)
        loss, stats = hf_flce.fused_linear_cross_entropy(h, w, ignored, backend="triton", return_stats=True)
        assert loss.item() == 0.0 and not stats.lse.abs().sum() and not stats.is_top1.any()
        # DFT's weighting without gradients (an eval of a DFT run)
        loss = hf_flce.fused_linear_cross_entropy(h, w, target, backend="triton", prob_weighted=True)
        ref, _ = hf_flce.reference_linear_cross_entropy(h.double(), w.double(), target, prob_weighted=True)
        assert_close(loss, ref, TOL, "prob_weighted loss")
        one = hf_flce.fused_linear_cross_entropy(h[:1], w, target[:1].clamp(min=0), backend="triton")
        assert_close(
            one,
            hf_flce.reference_linear_cross_entropy(h[:1].double(), w.double(), target[:1].clamp(min=0))[0],
            TOL,
            "one row",
        )
    assert fused_calls["forward"] == 7  # the bad targets too: they are caught after the GEMM's launch


def test_no_grad_call_over_the_budget_takes_the_chunked_path(fused_calls):
    hidden, weight, target, _, _ = build((), n=40, v=300, ignore_every=4)
    h, w = half(hidden, weight, None)[:2]
    # ten rows of partial statistics (their size follows the device's narrowest tile; a plain loss asks for none of
    # the optional ones)
    budget = 10 * triton_gemm.partial_bytes_per_row(300, params_for(300, stats=frozenset()))
    with torch.no_grad(), mock.patch.object(engine, "kept_rows", wraps=engine.kept_rows) as compaction:
        loss = hf_flce.fused_linear_cross_entropy(h, w, target, backend="triton", memory_budget=budget)
    ref, _ = hf_flce.reference_linear_cross_entropy(h.double(), w.double(), target)
    assert compaction.called and fused_calls["forward"] >= 2
    assert_close(loss, ref, TOL, "loss")


@pytest.mark.parametrize("columns", ["1", "0"], ids=["column-chunks", "row-chunks"])
def test_per_token_forward_that_will_recompute_reads_nothing_before_the_gemm(columns, fused_calls, monkeypatch):
    """A per-token loss whose logits will not be kept takes the no-grad forward (kept rows first on the device, the
    count read by the GEMM) and leaves the kept rows' lse and entropy for the recomputing backward."""
    monkeypatch.setenv("HF_FLCE_VOCAB_CHUNKS", columns)
    hidden, weight, target, bias, opts = build(("z_loss", "bias"), n=200, v=600, ignore_every=4)
    target[20:53] = -100  # a masked prompt
    h, w, b = half(hidden, weight, bias)
    with mock.patch.object(engine, "kept_rows", side_effect=AssertionError("synced before the GEMM")) as compaction:
        check(
            h,
            w,
            target,
            b,
            tol=TOL,
            grad_tol=GRAD_TOL,
            stat_grads=True,
            reduction="none",
            memory_budget=100_000,
            **opts,
        )
    assert fused_calls["forward"] == 1 and fused_calls["recompute_gradient"] >= 2
    # the backward reads the count its forward left, and never compacts again
    assert not compaction.called


@pytest.mark.parametrize("share, path", [(1.2, "kept_no_wait"), (0.6, "kept"), (0.45, "recompute")])
def test_per_token_reads_the_count_first_where_half_masked_rows_would_fit(share, path, fused_calls):
    """A budget of ``share`` times every row's kept logits. Where they fit it the forward does not wait for the host
    to read the kept count before the GEMM, and keeps the logits (fp16: e, and a pass in backward). Where they pass it,
    the 20 kept rows' (a third) fit it: within twice the budget the host reads the kept count before the GEMM and
    keeps their logits; past it the forward does not wait, and backward recomputes."""
    hidden, weight, target, bias, opts = build(("z_loss",), n=60, v=300)
    target[:36] = -100
    assert int((target != -100).sum()) == 20
    budget = int(share * 60 * 300 * triton_gemm.bytes_per_logit(300, params_for(300)))
    h, w, b = half(hidden, weight, bias)
    with mock.patch.object(engine, "kept_rows", wraps=engine.kept_rows) as compaction:
        check(
            h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, reduction="none", memory_budget=budget, **opts
        )
    if path.startswith("kept"):
        assert compaction.called == (path == "kept")
        assert fused_calls["gradient"] == 1 and fused_calls["recompute_gradient"] == 0
    else:
        assert not compaction.called and fused_calls["gradient"] == 0 and fused_calls["recompute_gradient"] >= 1


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host synchronisations are a CUDA notion")
@pytest.mark.parametrize(
    "grad, reduction, budget",
    [(False, "mean", None), (True, "mean", None), (True, "none", 64 << 20), (True, "none", None)],
    ids=["no-grad", "scalar-loss", "per-token-recompute", "per-token-kept-whole"],
)
def test_call_returns_while_the_head_gemm_runs(grad, reduction, budget):
    """Neither a no-grad call nor the forward of a scalar loss or of a per-token loss that will recompute, or whose
    logits fit whole (550 MB in the default 1 GiB), synchronises the stream: the host reads the kept count and the
    targets' range from a copy made right after the compaction, and returns with the GEMMs still running."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    # ~3 ms of GEMM on an H100/H200 against ~50 us of host work after the read (at 1 ms the per-token case failed once
    # beside 13 other test processes); the per-token forward's partial statistics still fit its 64 MiB budget
    n, h, v = 4096, 4096, 65536
    hidden = torch.randn(n, h, device=DEVICE, generator=gen, dtype=torch.bfloat16).requires_grad_(grad)
    weight = (torch.randn(v, h, device=DEVICE, generator=gen) * 0.02).bfloat16().requires_grad_(grad)
    target = torch.randint(0, v, (n,), device=DEVICE, generator=gen)
    target[::7] = -100
    opts = dict(backend="triton", reduction=reduction, memory_budget=budget)
    with torch.set_grad_enabled(grad):
        hf_flce.fused_linear_cross_entropy(hidden, weight, target, **opts)  # compiles
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = hf_flce.fused_linear_cross_entropy(hidden, weight, target, **opts)
                still_running = not torch.cuda.current_stream().query()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert not [c for c in caught if "called a synchronizing" in str(c.message)]
    assert still_running
    ref, _ = hf_flce.reference_linear_cross_entropy(
        hidden.detach().float(), weight.detach().float(), target, reduction=reduction
    )
    assert_close(loss.detach(), ref, 1e-3, "loss")


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "scalar-loss"])
def test_inputs_on_a_device_that_is_not_the_current_one(grad):
    """The host's read of the kept count waits on the inputs' device's stream, not the current device's."""
    other = torch.device("cuda", 1)
    hidden, weight, target, _, _ = build((), n=300, v=4000, ignore_every=3)
    h, w = (t.bfloat16().to(other).requires_grad_(grad) for t in (hidden, weight))
    y = target.to(other)
    assert torch.cuda.current_device() == 0
    with torch.set_grad_enabled(grad):
        loss = hf_flce.fused_linear_cross_entropy(h, w, y, backend="triton")
        ref, _ = hf_flce.reference_linear_cross_entropy(h.detach().double(), w.detach().double(), y)
        assert_close(loss.detach(), ref, 1e-3, "loss")
        wrong = y.clone()
        wrong[5] = 4000
        with pytest.raises(ValueError, match="target contains 4000"):
            hf_flce.fused_linear_cross_entropy(h, w, wrong, backend="triton")


@pytest.mark.parametrize(
    "names",
    [("smoothing", "z_loss", "temperature", "bias"), ("softcap", "z_loss", "temperature", "bias")],
    ids="+".join,
)
@pytest.mark.parametrize("ignore_every", [0, 4], ids=["all-kept", "compacted"])
def test_recompute_by_vocabulary_chunks(names, ignore_every, fused_calls):
    """777 classes in column chunks of 256 (the last one 9 wide), with targets on every chunk's edges: the per-token
    gradients against the float64 reference."""
    hidden, weight, target, bias, opts = build(names, n=70, v=777, ignore_every=ignore_every)
    edges = torch.tensor([0, 255, 256, 511, 512, 767, 768, 776], device=target.device)
    target[1 : 2 * len(edges) : 2] = edges
    h, w, b = half(hidden, weight, bias)
    check(h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, reduction="none", memory_budget=8192, **opts)
    assert fused_calls["recompute_gradient"] == 4


def test_recompute_past_the_budget_takes_column_chunks_where_rows_took_one_chunk(fused_calls):
    """48 kept rows of 300 classes: their fp16 gradient (28.8 kB) passes the 16 kB budget, but costs less than the
    budget plus a float32 dW accumulator (19.2 kB), so row chunks would take all rows at once; column chunks keep
    within the budget."""
    hidden, weight, target, bias, opts = build(("smoothing", "bias"), n=60, v=300)
    h, w, b = half(hidden, weight, bias)
    check(h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, reduction="none", memory_budget=16384, **opts)
    assert fused_calls["recompute_gradient"] == 2


@pytest.mark.parametrize(
    "budget, recomputed, kept", [(1024, 3, 0), (40000, 2, 1), (400_000, 0, 1)], ids=["recomputed", "256-kept", "whole"]
)
def test_recompute_by_vocabulary_chunks_under_autocast(budget, recomputed, kept, fused_calls):
    """float32 inputs under bf16 autocast: the chunks' dW rows come back in float32, and dX too; the kept leading
    columns are bf16 E with row scales, as the recomputed chunks' gradient is bf16 (not float32, twice the kept
    bytes), and their dW rows come from E in float32 too; so do logits kept whole, with nothing recomputed."""
    hidden, weight, target, _, _ = build((), n=60, v=600)
    x, w = (t.clone().requires_grad_() for t in (hidden, weight))
    upstream = torch.randn(target.shape, generator=torch.Generator().manual_seed(3)).to(target.device)
    kept_dtypes = []
    real_times = triton_scaled.ScaledGradient.times

    def times(scaled, per_row):
        kept_dtypes.append(scaled.e.dtype)
        return real_times(scaled, per_row)

    with mock.patch.object(triton_scaled.ScaledGradient, "times", times):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = hf_flce.fused_linear_cross_entropy(
                x, w, target, backend="triton", reduction="none", memory_budget=budget
            )
        (loss * upstream).sum().backward()
    assert fused_calls["recompute_gradient"] == recomputed and fused_calls["gradient"] == 0
    assert kept_dtypes == [torch.bfloat16] * kept
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    rx, rw = (t.detach().bfloat16().double().requires_grad_() for t in (hidden, weight))
    ref, _ = hf_flce.reference_linear_cross_entropy(rx, rw, target, reduction="none")
    (ref * upstream.double()).sum().backward()
    assert_close(x.grad, rx.grad, 3e-2, "dX")
    assert_close(w.grad, rw.grad, 3e-2, "dW")


def _recording_kept_columns(record: list):
    real = engine._kept_columns

    def wrapper(*args, **kwargs):
        record.append(real(*args, **kwargs))
        return record[-1]

    return mock.patch.object(engine, "_kept_columns", wrapper)


@pytest.mark.parametrize(
    "names",
    [("smoothing", "z_loss", "temperature", "bias"), ("softcap", "z_loss", "temperature", "bias")],
    ids="+".join,
)
@pytest.mark.parametrize(
    "budget, columns, sync", [(71680, 512, False), (100_000, 768, True)], ids=["no-host-wait", "count-read-first"]
)
def test_per_token_keeps_leading_columns_and_recomputes_the_rest(names, budget, columns, sync, fused_calls):
    """Per-token logits past the keep limit: the forward keeps e for as many leading columns as the limit holds (for
    every row where it does not wait for the kept count, for the kept rows where it does), backward turns them into
    the gradient by one pass and recomputes only the other columns. Targets sit on both sides of every edge."""
    hidden, weight, target, bias, opts = build(names, n=70, v=1000, ignore_every=4)
    edges = torch.tensor([0, 255, 256, 511, 512, 767, 768, 999], device=target.device)
    target[1 : 2 * len(edges) : 2] = edges
    h, w, b = half(hidden, weight, bias)
    kept_columns = []
    with (
        _recording_kept_columns(kept_columns),
        mock.patch.object(engine, "kept_rows", wraps=engine.kept_rows) as compaction,
    ):
        check(
            h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, reduction="none", memory_budget=budget, **opts
        )
    assert kept_columns == [columns] and compaction.called == sync
    assert fused_calls["gradient"] == 1 and fused_calls["recompute_gradient"] == 1


def test_partly_kept_columns_with_a_frozen_head_every_row_ignored_and_a_second_backward(fused_calls):
    """The leading columns kept for a head that takes no gradient (a LoRA fine-tune's): dX alone, by vocabulary
    chunks. A batch whose every row is ignored: zero gradients. A second backward (retain_graph) recomputes every
    column, its kept e being consumed by the first."""
    hidden, weight, target, _, _ = build((), n=70, v=1000)
    h, w = (t.half() for t in (hidden, weight))
    upstream = torch.randn(target.shape, generator=torch.Generator().manual_seed(5)).to(target.device)
    rx = h.detach().double().requires_grad_()
    ref, _ = hf_flce.reference_linear_cross_entropy(rx, w.double(), target, reduction="none")
    (ref * upstream.double()).sum().backward()
    x = h.detach().clone().requires_grad_()
    kept_columns = []
    with _recording_kept_columns(kept_columns):
        loss = hf_flce.fused_linear_cross_entropy(x, w, target, backend="triton", reduction="none", memory_budget=71680)
    assert kept_columns == [512]
    (loss * upstream).sum().backward(retain_graph=True)
    assert_close(x.grad, rx.grad, GRAD_TOL, "dX")
    assert fused_calls["gradient"] == 1 and fused_calls["recompute_gradient"] == 1
    first = x.grad.clone()
    x.grad = None
    (loss * upstream).sum().backward()
    assert_close(x.grad, first, GRAD_TOL, "dX of the second backward")
    assert fused_calls["gradient"] == 1 and fused_calls["recompute_gradient"] >= 2

    x, wg = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ignored = torch.full_like(target, -100)
    loss = hf_flce.fused_linear_cross_entropy(x, wg, ignored, backend="triton", reduction="none", memory_budget=71680)
    (loss * upstream).sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(wg.grad) == 0


# (options, upstream gradients, whether E's row scales carry them): the loss's and the log-probs' upstream gradients
# are a row factor of E (``u = g_loss - g_logprob``) unless a z-loss comes with the latter, or the entropy's is asked for
ROW_SCALE_CASES = pytest.mark.parametrize(
    "names, upstream, scaled",
    [
        ((), "loss", True),
        ((), "logprob", True),
        (("z_loss",), "loss", True),
        (("softcap", "temperature"), "loss+logprob", True),
        (("z_loss",), "logprob", False),
        ((), "loss+logprob+entropy", False),
    ],
    ids=lambda c: "+".join(c) or "plain" if isinstance(c, tuple) else str(c),
)


def _per_token_bf16_grads(names, upstream, budget, fused_calls, ignore_every=4):
    """dX and dW of a bf16 per-token objective (``upstream``: the summed outputs, each with its random per-row
    coefficients) at 70 rows and 1000 classes, every ``ignore_every``-th row ignored, with targets on both sides of
    every tile edge; with how many leading columns the forward kept (``_kept_columns``' answers), whether it read the
    kept count first, how many times E's row scales took the upstream gradients, and the float64 reference's
    gradients."""
    hidden, weight, target, _, opts = build(names, n=70, v=1000, ignore_every=ignore_every)
    target[1:16:2] = torch.tensor([0, 255, 256, 511, 512, 767, 768, 999], device=target.device)
    x, w = (t.bfloat16().requires_grad_() for t in (hidden, weight))
    gen = torch.Generator().manual_seed(1)
    coefs = {
        name: torch.randn(70, generator=gen, dtype=torch.float64).to(DEVICE) for name in ("loss", "logprob", "entropy")
    }

    def objective(loss, stats):
        values = dict(loss=loss, logprob=stats["logprobs"], entropy=stats["entropy"])
        return sum((values[name] * coefs[name].to(loss.dtype)).sum() for name in upstream.split("+"))

    kept_columns, row_scaled = [], []
    real_times = triton_scaled.ScaledGradient.times
    with (
        _recording_kept_columns(kept_columns),
        mock.patch.object(engine, "kept_rows", wraps=engine.kept_rows) as compaction,
        mock.patch.object(
            triton_scaled.ScaledGradient, "times", lambda self, u: row_scaled.append(1) or real_times(self, u)
        ),
    ):
        loss, stats = hf_flce.fused_linear_cross_entropy(
            x, w, target, backend="triton", reduction="none", return_stats=True, memory_budget=budget, **opts
        )
        objective(loss, vars(stats)).backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    ref, ref_stats = hf_flce.reference_linear_cross_entropy(*ref_leaves, target, reduction="none", **opts)
    objective(ref, ref_stats).backward()
    recorded = dict(kept_columns=kept_columns, count_read_first=compaction.called, row_scaled=len(row_scaled))
    return (x.grad, w.grad), (ref_leaves[0].grad, ref_leaves[1].grad), recorded


@ROW_SCALE_CASES
@pytest.mark.parametrize("budget, sync", [(71680, False), (100_000, True)], ids=["no-host-wait", "count-read-first"])
def test_per_token_bf16_keeps_leading_columns_as_e_with_row_scales(names, upstream, scaled, budget, sync, fused_calls):
    """bf16 per-token logits past the keep limit keep their leading columns as the scalar loss's E (row scales, the
    target column apart): backward takes those columns' dX and dW from E with no pass over it, for upstream gradients
    of the loss and the log-probs (``u = g_loss - g_logprob``, no z-loss with the latter). Otherwise it recomputes
    them with the others. Against float64: within the bf16 gradient's rounding (the fp16-e path reads 2.7-3.8e-3 on
    these inputs), with targets on both sides of every tile edge and of the kept width."""
    ours, ref, recorded = _per_token_bf16_grads(names, upstream, budget, fused_calls)
    assert recorded["kept_columns"] == [512 if budget == 71680 else 768] and recorded["count_read_first"] == sync
    assert fused_calls["gradient"] == 0 and recorded["row_scaled"] == int(scaled)
    for name, grad, ref_grad in zip(("dX", "dW"), ours, ref):
        assert rel_err(grad, ref_grad) < 6e-3, name


@ROW_SCALE_CASES
# 70 rows' logits fit 200 kB, the 35 kept rows' 120 kB: ~2.05 (GPU) to 2.77 (interpreter) bytes per logit
@pytest.mark.parametrize("budget, sync", [(200_000, False), (120_000, True)], ids=["no-host-wait", "count-read-first"])
def test_per_token_bf16_logits_kept_whole_as_e_with_row_scales(names, upstream, scaled, budget, sync, fused_calls):
    """bf16 per-token logits within the keep limit are kept whole as the scalar loss's E with row scales: backward
    is the scalar loss's (``s (E W) + c W[y]`` and ``E^T (s X)``, each row's target column ``c`` in float32), with no
    pass over the logits and no GEMM recomputing them. Where ``u`` is no row scale of E, backward recomputes the
    logits instead. Where every row's logits fit, the forward's GEMM does not wait for the host to read how many rows
    are kept; where only the kept rows' do, it does. Against float64: within the bf16 gradient's rounding (3.0-4.5e-3
    here, 2.0-2.7x the float64 gradients rounded to bf16: at 35 kept rows the gradient's own rounding does not average
    out; the fp16 e it replaces, ``HF_FLCE_SCALED_GRAD=0``, read 2.9-4.6e-3 at 52 kept rows)."""
    ours, ref, recorded = _per_token_bf16_grads(names, upstream, budget, fused_calls, ignore_every=2)
    assert recorded["kept_columns"] == [] and recorded["row_scaled"] == int(scaled)
    assert recorded["count_read_first"] == sync
    assert fused_calls["gradient"] == 0 and fused_calls["recompute_gradient"] == (0 if scaled else 1)
    for name, grad, ref_grad in zip(("dX", "dW"), ours, ref):
        assert rel_err(grad, ref_grad) < 6e-3, name


def test_per_token_bf16_logits_kept_whole_without_compaction(fused_calls):
    """Under torch.compile or graph capture no row is dropped: logits kept whole as E hold the ignored rows too, whose
    row scales and target terms are 0, so their dX rows are 0 and they add nothing to dW."""
    with mock.patch.object(engine, "_can_compact", return_value=False):
        ours, ref, recorded = _per_token_bf16_grads((), "loss+logprob", 200_000, fused_calls, ignore_every=2)
    assert recorded["kept_columns"] == [] and recorded["row_scaled"] == 1
    assert fused_calls["gradient"] == 0 and fused_calls["recompute_gradient"] == 0
    assert not ours[0][::2].any()
    for name, grad, ref_grad in zip(("dX", "dW"), ours, ref):
        assert rel_err(grad, ref_grad) < 6e-3, name


@pytest.mark.parametrize("optional_stats", [False, True], ids=["row-reference", "tile-max"])
@pytest.mark.parametrize("names", [(), ("softcap", "temperature")], ids=lambda c: "+".join(c) or "plain")
def test_scaled_forward_keeps_leading_columns(names, optional_stats):
    """``forward(scaled=True, keep_columns=512)`` at 1000 classes stores the leading 512 columns of the whole call's
    E exactly, with its statistics and row scales to rounding: against the row's reference (``SPLIT``: E stored from
    registers by column halves) and against each tile's max (entropy asked for). Rows past ~120 nats get E rewritten
    by the merge within the kept width; each kept row's target column is 0 where E holds it."""
    hidden, weight, target, _ = make_inputs(23, 16, 1000, ignore_every=4, seed=9)
    hidden, target = hundreds_of_nats(hidden, weight, target, rows=3)
    target[3:9] = torch.tensor([0, 255, 256, 511, 512, 999], device=target.device)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    softcap = 30.0 if "softcap" in names else None
    params = params_for(
        1000, softcap=softcap, temperature=0.7 if names else 1.0, stats=frozenset({"entropy"} if optional_stats else ())
    )
    stats, whole = triton_gemm.forward(hidden, weight, None, target, params, keep=False, scaled=True)
    part_stats, part = triton_gemm.forward(
        hidden, weight, None, target, params, keep=True, scaled=True, keep_columns=512
    )
    assert part.e.shape == (23, 512)
    assert torch.equal(part.e, whole.e[:, :512])
    # the tiles past the kept width sum their row without splitting it in halves: equal to rounding
    for name in ("row_scale", "target_coef"):
        torch.testing.assert_close(getattr(part, name), getattr(whole, name), rtol=1e-6, atol=0, msg=name)
    for name in ("loss", "lse", "entropy"):
        torch.testing.assert_close(getattr(part_stats, name), getattr(stats, name), rtol=1e-6, atol=0, msg=name)
    kept = (target != -100) & (target < 512)
    assert not part.e[kept.nonzero()[:, 0], target[kept]].any()
    assert part.e[:3].any(1).all()  # the rewritten rows past ~120 nats


@pytest.mark.parametrize("names", [(), ("softcap", "z_loss", "temperature", "bias")], ids=["plain", "options"])
@pytest.mark.parametrize("budget, by_columns", [(None, False), (20000, True)], ids=["one_chunk", "chunked"])
def test_weight_grad_saved_for_later(names, budget, by_columns, fused_calls):
    """``save_for_weight_grad`` (``defer_head_grad``): dX and db from the scalar loss's epilogue in forward, dW later
    by the recomputing GEMM with the gradient in its epilogue and the saved lse, in one chunk or by vocabulary chunks
    (four of 256 columns here), each as the float64 reference's."""
    hidden, weight, target, bias, opts = build(names, n=40, v=1000)
    h, w, b = half(hidden, weight, bias)
    leaves = [h.detach().clone().requires_grad_()] + ([] if b is None else [b.detach().clone().requires_grad_()])
    saved = []
    loss = hf_flce.fused_linear_cross_entropy(
        leaves[0], w, target, None if b is None else leaves[1], backend="triton", memory_budget=budget,
        save_for_weight_grad=saved.append, **opts,
    )  # fmt: skip
    upstream = torch.tensor(0.37, device=loss.device)
    loss.backward(upstream)
    assert fused_calls["recompute_gradient"] == 0
    dw = saved[0].weight_grad(upstream)
    assert fused_calls["recompute_gradient"] == (4 if by_columns else 1)
    refs = [t.detach().double().requires_grad_() for t in (h, w) + (() if b is None else (b,))]
    ref, _ = hf_flce.reference_linear_cross_entropy(refs[0], refs[1], target, None if b is None else refs[2], **opts)
    assert_close(loss, ref, TOL, "loss")
    ref.backward(upstream.double())
    assert dw.dtype == w.dtype
    assert_close(leaves[0].grad, refs[0].grad, GRAD_TOL, "dX")
    assert_close(dw, refs[1].grad, GRAD_TOL, "dW")
    if b is not None:
        assert_close(leaves[1].grad, refs[2].grad, GRAD_TOL, "db")


@pytest.mark.parametrize(
    "opts",
    [{}, dict(smoothing=0.2, z_loss=1e-3), dict(softcap=3.0, temperature=0.7)],
    ids=["plain", "smoothing+z_loss", "softcap+temperature"],
)
@pytest.mark.parametrize("first_column, columns", [(0, 1000), (256, 256), (768, 232)], ids=["all", "middle", "last"])
def test_recompute_gradient_with_the_target_column_apart(opts, first_column, columns):
    """``recompute_gradient(target_apart=True)`` writes 0 at each row's target column among its columns (a vocabulary
    chunk, the last one ragged) and every other entry as the plain recompute; ``target_gradient`` gives every row's
    target entry in float32 (from a dot per row, so within float32 rounding), 0 at ignored rows."""
    hidden, weight, target, _ = make_inputs(37, 16, 1000, ignore_every=4, seed=5)
    target[1:9] = torch.arange(first_column, first_column + 8, device=DEVICE)  # some targets in every chunk
    params = params_for(1000, **opts)
    stats, _ = triton_gemm.forward(hidden, weight, None, target, params, keep=False)
    upstream = [torch.randn(37, generator=torch.Generator().manual_seed(s)).to(DEVICE) for s in (6, 7, 8)]
    w_cols = weight[first_column : first_column + columns]
    args = (hidden, w_cols, None, target, stats.lse, stats.entropy, params, *upstream)
    whole = triton_gemm.recompute_gradient(*args, first_column=first_column)
    apart = triton_gemm.recompute_gradient(*args, first_column=first_column, target_apart=True)
    local = target - first_column
    held = (target != -100) & (local >= 0) & (local < columns)
    rows = held.nonzero().squeeze(1)
    assert rows.numel() >= 8
    assert torch.equal(apart[rows, local[rows]], torch.zeros(rows.numel(), device=DEVICE))
    apart[rows, local[rows]] = whole[rows, local[rows]]
    assert torch.equal(apart, whole)
    column = triton_gemm.target_gradient(hidden, weight, target, stats.lse, stats.entropy, params, *upstream)
    assert_close(column[rows], whole[rows, local[rows]], 1e-5, "target column")
    ignored = target == -100
    assert torch.equal(column[ignored], torch.zeros(int(ignored.sum()), device=DEVICE))


def flat_grad_errors(dtype: torch.dtype, apart: bool, monkeypatch, budget, per_token: bool) -> dict:
    """Relative Frobenius errors against float64 of ours, of stock's (16-bit logits, float32 cross-entropy) and of the
    float64 gradient rounded to 16 bits, for a flat distribution over 2000 classes: p_y ~ 2^-11, which a 16-bit
    ``p_y - 1`` loses (bf16 keeps it to 2^-9, fp16 to 2^-11). ``per_token``: dX and dW of a per-token loss times a
    per-row upstream gradient (DPO's shape of call); otherwise the deferred dW of a mean (``save_for_weight_grad``)."""
    monkeypatch.setenv("HF_FLCE_TARGET_APART", "1" if apart else "0")
    gen = torch.Generator().manual_seed(11)
    n, h, v = 96, 32, 2000
    hidden = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(v, h, generator=gen) * 0.02).to(DEVICE, dtype)
    target = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    target[::7] = -100
    upstream = (0.5 + torch.rand(n, generator=gen)).to(DEVICE) if per_token else torch.tensor(1.0, device=DEVICE)
    reduction = "none" if per_token else "mean"
    saved = []
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(per_token)
    options = dict(reduction=reduction, memory_budget=budget)
    if not per_token:
        options["save_for_weight_grad"] = saved.append
    (hf_flce.fused_linear_cross_entropy(x, w, target, backend="triton", **options) * upstream).sum().backward()
    # (a mean's dX comes from its forward, not from a recomputing backward)
    ours = {"dX": x.grad, "dW": w.grad} if per_token else {"dW": saved[0].weight_grad(upstream)}
    errors = {}
    for name, (a, b) in {"ref": (torch.float64, torch.float64), "stock": (dtype, torch.float32)}.items():
        leaves = [t.to(a).requires_grad_() for t in (hidden, weight)]
        logits = (leaves[0] @ leaves[1].T).to(b)
        (torch.nn.functional.cross_entropy(logits, target, reduction=reduction) * upstream.to(b)).sum().backward()
        errors[name] = {k: leaves[i].grad for i, k in enumerate(("dX", "dW")) if k in ours}
    ref = errors.pop("ref")
    errors["ours"] = ours
    errors["rounded_once"] = {k: g.to(dtype) for k, g in ref.items()}
    return {
        who: {k: ((g.double() - ref[k]).norm() / ref[k].norm()).item() for k, g in grads.items()}
        for who, grads in errors.items()
    }


# The interpreter casts float32 to bf16 by truncation (twice round-to-nearest's error): bf16 on GPUs only
SIXTEEN_BIT = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
@pytest.mark.parametrize(
    "per_token, budget, recomputes",
    [(False, None, 1), (False, 100_000, 4), (True, 100_000, 3), (True, None, 0)],
    ids=["deferred-one_chunk", "deferred-chunked", "per_token-512_kept", "per_token-all_kept"],
)
def test_recomputing_backward_carries_the_target_column_in_float32(
    dtype, per_token, budget, recomputes, monkeypatch, fused_calls
):
    """Stock's 16-bit gradient rounds ``p_y - 1``, and so did our recomputing backward with the target column in it
    (``HF_FLCE_TARGET_APART=0``): the same error. Carried in float32 and added to dW's target rows and to dX, the
    gradients come within 10% of the float64 gradient rounded once, and well below stock's: the deferred dW, and a
    per-token loss whose backward takes the leading 512 columns' gradient from the forward's kept columns (bf16: E
    with row scales, with no pass over it; fp16: e and the pass) and recomputes the others. A per-token loss whose
    logits are kept whole takes them as E in bf16 too, its target column in float32; in fp16 it keeps that column in
    its 16-bit gradient (the float32 path would cost it 2-5%, with the pass), with stock's error."""
    kept_in = flat_grad_errors(dtype, False, monkeypatch, budget, per_token)
    apart = flat_grad_errors(dtype, True, monkeypatch, budget, per_token)
    assert fused_calls["recompute_gradient"] == 2 * recomputes
    # kept columns (or logits) as bf16 E only with the target column apart: the pass over fp16 e in the other runs
    passes = 1 if dtype == torch.bfloat16 else 2
    assert fused_calls["gradient"] == passes or not per_token
    stock, rounded_once = apart["stock"], apart["rounded_once"]
    assert stock == kept_in["stock"] and list(apart["ours"]) == (["dX", "dW"] if per_token else ["dW"])
    for name, error in apart["ours"].items():
        assert abs(kept_in["ours"][name] - stock[name]) <= 0.05 * stock[name], (name, kept_in, stock)
        if budget is None and per_token and dtype != torch.bfloat16:
            assert error == kept_in["ours"][name], (name, apart, kept_in)
        else:
            assert error <= 1.1 * rounded_once[name] and error < 0.8 * stock[name], (name, apart)


def test_plan_chunk_columns():
    for n_rows, vocab, budget in [(70, 777, 8192), (16384, 151936, 1 << 30), (8192, 128256, 1 << 30), (1, 5, 1)]:
        columns = engine.plan_chunk_columns(n_rows, vocab, 2, budget, triton_gemm.COLUMN_ALIGN)
        chunks = -(-vocab // columns)
        assert columns % 256 == 0 and columns >= 256
        assert n_rows * columns * 2 <= budget or columns == 256
        # balanced: no chunk of more than one column tile fewer than the others, but the last
        assert chunks == 1 or vocab - (chunks - 1) * columns > columns - 256 * chunks


def test_prob_weighted_and_second_backward(fused_calls):
    hidden, weight, target, _, _ = build((), n=12)
    h, w = (t.half().requires_grad_() for t in (hidden, weight))
    ref_h, ref_w = (t.detach().double().requires_grad_() for t in (hidden, weight))
    loss = hf_flce.fused_linear_cross_entropy(h, w, target, backend="triton", prob_weighted=True)
    ref, _ = hf_flce.reference_linear_cross_entropy(ref_h, ref_w, target, prob_weighted=True)
    assert_close(loss, ref, TOL, "loss")
    loss.backward(retain_graph=True)
    ref.backward()
    first = (h.grad.clone(), w.grad.clone())
    assert_close(first[0], ref_h.grad, GRAD_TOL, "dX")
    assert_close(first[1], ref_w.grad, GRAD_TOL, "dW")
    # the eager buffers were handed out: the second backward recomputes through the epilogue
    h.grad = w.grad = None
    loss.backward()
    assert fused_calls["recompute_gradient"] == 1
    assert_close(h.grad, ref_h.grad, GRAD_TOL, "dX (second backward)")
    assert_close(w.grad, ref_w.grad, GRAD_TOL, "dW (second backward)")


@pytest.mark.parametrize(
    "names", [("class_weight",), ("softcap", "smoothing")], ids=["class_weight", "softcap+smoothing"]
)
def test_unsupported_options_take_the_tile_path(names, fused_calls):
    hidden, weight, target, bias, opts = build(names, n=10)
    h, w, b = half(hidden, weight, bias)
    check(h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, stat_grads=True, **opts)
    assert fused_calls["forward"] == 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_saturated_softcap_matches_the_tile_path(reduction, fused_calls):
    # Hidden states scaled by 100: most logits sit where tanh saturates (dt ~ 0), many tied at +-softcap in float32.
    hidden, weight, target, _ = make_inputs(40, 32, 300, ignore_every=7)
    h, w = half(hidden * 100.0, weight, None)[:2]
    tiles = resolve_backend("triton", DEVICE)
    results = []
    for head in (triton_gemm, None):
        leaves = [t.detach().clone().requires_grad_() for t in (h, w)]
        with mock.patch.object(tiles, "fused_head", head):
            loss, stats = hf_flce.fused_linear_cross_entropy(
                *leaves, target, backend="triton", softcap=30.0, reduction=reduction, return_stats=True
            )
            gen = torch.Generator().manual_seed(0)
            upstream = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in (loss, target, target)]
            terms = (loss * upstream[0]).sum()
            if reduction == "none":
                terms = terms + (stats.logprobs * upstream[1]).sum() + (stats.entropy * upstream[2]).sum()
            terms.backward()
        results.append((loss, stats.lse, stats.logprobs, stats.entropy, leaves[0].grad, leaves[1].grad))
    assert fused_calls["forward"] == 1
    for name, ours, tiled in zip(("loss", "lse", "logprobs", "entropy", "dX", "dW"), *results):
        assert torch.isfinite(ours).all(), name
        assert_close(ours, tiled, GRAD_TOL if name.startswith("d") else TOL, name)


def test_switch():
    assert TritonTileOps(gemm_epilogue=False).fused_head is None
    on = TritonTileOps(gemm_epilogue=True)
    assert on.fused_head is triton_gemm and on.gemm_min_capability == 0
    with mock.patch.dict("os.environ", {"HF_FLCE_GEMM_EPILOGUE": "1"}):
        assert TritonTileOps().gemm_min_capability == 0
    with mock.patch.dict("os.environ", {"HF_FLCE_GEMM_EPILOGUE": "0"}):
        assert TritonTileOps().fused_head is None
    with mock.patch.dict("os.environ", {"HF_FLCE_GEMM_EPILOGUE": "auto"}):
        auto = TritonTileOps()
    assert auto.fused_head is triton_gemm and auto.gemm_min_capability == 9


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the default on a CPU device (the interpreter)")
def test_default_skips_devices_it_was_not_measured_on(fused_calls):
    hidden, weight, target, bias, opts = build((), n=10)
    tiles = resolve_backend("triton", DEVICE)
    h, w, b = half(hidden, weight, bias)
    with mock.patch.object(tiles, "gemm_min_capability", 9):
        check(h, w, target, b, tol=TOL, grad_tol=GRAD_TOL, **opts)
    assert fused_calls["forward"] == 0


# --- the kernels directly, float32 operands (float64 reference) ---------------------------------------------------


def params_for(v, smoothing=0.0, z_loss=0.0, temperature=1.0, softcap=None, stats=OPTIONAL_STATS):
    return TileParams(v, -100, smoothing, z_loss, softcap, 1.0 / temperature, None, None, stats)


def kernel_stats_match(hidden, weight, bias, target, params):
    """The forward kernels' statistics against the float64 reference; returns what the gradient check needs."""
    logits = (hidden.double() @ weight.double().T + (0.0 if bias is None else bias.double())).float()
    ref = TorchTileOps().forward(logits, target, params)
    stats, kept = triton_gemm.forward(hidden, weight, bias, target, params, keep=True)
    for name in ("loss", "lse", "logprob", "entropy", "mean_logit", "log_sum_sq_probs"):
        assert_close(getattr(stats, name), getattr(ref, name), 1e-5, name)
    assert torch.equal(stats.is_top1, ref.is_top1)
    return logits, ref, stats, kept


def kernel_grads_match(hidden, weight, bias, target, params, logits, ref, stats, kept, seed):
    """Both gradient kernels (the recomputing epilogue, the pass over the kept e) against the reference, with random
    upstream gradients of the loss, logprob and entropy."""
    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(target.shape[0], generator=gen).to(DEVICE) for _ in range(3)]
    expected = torch.empty_like(logits)
    TorchTileOps().backward(logits, target, ref.lse, ref.entropy, params, *upstream, expected)
    recomputed = triton_gemm.recompute_gradient(
        hidden, weight, bias, target, stats.lse, stats.entropy, params, *upstream
    )
    assert_close(recomputed, expected, 1e-5, "gradient from the epilogue")
    # e is stored in fp16 (11 bits)
    from_kept = triton_gemm.gradient(kept, target, stats.lse, stats.entropy, params, torch.float32, *upstream)
    assert_close(from_kept, expected, 2e-3, "gradient from the kept e")
    assert kept.e is None


@pytest.mark.parametrize(
    "opts",
    [dict(smoothing=0.3, z_loss=1e-3), dict(softcap=3.0, temperature=0.7)],
    ids=["smoothing+z_loss", "softcap+temperature"],
)
def test_gradient_of_leading_columns_kept_equals_the_whole_kept_one(opts):
    """``forward(keep_columns=512)`` at 1000 classes stores e for the leading 512 columns only, and the pass over it
    gives exactly those columns of the gradient from every column's e (the smoothing term still spread over all
    1000), with ignored rows; a width that is not a multiple of COLUMN_ALIGN is refused."""
    hidden, weight, target, bias = make_inputs(23, 16, 1000, bias=True, ignore_every=4, seed=9)
    hidden, weight, bias = hidden.half(), weight.half(), bias.half()
    params = params_for(1000, **opts)
    upstream = [torch.randn(23, generator=torch.Generator().manual_seed(4)).to(DEVICE) for _ in range(3)]
    stats, whole = triton_gemm.forward(hidden, weight, bias, target, params, keep=True)
    part_stats, part = triton_gemm.forward(hidden, weight, bias, target, params, keep=True, keep_columns=512)
    assert part.e.shape == (23, 512)
    for name in ("loss", "lse", "entropy"):
        assert torch.equal(getattr(part_stats, name), getattr(stats, name)), name
    grads = [
        triton_gemm.gradient(kept, target, stats.lse, stats.entropy, params, torch.float32, *upstream)
        for kept in (whole, part.head(23))
    ]
    assert torch.equal(grads[1], grads[0][:, :512])
    with pytest.raises(ValueError, match="multiple of 256"):
        triton_gemm.forward(hidden, weight, bias, target, params, keep=True, keep_columns=500)


def hundreds_of_nats(hidden, weight, target, rows=5, scale=80.0):
    """The first ``rows`` rows scaled to logits of hundreds, each targeting its least likely class: losses past the
    ~120 nats where exp(t - t_y - REF_OFFSET) overflows float32."""
    hidden, target = hidden.clone(), target.clone()
    hidden[:rows] *= scale
    logits = hidden[:rows].double() @ weight.double().T
    target[:rows] = logits.argmin(1)
    assert (torch.logsumexp(logits, 1) - logits.min(1).values > 130).all()
    return hidden, target


@pytest.mark.parametrize("names", [(), ("z_loss",), ("softcap", "temperature")], ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize("overflow", [False, True], ids=["normal", "hundreds-of-nats"])
@pytest.mark.parametrize("row_reference", ["1", "0"], ids=["row-reference", "tile-max"])
def test_scaled_statistics_against_a_row_reference(names, overflow, row_reference):
    """``MODE_SCALED`` with no optional statistic takes every tile's sum of exp against the row's
    ``t_y + REF_OFFSET`` instead of the tile's max (``FIXED_REF``); a row whose sum overflows gets its lse again from
    float32 dots in the merge. Both ways against float64 (bf16 inputs), at a vocabulary no tile width divides, with
    ignored rows."""
    n, v = 21, 300
    hidden, weight, target, _ = make_inputs(n, 24, v, ignore_every=4, seed=5)
    if overflow:
        hidden, target = hundreds_of_nats(hidden, weight, target)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    opts = dict(z_loss=1e-3 if "z_loss" in names else 0.0, softcap=30.0 if "softcap" in names else None)
    params = params_for(v, temperature=0.7 if "temperature" in names else 1.0, stats=frozenset(), **opts)
    ref = TorchTileOps().forward((hidden.double() @ weight.double().T).float(), target, params)
    with mock.patch.dict("os.environ", {"HF_FLCE_ROW_REFERENCE": row_reference}):
        assert triton_gemm._row_reference(params) == (row_reference == "1")
        stats, _ = triton_gemm.forward(hidden, weight, None, target, params, keep=False, scaled=True)
    for name in ("loss", "lse", "logprob"):
        assert_close(getattr(stats, name), getattr(ref, name), 1e-5, name)
    assert torch.isfinite(stats.loss).all()


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "stats-only"])
def test_top1_ties_across_the_merges_tile_blocks(scaled):
    """The merge walks a row's tiles ``MERGE_TILES`` at a time: a tie for the max in a later step leaves the first
    column the top-1 (more tiles than a step both at the interpreter's 32-column tiles and at the GPU's 256)."""
    v = 17000
    assert -(-v // 256) > triton_gemm.MERGE_TILES
    hidden, weight, target, _ = make_inputs(6, 16, v, ignore_every=0, seed=3)
    weight[v - 1] *= 4  # its logit the row max in every row below
    weight[[5, v - 9]] = weight[v - 1].clone()
    hidden[:] = weight[v - 1]
    target[:] = torch.tensor([5, v - 9, v - 1, 0, 5, v - 9])
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    params = params_for(v, stats=frozenset({"entropy", "is_top1"}))
    ref = TorchTileOps().forward((hidden.double() @ weight.double().T).float(), target, params)
    assert ref.is_top1.tolist() == [True, False, False, False, True, False]
    stats, _ = triton_gemm.forward(hidden, weight, None, target, params, keep=False, scaled=scaled)
    assert torch.equal(stats.is_top1, ref.is_top1)
    for name in ("loss", "entropy"):
        assert_close(getattr(stats, name), getattr(ref, name), 1e-5, name)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("budget", [None, 4096], ids=["one-chunk", "chunks"])
def test_scaled_epilogue_in_column_halves(softcap, temperature, budget):
    """A scalar loss with no statistics asked for stores E from two column halves of each tile, from registers
    (``SPLIT``: no spilled registers with a softcap, no TMA store's barriers): its loss and gradients against float64
    and against whole tiles, at a vocabulary no tile width divides, with saturated softcap logits and ignored rows."""
    hidden, weight, target, _ = make_inputs(37, 32, 300, ignore_every=4, seed=7)
    hidden = hidden * (8.0 if softcap else 1.0)  # with a softcap, many logits where tanh saturates
    h, w = hidden.bfloat16(), weight.bfloat16()
    opts = dict(softcap=softcap, temperature=temperature)
    split_flags = []
    real = triton_gemm._launch_tuned

    def spy(grid, args, flags, key):
        split_flags.append(flags["SPLIT"])
        return real(grid, args, flags, key)

    results = []
    for split in ("1", "0"):
        leaves = [t.clone().requires_grad_() for t in (h, w)]
        with mock.patch.dict("os.environ", {"HF_FLCE_SPLIT_EPILOGUE": split}):
            with mock.patch.object(triton_gemm, "_launch_tuned", spy):
                loss = hf_flce.fused_linear_cross_entropy(
                    *leaves, target, backend="triton", memory_budget=budget, **opts
                )
        loss.backward()
        results.append((loss, leaves[0].grad, leaves[1].grad))
        assert set(split_flags) == {split == "1"}
        split_flags.clear()
    ref_leaves = [t.double().requires_grad_() for t in (h, w)]
    ref, _ = hf_flce.reference_linear_cross_entropy(*ref_leaves, target, **opts)
    ref.backward()
    for (loss, dx, dw), other in zip(results, (results[1], results[0])):
        assert_close(loss, ref, 1e-5, "loss")
        assert_close(dx, ref_leaves[0].grad, 1e-2, "dX")
        assert_close(dw, ref_leaves[1].grad, 1e-2, "dW")
        assert_close(dx, other[1], 1e-3, "dX halves vs whole tiles")
        assert_close(dw, other[2], 1e-3, "dW halves vs whole tiles")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_grad_call_with_rows_of_hundreds_of_nats(reduction):
    """The no-grad path (kept rows counted on the device) on bf16 inputs with rows of losses in the hundreds: their
    statistics are relative to the tile max, where nothing overflows."""
    hidden, weight, target, _ = make_inputs(40, 32, 300, ignore_every=3, seed=2)
    hidden, target = hundreds_of_nats(hidden, weight, target, rows=4, scale=60.0)
    h, w = hidden.bfloat16(), weight.bfloat16()
    with torch.no_grad():
        loss = hf_flce.fused_linear_cross_entropy(h, w, target, backend="triton", reduction=reduction)
    ref, _ = hf_flce.reference_linear_cross_entropy(h.double(), w.double(), target, reduction=reduction)
    assert torch.isfinite(loss).all()
    assert_close(loss, ref, 1e-5, "loss")


@pytest.mark.parametrize("count", [0, 1, 13, 21])
def test_kernel_computes_only_the_rows_counted_on_the_device(count):
    n, v = 21, 70
    hidden, weight, target, _ = make_inputs(n, 24, v, ignore_every=0, seed=3)
    params = params_for(v)
    max_tiles = triton_gemm._max_tiles(v)
    stride = triton_gemm.partial_stride(n)  # 32: rows 21-31 of each tile are padding
    partials = torch.full((5 * max_tiles * stride,), float("nan"), device=DEVICE)
    best = torch.zeros(max_tiles * stride, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor(count, dtype=torch.int32, device=DEVICE)
    none = (None, None, None)
    triton_gemm._gemm(hidden, weight, None, target, params, 0, None, partials, best, None, None, none, rows)
    tile_n = triton_gemm._head_gemm_kernel.best_config.kwargs["BN"]
    n_tiles = -(-v // tile_n)
    maxima = partials[: n_tiles * stride].view(n_tiles, stride)
    logits = hidden.double() @ weight.double().T
    padded = torch.nn.functional.pad(logits, (0, n_tiles * tile_n - v), value=float("-inf"))
    expected = padded.view(n, n_tiles, tile_n).amax(-1).T
    assert_close(maxima[:, :count], expected[:, :count], 1e-5, "tile maxima")
    assert maxima[:, count:].isnan().all(), "rows past the count were computed"


@pytest.mark.parametrize("group_blocks", [0, 3, 5, None], ids=lambda g: "L2-default" if g is None else f"{g}-blocks")
def test_kernel_visits_every_tile_once_in_any_group_order(group_blocks):
    """Row blocks go in groups of as many as ``L2_GROUP_BYTES`` of X holds (at least GROUP_M, 4 in the
    interpreter): every grouping, a ragged last group included, computes every tile exactly once."""
    n, k, v = 150, 24, 100  # 10 row blocks of the interpreter's 16 rows; V is 3 full column blocks and a ragged one
    hidden, weight, target, _ = make_inputs(n, k, v, ignore_every=0, seed=5)
    params = params_for(v)
    max_tiles = triton_gemm._max_tiles(v)
    stride = triton_gemm.partial_stride(n)  # 160
    partials = torch.full((5 * max_tiles * stride,), float("nan"), device=DEVICE)
    best = torch.zeros(max_tiles * stride, dtype=torch.int32, device=DEVICE)
    group_bytes = triton_gemm.L2_GROUP_BYTES if group_blocks is None else group_blocks * 16 * k * hidden.element_size()
    with mock.patch.object(triton_gemm, "L2_GROUP_BYTES", group_bytes):
        triton_gemm._gemm(hidden, weight, None, target, params, 0, None, partials, best, None, None, (None,) * 3)
    tile_n = triton_gemm._head_gemm_kernel.best_config.kwargs["BN"]
    n_tiles = -(-v // tile_n)
    logits = hidden.double() @ weight.double().T
    padded = torch.nn.functional.pad(logits, (0, n_tiles * tile_n - v), value=float("-inf"))
    expected_max = padded.view(n, n_tiles, tile_n).amax(-1).T
    expected_sum = (padded.view(n, n_tiles, tile_n) - expected_max.T[..., None]).exp().sum(-1).T
    planes = partials[: 2 * n_tiles * stride].view(2, n_tiles, stride)[..., :n]
    assert_close(planes[0], expected_max, 1e-5, "tile maxima")
    assert_close(planes[1], expected_sum, 1e-5, "tile sums")


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("v", [1, 255, 256, 257, 128256])
def test_partials_hold_every_tile_a_launch_may_run(tma, v):
    """The partials are sized by the narrowest tile among the configurations the launch's pruning keeps (with TMA or
    without), so no configuration the autotuner may pick writes past them; with TMA that is fewer tiles than the
    narrowest configuration overall, where it has one of its own."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    with mock.patch.object(triton_gemm, "_tma_usable", lambda *_: tma):
        kept = triton_gemm._prune_configs(triton_gemm._head_gemm_kernel.configs, {"x_ptr": x, "w_ptr": x})
    assert kept
    assert max(-(-v // c.kwargs["BN"]) for c in kept) <= triton_gemm._max_tiles(v, tma)
    assert triton_gemm._max_tiles(v, tma) <= triton_gemm._max_tiles(v)


@pytest.mark.parametrize("v", [1, 31, 32, 100])
@pytest.mark.parametrize(
    "opts",
    [{}, dict(smoothing=0.1, z_loss=1e-3, temperature=0.6), dict(softcap=3.0, z_loss=1e-3, temperature=0.6)],
    ids=["plain", "options", "softcap"],
)
def test_kernel_stats_and_gradients(v, opts):
    hidden, weight, target, bias = make_inputs(13, 24, v, bias=True, ignore_every=4, seed=v)
    params = params_for(v, **opts)
    checked = kernel_stats_match(hidden, weight, bias, target, params)
    kernel_grads_match(hidden, weight, bias, target, params, *checked, seed=v)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernel_softcap_far_and_peaked_targets(temperature):
    # Softcap 30. Rows 0-2 put the target logit at -60, ~30 below their tile's max: e_y underflows fp16, and the
    # gradient's target column needs dt at t_y all the same. Rows 3-5 put it at +60: p_y ~ 1 with tanh saturating.
    hidden, weight, target, _ = make_inputs(6, 16, 90, ignore_every=0)
    target = torch.tensor([3, 17, 40, 41, 70, 89], device=DEVICE)
    sign = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0], device=DEVICE)[:, None]
    weight[target] = sign * hidden * (60.0 / hidden.pow(2).sum(1, keepdim=True))
    params = params_for(90, z_loss=1e-3, temperature=temperature, softcap=30.0)
    logits, ref, stats, kept = kernel_stats_match(hidden, weight, None, target, params)
    assert torch.allclose(logits.gather(1, target[:, None]), 60.0 * sign, atol=1e-3)
    assert stats.is_top1[3:].all()
    assert not kept.e[torch.arange(3), target[:3]].any()
    kernel_grads_match(hidden, weight, None, target, params, logits, ref, stats, kept, seed=3)


def test_kernel_first_argmax_across_tiles():
    # Vocabulary rows 10 and 65 are identical (different tiles) and give rows 0 and 1 their max: a tie. As with
    # torch.argmax, the first index wins, so target 65 is not top-1 and target 10 is. Those rows hold small
    # integers, so the tied logit (2 * 33 = 66) is exact in any summation order: numpy's sgemm (under the
    # interpreter; numpy 2.4.6) rounds the same dot differently at different places of its output block.
    hidden, weight, target, _ = make_inputs(4, 8, 70, ignore_every=0)
    hidden[0] = torch.tensor([1.0, 2.0, -1.0, 3.0, -2.0, 1.0, 2.0, -3.0], device=hidden.device)
    hidden[1] = hidden[0]
    weight[10] = hidden[0] * 2.0
    weight[65] = weight[10]
    target[0], target[1] = 65, 10
    weight[11] = hidden[2] * 5.0
    target[2] = 11
    logits = hidden.double() @ weight.double().T
    stats, _ = triton_gemm.forward(hidden, weight, None, target, params_for(70), keep=False)
    assert not stats.is_top1[0] and stats.is_top1[1] and stats.is_top1[2]
    assert torch.equal(stats.is_top1, logits.argmax(-1) == target)


def test_peaked_rows_keep_fp32_accuracy():
    # Each row's target logit ~40 above the others: from the float32 tile, p_y - 1 and the lse come out to float32
    # precision (stock HF's bf16 logits would be off by ~0.1 here). The loss lse - t_y takes t_y from a separate
    # float32 dot, so it is exact to a few ulps of the target logit, and never negative.
    hidden, weight, target, _ = make_inputs(6, 16, 90, ignore_every=0)
    target = torch.tensor([3, 17, 40, 41, 70, 89], device=DEVICE)
    weight[target] = hidden * 2.5
    params = params_for(90)
    logits = (hidden.double() @ weight.double().T).float()
    assert (logits.gather(1, target[:, None]) - logits.max(1, keepdim=True).values).min() > -1e-3
    ref = TorchTileOps().forward(logits, target, params)
    stats, kept = triton_gemm.forward(hidden, weight, None, target, params, keep=True)
    target_ulp = torch.finfo(torch.float32).eps * logits.gather(1, target[:, None]).abs().max().item()
    assert_close(stats.loss, ref.loss, 1e-6 + 4 * target_ulp, "loss")
    assert (stats.loss >= 0).all() and (stats.logprob <= 0).all()
    ones = torch.ones(6, device=DEVICE)
    grad = triton_gemm.gradient(kept, target, stats.lse, stats.entropy, params, torch.float32, ones)
    expected = torch.empty_like(logits)
    TorchTileOps().backward(logits, target, ref.lse, ref.entropy, params, ones, None, None, expected)
    assert_close(grad, expected, 1e-6, "gradient")


@pytest.mark.parametrize(
    "stats, per_tile",
    [
        (OPTIONAL_STATS, 24),  # five float32 partials and an int32 argmax
        (frozenset(), 8),  # max and sum of exp
        (frozenset({"entropy"}), 12),
        (frozenset({"is_top1"}), 12),
        (frozenset({"log_sum_sq_probs"}), 16),
        (frozenset({"mean_logit"}), 20),
    ],
    ids=lambda s: "+".join(sorted(s)) if isinstance(s, frozenset) else str(s),
)
def test_memory_accounting(stats, per_tile):
    # e in 16 bits, plus the partials asked for per tile of the narrowest configured width
    narrowest = min(c.kwargs["BN"] for c in triton_gemm._head_gemm_kernel.configs)
    for v in (1, 100, 128256):
        params = params_for(v, stats=stats)
        tiles = -(-v // narrowest)
        assert triton_gemm.partial_bytes_per_row(v, params) == tiles * per_tile
        assert triton_gemm.bytes_per_logit(v, params) == 2 + tiles * per_tile / v
        assert triton_gemm.bytes_per_logit(v, params, keep=False) == tiles * per_tile / v


@pytest.mark.parametrize(
    "wanted",
    [{"entropy"}, {"is_top1", "mean_logit"}, {"log_sum_sq_probs"}, set()],
    ids=lambda w: "+".join(sorted(w)) or "none",
)
@pytest.mark.parametrize("names", [(), ("smoothing",)], ids=["plain", "smoothing"])
def test_requested_stats_only(wanted, names, fused_calls):
    """``return_stats`` naming some fields: those match the reference (as does everything the loss and its gradient
    need, label smoothing's sum of logits included); the epilogue skips the others and returns them as zeros."""
    hidden, weight, target, bias, opts = build(names, n=40, v=300)
    h, w = (t.requires_grad_() for t in half(hidden, weight, bias)[:2])
    loss, stats = hf_flce.fused_linear_cross_entropy(h, w, target, backend="triton", return_stats=wanted, **opts)
    ref_h, ref_w = (t.detach().double().requires_grad_() for t in (h, w))
    ref, ref_stats = hf_flce.reference_linear_cross_entropy(ref_h, ref_w, target, **opts)
    assert fused_calls["forward"] == 1
    assert_close(loss, ref, TOL, "loss")
    assert_close(stats.logprobs, ref_stats["logprobs"], TOL, "logprobs")
    assert_close(stats.lse, ref_stats["lse"], TOL, "lse")
    computed = wanted | ({"mean_logit"} if "smoothing" in names else set())  # smoothing needs the sum of logits
    for name in ("entropy", "mean_logit", "log_sum_sq_probs"):
        if name in computed:
            assert_close(getattr(stats, name), ref_stats[name], TOL, name)
        else:
            assert not getattr(stats, name).abs().sum(), name
    if "is_top1" in wanted:
        assert torch.equal(stats.is_top1.cpu(), ref_stats["is_top1"].cpu()) and stats.is_top1.any()
    else:
        assert not stats.is_top1.any()
    loss.backward()
    ref.backward()
    assert_close(h.grad, ref_h.grad, GRAD_TOL, "dX")
    assert_close(w.grad, ref_w.grad, GRAD_TOL, "dW")


GRADIENT_PASS_CASES = [
    (torch.float16, ()),
    (torch.float16, ("softcap", "z_loss", "temperature")),
    (torch.float16, ("smoothing",)),
    (torch.float16, ("smoothing", "z_loss", "temperature")),
]


@pytest.mark.parametrize(
    "dtype, names",
    GRADIENT_PASS_CASES,
    ids=lambda c: str(c).replace("torch.", "") if isinstance(c, torch.dtype) else "+".join(c) or "plain",
)
@pytest.mark.parametrize("budget", [None, 8192], ids=["one-chunk", "chunks"])
def test_gradient_pass_target_column_apart(dtype, names, budget):
    """A scalar loss on the epilogue path whose gradient is no row scale of ``E`` (fp16 operands; bf16 label smoothing
    is a scaled gradient since v51, ``test_triton_scaled.py``) turns stored e into a 16-bit gradient with each row's target column apart in float32, and over several chunks
    sums dW in the 16-bit gradient itself (no float32 ``[V, H]`` sum). The loss is the column-in path's, and the
    gradients' errors against float64 are within ``TILE_MARGIN`` of that path's, whose dW is summed in float32."""
    check_target_apart(names, dtype, budget)


@pytest.mark.parametrize("names", [(), ("smoothing",)], ids=["plain", "smoothing"])
def test_gradient_pass_target_column_apart_dft(names):
    """DFT (``prob_weighted``): its per-row factor is known before the epilogue path's gradient pass, which takes the
    target column apart as for any other scalar loss."""
    check_target_apart(names, torch.float16, 8192, prob_weighted=True)


@pytest.mark.parametrize("case", ["all-ignored", "one-token", "peaked"])
def test_gradient_pass_target_column_apart_edge_cases(case):
    """The same with label smoothing in fp16: every row ignored gives loss 0 and zero gradients; one token; peaked
    rows, whose ``p_y - 1 + eps`` a 16-bit gradient rounds away, keep dX and dW as accurate as the column-in path."""
    check_target_apart_edge_case(case, torch.float16, label_smoothing=0.1, memory_budget=2048)


def test_gradient_pass_frequent_classes():
    """The gradient pass with its target column apart (fp16, label smoothing) sums the most frequent target classes'
    dW rows in float32 from ``MIN_CHUNKS`` chunks on, as the scaled gradient and the tile path do."""
    check_frequent_classes(10, torch.float16, label_smoothing=0.1)


def test_gradient_pass_keeps_the_column_in_with_a_bias():
    """With a bias (whose gradient would need the column) the gradient pass keeps the target column in, and dW
    is summed in float32 across chunks."""
    hidden, weight, target, bias, opts = build(("smoothing", "bias"), n=40, v=200)
    leaves = [t.bfloat16() for t in (hidden, weight, bias)]
    with target_apart_calls(fp32_sum_allowed=True) as calls:
        check(*leaves[:2], target, leaves[2], tol=1e-2, grad_tol=3e-2, memory_budget=4096, **opts)
    assert calls["chunks"] == 0
