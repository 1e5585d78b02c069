"""Triton launches without ``JITFunction.run``'s per-call bookkeeping.

``kernel[grid](*args)`` binds every argument by name, derives the kernel's specialization from them, formats it into a
cache key string, checks the globals the kernel read and only then launches. An isolated call's GPU waits for every
microsecond of that before each kernel (a no-grad call, or a call's first GEMM after compaction's host read). On the
H200 machine's host the head GEMM's launch took 76 µs that way and 59 µs from this module's first version
(``docs/PERF_NOTES.md`` v18); timed statement by statement inside a call (v20), 24 µs of it went to that version's key
and 58 µs to ``CompiledKernel.__getitem__``'s runner and the launch. Here the compiled kernel is kept under a key at
least as fine as Triton's specialization and handed straight to its launcher, as ``JITFunction.run`` itself does
once it has the kernel; the first launch of each key goes through Triton as usual. Under the interpreter (CPU tests)
every launch goes through Triton.

Triton compiles a variant of a kernel for each specialization of its integer arguments (divisible by 16, equal to
1). A row count changes from batch to batch, so the kernels take theirs unspecialized (``do_not_specialize``): in the
GPU convergence loop on an H100 (docs/PERF_NOTES.md v38) a count divisible by 16, first met at step 1 or 4, compiled
five more variants (the head GEMM's among them) and made those steps 1.1 and 3.3 s long on a cold cache. A row count
only bounds masks across rows; where rows are also a stride (the partial statistics), the stride is the count rounded
up to 16 (``triton_gemm.partial_stride``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# (kernel, device, options..., argument keys...) -> (compiled kernel, the parameters after the positional ones)
_COMPILED: dict[tuple, tuple[CompiledKernel, tuple]] = {}
_I32 = 2**31


def _key(kernel, device: int, args: Sequence, kwargs: dict) -> tuple:
    """At least as fine as Triton's specialization of ``args``: a tensor's dtype and 16-byte alignment; an int's being
    1, its divisibility by 16 and its range (i32, i64 or u64); a float's nothing; anything else (bool, None) by type
    and value. One comprehension: a helper called per argument took 40% longer (10.9 against 7.7 µs for 42
    arguments on the CPU machine)."""
    return (
        kernel,
        device,
        *kwargs.items(),
        *[
            (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, torch.Tensor)
            else (a == 1, a % 16 == 0, -_I32 <= a < _I32, a < 2**63)
            if a.__class__ is int
            else float
            if a.__class__ is float
            else (a.__class__, a)
            for a in args
        ],
    )


def launch(kernel, grid: Sequence[int], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: ``args`` the runtime arguments in signature order, ``kwargs`` the constexpr
    ones and launch options (``num_warps``, ...), all of which are part of the key."""
    if not isinstance(kernel, JITFunction):  # the interpreter's function
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key = _key(kernel, device, args, kwargs)
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if isinstance(compiled, CompiledKernel):
            params = kernel.params[len(args) :]
            tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params)
            _COMPILED[key] = compiled, tail
        return
    compiled, tail = entry
    grid = (*grid, 1, 1)[:3]
    stream = driver.active.get_current_stream(device)
    enter_hook, exit_hook = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    # what JITFunction.run does once it has the compiled kernel: the launcher takes every parameter in signature order
    # (constexprs included); only a profiler's launch hooks read the metadata, which is not built without them
    metadata = (
        None if enter_hook is None and exit_hook is None else compiled.launch_metadata(grid, stream, *args, *tail)
    )
    compiled.run(
        *grid,
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        enter_hook,
        exit_hook,
        *args,
        *tail,
    )
