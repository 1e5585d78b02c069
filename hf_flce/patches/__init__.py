"""Patch transformers causal LMs so that training computes the loss with :func:`hf_flce.fused_linear_cross_entropy`.

A patched model returns the fused loss and ``logits=None`` for a training call with labels; generation, inference
and evaluation go through the stock forward. Patch one model (instance patch, also through a ``PeftModel``) or, with
no model, the classes, so models created afterwards are fused. Patching touches neither parameters nor the state dict.
"""

from __future__ import annotations

import gc
import inspect
import warnings
import weakref
from dataclasses import replace
from types import MethodType
from typing import TypedDict, TypeVar

from torch import nn
from typing_extensions import Unpack

from .forward import (
    FUSED_FORWARDS,
    STATE_ATTR,
    PatchOptions,
    PatchState,
    causal_lm_forward,
    forward_from_stock,
    moe_causal_lm_forward,
    stock_logit_attributes,
)
from .registry import (
    ALL_TARGETS,
    FAMILIES,
    MODEL_TYPES,
    Target,
    aux_loss_function,
    find_target,
    installed_classes,
    load_class,
    loaded_classes,
    output_class,
    stock_forward,
    supported_classes,
)

__all__ = [
    "apply_flce",
    "apply_flce_to_llama",
    "apply_flce_to_qwen",
    "apply_flce_to_mistral",
    "apply_flce_to_gemma",
    "revert_flce",
]

M = TypeVar("M", bound=nn.Module)


class PatchKwargs(TypedDict, total=False):
    """Patch options; see :func:`apply_flce`."""

    backend: str
    memory_budget: int | None
    label_smoothing: float
    z_loss: float
    skip_logits: bool | None
    defer_head_grad: bool


def apply_flce(model: M | None = None, **options: Unpack[PatchKwargs]) -> M | None:
    """Fuse ``lm_head`` and the loss of ``model``, whichever supported family its class (or a base class) is of.

    With no model, patch the classes of every family. Applying again only updates the options.

    Args:
        model: a supported ``*ForCausalLM`` or vision-language ``*ForConditionalGeneration`` (see
            ``hf_flce.patches.FAMILIES``), or a ``PeftModel`` around one.
        backend: ``"auto"`` (default; the torch backend on CPU), ``"torch"``, ``"triton"`` or ``"ascend"``.
        memory_budget: bytes of logits alive at once (default: half the op's, ``hf_flce.options.in_model_budget``).
        label_smoothing, z_loss: as :func:`hf_flce.fused_linear_cross_entropy` (both 0 reproduce the stock loss).
        skip_logits: ``None`` (default) fuses in training mode only, so ``model.eval()`` calls with labels return
            stock logits (``Trainer.evaluate`` with ``compute_metrics`` works); ``True`` fuses whenever there are
            labels; ``False`` never. A ``skip_logits=`` keyword of one forward call overrides it.
        defer_head_grad: compute ``lm_head``'s weight gradient at the end of the backward, after the layers' (default
            ``False``). The step's peak, at the end of the forward, then holds no ``[V, H]`` dW buffer (below a
            peer that sums dW in bf16; dW still gets the target column in float32), for one more logits GEMM from
            the forward's saved lse (1-4% of the H200 SFT steps of ``scripts/benchmark_training.py``,
            ``docs/PERF_NOTES.md`` v30, v31). Needs
            the weight whole on this device from the forward to the end of the backward: one GPU, DDP, or FSDP2 with
            ``lm_head`` in the root unit. Where FSDP2 shards ``lm_head`` as its own unit, and under FSDP1, DeepSpeed
            ZeRO-3 or accelerate's offload, the forward raises a ValueError.

    Returns:
        ``model`` itself (patched in place), or ``None`` for a class patch.

    Raises:
        ValueError: the model is not a supported class.
        RuntimeError: the forward was already wrapped on the instance (``accelerator.prepare`` under mixed precision)
            around the stock forward, where a patch could not take effect. A model dispatched by accelerate
            (``from_pretrained(device_map="auto")``, offload) is patched inside its hooks.

    Example:
        >>> import torch
        >>> from transformers import Qwen3Config, Qwen3ForCausalLM
        >>> from hf_flce import apply_flce
        >>> config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        >>> model = apply_flce(Qwen3ForCausalLM(config))
        >>> ids = torch.randint(0, 128, (2, 8))
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.logits is None, out.loss.shape
        (True, torch.Size([]))
    """
    return _apply(tuple(FAMILIES), model, options, "apply_flce")


