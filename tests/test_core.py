"""The fused op (torch backend) against the float64 materialised reference, plus bad input and autograd features."""

from __future__ import annotations

import gc
import itertools
import os
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from offset_utils import offset_errors, rel_err
from torch.utils.checkpoint import checkpoint

import hf_flce
from hf_flce import engine, reference_linear_cross_entropy
from hf_flce.backends import resolve_backend
from hf_flce.backends.torch_tiles import TorchTileOps

OPTIONS = {
    "label_smoothing": 0.15,
    "class_weight": "random",
    "z_loss": 1e-3,
    "softcap": 2.5,
    "temperature": 0.7,
    "bias": True,
}


def _problem(n=37, h=24, v=131, dtype=torch.float32, ignore_every=5, bias=False):
    x = torch.randn(n, h, dtype=dtype)
    w = (torch.randn(v, h) * 0.3).to(dtype)
    y = torch.randint(0, v, (n,))
    if ignore_every:
        y[::ignore_every] = -100
    b = (torch.randn(v) * 0.1).to(dtype) if bias else None
    return x, w, y, b


def _kwargs(names):
    kw = {}
    for name in names:
        value = OPTIONS[name]
        if name == "bias":
            continue
        kw[name] = torch.rand(131) + 0.5 if value == "random" else value
    return kw


