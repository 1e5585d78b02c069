"""The fused causal-LM forward shared by every patched class, its MoE variant and its vision-language variant.

In transformers 5.x the dense ``*ForCausalLM.forward`` bodies are identical across the supported classes, and so are
the MoE ones; these functions reproduce them with the ``lm_head`` matmul and the loss replaced by
:func:`hf_flce.fused_linear_cross_entropy`. A vision-language ``*ForConditionalGeneration`` has the dense body with
its own inputs (pixel values, token types) passed to its ``model`` and its own output class: its fused forward is
made from its stock one (:func:`forward_from_stock`), as are those of the GPT-2 line (GPT-2, GPT-NeoX, OPT, BLOOM,
...), whose inputs and decoder attribute are their own (``registry.decoder_of``). Whenever logits are needed (no labels, evaluation, an adapter on
``lm_head``) they call the class's stock forward instead, so those paths are stock by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..distributed import head_linear_cross_entropy, linear_of
from ..options import BACKENDS, FLCEOptions, in_model_budget
from .late_head_grad import LateHeadGrad
from .registry import decoder_of

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

    ``defer_head_grad``: ``lm_head``'s weight gradient is computed at the end of the backward instead of with the
    loss (:class:`LateHeadGrad`).
    """

    backend: str = "auto"
    memory_budget: int | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    skip_logits: bool | None = None
    defer_head_grad: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.skip_logits not in (None, True, False):
            raise TypeError(f"skip_logits must be None or a bool, got {self.skip_logits!r}")
        if not isinstance(self.defer_head_grad, bool):
            raise TypeError(f"defer_head_grad must be a bool, got {self.defer_head_grad!r}")
        FLCEOptions(label_smoothing=self.label_smoothing, z_loss=self.z_loss, memory_budget=self.memory_budget)


# The config attributes of a logit transform, the ones TRL's fused head reads
LOGIT_ATTRIBUTES = frozenset(
    ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling", "final_logit_softcapping")
)


@dataclass(frozen=True)
class PatchState:
    """What a patched forward reads from its module: the options (``None`` once reverted) and the stock fallbacks."""

    options: PatchOptions | None
    stock_forward: Callable
    aux_loss: Callable | None = None
    # a vision-language class: its stock output class (the fused forward returns one, with the body's extra fields)
    output_class: type | None = None
    # the config attributes of a logit transform that the stock forward applies (``stock_logit_attributes``)
    logit_attributes: frozenset[str] = LOGIT_ATTRIBUTES
    # an instance reverted under a class patch: that patch's state, which a later class patch or revert replaces
    opted_out_of: PatchState | None = None


def patch_state(module: nn.Module) -> PatchState:
    """The patch state a fused forward reads: the instance's own (instance patch, or reverted under the class patch
    still in place), else its class's."""
    state = getattr(module, STATE_ATTR)
    if state.opted_out_of is not None:
        class_state = getattr(type(module), STATE_ATTR, None)
        if class_state is not None and class_state is not state.opted_out_of:
            return class_state
    return state


def stock_logit_attributes(stock: Callable) -> frozenset[str]:
    """Which of :data:`LOGIT_ATTRIBUTES` the stock forward ``stock`` reads, from its source: a class applies only its
    own transform (Gemma 2 its softcap, Granite its scaling, Command R its scale), whatever else its config holds.
    Without the source, every one the config sets."""
    try:
        source = inspect.getsource(stock)
    except (OSError, TypeError):
        return LOGIT_ATTRIBUTES
    return frozenset(name for name in LOGIT_ATTRIBUTES if name in source)


