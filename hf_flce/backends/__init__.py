"""Backends: each one implements the tile passes of ``base.TileOps`` for one kind of device.

* ``torch``: pure PyTorch, any device; the behaviour the kernels are tested against.
* ``triton``: CUDA kernels (also CPU tensors under ``TRITON_INTERPRET=1``, which is how CI tests them).
* ``ascend``: Triton-Ascend kernels for Huawei NPUs (torch_npu + triton-ascend).
"""

from __future__ import annotations

import functools
import os

import torch

from ..options import BACKENDS
from .base import TileOps


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the project's chunk counts, and ``triton.cdiv``'s value for host grids
    without Triton's ``constexpr_function`` wrapper (1.4 µs a call on the CPU machine, ~17 calls per fused call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _load(name: str) -> TileOps:
    if name == "torch":
        from .torch_tiles import TorchTileOps

        return TorchTileOps()
    if name == "triton":
        from .triton_tiles import TritonTileOps

        return TritonTileOps()
    if name == "ascend":
        from .ascend import AscendTileOps

        return AscendTileOps()
    raise AssertionError(name)


@functools.cache
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def cuda_properties(device: torch.device):
    """A CUDA device's properties (``major``, ``multi_processor_count``, ...; the current device when ``device`` has no
    index), looked up once: torch's lookup costs microseconds on every call, and a call's GPU waits for its host."""
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


def resolve_backend(backend: str, device: torch.device) -> TileOps:
    """The tile implementation for ``backend`` on ``device``; ``"auto"`` picks by device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda" and triton_importable():
            backend = "triton"
        elif device.type == "npu":
            backend = "ascend"
        else:
            backend = "torch"
    if backend == "triton":
        if not triton_importable():
            raise ValueError("backend='triton' needs the triton package, which failed to import")
        if device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
            raise ValueError(
                f"backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"
            )
    if backend == "ascend" and device.type != "npu" and not (device.type == "cpu" and triton_interpreting()):
        raise ValueError(
            f"backend='ascend' runs on NPU tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"
        )
    return _load(backend)