def _compare(x, w, y, b, kw, grad_out_kind="scalar", stats_grads=False, rtol=1e-5, backend="torch"):
    """Forward + backward through ours and the float64 reference; compares loss, stats and every gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    loss, stats = hf_flce.fused_linear_cross_entropy(
        leaves[0], leaves[1], y, leaves[2] if b is not None else None, return_stats=True, backend=backend, **kw
    )
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_kw = {k: v for k, v in kw.items() if k != "memory_budget"}
    ref_loss, ref_stats = reference_linear_cross_entropy(
        ref_leaves[0], ref_leaves[1], y, ref_leaves[2] if b is not None else None, **ref_kw
    )
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    torch.testing.assert_close(loss.double(), ref_loss, rtol=rtol, atol=rtol)
    for name in ("logprobs", "entropy", "lse", "mean_logit", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(stats, name).double(), ref_stats[name], rtol=rtol, atol=rtol, msg=name)
    assert torch.equal(stats.is_top1, ref_stats["is_top1"])

    upstream = torch.randn(loss.shape, dtype=torch.float64) if grad_out_kind == "random" else torch.ones(loss.shape)
    total = (loss * upstream.float()).sum()
    ref_total = (ref_loss * upstream.double()).sum()
    if stats_grads:
        g_lp, g_ent = torch.randn(y.shape), torch.randn(y.shape)
        total = total + (stats.logprobs * g_lp).sum() + (stats.entropy * g_ent).sum()
        ref_total = (
            ref_total + (ref_stats["logprobs"] * g_lp.double()).sum() + (ref_stats["entropy"] * g_ent.double()).sum()
        )
    grads = torch.autograd.grad(total, leaves)
    ref_grads = torch.autograd.grad(ref_total, ref_leaves)
    for g, r, name in zip(grads, ref_grads, ("hidden", "weight", "bias")):
        assert g.dtype == leaves[0].dtype
        torch.testing.assert_close(g.double(), r, rtol=rtol * 10, atol=rtol, msg=f"grad {name}")


@pytest.mark.parametrize("names", [()] + [(n,) for n in OPTIONS] + list(itertools.combinations(OPTIONS, 2)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_options_and_pairs_match_reference(names, reduction):
    x, w, y, b = _problem(bias="bias" in names)
    kw = _kwargs(names)
    _compare(x, w, y, b, {**kw, "reduction": reduction}, grad_out_kind="random" if reduction == "none" else "scalar")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("budget", [None, 3000, 131 * 4 * 3])
def test_stats_gradients_and_chunking(reduction, budget):
    x, w, y, b = _problem(bias=True)
    kw = {"reduction": reduction, "memory_budget": budget, "label_smoothing": 0.1, "z_loss": 1e-2}
    _compare(x, w, y, b, kw, grad_out_kind="random", stats_grads=True)


@pytest.mark.parametrize("backend", ["torch", "triton", "ascend"])
@pytest.mark.parametrize(
    "names",
    [(), ("label_smoothing", "class_weight", "bias"), ("softcap", "temperature", "z_loss")],
    ids=["plain", "smoothing-weights-bias", "softcap-temperature-zloss"],
)
@pytest.mark.parametrize("ignored", ["some", "all"])
def test_per_token_recompute_walks_the_vocabulary_in_column_chunks(backend, names, ignored):
    """Past the budget, a per-token loss's backward recomputes the logits by vocabulary chunks on the tile path too:
    every row per chunk, dW's rows written once, no [V, H] accumulator. V = 300 gives chunks of 128, 128 and 44
    columns, with targets on each side of their edges."""
    if backend != "torch" and torch.cuda.is_available():
        pytest.skip("CPU tensors: the Triton backends run them in the interpreter only (CUDA covers them elsewhere)")
    v = 300
    x, w, y, b = _problem(n=40, h=16, v=v, bias="bias" in names)
    y[1:8] = torch.tensor([0, 127, 128, 255, 256, 299, 143])
    if ignored == "all":
        y[:] = -100
    kw = {name: OPTIONS[name] for name in names if name not in ("bias", "class_weight")}
    if "class_weight" in names:
        kw["class_weight"] = torch.rand(v) + 0.5
    kw.update(reduction="none", memory_budget=40 * 128 * 4)
    widths = []
    real_logits = engine.compute_logits

    def logits_of(x_rows, w_rows, *args, **kwargs):
        widths.append(w_rows.shape[0])
        return real_logits(x_rows, w_rows, *args, **kwargs)

    with (
        mock.patch.object(engine, "_recompute_by_columns", wraps=engine._recompute_by_columns) as by_columns,
        mock.patch.object(engine, "compute_logits", side_effect=logits_of),
        # the Ascend backend keeps up to 1 GiB of logits whatever the budget
        mock.patch.object(engine, "_keep_limit", lambda plan, device: plan.budget),
    ):
        _compare(x, w, y, b, kw, grad_out_kind="random", stats_grads=True, backend=backend)
    if ignored == "some":
        assert by_columns.call_count == 1
        assert widths[-3:] == [128, 128, 44]


def test_cpu_16bit_column_chunks_budget_the_upcast_gradient():
    """On CPU the recomputed chunk's logits stay bf16 (2 bytes per logit, the gradient written over them), and dX's
    exact product upcasts that gradient to float32: 6 bytes per logit in all, so a budget of 256 columns at that size
    gives chunks of 256 columns, not the 768 that 2 bytes would allow."""
    x, w, y, _ = _problem(n=64, h=16, v=1024, dtype=torch.bfloat16, ignore_every=0)
    widths = []
    real_logits = engine.compute_logits

    def logits_of(x_rows, w_rows, *args, **kwargs):
        widths.append(w_rows.shape[0])
        return real_logits(x_rows, w_rows, *args, **kwargs)

    with mock.patch.object(engine, "compute_logits", side_effect=logits_of):
        _compare(x, w, y, None, {"reduction": "none", "memory_budget": 64 * 6 * 256}, "random", rtol=2e-2)
    assert widths[-4:] == [256] * 4  # after the forward's GEMM


def test_cpu_autocast_column_chunks_upcast_the_rows_once_within_the_budget():
    """Under bf16 autocast with float32 weights, a recomputing backward's dW rows are an exact float32 product, which
    CPU upcasts: the kept rows are upcast once (not per chunk), and their float32 bytes come out of the chunks'
    budget. The budget here allows 384 columns of 6 bytes per logit plus those rows; 256 once they are paid for."""
    n, h, v = 64, 16, 2048
    x, w, y, _ = _problem(n=n, h=h, v=v, ignore_every=0)
    budget = n * 6 * 384 - 1 + n * h * 4
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    widths, upcasts = [], []
    real_logits, real_float = engine.compute_logits, torch.Tensor.float

    def logits_of(x_rows, w_rows, *args, **kwargs):
        widths.append(w_rows.shape[0])
        return real_logits(x_rows, w_rows, *args, **kwargs)

    def counted_float(t):
        if t.dtype == torch.bfloat16 and t.shape == (n, h):
            upcasts.append(t.shape)
        return real_float(t)

    weights = torch.randn(n)
    with mock.patch.object(engine, "compute_logits", side_effect=logits_of):
        with mock.patch.object(torch.Tensor, "float", counted_float):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = hf_flce.fused_linear_cross_entropy(xs, ws, y, reduction="none", memory_budget=budget)
            (losses * weights).sum().backward()
    assert [w for w in widths if w != v] == [256] * 8 and len(upcasts) == 1  # the forward's logits are whole rows
    assert ws.grad.dtype == torch.float32 and xs.grad.dtype == torch.float32
    # against float64 on the operands autocast gives the GEMMs
    xr = x.bfloat16().double().requires_grad_()
    wr = w.bfloat16().double().requires_grad_()
    ref, _ = reference_linear_cross_entropy(xr, wr, y, reduction="none")
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(losses.double(), ref, rtol=2e-2, atol=2e-2)
    for got, want in ((ws.grad, wr.grad), (xs.grad, xr.grad)):
        assert ((got.double() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize(
    "n,h,v",
    [(1, 8, 17), (2, 5, 257), (13, 7, 97), (64, 3, 1000), (0, 8, 11)],
    ids=["one-token", "V-prime", "odd", "many-chunks", "zero-rows"],
)
def test_odd_sizes(n, h, v):
    x, w, y, b = _problem(n, h, v, ignore_every=0, bias=True)
    _compare(x, w, y, b, {"memory_budget": 2 * v * 16})
    _compare(x, w, y, b, {"reduction": "none", "memory_budget": 2 * v * 16}, grad_out_kind="random")


def test_num_items_in_batch_forms():
    x, w, y, _ = _problem()
    for num in (29, 29.0, torch.tensor(29.0), torch.tensor(29)):
        _compare(x, w, y, None, {"num_items_in_batch": num})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction):
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    y = torch.full((6,), -100)
    loss = hf_flce.fused_linear_cross_entropy(x, w, y, reduction=reduction)
    assert torch.all(loss == 0)
    loss.sum().backward()
    assert torch.all(x.grad == 0) and torch.all(w.grad == 0)
    assert not torch.isnan(loss).any()
    num = hf_flce.fused_linear_cross_entropy(x, w, y, num_items_in_batch=0)
    assert num.item() == 0


# float32 on CPU (the torch backend); bf16 on a CUDA GPU, the default path there (the epilogue GEMM on Hopper)
DEFAULT_PATHS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _leaves(device: str, n: int = 24, h: int = 64, v: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(n, h, device=device).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_()
    return x, w


@pytest.mark.parametrize("device", DEFAULT_PATHS)
def test_zero_denominator_gives_zero_loss_and_grads(device):
    """Nothing to average over gives 0, not NaN and not the undivided sum: a zero ``num_items_in_batch`` with kept
    targets (stock: inf), class weights 0 at every target with label smoothing (stock: NaN)."""
    x, w = _leaves(device)
    y = torch.randint(0, 299, (24,), device=device)
    only_last_class = torch.zeros(300, device=device)
    only_last_class[299] = 1.0
    calls = (
        dict(num_items_in_batch=0),
        dict(num_items_in_batch=torch.tensor(0, device=device)),
        dict(class_weight=only_last_class, label_smoothing=0.2),
    )
    for options in calls:
        x.grad = w.grad = None
        loss = hf_flce.fused_linear_cross_entropy(x, w, y, **options)
        want, _ = reference_linear_cross_entropy(x.double(), w.double(), y, **options)
        assert loss.item() == 0 and want.item() == 0, options
        loss.backward()
        assert torch.all(x.grad == 0) and torch.all(w.grad == 0), options


@pytest.mark.parametrize("device", DEFAULT_PATHS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_graph_of_the_gradient_is_refused(reduction, device):
    """The gradients are formed by kernels autograd does not record: ``create_graph=True`` raises rather than give a
    second derivative of 0. A plain backward still works after it."""
    x, w = _leaves(device)
    y = torch.randint(0, 300, (24,), device=device)
    loss = hf_flce.fused_linear_cross_entropy(x, w, y, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="no second derivative.*create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True, retain_graph=True)
    (gx,) = torch.autograd.grad(loss, x)
    stock = F.cross_entropy((x @ w.T).float(), y, reduction="mean" if reduction == "mean" else "sum")
    tolerance = {} if device == "cpu" else dict(rtol=2e-2, atol=1e-3)  # bf16 against bf16 logits
    torch.testing.assert_close(gx, torch.autograd.grad(stock, x)[0], **tolerance)


def test_leading_shape_and_non_contiguous_hidden():
    base = torch.randn(3, 24, 9)
    x = base.transpose(1, 2)  # [3, 9, 24], non-contiguous
    w = torch.randn(50, 24)
    y = torch.randint(0, 50, (3, 9))
    loss = hf_flce.fused_linear_cross_entropy(x, w, y, reduction="none")
    assert loss.shape == (3, 9)
    ref = F.cross_entropy((x @ w.T).reshape(-1, 50), y.reshape(-1), reduction="none").reshape(3, 9)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_matches_stock_hf_loss_semantics():
    """Same number as transformers' ForCausalLMLoss on materialised logits (shift done by the caller)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    x = torch.randn(2, 11, 16)
    w = torch.randn(40, 16)
    labels = torch.randint(0, 40, (2, 11))
    labels[0, :4] = -100
    stock = ForCausalLMLoss(x @ w.T, labels, vocab_size=40, num_items_in_batch=torch.tensor(13.0))
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ours = hf_flce.fused_linear_cross_entropy(x, w, shifted, num_items_in_batch=torch.tensor(13.0))
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)


def test_gradcheck_small():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, -100, 6, 0, 3])

    def loss_and_stats(x, w):
        loss, stats = hf_flce.fused_linear_cross_entropy(
            x.float(), w.float(), y, reduction="none", return_stats=True, label_smoothing=0.1, softcap=3.0
        )
        return loss.double(), stats.logprobs.double(), stats.entropy.double()

    # The op computes in float32, so compare against float64 finite differences with float32-sized tolerances.
    assert torch.autograd.gradcheck(loss_and_stats, (x, w), eps=1e-3, atol=2e-3, rtol=2e-3)


