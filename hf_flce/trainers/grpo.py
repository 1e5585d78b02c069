"""``FLCEGRPOTrainer`` and ``FLCERLOOTrainer``: TRL's online RL trainers with the policy's and the reference's
per-token log-probabilities and entropies computed by hf_flce's fused kernels."""

from __future__ import annotations

import trl.trainer.grpo_trainer as trl_grpo
import trl.trainer.rloo_trainer as trl_rloo
from trl import GRPOTrainer, RLOOTrainer

from ._common import FLCETrainerMixin


class FLCEGRPOTrainer(FLCETrainerMixin, GRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer`: same arguments, loss types and logged metrics, with the
    completions' per-token log-probabilities and entropies (policy, old policy and reference) computed by
    :func:`hf_flce.fused_linear_cross_entropy` at the trainer's sampling ``temperature``.

    Generation is untouched (``transformers`` or vLLM). The policy loss reads per-token log-probs, and with
    ``entropy_coef`` the entropies too, so the policy takes the op's per-token path: it keeps the logits for backward
    when they fit the memory budget and recomputes them otherwise, with the entropy's own gradient where the loss has
    one. The reference model, and the old policy's log-probs when ``num_iterations > 1``, run under
    ``torch.no_grad``, where the op computes no gradients at all.

    Extra keyword-only options: ``flce_backend`` and ``flce_memory_budget``, as in :class:`FLCESFTTrainer`
    (``flce_defer_head_grad`` is refused: the loss reads per-token log-probs).

    Example (trains one step of a tiny model on a CPU)::

        from trl import GRPOConfig
        from hf_flce import FLCEGRPOTrainer
        from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
        tokenizer = build_tokenizer()
        prompts = load_toy_dataset("sft_prompt_completion").remove_columns("completion")
        trainer = FLCEGRPOTrainer(
            model=build_tiny_model(tokenizer),
            reward_funcs=lambda completions, **kwargs: [float(len(str(c))) for c in completions],
            args=GRPOConfig(output_dir="outputs/tiny-grpo", max_steps=1, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, bf16=False, report_to="none"),
            train_dataset=prompts,
            processing_class=tokenizer,
        )
        trainer.train()
    """

    _trl_module = trl_grpo
    _scalar_head_loss = False
    _tag_names = [*GRPOTrainer._tag_names, "hf-flce"]


class FLCERLOOTrainer(FLCETrainerMixin, RLOOTrainer):
    """Drop-in replacement for :class:`trl.RLOOTrainer`, as :class:`FLCEGRPOTrainer` is for ``GRPOTrainer``: the
    policy's and the reference's per-token log-probabilities and entropies come from
    :func:`hf_flce.fused_linear_cross_entropy`; everything else is TRL's.

    Extra keyword-only options: ``flce_backend`` and ``flce_memory_budget`` (``flce_defer_head_grad`` is refused).

    Example (one step of a tiny model saved to a folder, on a CPU; TRL loads the KL term's reference model from the
    same folder)::

        from trl import RLOOConfig
        from hf_flce import FLCERLOOTrainer
        from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
        tokenizer = build_tokenizer()
        build_tiny_model(tokenizer).save_pretrained("outputs/tiny-model")
        tokenizer.save_pretrained("outputs/tiny-model")
        config = RLOOConfig(output_dir="outputs/tiny-rloo", max_steps=1, per_device_train_batch_size=2,
                            num_generations=2, max_completion_length=8, beta=0.05, bf16=False, report_to="none")
        trainer = FLCERLOOTrainer(
            model="outputs/tiny-model",
            reward_funcs=lambda completions, **kwargs: [float(len(str(c))) for c in completions],
            args=config,
            train_dataset=load_toy_dataset("sft_prompt_completion").remove_columns("completion"),
        )
        trainer.train()
    """

    _trl_module = trl_rloo
    _scalar_head_loss = False
    _tag_names = [*RLOOTrainer._tag_names, "hf-flce"]
