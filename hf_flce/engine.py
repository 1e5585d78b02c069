"""The chunk driver shared by every backend: GEMMs, chunking by a memory budget, compaction and autograd.

Two strategies, picked per call:

* **Scalar loss** (``mean``/``sum``/``num_items_in_batch``) with gradients wanted: the gradient of each chunk's
  logits is known up to the upstream scalar, so it is computed during forward and turned into ``dX`` and ``dW``
  right away (three GEMMs in all: logits, ``dX = G W``, ``dW = G^T X``). Backward only scales them.
* **Per-token outputs** (``reduction="none"``, or stats whose gradients are used): the upstream gradient is only
  known in backward. Forward saves the log-sum-exp and entropy of each row; backward recomputes each chunk's logits
  (a fourth GEMM), or reuses them when the whole set of logits fits the memory budget.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from .backends import cdiv, cuda_properties
from .backends.base import TileOps, TileParams, TileStats
from .options import env_flag, env_int

_HAS_MM_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)


@dataclass
class CallPlan:
    """Everything about one call that is not a tensor autograd tracks."""

    tiles: TileOps
    params: TileParams
    reduction: str  # "none" or "scalar"
    # The scalar loss is sum / denominator() (float32 0-d; None for per-token losses). Computed where first needed,
    # so a no-grad call launches its GEMM before the launches that count the targets.
    denominator: Callable[[], torch.Tensor | None]
    budget: int
    grad_mode: bool  # torch.is_grad_enabled() at the call (it is always off inside Function.forward)
    # Under autocast: the dtype the GEMMs run in. The inputs stay in their own dtypes, so the gradients come back in
    # them too (an fp32 master weight gets its fp32 accumulator, never rounded to bf16 on the way).
    compute_dtype: torch.dtype | None = None
    prob_weighted: bool = False  # DFT: each row's loss times its detached target probability
    want_stats: bool = True  # whether the caller reads the per-token statistics (else they are not scattered)
    # Called once by a scalar loss's forward with a SavedForWeightGrad, for a caller that passed the weight detached
    # and computes its gradient later; cleared when called, so the saved state holds no path back to the caller.
    save_for_weight_grad: Callable[[SavedForWeightGrad], None] | None = None


def compute_operand(t: torch.Tensor, plan: CallPlan) -> torch.Tensor:
    return t if plan.compute_dtype is None or t.dtype == plan.compute_dtype else t.to(plan.compute_dtype)


def _fp32_out(x: torch.Tensor) -> bool:
    return _HAS_MM_OUT_DTYPE and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)


def mm_fp32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` in float32, added into the float32 ``acc`` when given. On CUDA, bf16/fp16 operands with a float32
    output: nothing is rounded to 16 bits. CPU torch has no such GEMM: a sum into ``acc`` upcasts the operands (summing
    16-bit products would round each one), a new product is the 16-bit one upcast."""
    if _fp32_out(a):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if acc is not None:
        return acc.addmm_(a.float(), b.float())
    return torch.mm(a, b).float()


def logits_buffer(rows: int, vocab: int, device: torch.device, spare_row: bool = False) -> torch.Tensor:
    """An uninitialised float32 ``[rows, vocab]``. ``spare_row``: its buffer has one more row after the last, for a
    label-smoothed gradient's row of ones under ``E`` (``ScaledGradient.dw_operands``)."""
    return torch.empty((rows + int(spare_row), vocab), dtype=torch.float32, device=device)[:rows]


def compute_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    keep_16bit: bool = False,
    spare_row: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` in float32, so the logits are never rounded to 16 bits before the softmax (stock HF rounds
    them, which costs accuracy on peaked distributions). ``keep_16bit`` (see ``_logits_16bit``): the 16-bit GEMM
    output as it is, where a float32 result would only be its upcast copy. ``spare_row``: the float32 logits'
    buffer has one more row after their last (``logits_buffer``). ``out``: a contiguous float32 ``[rows, V]`` to
    write them to."""
    if keep_16bit:
        return torch.mm(x, weight.t())
    if spare_row or out is not None:
        logits = logits_buffer(x.shape[0], weight.shape[0], x.device, spare_row) if out is None else out
        if _fp32_out(x):
            torch.mm(x, weight.t(), out_dtype=torch.float32, out=logits)
        elif x.dtype == torch.float32:
            torch.mm(x, weight.t(), out=logits)
        else:
            logits.copy_(torch.mm(x, weight.t()))
    elif bias is not None and x.dtype == torch.float32 and bias.dtype == torch.float32:
        return torch.addmm(bias, x, weight.t())
    else:
        logits = mm_fp32(x, weight.t())
    if bias is not None:
        logits += bias.float()
    return logits


def exact_mm_fp32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` in float32, added into ``acc`` when given, with nothing rounded to 16 bits: on CUDA the GEMM has a
    float32 output; CPU torch has none, so the operands are upcast there (``mm_fp32`` keeps a new CPU product's 16-bit
    rounding, which costs less where the product is rounded anyway)."""
    if acc is None and not _fp32_out(a):
        return torch.mm(a.float(), b.float())
    return mm_fp32(a, b, acc)


def dw_product(grad_logits: torch.Tensor, x: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``grad_logits^T x`` in float32 by ``exact_mm_fp32``, added into ``acc`` when given. Summed across chunks in
    bf16 with the target column in (Liger's way), dW's error grows with the chunks: 3.5e-3 at 8 against stock's 1.7e-3
    (``scripts/dw_accumulation_error.py``); ``_dw_sum_in_weight_dtype`` says when a 16-bit sum is kept instead."""
    return exact_mm_fp32(grad_logits.t(), x, acc)