def logit_transform(text_config, attributes: frozenset[str] = LOGIT_ATTRIBUTES) -> tuple[float, float | None]:
    """``(scale, softcap)`` of the config's logit transform ``softcap * tanh(scale * z / softcap)``, read from
    ``attributes`` (by default every one TRL's fused head reads: ``logit_scale``, ``output_multiplier``,
    ``lm_head_multiplier``, ``logits_scaling``, ``final_logit_softcapping``)."""

    def read(name: str):
        return getattr(text_config, name, None) if name in attributes else None

    scale = read("logit_scale")
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = read(name)
    scaling = read("logits_scaling")
    if scale is None and scaling is not None:
        # Granite and MiniCPM3 divide by `logits_scaling`; HyperCLOVA X multiplies by it.
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return (1.0 if scale is None else float(scale)), read("final_logit_softcapping")


def op_transform(
    text_config, temperature: float, attributes: frozenset[str] = LOGIT_ATTRIBUTES
) -> tuple[float, float | None]:
    """The op's ``(temperature, softcap)`` equal to scaling by ``scale``, capping, then dividing by ``temperature``:
    ``c tanh(s z / c) / T = c' tanh(z / c') / T'`` with ``c' = c / s`` and ``T' = T / s`` for ``s > 0``."""
    scale, softcap = logit_transform(text_config, attributes)
    if scale <= 0:
        raise NotImplementedError(f"hf_flce's fused head needs a positive logit scale, the config gives {scale}")
    return temperature / scale, (None if softcap is None else softcap / scale)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _fusable(linear: nn.Linear | None) -> bool:
    """Whether the fused loss can stand in for the head whose linear map is ``linear`` (see
    :func:`hf_flce.distributed.linear_of`): one whose weight is real or made real by the engine's hooks around the
    head's call (FSDP1, FSDP2, ZeRO-3, accelerate's offload hooks). A meta weight with no hook to load it is not."""
    if linear is None:
        return False
    return not (linear.weight.is_meta and getattr(linear, "_hf_hook", None) is None)


# The modules whose forward hooks on ``lm_head`` take no logits: the sharding engines', which gather and free the
# weight around the head's call (the fused loss runs as that call, ``head_linear_cross_entropy``)
_ENGINE_HOOK_MODULES = ("torch.distributed.fsdp", "deepspeed")


def _logit_hooks(head: nn.Module, linear: nn.Linear) -> list[str]:
    """The forward hooks on ``head`` (or ``linear``, the linear map inside it) that would receive its logits, by
    name: the fused path has none to give them."""
    hooks = []
    for module in {id(m): m for m in (head, linear) if m is not None}.values():
        for hook in module._forward_hooks.values():
            function = getattr(hook, "__func__", getattr(hook, "func", hook))
            if not getattr(function, "__module__", "").startswith(_ENGINE_HOOK_MODULES):
                hooks.append(getattr(function, "__qualname__", type(hook).__name__))
    return hooks


def _fused_head(
    model: nn.Module, state: PatchState, labels: torch.Tensor | None, skip_logits: bool | None
) -> PatchOptions | None:
    """The patch options when this call takes the fused path, else ``None``."""
    options = state.options
    if options is None or labels is None:
        return None
    if skip_logits is None:
        skip_logits = options.skip_logits
    if not (model.training if skip_logits is None else skip_logits):
        return None
    head = model.get_output_embeddings()
    linear = linear_of(head)
    if not _fusable(linear):
        kind = type(head)
        name = kind.__name__
        _warn_once(
            f"{kind.__module__}.{name}",
            f"hf_flce: cannot fuse lm_head ({name}: an adapter on lm_head, a quantized layer or a weight not "
            "materialised here); using the stock forward, which materialises the logits.",
        )
        return None
    loss_function = model.loss_function
    if loss_function is not ForCausalLMLoss:
        _warn_once(
            f"loss_function {getattr(loss_function, '__qualname__', loss_function)!r}",
            f"hf_flce: {type(model).__name__}.loss_function is {loss_function!r}, not transformers' causal-LM loss; "
            "using the stock forward, which materialises the logits for it.",
        )
        return None
    hooks = _logit_hooks(head, linear)
    if hooks:
        _warn_once(
            f"lm_head hooks {hooks}",
            f"hf_flce: lm_head has forward hooks that take its logits ({', '.join(hooks)}); using the stock forward, "
            "which materialises them.",
        )
        return None
    return options


