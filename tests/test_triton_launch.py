"""``backends/triton_launch.py``: compiled kernels launched straight from a cache whose key is at least as fine as
Triton's own specialization, so a launch never reuses a kernel compiled for other argument properties."""

import pytest
import torch
import triton
import triton.language as tl
from test_triton_backend import DEVICE

from hf_flce.backends import cdiv, next_power_of_2, triton_launch
from hf_flce.backends.triton_launch import _key, launch


@triton.jit
def _scaled_copy_kernel(src_ptr, dst_ptr, n, scale, step, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    values = tl.load(src_ptr + offs * step, mask=mask, other=0.0) * scale
    if ADD_ONE:
        values += 1.0
    tl.store(dst_ptr + offs, values, mask=mask)


def _arg_key(value):
    return _key(_scaled_copy_kernel, 0, (value,), {})


def test_host_grid_helpers_match_triton():
    """The grid arithmetic done on the host without Triton's constexpr-function wrapper gives Triton's values."""
    for n in [*range(1, 300), 4095, 4096, 4097, 151936, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 3, 16, 32, 128, 256):
            assert cdiv(n, block) == triton.cdiv(n, block), (n, block)
    assert cdiv(0, 16) == 0


def test_key_separates_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) != _arg_key(base[1:])  # 16-byte aligned or not
    assert _arg_key(base) != _arg_key(base.to(torch.bfloat16))
    assert _arg_key(base) == _arg_key(torch.ones(64, dtype=torch.float32))  # another aligned buffer of that dtype
    ints = [0, 1, 2, 16, 17, 2**31 - 16, 2**31, 2**63, -16, -(2**31) - 1]
    assert len({_arg_key(i) for i in ints}) >= 6
    assert _arg_key(1) != _arg_key(17) and _arg_key(16) != _arg_key(17) and _arg_key(2**31 - 16) != _arg_key(2**31)
    assert _arg_key(2**31) != _arg_key(2**63) and _arg_key(-16) != _arg_key(-(2**31) - 1)
    assert _arg_key(32) == _arg_key(4096) and _arg_key(3) == _arg_key(1001)  # one specialization, one entry
    assert _arg_key(0.5) == _arg_key(3.0)  # floats are not specialized
    assert _arg_key(True) != _arg_key(1) and _arg_key(None) != _arg_key(False) and _arg_key(1.0) != _arg_key(1)
    assert _key(_scaled_copy_kernel, 0, (), {"BLOCK": 64}) != _key(_scaled_copy_kernel, 0, (), {"BLOCK": 128})
    assert _key(_scaled_copy_kernel, 0, (), {}) != _key(_scaled_copy_kernel, 1, (), {})  # per device


def _reference(src, n, scale, step, add_one):
    out = src[::step][:n].to(torch.float32) * scale
    return out + 1.0 if add_one else out


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset-by-one"])
def test_launch_matches_triton_across_argument_properties(offset):
    """The same kernel through ``launch`` with pointers, counts, strides and constexprs that change between calls,
    each compared with torch: a reused kernel compiled for other properties (an alignment, ``n == 1``, a stride of
    1) would read or write the wrong elements."""
    torch.manual_seed(0)
    buf = torch.randn(4096 + offset, device=DEVICE)
    src = buf[offset:]
    cases = [(1000, 1, False), (1000, 1, False), (1, 1, False), (16, 2, False), (17, 3, True), (1000, 1, True)]
    for n, step, add_one in cases:
        dst = torch.full((n + 1,), -7.0, device=DEVICE)
        launch(_scaled_copy_kernel, (triton.cdiv(n, 128),), src, dst, n, 0.5, step, BLOCK=128, ADD_ONE=add_one)
        torch.testing.assert_close(dst[:n], _reference(src, n, 0.5, step, add_one), rtol=0, atol=0)
        assert dst[n].item() == -7.0  # nothing written past n


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter launches through Triton every time")
def test_second_launch_comes_from_the_cache(monkeypatch):
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    src = torch.randn(256, device=DEVICE)
    dst = torch.empty(256, device=DEVICE)
    launch(_scaled_copy_kernel, (2,), src, dst, 256, 2.0, 1, BLOCK=128)
    assert len(triton_launch._COMPILED) == 1
    ((compiled, tail),) = triton_launch._COMPILED.values()
    assert tail == (128, False)  # BLOCK, then ADD_ONE's default

    def no_jit(*args, **kwargs):
        raise AssertionError("went through JITFunction.run")

    monkeypatch.setattr(type(_scaled_copy_kernel), "run", no_jit)
    src2, dst2 = torch.randn(256, device=DEVICE), torch.empty(256, device=DEVICE)  # other buffers, same properties
    launch(_scaled_copy_kernel, (2,), src2, dst2, 256, 3.0, 1, BLOCK=128)  # a float is not part of the key
    torch.testing.assert_close(dst2, src2 * 3.0, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="JITFunction.run"):
        launch(_scaled_copy_kernel, (2,), src, dst, 255, 2.0, 1, BLOCK=128)  # a new key: through Triton


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter launches through Triton every time")
def test_profiler_hooks_see_cached_launches(monkeypatch):
    """A launch hook (a profiler's) sees cached launches too, with their metadata."""
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    src = torch.randn(256, device=DEVICE)
    dst = torch.empty(256, device=DEVICE)
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(metadata))
    launch(_scaled_copy_kernel, (2,), src, dst, 103, 4.0, 1, BLOCK=128)  # new key: through Triton
    launch(_scaled_copy_kernel, (2,), src, dst, 103, 4.0, 1, BLOCK=128)  # cached
    torch.testing.assert_close(dst[:103], src[:103] * 4.0, rtol=0, atol=0)
    assert len(seen) == 2 and seen[1].get()["name"] == "_scaled_copy_kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_changing_row_counts_compile_nothing_new(monkeypatch, reduction):
    """Batches whose token and kept-row counts change (divisible by 16 or not) reuse the kernels the first batch
    compiled: the row counts are unspecialized, so training does not stop to compile a variant when it first meets a
    count divisible by 16. The tile path (GPUs before Hopper, or ``HF_FLCE_GEMM_EPILOGUE=0``) picks its pass's warps
    by row count (``triton_tiles.launch_config``), so there a batch compiles only ``_tile_kernel`` variants for warp
    counts the first batch did not use."""
    from hf_flce import fused_linear_cross_entropy
    from hf_flce.backends import resolve_backend

    vocab, hidden = 1000, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()

    def step(n: int) -> None:
        x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        target = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
        target[::5] = -100
        loss = fused_linear_cross_entropy(x, weight, target, reduction=reduction)
        (loss if reduction == "mean" else loss.sum()).backward()

    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kwargs: compiled.append(kwargs["repr"]))
    step(1003)  # 1003 rows, 802 kept
    first, compiled[:] = list(compiled), []
    for n in (1000, 1008, 2048, 997, 1040):  # kept 800, 806, 1638, 797, 832
        step(n)
    tiles = resolve_backend("triton", torch.device("cuda"))
    if tiles.fused_head is not None and torch.cuda.get_device_capability()[0] >= tiles.gemm_min_capability:
        assert compiled == []
        return

    def warps(kernel_repr: str) -> str:
        return kernel_repr.split("num_warps=")[1].split(",")[0]

    first_warps = {warps(r) for r in first if r.startswith("_tile_kernel[")}
    assert all(r.startswith("_tile_kernel[") and warps(r) not in first_warps for r in compiled), compiled