def test_fp16_and_bf16_inputs_close_to_fp32_truth():
    for dtype in (torch.float16, torch.bfloat16):
        x, w, y, _ = _problem(dtype=dtype)
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        ref, _ = reference_linear_cross_entropy(xr, wr, y)
        ref.backward()
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = hf_flce.fused_linear_cross_entropy(xo, wo, y)
        loss.backward()
        assert xo.grad.dtype == dtype and wo.grad.dtype == dtype
        # bf16 has 8 mantissa bits: 1e-2 relative; fp16 has 11: 2e-3.
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
        assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
        for g, r in ((xo.grad, xr.grad), (wo.grad, wr.grad)):
            assert ((g.double() - r).norm() / r.norm()).item() < tol


def _ours_output(x, w, y, output, backend, budget):
    kw = dict(backend=backend, memory_budget=budget)
    if output == "mean":
        return hf_flce.fused_linear_cross_entropy(x, w, y, **kw)
    loss, stats = hf_flce.fused_linear_cross_entropy(x, w, y, reduction="none", return_stats=True, **kw)
    return {"loss": loss, "logprob": stats.logprobs, "entropy": stats.entropy}[output]


@pytest.mark.parametrize("backend", ["torch", "triton", "ascend"])
@pytest.mark.parametrize("output", ["mean", "loss", "logprob", "entropy"])
@pytest.mark.parametrize("peak", [0.0, 14.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("budget", [None, 40000], ids=["whole", "vocab-chunks"])
def test_float32_at_a_shared_logit_offset_is_as_precise_as_stock(backend, output, peak, budget):
    """Logits sharing an offset of 168 (lse ~ 170, as in the large-lse rows of some trained models), in float32: the
    value and the gradients against float64 are within stock float32's error. One float32 lse carries half an ulp of
    168 (7.6e-6) into every p_j, and the gradient's row sum with it, a bias along W's offset column that made the
    per-token gradients 14-150x less precise than stock's (the pair ``lse``, ``lse_low`` of ``backends.base``).
    The vocab-chunks budget makes the torch and Triton backends' per-token backward recompute the logits."""
    errors = offset_errors(output, peak, lambda x, w, y: _ours_output(x, w, y, output, backend, budget))
    for what, ours, stock in zip(("value", "dX", "dW"), errors["ours"], errors["stock"]):
        assert ours <= 1.5 * stock + 1e-6, (what, errors)


def _rounded_otherwise_in_backward(monkeypatch):
    """Makes the logits that backward recomputes come from another summation order (two GEMMs over halves of H, as
    a split-K kernel of another shape would), so that they differ from the forward's by float32 rounding."""
    real = engine.compute_logits
    in_backward = {"on": False}

    def compute_logits(x, w, bias=None, *args, **kwargs):
        if not in_backward["on"]:
            return real(x, w, bias, *args, **kwargs)
        h = x.shape[1] // 2
        halves = [real(x[:, s].contiguous(), w[:, s].contiguous(), None) for s in (slice(None, h), slice(h, None))]
        return (halves[0] + halves[1]) if bias is None else (halves[0] + halves[1] + bias)

    monkeypatch.setattr(engine, "compute_logits", compute_logits)
    return in_backward


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("output", ["loss", "logprob", "entropy"])
@pytest.mark.parametrize("peak", [0.0, 14.0], ids=["flat", "peaked"])
def test_float32_recompute_rounded_otherwise_than_the_forward(backend, output, peak, monkeypatch):
    """A per-token backward that recomputes the logits with another rounding than the forward's (cuBLAS picks its
    kernel by shape): its p_j = exp(t_j - lse) then sum to 1 + d with the forward's lse, and at a shared logit offset
    of 168 that bias along W's mean row took dX to 2-90x stock float32's error and dW to 15-42x at peaked rows.
    Each row brought to its exact sum (``engine._RowSumBalance``): dX within stock's error, dW within 3x (the two
    roundings of each row's lse remain; up to 2.3x stock's over seeds). 60000 bytes: row chunks of two or three rows
    in forward (one row would take the BLAS's GEMV, which rounds otherwise too), vocabulary chunks in backward."""
    in_backward = _rounded_otherwise_in_backward(monkeypatch)
    errors = offset_errors(output, peak, lambda x, w, y: _ours_output(x, w, y, output, backend, 60000), in_backward)
    (_, dx_ours, dw_ours), (_, dx_stock, dw_stock) = errors["ours"], errors["stock"]
    assert dx_ours <= 1.5 * dx_stock + 1e-6, errors
    assert dw_ours <= 3.0 * dw_stock + 1e-6, errors


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("chunks", ["vocabulary", "rows"])
def test_float32_recompute_row_sums_with_every_option(chunks, backend, monkeypatch):
    """The exact row sums that a recomputed float32 gradient is brought to (``engine._RowSumBalance``) carry the
    z-loss's ``2 z lse`` times dt/dz = 1 / temperature, while label smoothing's and class weights' terms sum to 0: a
    wrong sum would move each row's target column (and the bias's gradient there) by the difference. The Triton
    backend adds the target rows' share to dW and db by its deterministic ``add_target_rows``."""
    if chunks == "rows":
        monkeypatch.setenv("HF_FLCE_VOCAB_CHUNKS", "0")
    x, w, y, b = _problem(bias=True)
    kw = {**_kwargs(("label_smoothing", "class_weight", "temperature")), "z_loss": 0.05}
    kw.update(reduction="none", memory_budget=3000)
    _compare(x, w, y, b, kw, grad_out_kind="random", stats_grads=True, backend=backend)


def test_frozen_backbone_and_frozen_head():
    x, w, y, _ = _problem()
    w1 = w.clone().requires_grad_()
    hf_flce.fused_linear_cross_entropy(x, w1, y).backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0
    x2 = x.clone().requires_grad_()
    hf_flce.fused_linear_cross_entropy(x2, w, y).backward()
    assert x2.grad is not None and x2.grad.abs().sum() > 0


def test_no_grad_does_no_gradient_work(monkeypatch):
    from hf_flce import engine

    calls = []
    monkeypatch.setattr(engine._GradBuffers, "add", lambda *a: calls.append(1))
    x, w, y, _ = _problem()
    x.requires_grad_()
    with torch.no_grad():
        loss = hf_flce.fused_linear_cross_entropy(x, w, y)
    assert not loss.requires_grad and not calls
    hf_flce.fused_linear_cross_entropy(x.detach(), w, y)
    assert not calls


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing(use_reentrant):
    x, w, y, _ = _problem()
    lin = torch.nn.Linear(24, 24)
    w = w.clone().requires_grad_()

    def head(h):
        return hf_flce.fused_linear_cross_entropy(lin(h), w, y)

    xs = x.clone().requires_grad_()
    checkpoint(head, xs, use_reentrant=use_reentrant).backward()
    got = (xs.grad.clone(), w.grad.clone(), lin.weight.grad.clone())
    for t in (xs, w, lin.weight):
        t.grad = None
    head(xs).backward()
    for a, b in zip(got, (xs.grad, w.grad, lin.weight.grad)):
        torch.testing.assert_close(a, b)


def test_bf16_autocast_with_fp32_weights():
    x, w, y, _ = _problem()
    w = w.clone().requires_grad_()
    xs = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = hf_flce.fused_linear_cross_entropy(xs, w, y)
    loss.backward()
    assert w.grad.dtype == torch.float32 and xs.grad.dtype == torch.float32
    xr, wr = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(xr, wr).float(), y)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    assert ((w.grad - wr.grad).norm() / wr.grad.norm()) < 2e-2


def test_module_form():
    x, w, y, b = _problem(bias=True)
    module = hf_flce.FusedLinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    ref, _ = reference_linear_cross_entropy(x, w, y, b, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(module(x, w, y, b).double(), ref, rtol=1e-5, atol=1e-5)
    assert "label_smoothing=0.1" in repr(module)
    with pytest.raises(TypeError, match="unknown option"):
        hf_flce.FusedLinearCrossEntropyLoss(smoothing=0.1)


@pytest.mark.parametrize("stats", [False, True], ids=["loss", "logprobs+entropy"])
def test_per_token_backward_saves_the_kept_rows_alone(stats):
    """A per-token loss with prompt rows saves the kept rows of x for backward, not x itself (its ignored rows need
    not outlive the forward), and its gradients still match the float64 reference, zero at the ignored rows."""
    x, w, y, b = _problem(ignore_every=2, bias=True)
    y[-1] = -100  # ignored rows at both ends
    leaves = [t.requires_grad_() for t in (x, w, b)]
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = hf_flce.fused_linear_cross_entropy(x, w, y, b, reduction="none", return_stats=stats)
    n_kept = int((y != -100).sum())
    assert (n_kept, x.shape[1]) in shapes and tuple(x.shape) not in shapes
    gen = torch.Generator().manual_seed(1)
    ups = [torch.randn(x.shape[0], generator=gen) for _ in range(3)]
    if stats:
        loss, st = out
        objective = (loss * ups[0]).sum() + (st.logprobs * ups[1]).sum() + (st.entropy * ups[2]).sum()
    else:
        objective = (out * ups[0]).sum()
    grads = torch.autograd.grad(objective, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref_loss, ref_stats = reference_linear_cross_entropy(*ref_leaves[:2], y, ref_leaves[2], reduction="none")
    ref_objective = (ref_loss * ups[0].double()).sum()
    if stats:
        ref_objective = ref_objective + (ref_stats["logprobs"] * ups[1].double()).sum()
        ref_objective = ref_objective + (ref_stats["entropy"] * ups[2].double()).sum()
    for got, want in zip(grads, torch.autograd.grad(ref_objective, ref_leaves)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not grads[0][y == -100].any()


def test_per_token_call_does_not_keep_the_hidden_states_alive():
    """Between forward and backward a per-token call with ignored rows holds its kept rows, not the caller's hidden
    states (the model's last hidden state, freed as soon as nothing else needs it)."""
    x, w, y, _ = _problem(ignore_every=3)
    leaf = x.requires_grad_()
    hidden = leaf * 1.0  # a non-leaf, as a model's output is: its autograd node does not keep it
    alive = weakref.ref(hidden)
    loss = hf_flce.fused_linear_cross_entropy(hidden, w, y, reduction="none")
    del hidden
    gc.collect()
    assert alive() is None
    loss.sum().backward()
    ref_x = x.detach().double().requires_grad_()
    reference_linear_cross_entropy(ref_x, w.double(), y, reduction="none")[0].sum().backward()
    torch.testing.assert_close(leaf.grad.double(), ref_x.grad, rtol=1e-5, atol=1e-6)


def test_retain_graph_second_backward_is_exact():
    x, w, y, _ = _problem()
    x.requires_grad_()
    loss = hf_flce.fused_linear_cross_entropy(x, w, y, reduction="none")
    g = torch.randn_like(loss)
    (first,) = torch.autograd.grad(loss, x, g, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x, g)
    torch.testing.assert_close(first, second)


@pytest.mark.parametrize("prob_weighted", [False, True], ids=["ce", "dft"])
def test_retain_graph_second_backward_of_a_scalar_loss(prob_weighted):
    # The scalar path hands its forward-computed gradients to the first backward (scaled in place); a second backward
    # recomputes them from the saved statistics.
    x, w, y, b = _problem(bias=True)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    loss = hf_flce.fused_linear_cross_entropy(x, w, y, b, label_smoothing=0.1, prob_weighted=prob_weighted)
    g = torch.tensor(0.37)
    first = torch.autograd.grad(loss, leaves, g, retain_graph=True)
    second = torch.autograd.grad(loss, leaves, g)
    for a, c in zip(first, second):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


def _saved_for_weight_grad_vs_reference(x, w, y, b, kw, backend="torch", dtype=torch.float64):
    """Loss, dX and db with the loss, dW from ``save_for_weight_grad`` later; returns ours and the float64
    reference's gradients (hidden, weight[, bias])."""
    leaves = [x.detach().clone().requires_grad_()] + ([] if b is None else [b.detach().clone().requires_grad_()])
    saved = []
    loss = hf_flce.fused_linear_cross_entropy(
        leaves[0], w, y, None if b is None else leaves[1], save_for_weight_grad=saved.append, backend=backend, **kw
    )
    upstream = torch.tensor(0.37)
    grads = list(torch.autograd.grad(loss, leaves, upstream))
    assert len(saved) == 1 and saved[0].plan.save_for_weight_grad is None
    grads.insert(1, saved[0].weight_grad(upstream.to(loss.device)))
    ref_leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    ref_kw = {k: v for k, v in kw.items() if k != "memory_budget"}
    ref_loss = reference_linear_cross_entropy(
        ref_leaves[0], ref_leaves[1], y, ref_leaves[2] if b is not None else None, **ref_kw
    )[0]
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-5, atol=1e-5)
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves, upstream.to(dtype))
    return grads, ref_grads


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"label_smoothing": 0.15, "z_loss": 1e-3, "softcap": 2.5, "temperature": 0.7, "bias": True},
        {"class_weight": "random", "num_items_in_batch": 53},
        {"prob_weighted": True, "reduction": "sum"},
    ],
    ids=["plain", "options", "class_weight", "dft"],
)
@pytest.mark.parametrize("budget, chunks", [(None, 1), (6000, 2)], ids=["one_chunk", "chunked"])
def test_weight_grad_saved_for_later(kw, budget, chunks):
    """``save_for_weight_grad``: dX and db come with the loss, dW later from the saved lse, each as the float64
    reference's. dW is recomputed by vocabulary chunks: one within the budget, several past it."""
    x, w, y, b = _problem(bias=kw.get("bias", False))
    kw = {k: torch.rand(131) + 0.5 if v == "random" else v for k, v in kw.items() if k != "bias"}
    planned = []

    def plan(n_rows, vocab, *args):
        planned.append(-(-vocab // engine_plan(n_rows, vocab, *args)))
        return engine_plan(n_rows, vocab, *args)

    engine_plan = engine.plan_chunk_columns
    with mock.patch.object(engine, "plan_chunk_columns", plan):
        grads, ref_grads = _saved_for_weight_grad_vs_reference(x, w, y, b, {**kw, "memory_budget": budget})
    assert planned == [chunks]
    for g, r, name in zip(grads, ref_grads, ("hidden", "weight", "bias")):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=f"grad {name}")


@pytest.mark.parametrize("n, ignore_every", [(1, 0), (9, 1)], ids=["one_token", "every_row_ignored"])
def test_weight_grad_saved_for_later_edge_rows(n, ignore_every):
    x, w, y, _ = _problem(n=n, v=257, ignore_every=ignore_every)
    grads, ref_grads = _saved_for_weight_grad_vs_reference(x, w, y, None, {"memory_budget": 600})
    if ignore_every == 1:
        assert all(torch.count_nonzero(g) == 0 for g in grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


def test_weight_grad_saved_for_later_with_more_rows_than_classes():
    """dW alone has no float32 dX sum: its vocabulary chunks' ``[rows, H]`` buffer is the gathered rows only, within
    a ``[V, H]`` accumulator up to V rows, where counting a dX sum too sent more than V / 2 rows to row chunks (200
    kept of 250 with 257 classes)."""
    x, w, y, _ = _problem(n=250, v=257, ignore_every=5)
    with mock.patch.object(engine, "_recompute_by_columns", wraps=engine._recompute_by_columns) as by_columns:
        grads, ref_grads = _saved_for_weight_grad_vs_reference(x, w, y, None, {})
    assert by_columns.call_count == 1
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


def test_weight_grad_saved_for_later_bad_input():
    x, w, y, _ = _problem()
    with pytest.raises(ValueError, match="needs the weight detached"):
        hf_flce.fused_linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), y, save_for_weight_grad=print)
    with pytest.raises(ValueError, match="save_for_weight_grad needs a scalar reduction"):
        hf_flce.fused_linear_cross_entropy(x, w.detach(), y, reduction="none", save_for_weight_grad=print)
    with pytest.raises(TypeError, match="save_for_weight_grad must be callable"):
        hf_flce.fused_linear_cross_entropy(x, w.detach(), y, save_for_weight_grad=1)


