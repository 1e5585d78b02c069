"""Block sizes and grids for the Ascend kernels, sized from the unified buffer (UB) of one vector core.

An Ascend vector core computes out of its UB (192 KiB on 910B / Atlas A2, 256 KiB on 910_95 / 950), and every
``[BLOCK]`` temporary a kernel keeps alive lives there. A GPU-sized tile overflows it, so each kernel's block is the
largest power of two with ``bytes_per_element * block <= UB * margin``. The grid is about one program per vector
core, each walking a contiguous range of rows.

Sources, first found wins: the environment (``ASCEND_UB_CAPACITY_BITS``, ``HF_FLCE_ASCEND_VECTOR_CORES``), then the
triton-ascend runtime on an NPU, then the 910B defaults. Nothing here imports torch_npu or triton-ascend at import
time, and every query of them is guarded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...options import env_positive_int

UB_ENV = "ASCEND_UB_CAPACITY_BITS"
CORES_ENV = "HF_FLCE_ASCEND_VECTOR_CORES"
DEFAULT_UB_BYTES = 192 * 1024  # 910B: 192 KiB per vector core
DEFAULT_VECTOR_CORES = 40  # 910B3/B4: 20 AI cores, two vector cores each
# The compiler keeps its own scratch, alignment padding and the per-row scalars in the UB too.
UB_MARGIN = 0.8
# UB alignment is 32 bytes: a block of float32 should fill at least one such unit.
MIN_BLOCK = 8
MAX_BLOCK = 1 << 16

# Live UB bytes per vocabulary element of each kernel variant ("lean": no softcap, class weight or smoothing).
# Counted as the float32/int32 [BLOCK] temporaries alive at once, plus a second buffer for the pipelined load.
# forward, lean: logits x2, exp, exp*(t-m), exp^2, column index, argmax candidate, masks
# forward, full: + transformed logits, tanh, class weight, weight*t
# backward, lean: logits x2, p, gradient, column index, masks
# backward, full: + transformed logits, tanh, class weight, chain-rule factor
BYTES_PER_ELEMENT: dict[tuple[str, bool], int] = {
    ("forward", True): 32,
    ("forward", False): 48,
    ("backward", True): 24,
    ("backward", False): 40,
}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``programs`` programs over consecutive rows (see ``grid``), ``block`` columns a step."""

    block: int
    programs: int
    rows_per_program: int
    extra_rows: int


def _triton_ascend_ub_kib() -> int | None:
    try:
        from triton.backends.ascend.runtime import utils as ascend_utils

        return int(ascend_utils.ub_size_in_kbytes)
    except Exception:
        return None


def _device_properties(device: torch.device) -> dict:
    try:
        import triton

        index = device.index if device.index is not None else torch.npu.current_device()
        return dict(triton.runtime.driver.active.utils.get_device_properties(index))
    except Exception:
        return {}


@functools.cache
def _npu_ub_bytes(device: torch.device) -> int:
    kib = _triton_ascend_ub_kib()
    return kib * 1024 if kib and kib > 0 else DEFAULT_UB_BYTES


@functools.cache
def _npu_vector_cores(device: torch.device) -> int:
    props = _device_properties(device)
    cores = props.get("num_vectorcore")
    if not cores and props.get("num_aicore"):
        cores = 2 * int(props["num_aicore"])
    return int(cores) if cores and int(cores) > 0 else DEFAULT_VECTOR_CORES


def ub_capacity_bytes(device: torch.device) -> int:
    """UB bytes of one vector core: ``ASCEND_UB_CAPACITY_BITS`` / 8, the triton-ascend runtime, or 192 KiB."""
    bits = env_positive_int(UB_ENV)
    if bits is not None:
        return bits // 8
    if device.type == "npu":
        return _npu_ub_bytes(device)
    return DEFAULT_UB_BYTES


def vector_core_count(device: torch.device) -> int:
    """Vector cores of the device: ``HF_FLCE_ASCEND_VECTOR_CORES``, the driver's ``num_vectorcore``, or 40."""
    cores = env_positive_int(CORES_ENV)
    if cores is not None:
        return cores
    if device.type == "npu":
        return _npu_vector_cores(device)
    return DEFAULT_VECTOR_CORES


def block_size(vocab: int, ub_bytes: int, bytes_per_element: int, margin: float = UB_MARGIN) -> int:
    """Largest power of two ``b`` with ``bytes_per_element * b <= ub_bytes * margin``, no larger than the row needs."""
    budget = int(ub_bytes * margin)
    fit = budget // bytes_per_element
    if fit < MIN_BLOCK:
        raise ValueError(
            f"UB of {ub_bytes} bytes leaves {budget} bytes, too small for a block of {MIN_BLOCK} elements at "
            f"{bytes_per_element} bytes each (check {UB_ENV})"
        )
    block = 1 << (min(fit, MAX_BLOCK).bit_length() - 1)
    needed = max(MIN_BLOCK, 1 << max(vocab - 1, 0).bit_length())
    return min(block, needed)


def grid(n_rows: int, cores: int) -> tuple[int, int, int]:
    """``(programs, rows_per_program, extra_rows)``: ``min(n_rows, cores)`` programs, each owning a contiguous range
    of ``rows_per_program`` rows, one more for the first ``extra_rows`` programs (program ``p`` starts at row
    ``p * rows_per_program + min(p, extra_rows)``)."""
    programs = max(0, min(n_rows, max(1, cores)))
    if programs == 0:
        return 0, 0, 0
    return programs, n_rows // programs, n_rows % programs


def plan_launch(kernel: str, lean: bool, n_rows: int, vocab: int, device: torch.device) -> Launch:
    block = block_size(vocab, ub_capacity_bytes(device), BYTES_PER_ELEMENT[(kernel, lean)])
    programs, rows_per_program, extra_rows = grid(n_rows, vector_core_count(device))
    return Launch(block=block, programs=programs, rows_per_program=rows_per_program, extra_rows=extra_rows)
