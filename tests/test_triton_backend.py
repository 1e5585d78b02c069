"""The Triton backend against the float64 reference (through the public API) and against the PyTorch tile passes.

Without a GPU the kernels run on CPU tensors in the Triton interpreter (how CI runs them); with one, the same tests
run the compiled kernels on CUDA tensors, and the ``gpu`` tests add real sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter is picked when the kernels are decorated.
    os.environ["TRITON_INTERPRET"] = "1"

import contextlib  # noqa: E402
import itertools  # noqa: E402
from dataclasses import replace  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import hf_flce  # noqa: E402
from hf_flce import engine  # noqa: E402
from hf_flce.backends import (  # noqa: E402
    resolve_backend,
    triton_gemm,
    triton_interpreting,
    triton_scaled,
    triton_tiles,
)
from hf_flce.backends.base import TileParams  # noqa: E402
from hf_flce.backends.torch_tiles import TorchTileOps  # noqa: E402
from hf_flce.backends.triton_tiles import TritonTileOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STAT_NAMES = ("logprobs", "entropy", "lse", "mean_logit", "log_sum_sq_probs")
# Blocks for the tile tests: a row of V = 257 spans three blocks, the last one ragged. Through the public API the
# interpreter's default block (256) gives two.
SMALL_BLOCK = 128


def make_inputs(n, h, v, *, dtype=torch.float32, bias=False, ignore_every=5, seed=0):
    """Logits with a spread of about 2; every ``ignore_every``-th target ignored; every third target the argmax, so
    that ``is_top1`` takes both values."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (2.0 / h**0.5)
    b = torch.randn(v, generator=gen) * 0.5 if bias else None
    target = torch.randint(0, v, (n,), generator=gen)
    if n:
        logits = hidden.double() @ weight.double().T + (0 if b is None else b.double())
        target[1::3] = logits[1::3].argmax(-1)
        if ignore_every:
            target[::ignore_every] = -100
    cast = [None if t is None else t.to(DEVICE, dtype) for t in (hidden, weight, b)]
    return cast[0], cast[1], target.to(DEVICE), cast[2]


def assert_close(actual, expected, tol, what):
    """Max error within ``tol`` times the largest expected magnitude (at least 1)."""
    expected = expected.detach().double()
    err = (actual.detach().double() - expected).abs().max().item() if expected.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} * {scale:.3g}"


def check(
    hidden, weight, target, bias=None, *, tol=1e-5, grad_tol=None, loss_grad=True, stat_grads=False, seed=1, **opts
):
    """Loss, every stat and the gradients of hidden, weight and bias against the float64 reference, for a random
    upstream gradient of the loss and (``stat_grads``) of the log-probs and the entropy."""
    grad_tol = tol if grad_tol is None else grad_tol
    budget = opts.pop("memory_budget", None)
    gen = torch.Generator().manual_seed(seed)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    ref_leaves = [None if t is None else t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    loss, stats = hf_flce.fused_linear_cross_entropy(
        leaves[0], leaves[1], target, leaves[2], backend="triton", return_stats=True, memory_budget=budget, **opts
    )
    ref_loss, ref_stats = hf_flce.reference_linear_cross_entropy(
        ref_leaves[0], ref_leaves[1], target, ref_leaves[2], **opts
    )
    stats = vars(stats)

    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert_close(loss, ref_loss, tol, "loss")
    for name in STAT_NAMES:
        assert_close(stats[name], ref_stats[name], tol, name)
    assert torch.equal(stats["is_top1"].cpu(), ref_stats["is_top1"].cpu()), "is_top1"

    upstream = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (loss, target, target)]
    for lo, st in ((loss, stats), (ref_loss, ref_stats)):
        terms = []
        if loss_grad:
            terms.append((lo * upstream[0].to(lo)).sum())
        if stat_grads:
            terms.append((st["logprobs"] * upstream[1].to(lo)).sum() + (st["entropy"] * upstream[2].to(lo)).sum())
        sum(terms).backward()
    for name, ours, ref in zip(("hidden", "weight", "bias"), leaves, ref_leaves):
        if ours is not None:
            assert ours.grad is not None and ours.grad.dtype == ours.dtype, name
            assert_close(ours.grad, ref.grad, grad_tol, f"grad of {name}")
    return loss, stats, leaves


# --- every option, and every pair of options, through the public API -------------------------------------------

OPTIONS = {
    "smoothing": dict(label_smoothing=0.1),
    "class_weight": dict(class_weight=True),
    "z_loss": dict(z_loss=1e-3),
    "softcap": dict(softcap=3.0),
    "temperature": dict(temperature=0.7),
    "bias": dict(bias=True),
}
CASES = [(), *((k,) for k in OPTIONS), *itertools.combinations(OPTIONS, 2), tuple(OPTIONS)]