# ---------------------------------------------------------------------------------------------- bad input
def _bad(match, exc=ValueError, **overrides):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), target=torch.randint(0, 10, (4,)))
    kw = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    with pytest.raises(exc, match=match):
        hf_flce.fused_linear_cross_entropy(args["hidden"], args["weight"], args["target"], **kw)


@pytest.mark.parametrize("compact", [True, False])
def test_kept_rows_checks_the_range_and_compacts(compact):
    target = torch.tensor([3, -100, 0, 9, -100, 5])
    rows, ys = engine.kept_rows(target, 10, -100, compact)
    if compact:
        assert rows.tolist() == [0, 2, 3, 5] and ys.tolist() == [3, 0, 9, 5]
    else:
        assert rows is None and ys is target
    # every row kept: no index
    assert engine.kept_rows(torch.tensor([1, 2]), 10, -100, compact)[0] is None
    # the bad value is named, whether it lies below 0 or at V, and an ignore_index inside [0, V) is not checked
    for bad in (10, -1, 12):
        with pytest.raises(ValueError, match=f"target contains {bad}, outside \\[0, V=10\\)"):
            engine.kept_rows(torch.tensor([0, bad, -100]), 10, -100, compact)
    rows, ys = engine.kept_rows(torch.tensor([4, 0, 7]), 10, 0, compact)
    assert ys.tolist() == ([4, 7] if compact else [4, 0, 7])
    assert engine.kept_rows(torch.zeros(0, dtype=torch.long), 10, -100, compact)[1].numel() == 0


