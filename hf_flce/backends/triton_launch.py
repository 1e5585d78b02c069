"""Triton launches without ``JITFunction.run``'s per-call bookkeeping.

``kernel[grid](*args)`` binds every argument by name, derives the kernel's specialization from them, formats it into a
cache key string, checks the globals the kernel read and only then launches. On the H200 machine's host the head
GEMM's launch took 76 µs that way and 59 µs from here, compaction's 45 and 40 (``docs/PERF_NOTES.md`` v18): a call
whose GPU waits for the host (a no-grad call, or the first GEMM of a call after compaction's host read) pays the
difference before each of its kernels. Here the compiled kernel is kept under a
key at least as fine as Triton's specialization and launched straight away; the first launch of each key goes through
Triton as usual. Under the interpreter (CPU tests) every launch goes through Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

# (kernel, device, options, argument keys...) -> (compiled kernel, the parameters after the positional ones)
_COMPILED: dict[tuple, tuple[CompiledKernel, tuple]] = {}


def _arg_key(value):
    """What Triton specializes a runtime argument on, or more: a pointer's dtype and 16-byte alignment, an integer's
    being 1, divisible by 16 and its range (i32, i64 or u64); floats are never specialized."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63
    if isinstance(value, float):
        return float
    return value


def launch(kernel, grid: Sequence[int], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: ``args`` the runtime arguments in signature order, ``kwargs`` the constexpr
    ones and launch options (``num_warps``, ...), all of which are part of the key."""
    if not isinstance(kernel, JITFunction):  # the interpreter's function
        kernel[grid](*args, **kwargs)
        return
    key = (kernel, torch.cuda.current_device(), tuple(kwargs.items()), *map(_arg_key, args))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if isinstance(compiled, CompiledKernel):
            params = kernel.params[len(args) :]
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params)
            _COMPILED[key] = compiled, tail
        return
    compiled, tail = entry
    # the launcher takes every parameter in signature order (constexprs included), as JITFunction.run passes them
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