def build(names, n=16, h=16, v=257, **kwargs):
    opts = {}
    for name in names:
        opts.update(OPTIONS[name])
    hidden, weight, target, bias = make_inputs(n, h, v, bias=opts.pop("bias", False), **kwargs)
    if opts.pop("class_weight", False):
        opts["class_weight"] = (torch.rand(v, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE)
    return hidden, weight, target, bias, opts


@pytest.mark.parametrize("names", CASES, ids=lambda c: "+".join(c) or "plain")
def test_options(names):
    hidden, weight, target, bias, opts = build(names)
    check(hidden, weight, target, bias, stat_grads=True, **opts)


@pytest.mark.parametrize(
    "reduction, num_items", [("mean", None), ("sum", None), ("none", None), ("mean", 13), ("mean", "tensor")]
)
@pytest.mark.parametrize("names", [(), ("smoothing", "class_weight", "z_loss")], ids=["plain", "weighted"])
def test_reductions(reduction, num_items, names):
    hidden, weight, target, bias, opts = build(names)
    if num_items == "tensor":
        num_items = torch.tensor(17.0, device=DEVICE)
    check(hidden, weight, target, bias, reduction=reduction, num_items_in_batch=num_items, **opts)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_stat_grads_without_loss_grad(reduction):
    hidden, weight, target, bias, opts = build(("softcap", "temperature"))
    check(hidden, weight, target, bias, loss_grad=False, stat_grads=True, reduction=reduction, **opts)


@pytest.mark.parametrize(
    "n, v, ignore_every",
    [(1, 257, 0), (2, 1, 0), (9, 300, 4), (16, 64, 3), (5, 130, 0)],
    ids=["one-token", "one-class", "ragged-tail", "exact-blocks", "two-blocks-plus-2"],
)
def test_odd_sizes(n, v, ignore_every):
    hidden, weight, target, bias, opts = build(("smoothing", "bias"), n=n, v=v, ignore_every=ignore_every)
    check(hidden, weight, target, bias, stat_grads=True, **opts)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    hidden, weight, target, bias, opts = build(("smoothing",), n=6)
    target = torch.full_like(target, -100)
    loss, stats, leaves = check(hidden, weight, target, bias, stat_grads=True, reduction=reduction, **opts)
    assert not loss.abs().sum() and not stats["is_top1"].any()
    assert not leaves[0].grad.abs().sum() and not leaves[1].grad.abs().sum()


def test_zero_num_items_in_batch_gives_zero():
    """A zero denominator with kept targets: loss and gradients 0 (stock: inf), on the tile path."""
    hidden, weight, target, bias, opts = build(("smoothing",), n=12)
    loss, _, leaves = check(hidden, weight, target, bias, num_items_in_batch=0, **opts)
    assert loss.item() == 0 and not leaves[0].grad.abs().sum() and not leaves[1].grad.abs().sum()


def test_zero_rows():
    hidden, weight, target, bias, opts = build(("z_loss",), n=0)
    loss, _, leaves = check(hidden, weight, target, bias, stat_grads=True, **opts)
    assert loss.item() == 0.0 and leaves[0].grad.shape == (0, 16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_several_chunks(reduction):
    # 257 float32 logits per row (plus scratch): a 4 KiB budget gives chunks of a few rows
    hidden, weight, target, bias, opts = build(("class_weight", "softcap"), n=20)
    check(hidden, weight, target, bias, stat_grads=True, reduction=reduction, memory_budget=4096, **opts)


@pytest.mark.parametrize("budget", [None, 4096], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp16_inputs(reduction, budget):
    # fp16 inputs and gradients: CPU GEMMs round their products to fp16, so ~1e-3 relative error. Several chunks:
    # the gradient over each float32 row's tail, dW through the float32 accumulator and the scaling cast.
    hidden, weight, target, bias, opts = build(("smoothing", "bias"), n=16)
    half = [None if t is None else t.half() for t in (hidden, weight, bias)]
    check(
        *half[:2],
        target,
        half[2],
        tol=2e-3,
        grad_tol=1e-2,
        stat_grads=True,
        reduction=reduction,
        memory_budget=budget,
        **opts,
    )


# --- the tile passes against the PyTorch ones ------------------------------------------------------------------


def tile_params(v, names=(), class_weight=None):
    opts = {}
    for name in names:
        opts.update(OPTIONS[name])
    cw = class_weight if opts.get("class_weight") else None
    return TileParams(
        vocab=v,
        ignore_index=-100,
        label_smoothing=opts.get("label_smoothing", 0.0),
        z_loss=opts.get("z_loss", 0.0),
        softcap=opts.get("softcap"),
        inv_temperature=1.0 / opts.get("temperature", 1.0),
        class_weight=cw,
        class_weight_sum=None if cw is None else cw.sum(),
    )


def random_logits(rows, v, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, v, generator=gen) * 3.0
    target = torch.randint(0, v, (rows,), generator=gen)
    target[3::5] = -100
    # ties for the max: the first index must win, whether or not it is the target
    top = logits.max() + 1.0
    logits[1, [7, 200 % v]] = top
    target[1] = 7
    logits[2, [9, 150 % v]] = top
    target[2] = 150 % v
    return logits.to(DEVICE), target.to(DEVICE)


def float64_tiles(logits, target, params, grad_scale):
    """The PyTorch tile passes in float64: the reference for the kernels' float32 statistics and gradients."""
    cw = params.class_weight
    params64 = replace(params, class_weight=None if cw is None else cw.double())
    if cw is not None:
        params64.class_weight_sum = params64.class_weight.sum()
    grad = torch.empty(logits.shape, dtype=torch.float64, device=DEVICE)
    stats = TorchTileOps().forward(logits.double(), target, params64, grad_scale.double(), grad)

    def backward(gl, glp, ge):
        out = torch.empty_like(grad)
        TorchTileOps().backward(logits.double(), target, stats.lse, stats.entropy, params64, gl, glp, ge, out)
        return out

    return stats, grad, backward


def assert_stats_close(ours, ref, tol=2e-6):
    for name in ("loss", "lse", "logprob", "entropy", "mean_logit", "log_sum_sq_probs"):
        assert_close(getattr(ours, name), getattr(ref, name), tol, name)
    assert torch.equal(ours.is_top1, ref.is_top1)


TILE_CASES = [(), ("smoothing", "class_weight", "z_loss"), ("softcap", "temperature"), tuple(OPTIONS)[:-1]]


@pytest.mark.parametrize("names", TILE_CASES, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize(
    "grad_dtype", [torch.float32, torch.bfloat16, "in-place", "row-tail"], ids=["fp32", "bf16", "in-place", "row-tail"]
)
def test_tiles_match_float64(names, grad_dtype):
    rows, v = 8, 257
    logits, target = random_logits(rows, v)
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE)
    params = tile_params(v, names, cw)
    tiles = TritonTileOps(block=SMALL_BLOCK)
    # "row-tail": a bf16 gradient over the second half of each float32 row's bytes (odd V: not element-aligned)
    in_place, row_tail = grad_dtype == "in-place", grad_dtype == "row-tail"
    dtype = torch.float32 if in_place else torch.bfloat16 if row_tail else grad_dtype
    grad_tol = 2e-6 if dtype == torch.float32 else 1e-2
    grad_scale = torch.rand(rows, device=DEVICE)
    ref, ref_grad, ref_backward = float64_tiles(logits, target, params, grad_scale)

    def fresh_grad():
        work = logits.clone()
        if row_tail:
            return work, work.view(torch.bfloat16)[:, v:]
        return work, (work if in_place else torch.empty(rows, v, dtype=dtype, device=DEVICE))

    work, grad = fresh_grad()
    ours = tiles.forward(work, target, params, grad_scale, grad)
    assert_stats_close(ours, ref)
    assert_close(grad, ref_grad, grad_tol, "forward grad")
    assert not grad[target == -100].any()

    gen = torch.Generator().manual_seed(4)
    upstream = [torch.randn(rows, generator=gen).to(DEVICE) for _ in range(3)]
    for keep in ((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)):
        gl, glp, ge = (u if k else None for u, k in zip(upstream, keep))
        work, grad = fresh_grad()
        tiles.backward(work, target, ours.lse, ours.entropy, params, gl, glp, ge, grad)
        ref_grad = ref_backward(*(None if g is None else g.double() for g in (gl, glp, ge)))
        assert_close(grad, ref_grad, grad_tol, f"backward grad {keep}")
        assert not grad[target == -100].any()


@pytest.mark.parametrize("ops", ["triton", "torch"])
def test_tiles_backward_over_a_vocabulary_chunk(ops):
    """A chunk of columns (``first_column=``) gets those columns of the whole row's gradient, the target's one-hot
    entry and the class weights placed by the offset; a chunk outside the vocabulary raises instead of indexing past
    it."""
    rows, v = 8, 257
    logits, target = random_logits(rows, v)
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE)
    params = tile_params(v, ("smoothing", "class_weight", "z_loss", "softcap"), cw)
    tiles = TritonTileOps(block=SMALL_BLOCK) if ops == "triton" else TorchTileOps()
    ref, _, ref_backward = float64_tiles(logits, target, params, torch.ones(rows, device=DEVICE))
    lse, entropy = ref.lse.float(), ref.entropy.float()
    gen = torch.Generator().manual_seed(5)
    gl, glp, ge = (torch.randn(rows, generator=gen).to(DEVICE) for _ in range(3))
    expected = ref_backward(gl.double(), glp.double(), ge.double())
    for first, last in ((0, 128), (128, 250), (250, v)):
        grad = torch.empty(rows, last - first, device=DEVICE)
        tiles.backward(logits[:, first:last].contiguous(), target, lse, entropy, params, gl, glp, ge, grad, first)
        assert_close(grad, expected[:, first:last], 2e-6, f"columns {first}:{last}")
    for first, last in ((-1, 9), (250, v + 1)):
        chunk = torch.zeros(rows, last - first, device=DEVICE)
        with pytest.raises(ValueError, match="pass the vocabulary"):
            tiles.backward(chunk, target, lse, entropy, params, gl, glp, ge, chunk.clone(), first)


def test_scale_into_in_place_and_cast():
    ops = TritonTileOps()
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(5003, generator=gen).to(DEVICE)
    # within one bf16 rounding: the interpreter's float32 -> bf16 conversion truncates, the GPU's rounds to nearest
    close = dict(rtol=2**-7, atol=0.0)
    for value in (1.0, 0.5, -3.0):
        scale = torch.tensor(value, device=DEVICE)
        g = src.to(torch.bfloat16)
        before = g.clone()
        # in place (a 16-bit gradient times the loss's upstream gradient); a scale of 1 leaves it as it is
        assert ops.scale_into(g, scale, g) is g
        if value == 1.0:
            assert torch.equal(g, before)
        else:
            torch.testing.assert_close(g.float(), before.float() * value, **close)
        # a float32 accumulator into a new 16-bit gradient: the cast happens whatever the scale
        out = torch.zeros(5003, dtype=torch.bfloat16, device=DEVICE)
        ops.scale_into(src, scale, out)
        torch.testing.assert_close(out.float(), src * value, **close)


def test_tiles_strided_rows_and_expanded_scale():
    rows, v = 6, 100
    logits, target = random_logits(rows, v + 28)
    target = target.clamp(max=v - 1)
    view = logits[:, :v]  # row stride 128 > V
    params = tile_params(v, ("smoothing",))
    scale = torch.tensor(0.5, device=DEVICE).expand(rows)
    ref, ref_grad, _ = float64_tiles(view, target, params, scale)
    padded = logits.clone()
    ours = TritonTileOps(block=32).forward(padded[:, :v], target, params, scale, padded[:, :v])
    assert_stats_close(ours, ref)
    assert_close(padded[:, :v], ref_grad, 2e-6, "grad")
    assert torch.equal(padded[:, v:], logits[:, v:]), "wrote outside its row"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter, about the NaN it computes
def test_tiles_non_finite_rows_give_nan():
    rows, v = 4, 257
    logits, target = random_logits(rows, v)
    target[:] = 5
    logits[0, 3] = float("nan")
    logits[1, 100] = float("inf")
    params = tile_params(v)
    grad = torch.empty(rows, v, device=DEVICE)
    stats = TritonTileOps(block=SMALL_BLOCK).forward(
        logits.clone(), target, params, torch.ones(rows, device=DEVICE), grad
    )
    # torch gives NaN or inf there (F.cross_entropy NaN, an inf logit off the target inf): not finite, no crash
    assert not stats.loss[:2].isfinite().any() and stats.lse[0].isnan()
    assert stats.loss[2:].isfinite().all() and grad[2:].isfinite().all()
    assert grad[:2].isnan().any(dim=1).all()


# --- the tile path's scalar gradient with its target column apart -------------------------------------------------


@pytest.mark.parametrize("names", TILE_CASES, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize("layout", ["bf16", "row-tail"])
def test_tiles_target_column_apart_match_float64(names, layout):
    """``forward_target_apart``: the statistics and the gradient off the target column are ``forward``'s, the target
    column is 0 in the 16-bit gradient and comes back in float32 as the gradient's ``target_coef`` (0 at ignored
    rows), with unit row scales."""
    rows, v = 8, 257
    logits, target = random_logits(rows, v)
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE)
    params = tile_params(v, names, cw)
    grad_scale = torch.rand(rows, device=DEVICE)
    ref, ref_grad, _ = float64_tiles(logits, target, params, grad_scale)
    work = logits.clone()
    out = work.view(torch.bfloat16)[:, v:] if layout == "row-tail" else torch.empty(rows, v, dtype=torch.bfloat16)
    out = out.to(DEVICE) if layout == "bf16" else out
    stats, grad = TritonTileOps(block=SMALL_BLOCK).forward_target_apart(work, target, params, grad_scale, out)
    assert_stats_close(stats, ref)
    assert grad.e is out and grad.row_scale is None and grad.target is target
    kept = target != -100
    at_target = torch.zeros(rows, v, dtype=torch.bool, device=DEVICE)
    at_target[kept, target[kept]] = True
    assert not out[at_target].any() and not out[~kept].any()
    assert_close(out[~at_target], ref_grad[~at_target], 1e-2, "gradient off the target column")
    assert grad.target_coef.dtype == torch.float32
    assert_close(grad.target_coef[kept], ref_grad[at_target], 2e-6, "target column")
    assert not grad.target_coef[~kept].any()


ONE_SWEEP_CASES = [
    (),
    ("z_loss",),
    ("softcap", "temperature"),
    ("softcap", "z_loss"),
    ("class_weight", "z_loss"),
    ("smoothing",),
    ("smoothing", "temperature", "z_loss"),
]


def one_sweep_inputs(rows=8, h=16, v=257, seed=0):
    """``x``, ``W`` and their float32 logits, with ``random_logits``' targets and ties for the max (rows 1 and 2,
    in two blocks: the first index must win though the sweep runs from the row's end); row 4 has a loss past
    ``REPAIR_ABOVE`` (its target 200 nats below the max) and row 5 one past ``E``'s float32 range (``t - t_y -
    REF_OFFSET`` over 88 nats at some column), both taken by ``exact_row``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.5
    _, target = random_logits(rows, v, seed)
    # random_logits' targets 7 (row 1, the first argmax) and 150 (row 2, the second)
    weight[200], weight[150] = weight[7], weight[9]
    x[1], x[2] = 3.0 * weight[7], 3.0 * weight[9]
    # one column of W as large as a row's needs: x_4 . w_c = 200 above its target's, x_5 . w_c = 150
    x[4], x[5] = x[4] * 0.1, x[5] * 0.1
    x[4, 0], x[5, 0] = 40.0, 30.0
    weight[3, 0] = 5.0
    target[4], target[5] = 10, 11
    x, weight = x.to(DEVICE), weight.to(DEVICE)
    return x, weight, x @ weight.T, target.to(DEVICE)


def one_sweep_buffers(logits: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of the float32 logits and the bf16 ``E`` the one sweep writes, over the second half of each logits row
    (``row-tail``) or apart (``bf16``), each buffer with a spare row after its last (for label smoothing's uniform
    term, ``ScaledGradient.dw_operands``)."""
    rows, v = logits.shape
    work = torch.empty(rows + 1, v, device=DEVICE)[:rows].copy_(logits)
    if layout == "row-tail":
        return work, work.view(torch.bfloat16)[:, v:]
    return work, torch.empty(rows + 1, v, dtype=torch.bfloat16, device=DEVICE)[:rows]


def test_spare_row():
    """``ScaledGradient.has_spare_row`` at each layout: a row after the last, at the row stride, in the buffer."""
    has_spare_row = triton_scaled.ScaledGradient.has_spare_row
    logits = torch.zeros(3, 5, device=DEVICE)
    for layout in ("row-tail", "bf16"):
        _, e = one_sweep_buffers(logits, layout)
        assert has_spare_row(e) and not has_spare_row(torch.empty_like(e))
    assert not has_spare_row(logits.view(torch.bfloat16)[:, 5:])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter, about row 5's overflowing E
@pytest.mark.parametrize("names", ONE_SWEEP_CASES, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize("layout", ["bf16", "row-tail"])
@pytest.mark.parametrize("repair_every_row", [False, True], ids=["default", "repair-every-row"])
def test_tiles_one_sweep_match_float64(names, layout, repair_every_row):
    """``forward_target_apart`` given the GEMM's operands (``one_sweep``): the statistics are ``forward``'s, the
    16-bit ``E`` times the row scales, plus label smoothing's uniform term, is the gradient off the target column,
    which is 0 in ``E`` and comes back in float32 (0 at ignored rows), also at rows past ``E``'s range
    (``exact_row``), and at every row when each is repaired (``REPAIR_ABOVE`` below 0)."""
    x, weight, logits, target = one_sweep_inputs()
    rows, v = logits.shape
    assert logits[1].argmax() == 7 and logits[1, 200] == logits[1, 7] and logits[2, 150] == logits[2].max()
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE)
    params = tile_params(v, names, cw)
    grad_scale = torch.rand(rows, device=DEVICE)
    ref, ref_grad, _ = float64_tiles(logits, target, params, grad_scale)
    if "softcap" not in names:  # a softcap bounds every loss
        assert (-ref.logprob[4:6] > triton_scaled.REPAIR_ABOVE).all()
    work, out = one_sweep_buffers(logits, layout)
    ops = TritonTileOps(block=SMALL_BLOCK)
    assert ops.one_sweep(out.dtype, params)
    repair = mock.patch.object(triton_scaled, "REPAIR_ABOVE", -1.0) if repair_every_row else contextlib.nullcontext()
    with repair:
        stats, grad = ops.forward_target_apart(work, target, params, grad_scale, out, x, weight)
    assert_stats_close(stats, ref)
    assert grad.e is out and grad.row_scale is not None and grad.target is target
    kept = target != -100
    at_target = torch.zeros(rows, v, dtype=torch.bool, device=DEVICE)
    at_target[kept, target[kept]] = True
    assert not out[at_target].any() and not out[~kept].any() and out.isfinite().all()
    assert not grad.row_scale[~kept].any() and not grad.target_coef[~kept].any()
    uniform = torch.zeros(rows, device=DEVICE)
    if "smoothing" in names:
        assert not grad.uniform_coef[~kept].any()
        uniform = grad.uniform_coef
        expected = -params.label_smoothing / v * params.inv_temperature * grad_scale
        assert_close(uniform[kept], expected[kept], 2e-6, "uniform term")
    else:
        assert grad.uniform_coef is None
    assert grad.w_sum is None  # dX's GEMM gives W's column sum (ScaledGradient.dx_operand)
    g = grad.row_scale[:, None] * out.float() + uniform[:, None]
    assert_close(g[~at_target], ref_grad[~at_target], 1e-2, "gradient off the target column")
    assert_close(grad.target_coef[kept] + uniform[kept], ref_grad[at_target], 2e-6, "target column")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter, about row 5's overflowing E
def test_tiles_one_sweep_only_where_it_applies():
    """fp16 (``E``'s range), label smoothing with class weights (a smoothing term that differs by column) or with a
    softcap (``dt`` that does) keep the two sweeps and unit row scales; so does ``HF_FLCE_SCALED_GRAD=0``, and label
    smoothing without a spare row under ``E``. Class weights alone take the one sweep."""
    x, weight, logits, target = one_sweep_inputs()
    v = logits.shape[1]
    bf16, fp16 = torch.bfloat16, torch.float16
    cw = torch.ones(v, device=DEVICE)
    assert TritonTileOps.one_sweep(bf16, tile_params(v, ("z_loss", "softcap")))
    assert not TritonTileOps.one_sweep(fp16, tile_params(v))
    assert TritonTileOps.one_sweep(bf16, tile_params(v, ("class_weight",), cw))
    assert TritonTileOps.one_sweep(bf16, tile_params(v, ("smoothing", "temperature")))
    assert not TritonTileOps.one_sweep(bf16, tile_params(v, ("smoothing", "class_weight"), cw))
    assert not TritonTileOps.one_sweep(bf16, tile_params(v, ("smoothing", "softcap")))
    with mock.patch.dict(os.environ, {"HF_FLCE_SCALED_GRAD": "0"}):
        assert not TritonTileOps.one_sweep(bf16, tile_params(v))
    ops = TritonTileOps(block=SMALL_BLOCK)
    smoothing = tile_params(v, ("smoothing",))
    ones = torch.ones(len(target), device=DEVICE)
    no_spare_row = torch.empty(logits.shape, dtype=bf16, device=DEVICE)
    _, grad = ops.forward_target_apart(logits.clone(), target, smoothing, ones, no_spare_row, x, weight)
    assert grad.row_scale is None and grad.uniform_coef is None


@contextlib.contextmanager
def target_apart_calls(fp32_sum_allowed=False):
    """Counts the chunks whose gradient came with the target column apart (the tile path's
    ``forward_target_apart``, the epilogue path's ``gradient_target_apart``), and fails on a float32 ``[V, H]`` dW
    sum unless ``fp32_sum_allowed`` (a float32 weight's own gradient)."""
    calls = {"chunks": 0, "one_sweep": 0}
    real_tiles, real_epilogue = TritonTileOps.forward_target_apart, triton_gemm.gradient_target_apart

    def spy_tiles(self, *args, **kwargs):
        calls["chunks"] += 1
        stats, grad = real_tiles(self, *args, **kwargs)
        calls["one_sweep"] += grad.row_scale is not None
        return stats, grad

    def spy_epilogue(*args, **kwargs):
        calls["chunks"] += 1
        return real_epilogue(*args, **kwargs)

    no_fp32_sum = mock.patch.object(engine, "dw_product", side_effect=AssertionError("a float32 dW sum"))
    with (
        mock.patch.object(TritonTileOps, "forward_target_apart", spy_tiles),
        mock.patch.object(triton_gemm, "gradient_target_apart", spy_epilogue),
        contextlib.nullcontext() if fp32_sum_allowed else no_fp32_sum,
    ):
        yield calls


def grads_target_apart(hidden, weight, target, apart=True, **opts):
    """Loss and the gradients of hidden and weight through the public API, with the target column apart (the
    default) or in (``HF_FLCE_TARGET_APART=0``)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    with mock.patch.dict(os.environ, {"HF_FLCE_TARGET_APART": "1" if apart else "0"}):
        loss = hf_flce.fused_linear_cross_entropy(*leaves, target, backend="triton", **opts)
        loss.backward()
    return loss.detach(), leaves[0].grad, leaves[1].grad


def float64_grads(hidden, weight, target, upstream=1.0, **opts):
    """Loss and the gradients of hidden and weight from the float64 reference, for ``upstream`` times the loss."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    opts = {k: (v.double() if torch.is_tensor(v) else v) for k, v in opts.items() if k != "memory_budget"}
    loss = hf_flce.reference_linear_cross_entropy(*leaves, target, **opts)[0]
    (loss * upstream).backward()
    return loss.detach(), leaves[0].grad, leaves[1].grad


# the interpreter truncates float32 to 16 bits (a GPU rounds to nearest): errors of one rounding vary by 2x there
TILE_MARGIN = 1.1 if DEVICE.type == "cuda" else 2.0


def check_target_apart(names: tuple, dtype: torch.dtype, budget: int | None, **extra) -> int:
    """A 16-bit scalar loss with the target column apart (``engine._gradient_target_apart``): over several chunks dW
    is summed in the 16-bit gradient itself (no float32 ``[V, H]`` sum); the loss is the column-in path's (to a
    float32 rounding where the tile path's one sweep gives it), and the gradients' errors against float64 are within
    ``TILE_MARGIN`` of that path's, whose dW is summed in float32. Returns how many chunks took the one sweep."""
    hidden, weight, target, _, opts = build(names, n=60, v=300, ignore_every=4)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    opts.update(extra, memory_budget=budget)
    with target_apart_calls() as calls:
        new = grads_target_apart(hidden, weight, target, **opts)
    assert calls["chunks"] >= (3 if budget else 1)
    old = grads_target_apart(hidden, weight, target, apart=False, **opts)
    ref = float64_grads(hidden, weight, target, **opts)
    torch.testing.assert_close(new[0], old[0], rtol=1e-6, atol=0.0)
    for name, n_, o, r in zip(("dX", "dW"), new[1:], old[1:], ref[1:]):
        assert n_.dtype == dtype and torch.isfinite(n_).all(), name
        assert rel_err(n_, r) <= TILE_MARGIN * rel_err(o, r) + 1e-4, (name, rel_err(n_, r), rel_err(o, r))
    return calls["one_sweep"]


def check_target_apart_edge_case(case: str, dtype: torch.dtype = torch.bfloat16, **opts) -> int:
    """The same in ``dtype`` for an edge case: every row ignored gives loss 0 and zero gradients; one token; peaked rows
    (``p_y`` near 1, whose ``p_y - 1`` a 16-bit gradient rounds away) keep dX and dW as accurate as the column-in
    path's. Returns how many chunks took the tile path's one sweep."""
    n = 1 if case == "one-token" else 24
    hidden, weight, target, _ = make_inputs(n, 16, 150, ignore_every=0 if case != "all-ignored" else 1)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if case == "peaked":
        hidden = (hidden.float() + 3.0 * weight.float()[target]).to(dtype)
    with target_apart_calls() as calls:
        new = grads_target_apart(hidden, weight, target, **opts)
    if case == "all-ignored":
        assert new[0].item() == 0.0 and not new[1].any() and not new[2].any()
        return calls["one_sweep"]
    assert calls["chunks"] >= 1
    old = grads_target_apart(hidden, weight, target, apart=False, **opts)
    ref = float64_grads(hidden, weight, target, **opts)
    # The tile path's one sweep rounds E and dW's operand s x to bf16 where the column-in pass rounds G alone: one
    # more rounding per product, up to sqrt(2) times the error where those roundings dominate (this test's 16-wide
    # head; at LLM sizes both errors agree to three digits, docs/PERF_NOTES.md v52).
    margin = TILE_MARGIN * (2**0.5 if calls["one_sweep"] else 1.0)
    for name, n_, o, r in zip(("dX", "dW"), new[1:], old[1:], ref[1:]):
        assert rel_err(n_, r) <= margin * rel_err(o, r) + 1e-4, (name, rel_err(n_, r), rel_err(o, r))
    return calls["one_sweep"]


@pytest.fixture
def tile_path():
    """The tile path on any device (cuBLAS float32 logits and the tile passes), as GPUs before Hopper take it."""
    with mock.patch.object(resolve_backend("triton", DEVICE), "fused_head", None):
        yield


@pytest.mark.parametrize(
    "names",
    [
        (),
        ("smoothing", "class_weight"),
        ("class_weight", "z_loss"),
        ("softcap", "z_loss", "temperature"),
        ("smoothing", "temperature"),
    ],
)
@pytest.mark.parametrize("budget", [None, 8192], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tile_path_target_column_apart(names, budget, dtype, tile_path):
    """On the tile path (``forward_target_apart``), class weights included; bf16 in one sweep
    (``TritonTileOps.one_sweep``) but for label smoothing with class weights."""
    one_sweep = check_target_apart(names, dtype, budget)
    assert bool(one_sweep) == (dtype == torch.bfloat16 and not {"smoothing", "class_weight"} <= set(names))


@pytest.mark.parametrize("case", ["all-ignored", "one-token", "peaked"])
def test_tile_path_target_column_apart_edge_cases(case, tile_path):
    """All rows ignored, one token, peaked rows on the tile path, in one sweep (bf16)."""
    one_sweep = check_target_apart_edge_case(case, memory_budget=2048)
    assert one_sweep or case == "all-ignored"


def tile_compaction(on: bool):
    """The tile path's compaction in one launch (``engine._compaction``) on or off, on any device."""
    return mock.patch.object(engine, "_compaction", lambda plan, device: plan.tiles.compaction if on else None)


def test_tile_path_compacts_in_one_launch(tile_path):
    """On a CUDA GPU the tile path compacts a call's kept rows with the epilogue path's one launch
    (``engine._compaction``, here also on the CPU interpreter): the loss and gradients are those of torch's
    compaction (with the first GEMM waiting for the kept count as torch's compaction makes it), and a target outside
    ``[0, V)`` raises the ValueError naming it."""
    hidden, weight, target, _, opts = build((), n=40, v=300, ignore_every=3)
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    opts["memory_budget"] = 8192

    waiting = mock.patch.object(engine, "_tile_deferral", lambda *args: None)
    spy = mock.patch.object(triton_gemm, "kept_order", wraps=triton_gemm.kept_order)
    with tile_compaction(True), waiting, spy as kept_order:
        one_launch = grads_target_apart(hidden, weight, target, **opts)
        assert kept_order.call_count == 1
        bad = target.clone()
        bad[5] = 300
        with pytest.raises(ValueError, match="target contains 300"):
            hf_flce.fused_linear_cross_entropy(hidden, weight, bad, backend="triton", **opts)
    with tile_compaction(False), spy as kept_order:
        by_torch = grads_target_apart(hidden, weight, target, **opts)
        assert kept_order.call_count == 0
    for name, a, b in zip(("loss", "dX", "dW"), one_launch, by_torch):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@contextlib.contextmanager
def gemms_and_reads():
    """The tile path's logits GEMMs (their rows) and the host's reads of the kept count, in order."""
    events = []
    real_logits, real_count = engine.compute_logits, engine._DeviceCompaction.kept_count

    def logits(x, *args, **kwargs):
        events.append(x.shape[0])
        return real_logits(x, *args, **kwargs)

    def count(self):
        events.append("read")
        return real_count(self)

    with (
        mock.patch.object(engine, "compute_logits", logits),
        mock.patch.object(engine._DeviceCompaction, "kept_count", count),
    ):
        yield events


@pytest.mark.parametrize(
    "case, names, dtype",
    [
        ("split", (), torch.bfloat16),
        ("split", ("smoothing",), torch.bfloat16),
        ("split", ("bias", "z_loss"), torch.bfloat16),
        ("split", ("class_weight",), torch.float16),
        ("split", ("dft",), torch.bfloat16),
        ("past-kept", (), torch.bfloat16),
        ("past-kept", ("smoothing", "temperature"), torch.bfloat16),
        ("chunks", (), torch.bfloat16),
        ("chunks", ("smoothing",), torch.bfloat16),
        ("one-token", (), torch.bfloat16),
        ("all-ignored", ("smoothing",), torch.bfloat16),
    ],
)
def test_tile_path_first_gemm_before_the_count(case, names, dtype, tile_path):
    """With the compaction in one launch, a tile-path scalar loss launches the GEMM of its first chunk's leading
    rows (``engine._lead_rows``) before the host reads the kept count, and the rest of the first chunk's kept rows
    after it (``_logits_before_the_count``). Where fewer rows are kept than that GEMM took ("past-kept"), the rest
    are dropped. Loss and gradients match the call whose first GEMM waits for the count, and float64; every row
    ignored gives loss 0 and zero gradients."""
    n, lead = {"one-token": (1, 1), "chunks": (60, 3)}.get(case, (60, 16))
    dft = "dft" in names
    names = tuple(name for name in names if name != "dft")
    hidden, weight, target, bias, opts = build(names, n=n, v=300, ignore_every=4 if n > 1 else 0)
    if dft:
        opts["prob_weighted"] = True
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if case == "past-kept":
        target[5:] = -100
    if case == "all-ignored":
        target[:] = -100
    if case == "chunks":
        opts["memory_budget"] = 8192
    if bias is not None:
        opts["bias"] = bias
    n_kept = int((target != -100).sum())
    lead_rows = mock.patch.object(engine, "_lead_rows", lambda rows, *shape_and_dtype: min(rows, lead))
    with tile_compaction(True), lead_rows, gemms_and_reads() as events:
        deferred = grads_target_apart(hidden, weight, target, **opts)
    if case == "chunks":
        assert events[:2] == [lead, "read"] and len(events) > 4 and sum(events[2:]) == n_kept - lead, events
    elif case == "past-kept":
        assert events == [lead, "read"], events
    else:
        assert events[:2] == [min(lead, n), "read"] and sum(events[2:]) == max(0, n_kept - lead), events
    waiting = mock.patch.object(engine, "_tile_deferral", lambda *args: None)
    with tile_compaction(True), waiting, gemms_and_reads() as events:
        waited = grads_target_apart(hidden, weight, target, **opts)
    assert events[0] == "read", events
    if case == "all-ignored":
        assert deferred[0].item() == 0.0 and not deferred[1].any() and not deferred[2].any()
        return
    ref = float64_grads(hidden, weight, target, **opts)
    torch.testing.assert_close(deferred[0], waited[0], rtol=1e-6, atol=0.0)
    for name, d, w, r in zip(("dX", "dW"), deferred[1:], waited[1:], ref[1:]):
        assert d.dtype == dtype and torch.isfinite(d).all(), name
        assert rel_err(d, r) <= TILE_MARGIN * rel_err(w, r) + 1e-4, (name, rel_err(d, r), rel_err(w, r))


def test_lead_rows():
    """The GEMM launched before the count's read takes whole 128-row tiles, at least ``_LEAD_GEMM_FLOPS``' worth on
    16-bit operands and ``_LEAD_FLOAT32_SLOWDOWN`` times fewer on float32 ones, which run that much slower (at most
    the chunk's rows)."""
    for hidden, vocab in ((4096, 128256), (1024, 151936), (4096, 32768), (2048, 128256), (8192, 256000)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            flops = engine._LEAD_GEMM_FLOPS / (1 if dtype.itemsize == 2 else engine._LEAD_FLOAT32_SLOWDOWN)
            rows = engine._lead_rows(1 << 20, hidden, vocab, dtype)
            assert rows % 128 == 0 and rows >= 128 and 2 * hidden * vocab * rows >= flops
            assert rows == 128 or 2 * hidden * vocab * (rows - 128) < flops
            assert engine._lead_rows(5, hidden, vocab, dtype) == 5
        lead_16bit, lead_32bit = (engine._lead_rows(1 << 20, hidden, vocab, d) for d in (torch.bfloat16, torch.float32))
        assert lead_32bit <= lead_16bit


def check_frequent_classes(budget_rows: int, dtype: torch.dtype = torch.bfloat16, **opts) -> tuple:
    """With targets drawn from the softmax (a calibrated model) over ``MIN_CHUNKS`` chunks or more, a 16-bit scalar
    loss with the target column apart sums the most frequent classes' dW rows in float32 (``_FrequentClassRows``):
    dW's error against float64 within ``TILE_MARGIN`` of the column-in path's float32 sum. Returns the inputs, the
    budget and both errors' references for further checks."""
    n, h, v = 160, 32, 300
    hidden, weight, _, _ = make_inputs(n, h, v, ignore_every=0, seed=4)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    probs = torch.softmax(hidden.double() @ weight.double().T, -1)
    target = torch.multinomial(probs.float().cpu(), 1, generator=torch.Generator().manual_seed(5)).squeeze(1)
    target = target.to(DEVICE)
    budget = budget_rows * (v * 4 + engine._scaled_row_bytes(h, 2))
    ref = float64_grads(hidden, weight, target, **opts)
    with (
        target_apart_calls() as calls,
        mock.patch.object(
            engine._FrequentClassRows, "add", autospec=True, side_effect=engine._FrequentClassRows.add
        ) as add,
    ):
        new = grads_target_apart(hidden, weight, target, memory_budget=budget, **opts)
    assert calls["chunks"] >= engine._FrequentClassRows.MIN_CHUNKS and add.call_count == calls["chunks"]
    old = grads_target_apart(hidden, weight, target, apart=False, memory_budget=budget, **opts)
    assert rel_err(new[2], ref[2]) <= TILE_MARGIN * rel_err(old[2], ref[2]), (
        rel_err(new[2], ref[2]),
        rel_err(old[2], ref[2]),
    )
    return hidden, weight, target, budget, ref, old


def test_tile_path_frequent_classes_and_autocast(tile_path):
    """From ``MIN_CHUNKS`` chunks the most frequent target classes' dW rows are summed in float32 on the tile path
    too; with a float32 weight under bf16 autocast dW is summed in that float32 gradient, the target column apart."""
    hidden, weight, target, budget, ref, old = check_frequent_classes(20)
    # a float32 weight (mixed precision): its gradient is the float32 sum
    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    with target_apart_calls(fp32_sum_allowed=True) as calls, torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        hf_flce.fused_linear_cross_entropy(x, w, target, backend="triton", memory_budget=budget).backward()
    assert calls["chunks"] >= 2 and w.grad.dtype == torch.float32
    assert rel_err(w.grad, ref[2]) <= TILE_MARGIN * rel_err(old[2], ref[2])


@triton.jit
def _tanh_probe_kernel(x_ptr, th_ptr, slope_ptr, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    th, slope = triton_tiles._tanh_and_slope(tl.load(x_ptr + offs, mask=offs < n), HW)
    tl.store(th_ptr + offs, th, mask=offs < n)
    tl.store(slope_ptr + offs, slope, mask=offs < n)


@pytest.mark.parametrize("hw", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["exp", "hardware"])
def test_softcap_tanh_matches_float64(hw):
    """The softcap's tanh and slope 1 - tanh**2 (the exp form of the tile passes, and the hardware tanh of the
    epilogue GEMM on CUDA), over the range a softcapped logit divided by its cap takes, past saturation included."""
    x = torch.cat([torch.linspace(-6.0, 6.0, 4099), torch.tensor([0.0, -0.0, 1e-8, -1e-30, 20.0, -40.0])]).to(DEVICE)
    th, slope = torch.empty_like(x), torch.empty_like(x)
    _tanh_probe_kernel[(triton.cdiv(x.numel(), 1024),)](x, th, slope, x.numel(), HW=hw, BLOCK=1024)
    ref = torch.tanh(x.double())
    tol = 2e-5 if hw else 3e-7
    assert (th.double() - ref).abs().max() <= tol
    assert (slope.double() - (1 - ref * ref)).abs().max() <= 2 * tol
    assert (slope >= 0).all() and (th.abs() <= 1).all()


# --- real sizes on a GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_interpreting(), reason="needs a CUDA GPU (and TRITON_INTERPRET unset)"
)


def chunked_reference(hidden, weight, target, rows_per_chunk=1024):
    """Mean cross-entropy, per-token log-probs and the gradients of hidden and weight for d(loss)/d(loss) = 1, in
    float32 with full-precision GEMMs, one chunk of rows at a time (the [N, V] logits don't fit)."""
    x, w = hidden.float(), weight.float()
    valid = target != -100
    count = valid.sum().clamp(min=1).float()
    total = torch.zeros((), device=hidden.device, dtype=torch.float64)
    logprobs = torch.zeros(target.shape, device=hidden.device)
    dx = torch.empty_like(x)
    dw = torch.zeros_like(w)
    for start in range(0, x.shape[0], rows_per_chunk):
        sl = slice(start, start + rows_per_chunk)
        logits = x[sl] @ w.T
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        y, ok = target[sl], valid[sl]
        safe = torch.where(ok, y, 0)
        lp = torch.where(ok, logp.gather(1, safe[:, None]).squeeze(1), 0.0)
        logprobs[sl] = lp
        total -= lp.double().sum()
        grad = logp.exp_()
        grad.scatter_add_(1, safe[:, None], torch.full_like(lp, -1.0)[:, None])
        grad *= ok[:, None].float() / count
        dx[sl] = grad @ w
        dw += grad.T @ x[sl]
    return (total / count).float(), logprobs, dx, dw


def rel_err(actual, expected):
    return ((actual.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "n, h, v, dtype, budget, tile_path",
    [
        (8192, 4096, 128256, torch.bfloat16, None, False),
        # cuBLAS logits and the tile passes, as before Hopper: the per-token backward in vocabulary chunks, each
        # chunk's bf16 gradient written over its float32 logits
        (8192, 4096, 128256, torch.bfloat16, None, True),
        (4096, 2048, 128256, torch.float32, None, False),
        # one chunk of N * V = 2.18e9 > 2**31 logits: the kernels' row offsets must be 64-bit
        (17000, 256, 128256, torch.bfloat16, 24 << 30, False),
    ],
    ids=["llama3-bf16", "llama3-bf16-tile-path", "fp32", "over-2**31"],
)
def test_gpu_real_sizes(n, h, v, dtype, budget, tile_path, monkeypatch):
    # Tolerances. fp32: the same fp32 GEMMs as the reference, so ~1e-5 on everything. bf16: the logits are exact
    # (fp32 output of the same bf16 GEMM), so the loss and log-probs match to ~1e-5; the gradients are rounded to
    # bf16 (the logits gradient, then dX and dW themselves: 2**-9 relative each), so norm-relative errors of
    # about 3e-3 are expected, and 1e-2 is allowed.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    if tile_path:
        monkeypatch.setattr(resolve_backend("triton", torch.device("cuda")), "fused_head", None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (2.0 / h**0.5)).to(dtype)
    target = torch.randint(0, v, (n,), device="cuda", generator=gen)
    target[::17] = -100
    ref_loss, ref_logprobs, ref_dx, ref_dw = chunked_reference(hidden, weight, target)
    count = (target != -100).sum()
    grad_tol = 1e-4 if dtype == torch.float32 else 1e-2
    # mean: gradients computed in forward; none: per-token upstream, through the backward kernel
    for reduction in ("mean", "none"):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with mock.patch.object(engine, "_recompute_by_columns", wraps=engine._recompute_by_columns) as by_columns:
            loss, stats = hf_flce.fused_linear_cross_entropy(
                x, w, target, backend="triton", reduction=reduction, return_stats=True, memory_budget=budget
            )
            if reduction == "none":
                loss = loss.sum() / count
            loss.backward()
        # past the default 1 GiB the per-token backward recomputes by vocabulary chunks (all of them on the tile path,
        # those past the kept leading columns on the Hopper GEMM); 24 GiB keeps every logit
        assert by_columns.called == (reduction == "none" and budget is None), reduction
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), reduction
        assert rel_err(stats.logprobs, ref_logprobs) <= 2e-5, reduction
        assert rel_err(x.grad, ref_dx) <= grad_tol, reduction
        assert rel_err(w.grad, ref_dw) <= grad_tol, reduction
        del x, w, loss, stats