def test_stats_are_not_scattered_unless_asked_for():
    hidden, weight = torch.randn(6, 8), torch.randn(10, 8)
    target = torch.tensor([1, -100, 2, 3, -100, 4])
    with mock.patch.object(engine, "_scatter_rows", wraps=engine._scatter_rows) as scatter:
        hf_flce.fused_linear_cross_entropy(hidden, weight, target)
        assert scatter.call_count == 0
        _, stats = hf_flce.fused_linear_cross_entropy(hidden, weight, target, return_stats=True)
        assert scatter.call_count == 6
    ref = torch.log_softmax(hidden @ weight.T, -1)
    kept = target != -100
    torch.testing.assert_close(stats.logprobs[kept], ref[kept].gather(1, target[kept, None])[:, 0])
    assert torch.all(stats.logprobs[~kept] == 0) and torch.all(stats.lse[~kept] == 0)


@pytest.mark.parametrize("ignored", [False, True])
def test_stats_can_be_modified_in_place(ignored):
    """Each returned statistic is its own tensor, not one of several views of a buffer (autograd forbids in-place
    changes to those), with or without dropped rows."""
    hidden = torch.randn(6, 8, requires_grad=True)
    target = torch.tensor([1, -100, 2, 3, -100, 4]) if ignored else torch.tensor([1, 0, 2, 3, 5, 4])
    loss, stats = hf_flce.fused_linear_cross_entropy(
        hidden, torch.randn(10, 8), target, reduction="none", return_stats=True
    )
    for name in ("logprobs", "entropy", "lse", "mean_logit", "log_sum_sq_probs"):
        value = getattr(stats, name)
        before = value.clone()
        value.mul_(2)
        torch.testing.assert_close(value, before * 2)
    loss.mul_(2)


def test_bad_inputs_are_named():
    _bad("outside \\[0, V=10\\)", target=torch.tensor([0, 10, 1, 2]))
    _bad("outside \\[0, V=10\\)", target=torch.tensor([0, -1, 1, 2]))
    _bad("hidden size mismatch", hidden=torch.randn(4, 7))
    _bad("V=0 classes", weight=torch.randn(0, 8))
    _bad("H=0 features", hidden=torch.randn(4, 0), weight=torch.randn(10, 0))
    _bad("target shape", target=torch.randint(0, 10, (5,)))
    _bad("integer", TypeError, target=torch.rand(4))
    _bad("same dtype", TypeError, weight=torch.randn(10, 8, dtype=torch.float64).to(torch.bfloat16))
    _bad("float32, bfloat16 or float16", TypeError, hidden=torch.randn(4, 8, dtype=torch.float64))
    _bad("reduction must be one of", reduction="avg")
    _bad("backend must be one of", backend="cuda")
    _bad("label_smoothing must be in", label_smoothing=1.5)
    _bad("label_smoothing must be in", label_smoothing=-0.1)
    _bad("temperature must be > 0", temperature=0.0)
    _bad("softcap must be > 0", softcap=-1.0)
    _bad("z_loss must be >= 0", z_loss=-1.0)
    _bad("memory_budget must be > 0", memory_budget=0)
    _bad("bias must have shape", bias=torch.randn(9))
    _bad("class_weight must have shape", class_weight=torch.rand(3))
    _bad("cannot be combined", reduction="none", num_items_in_batch=4)
    _bad("num_items_in_batch must be", TypeError, num_items_in_batch="4")
    _bad("weight must be 2-D", weight=torch.randn(10, 8, 1))
    _bad("return_stats must be a bool or a collection", TypeError, return_stats="entropy")
    _bad("return_stats must be a bool or a collection", TypeError, return_stats=1)
    _bad("unknown stats \\['logits'\\]", return_stats={"entropy", "logits"})
    _bad("prob_weighted must be a bool", TypeError, prob_weighted=1)
    meta = torch.randn(10, 8, device="meta")
    _bad("device mismatch", weight=meta)


