"""The contract between the shared chunk driver (``hf_flce.engine``) and a backend.

The driver does the GEMMs (cuBLAS, torch_npu or CPU BLAS through ``torch.mm``), the chunking and autograd. A backend
only does the passes over one chunk of logits, ``[rows, V]``: the statistics and loss of each row, and the gradient of
the logits. Row ``i`` of a chunk holds raw logits ``z = x_i W^T + b`` in float32 (on CPU, in the GEMM's 16-bit dtype
for a backend with ``cpu_16bit_logits``); the backend applies softcap and temperature itself, so that every backend
transforms the logits the same way.

Gradient of one row (``t`` the transformed logits, ``p = softmax(t)``, ``w`` the class weights, ``eps`` the label
smoothing, ``y`` the target):

    loss  = (1 - eps) * w_y * (lse - t_y) + eps / V * sum_j w_j * (lse - t_j) + z_loss * lse**2
    dloss/dt_j = p_j * ((1 - eps) * w_y + eps / V * sum_k w_k + 2 * z_loss * lse)
                 - (1 - eps) * w_y * [j == y] - eps / V * w_j
    dlogp/dt_j = [j == y] - p_j                       (logp = t_y - lse)
    dH/dt_j    = -p_j * (t_j - lse + H)               (H = lse - sum_j p_j t_j)

and ``dt/dz = (1 - tanh(z / softcap)**2) / temperature``.

``t_j - lse`` (= log p_j) is the difference of two numbers that may be large (a trained model's logits share an
offset of tens or hundreds), so lse is kept as two float32 numbers, ``lse`` and its rounding error ``lse_low``: one
float32 lse is off by up to half its ulp, and every p_j with it, so the gradient's row sum is off by that much, a bias
along the weight's mean row that outgrows stock's float32 gradient error at |lse| of about 20 and more.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from ..options import OPTIONAL_STATS


@dataclass
class TileParams:
    """Per-call constants of the tile passes."""

    vocab: int
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    inv_temperature: float
    class_weight: torch.Tensor | None  # float32 [V]
    class_weight_sum: torch.Tensor | None  # float32 0-d, sum of class_weight
    # The optional statistics the caller reads. A backend may skip the others and return them as 0 (False).
    optional_stats: frozenset[str] = OPTIONAL_STATS


def lse_pair(row_max: torch.Tensor, log_sum_exp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse = row_max + log_sum_exp`` rounded, and its rounding error (Knuth's two-sum: exact for any two float32
    values), 0 where either is not finite."""
    lse = row_max + log_sum_exp
    b = lse - row_max
    low = (row_max - (lse - b)) + (log_sum_exp - b)
    return lse, torch.where(torch.isfinite(low), low, 0.0)


def check_columns(first_column: int, columns: int, vocab: int) -> None:
    """Raises where a vocabulary chunk ``first_column:first_column + columns`` does not lie inside ``[0, vocab)``: a
    pass would index the class weights and place the target's one-hot entry by those columns."""
    if first_column < 0 or first_column + columns > vocab:
        raise ValueError(f"columns {first_column}:{first_column + columns} pass the vocabulary {vocab}")


@dataclass
class TileStats:
    """Per-row results of a forward tile pass; all ``[rows]``, 0 (False) at ignored rows."""

    loss: torch.Tensor  # float32, class-weighted, smoothing and z-loss included
    lse: torch.Tensor  # float32
    logprob: torch.Tensor  # float32
    entropy: torch.Tensor  # float32
    is_top1: torch.Tensor  # bool
    mean_logit: torch.Tensor  # float32
    log_sum_sq_probs: torch.Tensor  # float32, log(sum_j p_j**2) (WPO weighting in TRL's DPO)
    # float32, lse's rounding error: lse + lse_low is the log-sum-exp to twice float32's precision (see above). None
    # on the 16-bit paths, whose logits and stored e round far more.
    lse_low: torch.Tensor | None = None

    @classmethod
    def empty(
        cls, rows: int, device: torch.device, dtype: torch.dtype = torch.float32, lse_low: bool = False
    ) -> TileStats:
        """Unfilled results for ``rows`` rows, each its own tensor (``dtype``; ``is_top1`` bool; ``lse_low`` None
        unless asked for)."""
        names = [f.name for f in fields(cls) if f.name not in ("is_top1", "lse_low")] + (["lse_low"] if lse_low else [])
        values = {name: torch.empty(rows, dtype=dtype, device=device) for name in names}
        return cls(is_top1=torch.empty(rows, dtype=torch.bool, device=device), **values)

    def head(self, rows: int) -> TileStats:
        """The first ``rows`` rows (views)."""
        return TileStats(**{f.name: _head(getattr(self, f.name), rows) for f in fields(self)})