def _fused_loss(
    model: nn.Module,
    state: PatchState,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    options: PatchOptions,
    kwargs: dict,
    late: LateHeadGrad | None = None,
) -> torch.Tensor:
    """The stock causal-LM loss (``ForCausalLMLoss``) of ``lm_head(hidden)``, computed by the fused op run as the
    head's forward, so that FSDP1 / FSDP2 / DeepSpeed ZeRO-3 gather its weight (:mod:`hf_flce.distributed`); with
    ``late``, against the detached weight, dW coming at the end of the backward."""
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        if labels.dim() not in (1, 2):
            # stock shifts along the last axis: a trailing axis of one would leave every position ignored
            raise ValueError(f"labels must be [batch, sequence] (or flat), got shape {tuple(labels.shape)}")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1)
    if target.numel() != hidden.shape[0]:
        raise ValueError(
            f"labels give {target.numel()} targets for {hidden.shape[0]} positions (after logits_to_keep); "
            "they must match as in the stock loss"
        )
    # the logit scale (Granite, Command R) and softcap (Gemma 2) the stock forward applies
    temperature, softcap = op_transform(model.config.get_text_config(), 1.0, state.logit_attributes)
    op_options = dict(
        ignore_index=ignore_index,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        label_smoothing=options.label_smoothing,
        z_loss=options.z_loss,
        temperature=temperature,
        softcap=softcap,
        backend=options.backend,
        memory_budget=in_model_budget(options.memory_budget, hidden.device),
    )
    head = model.get_output_embeddings()
    if late is not None:
        return late.loss(head, hidden, target, **op_options)
    return head_linear_cross_entropy(head, hidden, target, **op_options)