def test_return_stats_by_name():
    """A collection of field names returns FLCEStats; the named fields equal those of ``return_stats=True``."""
    x, w, y, _ = _problem()
    loss_all, every = hf_flce.fused_linear_cross_entropy(x, w, y, return_stats=True)
    loss, some = hf_flce.fused_linear_cross_entropy(x, w, y, return_stats=("entropy", "is_top1", "logprobs"))
    torch.testing.assert_close(loss, loss_all)
    for name in ("logprobs", "lse", "entropy", "is_top1"):
        torch.testing.assert_close(getattr(some, name), getattr(every, name))
    assert isinstance(hf_flce.fused_linear_cross_entropy(x, w, y, return_stats=[])[1], hf_flce.FLCEStats)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter refusal")
def test_triton_backend_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _bad("runs on CUDA", backend="triton")
    _bad("runs on NPU", backend="ascend")


def test_ignore_index_custom_value():
    x, w, y, _ = _problem(ignore_every=0)
    y[::3] = 7  # a valid class id used as ignore_index
    ours = hf_flce.fused_linear_cross_entropy(x, w, y, ignore_index=7)
    ref = F.cross_entropy(x @ w.T, y, ignore_index=7)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}, {"num_items_in_batch": 41}])
def test_prob_weighted_is_dft(kw):
    """DFT (TRL's loss_type="dft"): each token's loss times its detached probability, on the 3-GEMM path."""
    x, w, y, b = _problem(bias=True)
    _compare(x, w, y, b, {**kw, "prob_weighted": True, "memory_budget": 3000})
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    _, stats = hf_flce.fused_linear_cross_entropy(*leaves, y, return_stats=True)
    logp = stats.logprobs
    dft = (-(logp * logp.exp().detach())).sum() / (y != -100).sum()
    ours = hf_flce.fused_linear_cross_entropy(x, w, y, prob_weighted=True)
    torch.testing.assert_close(ours, dft, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="prob_weighted=True needs a scalar reduction"):
        hf_flce.fused_linear_cross_entropy(x, w, y, prob_weighted=True, reduction="none")


def _target_apart(on: bool):
    """``HF_FLCE_TARGET_APART``: a 16-bit scalar loss's gradient with its target column apart (the default) or in."""
    return mock.patch.dict(os.environ, {"HF_FLCE_TARGET_APART": "1" if on else "0"})


def test_cpu_16bit_chunks_with_the_target_column_in_keep_dw_in_float32():
    # With the target column in the 16-bit gradient (HF_FLCE_TARGET_APART=0), several chunks of bf16 logits sum dW in
    # float32, seeded by a first chunk that is not rounded to bf16. Its error against float64 must match a single
    # chunk's (one bf16 GEMM, as stock) to within a few percent.
    torch.manual_seed(3)
    x, w, y, _ = _problem(n=1024, h=64, v=512, dtype=torch.bfloat16, ignore_every=7)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref, _ = reference_linear_cross_entropy(xr, wr, y)
    ref.backward()
    errors = {}
    for budget in (None, 64 * 512 * 6):  # one chunk; 14 chunks of <= 64 rows (2 B/logit + the float32 upcast)
        wo = w.clone().requires_grad_()
        with _target_apart(False), mock.patch.object(engine, "compute_logits", wraps=engine.compute_logits) as gemms:
            hf_flce.fused_linear_cross_entropy(x, wo, y, memory_budget=budget).backward()
        assert gemms.call_count == (1 if budget is None else 14)
        errors[budget] = ((wo.grad.double() - wr.grad).norm() / wr.grad.norm()).item()
    assert errors[64 * 512 * 6] <= 1.05 * errors[None] + 1e-4, errors

    from hf_flce.engine import dw_product

    g = torch.randn(300, 40).bfloat16()
    xs = torch.randn(300, 24).bfloat16()
    exact = g.double().T @ xs.double()
    assert ((dw_product(g, xs).double() - exact).norm() / exact.norm()).item() < 1e-6


