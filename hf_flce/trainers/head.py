"""A fused LM head with TRL's ``FusedCausalLMOutput`` contract, computed by :func:`hf_flce.fused_linear_cross_entropy`.

TRL 1.16's SFT and DPO trainers patch the model with ``trl.trainer.utils.add_fused_lm_head`` and then call
``model(..., labels=labels, fused_lm_head=True)``. :func:`add_flce_lm_head` has the same signature and output
contract (shifted labels unless ``shift_labels`` is given, zeros at ignored positions, ``label_mask``, MoE
``aux_loss``, the config's logit scale and softcap), so it can be installed in its place. It also understands
``fused_loss_type``, with which the caller asks for a trainable scalar loss directly: ``"nll"`` takes the op's
three-GEMM path (gradients computed during forward), and the per-token fields come back detached for metrics.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from trl.trainer.utils import FusedCausalLMOutput

from ..distributed import head_linear_cross_entropy, linear_of
from ..options import in_model_budget
from ..patches import InstanceForward
from ..patches.forward import op_transform
from ..patches.late_head_grad import LateHeadGrad
from ..patches.registry import decoder_of

IGNORE_INDEX = -100
FUSED_LOSS_TYPES = ("nll", "dft")
_PER_TOKEN_FIELDS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_HEAD_MARK = "_hf_flce_head"


@dataclass
class FLCECausalLMOutput(FusedCausalLMOutput):
    """:class:`trl.trainer.utils.FusedCausalLMOutput` plus ``token_loss``.

    Args:
        token_loss: the token-level loss alone (no MoE term): with ``fused_loss_type`` the trainable NLL or DFT loss
            (label-smoothed if asked), otherwise ``loss`` without the weighted ``aux_loss``.
    """

    token_loss: torch.Tensor | None = None


def _moe_aux_loss(model, text_config, backbone_outputs, attention_mask):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts = getattr(text_config, "num_experts", None) or getattr(model, "num_experts", None)
    return load_balancing_loss_func(
        backbone_outputs.router_logits, num_experts, text_config.num_experts_per_tok, attention_mask
    )


def _denominator(mask: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    count = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=mask.device)
    return count.clamp(min=1)


def add_flce_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
    *,
    backend: str = "auto",
    memory_budget: int | None = None,
    defer_head_grad: bool = False,
) -> None:
    """Give ``model`` a fused LM head: ``model(..., labels=labels, fused_lm_head=True)`` returns an
    :class:`FLCECausalLMOutput` instead of logits; without ``fused_lm_head`` the forward is the original one.

    The first four arguments are those of ``trl.trainer.utils.add_fused_lm_head``. ``backend`` and ``memory_budget``
    go to :func:`hf_flce.fused_linear_cross_entropy`; without ``memory_budget`` (nor ``HF_FLCE_MEMORY_BUDGET``) the
    head takes half the op's default budget, as the patched forwards do (``hf_flce.options.in_model_budget``).
    ``defer_head_grad`` computes ``lm_head``'s weight gradient at the end of the backward for the scalar losses, as
    ``apply_flce(..., defer_head_grad=True)`` does (:class:`hf_flce.patches.late_head_grad.LateHeadGrad`). Extra
    forward keywords:

    * ``fused_loss_type``: ``None`` (TRL's contract: differentiable per-token ``log_probs`` and ``entropy``; the op
      recomputes or keeps the logits for backward), ``"nll"`` (scalar loss, gradients computed in forward: three
      GEMMs) or ``"dft"`` (each token's NLL weighted by its detached probability; also three GEMMs). With a loss type, ``token_loss``
      is the trainable loss and the per-token fields are detached.
    * ``fused_label_smoothing``: label smoothing for ``"nll"``, as ``transformers``' ``LabelSmoother``.

    Example:
        >>> import torch
        >>> from hf_flce.data import build_tiny_model, build_tokenizer
        >>> from hf_flce.trainers import add_flce_lm_head
        >>> model = build_tiny_model(build_tokenizer())
        >>> add_flce_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        >>> ids = torch.randint(0, 600, (2, 9))
        >>> out = model(input_ids=ids, labels=ids, fused_lm_head=True, fused_loss_type="nll")
        >>> out.token_loss.backward()
        >>> out.log_probs.shape, out.log_probs.requires_grad
        (torch.Size([2, 8]), False)
    """
    unknown = set(outputs) - {"log_probs", *_PER_TOKEN_FIELDS}
    if unknown:
        raise ValueError(f"unknown fused-head outputs {sorted(unknown)}")
    if not isinstance(defer_head_grad, bool):
        raise TypeError(f"defer_head_grad must be a bool, got {defer_head_grad!r}")
    op_transform(model.config.get_text_config(), temperature)  # an unsupported logit scale raises here, not mid-step
    settings = _HeadSettings(temperature, cast_lm_head_to_fp32, tuple(outputs), backend, memory_budget, defer_head_grad)
    plain_forward = model.__dict__.get("forward")
    if isinstance(plain_forward, types.MethodType) and plain_forward.__self__ is model:
        # a method bound to the model (accelerate's mixed-precision wrapper): kept unbound, so that a copy calls it
        # with itself, and pickling fails on it as it did on the model before, instead of pickling a name to look up
        plain_forward = plain_forward.__func__
    model.forward = _head_forward(model, plain_forward, settings)


@dataclass(frozen=True)
class _HeadSettings:
    """:func:`add_flce_lm_head`'s arguments, kept with its forward to build a copy's."""

    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    backend: str
    memory_budget: int | None
    defer_head_grad: bool


def _head_forward(model, plain_forward, settings: _HeadSettings) -> InstanceForward:
    """:func:`add_flce_lm_head`'s forward for ``model``, bound to it weakly; without ``fused_lm_head`` it calls
    ``plain_forward``, the forward the instance had of its own (a patch; a plain function is called with the model
    as its first argument), or the class's where it had none. ``copy.deepcopy`` and pickling make the copy's own
    (its plain forward the copy's too). The config is read at each call."""
    outputs, defer_head_grad = settings.outputs, settings.defer_head_grad
    class_forward = type(model).forward  # the model may be a copy whose attributes are not set yet: its class only
    # the op computes only the statistics these outputs read (TRL's names -> FLCEStats fields)
    wanted_stats = {"mean_logit" if name == "mean_logits" else name for name in outputs if name != "log_probs"}

    @functools.wraps(type(model).forward)
    def flce_forward(
        self,
        *args,
        fused_lm_head: bool = False,
        labels=None,
        shift_labels=None,
        num_items_in_batch=None,
        fused_loss_type: str | None = None,
        fused_label_smoothing: float = 0.0,
        **kwargs,
    ):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            if plain_forward is None or isinstance(plain_forward, types.FunctionType):
                forward = functools.partial(class_forward if plain_forward is None else plain_forward, self)
            else:
                forward = plain_forward
            return forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True needs `labels` (or `shift_labels`)")
        if fused_loss_type not in (None, *FUSED_LOSS_TYPES):
            raise ValueError(f"fused_loss_type must be None or one of {FUSED_LOSS_TYPES}, got {fused_loss_type!r}")
        if fused_label_smoothing and fused_loss_type != "nll":
            raise ValueError("fused_label_smoothing applies to fused_loss_type='nll' only")
        if defer_head_grad and fused_loss_type is None and torch.is_grad_enabled():
            raise ValueError(
                "defer_head_grad=True needs a scalar loss (fused_loss_type 'nll' or 'dft'): the per-token log_probs' "
                "backward recomputes the logits and has no float32 dW sum to defer"
            )

        kwargs["use_cache"] = False
        text_config = self.config.get_text_config()
        op_temperature, op_softcap = op_transform(text_config, settings.temperature)
        op_kwargs = dict(temperature=op_temperature, softcap=op_softcap, backend=settings.backend)
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        # Looked up on each call: FSDP and PEFT replace the backbone and the head after patching.
        lm_head = self.get_output_embeddings()
        linear = linear_of(lm_head)
        if linear is None:
            raise ValueError(
                f"the fused head needs a plain linear lm_head, got {type(lm_head).__name__} "
                "(an adapter on lm_head would be skipped; put LoRA on other modules or use modules_to_save)"
            )
        late = LateHeadGrad.start(lm_head) if defer_head_grad else None  # before the backbone's autograd nodes
        backbone_outputs = decoder_of(self)(*args, **kwargs)
        # With the model split across devices (device_map) the backbone can end on another device than the head.
        hidden = backbone_outputs.last_hidden_state.to(linear.weight.device)
        # Score every position against the next token, the last one against nothing: the hidden states stay a view.
        shifted = shift_labels is None
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shifted else shift_labels
        targets = targets.to(hidden.device)
        mask = targets != IGNORE_INDEX
        # the budget is resolved where the hidden states are: its default depends on the device
        call_kwargs = {**op_kwargs, "memory_budget": in_model_budget(settings.memory_budget, hidden.device)}
        # Run as lm_head's own forward, so FSDP1/FSDP2/ZeRO-3 gather the weight as they would for logits.
        head_loss = functools.partial(
            head_linear_cross_entropy if late is None else late.loss,
            lm_head,
            hidden,
            targets,
            upcast=settings.cast_lm_head_to_fp32,
            return_stats=wanted_stats,
        )
        if fused_loss_type is not None:
            # nll and dft (https://huggingface.co/papers/2508.05629: each token weighted by its detached probability)
            # are scalar losses: the op's three-GEMM path, gradients formed during forward.
            token_loss, stats = head_loss(
                num_items_in_batch=num_items_in_batch,
                label_smoothing=fused_label_smoothing,
                prob_weighted=fused_loss_type == "dft",
                **call_kwargs,
            )
        else:
            _, stats = head_loss(reduction="none", **call_kwargs)
            token_loss = -stats.logprobs.sum() / _denominator(mask, num_items_in_batch)

        detach = fused_loss_type is not None
        fields = {
            "log_probs": stats.logprobs,
            "entropy": stats.entropy,
            "log_sum_sq_probs": stats.log_sum_sq_probs,
            "mean_logits": stats.mean_logit,
            "is_top1": stats.is_top1,
            "label_mask": mask,
        }
        for name, value in fields.items():
            if name not in ("log_probs", "label_mask") and name not in outputs:
                value = None
            elif detach:
                value = value.detach()
            if value is not None and shifted:
                value = value[:, :-1]
            fields[name] = value

        loss, aux_loss = token_loss, None
        if kwargs.get("output_router_logits"):
            aux_loss = _moe_aux_loss(self, text_config, backbone_outputs, kwargs.get("attention_mask"))
            loss = token_loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FLCECausalLMOutput(loss=loss, token_loss=token_loss, aux_loss=aux_loss, **fields)

    setattr(flce_forward, _HEAD_MARK, True)
    return InstanceForward(flce_forward, model, rebind=_head_forward, rebind_args=(plain_forward, settings))


def has_flce_head(model) -> bool:
    """Whether ``model.forward`` (or one it wraps, e.g. accelerate's autocast wrapper) is :func:`add_flce_lm_head`'s."""
    forward = getattr(model, "forward", None)
    if getattr(model, "_original_forward", None) is not None:  # accelerate's mixed-precision wrapper keeps it here
        forward = model._original_forward
    for _ in range(8):
        func = getattr(forward, "__func__", forward)
        if getattr(func, _HEAD_MARK, False):
            return True
        forward = getattr(func, "__wrapped__", None)
        if forward is None:
            return False
    return False


_SWAP_LOCK = threading.RLock()


@contextlib.contextmanager
def flce_head_in_place_of_trl(trainer_module: types.ModuleType, **head_kwargs):
    """While active, ``trainer_module.add_fused_lm_head`` (the name TRL's trainer calls to patch its models) installs
    :func:`add_flce_lm_head` instead, with the same arguments plus ``head_kwargs``."""
    if not callable(getattr(trainer_module, "add_fused_lm_head", None)):
        raise RuntimeError(
            f"{trainer_module.__name__} has no `add_fused_lm_head`: this TRL version is not supported by hf_flce"
        )
    with _SWAP_LOCK:
        original = trainer_module.add_fused_lm_head
        trainer_module.add_fused_lm_head = functools.partial(add_flce_lm_head, **head_kwargs)
        try:
            yield
        finally:
            trainer_module.add_fused_lm_head = original