def _head(values: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if values is None else values[:rows]


class TileOps(Protocol):
    name: str
    # Scratch bytes per logit the backend needs on top of the float32 logits chunk (used to size chunks).
    scratch_bytes_per_logit: int
    # Optional: ``keep_logits_limit(device) -> int``, bytes of float32 logits the per-token path may keep from
    # forward to backward (default: the chunk budget).
    # Optional: ``grad_in_row_tail = True`` when ``grad_out`` may be a 16-bit view of the second half of each float32
    # logits row (``logits.view(bf16)[:, V:]``): the pass must then read each element before writing over it.
    # Optional: ``cpu_16bit_logits = True`` when on CPU the logits may be the 16-bit output of the GEMM itself (CPU
    # torch has no 16-bit GEMM with a float32 output, so a float32 copy would hold the same values), with ``grad_out``
    # then the logits themselves; the backend's scratch must not grow with the chunk there (it is not budgeted).
    # Optional: ``forward_target_apart(logits, target, params, grad_scale, grad_out, x, weight)``, ``forward`` with
    # the gradient's target column returned apart in float32, as a gradient object ``engine._GradBuffers`` takes
    # (``triton_scaled.ScaledGradient``, ``torch_tiles.TargetApartGradient``): a 16-bit dW is then summed across
    # chunks in the gradient itself (``engine._gradient_target_apart``).
    # Optional: ``fused_head``, a path that replaces the logits GEMM and these passes for calls it ``supports``:
    # ``forward`` (``keep_columns=``: e kept for the leading columns only, a multiple of ``COLUMN_ALIGN``),
    # ``gradient`` and ``recompute_gradient`` (``first_column=``: a vocabulary chunk of the head's rows; both take
    # ``target_apart=``: 0 at each row's target column), ``target_gradient`` (that column in float32),
    # ``add_target_rows`` (its ``dW[y_i] += c_i x_i``) and ``bytes_per_logit`` (``triton_gemm``).
    # Optional: ``gemm_min_capability``, the CUDA compute capability (major) below which the engine does not take
    # ``fused_head`` (0: any device it supports).
    # Optional: ``compaction``, a module with ``kept_order`` and ``read_later`` (``triton_gemm``'s), which compacts a
    # CUDA call's kept rows in one launch where ``fused_head`` is not taken (``engine._compaction``).
    # Optional: ``add_target_rows(dw, x, target, coef, ignore_index)``, ``dW[y_i] += c_i x_i`` for every row ``i`` not
    # ignored, with no atomics (deterministic; default: ``index_add_``, whose CUDA kernel sums repeated targets in any
    # order).
    # Optional: ``scale_into(src, scale, out) -> out``, ``out = src * scale`` with a float32 0-d ``scale``, for the
    # final scaling of the gradients (default: ``torch.mul``).

    def forward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        params: TileParams,
        grad_scale: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
    ) -> TileStats:
        """Statistics of each row. With ``grad_scale`` ([rows] float32), also writes
        ``d(sum_i grad_scale_i * loss_i) / d logits`` into ``grad_out`` ([rows, V], may be ``logits`` itself)."""
        ...

    def backward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        lse: torch.Tensor,
        entropy: torch.Tensor,
        params: TileParams,
        grad_loss: torch.Tensor | None,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        grad_out: torch.Tensor,
        first_column: int = 0,
        lse_low: torch.Tensor | None = None,
    ) -> None:
        """Writes the logits gradient for per-row upstream gradients of loss, logprob and entropy
        (each [rows] float32, or None for zero) into ``grad_out`` ([rows, C], may be ``logits`` itself). ``logits``
        may be a vocabulary chunk, ``[rows, C]``: the columns from ``first_column`` on, with ``lse`` and ``entropy``
        the whole row's and ``params.vocab`` the whole vocabulary. ``lse_low``: the forward's (None: 0)."""
        ...
