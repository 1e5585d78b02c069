"""``FLCESFTTrainer``: TRL's ``SFTTrainer`` with its loss computed by hf_flce's fused kernels."""

from __future__ import annotations

import warnings

import accelerate
import torch
import trl.trainer.sft_trainer as trl_sft
from packaging.version import Version
from trl import SFTTrainer

from ._common import FLCETrainerMixin


class FLCESFTTrainer(FLCETrainerMixin, SFTTrainer):
    """Drop-in replacement for :class:`trl.SFTTrainer`: same arguments, features and logged metrics, with the
    ``lm_head`` and the loss fused by :func:`hf_flce.fused_linear_cross_entropy`.

    The ``nll`` loss (label-smoothed when ``label_smoothing_factor`` > 0) and ``dft`` (each token weighted by its
    detached probability) take the op's three-GEMM path: their gradient is known up to the upstream scalar and a
    per-row factor the kernel computes, so it is formed during forward and the logits are never recomputed. The
    metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``, ``aux_loss``) come from the op's detached stats.
    Evaluation without ``compute_metrics`` never builds the logits.

    Extra keyword-only options: ``flce_backend`` (``"auto"``, ``"torch"``, ``"triton"``, ``"ascend"``),
    ``flce_memory_budget`` (bytes of logits alive at once; default: half the op's, as in every patched model) and
    ``flce_defer_head_grad`` (``lm_head``'s weight gradient at the end of the backward, as
    ``apply_flce(..., defer_head_grad=True)``: a lower peak for one more logits GEMM; one GPU, DDP, or FSDP2 with
    ``lm_head`` in the root unit).

    Example (trains one step of a tiny model on a CPU)::

        from trl import SFTConfig
        from hf_flce import FLCESFTTrainer
        from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
        tokenizer = build_tokenizer()
        trainer = FLCESFTTrainer(
            model=build_tiny_model(tokenizer),
            args=SFTConfig(output_dir="outputs/tiny-sft", max_steps=1, bf16=False, report_to="none"),
            train_dataset=load_toy_dataset("sft_chat"),
            processing_class=tokenizer,
        )
        trainer.train()
    """

    _trl_module = trl_sft
    _scalar_head_loss = True
    _tag_names = [*SFTTrainer._tag_names, "hf-flce"]

    def _flce_owns_loss(self) -> bool:
        """Whether the loss goes through the fused scalar path; otherwise TRL's ``compute_loss`` runs (on hf_flce's
        head) for what needs the model's own outputs: ``compute_loss_func`` and DeepSpeed sequence parallelism."""
        if self.compute_loss_func is not None:
            return False
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        deepspeed_sp = (
            Version(accelerate.__version__) >= Version("1.12.0")
            and parallelism is not None
            and parallelism.sp_backend == "deepspeed"
            and parallelism.sp_enabled
        )
        return not (deepspeed_sp and self.model.training)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._flce_owns_loss():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        smoothing = self.args.label_smoothing_factor if self.args.loss_type == "nll" else 0.0
        outputs = model(
            **inputs,
            fused_lm_head=True,
            fused_loss_type=self.args.loss_type,
            fused_label_smoothing=smoothing,
            num_items_in_batch=num_items_in_batch,
        )
        loss = outputs.token_loss
        # As `Trainer.compute_loss`: `num_items_in_batch` counts every rank's tokens and DDP averages the gradients.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        # TRL 1.16 leaves the MoE term out of the label-smoothed loss (its smoother sees logits only); kept identical.
        if self.aux_loss_enabled and not smoothing:
            # A per-micro-batch mean: with `num_items_in_batch` the loss itself averages over accumulation steps.
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        self._record_metrics(mode, inputs, outputs)

        if not return_outputs:
            return loss
        warnings.warn(
            "`return_outputs=True` (for `compute_metrics` or `preprocess_logits_for_metrics`) runs an extra forward "
            "pass that builds the full logits, which the fused head avoids.",
            FutureWarning,
            stacklevel=2,
        )
        with torch.no_grad():
            logits_outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        return loss, logits_outputs

    def _record_metrics(self, mode: str, inputs: dict, outputs) -> None:
        """The metrics TRL's SFTTrainer logs, from the fused head's per-token fields (zero at ignored positions)."""
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        count = gather(outputs.label_mask.sum()).sum()
        entropy = gather(outputs.entropy.detach().sum()).sum()
        correct = gather(outputs.is_top1.sum()).sum()
        metrics["entropy"].append((entropy / count).item() if count > 0 else 0.0)
        metrics["mean_token_accuracy"].append((correct / count).item() if count > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            elif "position_ids" in inputs:  # padding-free: one packed row, no attention mask
                ids = inputs["position_ids"]
                local = torch.tensor(ids.size(1), device=ids.device)
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            self._total_train_tokens += gather(local).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            metrics["aux_loss"].append(gather(outputs.aux_loss).mean().item())
