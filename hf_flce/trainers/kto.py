"""``FLCEKTOTrainer``: TRL's ``KTOTrainer`` with the policy's and the reference's log-probabilities computed by
hf_flce's fused kernels."""

from __future__ import annotations

import trl.trainer.kto_trainer as trl_kto
from trl import KTOTrainer

from ._common import FLCETrainerMixin


class FLCEKTOTrainer(FLCETrainerMixin, KTOTrainer):
    """Drop-in replacement for :class:`trl.KTOTrainer`: same arguments, loss types and logged metrics, with the
    per-token log-probabilities, entropy and mean logits of the policy (completions and the mismatched KL
    completions) and of the reference model computed by :func:`hf_flce.fused_linear_cross_entropy`.

    As in :class:`FLCEDPOTrainer`, the policy takes the op's per-token path and the reference runs under
    ``torch.no_grad``. Extra keyword-only options: ``flce_backend`` and ``flce_memory_budget``
    (``flce_defer_head_grad`` is refused).

    Example (trains one step of a tiny model on a CPU)::

        from trl import KTOConfig
        from trl.data_utils import unpair_preference_dataset
        from hf_flce import FLCEKTOTrainer
        from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
        tokenizer = build_tokenizer()
        trainer = FLCEKTOTrainer(
            model=build_tiny_model(tokenizer),
            ref_model=build_tiny_model(tokenizer),
            args=KTOConfig(output_dir="outputs/tiny-kto", max_steps=1, per_device_train_batch_size=4, bf16=False,
                           report_to="none"),
            train_dataset=unpair_preference_dataset(load_toy_dataset("preference")),
            processing_class=tokenizer,
        )
        trainer.train()
    """

    _trl_module = trl_kto
    _scalar_head_loss = False
    _tag_names = [*KTOTrainer._tag_names, "hf-flce"]