def apply_flce_to_llama(model: M | None = None, **options: Unpack[PatchKwargs]) -> M | None:
    """Patch ``LlamaForCausalLM``, Llama 4's text model ``Llama4ForCausalLM`` and the vision-language
    ``LlavaForConditionalGeneration`` (this instance, or the classes when ``model`` is None). Options:
    :func:`apply_flce`.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_flce import apply_flce_to_llama
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4)
        >>> model = apply_flce_to_llama(LlamaForCausalLM(config), memory_budget=1 << 20)
        >>> ids = torch.randint(0, 128, (2, 8))
        >>> model(input_ids=ids, labels=ids).loss.backward()
    """
    return _apply(("llama",), model, options, "apply_flce_to_llama")


def apply_flce_to_qwen(model: M | None = None, **options: Unpack[PatchKwargs]) -> M | None:
    """Patch ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``,
    ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, ``Qwen4ExpForCausalLM`` and the
    vision-language ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
    ``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``,
    ``Qwen3_5MoeForConditionalGeneration`` (Qwen3.5's checkpoints) and ``Qwen4ExpForConditionalGeneration``. The MoE
    ones add stock's weighted load-balancing loss when router logits are on.

    Patches this instance, or with no model those classes. Options: :func:`apply_flce`.

    Example:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from hf_flce import apply_flce_to_qwen, revert_flce
        >>> apply_flce_to_qwen()  # models created from now on are fused
        >>> config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2)
        >>> model = Qwen2ForCausalLM(config)
        >>> import torch; ids = torch.randint(0, 128, (1, 6))
        >>> model(input_ids=ids, labels=ids).logits is None
        True
        >>> revert_flce()
    """
    return _apply(("qwen",), model, options, "apply_flce_to_qwen")


def apply_flce_to_mistral(model: M | None = None, **options: Unpack[PatchKwargs]) -> M | None:
    """Patch ``MistralForCausalLM``, ``MixtralForCausalLM``, ``MinistralForCausalLM``, ``Ministral3ForCausalLM``,
    ``Mistral4ForCausalLM`` and the vision-language ``Mistral3ForConditionalGeneration``
    (this instance, or the classes). Options: :func:`apply_flce`.

    Example:
        >>> import torch
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> from hf_flce import apply_flce_to_mistral
        >>> config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
        >>> model = apply_flce_to_mistral(MixtralForCausalLM(config))
        >>> ids = torch.randint(0, 128, (2, 8))
        >>> out = model(input_ids=ids, labels=ids, output_router_logits=True)
        >>> out.aux_loss is not None
        True
    """
    return _apply(("mistral",), model, options, "apply_flce_to_mistral")


def apply_flce_to_gemma(model: M | None = None, **options: Unpack[PatchKwargs]) -> M | None:
    """Patch ``GemmaForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, ``Gemma4ForCausalLM``,
    ``Gemma3nForCausalLM`` (Gemma 3n's text model), ``VaultGemmaForCausalLM`` and the vision-language
    ``Gemma3ForConditionalGeneration`` (Gemma 3 4B-27B) and ``Gemma4ForConditionalGeneration`` (this instance, or the
    classes).

    The fused loss applies the config's ``final_logit_softcapping`` (``cap * tanh(logits / cap)``: 30 in Gemma 2's
    configs; Gemma 3's leave it unset) as stock does, in float32 inside the op. The vision-language classes and
    ``Gemma4ForCausalLM`` keep their stock signatures and pass their own inputs (``pixel_values``,
    ``token_type_ids``, Gemma 4's ``per_layer_inputs``) and the labels to their models as stock does; the fused loss
    is the text model's. Options: :func:`apply_flce`.

    Example:
        >>> import torch
        >>> from transformers import Gemma2Config, Gemma2ForCausalLM
        >>> from hf_flce import apply_flce_to_gemma
        >>> config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=1.0)
        >>> model = apply_flce_to_gemma(Gemma2ForCausalLM(config))
        >>> ids = torch.randint(0, 128, (2, 8))
        >>> fused = model(input_ids=ids, labels=ids).loss  # training mode: no logits
        >>> stock = model(input_ids=ids, labels=ids, skip_logits=False)  # the stock forward: logits capped at 1
        >>> torch.allclose(fused, stock.loss), stock.logits.abs().max() < 1
        (True, tensor(True))
    """
    return _apply(("gemma",), model, options, "apply_flce_to_gemma")


