"""Option checking shared by every backend: one place that says what is a valid call."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton", "ascend")

# Default bytes of logits (and their gradient) alive at once. Large enough that every GEMM stays
# big on a GPU; smaller on CPU, where the point is a lower peak than stock HF.
DEFAULT_BUDGET_ACCELERATOR = 1 << 30
DEFAULT_BUDGET_CPU = 256 << 20
BUDGET_ENV = "HF_FLCE_MEMORY_BUDGET"
# Inside a model (the patched forwards, the trainers' heads) the default is half the op's: there the head's buffers
# add to the activations at the training step's peak, and the step takes many times the head's time, so the smaller
# chunks cost no measurable speed (docs/PERF_NOTES.md v25).
IN_MODEL_BUDGET_DIVISOR = 2


@dataclass(frozen=True)
class FLCEOptions:
    """The loss options of one call, validated. Backends read these and nothing else."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(self.ignore_index).__name__}")
        _check_real("label_smoothing", self.label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        _check_real("z_loss", self.z_loss)
        if self.z_loss < 0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        _check_real("temperature", self.temperature)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.softcap is not None:
            _check_real("softcap", self.softcap)
            if self.softcap <= 0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        if self.memory_budget is not None:
            if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int):
                raise TypeError(f"memory_budget must be an int number of bytes, got {self.memory_budget!r}")
            if self.memory_budget <= 0:
                raise ValueError(f"memory_budget must be > 0 bytes, got {self.memory_budget}")

    def budget_bytes(self, device: torch.device, default_divisor: int = 1) -> int:
        """``memory_budget``, else ``HF_FLCE_MEMORY_BUDGET``, else the device's default divided by
        ``default_divisor``."""
        if self.memory_budget is not None:
            return self.memory_budget
        env = env_positive_int(BUDGET_ENV)
        if env is not None:
            return env
        return (DEFAULT_BUDGET_CPU if device.type == "cpu" else DEFAULT_BUDGET_ACCELERATOR) // default_divisor


def in_model_budget(memory_budget: int | None, device: torch.device) -> int:
    """The budget of a head inside a model on ``device``: ``memory_budget`` or ``HF_FLCE_MEMORY_BUDGET`` when set,
    else the op's default divided by ``IN_MODEL_BUDGET_DIVISOR`` (512 MiB on accelerators, 128 MiB on CPU)."""
    return FLCEOptions(memory_budget=memory_budget).budget_bytes(device, IN_MODEL_BUDGET_DIVISOR)


def env_positive_int(name: str) -> int | None:
    """The positive integer environment variable ``name``, or None where it is unset or empty."""
    return env_int(name, minimum=1)


def env_int(name: str, minimum: int = 0) -> int | None:
    """The integer environment variable ``name`` (at least ``minimum``), or None where it is unset or empty."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def env_flag(name: str) -> bool:
    """The on/off environment variable ``name``: ``1``/``true`` or ``0``/``false`` (any case), off where unset or
    empty."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise ValueError(f"{name} must be 1, 0, true or false, got {os.environ[name]!r}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_tensors(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    mixed_dtypes: bool = False,
) -> None:
    """Shapes, dtypes and devices. Raises ValueError / TypeError naming the argument at fault. ``mixed_dtypes``:
    hidden and weight may differ (under autocast both are cast to the autocast dtype for the GEMMs)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if hidden.dtype != weight.dtype and not mixed_dtypes:
        raise TypeError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype "
            "(as F.linear requires; under torch.autocast both are cast for you)"
        )
    if target.dtype not in INT_DTYPES:
        raise TypeError(f"target must be an integer tensor, got {target.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension [..., H]")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden has H={hidden.shape[-1]} but weight is [V, H]={tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has V=0 classes")
    if weight.shape[1] == 0:
        raise ValueError("weight and hidden have H=0 features")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the leading shape of hidden {tuple(hidden.shape[:-1])}"
        )
    devices = {"hidden": hidden.device, "weight": weight.device, "target": target.device}
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V]=({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype not in FLOAT_DTYPES:
            raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
        devices["bias"] = bias.device
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor):
            raise TypeError(f"class_weight must be a torch.Tensor or None, got {type(class_weight).__name__}")
        if tuple(class_weight.shape) != (weight.shape[0],):
            raise ValueError(f"class_weight must have shape [V]=({weight.shape[0]},), got {tuple(class_weight.shape)}")
        if not class_weight.is_floating_point():
            raise TypeError(f"class_weight must be a float tensor, got {class_weight.dtype}")
        devices["class_weight"] = class_weight.device
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{k} on {v}" for k, v in devices.items())
        raise ValueError(f"device mismatch: {listed}; move them to one device")


def check_num_items(num_items_in_batch: object, reduction: str) -> None:
    """HF's gradient-accumulation count: a non-negative number (or 0-d tensor), only with ``reduction="mean"``."""
    if num_items_in_batch is None:
        return
    if reduction != "mean":
        raise ValueError(
            "num_items_in_batch gives sum / num_items_in_batch and replaces the reduction; "
            f"it cannot be combined with reduction={reduction!r}"
        )
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float, torch.Tensor)):
        raise TypeError(
            f"num_items_in_batch must be an int, float or 0-d tensor, got {type(num_items_in_batch).__name__}"
        )
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a single number, got shape {tuple(num_items_in_batch.shape)}")
    if not isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {num_items_in_batch}")


STAT_NAMES = ("logprobs", "lse", "entropy", "is_top1", "mean_logit", "log_sum_sq_probs")
ALWAYS_COMPUTED = ("logprobs", "lse")
# computed only when asked for (TileParams.optional_stats)
OPTIONAL_STATS = frozenset(STAT_NAMES) - set(ALWAYS_COMPUTED)


def stats_request(return_stats: object) -> frozenset[str] | None:
    """``return_stats`` checked: ``None`` when no stats are returned, else the optional statistics to compute.

    ``True`` asks for all of them; a collection of :class:`hf_flce.FLCEStats` field names asks for those (``logprobs``
    and ``lse`` are always computed; the fields not named come back as zeros where skipping them saves time).
    """
    if isinstance(return_stats, bool):
        return OPTIONAL_STATS if return_stats else None
    if isinstance(return_stats, str) or not hasattr(return_stats, "__iter__"):
        raise TypeError(f"return_stats must be a bool or a collection of stat names, got {type(return_stats).__name__}")
    names = frozenset(return_stats)
    unknown = sorted(str(n) for n in names - set(STAT_NAMES))
    if unknown:
        raise ValueError(f"return_stats names unknown stats {unknown}; known: {list(STAT_NAMES)}")
    return names & OPTIONAL_STATS
