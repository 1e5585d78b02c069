"""The TRL internals hf_flce's trainers rely on, checked at import so that a TRL change fails loudly.

Relied on (TRL 1.16):

* ``add_fused_lm_head`` in ``trl.trainer.{sft,dpo,kto,grpo,rloo}_trainer``: the module-level name each trainer's
  constructor calls as ``add_fused_lm_head(model, temperature=..., cast_lm_head_to_fp32=..., outputs=...)`` to patch
  the policy (and the reference model); hf_flce's head stands in for it while the constructor runs. The DPO, KTO,
  GRPO and RLOO trainers then call the model with ``fused_lm_head=True`` and read its per-token fields.
* ``trl.trainer.utils.FusedCausalLMOutput`` (its fields).
* ``SFTTrainer.compute_loss(model, inputs, return_outputs, num_items_in_batch)`` and the instance attributes it
  uses: ``_metrics``, ``_total_train_tokens``, ``_tp_size``, ``aux_loss_enabled``, ``router_aux_loss_coef``,
  ``compute_loss_func``; ``SFTConfig.loss_type``, ``label_smoothing_factor`` and ``average_tokens_across_devices``.
* ``DPOTrainer._compute_loss`` reading ``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``,
  ``log_sum_sq_probs`` and ``aux_loss`` from ``model(..., labels=..., fused_lm_head=True)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

SUPPORTED_TRL = (">=1.16", "<1.17")
# trainer modules whose fused head hf_flce replaces; all but SFT's read the head's per-token fields in their loss
TRAINER_MODULES = ("sft_trainer", "dpo_trainer", "kto_trainer", "grpo_trainer", "rloo_trainer")
FUSED_OUTPUT_FIELDS = {
    "loss",
    "log_probs",
    "entropy",
    "log_sum_sq_probs",
    "mean_logits",
    "is_top1",
    "label_mask",
    "aux_loss",
}
SFT_INSTANCE_ATTRIBUTES = (
    "_metrics",
    "_total_train_tokens",
    "_tp_size",
    "aux_loss_enabled",
    "router_aux_loss_coef",
    "compute_loss_func",
)


def trl_problems() -> list[str]:
    """Every way the installed TRL differs from what the trainers rely on (empty when it is fine)."""
    import importlib

    import trl
    import trl.trainer.sft_trainer as trl_sft
    import trl.trainer.utils as trl_utils
    from packaging.specifiers import SpecifierSet
    from transformers import Trainer

    problems = []
    if trl.__version__ not in SpecifierSet(",".join(SUPPORTED_TRL)):
        problems.append(f"trl {trl.__version__} is outside the supported range {','.join(SUPPORTED_TRL)}")
    for name in TRAINER_MODULES:
        module = importlib.import_module(f"trl.trainer.{name}")
        head = getattr(module, "add_fused_lm_head", None)
        if head is None:
            problems.append(f"{module.__name__}.add_fused_lm_head is gone")
        elif list(inspect.signature(head).parameters)[:4] != [
            "model",
            "temperature",
            "cast_lm_head_to_fp32",
            "outputs",
        ]:
            problems.append(f"{module.__name__}.add_fused_lm_head changed signature: {inspect.signature(head)}")
        source = inspect.getsource(module)
        if "add_fused_lm_head(" not in source:
            problems.append(f"{module.__name__} no longer calls add_fused_lm_head")
        if module is not trl_sft and "fused_lm_head=True" not in source:
            problems.append(f"{module.__name__} no longer calls the model with fused_lm_head=True")
    output_cls = getattr(trl_utils, "FusedCausalLMOutput", None)
    if output_cls is None:
        problems.append("trl.trainer.utils.FusedCausalLMOutput is gone")
    elif {f.name for f in dataclasses.fields(output_cls)} != FUSED_OUTPUT_FIELDS:
        problems.append(f"FusedCausalLMOutput fields changed: {[f.name for f in dataclasses.fields(output_cls)]}")
    compute_loss = list(inspect.signature(trl_sft.SFTTrainer.compute_loss).parameters)
    if compute_loss != ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]:
        problems.append(f"SFTTrainer.compute_loss changed signature: {compute_loss}")
    sft_source = inspect.getsource(trl_sft.SFTTrainer.__init__)
    for name in SFT_INSTANCE_ATTRIBUTES:
        if name != "compute_loss_func" and f"self.{name} =" not in sft_source:
            problems.append(f"SFTTrainer no longer sets self.{name}")
    fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    for name in ("loss_type", "label_smoothing_factor", "average_tokens_across_devices"):
        if name not in fields:
            problems.append(f"SFTConfig.{name} is gone")
    if not callable(getattr(Trainer, "get_tp_size", None)):
        problems.append("transformers.Trainer.get_tp_size is gone")
    return problems


def check_trl_compat() -> None:
    """Raise ``ImportError`` when a TRL internal the trainers rely on is missing or changed; warn when only the
    version is outside the supported range."""
    problems = trl_problems()
    structural = [p for p in problems if "outside the supported range" not in p]
    if structural:
        raise ImportError("hf_flce's trainers do not support the installed TRL: " + "; ".join(structural))
    for problem in problems:
        warnings.warn(f"hf_flce: {problem}", stacklevel=2)