# the torch backend on CPU, and on a CUDA GPU (cuBLAS float32 logits, the gradient in their rows' tails)
TORCH_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _stock_grads(x, w, y, kw) -> tuple[torch.Tensor, torch.Tensor]:
    """dX and dW as stock HF computes them: 16-bit logits from the 16-bit GEMM, the loss on them in float32, the
    logits' gradient rounded to 16 bits, and one 16-bit GEMM each for dX and dW."""
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = F.linear(xs, ws).float()
    if kw.get("softcap") is not None:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    z = z / kw.get("temperature", 1.0)
    cw, eps = kw.get("class_weight"), kw.get("label_smoothing", 0.0)
    loss = F.cross_entropy(z, y, weight=cw, label_smoothing=eps)
    if kw.get("z_loss"):
        loss = loss + kw["z_loss"] * torch.logsumexp(z[y != -100], dim=1).square().mean()
    loss.backward()
    return xs.grad, ws.grad


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("frequent", [0, 16], ids=["bf16-sum", "16-frequent-in-fp32"])
@pytest.mark.parametrize("peaked", [False, True], ids=["flat", "peaked"])
@pytest.mark.parametrize("names", [(), ("label_smoothing", "z_loss"), ("softcap", "temperature", "class_weight")])
def test_16bit_chunks_sum_dw_in_the_gradient_with_the_target_column_apart(names, peaked, frequent, device):
    # By default a bf16 scalar loss on the torch backend takes its gradient with the target column apart (its
    # forward_target_apart): dW is summed across chunks in the bf16 gradient itself, with no float32 [V, H] sum, and
    # each target row gets its float32 term once. The loss is the column-in path's (whose dW is summed in float32),
    # and so is dX's error against float64; dW's is within stock's (target 4). But for a softcap that the peaked rows
    # saturate: there the target column's gradient is ~0 (tanh' at the cap), the softmax part is all of dW, and the
    # bf16 sum rounds it once per chunk (twice on a CUDA GPU, where cuBLAS rounds a 16-bit addmm_'s product before
    # adding it; docs/PERF_NOTES.md v58): at these 8-9 chunks 1.66x stock's error on CPU, 1.65x on an H100
    # (HF_FLCE_DW_FP32_SUM=1 keeps the float32 sum).
    torch.manual_seed(6)
    n, v = 1024, 4096
    x, w, y, _ = _problem(n=n, h=64, v=v, dtype=torch.bfloat16, ignore_every=7)
    if peaked:
        x = (x.float() + 4.0 * w.float()[y.clamp(min=0)]).bfloat16()
    kw = {name: OPTIONS[name] for name in names if name != "class_weight"}
    if "class_weight" in names:
        kw["class_weight"] = torch.rand(v) + 0.5
    leaves = (x.double().requires_grad_(), w.double().requires_grad_())
    ref, _ = reference_linear_cross_entropy(
        *leaves, y, **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()}
    )
    ref.backward()

    kw = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()}
    x, w, y = x.to(device), w.to(device), y.to(device)

    def grads(apart: bool, budget: int | None):
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        with _target_apart(apart), mock.patch.object(engine, "compute_logits", wraps=engine.compute_logits) as gemms:
            loss = hf_flce.fused_linear_cross_entropy(xo, wo, y, memory_budget=budget, backend="torch", **kw)
            loss.backward()
        return loss.detach().cpu(), xo.grad.cpu(), wo.grad.cpu(), gemms.call_count

    # about 110 rows per chunk: 8-9 chunks of bf16 logits on CPU, of float32 logits and the pass's scratch elsewhere
    budget = 113 * v * (2 if device == "cpu" else 16)
    no_fp32_sum = mock.patch.object(engine, "dw_product", side_effect=AssertionError("a float32 dW sum"))
    apart_calls = mock.patch.object(
        TorchTileOps, "forward_target_apart", autospec=True, side_effect=TorchTileOps.forward_target_apart
    )
    frequent_classes = mock.patch.dict(os.environ, {engine._FrequentClassRows.COUNT_ENV: str(frequent)})
    with no_fp32_sum, apart_calls as apart, frequent_classes:
        new = grads(True, budget)
    assert new[3] >= 8 and apart.call_count == new[3]
    old = grads(False, budget)
    stock = _stock_grads(x, w, y, kw)
    torch.testing.assert_close(new[0], old[0], rtol=1e-6, atol=0.0)
    assert new[1].dtype == new[2].dtype == torch.bfloat16
    dx_err, dw_err = rel_err(new[1], leaves[0].grad), rel_err(new[2], leaves[1].grad)
    assert dx_err <= 1.05 * rel_err(old[1], leaves[0].grad), dx_err
    saturated = peaked and "softcap" in names
    margin = 1.8 if saturated else 1.05
    assert dw_err <= margin * rel_err(stock[1].cpu(), leaves[1].grad), dw_err


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("case", ["all-ignored", "one-token"])
def test_16bit_target_column_apart_edge_rows(case, device):
    # Every row ignored: loss 0 and zero gradients; one token: the gradients of the float64 reference.
    n = 1 if case == "one-token" else 9
    x, w, y, _ = _problem(n=n, h=16, v=150, dtype=torch.bfloat16, ignore_every=1 if case == "all-ignored" else 0)
    xo, wo = x.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
    with _target_apart(True):
        loss = hf_flce.fused_linear_cross_entropy(xo, wo, y.to(device), memory_budget=4096, backend="torch")
        loss.backward()
    loss, dx, dw = loss.detach().cpu(), xo.grad.cpu(), wo.grad.cpu()
    if case == "all-ignored":
        assert loss.item() == 0.0 and not dx.any() and not dw.any()
        return
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref, _ = reference_linear_cross_entropy(xr, wr, y)
    ref.backward()
    # the CPU's bf16 GEMM rounds the logits to bf16, as stock's does
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-3, atol=0.0)
    torch.testing.assert_close(dx.double(), xr.grad, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(dw.double(), wr.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("rows_per_block", [3, 7, 2048])
@pytest.mark.parametrize("layout", ["rows", "compacted", "float32-x", "hot"])
def test_target_rows_are_added_once_in_float32(rows_per_block, layout, device):
    # TargetApartGradient.add_target_rows: every target row of a 16-bit dW becomes dW[v] + sum_{y_i = v} c_i x_i,
    # summed in float32 and rounded once (within one bf16 rounding of the float64 value), across blocks of sorted rows
    # whose ends cut runs of one target; ignored rows add nothing, even with non-finite x; hot classes' terms go to
    # their float32 rows instead, and their dW rows are left as they were.
    from hf_flce.backends.torch_tiles import TargetApartGradient

    g = torch.Generator().manual_seed(11)
    n, h, v = 40, 6, 9
    dw = (torch.randn(v, h, generator=g) * 4).bfloat16()
    x = torch.randn(n + 5, h, generator=g)
    x_rows = torch.randperm(n + 5, generator=g)[:n] if layout == "compacted" else None
    x = x if layout == "float32-x" else x.bfloat16()
    target = torch.randint(0, v, (n,), generator=g)
    target[:12] = 4  # a long run of one class, cut by small blocks
    target[::9] = -100
    coef = torch.randn(n, generator=g)
    x_used = x[x_rows] if x_rows is not None else x[:n]
    x_used[target == -100] = float("nan")
    if x_rows is not None:
        x[x_rows] = x_used
    hot = None
    if layout == "hot":
        slot = torch.full((v,), -1, dtype=torch.int32)
        slot[torch.tensor([4, 7])] = torch.tensor([0, 1], dtype=torch.int32)
        hot = (slot, torch.zeros(2, h))
    out = dw.clone().to(device)
    on_device = [None if t is None else t.to(device) for t in (x, x_rows, target, coef)]
    hot_on_device = None if hot is None else tuple(t.clone().to(device) for t in hot)
    with mock.patch.object(TargetApartGradient, "TARGET_ROWS_BLOCK", rows_per_block):
        TargetApartGradient.add_target_rows(out, *on_device, -100, None, hot_on_device, torch.bfloat16)
    out = out.cpu()
    hot = None if hot is None else tuple(t.cpu() for t in hot_on_device)

    kept = target != -100
    terms = torch.zeros(v, h, dtype=torch.float64)
    terms.index_add_(0, target[kept], x_used[kept].bfloat16().double() * coef[kept, None].double())
    want = dw.double() + terms
    hot_classes = [4, 7] if hot is not None else []
    cold = torch.tensor([c not in hot_classes for c in range(v)])
    # one rounding to bf16: within half a unit in the last place (8 significant bits) of the float64 value, plus the
    # float32 sum's own error
    assert ((out.double() - want).abs() <= want.abs() * 2.0**-8 * 1.01 + 1e-6)[cold].all()
    if hot is not None:
        assert torch.equal(out[~cold], dw[~cold])
        torch.testing.assert_close(hot[1].double(), terms[hot_classes], rtol=1e-6, atol=1e-6)


def test_target_rows_into_a_float32_dw_in_two_blocks():
    # A float32 dW (the float32 sum, HF_FLCE_DW_FP32_SUM=1) takes the terms as they are, into its two row blocks.
    from hf_flce.backends.torch_tiles import TargetApartGradient

    g = torch.Generator().manual_seed(12)
    n, h, v = 30, 5, 11
    lower, upper = torch.randn(6, h, generator=g), torch.randn(5, h, generator=g)
    x = torch.randn(n, h, generator=g).bfloat16()
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = -100
    coef = torch.randn(n, generator=g)
    want = torch.cat((lower, upper)).double()
    kept = target != -100
    want.index_add_(0, target[kept], x[kept].double() * coef[kept, None].double())
    with mock.patch.object(TargetApartGradient, "TARGET_ROWS_BLOCK", 7):
        TargetApartGradient.add_target_rows(lower, x, None, target, coef, -100, upper)
    torch.testing.assert_close(torch.cat((lower, upper)).double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("apart", [False, True], ids=["column-in", "column-apart"])
@pytest.mark.parametrize("v", [131, 132])
@pytest.mark.parametrize("upstream", [1.0, 0.37])
def test_dw_summed_across_chunks_is_cast_into_its_own_memory(v, upstream, apart):
    # A 16-bit weight's dW summed over several chunks in float32 (with the target column in, or apart under
    # HF_FLCE_DW_FP32_SUM=1): the sum's two row blocks, the 16-bit result written over the first one's float32 values
    # in doubling spans (here from the 7th value on), the second block freed.
    torch.manual_seed(5)
    x, w, y, _ = _problem(n=400, h=48, v=v, dtype=torch.bfloat16, ignore_every=7)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref, _ = reference_linear_cross_entropy(xr, wr, y)
    (ref * upstream).backward()
    made = []

    class Spy(engine._SplitDWSum):
        FIRST = 7

        def __init__(self, vocab):
            super().__init__(vocab)
            made.append(self)

    wo = w.clone().requires_grad_()
    fp32_sum = mock.patch.dict(os.environ, {"HF_FLCE_DW_FP32_SUM": "1"})
    with mock.patch.object(engine, "_SplitDWSum", Spy), _target_apart(apart), fp32_sum:
        loss = hf_flce.fused_linear_cross_entropy(x, wo, y, memory_budget=16 * v * 2)
        (loss * upstream).backward()
    assert len(made) == 1 and made[0].split == -(-v // 2)
    torch.testing.assert_close(wo.grad.double(), wr.grad, rtol=2e-2, atol=2e-3)
    # the result lives in the first block's memory: 2 V H bytes, plus one row of float32 where V is odd
    assert wo.grad.untyped_storage().nbytes() == 4 * made[0].split * 48 == 2 * (v + v % 2) * 48
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-2, atol=1e-3)
    # split only for a 16-bit weight, and where the gradient is at least 1.5 chunks' buffers
    grad_bytes = v * 48 * 2
    assert engine._SplitDWSum.lowers_the_peak(w, torch.bfloat16, grad_bytes * 2 // 3)
    assert not engine._SplitDWSum.lowers_the_peak(w, torch.bfloat16, grad_bytes * 2 // 3 + 1)
    assert not engine._SplitDWSum.lowers_the_peak(w.float(), torch.float32, 0)


def test_cpu_top1_with_ties_and_nan_rows_is_argmax():
    # The CPU tile pass only runs argmax where the target logit equals the row max; ties and NaN rows must still
    # give exactly torch.argmax's answer (first index wins; NaN is the max).
    from hf_flce.backends.base import TileParams
    from hf_flce.backends.torch_tiles import TorchTileOps

    torch.manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(70, 50).to(dtype)
        z[:, 7] = z.max(1).values
        z[3, :] = float("nan")
        z[4, 9] = float("nan")
        y = torch.randint(0, 50, (70,))
        y[::2] = z.float().argmax(1)[::2]
        y[1::4] = 7
        y[5] = -100
        stats = TorchTileOps().forward(z, y, TileParams(50, -100, 0.0, 0.0, None, 1.0, None, None))
        assert torch.equal(stats.is_top1, (z.float().argmax(1) == y) & (y != -100))


def test_chunk_plan_puts_the_float32_accumulator_beside_the_budget():
    # Chunks get the whole budget; a float32 dW accumulator (4 V H bytes) comes on top of it, so one chunk is taken
    # whenever it costs no more than that accumulator plus a budget-sized chunk. dW summed in the gradient itself
    # (or not wanted) takes nothing.
    plan = engine.CallPlan(resolve_backend("torch", "cpu"), None, "scalar", lambda: None, budget=1000, grad_mode=True)
    weight = torch.empty(40, 10, dtype=torch.bfloat16)
    assert engine._accumulator_bytes(weight, True) == 1600
    assert engine._accumulator_bytes(weight.float(), True) == 1600
    assert engine._accumulator_bytes(weight, True, in_weight_dtype=True) == 0
    assert engine._accumulator_bytes(weight, False) == 0
    # 100 rows of 10 bytes: 1000 bytes, within the budget
    assert engine._plan_rows(plan.budget, 100, 10, 1.0, 0, False) == 100
    # 2000 bytes without an accumulator: two balanced chunks
    assert engine._plan_rows(plan.budget, 200, 10, 1.0, 0, False) == 100
    assert engine._plan_rows(plan.budget, 250, 10, 1.0, 0, False) == 84
    # with a 1600-byte accumulator 2000 bytes take one chunk; 10000 bytes take chunks of the budget
    assert engine._plan_rows(plan.budget, 200, 10, 1.0, 1600, False) == 200
    assert engine._plan_rows(plan.budget, 1000, 10, 1.0, 1600, False) == 100
    # 16-bit logits on CPU over several chunks: the float32 upcast of each chunk's gradient is budgeted (6 B/logit)
    assert engine._plan_rows(plan.budget, 1000, 10, 2.0, 1600, True) == 16


def test_chunk_plan_leaves_room_for_the_frequent_classes_rows():
    # From _FrequentClassRows.MIN_CHUNKS chunks on, a call holds the frequent classes' float32 dW rows beside its
    # chunks: the chunks get the budget less those, down to half of it.
    plan = engine.CallPlan(resolve_backend("torch", "cpu"), None, "scalar", lambda: None, budget=10**7, grad_mode=True)
    # one chunk, and 7 chunks: nothing is set aside
    assert engine._plan_rows_beside(plan, 9000, 1000, 1.0, 0, False, 50_000) == (9000, 10**7)
    assert engine._plan_rows_beside(plan, 70_000, 1000, 1.0, 0, False, 50_000) == (10_000, 10**7)
    # 8 chunks and more: 50 kB set aside, so 80_000 rows take 9 chunks
    chunk, budget = engine._plan_rows_beside(plan, 80_000, 1000, 1.0, 0, False, 50_000)
    assert budget == 10**7 - 50_000 and chunk == engine.plan_chunk_rows(80_000, 1000, 1.0, budget) == 8889
    assert engine._plan_rows_beside(plan, 80_000, 1000, 1.0, 0, False, 0) == (10_000, 10**7)
    # at most half of the budget
    assert engine._plan_rows_beside(plan, 80_000, 1000, 1.0, 0, False, 8 * 10**6) == (5000, 10**7 // 2)
    weight = torch.empty(3000, 64, dtype=torch.bfloat16)
    count = engine._FrequentClassRows.COUNT
    assert engine._FrequentClassRows.bytes_beside(weight, True) == 4 * count * 64 + 8 * 3000
    assert engine._FrequentClassRows.bytes_beside(weight, False) == 0
    with mock.patch.dict(os.environ, {engine._FrequentClassRows.COUNT_ENV: "0"}):
        assert engine._FrequentClassRows.bytes_beside(weight, True) == 0
