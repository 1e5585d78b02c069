"""What the trainer subclasses share: TRL's constructor run with hf_flce's head in place of TRL's, and a constructor
signature made of TRL's parameters plus hf_flce's keyword-only options."""

from __future__ import annotations

import inspect
import types

from accelerate.utils import is_peft_model

from ..backends import resolve_backend
from ..patches.forward import PatchOptions
from .head import flce_head_in_place_of_trl, has_flce_head

_FLCE_OPTIONS = (
    inspect.Parameter("flce_backend", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation=str),
    inspect.Parameter("flce_memory_budget", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=int | None),
    inspect.Parameter("flce_defer_head_grad", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool),
)


def _check_options(**options) -> None:
    """The ``flce_*`` options checked at construction as a patch's are (not at the first step's head call), and
    named by their ``flce_`` names."""
    try:
        PatchOptions(**options)
    except (TypeError, ValueError) as error:
        raise type(error)(f"flce_{error}") from None


class FLCETrainerMixin:
    """Runs the TRL trainer's constructor while its module's ``add_fused_lm_head`` installs
    :func:`~hf_flce.trainers.head.add_flce_lm_head`, then checks that every fused head is hf_flce's.

    ``flce_backend`` and ``flce_memory_budget`` become the op's ``backend`` and ``memory_budget``, and
    ``flce_defer_head_grad`` the head's ``defer_head_grad`` (trainers whose loss is a scalar of the head only).
    """

    _trl_module: types.ModuleType
    _scalar_head_loss: bool  # whether the trainer asks the head for a scalar loss (``fused_loss_type``)

    def __init__(
        self,
        *args,
        flce_backend: str = "auto",
        flce_memory_budget: int | None = None,
        flce_defer_head_grad: bool = False,
        **kwargs,
    ) -> None:
        _check_options(backend=flce_backend, memory_budget=flce_memory_budget, defer_head_grad=flce_defer_head_grad)
        if flce_defer_head_grad and not self._scalar_head_loss:
            raise ValueError(
                f"flce_defer_head_grad=True is for FLCESFTTrainer: {type(self).__name__}'s loss needs the head's "
                "per-token log-probs, whose backward recomputes the logits and has no float32 dW sum to defer"
            )
        self.flce_backend = flce_backend
        self.flce_memory_budget = flce_memory_budget
        self.flce_defer_head_grad = flce_defer_head_grad
        head_options = dict(
            backend=flce_backend, memory_budget=flce_memory_budget, defer_head_grad=flce_defer_head_grad
        )
        with flce_head_in_place_of_trl(self._trl_module, **head_options):
            super().__init__(*args, **kwargs)
        for name, model in self._fused_models():
            if not has_flce_head(model):
                raise RuntimeError(
                    f"TRL did not install the fused LM head of the {name} through `add_fused_lm_head`, so hf_flce "
                    "could not replace it: this TRL version is not supported (hf_flce supports trl>=1.16,<1.17)"
                )
        try:
            # the device the steps run on: under FSDP or DeepSpeed the model is not there yet
            resolve_backend(flce_backend, self.args.device)
        except ValueError as error:
            raise ValueError(f"flce_backend={flce_backend!r} on {self.args.device}: {error}") from None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        trl_init = next(base.__init__ for base in cls.__mro__ if base.__module__.startswith("trl."))
        params = [p for p in inspect.signature(trl_init).parameters.values() if p.kind != p.VAR_KEYWORD]

        def __init__(self, *args, **kwargs):
            FLCETrainerMixin.__init__(self, *args, **kwargs)

        # help() and IDEs show TRL's parameters plus hf_flce's options.
        __init__.__signature__ = inspect.Signature([*params, *_FLCE_OPTIONS])
        __init__.__doc__ = cls.__doc__
        cls.__init__ = __init__

    def _fused_models(self):
        """The models TRL's constructor gave a fused head: the policy (inside its PEFT wrapper) and, where the trainer
        keeps a separate one, the reference model."""
        model = self.accelerator.unwrap_model(self.model)
        yield "policy model", (model.get_base_model() if is_peft_model(model) else model)
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            yield "reference model", self.accelerator.unwrap_model(reference)
