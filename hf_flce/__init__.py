"""hf_flce: the ``lm_head`` matmul fused with cross-entropy, so the ``[tokens, V]`` logits never exist in full.

The op is imported eagerly; the patchers and the TRL trainers load on first use, so ``import hf_flce`` stays light.
"""

from __future__ import annotations

import importlib

from .api import FLCEStats, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .reference import reference_linear_cross_entropy

__version__ = "0.1.0"

_LAZY = {
    "apply_flce": "hf_flce.patches",
    "apply_flce_to_llama": "hf_flce.patches",
    "apply_flce_to_qwen": "hf_flce.patches",
    "apply_flce_to_mistral": "hf_flce.patches",
    "apply_flce_to_gemma": "hf_flce.patches",
    "revert_flce": "hf_flce.patches",
    "FLCESFTTrainer": "hf_flce.trainers",
    "FLCEDPOTrainer": "hf_flce.trainers",
    "FLCEKTOTrainer": "hf_flce.trainers",
    "FLCEGRPOTrainer": "hf_flce.trainers",
    "FLCERLOOTrainer": "hf_flce.trainers",
}

__all__ = [
    "FLCEStats",
    "FusedLinearCrossEntropyLoss",
    "fused_linear_cross_entropy",
    "reference_linear_cross_entropy",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_flce' has no attribute {name!r}")