def revert_flce(model: M | None = None) -> M | None:
    """Return ``model`` to the stock forward; with no model, undo the class patches.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from hf_flce import apply_flce_to_llama, revert_flce
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4)
        >>> model = revert_flce(apply_flce_to_llama(LlamaForCausalLM(config)))
        >>> ids = torch.randint(0, 128, (1, 6))
        >>> model(input_ids=ids, labels=ids).logits.shape
        torch.Size([1, 6, 128])
    """
    if model is None:
        for cls, target in loaded_classes().items():
            if cls.__dict__["forward"] in FUSED_FORWARDS:
                cls.forward = stock_forward(cls)
                # Instances wrapped by accelerate around the fused forward still call it: make it fall back.
                setattr(cls, STATE_ATTR, _state(cls, target, None))
        return None
    base = _unwrap(model)
    if _func(base.__dict__.get("forward")) in FUSED_FORWARDS:
        del base.__dict__["forward"]
    state = getattr(base, STATE_ATTR, None)  # the instance's, or the class patch's
    if state is not None and _routes_to_fused(base):
        # a class patch made later (or a class revert) reaches this instance again (``PatchState.opted_out_of``)
        class_state = getattr(type(base), STATE_ATTR, None)
        setattr(base, STATE_ATTR, replace(state, options=None, opted_out_of=class_state))
    else:
        base.__dict__.pop(STATE_ATTR, None)
    return model


def _apply(families: tuple[str, ...], model: M | None, options: PatchKwargs, caller: str) -> M | None:
    opts = PatchOptions(**options)
    targets = tuple(t for family in families for t in FAMILIES[family])
    if model is None:
        classes = installed_classes(targets)
        _warn_unreachable_instances(tuple(classes), caller)
        for cls, target in classes.items():
            cls.forward = _fused_forward(target)
            setattr(cls, STATE_ATTR, _state(cls, target, opts))
        return None
    base = _unwrap(model)
    found = find_target(base, targets)
    if found is None:
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        raise ValueError(
            f"{caller}: {type(base).__name__} is not supported (model type {model_type!r}); supported classes: "
            f"{supported_classes(targets)}"
            + (
                f" (model types: {', '.join(MODEL_TYPES)})"
                if len(targets) == len(ALL_TARGETS)
                else f" (all families: {supported_classes()})"
            )
        )
    cls, target = found
    override = _forward_override(type(base), cls)
    if override is not None:
        raise ValueError(
            f"{caller}: {type(base).__name__} overrides {cls.__name__}.forward (in {override.__qualname__}), which an "
            f"instance patch would replace. Patch the classes instead ({caller}() with no model) before creating the "
            "model, so that its super().forward() reaches the fused forward."
        )
    fused = _fused_forward(target)
    current = base.__dict__.get("forward")
    if current is None or _func(current) is fused:
        base.forward = InstanceForward(fused, base)
    elif _hooked_forward(base) in (stock_forward(cls), fused):
        # accelerate's hooks (``device_map`` dispatch, offload) call the bound method kept in ``_old_forward`` at each
        # call, inside whatever wraps them: replaced there, the hook still moves the inputs and the loss
        base._old_forward = InstanceForward(fused, base)
    elif _func(base.__dict__.get("_original_forward")) is not fused:
        raise RuntimeError(
            f"{caller}: {type(base).__name__}.forward is already wrapped on this instance ({_describe(current)}, e.g. "
            "by accelerator.prepare under mixed precision), so a patch would be ignored. Patch before "
            "accelerator.prepare / trainer.train(), or patch the classes before creating the model."
        )
    setattr(base, STATE_ATTR, _state(cls, target, opts))
    return model


def _fused_forward(target: Target):
    """The shared dense or MoE forward; one made from the stock forward where the class takes inputs of its own, or
    where its stock forward orders its arguments otherwise (GraniteMoe's has no ``use_cache``), so that positional
    calls mean what they mean in stock."""
    stock = stock_forward(load_class(target))
    shared = moe_causal_lm_forward if target.moe else causal_lm_forward
    if target.from_stock_forward or _positional_names(stock) != _positional_names(shared):
        return forward_from_stock(stock)
    return shared


