"""TRL trainers whose loss goes through hf_flce's fused ``lm_head`` + cross-entropy.

``FLCESFTTrainer``, ``FLCEDPOTrainer``, ``FLCEKTOTrainer``, ``FLCEGRPOTrainer`` and ``FLCERLOOTrainer`` subclass
TRL's trainers of the same names and take the same arguments: a TRL script changes only the class name. Each runs
TRL's constructor with hf_flce's head (:func:`add_flce_lm_head`) in place of TRL's fused head. Supported TRL:
``>=1.16,<1.17``.
"""

from __future__ import annotations

from .compat import check_trl_compat
from .dpo import FLCEDPOTrainer
from .grpo import FLCEGRPOTrainer, FLCERLOOTrainer
from .head import FLCECausalLMOutput, add_flce_lm_head
from .kto import FLCEKTOTrainer
from .sft import FLCESFTTrainer

check_trl_compat()

__all__ = [
    "FLCEDPOTrainer",
    "FLCEGRPOTrainer",
    "FLCEKTOTrainer",
    "FLCERLOOTrainer",
    "FLCESFTTrainer",
    "FLCECausalLMOutput",
    "add_flce_lm_head",
    "check_trl_compat",
]
