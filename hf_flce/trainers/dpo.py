"""``FLCEDPOTrainer``: TRL's ``DPOTrainer`` with the policy's and the reference's log-probabilities computed by
hf_flce's fused kernels."""

from __future__ import annotations

import trl.trainer.dpo_trainer as trl_dpo
from trl import DPOTrainer

from ._common import FLCETrainerMixin


class FLCEDPOTrainer(FLCETrainerMixin, DPOTrainer):
    """Drop-in replacement for :class:`trl.DPOTrainer`: same arguments, loss types and logged metrics, with the
    per-token log-probabilities, entropy, mean logits, top-1 flags and WPO weights of the policy and of the
    reference model computed by :func:`hf_flce.fused_linear_cross_entropy`.

    The preference losses need per-token gradients, so the policy takes the op's per-token path, which keeps the
    logits for backward when they fit the memory budget and recomputes them otherwise. The reference model runs
    under ``torch.no_grad``, where the op computes no gradients at all. The reference may be ``ref_model``, the
    PEFT base model with the adapter disabled, or precomputed (``precompute_ref_log_probs``), exactly as in TRL.

    Extra keyword-only options: ``flce_backend`` and ``flce_memory_budget``, as in :class:`FLCESFTTrainer`
    (``flce_defer_head_grad`` is refused: the DPO loss reads per-token log-probs, whose backward recomputes the
    logits).

    Example (trains one step of a tiny model on a CPU)::

        from trl import DPOConfig
        from hf_flce import FLCEDPOTrainer
        from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
        tokenizer = build_tokenizer()
        trainer = FLCEDPOTrainer(
            model=build_tiny_model(tokenizer),
            ref_model=build_tiny_model(tokenizer),
            args=DPOConfig(output_dir="outputs/tiny-dpo", max_steps=1, bf16=False, report_to="none"),
            train_dataset=load_toy_dataset("preference"),
            processing_class=tokenizer,
        )
        trainer.train()
    """

    _trl_module = trl_dpo
    _scalar_head_loss = False
    _tag_names = [*DPOTrainer._tag_names, "hf-flce"]
