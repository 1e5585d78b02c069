"""TRL trainers whose loss goes through hf_flce's fused ``lm_head`` + cross-entropy.

``FLCESFTTrainer`` and ``FLCEDPOTrainer`` subclass TRL's ``SFTTrainer`` and ``DPOTrainer`` and take the same
arguments: a TRL script changes only the class name. Supported TRL: ``>=1.16,<1.17``.
"""

from __future__ import annotations

from .compat import check_trl_compat
from .dpo import FLCEDPOTrainer
from .head import FLCECausalLMOutput, add_flce_lm_head
from .sft import FLCESFTTrainer

check_trl_compat()

__all__ = ["FLCEDPOTrainer", "FLCESFTTrainer", "FLCECausalLMOutput", "add_flce_lm_head", "check_trl_compat"]
