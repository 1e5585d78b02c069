"""The fused causal-LM forward shared by every patched class, and its MoE variant.

In transformers 5.x the dense ``*ForCausalLM.forward`` bodies are identical across the supported classes, and so are
the MoE ones; these two functions reproduce them with the ``lm_head`` matmul and the loss replaced by
:func:`hf_flce.fused_linear_cross_entropy`. Whenever logits are needed (no labels, evaluation, an adapter on
``lm_head``) they call the class's stock forward instead, so those paths are stock by construction.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..api import fused_linear_cross_entropy
from ..options import BACKENDS, FLCEOptions

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # older 5.x: the slicing was inline in each forward

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


STATE_ATTR = "_hf_flce_state"
_warned: set[str] = set()


@dataclass(frozen=True)
class PatchOptions:
    """Options of a patch, forwarded to :func:`hf_flce.fused_linear_cross_entropy`.

    ``skip_logits``: ``None`` fuses in training mode only (evaluation gets stock logits and loss), ``True`` always
    fuses when there are labels, ``False`` never does.
    """

    backend: str = "auto"
    memory_budget: int | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    skip_logits: bool | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.skip_logits not in (None, True, False):
            raise TypeError(f"skip_logits must be None or a bool, got {self.skip_logits!r}")
        FLCEOptions(label_smoothing=self.label_smoothing, z_loss=self.z_loss, memory_budget=self.memory_budget)


@dataclass(frozen=True)
class PatchState:
    """What a patched forward reads from its module: the options (``None`` once reverted) and the stock fallbacks."""

    options: PatchOptions | None
    stock_forward: Callable
    aux_loss: Callable | None = None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def head_parameters(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` of the linear map ``head`` applies, or ``None`` when it is not a plain linear map.

    PEFT's ``modules_to_save`` wrapper resolves to its active copy; a LoRA (or any other) adapter on the head, a
    quantized linear, or a weight that is not materialised here (offloaded, ZeRO-3 shard) gives ``None``.
    """
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        weight = head.weight
        if weight.is_meta or weight.numel() == 0:
            return None
        return weight, head.bias
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:
        return None
    if isinstance(head, ModulesToSaveWrapper):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            return head_parameters(head.original_module)
        return head_parameters(head.modules_to_save[active[0]])
    return None


def _fused_head(model: nn.Module, labels: torch.Tensor | None, skip_logits: bool | None):
    """``(options, weight, bias)`` when this call takes the fused path, else ``None``."""
    options = getattr(model, STATE_ATTR).options
    if options is None or labels is None:
        return None
    if skip_logits is None:
        skip_logits = options.skip_logits
    if not (model.training if skip_logits is None else skip_logits):
        return None
    params = head_parameters(model.lm_head)
    if params is None:
        kind = type(model.lm_head)
        name = kind.__name__
        _warn_once(
            f"{kind.__module__}.{name}",
            f"hf_flce: cannot fuse lm_head ({name}: an adapter on lm_head, a quantized layer or a weight not "
            "materialised here); using the stock forward, which materialises the logits.",
        )
        return None
    return options, *params


def _fused_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, head, kwargs: dict) -> torch.Tensor:
    """The stock causal-LM loss (``ForCausalLMLoss``) of ``lm_head(hidden)``, computed by the fused op."""
    options, weight, bias = head
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(weight.device)
    target = shift_labels.reshape(-1).to(weight.device)
    if target.numel() != hidden.shape[0]:
        raise ValueError(
            f"labels give {target.numel()} targets for {hidden.shape[0]} positions (after logits_to_keep); "
            "they must match as in the stock loss"
        )
    return fused_linear_cross_entropy(
        hidden,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        label_smoothing=options.label_smoothing,
        z_loss=options.z_loss,
        softcap=getattr(model.config, "final_logit_softcapping", None),
        backend=options.backend,
        memory_budget=options.memory_budget,
    )


def _forward(
    self,
    input_ids,
    attention_mask,
    position_ids,
    past_key_values,
    inputs_embeds,
    labels,
    use_cache,
    logits_to_keep,
    **kwargs,
):
    """The body of both forwards; an MoE call carries ``output_router_logits`` in ``kwargs``."""
    state: PatchState = getattr(self, STATE_ATTR)
    head = _fused_head(self, labels, kwargs.pop("skip_logits", None))
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
    )
    if head is None:
        return state.stock_forward(self, **inputs, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    outputs = self.model(**inputs, **kwargs)
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    loss = _fused_loss(self, hidden, labels, head, kwargs)
    fields = dict(
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if state.aux_loss is None:
        return CausalLMOutputWithPast(loss=loss, **fields)
    aux_loss = None
    if kwargs["output_router_logits"]:
        aux_loss = state.aux_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, router_logits=outputs.router_logits, **fields)


@can_return_tuple
def causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.FloatTensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
) -> CausalLMOutputWithPast:
    """Stock dense ``*ForCausalLM.forward``, except that a training call with labels returns the fused loss and no
    logits. ``skip_logits=True/False`` (keyword) forces the fused or the stock path for one call."""
    return _forward(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache, logits_to_keep,
        **kwargs,
    )  # fmt: skip


@can_return_tuple
def moe_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.FloatTensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
) -> MoeCausalLMOutputWithPast:
    """MoE variant of :func:`causal_lm_forward`: adds ``router_aux_loss_coef * aux_loss`` as stock does (not divided
    by ``num_items_in_batch``) and returns ``aux_loss`` and ``router_logits``."""
    if output_router_logits is None:
        output_router_logits = self.config.output_router_logits
    return _forward(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache, logits_to_keep,
        output_router_logits=output_router_logits, **kwargs,
    )  # fmt: skip


FUSED_FORWARDS = (causal_lm_forward, moe_causal_lm_forward)