def _logits_16bit(plan: CallPlan, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the chunk's logits stay in the GEMM's 16-bit dtype. CPU torch has no 16-bit GEMM with a float32
    output, so there ``mm_fp32`` rounds the logits to 16 bits before upcasting them anyway: a backend that takes 16-bit
    logits (``cpu_16bit_logits``) gets them without that float32 copy, and writes the gradient over them."""
    dtype = plan.compute_dtype or x.dtype
    return (
        getattr(plan.tiles, "cpu_16bit_logits", False)
        and x.device.type == "cpu"
        and bias is None
        and dtype in (torch.bfloat16, torch.float16)
    )


def _can_compact(device: torch.device) -> bool:
    # Compaction sizes the batch on the host (one sync). Under compilation or CUDA graph capture that is not allowed,
    # so every row is processed and the tiles zero the ignored ones instead.
    if torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def check_target_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every target is in ``[0, V)`` or ``ignore_index``: a ValueError on CPU; on an accelerator a device-side assert
    (no host sync), for the paths that may not sync (compilation, graph capture)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if target.device.type == "cpu":
        if bool(bad.any()):
            _raise_target_range(int(target[bad][0]), vocab, ignore_index)
    elif target.numel():
        torch._assert_async(~bad.any(), f"hf_flce: target outside [0, V={vocab}) and not ignore_index={ignore_index}")


def _raise_target_range(value: int, vocab: int, ignore_index: int):
    raise ValueError(f"target contains {value}, outside [0, V={vocab}) and not ignore_index={ignore_index}")


def _check_range(low: int, high: int, vocab: int, ignore_index: int) -> None:
    """The kept targets' minimum and maximum (read on the host) lie in ``[0, V)``."""
    if low < 0 or high >= vocab:
        _raise_target_range(low if low < 0 else high, vocab, ignore_index)


@dataclass
class _DeviceCompaction:
    """The epilogue GEMM's compaction in one launch (``fused.kept_order``): the kept rows first, their targets, and
    ``summary`` (the kept count and the kept targets' range) on the device, with a host copy of that summary started
    right behind it (``fused.read_later``), so reading it never waits for what is launched afterwards."""

    order: torch.Tensor
    targets: torch.Tensor
    summary: torch.Tensor
    read: Callable[[], list[int]]
    vocab: int
    ignore_index: int

    @classmethod
    def start(cls, fused, target: torch.Tensor, vocab: int, ignore_index: int) -> _DeviceCompaction:
        order, targets, summary = fused.kept_order(target, ignore_index, vocab)
        return cls(order, targets, summary, fused.read_later(summary), vocab, ignore_index)

    def kept_count(self) -> int:
        """The kept count, read on the host once the kept targets' range is checked (a ValueError)."""
        n_kept, low, high = self.read()
        _check_range(low, high, self.vocab, self.ignore_index)
        return n_kept

    def kept(self, n_kept: int, target: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``kept_rows``'s result: the kept rows and their targets, or None and ``target`` when every row is kept."""
        return (None, target) if n_kept == target.numel() else (self.order[:n_kept], self.targets[:n_kept])


def kept_rows(
    target: torch.Tensor, vocab: int, ignore_index: int, compact: bool = True, fused=None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The rows whose target is not ``ignore_index`` (``None`` when that is every row, or when ``compact`` is off)
    and their targets, once each of those targets is checked to lie in ``[0, V)``. Compaction sizes the batch on the
    host, so it costs one sync; that same read brings the kept targets' range, and a bad one raises a ValueError
    naming it (on every device, never a device-side assert that would poison the CUDA context). ``fused`` (a module
    with ``kept_order`` and ``read_later``, the epilogue GEMM's) does the compaction in one launch."""
    n = target.numel()
    if not compact or n == 0:
        check_target_range(target, vocab, ignore_index)
        return None, target
    if fused is not None:
        compaction = _DeviceCompaction.start(fused, target, vocab, ignore_index)
        return compaction.kept(compaction.kept_count(), target)
    valid = target != ignore_index
    low, high = torch.aminmax(torch.where(valid, target, 0))
    n_kept, low, high = torch.stack((valid.sum(), low, high)).tolist()
    _check_range(low, high, vocab, ignore_index)
    if n_kept == n:
        return None, target
    rows = torch.nonzero_static(valid, size=n_kept).squeeze(1)
    return rows, target.index_select(0, rows)


def plan_chunk_rows(
    n_rows: int, vocab: int, bytes_per_logit: float, budget: int, accumulator_bytes: int = 0, balanced: bool = True
) -> int:
    """Rows per chunk: as many as ``budget`` bytes of per-logit buffers allow, balanced so the last chunk is not a
    sliver (``balanced=False``: as many as the budget allows). Several chunks need a dW accumulator
    (``accumulator_bytes`` beyond the gradient), so one chunk is taken whenever it costs no more memory than that
    accumulator plus a budget-sized chunk."""
    if n_rows == 0:
        return 1
    bytes_per_row = max(1, int(vocab * bytes_per_logit))
    if n_rows * bytes_per_row <= budget + accumulator_bytes:
        return n_rows
    max_rows = max(1, budget // bytes_per_row)
    if not balanced:
        return min(n_rows, max_rows)
    n_chunks = cdiv(n_rows, max_rows)
    return cdiv(n_rows, n_chunks)


def _keep_limit(plan: CallPlan, device: torch.device) -> int:
    """Bytes of float32 logits the per-token path may keep from forward to backward instead of recomputing them.
    A backend may allow more than the chunk budget (``TileOps.keep_logits_limit``)."""
    backend_limit = getattr(plan.tiles, "keep_logits_limit", None)
    return max(plan.budget, backend_limit(device)) if backend_limit is not None else plan.budget


def _column_buffers_fit(plan: CallPlan, n_rows: int, x, w_c, weight, gathered: bool, needs: tuple[bool, bool]) -> bool:
    """Whether a recomputing backward over vocabulary chunks (``_recompute_by_columns``) costs less memory than row
    chunks: its ``[rows, H]`` buffers (a float32 dX sum where dX is wanted, and the gathered rows of a compacted batch
    or a cast weight's dtype) against the dW accumulator that row chunks sum into, or without dW against the budget.
    ``needs``: whether dX and dW are wanted."""
    need_dx, need_dw = needs
    gathered_bytes = w_c.element_size() if gathered or w_c.dtype != x.dtype else 0
    row_bytes = x.shape[1] * ((4 if need_dx else 0) + gathered_bytes)
    limit = _accumulator_bytes(weight, True) if need_dw else plan.budget
    return n_rows * row_bytes < limit


def _kept_columns(plan: CallPlan, fused, n_rows: int, x, w_c, weight, needs: tuple[bool, bool]) -> int | None:
    """How many leading vocabulary columns a per-token loss whose logits pass the keep limit keeps (as the epilogue's
    16-bit e) from forward to backward for ``n_rows`` rows, its backward recomputing only the others, by vocabulary
    chunks: as many whole ``fused.COLUMN_ALIGN`` blocks as the limit holds. None where none fits or the backward would
    not walk the vocabulary. The kept columns cost their share of a GEMM less in backward, for a pass over them."""
    align = fused.COLUMN_ALIGN
    columns = _keep_limit(plan, x.device) // max(1, n_rows * 2) // align * align
    if not 0 < columns < w_c.shape[0] or not _vocab_chunks():
        return None
    return columns if _column_buffers_fit(plan, n_rows, x, w_c, weight, True, needs) else None


def _vocab_chunks() -> bool:
    """Whether a recomputing backward may walk the vocabulary in column chunks (``_recompute_by_columns``);
    ``HF_FLCE_VOCAB_CHUNKS=0`` keeps row chunks (for A/B measurements)."""
    return os.environ.get("HF_FLCE_VOCAB_CHUNKS", "1") != "0"


def _target_column_apart() -> bool:
    """Whether a recomputing backward over vocabulary chunks (``recompute_gradient(target_apart=)``,
    ``target_gradient``) and a scalar loss without a scaled gradient (``_gradient_target_apart``) take each row's
    target column out of the 16-bit gradient and add it in float32; ``HF_FLCE_TARGET_APART=0`` keeps it in (for A/B
    measurements)."""
    return os.environ.get("HF_FLCE_TARGET_APART", "1") != "0"


def _dw_sum_in_weight_dtype(scaled: bool, weight: torch.Tensor) -> bool:
    """Whether a scalar loss sums dW across its chunks in the 16-bit gradient itself (a 16-bit ``addmm_`` per chunk: on
    CPU the float32 product is added and rounded once; on an H100 cuBLAS rounds the product to 16 bits before it adds
    it, with ``E`` transposed as here, ``docs/PERF_NOTES.md`` v58) instead of a float32 ``[V, H]`` sum: ``4 V H`` bytes
    less (2 GiB on llama3-8b's head) and half the sum's traffic (v46). That is done for a scaled gradient
    (``_scaled_gradient``) or one with its target column apart (``_gradient_target_apart``), whose target column stays
    out of the 16-bit sums and is added in float32 once per call (``add_target_rows``): the sums then round only dW's
    softmax part. Against float64 (``scripts/dw_accumulation_error.py``, V = 8192), dW's error equals the float32 sum's
    at up to 32 chunks with random targets, flat or peaked; with targets drawn from the softmax, as a trained model's,
    the softmax part carries more of dW, and the error goes from the float32 sum's 1.7e-3 to 2.0e-3 at 4 chunks, 2.2e-3
    at 8 and 3.2e-3 at 32, against stock's 2.9e-3 (a bf16 sum with the target column in, Liger's: 2.9e-3, 3.7e-3,
    6.3e-3). From 8 chunks on the most frequent target classes' rows, which carry most of that, are summed in float32
    (``_FrequentClassRows``: 2.0e-3 at 32 chunks). ``HF_FLCE_DW_FP32_SUM=1`` keeps the float32 sum."""
    return scaled and weight.dtype.itemsize == 2 and not env_flag("HF_FLCE_DW_FP32_SUM")


def _gradient_target_apart(plan: CallPlan, fused, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a scalar loss whose gradient is not a scaled one (``_scaled_gradient``) writes its 16-bit logits gradient
    with each row's target column taken out and carried in float32, as the scaled gradient does: the 16-bit sums of dW
    then round only its softmax part, so they are kept in the gradient itself (``_dw_sum_in_weight_dtype``), with no
    float32 ``[V, H]`` sum. On the tile path (the GEMM's logits and the tile passes: GPUs before Hopper, class-weighted
    calls, the torch backend) the backend's ``forward_target_apart`` does it (Triton's on bf16 in one sweep, as ``E``
    and row scales, but for label smoothing with class weights: ``TritonTileOps.one_sweep``); on the epilogue path (fp16
    operands; bf16 ones with ``HF_FLCE_SCALED_GRAD=0``) ``fused.gradient_target_apart``. Not with a bias (its gradient
    would need the column too), nor for DFT on the tile path (whose pass writes the gradient with the statistics, before
    DFT's per-row factor is known; the epilogue path's pass comes after it); ``HF_FLCE_TARGET_APART=0`` keeps the column
    in."""
    backend, method = (plan.tiles, "forward_target_apart") if fused is None else (fused, "gradient_target_apart")
    return (
        bias is None
        and (fused is not None or not plan.prob_weighted)
        and (plan.compute_dtype or x.dtype).itemsize == 2
        and hasattr(backend, method)
        and _target_column_apart()
    )


def _tile_one_sweep(plan: CallPlan, x: torch.Tensor) -> bool:
    """Whether a tile-path call whose gradient has its target column apart can take it in one sweep over the logits
    (``TritonTileOps.one_sweep``)."""
    one_sweep = getattr(plan.tiles, "one_sweep", None)
    return one_sweep is not None and one_sweep(plan.compute_dtype or x.dtype, plan.params)


def _scaled_gradient(plan: CallPlan, fused, w_c: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the epilogue path can carry a logits gradient as ``E`` and row scales (``triton_scaled``): bf16
    operands, no bias, label smoothing only for a scalar loss, and on CUDA only where ``mm_fp32`` keeps ``E W`` in
    float32."""
    return (
        fused is not None
        and (_HAS_MM_OUT_DTYPE or w_c.device.type != "cuda")
        and fused.scaled_gradient_supports(w_c.dtype, bias, plan)
    )


def _scaled_row_bytes(hidden: int, operand_bytes: int) -> int:
    """Bytes per row that a scaled gradient's chunk holds next to its ``E``: the gathered rows of x in the GEMM's
    dtype and ``E W`` in float32 for dX (``[rows, H]`` each; at llama3-8b's head 6% of ``E``'s). The budget covers
    them, so that the call's memory beyond its gradients stays within it."""
    return hidden * (operand_bytes + 4)


def _scaled_kept_columns(plan: CallPlan, fused, w_c: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a per-token loss keeps its leading columns, or its logits whole, as the scalar loss's ``E`` with row
    scales (``_scaled_gradient``) rather than as fp16 e: its backward then takes their dX and dW from ``E`` itself,
    with no pass turning e into the gradient (2 bytes read and 2 written per kept logit), the target column in float32
    (``_target_column_apart``). Where the upstream gradients are no row scale of ``E`` (an entropy gradient, or a
    log-prob gradient with a z-loss) the backward recomputes the kept columns too (``_scaled_upstream``)."""
    return _scaled_gradient(plan, fused, w_c, bias) and _target_column_apart()


def _scaled_upstream(plan: CallPlan, grad_loss, grad_logprob, grad_entropy) -> torch.Tensor | None:
    """The per-row factor ``u`` of kept ``E``'s row scales (float32 ``[rows]``), or None where the upstream gradients
    are no row scale of ``E``. Off the target column, the loss's gradient is ``p_j (1 + 2 z lse) dt_j`` and the
    log-prob's ``-p_j dt_j``: with no z-loss both are ``p_j dt_j`` times a row factor, so ``u = g_loss - g_logprob``;
    the entropy's, ``-p_j (t_j - lse + H) dt_j``, depends on ``t_j``."""
    if grad_entropy is not None or (grad_logprob is not None and plan.params.z_loss != 0.0):
        return None
    if grad_logprob is None:
        return grad_loss
    return -grad_logprob if grad_loss is None else grad_loss - grad_logprob


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


class _SplitDWSum:
    """dW of a 16-bit weight summed across row chunks in float32, as two blocks of rows, each its own allocation: rows
    ``[0, split)`` with ``split = ceil(V / 2)``, and the rest. The 16-bit result (``2 V H`` bytes) fits in the first
    block's memory (``4 split H`` bytes), so ``result`` casts into that memory and frees the second block. The sum and
    its cast are then never held together: that was ``6 V H`` bytes at the start of a model's backward, where all of
    its activations are still alive, and is ``4 V H`` now (llama3-8b's head at 32k tokens and 512 MiB: 0.48 GiB less
    at the peak, docs/PERF_NOTES.md v28)."""

    # the first block's leading float32 values that are cast through a temporary (see ``result``)
    FIRST = 1 << 22

    @staticmethod
    def lowers_the_peak(weight: torch.Tensor, weight_dtype: torch.dtype, chunk_bytes: int) -> bool:
        """Whether to split: for a 16-bit weight whose gradient is at least 1.5 times a chunk's buffers. The chunks'
        moment (the float32 sum and a chunk) stays, so the split lowers the call's peak by the gradient's size less a
        chunk's. On thin H the two GEMMs of half the rows run 2-6% slower than one (v28, H100), and there the gradient
        is small against a chunk."""
        grad_bytes = weight.numel() * weight_dtype.itemsize
        return weight_dtype.itemsize == 2 and 2 * grad_bytes >= 3 * chunk_bytes

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.split = cdiv(vocab, 2)
        self.blocks: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, grad_logits: torch.Tensor, x_chunk: torch.Tensor) -> None:
        """``dW += grad_logits^T x_chunk``: one GEMM per block, on the gradient's column slices."""
        lower, upper = grad_logits[:, : self.split], grad_logits[:, self.split :]
        if self.blocks is None:
            self.blocks = (dw_product(lower, x_chunk), dw_product(upper, x_chunk))
        else:
            dw_product(lower, x_chunk, self.blocks[0])
            dw_product(upper, x_chunk, self.blocks[1])

    def result(self, dtype: torch.dtype, scale: torch.Tensor | None, scale_into) -> torch.Tensor:
        """dW in ``dtype`` (times ``scale`` when given, ``scale_into(src, scale, out)`` multiplying), in the first
        block's memory; the blocks are given up."""
        lower, upper = self.blocks
        self.blocks = None

        def cast(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return out.copy_(src) if scale is None else scale_into(src, scale, out)

        src = lower.view(-1)
        n = src.numel()
        out = src.view(dtype)  # twice as many 16-bit slots over the same bytes
        # 16-bit value i goes to byte 2i, over float32 value i/2: the values [s, 2s) overwrite only values below s,
        # which the casts before them have read. The first ones would overwrite themselves: they go through a copy.
        first = min(n, self.FIRST)
        out[:first].copy_(cast(src[:first], torch.empty(first, dtype=dtype, device=src.device)))
        start = first
        while start < n:
            end = min(2 * start, n)
            cast(src[start:end], out[start:end])
            start = end
        cast(upper.view(-1), out[n : n + upper.numel()])
        return out[: n + upper.numel()].view(self.vocab, -1)


class _FrequentClassRows:
    """The dW rows of a call's most frequent target classes, summed across chunks in float32 next to a 16-bit sum in
    the gradient (``_dw_sum_in_weight_dtype``), their target terms added to them in float32 too, and written into the
    gradient once. Where targets follow the softmax (a trained model's), a class that is often a target has a softmax
    part of dW (``sum_i p_iv x_i``) that nearly cancels its target part (``-sum_{y_i = v} x_i``): rounding the running
    softmax sum to 16 bits once per chunk then costs that row's small difference much. Those rows carry most of the
    16-bit sum's error: on qwen3-0.6b's head (H100, ``scripts/dw_accumulation_error.py --op``, targets drawn from the
    softmax) dW's error is 2.80e-3 at 20 chunks of 32768 rows and 4.48e-3 at 79, against stock's 2.57e-3 and the
    float32 sum's 1.74e-3; with the 1024 most frequent classes in float32, 1.83e-3 and 2.05e-3. ``COUNT`` classes cost
    ``4 COUNT H`` bytes (16 MiB at H = 4096, set aside from the chunks' budget: ``_plan_rows_beside``) and, per
    chunk, a gather of their ``E`` columns and a ``[COUNT, rows] x [rows, H]`` GEMM: 0.4-2.3% of a call's time at 9-19
    chunks, 4.8% at 19 chunks of ~400 rows, where the GPU waits on the call's host work (``docs/PERF_NOTES.md``
    v47)."""

    COUNT = 1024
    COUNT_ENV = "HF_FLCE_DW_FREQUENT_CLASSES"  # another count; 0 keeps every row in the 16-bit sum
    # Below this many chunks the 16-bit sum's error stays within ~1.15x the float32 sum's (H100, qwen3-0.6b's head
    # at 8192 rows: 1.88e-3 at 3 chunks, 1.94e-3 at 5, float32 sum 1.71e-3, stock 2.54e-3), and these rows cost 2-5%
    # of such a call (measured with them taken from 2 chunks on).
    MIN_CHUNKS = 8

    @classmethod
    def count(cls) -> int:
        value = env_int(cls.COUNT_ENV)
        return cls.COUNT if value is None else value

    @classmethod
    def bytes_beside(cls, weight: torch.Tensor, used: bool) -> int:
        """Bytes of the float32 rows beside the chunks of a call that would use them (``used``: its dW is summed in
        the 16-bit gradient with its targets known per kept row, ``_GradBuffers(scaled_target=)``), at enough chunks."""
        if not used:
            return 0
        vocab, hidden = weight.shape
        count = min(cls.count(), vocab)
        # the float32 rows, and the per-class counts and slots (int32)
        return 4 * count * hidden + 8 * vocab if count else 0

    def __init__(self, target: torch.Tensor, kept_only: bool, vocab: int, ignore_index: int, hidden: int, count: int):
        device = target.device
        if not kept_only:
            # ignored rows are counted in a slot past the vocabulary
            target = torch.where((target >= 0) & (target < vocab) & (target != ignore_index), target, vocab)
        counts = torch.zeros(vocab + 1, dtype=torch.int32, device=device)
        counts.scatter_add_(0, target, torch.ones_like(target, dtype=torch.int32))
        self.classes = counts[:vocab].topk(min(count, vocab), sorted=False).indices
        self.slot = torch.full((vocab,), -1, dtype=torch.int32, device=device)
        self.slot[self.classes] = torch.arange(self.classes.numel(), dtype=torch.int32, device=device)
        self.rows = torch.zeros((self.classes.numel(), hidden), dtype=torch.float32, device=device)

    def add(self, e: torch.Tensor, x_operand: torch.Tensor) -> None:
        """Their rows of ``E^T (s X)``, in float32."""
        mm_fp32(e.index_select(1, self.classes).t(), x_operand, self.rows)

    def write(self, dw: torch.Tensor) -> None:
        """Their rows of ``dw``, rounded once, after ``add_target_rows(..., hot=(slot, rows))`` has added their
        target terms to ``rows``."""
        dw.index_copy_(0, self.classes, self.rows.to(dw.dtype))
        self.rows = None


class _GradBuffers:
    """dX rows, dW (written once when there is a single chunk; across several, summed in the 16-bit gradient itself
    with ``dw_in_weight_dtype`` (``_dw_sum_in_weight_dtype``), else in float32: ``_SplitDWSum`` for a 16-bit weight, the
    gradient itself for a float32 one) and db for one gradient pass. ``scaled_target``: a scaled gradient's targets (per
    kept row), whose most frequent classes' dW rows are summed in float32 where dW is 16-bit (``_FrequentClassRows``).
    ``weight`` is the GEMM operand; the gradients come out in ``x_dtype`` and ``weight_dtype``. ``chunk_bytes``: what
    a chunk's buffers take, against which ``_SplitDWSum`` is weighed. With ``rows`` (the
    kept rows of a compacted batch of ``n_rows`` rows) each chunk's dX rows are scattered straight into the full
    dX, zero at the dropped rows, so no second ``[N, H]`` buffer is ever made."""

    def __init__(
        self,
        n_rows,
        x_dtype,
        weight,
        weight_dtype,
        n_chunks,
        need_dx,
        need_dw,
        need_db,
        rows=None,
        chunk_bytes=0,
        dw_in_weight_dtype=False,
        scaled_target=None,
        ignore_index=-100,
    ):
        self.dx = None
        if need_dx:
            alloc = torch.empty if rows is None else torch.zeros
            self.dx = alloc((n_rows, weight.shape[1]), dtype=x_dtype, device=weight.device)
        self.rows = rows
        self.single = n_chunks == 1
        self.dw = None
        self.need_dw = need_dw
        self.dw_sum = None
        # the dtype dW is summed in across chunks
        self.sum_dtype = weight_dtype if weight_dtype == torch.float32 or self.single or dw_in_weight_dtype else None
        if need_dw and self.sum_dtype is None and _SplitDWSum.lowers_the_peak(weight, weight_dtype, chunk_bytes):
            self.dw_sum = _SplitDWSum(weight.shape[0])
        self.frequent = None
        if need_dw and dw_in_weight_dtype and scaled_target is not None:
            count = _FrequentClassRows.count()  # read (and checked) at every such call
            if count and n_chunks >= _FrequentClassRows.MIN_CHUNKS:
                vocab, hidden = weight.shape
                kept_only = rows is not None
                self.frequent = _FrequentClassRows(scaled_target, kept_only, vocab, ignore_index, hidden, count)
        self.db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_db else None
        self.weight = weight
        self.weight_dtype = weight_dtype
        # a scaled gradient's dW target terms, per chunk, summed into dW once after the last chunk
        self.target_coefs: list[torch.Tensor] = []
        self.scaled_kind = None

    def add(self, start, end, grad_logits, x_chunk):
        if hasattr(grad_logits, "row_scale"):
            self._add_scaled(start, end, grad_logits, x_chunk)
            return
        if self.dx is not None:
            if self.rows is not None:
                same = self.dx.dtype == grad_logits.dtype
                dx_rows = torch.mm(grad_logits, self.weight) if same else mm_fp32(grad_logits, self.weight)
                self.dx.index_copy_(0, self.rows[start:end], dx_rows.to(self.dx.dtype))
            elif self.dx.dtype == grad_logits.dtype:
                torch.mm(grad_logits, self.weight, out=self.dx[start:end])
            else:
                self.dx[start:end] = mm_fp32(grad_logits, self.weight)
        if self.need_dw:
            self._add_dw(grad_logits, x_chunk)
        if self.db is not None:
            self.db += grad_logits.sum(0, dtype=torch.float32)

    def _add_dw(self, grad_logits, x_chunk):
        if self.dw_sum is not None:
            self.dw_sum.add(grad_logits, x_chunk)
        elif self.sum_dtype is None or self.sum_dtype == torch.float32:
            # the first chunk initialises the float32 sum
            self.dw = dw_product(grad_logits, x_chunk, self.dw)
        elif self.dw is None:
            self.dw = grad_logits.t() @ x_chunk
        else:
            self.dw.addmm_(grad_logits.t(), x_chunk)

    def _add_scaled(self, start, end, grad, x_chunk):
        """A ``ScaledGradient`` (``backends/triton_scaled.py``; the torch backend's ``TargetApartGradient`` has unit
        row scales): ``G = diag(s) E`` plus the target column (and with label smoothing the uniform term ``u``), so
        ``dX = s (E W) + c W[y] (+ u 1^T W)`` and ``dW = E^T (s X)`` (+ ``u^T X`` at every row, in the same GEMM) plus
        ``c x`` added at the target rows."""
        if self.dx is not None:
            # E W in float32 ([rows, H]) is a temporary: not alive any more when the dW GEMM runs (the call's peak).
            # Where the GEMM has no float32 output (CPU) it is the 16-bit product upcast: an exact one would upcast W,
            # 4 V H bytes per chunk.
            grad.write_dx(
                mm_fp32(grad.dx_operand(), self.weight),
                self.weight,
                self.dx,
                None if self.rows is None else self.rows[start:end],
                start,
            )
        if self.need_dw:
            e, x_operand = grad.dw_operands(x_chunk)
            self._add_dw(e, x_operand)
            if self.frequent is not None:
                self.frequent.add(e, x_operand)
            self.target_coefs.append(grad.target_coef)
            self.scaled_kind = type(grad)

    def add_target_rows(self, x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> None:
        """A scaled gradient's ``dW[y_i] += c_i x_i`` over every chunk at once, once the last chunk's dW GEMM is in:
        one sort of the kept targets and one launch per call instead of per chunk. ``x`` is the op's input and
        ``target`` the kept rows' targets."""
        if not self.target_coefs:
            return
        coefs = self.target_coefs[0] if len(self.target_coefs) == 1 else torch.cat(self.target_coefs)
        lower, upper = (self.dw, None) if self.dw_sum is None else self.dw_sum.blocks
        hot = None if self.frequent is None else (self.frequent.slot, self.frequent.rows)
        self.scaled_kind.add_target_rows(
            lower, x, self.rows, target, coefs, ignore_index, upper, hot, self.weight.dtype
        )
        if self.frequent is not None:
            self.frequent.write(self.dw)
            self.frequent = None
        self.target_coefs = []

    def finish(self, scale: torch.Tensor | None = None, scale_into=None):
        """dX, dW (in the weight's dtype) and db, each times ``scale`` (float32 0-d) when given. The buffers are
        handed out, so they are scaled in place (no second copy of dX, which grows with N); the float32 -> weight
        dtype cast of a dW accumulator and its scaling are one pass. ``scale_into(src, scale, out)`` is the
        backend's multiply (the scale is read in float32 either way)."""
        assert not self.target_coefs, "a scaled gradient's target rows are added (add_target_rows) before finish"
        scale_into = scale_into or (lambda src, s, out: torch.mul(src, s, out=out))
        dx, dw, db = self.dx, None, self.db
        if self.dw_sum is not None and self.dw_sum.blocks is not None:
            dw = self.dw_sum.result(self.weight_dtype, scale, scale_into)
        elif self.need_dw:
            out = dict(dtype=self.weight_dtype, device=self.weight.device)
            if self.dw is None:
                dw = torch.zeros(self.weight.shape, **out)
            elif scale is None:
                dw = self.dw.to(self.weight_dtype)
            else:
                target = self.dw if self.dw.dtype == self.weight_dtype else torch.empty(self.weight.shape, **out)
                dw = scale_into(self.dw, scale, target)
        if scale is not None:
            dx = None if dx is None else scale_into(dx, scale, dx)
            db = None if db is None else db.mul_(scale)
        self.dx = self.dw = self.db = self.dw_sum = None
        return dx, dw, db


def _grad_buffer(logits: torch.Tensor, dtype: torch.dtype, tiles: TileOps) -> torch.Tensor:
    """Where the tile pass writes the logits gradient: over the logits themselves when they have its dtype, or for
    a 16-bit gradient over the second half of each float32 row when the backend allows it (the GEMMs read it with a
    row stride of 2V), else a new buffer."""
    if dtype == logits.dtype:
        return logits
    if getattr(tiles, "grad_in_row_tail", False):
        return logits.view(dtype)[:, logits.shape[1] :]
    return torch.empty(logits.shape, dtype=dtype, device=logits.device)


def _bytes_per_logit(plan: CallPlan, grad_dtype: torch.dtype | None, logits_16bit: bool = False) -> int:
    """Chunk bytes per logit: float32 logits, backend scratch, and a separate 16-bit gradient if one is needed. 16-bit
    logits take their own bytes only: the gradient overwrites them, and such a backend's scratch is per row block."""
    if logits_16bit:
        return 2
    separate_grad = grad_dtype not in (None, torch.float32) and not getattr(plan.tiles, "grad_in_row_tail", False)
    return 4 + plan.tiles.scratch_bytes_per_logit + (grad_dtype.itemsize if separate_grad else 0)


def _gemm_path_allowed(plan: CallPlan, weight: torch.Tensor) -> bool:
    """The backend's epilogue GEMM (``triton_gemm``) runs by default only on the GPUs it was measured on (Hopper and
    newer): ``TileOps.gemm_min_capability``."""
    min_capability = getattr(plan.tiles, "gemm_min_capability", 0)
    return not min_capability or (
        weight.device.type == "cuda" and cuda_properties(weight.device).major >= min_capability
    )


def _accumulator_bytes(weight: torch.Tensor, need_dw: bool, in_weight_dtype: bool = False) -> int:
    """Memory that summing dW across chunks takes: none in the gradient itself (``_dw_sum_in_weight_dtype``), or a
    float32 accumulator (for a float32 weight that is the gradient itself; one chunk is still taken up to that size,
    which saves the accumulator's traffic)."""
    if not need_dw or in_weight_dtype:
        return 0
    return weight.numel() * 4


def _plan_rows(budget: int, n_rows: int, vocab: int, per_logit, accumulator: int, logits_16bit):
    """Rows per chunk: the chunk buffers stay within ``budget``. A float32 dW accumulator (``_accumulator_bytes``)
    comes on top of it: it is 4 bytes per weight, and every extra chunk would cost a pass over it."""
    chunk = plan_chunk_rows(n_rows, vocab, per_logit, budget, accumulator)
    if logits_16bit and accumulator and chunk < n_rows:
        # several chunks: dw_product upcasts each chunk's 16-bit gradient (CPU has no float32-output GEMM)
        chunk = plan_chunk_rows(n_rows, vocab, per_logit + 4, budget, accumulator)
    return chunk


def _plan_rows_beside(plan: CallPlan, n_rows, vocab, per_logit, accumulator, logits_16bit, frequent_bytes: int):
    """``_plan_rows`` within the call's budget, less ``frequent_bytes`` (``_FrequentClassRows.bytes_beside``) where
    the plan takes enough chunks for those rows to be made: they live beside the chunks. They take at most half of
    the budget: a budget under twice their bytes (33 MiB at llama3-8b's head) cannot be kept anyway, and the chunks
    are not cut to slivers for it. What the rows themselves hold until the call's end (their statistics, the target
    column's float32 value, the compaction's order and targets: under 64 bytes each) is not counted. Returns the rows
    per chunk and the budget they were planned in."""
    chunk = _plan_rows(plan.budget, n_rows, vocab, per_logit, accumulator, logits_16bit)
    if not frequent_bytes or cdiv(n_rows, chunk) < _FrequentClassRows.MIN_CHUNKS:
        return chunk, plan.budget
    budget = max(plan.budget // 2, plan.budget - frequent_bytes)
    return _plan_rows(budget, n_rows, vocab, per_logit, accumulator, logits_16bit), budget


def _chunk_rows(x: torch.Tensor, rows: torch.Tensor | None, start: int, end: int, plan: CallPlan) -> torch.Tensor:
    """Rows ``start:end`` of the compacted batch as a GEMM operand, gathered one chunk at a time (never a compacted
    copy of all of ``x``, which would grow with N)."""
    return compute_operand(x[start:end] if rows is None else x.index_select(0, rows[start:end]), plan)


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    if rows is None:
        return values
    out = values.new_zeros((n,) + tuple(values.shape[1:]))
    return out.index_copy_(0, rows, values)


def _compaction(plan: CallPlan, device: torch.device):
    """The tile path's compaction on a CUDA GPU: the backend's one-launch ``kept_order`` (``TileOps.compaction``, the
    epilogue GEMM's). torch's takes ~10 launches, several of them after the host's read of the kept count, while the
    GPU waits: 0.5-3% of a queued call on an H100 (``docs/PERF_NOTES.md`` v54)."""
    return getattr(plan.tiles, "compaction", None) if device.type == "cuda" else None


def _tile_deferral(plan: CallPlan, fused, eager: bool, device: torch.device):
    """The compaction module (``_compaction``) with which a tile-path scalar loss launches its first chunk's GEMM
    before the host has read the kept count (``_logits_before_the_count``), or None."""
    return _compaction(plan, device) if fused is None and eager else None


# The FLOPs of the 16-bit logits GEMM launched before the host reads the kept count on the tile path: about 0.2 ms
# on an H100, for the GPU to run while the host takes its steps from that read to the next launch. Twice as many
# measured no better overall and would waste twice as much where nearly every row is masked (docs/PERF_NOTES.md v55).
_LEAD_GEMM_FLOPS = 1.5e11
# A float32 GEMM (without TF32) runs at about 1/15 of a bf16 one's rate on an H100 or an A100 (no tensor cores), so
# its lead takes that much fewer FLOPs for the same time. At 1.5e11 the lead's rows computed for nothing where every
# row is ignored took 2.1% of the 3-GEMM floor's time (isolated, H100, mistral-7b's head; docs/PERF_NOTES.md v57).
_LEAD_FLOAT32_SLOWDOWN = 16


def _lead_rows(rows: int, hidden: int, vocab: int, dtype: torch.dtype) -> int:
    """How many of a deferred chunk's ``rows`` the GEMM launched before the count's read takes (``_LEAD_GEMM_FLOPS``
    on 16-bit operands, ``_LEAD_FLOAT32_SLOWDOWN`` times fewer on float32 ones, in whole 128-row tiles)."""
    flops = int(_LEAD_GEMM_FLOPS) // (1 if dtype.itemsize <= 2 else _LEAD_FLOAT32_SLOWDOWN)
    return min(rows, cdiv(cdiv(flops, 2 * hidden * vocab), 128) * 128)


def _logits_before_the_count(x_chunk, w_c, bias, spare_row: bool, settle: Callable[[], int]) -> torch.Tensor:
    """The tile path's deferred first chunk (see ``_forward``): its float32 logits, cut to the kept rows.

    cuBLAS takes its rows from the host, so this chunk's GEMM cannot read the kept count from device memory as the
    epilogue GEMM does. It is split instead: the GEMM of the leading ``_lead_rows`` rows is launched before the host
    waits for the count (``settle``), the rest of the kept rows' once it is known, into the same buffer. Rows of the
    first GEMM past the kept count are computed for nothing; that happens only when fewer rows are kept than it
    takes, and costs at most its ~0.2 ms, about the idle GPU time it saves. Float32 operands take at least one
    128-row tile on the CUDA cores: with every row ignored at mistral-7b's head, 0.2% of the 3-GEMM floor's time, and
    more on a head with more FLOPs per row."""
    planned = x_chunk.shape[0]
    logits = logits_buffer(planned, w_c.shape[0], x_chunk.device, spare_row)
    lead = _lead_rows(planned, w_c.shape[1], w_c.shape[0], w_c.dtype)
    compute_logits(x_chunk[:lead], w_c, None, out=logits[:lead])
    n_rows = settle()
    if n_rows > lead:
        compute_logits(x_chunk[lead:n_rows], w_c, None, out=logits[lead:n_rows])
    logits = logits[:n_rows]
    if bias is not None:
        logits += bias.float()
    return logits


def _fused_head(plan: CallPlan, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The backend's GEMM-with-softmax-epilogue path (``backends/triton_gemm.py``) when it offers one and this call
    fits it, else None (cuBLAS float32 logits plus the tile passes)."""
    fused = getattr(plan.tiles, "fused_head", None)
    dtype = plan.compute_dtype or x.dtype
    if fused is None or x.stride(-1) != 1 or not fused.supports(dtype, weight, bias, plan.params):
        return None
    return fused if _gemm_path_allowed(plan, weight) else None


def _chunk_forward(
    x_chunk,
    w_c,
    bias,
    ys,
    plan: CallPlan,
    fused,
    inv_denominator,
    eager: bool,
    keep: bool,
    scaled: bool = False,
    settle: Callable[[], int] | None = None,
    rows_on_device: torch.Tensor | None = None,
    keep_columns: int | None = None,
    target_apart: bool = False,
    w_sum: torch.Tensor | None = None,
):
    """One chunk: its row statistics, the detached target probability (DFT only), for a scalar loss the logits
    gradient times ``inv_denominator()`` (0-d, asked for once the logits GEMM is launched; with ``scaled`` as the
    epilogue path's ``ScaledGradient``), and with ``keep`` what the per-token backward reuses.
    ``settle`` (a deferred first chunk, launched before the host knows how many rows are kept; the epilogue GEMM
    reads that count from ``rows_on_device``, the tile path's is split, ``_logits_before_the_count``): called once
    the GEMM is launched, it returns how many of the chunk's leading rows count, and the results are cut to them.
    ``keep_columns`` (with ``keep``): only the leading columns' e is kept. ``target_apart``: a gradient that is not
    a scaled one comes with its target column apart (``_gradient_target_apart``). ``w_sum``: W's column sum, for the
    epilogue path's label-smoothed scaled gradient."""
    n_rows = x_chunk.shape[0]
    # a scaled gradient's row scales come from the GEMM's path already times the upstream 0-d (no pass for it), but
    # for DFT, whose per-row factor is known only after the statistics
    scaled_upstream = inv_denominator if scaled and eager and not plan.prob_weighted else None
    if fused is not None:
        stats, kept = fused.forward(
            x_chunk,
            w_c,
            bias,
            ys,
            plan.params,
            keep=eager or keep,
            rows_on_device=rows_on_device,
            scaled=scaled,
            keep_columns=keep_columns,
            upstream=scaled_upstream,
            w_sum=w_sum,
        )
        if settle is not None:
            n_rows = settle()
            stats, kept, ys = stats.head(n_rows), kept.head(n_rows), ys[:n_rows]
    else:
        # the tile path's one sweep carries label smoothing with a row of ones under E, in the logits' spare row
        spare_row = target_apart and plan.params.label_smoothing != 0.0 and _tile_one_sweep(plan, x_chunk)
        if settle is None:
            kept = compute_logits(x_chunk, w_c, bias, _logits_16bit(plan, x_chunk, bias), spare_row=spare_row)
        else:
            kept = _logits_before_the_count(x_chunk, w_c, bias, spare_row, settle)
            n_rows = kept.shape[0]
            x_chunk, ys = x_chunk[:n_rows], ys[:n_rows]
    if settle is not None and n_rows == 0:  # every row ignored: the caller takes no chunk, nothing more to launch
        return TileStats.empty(0, x_chunk.device), None, None, None
    scale = inv_denominator().expand(n_rows) if eager and scaled_upstream is None else None
    grad_out = prob = None
    if fused is None and eager and not plan.prob_weighted:
        # statistics and gradient in one pass over the logits
        grad_out = _grad_buffer(kept, x_chunk.dtype, plan.tiles)
        if target_apart:
            stats, grad_out = plan.tiles.forward_target_apart(kept, ys, plan.params, scale, grad_out, x_chunk, w_c)
        else:
            stats = plan.tiles.forward(kept, ys, plan.params, grad_scale=scale, grad_out=grad_out)
    elif fused is None:
        stats = plan.tiles.forward(kept, ys, plan.params)
    if plan.prob_weighted:
        # DFT: loss_i * p_y (detached). Its gradient is the CE gradient scaled per row by p_y.
        prob = torch.exp(stats.logprob)
        stats.loss = stats.loss * prob
        if eager:
            scale = scale * prob
    if eager and grad_out is None:
        if scaled:
            grad_out = kept if scaled_upstream is not None else kept.times(scale)
        elif fused is not None and target_apart:
            grad_out = fused.gradient_target_apart(kept, x_chunk, w_c, ys, stats, plan.params, scale)
        elif fused is not None:
            grad_out = fused.gradient(kept, ys, stats.lse, stats.entropy, plan.params, x_chunk.dtype, scale)
        else:
            grad_out = _grad_buffer(kept, x_chunk.dtype, plan.tiles)
            plan.tiles.backward(
                kept, ys, stats.lse, stats.entropy, plan.params, scale, None, None, grad_out, lse_low=stats.lse_low
            )
    return stats, prob, grad_out, (kept if keep else None)


def _joined(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The chunks' ``[rows]`` results as one tensor of ``dtype`` (a single chunk's as it is, possibly a view)."""
    if not parts:
        return torch.zeros(0, dtype=dtype, device=device)
    if len(parts) > 1:
        return torch.cat(parts).to(dtype)
    return parts[0].to(dtype)


def _joined_stats(chunk_stats: list[TileStats], device: torch.device, plan: CallPlan) -> TileStats:
    """Every kept row's statistics (float32; is_top1 bool): the loss, the lse and entropy backward may need, and the
    others where the caller reads them (else None)."""
    wanted = ("loss", "lse_low", *_PER_TOKEN) if plan.want_stats else ("loss", "lse", "lse_low", "entropy")
    parts = {f.name: [getattr(s, f.name) for s in chunk_stats] for f in fields(TileStats) if f.name in wanted}
    if any(part is None for part in parts["lse_low"]):
        parts["lse_low"] = None
    joined = {
        name: None if values is None else _joined(values, torch.bool if name == "is_top1" else torch.float32, device)
        for name, values in parts.items()
    }
    return TileStats(**{f.name: joined.get(f.name) for f in fields(TileStats)})


@dataclass
class _ForwardState:
    """What a forward that wants gradients leaves for backward."""

    eager_grads: _GradBuffers | None  # the scalar loss's gradients, waiting for the upstream scalar
    row_prob: torch.Tensor | None  # DFT: each kept row's detached target probability
    rows: torch.Tensor | None  # the kept rows (None: every row)
    lse: torch.Tensor  # kept rows
    entropy: torch.Tensor  # kept rows
    lse_low: torch.Tensor | None  # kept rows (``TileStats.lse_low``)
    kept: object  # kept logits (or the epilogue path's KeptSoftmax) for the per-token backward, else None


_PER_TOKEN = ("logprob", "entropy", "lse", "is_top1", "mean_logit", "log_sum_sq_probs")


def _outputs(kept_stats: TileStats, plan: CallPlan, scatter) -> tuple[torch.Tensor, ...]:
    """The op's seven outputs from the kept rows' statistics; ``scatter`` places kept-row values into all rows."""

    def placed(values: torch.Tensor) -> torch.Tensor:
        # a backend may return its statistics as rows of one buffer; a view returned by an autograd Function cannot
        # be modified in place
        out = scatter(values)
        return out.clone() if out._base is not None else out

    if plan.reduction == "none":
        loss = placed(kept_stats.loss)
    else:
        loss = kept_stats.loss.sum() / plan.denominator()
    if not plan.want_stats:
        # nobody reads them: one empty placeholder in their six places instead of six scatters
        return (loss,) + (loss.new_empty(0),) * len(_PER_TOKEN)
    return (loss,) + tuple(placed(getattr(kept_stats, name)) for name in _PER_TOKEN)


def _statistics_without_sync(
    x, w_c, bias, target, plan: CallPlan, fused, for_backward: bool = False, keep_columns: int | None = None
):
    """A forward on the epilogue GEMM whose host never waits before the GEMM's launch: the kept rows are moved first
    on the device (a fixed-size gather) and the GEMM reads their count from device memory. Prompt-masked rows still
    cost nothing but that gather. The targets' range is checked by one host read after the launches (a ValueError, as
    everywhere), of a copy made right after the compaction: the call returns while the GEMM runs. The outputs, and
    with ``for_backward`` (a per-token loss) the state that backward needs, else None; with ``keep_columns``, that
    state keeps e (or E with row scales, ``_scaled_kept_columns``) for those leading columns, all of them where it is
    the vocabulary's size, sized for every row, since the kept count is not known before the GEMM. None where this
    does not apply: a call whose partial statistics and gathered rows exceed the budget (it takes the chunked path),
    or one that may not sync at all (graph capture, compilation)."""
    n, vocab = x.shape[0], w_c.shape[0]
    if fused is None or n == 0 or not _can_compact(x.device):
        return None
    # the partial statistics and the gathered rows (plus their cast under autocast), within the budget as one chunk
    row_bytes = x.element_size() + (0 if x.dtype == w_c.dtype else w_c.element_size())
    if n * (vocab * fused.bytes_per_logit(vocab, plan.params, False) + x.shape[1] * row_bytes) > plan.budget:
        return None
    ignore_index = plan.params.ignore_index
    # the kept rows first; the GEMM reads their count from summary[0], and rows past it are never computed
    compaction = _DeviceCompaction.start(fused, target, vocab, ignore_index)
    x_kept = compute_operand(x.index_select(0, compaction.order), plan)
    keep = keep_columns is not None
    stats, kept = fused.forward(
        x_kept,
        w_c,
        bias,
        compaction.targets,
        plan.params,
        keep,
        compaction.summary,
        scaled=keep and _scaled_kept_columns(plan, fused, w_c, bias),
        keep_columns=keep_columns if keep and keep_columns < vocab else None,
    )
    if plan.prob_weighted:
        stats.loss = stats.loss * torch.exp(stats.logprob)
    # the mask only for outputs placed back per token (a scalar loss without stats needs none)
    valid = functools.cache(lambda: target != ignore_index)
    outputs = _outputs(stats, plan, lambda values: values.new_zeros(n).masked_scatter_(valid(), values))
    n_kept = compaction.kept_count()  # the range check, waiting for the compaction's copy alone
    if not for_backward:
        return outputs, None
    rows, _ = compaction.kept(n_kept, target)
    kept = None if kept is None else kept.head(n_kept)
    lse_low = None if stats.lse_low is None else stats.lse_low[:n_kept]
    return outputs, _ForwardState(None, None, rows, stats.lse[:n_kept], stats.entropy[:n_kept], lse_low, kept)


def _forward(x, weight, bias, target, plan: CallPlan, needs_input_grad) -> tuple[tuple, _ForwardState | None]:
    """The op's outputs and, when gradients are wanted, what backward needs."""
    n, vocab = x.shape[0], weight.shape[0]
    need_dx, need_dw, need_db = needs_input_grad
    need_grad = plan.grad_mode and any(needs_input_grad)
    w_c = compute_operand(weight, plan)
    fused = _fused_head(plan, x, w_c, bias)
    eager = need_grad and plan.reduction == "scalar"
    # A per-token loss whose logits will not be kept recomputes them in backward: its forward is a no-grad one that
    # also leaves the rows' lse and entropy, with no host wait before the GEMM. One whose logits fit whole with every
    # row counted keeps them so, with no host wait either. Whether the kept rows' logits fit is known only once the
    # host has read their count, so that wait stays where they would fit with half the rows masked (prompt masking
    # often is about that): a recompute costs a GEMM, more than the wait.
    per_token = need_grad and not eager and not plan.prob_weighted and fused is not None
    logits_bytes = n * vocab * fused.bytes_per_logit(vocab, plan.params) if per_token else 0
    recompute = per_token and logits_bytes > 2 * _keep_limit(plan, x.device)
    keep_whole = per_token and logits_bytes <= _keep_limit(plan, x.device)
    if not need_grad or recompute or keep_whole:
        keep_columns = vocab if keep_whole else None
        if recompute:
            keep_columns = _kept_columns(plan, fused, n, x, w_c, weight, (need_dx, need_dw))
        result = _statistics_without_sync(x, w_c, bias, target, plan, fused, need_grad, keep_columns)
        if result is not None:
            return result
    ignore_index = plan.params.ignore_index
    # the gradient as E and row scales (no pass over the logits)
    scaled = eager and _scaled_gradient(plan, fused, w_c, bias)
    target_apart = eager and not scaled and _gradient_target_apart(plan, fused, x, bias)
    dw_in_weight_dtype = _dw_sum_in_weight_dtype(scaled or target_apart, weight)
    accumulator = _accumulator_bytes(weight, eager and need_dw, dw_in_weight_dtype)
    logits_16bit = fused is None and _logits_16bit(plan, x, bias)
    if fused is not None:
        # without a gradient in forward only the partial statistics take memory; kept logits are one chunk
        per_logit = fused.bytes_per_logit(vocab, plan.params, keep=eager, scaled=scaled)
        kept_per_logit = fused.bytes_per_logit(vocab, plan.params)
    else:
        per_logit = _bytes_per_logit(plan, (plan.compute_dtype or x.dtype) if eager else None, logits_16bit)
        kept_per_logit = 2 if logits_16bit else 4
    if scaled or target_apart:
        per_logit += _scaled_row_bytes(x.shape[1], w_c.element_size()) / vocab
    # With a scaled gradient, or on the tile path, the first chunk's GEMM need not wait for the host to learn how
    # many rows are kept: the kept rows are moved first on the device, that GEMM reads their count from device
    # memory (the tile path's launches its leading rows, _logits_before_the_count), and the host reads it (with the
    # targets' range) while the GEMM runs. The first chunk is then planned as if every row were kept, so this is done
    # only where that chunk fits the budget: where one chunk is taken for costing less than the accumulator it
    # saves, sizing it by every row would spend up to that accumulator more.
    tile_compaction = _tile_deferral(plan, fused, eager, x.device)
    deferred = False
    # dw_in_weight_dtype holds only for a scaled gradient or one with its target column apart, whose targets per kept
    # row _GradBuffers takes
    frequent_bytes = _FrequentClassRows.bytes_beside(weight, need_dw and dw_in_weight_dtype)
    budget = plan.budget
    if (scaled or tile_compaction is not None) and n > 0 and _can_compact(x.device):
        chunk, budget = _plan_rows_beside(plan, n, vocab, per_logit, accumulator, logits_16bit, frequent_bytes)
        deferred = chunk * vocab * per_logit <= budget
    if deferred:
        compaction = _DeviceCompaction.start(fused or tile_compaction, target, vocab, ignore_index)
        rows, ys = compaction.order, compaction.targets
    else:
        rows, ys = kept_rows(target, vocab, ignore_index, _can_compact(x.device), fused or _compaction(plan, x.device))
    n_valid = ys.shape[0]
    if not deferred:
        chunk, budget = _plan_rows_beside(plan, n_valid, vocab, per_logit, accumulator, logits_16bit, frequent_bytes)
    n_chunks = max(1, cdiv(n_valid, chunk))
    keep_logits = (
        need_grad and not eager and n_valid > 0 and n_valid * vocab * kept_per_logit <= _keep_limit(plan, x.device)
    )
    if keep_logits:
        chunk, n_chunks = n_valid, 1
    # a per-token loss whose logits pass the keep limit keeps what fits of them, by leading columns, in one chunk
    keep_columns = None
    if need_grad and not eager and not keep_logits and n_chunks == 1 and fused is not None and not plan.prob_weighted:
        keep_columns = _kept_columns(plan, fused, n_valid, x, w_c, weight, (need_dx, need_dw))
    keep = keep_logits or keep_columns is not None
    # the scalar loss's gradient, or what a per-token loss keeps (its leading columns, or its logits whole), as E and
    # row scales
    scaled = scaled or (keep and not plan.prob_weighted and _scaled_kept_columns(plan, fused, w_c, bias))

    def settle() -> int:
        """The deferred first chunk's rows that are kept, once the host has read the count. The rest is planned in as
        few chunks as the budget allows, balanced among themselves: the first was sized for every row, and chunks no
        larger than it can take one more where rows were dropped (gemma2-2b with every 17th row ignored: 5 instead
        of 4). Where they take no fewer, they are no larger than the first either, so the peak does not move."""
        nonlocal rows, ys, n_valid, chunk, n_chunks
        if eager:
            inv_denominator()  # its launches are made while the host waits for the count, not after
        n_kept = compaction.kept_count()
        rows, ys = compaction.kept(n_kept, target)
        first, n_valid = chunk, n_kept
        rest = max(0, n_kept - first)
        n_rest = 0
        if rest:
            n_rest = cdiv(rest, plan_chunk_rows(rest, vocab, per_logit, budget, balanced=False))
            chunk = cdiv(rest, n_rest)
        n_chunks = 1 + n_rest
        return min(n_kept, first)

    # dX (zeroed where rows were dropped) and the dW summation, made once the first chunk's GEMM is launched: an
    # isolated call's GPU waits for every host step before that launch
    def new_grads() -> _GradBuffers:
        chunk_bytes = chunk * vocab * per_logit
        return _GradBuffers(
            n,
            x.dtype,
            w_c,
            weight.dtype,
            n_chunks,
            need_dx,
            need_dw,
            need_db,
            rows,
            chunk_bytes,
            dw_in_weight_dtype,
            ys if scaled or target_apart else None,
            ignore_index,
        )

    # Asked for after the first GEMM's launch: the denominator's few small launches then run under that GEMM
    # instead of delaying it (an isolated call's GPU waits for every host step before the GEMM).
    @functools.cache
    def inv_denominator() -> torch.Tensor:
        return plan.denominator().to(torch.float32).reciprocal()

    # label smoothing's sum of t and uniform term on the epilogue path, once per call (triton_scaled)
    w_sum = w_c.sum(0, dtype=torch.float32) if scaled and eager and plan.params.label_smoothing != 0.0 else None
    grads = kept = None
    chunk_stats, chunk_probs = [], []
    start = 0
    while start < n_valid:
        end = min(start + chunk, n_valid)
        x_chunk = _chunk_rows(x, rows, start, end, plan)
        first_deferred = deferred and start == 0
        stats, prob, grad_out, kept_chunk = _chunk_forward(
            x_chunk,
            w_c,
            bias,
            ys[start:end],
            plan,
            fused,
            inv_denominator,
            eager,
            keep,
            scaled,
            settle if first_deferred else None,
            compaction.summary if first_deferred else None,
            keep_columns,
            target_apart,
            w_sum,
        )
        if first_deferred:
            end = start + stats.loss.shape[0]
            x_chunk = x_chunk[: end - start]
        if end > start:
            chunk_stats.append(stats)
            chunk_probs.append(prob)
            if eager:
                if grads is None:
                    grads = new_grads()
                grads.add(start, end, grad_out, x_chunk)
            elif keep:
                kept = kept_chunk
        # the next chunk's buffers must not be allocated while this chunk's are still referenced
        del grad_out, kept_chunk
        start = end
    if eager:
        if grads is None:  # no kept row, no chunk
            grads = new_grads()
        grads.add_target_rows(x, ys, ignore_index)

    kept_stats = _joined_stats(chunk_stats, x.device, plan)
    outputs = _outputs(kept_stats, plan, lambda values: _scatter_rows(values, rows, n))
    if not need_grad:
        return outputs, None
    prob_v = _joined(chunk_probs, torch.float32, x.device) if plan.prob_weighted else None
    return outputs, _ForwardState(grads, prob_v, rows, kept_stats.lse, kept_stats.entropy, kept_stats.lse_low, kept)


def forward_without_grad(x, weight, bias, target, plan: CallPlan) -> tuple[torch.Tensor, ...]:
    """The op's outputs where no gradient is wanted, without autograd's bookkeeping."""
    return _forward(x, weight, bias, target, plan, (False, False, False))[0]


def _scalar_grad_per_row(g_loss: torch.Tensor, plan: CallPlan, row_prob, rows, n: int) -> torch.Tensor:
    """A scalar loss's upstream gradient as each row's: ``g / denominator``, times the row's detached target
    probability for DFT (``row_prob`` holds the kept rows')."""
    per_row = (g_loss.to(torch.float32) / plan.denominator()).expand(n)
    if plan.prob_weighted:
        per_row = per_row * _scatter_rows(row_prob, rows, n)
    return per_row


@dataclass
class SavedForWeightGrad:
    """What a scalar loss computed against a detached weight leaves for that weight's gradient, computed later
    (``patches.late_head_grad.LateHeadGrad``). The kept rows' lse is known, so dW takes no statistics pass and no
    host wait: the recomputing backward of a per-token loss, with the scalar's gradient spread over the rows and dX
    not asked for. Past the budget it walks the vocabulary in chunks, each chunk's gradient ``[rows, C]`` giving dW's
    rows of that chunk in one GEMM over every kept row, written once in the weight's dtype: no float32 ``[V, H]``
    sum. Each row's target column is added to dW in float32 (``_recompute_by_columns``)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    rows: torch.Tensor | None
    lse: torch.Tensor
    entropy: torch.Tensor
    lse_low: torch.Tensor | None
    row_prob: torch.Tensor | None
    plan: CallPlan

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every field but the plan, in order, for ``ctx.save_for_backward``."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "plan")

    def weight_grad(self, g_loss: torch.Tensor, memory_budget: int | None = None) -> torch.Tensor:
        """dW of the loss times its upstream gradient ``g_loss`` (0-d), within ``memory_budget`` bytes of logits (by
        default the forward's)."""
        plan = self.plan if memory_budget is None else replace(self.plan, budget=memory_budget)
        per_row = _scalar_grad_per_row(g_loss, plan, self.row_prob, self.rows, self.x.shape[0])
        needs = (False, True, False)
        stats = (self.lse, self.entropy, self.lse_low)
        args = (self.x, self.weight, self.bias, self.target, self.rows, *stats, None, plan)
        return _recompute_grads(*args, per_row, None, None, *needs)[1]


def first_derivative_only(backward: Callable) -> Callable:
    """An autograd Function's ``backward`` that refuses to build a graph of the gradient (``create_graph=True``).
    The fused op's gradients are formed from saved tensors by kernels autograd does not record, so a gradient of
    them would silently be 0 or partial."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled() and any(ctx.needs_input_grad):
            raise RuntimeError(
                "hf_flce's fused linear cross-entropy has no second derivative: a backward with create_graph=True "
                "through it is not supported (compute higher-order gradients with the unfused loss)"
            )
        return backward(ctx, *grads)

    return wrapper


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, plan: CallPlan):
        ctx.set_materialize_grads(False)
        outputs, state = _forward(x, weight, bias, target, plan, ctx.needs_input_grad[:3])
        receiver, plan.save_for_weight_grad = plan.save_for_weight_grad, None
        if receiver is not None and state is not None:
            # detached: x's graph reaches the caller's, which holds this (a cycle only the garbage collector breaks)
            inputs = (t if t is None else t.detach() for t in (x, weight, bias))
            stats = (state.lse, state.entropy, state.lse_low)
            receiver(SavedForWeightGrad(*inputs, target, state.rows, *stats, state.row_prob, plan))
        ctx.mark_non_differentiable(*outputs[3:])
        ctx.plan = plan
        ctx.eager = state is not None and state.eager_grads is not None
        ctx.n = x.shape[0]
        ctx.grad_enabled = state is not None
        if state is not None:
            ctx.eager_grads = state.eager_grads
            ctx.row_prob = state.row_prob
            # A per-token backward reads the kept rows alone: they are saved instead of x, whose prompt rows then need
            # not outlive the forward (backward would gather the same rows), and dX is scattered back to every row.
            ctx.rows_gathered = not ctx.eager and state.rows is not None
            saved_x, saved_target = x, target
            if ctx.rows_gathered:
                saved_x, saved_target = x.index_select(0, state.rows), target.index_select(0, state.rows)
            stats = (state.lse, state.entropy, state.lse_low)
            ctx.save_for_backward(saved_x, weight, bias, saved_target, state.rows, *stats)
            # Kept logits are overwritten by the first backward, so they live on ctx (not version-checked) and are
            # dropped once used: a second backward (retain_graph) recomputes them.
            ctx.kept = state.kept
        return outputs

    @staticmethod
    @first_derivative_only
    def backward(ctx, g_loss, g_logp, g_ent, *unused):
        if not ctx.grad_enabled:
            return None, None, None, None, None
        x, weight, bias, target, rows, lse_v, ent_v, lse_low = ctx.saved_tensors
        plan = ctx.plan
        kept, ctx.kept = ctx.kept, None
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        per_token_loss = None if ctx.eager else g_loss
        eager_grads, ctx.eager_grads = ctx.eager_grads, None
        if ctx.eager and g_loss is not None:
            if eager_grads is not None:
                dx, dw, db = eager_grads.finish(g_loss.to(torch.float32), getattr(plan.tiles, "scale_into", None))
            else:
                # A second backward (retain_graph): the eager buffers were handed out, so recompute, with the
                # scalar's gradient spread over the rows.
                per_token_loss = _scalar_grad_per_row(g_loss, plan, ctx.row_prob, rows, ctx.n)
        if per_token_loss is not None or g_logp is not None or g_ent is not None:
            upstream, gather = (per_token_loss, g_logp, g_ent), rows
            if ctx.rows_gathered:
                upstream = tuple(None if g is None else g.reshape(-1).index_select(0, rows) for g in upstream)
                gather = None
            stats = (lse_v, ent_v, lse_low)
            pdx, pdw, pdb = _recompute_grads(
                x, weight, bias, target, gather, *stats, kept, plan, *upstream, need_dx, need_dw, need_db
            )
            if ctx.rows_gathered and pdx is not None:
                pdx = _scatter_rows(pdx, rows, ctx.n)
            dx = pdx if dx is None else (dx if pdx is None else dx + pdx)
            dw = pdw if dw is None else (dw if pdw is None else dw + pdw)
            db = pdb if db is None else (db if pdb is None else db + pdb)
        if db is not None and bias is not None:
            db = db.to(bias.dtype)
        return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), None, None


class _RowSumBalance:
    """Brings each row of a recomputed float32 gradient to its exact sum. The recomputing GEMM has another shape
    than the forward's and may round each logit differently (cuBLAS picks its kernel by shape; on CPU a one-row chunk
    takes a GEMV), while p_j = exp(t_j - lse) takes the forward's lse: a row's p_j then sum to 1 + d, off by
    ``sum_j p_j (r_j - r'_j)`` for the two roundings r, r' (up to half an ulp of the logits each). Where the logits
    share a large offset (lse ~ 170: 7.6e-6 per logit), ``d`` is a bias along W's mean row, which carries the offset,
    and it took the per-token dX to 2-90x stock float32's error, dW to 40x at peaked rows (stock's p_j sum to 1 with
    its own lse). Renormalizing p would move ``d`` onto every column in proportion to p_j, which needs P again; here
    the target column takes its share ``d p_y`` (the whole defect at a peaked row) in dX, dW and db, and the rest
    ``d (1 - p_y)`` goes to dX along W's mean row, which removes the bias and leaves the other columns' roundings as
    noise of stock's kind. The rows are summed in float32: a float64 sum took 5.5x the time on an H100 (1.8 ms per GB)
    for dX errors at most 1.04-1.10x stock's instead of 1.24x in the CPU probes. Only float32 gradients without a
    softcap: a 16-bit gradient rounds far more than this, and a softcap's ``dt/dz`` differs by column, so its rows
    have no known sum."""

    @staticmethod
    def applies(plan: CallPlan, grad_dtype: torch.dtype) -> bool:
        return grad_dtype == torch.float32 and plan.params.softcap is None

    def __init__(self, plan: CallPlan, ys, lse, lse_low, g_loss):
        self.plan, self.ys, self.lse, self.lse_low, self.g_loss = plan, ys, lse, lse_low, g_loss
        self.sums = torch.zeros(ys.shape[0], dtype=torch.float32, device=ys.device)
        self.target_logit = torch.zeros(ys.shape[0], dtype=torch.float32, device=ys.device)

    def see_logits(self, logits: torch.Tensor, rows: slice, first_column: int) -> None:
        """Takes the target logits of a recomputed chunk (rows ``rows``, columns ``first_column:``) before its
        gradient pass writes over them."""
        column = self.ys[rows] - first_column
        inside = (column >= 0) & (column < logits.shape[1])
        taken = logits.gather(1, torch.where(inside, column, 0).unsqueeze(1)).squeeze(1).float()
        self.target_logit[rows] = torch.where(inside, taken, self.target_logit[rows])

    def see_gradient(self, grad: torch.Tensor, rows: slice) -> None:
        self.sums[rows] += grad.sum(1)

    def apply(self, w_c: torch.Tensor, x_rows: torch.Tensor | None, dw, db, add_to_dx: Callable | None) -> None:
        """Adds each row's share at its target column to ``dw`` and ``db`` (either may be None; by the backend's
        ``add_target_rows`` where it has one, deterministic) and passes dX's correction, ``[rows, H]`` float32, to
        ``add_to_dx``; ``x_rows`` are the rows (float32; only read for dw)."""
        column, at_target, along_mean = self._corrections()
        if add_to_dx is not None:
            w_mean = w_c.mean(0, dtype=torch.float32)
            add_to_dx((at_target * w_c.index_select(0, column)).addcmul_(along_mean, w_mean.unsqueeze(0)))
        add_rows = getattr(self.plan.tiles, "add_target_rows", None)
        for grad, rows in ((dw, x_rows), (db, None)):
            if grad is None:
                continue
            if rows is None:  # db: dW's rule on a column of ones
                grad, rows = grad.unsqueeze(1), torch.ones_like(at_target)
            if add_rows is not None:
                add_rows(grad, rows, self.ys, at_target.squeeze(1), self.plan.params.ignore_index)
            else:
                grad.index_add_(0, column, (rows * at_target).to(grad.dtype))

    def _corrections(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's target column (0 at an ignored row), and what to add at that column and along W's mean row
        (``[rows, 1]``, 0 at an ignored row)."""
        params = self.plan.params
        valid = self.ys != params.ignore_index
        # sum_j dloss/dt_j = 2 z_loss lse (backends/base.py: the smoothing's and class weights' terms cancel), the
        # log-prob's and the entropy's sum to 0; times dt/dz = 1 / temperature
        wanted = torch.zeros_like(self.lse)
        if self.g_loss is not None and params.z_loss:
            wanted = self.g_loss * (2.0 * params.z_loss * params.inv_temperature) * self.lse
        defect = torch.where(valid, wanted - self.sums, 0.0)
        log_p = self.target_logit * params.inv_temperature - self.lse
        if self.lse_low is not None:
            log_p = log_p - self.lse_low
        at_target = defect * log_p.exp().clamp(max=1.0)
        return torch.where(valid, self.ys, 0), at_target.unsqueeze(1), (defect - at_target).unsqueeze(1)


def _recompute_grads(
    x, weight, bias, target, rows, lse_v, ent_v, lse_low, kept, plan, g_loss, g_logp, g_ent, need_dx, need_dw, need_db
):
    """Gradient pass for per-token upstream gradients: one extra GEMM per chunk unless the logits were kept."""
    n = x.shape[0]

    def compact(t):
        if t is None:
            return None
        t = t.reshape(-1).to(torch.float32)
        return t if rows is None else t.index_select(0, rows)

    ys = target if rows is None else target.index_select(0, rows)
    gl, glp, ge = compact(g_loss), compact(g_logp), compact(g_ent)
    n_valid = ys.shape[0]
    w_c = compute_operand(weight, plan)
    if kept is not None and hasattr(kept, "row_scale") and kept.e.shape[1] == weight.shape[0]:
        # logits kept whole as E with row scales: the scalar loss's route, once each row's upstream factor is known
        per_row = _scaled_upstream(plan, gl, glp, ge)
        if per_row is not None:
            grads = _GradBuffers(n, x.dtype, w_c, weight.dtype, 1, need_dx, need_dw, need_db, rows)
            grads.add(0, n_valid, kept.times(per_row), _chunk_rows(x, rows, 0, n_valid, plan))
            kept.e = None
            grads.add_target_rows(x, ys, plan.params.ignore_index)
            return grads.finish()
        # no row scale of E: the logits are recomputed
        kept.e, kept = None, None
    fused = _fused_head(plan, x, w_c, bias)
    logits_16bit = fused is None and _logits_16bit(plan, x, bias)
    if fused is not None:
        per_logit = x.dtype.itemsize if plan.compute_dtype is None else plan.compute_dtype.itemsize
    else:
        per_logit = _bytes_per_logit(plan, plan.compute_dtype or x.dtype, logits_16bit)
    accumulator = _accumulator_bytes(weight, need_dw)
    chunk = _plan_rows(plan.budget, n_valid, weight.shape[0], per_logit, accumulator, logits_16bit)
    if kept is not None:
        chunk = max(n_valid, 1)
    n_chunks = max(1, cdiv(n_valid, chunk))
    over_budget = n_valid * weight.shape[0] * per_logit > plan.budget
    # Past the budget, row chunks sum dW in a [V, H] float32 accumulator, or take every row at once where that costs
    # less than the accumulator. Column chunks stay within the budget, with [rows, H] buffers (a float32 dX, and the
    # gathered rows of a compacted batch) and no pass over an accumulator. A forward that kept the leading columns
    # (``_kept_columns``) chose them already. dW alone (``SavedForWeightGrad``) always goes by columns: within the
    # budget that is one chunk, the same GEMMs, with the target column added in float32. Logits kept whole take one
    # row chunk: the target column's float32 path (a float32 dX, a sort, three small kernels) would cost 2-5% there.
    partly_kept = kept is not None and not isinstance(kept, torch.Tensor) and kept.e.shape[1] < weight.shape[0]
    by_columns = (
        kept is None
        and (over_budget or not need_dx)
        and need_dw
        and _vocab_chunks()
        and _column_buffers_fit(plan, n_valid, x, w_c, weight, rows is not None, (need_dx, need_dw))
    )
    if partly_kept or by_columns:
        return _recompute_by_columns(
            x,
            w_c,
            weight.dtype,
            bias,
            rows,
            ys,
            lse_v,
            ent_v,
            lse_low,
            plan,
            fused,
            (gl, glp, ge),
            per_logit,
            (need_dx, need_dw, need_db),
            kept,
        )
    balance = None
    if fused is None and kept is None and _RowSumBalance.applies(plan, plan.compute_dtype or x.dtype):
        balance = _RowSumBalance(plan, ys, lse_v, lse_low, gl)
    chunk_bytes = chunk * weight.shape[0] * per_logit
    grads = _GradBuffers(n, x.dtype, w_c, weight.dtype, n_chunks, need_dx, need_dw, need_db, rows, chunk_bytes)
    for start, end in _chunks(n_valid, chunk):
        x_chunk = _chunk_rows(x, rows, start, end, plan)
        sl = slice(start, end)
        upstream = tuple(None if g is None else g[sl] for g in (gl, glp, ge))
        if kept is not None and not isinstance(kept, torch.Tensor):
            grad_out = fused.gradient(kept, ys[sl], lse_v[sl], ent_v[sl], plan.params, x_chunk.dtype, *upstream)
        elif fused is not None and kept is None:
            # the epilogue of the recomputing GEMM writes the gradient itself: the logits never exist
            grad_out = fused.recompute_gradient(
                x_chunk, w_c, bias, ys[sl], lse_v[sl], ent_v[sl], plan.params, *upstream
            )
        else:
            logits = kept
            if logits is None:
                logits = compute_logits(x_chunk, w_c, bias, logits_16bit)
                if balance is not None:
                    balance.see_logits(logits, sl, 0)
            grad_out = _grad_buffer(logits, x_chunk.dtype, plan.tiles)
            low = None if lse_low is None else lse_low[sl]
            plan.tiles.backward(logits, ys[sl], lse_v[sl], ent_v[sl], plan.params, *upstream, grad_out, lse_low=low)
            del logits
            if balance is not None:
                balance.see_gradient(grad_out, sl)
        grads.add(start, end, grad_out, x_chunk)
        del grad_out
    dx, dw, db = grads.finish()
    if balance is not None:

        def add_to_dx(correction: torch.Tensor) -> None:
            if rows is None:
                dx.add_(correction)
            else:
                dx.index_add_(0, rows, correction.to(dx.dtype))

        x_rows = None if dw is None else _chunk_rows(x, rows, 0, n_valid, plan)
        balance.apply(w_c, x_rows, dw, db, None if dx is None else add_to_dx)
    return dx, dw, db


# A vocabulary chunk's width on the tile path is a multiple of this: only the last chunk has a ragged GEMM tile.
_TILE_COLUMN_ALIGN = 128


def plan_chunk_columns(n_rows: int, vocab: int, bytes_per_logit: float, budget: int, align: int) -> int:
    """Columns per vocabulary chunk of ``n_rows`` rows: as many as ``budget`` bytes allow, balanced, and a multiple of
    ``align`` (a GEMM column tile, so only the last chunk has a ragged tile), at least ``align``."""
    per_column = max(1, int(n_rows * bytes_per_logit))
    most = max(align, budget // per_column // align * align)
    n_chunks = cdiv(vocab, most)
    balanced = cdiv(vocab, n_chunks)
    return cdiv(balanced, align) * align


def _recompute_by_columns(
    x, w_c, weight_dtype, bias, rows, ys, lse_v, ent_v, lse_low, plan, fused, upstream, per_logit, needs, kept=None
):
    """The recomputing backward over vocabulary chunks instead of row chunks. Each chunk's gradient ``[rows, C]``
    (every kept row: their lse is known) gives dW's rows of that chunk in one GEMM over all rows, written once in the
    weight's dtype; dX is summed over the chunks in float32. Row chunks would sum dW in a ``[V, H]`` float32
    accumulator instead, read and written once per chunk: with rows < V this takes less memory and traffic, and dW is
    rounded once, as one GEMM rounds it. A chunk's gradient comes from the epilogue of the GEMM that recomputes its
    logits (``fused``), or from the tile pass over its logits. ``kept`` (the forward's e for the leading columns,
    ``_kept_columns``) gives the first chunk's gradient by a pass over it, freed before the GEMMs recompute the
    others; kept as ``E`` with row scales (``_scaled_kept_columns``) it gives their dX and dW with no pass. The
    recomputing epilogue and that pass (16-bit, without a bias) write 0 at each row's target column (as ``E`` holds
    it), and that column's float32 value (from a float32 dot per row) is added to dW's target rows and to dX at the
    end: bf16 holds ``p_y - 1`` to 2^-9 only, which loses ``p_y`` wherever it is smaller (stock's gradient does). dW
    is then rounded once at its other rows, and its target rows, whose 16-bit part holds the other rows' small terms
    only, get the float32 term before a second rounding."""
    need_dx, need_dw, need_db = needs
    n_valid = ys.shape[0]
    vocab = w_c.shape[0]
    logits_16bit = fused is None and _logits_16bit(plan, x, bias)
    x_kept = _chunk_rows(x, rows, 0, n_valid, plan)
    # dW in a weight dtype other than the gradient's is an exact float32 product; with no float32-output GEMM (CPU,
    # NPU) that upcasts its operands, so the rows are upcast once here and their bytes come out of the chunks' budget
    x_dw = x_kept
    if need_dw and weight_dtype != x_kept.dtype and not _fp32_out(x_kept):
        x_dw = x_kept.float()
    upcast_rows_bytes = 0 if x_dw is x_kept else x_dw.numel() * 4
    dx_acc = None
    dw = torch.empty(w_c.shape, dtype=weight_dtype, device=w_c.device) if need_dw else None
    db = torch.empty(vocab, dtype=torch.float32, device=w_c.device) if need_db else None
    # each kept row's target column apart, in float32 (db would need it too: not with a bias)
    target_apart = fused is not None and bias is None and x_kept.dtype.itemsize == 2 and _target_column_apart()
    balance = None
    if fused is None and _RowSumBalance.applies(plan, x_kept.dtype):
        balance = _RowSumBalance(plan, ys, lse_v, lse_low, upstream[0])

    def add_dw(start: int, end: int, grad: torch.Tensor, rows: torch.Tensor) -> None:
        """dW's rows ``start:end`` as ``grad^T rows``, in the weight's dtype (in float32 before its rounding)."""
        if weight_dtype == grad.dtype:
            torch.mm(grad.t(), rows, out=dw[start:end])
        else:
            dw[start:end] = exact_mm_fp32(grad.t(), rows)

    def add(start: int, end: int, grad: torch.Tensor) -> None:
        nonlocal dx_acc
        w_cols = w_c[start:end]
        if need_dx:
            # the first chunk writes the float32 sum, the others add into it
            dx_acc = exact_mm_fp32(grad, w_cols, dx_acc)
        if dw is not None:
            # x_dw is x_kept unless the weight's dtype differs from the gradient's
            add_dw(start, end, grad, x_dw)
        if db is not None:
            db[start:end] = grad.sum(0, dtype=torch.float32)

    def recompute(start: int, end: int) -> torch.Tensor:
        w_cols, b_cols = w_c[start:end], None if bias is None else bias[start:end]
        if fused is not None:
            return fused.recompute_gradient(
                x_kept,
                w_cols,
                b_cols,
                ys,
                lse_v,
                ent_v,
                plan.params,
                *upstream,
                first_column=start,
                target_apart=target_apart,
            )
        logits = compute_logits(x_kept, w_cols, b_cols, logits_16bit)
        if balance is not None:
            balance.see_logits(logits, slice(None), start)
        grad = _grad_buffer(logits, x_kept.dtype, plan.tiles)
        plan.tiles.backward(logits, ys, lse_v, ent_v, plan.params, *upstream, grad, first_column=start, lse_low=lse_low)
        return grad

    def add_scaled(scaled) -> None:
        """The kept columns' dW rows ``E^T (s X)`` and dX sum ``s (E W)``, from the forward's ``E`` with row scales
        ``s``: as ``add`` would from their gradient ``diag(s) E``, less the target column, 0 in ``E`` and added below
        with the others'. dW first, so that ``s X`` is freed before dX's float32 sum exists."""
        nonlocal dx_acc
        columns = scaled.e.shape[1]
        if dw is not None:
            add_dw(0, columns, scaled.e, scaled.x_operand(x_kept))
        if need_dx:
            dx_acc = scaled.scale(exact_mm_fp32(scaled.e, w_c[:columns]))

    first = 0
    if kept is not None and hasattr(kept, "row_scale"):
        per_row = _scaled_upstream(plan, *upstream) if target_apart else None
        if per_row is None:
            # no row scale of E: the kept columns are recomputed with the others
            kept.e, kept = None, None
        else:
            first = kept.e.shape[1]
            scaled = kept.times(per_row)
            kept.e = None
            add_scaled(scaled)
            del scaled
    elif kept is not None:
        first = kept.e.shape[1]
        grad = fused.gradient(kept, ys, lse_v, ent_v, plan.params, x_kept.dtype, *upstream, target_apart=target_apart)
        add(0, first, grad)
        del grad
    align = _TILE_COLUMN_ALIGN if fused is None else fused.COLUMN_ALIGN
    # on the tile path where the GEMM has no float32 output (CPU, NPU), exact_mm_fp32 upcasts each chunk's 16-bit
    # gradient for dX (the epilogue GEMM runs on CUDA, where it has one)
    if fused is None and x_kept.dtype.itemsize == 2 and not _fp32_out(x_kept):
        per_logit += 4
    columns = plan_chunk_columns(n_valid, vocab - first, per_logit, max(1, plan.budget - upcast_rows_bytes), align)
    for start, end in _chunks(vocab - first, columns):
        start, end = first + start, min(first + end, vocab)
        grad = recompute(start, end)
        if balance is not None:
            balance.see_gradient(grad, slice(None))
        add(start, end, grad)
        del grad
    dx = None
    if target_apart:
        target_column = fused.target_gradient(x_kept, w_c, ys, lse_v, ent_v, plan.params, *upstream)
        if dw is not None:
            fused.add_target_rows(dw, x_kept, None, ys, target_column, plan.params.ignore_index)
        if dx_acc is not None:
            # added in the pass that casts the float32 sum and scatters it to the kept rows
            dx = (torch.empty if rows is None else torch.zeros)(x.shape, dtype=x.dtype, device=x.device)
            fused.write_dx(dx_acc, w_c, ys, target_column, dx, rows)
    if balance is not None:
        balance.apply(w_c, x_dw, dw, db, None if dx_acc is None else dx_acc.add_)
    if dx is None and dx_acc is not None:
        dx = _scatter_rows(dx_acc.to(x.dtype), rows, x.shape[0])
    return dx, dw, db