def _positional_names(function) -> list[str]:
    # transformers 5.24 renamed ``past_key_values`` to ``cache``, with the old name still taken as a keyword
    return [
        "cache" if p.name == "past_key_values" else p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]


def _state(cls: type, target: Target, options: PatchOptions | None) -> PatchState:
    stock = stock_forward(cls)
    return PatchState(
        options=options,
        stock_forward=stock,
        aux_loss=aux_loss_function(target),
        output_class=output_class(target),
        logit_attributes=stock_logit_attributes(stock),
    )


class InstanceForward:
    """A fused forward bound to one model, as ``MethodType(forward, model)`` would be, except that it pickles and
    deep-copies as ``rebind(model, *rebind_args)`` (by default :func:`_bound_fused_forward`), with the copy's model:
    a bound method pickles as ``getattr(model, forward.__name__)``, which no model has, so ``torch.save(model)``
    could not be loaded. It holds its model weakly: the model holds it, and a strong reference back would keep a
    deleted model (its weights and gradients) alive until the garbage collector finds the cycle, where stock frees
    it on ``del``."""

    def __init__(self, forward, model: nn.Module, rebind=None, rebind_args: tuple = ()):
        self.__func__ = forward
        self._model = weakref.ref(model)
        self._rebind = _bound_fused_forward if rebind is None else rebind
        self._rebind_args = rebind_args

    @property
    def __self__(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise ReferenceError("this fused forward's model has been deleted")
        return model

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(MethodType(self.__func__, self.__self__))

    def __reduce__(self):
        return self._rebind, (self.__self__, *self._rebind_args)


def _bound_fused_forward(model: nn.Module) -> InstanceForward:
    """The fused forward of ``model``'s class bound to it (unpickling an :class:`InstanceForward`; the model may
    not have its attributes back yet, only its class)."""
    return InstanceForward(_fused_forward(find_target(model)[1]), model)


def _forward_override(kind: type, cls: type) -> type | None:
    """The subclass of ``cls`` in ``kind``'s MRO that defines its own forward, if any."""
    for klass in kind.__mro__:
        if klass is cls:
            return None
        if "forward" in klass.__dict__:
            return klass
    return None


def _func(method: object) -> object:
    return getattr(method, "__func__", None)


def _describe(method: object) -> str:
    func = _func(method) or method
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"


def _hooked_forward(module: nn.Module) -> object:
    """The function that accelerate's hook wrapper on ``module`` calls (``add_hook_to_module`` keeps it bound in
    ``_old_forward``), or None without a hook."""
    if getattr(module, "_hf_hook", None) is None or "_old_forward" not in module.__dict__:
        return None
    return _func(module.__dict__["_old_forward"])


def _routes_to_fused(module: nn.Module) -> bool:
    """Whether calling ``module`` still reaches a fused forward (class patch, or an instance wrapper around one)."""
    current = module.__dict__.get("forward")
    if current is None:
        return type(module).forward in FUSED_FORWARDS
    wrapped = (_func(current), _func(module.__dict__.get("_original_forward")), _hooked_forward(module))
    return any(f in FUSED_FORWARDS for f in wrapped)


def _warn_unreachable_instances(classes: tuple[type, ...], caller: str) -> None:
    """A class patch cannot reach instances whose forward was wrapped on the instance (accelerate's mixed-precision
    wrapper captures the stock function; TRL's own fused head replaces it): say so rather than be silently ignored
    for them. The patch still applies to every other instance, old and new."""

    def stuck() -> list[nn.Module]:
        return [
            obj
            for obj in gc.get_objects()
            if issubclass(type(obj), classes) and "forward" in obj.__dict__ and not _routes_to_fused(obj)
        ]

    found = stuck()
    if found:
        gc.collect()  # unreachable models awaiting collection do not count
        found = stuck()
    if found:
        names = sorted({type(obj).__name__ for obj in found})
        warnings.warn(
            f"{caller}: {len(found)} existing {'/'.join(names)} instance(s) have a forward wrapped on the instance "
            f"({_describe(found[0].__dict__['forward'])}, e.g. by accelerator.prepare under mixed precision); the class "
            f"patch does not reach them and they keep the stock loss. Patch the classes before accelerator.prepare / "
            f"trainer.train(), or call {caller}(model) on the unwrapped model before preparing it.",
            stacklevel=3,
        )


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT, torch.compile and (Distributed)DataParallel wrappers."""
    while True:
        if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        elif type(model).__name__ == "OptimizedModule":
            inner = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner
