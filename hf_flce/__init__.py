"""hf_flce: the ``lm_head`` matmul fused with cross-entropy, so the ``[tokens, V]`` logits never exist in full."""

from .api import FLCEStats, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .reference import reference_linear_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "FLCEStats",
    "FusedLinearCrossEntropyLoss",
    "fused_linear_cross_entropy",
    "reference_linear_cross_entropy",
]
