"""Ascend NPU backend: Triton kernels for triton-ascend, tiled to the unified buffer of one vector core.

The forward kernel writes the loss and statistics of each row; the backward kernel writes the logits gradient for
the real upstream gradients (per row, so ``reduction="none"`` and the stats' gradients are exact). When the engine
wants the gradient during forward (scalar loss), forward runs the backward kernel right after, with the upstream
gradient of the loss set to ``grad_scale``; ``forward_target_apart`` has that kernel write the target column to a
float32 row vector instead, so that a 16-bit dW can be summed across chunks in the gradient itself.

Importing this package needs triton only; torch_npu is imported lazily, when an NPU tensor is seen. Without an NPU
the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check them).
"""

from __future__ import annotations

import functools

import torch

from ..base import TileParams, TileStats, check_columns
from ..torch_tiles import TargetApartForward
from .tiling import plan_launch

try:
    from . import kernels
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError("backend='ascend' needs Triton (triton-ascend on an NPU: pip install 'hf-flce[npu]')") from err

GIB = 1 << 30
# Device memory assumed when it cannot be read (910B: 64 GB of HBM).
DEFAULT_DEVICE_MEMORY = 64 * GIB


def _lean(params: TileParams) -> bool:
    """No per-element extras: temperature and z-loss only cost scalar work, so they keep the fast path."""
    return params.softcap is None and params.class_weight is None and params.label_smoothing == 0.0


def _row_vector(v: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    # grad_scale arrives as an expanded (stride 0) view: the kernels index rows contiguously.
    return None if v is None else v.to(torch.float32).expand(rows).contiguous()


@functools.cache
def _device_memory(device: torch.device) -> int:
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401

            return int(torch.npu.get_device_properties(device).total_memory)
        except Exception:
            pass
    return DEFAULT_DEVICE_MEMORY


class AscendTileOps(TargetApartForward):
    name = "ascend"
    # The kernels stream the logits block by block: nothing of size [rows, V] besides the logits (and grad_out).
    scratch_bytes_per_logit = 0

    def keep_logits_limit(self, device: torch.device) -> int:
        """Bytes of logits kept from forward to backward: ``min(4 GiB, device memory / 8)``, at least 1 GiB."""
        return max(GIB, min(4 * GIB, _device_memory(device) // 8))

    @staticmethod
    def _common(params: TileParams, dummy: torch.Tensor) -> dict:
        weight = params.class_weight
        return dict(
            weight_ptr=dummy if weight is None else weight,
            weight_sum_ptr=dummy if weight is None else params.class_weight_sum.reshape(1),
            vocab=params.vocab,
            ignore_index=params.ignore_index,
            eps=float(params.label_smoothing),
            z_loss=float(params.z_loss),
            softcap=1.0 if params.softcap is None else float(params.softcap),
            inv_temp=float(params.inv_temperature),
            SOFTCAP=params.softcap is not None,
            HAS_WEIGHT=weight is not None,
            SMOOTH=params.label_smoothing != 0.0,
        )

    def forward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        params: TileParams,
        grad_scale: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
        target_coef: torch.Tensor | None = None,
    ) -> TileStats:
        """``TileOps.forward``; with ``target_coef`` ([rows] float32) the gradient's target column goes there and is
        0 in ``grad_out`` (``forward_target_apart``)."""
        rows, vocab = logits.shape
        target = target.contiguous()
        stats = torch.empty((kernels.N_STATS, rows), dtype=torch.float32, device=logits.device)
        if rows:
            launch = plan_launch("forward", _lean(params), rows, vocab, logits.device)
            kernels.forward_kernel[(launch.programs,)](
                logits_ptr=logits,
                logits_stride=logits.stride(0),
                target_ptr=target,
                stats_ptr=stats,
                stats_stride=stats.stride(0),
                extra_rows=launch.extra_rows,
                rows_per_program=launch.rows_per_program,
                BLOCK=launch.block,
                **self._common(params, logits),
            )
        result = TileStats(
            loss=stats[kernels.STAT_LOSS.value],
            lse=stats[kernels.STAT_LSE.value],
            logprob=stats[kernels.STAT_LOGPROB.value],
            entropy=stats[kernels.STAT_ENTROPY.value],
            is_top1=stats[kernels.STAT_TOP1.value] != 0,
            mean_logit=stats[kernels.STAT_MEAN.value],
            log_sum_sq_probs=stats[kernels.STAT_LSSP.value],
            lse_low=stats[kernels.STAT_LSE_LOW.value],
        )
        if grad_scale is not None:
            lse, entropy = result.lse, result.entropy
            self.backward(
                logits,
                target,
                lse,
                entropy,
                params,
                grad_scale,
                None,
                None,
                grad_out,
                target_coef=target_coef,
                lse_low=result.lse_low,
            )
        return result

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
        target_coef: torch.Tensor | None = None,
        lse_low: torch.Tensor | None = None,
    ) -> None:
        rows, n_cols = logits.shape
        check_columns(first_column, n_cols, params.vocab)
        if rows == 0:
            return
        grads = [_row_vector(g, rows) for g in (grad_loss, grad_logprob, grad_entropy)]
        launch = plan_launch("backward", _lean(params), rows, n_cols, logits.device)
        kernels.backward_kernel[(launch.programs,)](
            logits_ptr=logits,
            logits_stride=logits.stride(0),
            grad_ptr=grad_out,
            grad_stride=grad_out.stride(0),
            target_ptr=target.contiguous(),
            lse_ptr=lse.contiguous(),
            lse_low_ptr=torch.zeros_like(lse) if lse_low is None else lse_low.contiguous(),
            entropy_ptr=entropy.contiguous(),
            grad_loss_ptr=logits if grads[0] is None else grads[0],
            grad_logprob_ptr=logits if grads[1] is None else grads[1],
            grad_entropy_ptr=logits if grads[2] is None else grads[2],
            target_coef_ptr=logits if target_coef is None else target_coef,
            extra_rows=launch.extra_rows,
            rows_per_program=launch.rows_per_program,
            n_cols=n_cols,
            col_offset=first_column,
            HAS_GRAD_LOSS=grads[0] is not None,
            HAS_GRAD_LOGPROB=grads[1] is not None,
            HAS_GRAD_ENTROPY=grads[2] is not None,
            TARGET_COEF=target_coef is not None,
            BLOCK=launch.block,
            **self._common(params, logits),
        )


__all__ = ["AscendTileOps"]