# The models' cache argument and their outputs' cache field: ``past_key_values`` until transformers 5.23, ``cache``
# from 5.24 on (which renames the old name with a warning, and refuses both at once)
CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


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
    state = patch_state(self)
    options = _fused_head(self, state, labels, kwargs.pop("skip_logits", None))
    if CACHE in kwargs:
        if past_key_values is not None:
            raise ValueError(f"pass the cache as `{CACHE}` or as `past_key_values`, not both")
        past_key_values = kwargs.pop(CACHE)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        CACHE: past_key_values,
        "inputs_embeds": inputs_embeds,
        "use_cache": use_cache,
    }
    if options is None:
        return state.stock_forward(self, **inputs, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    if use_cache is None and past_key_values is None:
        # Stock builds a KV cache from ``config.use_cache`` (True in most configs), copying every layer's keys and
        # values. With no logits returned it could not continue a generation, so the fused call builds one only when
        # asked, as a ``Trainer`` run (``args.use_cache=False``) and TRL's fused head (``use_cache=False``) have it.
        inputs["use_cache"] = False
    # before the layers' autograd nodes
    late = LateHeadGrad.start(self.get_output_embeddings()) if options.defer_head_grad else None
    body = decoder_of(self)
    if state.output_class is not None and _takes(type(body).forward, "labels"):
        inputs["labels"] = labels  # as the stock vision-language forward passes them
    router_flag = "output_router_logits"
    if state.aux_loss is not None and kwargs.get(router_flag) is None and _takes(state.stock_forward, router_flag):
        # stock's default where its forward names the flag (5.17's vision-language MoE forwards read it from their
        # kwargs only, so there it is off unless passed)
        kwargs[router_flag] = self.config.get_text_config().output_router_logits
    outputs = body(**inputs, **kwargs)
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    loss = _fused_loss(self, state, hidden, labels, options, kwargs, late)
    fields = {
        "logits": None,
        CACHE: getattr(outputs, CACHE),
        "hidden_states": outputs.hidden_states,
        "attentions": outputs.attentions,
    }
    if state.aux_loss is not None:
        aux_loss = _aux_loss(self, state, outputs, kwargs.get("output_router_logits"), attention_mask)
        if aux_loss is not None:
            loss = loss + _router_setting(self, "router_aux_loss_coef") * aux_loss.to(loss.device)
        fields.update(aux_loss=aux_loss, router_logits=outputs.router_logits)
    if state.output_class is not None:
        extra = {f.name: getattr(outputs, f.name, None) for f in dataclasses.fields(state.output_class)}
        return state.output_class(**{**extra, "loss": loss, **fields})
    output_class = CausalLMOutputWithPast if state.aux_loss is None else MoeCausalLMOutputWithPast
    return output_class(loss=loss, **fields)


def _router_setting(model: nn.Module, name: str):
    """A router setting as the stock forward reads it: the model's attribute (text MoE classes), else its text
    config's (vision-language MoE classes)."""
    return getattr(model, name) if hasattr(model, name) else getattr(model.config.get_text_config(), name)


def _aux_loss(model: nn.Module, state: PatchState, outputs, output_router_logits: bool | None, attention_mask):
    """Stock's load-balancing loss (not divided by ``num_items_in_batch``), or None when router logits are off."""
    if not output_router_logits:
        return None
    if outputs.router_logits is None:
        # transformers 5.17's GraniteMoe models: stock's forward fails on the same missing logits
        raise RuntimeError(
            f"{type(model).__name__}: the model returned no router logits for its aux loss (output_router_logits="
            "True), which this transformers release does not collect for it; set output_router_logits=False or "
            "upgrade transformers"
        )
    experts, top_k = _router_setting(model, "num_experts"), _router_setting(model, "num_experts_per_tok")
    return state.aux_loss(outputs.router_logits, experts, top_k, attention_mask)


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
    return _forward(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache, logits_to_keep,
        output_router_logits=output_router_logits, **kwargs,
    )  # fmt: skip


@functools.cache
def _takes(function: Callable, name: str) -> bool:
    """Whether ``function`` has a parameter called ``name``."""
    return name in inspect.signature(function).parameters


# the named arguments of the shared body (``_forward``) after ``self``; a vision-language forward's others go to its
# model
_BODY_ARGUMENTS = tuple(
    p.name for p in inspect.signature(_forward).parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
)[1:]


@functools.cache
def forward_from_stock(stock: Callable) -> Callable:
    """The fused forward of a class whose stock forward is ``stock`` (a vision-language class, or one whose stock
    forward orders its arguments otherwise): the shared body, with the class's other inputs (``pixel_values``,
    ``token_type_ids``, ...) passed to its model and its output class. It has ``stock``'s signature, which
    ``Trainer`` reads to keep the dataset columns the model takes, and by which positional arguments are bound."""
    signature = inspect.signature(stock)
    if "labels" not in signature.parameters:
        raise TypeError(f"{stock.__qualname__} takes no labels: not a causal vision-language forward")
    # the shared body's arguments that ``stock`` does not name arrive in its ``**kwargs``, if at all
    defaults = {name: None for name in _BODY_ARGUMENTS} | {"logits_to_keep": 0}
    defaults |= {name: p.default for name, p in signature.parameters.items() if name in _BODY_ARGUMENTS}

    @can_return_tuple
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        bound.pop(next(iter(signature.parameters)))  # self
        given = {}  # every argument passed, stock's **kwargs flattened
        for name, value in bound.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                given.update(value)
            else:
                given[name] = value
        body = [given.pop(name, defaults[name]) for name in _BODY_ARGUMENTS]
        return _forward(self, *body, **given)

    forward.__signature__ = signature
    forward.__doc__ = (
        f"Stock ``{stock.__qualname__}``, except that a training call with labels returns the fused loss and no "
        "logits. ``skip_logits=True/False`` (keyword) forces the fused or the stock path for one call."
    )
    FUSED_FORWARDS.add(forward)
    return forward


# every fused forward: the shared two, and the vision-language ones as they are made
FUSED_FORWARDS: set[Callable] = {causal_lm_forward, moe_causal_lm_forward}
