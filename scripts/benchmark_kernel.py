#!/usr/bin/env python3
"""Kernel benchmark: hf_flce's fused lm_head + cross-entropy side by side with its peers, in one run on one device.

Providers (each missing one is reported as ``n/a`` with its import error; a failing one as ``error``/``OOM``):
  stock        ``F.linear`` then ``F.cross_entropy`` on fp32 logits, as transformers' ``ForCausalLMLoss``
  compile      ``torch.compile`` of ``stock``
  liger        ``liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss``
  cce          Apple's ``cut_cross_entropy.linear_cross_entropy`` with gradient filtering (``filter_eps="high"``)
  cce_nofilter the same with ``filter_eps=None`` (exact gradient)
  trl          TRL 1.16's fused head kernel ``trl.kernels.ChunkedLogProbFunction``, called as ``add_fused_lm_head``
               calls it (ignored rows compacted first); loss ``-logp.sum() / count``
  torch_lce    ``torch.nn.functional.linear_cross_entropy`` with ``LinearCrossEntropyOptions()`` (chunked), if present
  ours         ``hf_flce.fused_linear_cross_entropy`` (backend ``triton`` on CUDA, ``torch`` on CPU, ``ascend`` on NPU)
  ours_fp32_sum  ``ours`` with dW summed across chunks in float32 (``HF_FLCE_DW_FP32_SUM=1``), the default before v46;
               not in the default list
  ours_no_frequent  ``ours`` with every dW row in the 16-bit sum (``HF_FLCE_DW_FREQUENT_CLASSES=0``), the default
               before v47: what keeping the most frequent target classes' rows in float32 costs; not in the default
               list
  ours_tile_path  ``ours`` on cuBLAS float32 logits and the tile passes (``HF_FLCE_GEMM_EPILOGUE=0``), the path of
               GPUs before Hopper; not in the default list
  ours_tile_path_fp32_sum  the same with each row's target column in the 16-bit gradient and dW summed across chunks
               in float32 (``HF_FLCE_TARGET_APART=0``), that path's default before v48; not in the default list
  ours_in_model  ``ours`` at the budget of a head inside a model (``hf_flce.options.in_model_budget``: half the op's
               default), what the patchers and trainers run; not in the default list, name it in ``--providers``

Inputs: ``X ~ N(0, 1)``, ``W ~ N(0, 0.02)``, every 17th target ignored, all bf16. ``peaked`` adds
``14 / |W[y]|^2 * W[y]`` to each non-ignored row of X (in fp32, with the bf16-rounded W), which raises its target
logit by exactly 14 and moves the other logits by ``W[y]·W[j]`` noise only. gemma2-2b runs with softcap 30 for every
provider; a provider without softcap support is ``n/a`` there.

Sections (``--sections``):
  main      per shape: the 3-GEMM floor (``torch.mm`` of X@W^T [N,V], G@W [N,H], G^T@X [V,H]) and one GEMM; per
            provider and distribution: fwd+bwd time (median of event-timed calls after warm-up), peak memory above the
            inputs (gradients included, and without them), ``|g - g_fp32| / |g_fp32|`` for dX and dW against a
            chunked fp32 reference (TF32 off); for ``flat`` also the no-grad forward time on detached inputs.
            Ratios: each timed call alternates with one of its yardstick (the floor's three GEMMs back to back, or
            the one logits GEMM for the no-grad forward) after ``SETTLE_S`` of untimed rounds, so both run at the
            clocks the GPU settles at under that load (``paired_floor_ms``, ``paired_gemm_ms``); an H100/H200 runs
            these GEMMs at its power limit, well below its top clock. Each round times both calls twice: queued,
            one after the other behind an untimed yardstick call (``fwdbwd_ms``, ``fwd_ms`` and the paired
            yardsticks: as inside a model, where the host enqueues the head while the GPU still runs the layers
            before it, so only host time after a host read is exposed), and isolated, each alone on an idle GPU
            (``*_isolated_ms``: every host step before the first kernel is exposed; earlier runs timed only this).
  pertoken  ``reduction="none"`` with a random per-token upstream gradient: time, memory, gradient error. On a GPU
            at the focus shapes, whose logits the per-token path recomputes in backward, and at shapes whose logits
            it keeps whole (``KEPT_WHOLE_SHAPES`` and mistral-7b): the two bounds of the per-token target.
  masked    the first half of every 4096-token sequence masked as prompt, against the unmasked batch.
  memory    accelerators: extra memory and time vs N (8k, 32k, 64k tokens at llama3-8b's H and V). CPU: peak RSS
            delta (VmHWM reset through /proc/self/clear_refs) of one fwd+bwd, one fresh process per provider.

Output under ``--out``: ``kernel.json`` (rewritten after every shape), ``kernel.md`` (tables), ``kernel.png``.
``--from-json FILE`` redraws tables and plots from a saved JSON without running anything.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from bench_common import (  # noqa: E402
    Device,
    bar_groups,
    base_parser,
    cpu_peak_rss_delta,
    env_info,
    finish_report,
    fmt_err,
    fmt_gb,
    fmt_ms,
    fmt_ratio,
    guarded,
    line_series,
    load_json,
    markdown_table,
    median,
    new_figure,
    ratio,
    run_worker,
    save_figure,
    setup_run,
    with_env,
    with_tile_path,
    write_json,
)

IGNORE = -100
PEAK_RAISE = 14.0
SEQ = 4096  # sequence length for prompt masking
TRL_VOCAB_TILE = 32768  # TRL 1.16's _CHUNKED_LOGPROB_CHUNK_SIZE, the vocabulary tile add_fused_lm_head passes
NPU_HIDDEN = 2048  # reference doc 001 benchmarks plain CE (no H); this is our choice of H for its shapes

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, "float | None"], torch.Tensor]


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    h: int
    v: int
    softcap: float | None = None


GPU_SHAPES = (
    Shape("llama3-8b", 8192, 4096, 128256),
    Shape("qwen2.5-7b", 8192, 3584, 152064),
    Shape("mistral-7b", 8192, 4096, 32768),
    Shape("qwen3-0.6b", 16384, 1024, 151936),
    Shape("gemma2-2b", 8192, 2304, 256000, 30.0),
    Shape("accuracy", 4096, 2048, 65536),  # design.md's gradient-accuracy shape
)
# per-token shapes whose logits fit the 1 GiB keep limit (kept whole from forward to backward), at llama3-8b's and
# qwen3-0.6b's heads; mistral-7b's fits at its benchmark N
KEPT_WHOLE_SHAPES = (
    Shape("llama3-8b-3k", 3072, 4096, 128256),
    Shape("qwen3-0.6b-3k", 3072, 1024, 151936),
)
CPU_SHAPES = (
    Shape("cpu-s", 512, 256, 8192),
    Shape("cpu-m", 1024, 512, 32000),
    Shape("cpu-softcap", 512, 256, 16384, 30.0),
)
CPU_MEM_SHAPE = "4096x1024x32768"
NPU_SHAPES = tuple(Shape(f"npu-v{v // 1024}k", 8 * 2048, NPU_HIDDEN, v) for v in (1024, 2048, 4096, 8192, 16384, 32768))
SHAPES = {s.name: s for s in (*GPU_SHAPES, *KEPT_WHOLE_SHAPES, *CPU_SHAPES, *NPU_SHAPES)}


@dataclass(frozen=True)
class DeviceDefaults:
    shapes: tuple[str, ...]
    providers: tuple[str, ...]
    focus: tuple[str, ...]  # shapes of the pertoken and masked sections
    memory_base: str  # H and V of the memory-vs-N sweep (CPU: the whole RSS shape)
    memory_n: tuple[int, ...]
    warmup: int = 2
    reps: int = 5
    kept_whole: tuple[str, ...] = ()  # more pertoken shapes: logits kept whole from forward to backward


_ALL_PEERS = ("stock", "compile", "liger", "cce", "cce_nofilter", "trl", "torch_lce", "ours")
DEFAULTS = {
    "cuda": DeviceDefaults(
        tuple(s.name for s in GPU_SHAPES),
        _ALL_PEERS,
        ("llama3-8b", "qwen3-0.6b"),
        "llama3-8b",
        (8192, 32768, 65536),
        kept_whole=("mistral-7b", *(s.name for s in KEPT_WHOLE_SHAPES)),
    ),
    "npu": DeviceDefaults(
        tuple(s.name for s in NPU_SHAPES), ("stock", "ours"), ("npu-v32k",), "npu-v32k", (16384, 32768, 65536)
    ),
    "cpu": DeviceDefaults(
        tuple(s.name for s in CPU_SHAPES), ("stock", "torch_lce", "trl", "ours"), ("cpu-m",), CPU_MEM_SHAPE, (), 1, 2
    ),
}
SECTIONS = ("main", "pertoken", "masked", "memory")


def parse_shape(spec: str) -> Shape:
    """A registered name, or ``NxHxV`` (optionally ``xCAP`` for a softcap)."""
    if spec in SHAPES:
        return SHAPES[spec]
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:x(\d+(?:\.\d+)?))?", spec)
    if not m:
        raise SystemExit(f"unknown shape {spec!r}: use one of {sorted(SHAPES)} or NxHxV[xSOFTCAP]")
    n, h, v = (int(g) for g in m.groups()[:3])
    return Shape(spec, n, h, v, float(m.group(4)) if m.group(4) else None)


# ---------------------------------------------------------------- providers


def stock_loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, reduction: str, softcap: float | None):
    """transformers' path: bf16 logits (softcapped as Gemma2 does), upcast to fp32, then cross-entropy."""
    logits = F.linear(x, w)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE, reduction=reduction)


def _compiled(_: str) -> LossFn:
    dynamo = torch._dynamo.config
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, key):
            setattr(dynamo, key, 64)  # shapes x grad modes x reductions recompile; never fall back silently
    return torch.compile(stock_loss)


def _liger(_: str) -> LossFn:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    def loss(x, w, y, reduction, softcap):
        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction=reduction, softcap=softcap)(w, x, y)

    return loss


def _cce(filter_eps: str | None) -> Callable[[str], LossFn]:
    def load(_: str) -> LossFn:
        from cut_cross_entropy import linear_cross_entropy

        def loss(x, w, y, reduction, softcap):
            return linear_cross_entropy(
                x, w, y, ignore_index=IGNORE, softcap=softcap, reduction=reduction, filter_eps=filter_eps
            )

        return loss

    return load


def _trl(_: str) -> LossFn:
    from trl.kernels import ChunkedLogProbFunction

    def loss(x, w, y, reduction, softcap):
        mask = y != IGNORE
        logp = ChunkedLogProbFunction.apply(
            x[mask], w, None, y[mask], 1.0, TRL_VOCAB_TILE, softcap, 1.0, ("log_probs",)
        )
        nll = -logp[0]
        if reduction == "none":
            return nll.new_zeros(y.shape).masked_scatter(mask, nll)
        total = nll.sum()
        return total if reduction == "sum" else total / mask.sum().clamp(min=1)

    return loss


def _torch_lce(_: str) -> LossFn:
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions")
    options = torch.nn.LinearCrossEntropyOptions()

    def loss(x, w, y, reduction, softcap):
        return F.linear_cross_entropy(x, w, y, reduction=reduction, ignore_index=IGNORE, options=options)

    return loss


def _ours(kind: str, in_model: bool = False) -> LossFn:
    import hf_flce
    from hf_flce.options import in_model_budget

    backend = {"cuda": "triton", "npu": "ascend"}.get(kind, "torch")
    budget = in_model_budget(None, torch.device(kind)) if in_model else None

    def loss(x, w, y, reduction, softcap):
        return hf_flce.fused_linear_cross_entropy(
            x, w, y, ignore_index=IGNORE, reduction=reduction, softcap=softcap, backend=backend, memory_budget=budget
        )

    return loss


@dataclass(frozen=True)
class ProviderSpec:
    load: Callable[[str], LossFn]
    softcap: bool = True
    devices: tuple[str, ...] = ("cuda", "cpu", "npu")


PROVIDERS = {
    "stock": ProviderSpec(lambda _: stock_loss),
    "compile": ProviderSpec(_compiled),
    "liger": ProviderSpec(_liger, devices=("cuda",)),
    "cce": ProviderSpec(_cce("high"), devices=("cuda",)),
    "cce_nofilter": ProviderSpec(_cce(None), devices=("cuda",)),
    "trl": ProviderSpec(_trl),
    "torch_lce": ProviderSpec(_torch_lce, softcap=False),
    "ours": ProviderSpec(_ours),
    "ours_fp32_sum": ProviderSpec(lambda kind: with_env(_ours(kind), HF_FLCE_DW_FP32_SUM="1")),
    "ours_no_frequent": ProviderSpec(lambda kind: with_env(_ours(kind), HF_FLCE_DW_FREQUENT_CLASSES="0")),
    "ours_tile_path": ProviderSpec(lambda kind: with_tile_path(_ours(kind)), devices=("cuda",)),
    "ours_tile_path_fp32_sum": ProviderSpec(
        lambda kind: with_env(with_tile_path(_ours(kind)), HF_FLCE_TARGET_APART="0"), devices=("cuda",)
    ),
    "ours_in_model": ProviderSpec(lambda kind: _ours(kind, in_model=True)),
}


def load_providers(names: list[str], kind: str) -> dict[str, LossFn | str]:
    """Each name's loss function, or the ``n/a: ...`` reason it cannot run here."""
    loaded: dict[str, LossFn | str] = {}
    for name in names:
        spec = PROVIDERS[name]
        if kind not in spec.devices:
            loaded[name] = f"n/a: runs on {'/'.join(spec.devices)} only"
            continue
        try:
            loaded[name] = spec.load(kind)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            loaded[name] = f"n/a: {type(exc).__name__}: {first[:160]}"
    return loaded


def unsupported(name: str, fn: LossFn | str, shape: Shape) -> str | None:
    if isinstance(fn, str):
        return fn
    if shape.softcap is not None and not PROVIDERS[name].softcap:
        return "n/a: no softcap"
    return None


# ---------------------------------------------------------------- inputs and reference


def make_inputs(
    shape: Shape, dist: str, dev: Device, seed: int, n: int | None = None, prompt_mask: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = shape.n if n is None else n
    d = dev.torch_device
    gen = torch.Generator(device=d).manual_seed(seed)
    w = (torch.randn(shape.v, shape.h, device=d, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(n, shape.h, device=d, generator=gen)
    y = torch.randint(0, shape.v, (n,), device=d, generator=gen)
    y[::17] = IGNORE
    if prompt_mask:
        seq = min(SEQ, n)
        y[(torch.arange(n, device=d) % seq) < seq // 2] = IGNORE
    if dist == "peaked":
        valid = y != IGNORE
        wy = w[y.clamp(min=0)].float()
        x.addcmul_(torch.where(valid, PEAK_RAISE / wy.square().sum(-1), 0.0)[:, None], wy)
        del wy
    return x.to(torch.bfloat16).requires_grad_(), w.requires_grad_(), y


@contextmanager
def exact_fp32():
    """fp32 matmuls without TF32 inside the block."""
    prev = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev[0]
        torch.set_float32_matmul_precision(prev[1])


@torch.no_grad()
def reference(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, row_scale: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token NLL, dX and dW in fp32, ``[rows, V]`` at a time; ``row_scale`` is each row's upstream gradient."""
    x32, w32 = x.detach().float(), w.detach().float()
    n, v = x32.shape[0], w32.shape[0]
    rows = max(1, min(n, (256 << 20) // v))  # 1 GiB per fp32 temporary
    nll = torch.zeros(n, device=x.device)
    dx = torch.empty_like(x32)
    dw = torch.zeros_like(w32)
    with exact_fp32():
        for s in range(0, n, rows):
            e = min(n, s + rows)
            yc = y[s:e]
            valid = yc != IGNORE
            safe = yc.clamp(min=0)[:, None]
            z = x32[s:e] @ w32.T
            t = None
            if softcap is not None:
                t = torch.tanh(z / softcap)
                z = t * softcap
            lse = torch.logsumexp(z, -1)
            nll[s:e] = torch.where(valid, lse - z.gather(1, safe)[:, 0], 0.0)
            g = z.sub_(lse[:, None]).exp_()  # softmax, in place of z
            g.scatter_add_(1, safe, -valid.float()[:, None])
            g.mul_(torch.where(valid, row_scale[s:e], 0.0)[:, None])
            if t is not None:
                g.mul_(1 - t * t)
            dx[s:e] = g @ w32
            dw.addmm_(g.T, x32[s:e])
            del z, g, t
    return nll, dx, dw


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp(min=1e-30))


# ---------------------------------------------------------------- measurements


@dataclass
class Runs:
    warmup: int
    reps: int


def measure_fwd_bwd(
    dev: Device,
    fn: LossFn,
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    reduction: str,
    softcap: float | None,
    runs: Runs,
    grad_out: torch.Tensor | None = None,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    floor: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Warm-up calls, then one call for memory (and the gradient error against ``ref``), then the timed calls, in
    turns with ``floor`` (the 3-GEMM floor, timed into ``paired_floor_ms``) where given."""

    def step():
        loss = fn(x, w, y, reduction, softcap)
        g = None if grad_out is None else grad_out.to(loss.dtype)
        return (loss.detach(), *torch.autograd.grad(loss, (x, w), grad_outputs=g))

    for _ in range(max(1, runs.warmup)):  # compilation and autotuning happen here
        step()
    (loss, dx, dw), extra = dev.extra_memory(step)
    rec: dict[str, Any] = {"grad_bytes": dx.nbytes + dw.nbytes}
    if dev.accelerator:
        rec["extra_bytes"] = extra
    if ref is not None:
        nll, ref_dx, ref_dw = ref
        count = (y != IGNORE).sum().clamp(min=1)
        ref_loss = nll if reduction == "none" else nll.sum() / count
        rec.update(dx_err=rel_err(dx, ref_dx), dw_err=rel_err(dw, ref_dw), loss_err=rel_err(loss.float(), ref_loss))
    del loss, dx, dw
    rec.update(_timed(dev, step, "fwdbwd", floor, "paired_floor", 0, runs.reps))
    return rec


# Seconds of untimed rounds before a timed pair, for the GPU's clocks to settle under the load (Device.time_rounds).
SETTLE_S = 0.5


def _timed(dev: Device, fn, name: str, yardstick, yardstick_name: str, warmup: int, reps: int) -> dict[str, Any]:
    """``name_ms`` and ``name_times`` of ``fn``, and the same of ``yardstick`` (if not None) timed in turns with it
    once the clocks have settled. On an accelerator with a yardstick, ``name_ms`` and ``yardstick_name_ms`` are the
    calls queued one after the other, as inside a model, and ``name_isolated_ms``, ``yardstick_name_isolated_ms``
    each alone on an idle GPU (``Device.time_queued``)."""
    if yardstick is None:
        times = dev.time_rounds([fn], warmup, reps)[0]
        return {f"{name}_ms": median(times), f"{name}_times": times}
    if not dev.accelerator:
        yard, times = dev.time_rounds([yardstick, fn], warmup, reps)
        timed = {"yardstick": yard, "queued": times}
    else:
        timed = dev.time_queued(yardstick, fn, warmup, reps, SETTLE_S)
    names = {
        "queued": name,
        "yardstick": yardstick_name,
        "isolated": f"{name}_isolated",
        "yardstick_isolated": f"{yardstick_name}_isolated",
    }
    rec = {}
    for kind, times in timed.items():
        rec.update({f"{names[kind]}_ms": median(times), f"{names[kind]}_times": times})
    return rec


def measure_forward(
    dev: Device, fn: LossFn, x, w, y, softcap: float | None, runs: Runs, gemm: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """No-grad forward on detached inputs (evaluation, a DPO reference model), in turns with ``gemm`` (one cuBLAS
    GEMM of the logits' shape, timed into ``paired_gemm_ms``) where given."""
    xd, wd = x.detach(), w.detach()

    def fwd():
        with torch.no_grad():
            return fn(xd, wd, y, "mean", softcap)

    return _timed(dev, fwd, "fwd", gemm, "paired_gemm", max(1, runs.warmup), runs.reps)


@dataclass
class Floor:
    """The head's three cuBLAS products at one shape, on random bf16 operands: ``X W^T`` ``[N, V]``, ``G W``
    ``[N, H]`` and ``G^T X`` ``[V, H]``; ``all`` runs them back to back, as one fused head would."""

    products: tuple[Callable[[], Any], ...]

    def all(self) -> None:
        for product in self.products:
            product()


def make_floor(dev: Device, shape: Shape) -> Floor:
    d, bf = dev.torch_device, torch.bfloat16
    x = torch.randn(shape.n, shape.h, device=d, dtype=bf)
    w = torch.randn(shape.v, shape.h, device=d, dtype=bf)
    g = torch.randn(shape.n, shape.v, device=d, dtype=bf)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    return Floor(
        (
            lambda: torch.mm(x, w.T, out=g),
            lambda: torch.mm(g, w, out=dx),
            lambda: torch.mm(g.T, x, out=dw),
        )
    )


def floor_times(dev: Device, floor: Floor, runs: Runs) -> dict[str, Any]:
    """The 3-GEMM floor timed on its own, each product apart (the tables' ``floor ms`` column; the ratios use the
    floor timed in turns with each provider)."""
    gemms = [median(dev.time_ms(p, max(1, runs.warmup), runs.reps)) for p in floor.products]
    return {"gemm_ms": gemms, "gemm1_ms": gemms[0], "floor_ms": sum(gemms)}


class Bench:
    """Runs the sections and keeps every result in one JSON-able dict, saved after each step."""

    def __init__(self, args: argparse.Namespace, dev: Device) -> None:
        self.args, self.dev = args, dev
        self.runs = Runs(args.warmup, args.reps)
        self.providers = load_providers(args.providers, dev.kind)
        self.out = Path(args.out)
        self.data: dict[str, Any] = {
            "env": env_info(dev),
            "args": {k: v for k, v in vars(args).items() if k != "worker_out"},
            "peak_raise": PEAK_RAISE,
            "floor": {},
            "main": [],
            "pertoken": [],
            "masked": [],
            "memory_vs_n": [],
            "cpu_memory": [],
        }
        for name, fn in self.providers.items():
            print(f"[provider] {name}: {fn if isinstance(fn, str) else 'ok'}", flush=True)

    def save(self) -> None:
        write_json(self.out / "kernel.json", self.data)

    def row(self, section: str, shape: Shape, provider: str, **fields: Any) -> dict[str, Any]:
        rec = {"shape": shape.name, "n": shape.n, "h": shape.h, "v": shape.v, "softcap": shape.softcap}
        rec.update(provider=provider, **fields)
        self.data[section].append(rec)
        return rec

    def each_provider(self, shape: Shape, run: Callable[[LossFn], dict[str, Any]]):
        """``(name, status, fields)`` per provider, with n/a, OOM and errors as the status."""
        for name, fn in self.providers.items():
            reason = unsupported(name, fn, shape)
            if reason:
                yield name, reason, {}
                continue
            fields, err = guarded(self.dev, lambda fn=fn: run(fn))
            yield name, err or "ok", fields or {}

    def log(self, section: str, shape: Shape, label: str, name: str, status: str, fields: dict[str, Any]) -> None:
        ms = fields.get("fwdbwd_ms")
        extra = fields.get("extra_bytes")
        print(
            f"[{section}] {shape.name:<12} {label:<8} {name:<13} {status if status != 'ok' else ''}"
            f"{'' if ms is None else f'{ms:8.2f} ms'}{'' if extra is None else f'  +{fmt_gb(extra)} GiB'}",
            flush=True,
        )

    # ---- sections

    def main(self, shapes: list[Shape]) -> None:
        for shape in shapes:
            floor_ops = make_floor(self.dev, shape)
            floor, err = guarded(self.dev, lambda ops=floor_ops: floor_times(self.dev, ops, self.runs))
            self.data["floor"][shape.name] = floor or {"status": err}
            print(f"[floor] {shape.name}: {floor or err}", flush=True)
            for dist in self.args.dists:
                x, w, y = make_inputs(shape, dist, self.dev, self.args.seed)
                count = (y != IGNORE).sum().float()
                ref = reference(x, w, y, torch.full_like(y, 1.0, dtype=torch.float32) / count, shape.softcap)

                def run(fn: LossFn, x=x, w=w, y=y, ref=ref, dist=dist, shape=shape, ops=floor_ops) -> dict[str, Any]:
                    rec = measure_fwd_bwd(
                        self.dev, fn, x, w, y, "mean", shape.softcap, self.runs, ref=ref, floor=ops.all
                    )
                    if dist == "flat":
                        gemm = ops.products[0]
                        rec.update(measure_forward(self.dev, fn, x, w, y, shape.softcap, self.runs, gemm=gemm))
                    return rec

                for name, status, fields in self.each_provider(shape, run):
                    self.row("main", shape, name, dist=dist, status=status, **fields)
                    self.log("main", shape, dist, name, status, fields)
                del x, w, y, ref, run
                self.dev.free()
                self.save()
            del floor_ops
            self.dev.free()

    def pertoken(self, shapes: list[Shape]) -> None:
        for shape in shapes:
            floor_ops = make_floor(self.dev, shape)
            x, w, y = make_inputs(shape, "flat", self.dev, self.args.seed)
            gen = torch.Generator(device=self.dev.torch_device).manual_seed(self.args.seed + 1)
            grad_out = torch.randn(shape.n, device=self.dev.torch_device, generator=gen)
            ref = reference(x, w, y, grad_out, shape.softcap)

            def run(fn: LossFn, x=x, w=w, y=y, g=grad_out, ref=ref, shape=shape, floor=floor_ops.all) -> dict[str, Any]:
                return measure_fwd_bwd(
                    self.dev, fn, x, w, y, "none", shape.softcap, self.runs, grad_out=g, ref=ref, floor=floor
                )

            for name, status, fields in self.each_provider(shape, run):
                self.row("pertoken", shape, name, dist="flat", status=status, **fields)
                self.log("pertoken", shape, "none", name, status, fields)
            del x, w, y, ref, grad_out, floor_ops, run
            self.dev.free()
            self.save()

    def masked(self, shapes: list[Shape]) -> None:
        for shape in shapes:
            inputs = {m: make_inputs(shape, "flat", self.dev, self.args.seed, prompt_mask=m) for m in (False, True)}

            def run(fn: LossFn, inputs=inputs, shape=shape) -> dict[str, Any]:
                recs = {
                    m: measure_fwd_bwd(self.dev, fn, *xwy, "mean", shape.softcap, self.runs)
                    for m, xwy in inputs.items()
                }
                return {
                    "unmasked_ms": recs[False]["fwdbwd_ms"],
                    "fwdbwd_ms": recs[True]["fwdbwd_ms"],
                    "extra_bytes": recs[True].get("extra_bytes"),
                    "valid_fraction": float((inputs[True][2] != IGNORE).float().mean()),
                }

            for name, status, fields in self.each_provider(shape, run):
                self.row("masked", shape, name, dist="flat", status=status, **fields)
                self.log("masked", shape, "50%", name, status, fields)
            del inputs
            self.dev.free()
            self.save()

    def memory_vs_n(self, base: Shape, ns: list[int]) -> None:
        runs = Runs(1, 1)
        failed: dict[str, str] = {}
        for n in ns:
            shape = Shape(f"{base.name}@{n}", n, base.h, base.v, base.softcap)
            x, w, y = make_inputs(shape, "flat", self.dev, self.args.seed)

            def run(fn: LossFn, x=x, w=w, y=y, shape=shape) -> dict[str, Any]:
                return measure_fwd_bwd(self.dev, fn, x, w, y, "mean", shape.softcap, runs)

            for name, status, fields in self.each_provider(shape, run):
                if name in failed:  # a larger N cannot fit where a smaller one did not
                    status, fields = f"{failed[name]} (skipped)", {}
                elif status == "OOM":
                    failed[name] = status
                self.row("memory_vs_n", shape, name, dist="flat", status=status, **fields)
                self.log("memory", shape, "flat", name, status, fields)
            del x, w, y
            self.dev.free()
            self.save()

    def worker_argv(self, provider: str, shape: Shape) -> list[str]:
        argv = [str(Path(__file__).resolve()), "--device", "cpu", "--worker-cpu-mem", provider, "--shapes", shape.name]
        argv += ["--reps", str(self.args.reps), "--seed", str(self.args.seed)]
        return argv + (["--threads", str(self.args.threads)] if self.args.threads else [])

    def cpu_memory(self, shape: Shape) -> None:
        for name, fn in self.providers.items():
            reason = unsupported(name, fn, shape)
            res = {"status": reason} if reason else run_worker(self.worker_argv(name, shape))
            if "error" in res:
                res = {"status": res["error"]}
            self.row("cpu_memory", shape, name, dist="flat", **res)
            print(f"[cpu-memory] {shape.name} {name}: {res}", flush=True)
            self.save()


def cpu_memory_worker(provider: str, shape: Shape, seed: int, reps: int) -> dict[str, Any]:
    """In a fresh process: warm up at a tiny size, then peak RSS delta and time of fwd+bwd at ``shape``."""
    dev = Device("cpu")
    fn = load_providers([provider], "cpu")[provider]
    if isinstance(fn, str):
        return {"status": fn}
    tiny = Shape("tiny", 64, shape.h, 256, shape.softcap)
    measure_fwd_bwd(dev, fn, *make_inputs(tiny, "flat", dev, seed), "mean", shape.softcap, Runs(1, 1))
    x, w, y = make_inputs(shape, "flat", dev, seed)

    def step():
        loss = fn(x, w, y, "mean", shape.softcap)
        return torch.autograd.grad(loss, (x, w))

    grads, extra, method = cpu_peak_rss_delta(step)
    grad_bytes = sum(g.nbytes for g in grads)
    del grads
    times = dev.time_ms(step, 0, max(1, reps))
    return {
        "status": "ok",
        "rss_extra_bytes": extra,
        "grad_bytes": grad_bytes,
        "method": method,
        "fwdbwd_ms": median(times),
        "fwdbwd_times": times,
    }


# ---------------------------------------------------------------- tables and plots


def _index(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["shape"], r.get("dist", "flat"), r["provider"]): r for r in rows}


def _ok(rec: dict[str, Any] | None, key: str) -> float | None:
    return rec.get(key) if rec and rec.get("status") == "ok" else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _yardstick(rec: dict[str, Any] | None, key: str, standalone: dict[str, float | None]) -> float | None:
    """What a row's time is divided by: the yardstick timed in turns with it (``paired_floor_ms`` or
    ``paired_gemm_ms``), else the shape's own timing (older runs)."""
    if rec is None:
        return None
    return rec.get(key) or standalone.get(rec["shape"])


def _paired(rec: dict[str, Any] | None, name: str, yardstick: str, standalone: dict[str, float | None]) -> float | None:
    """``name``'s time ÷ its yardstick's (``fwdbwd`` ÷ ``paired_floor``, ``fwd`` ÷ ``paired_gemm``, their ``_isolated``
    forms): the median over rounds of each round's ratio, the two having run back to back in that round. A GPU at its
    power limit moves its clocks from one round to the next (an H100's floor read 20.8-25.1 ms within one row), and
    the ratio of the two medians would take them from different rounds. Rows without per-round times (older runs, or
    a yardstick timed on its own) take the ratio of the medians."""
    if rec is None or rec.get("status") != "ok":
        return None
    times, yard = rec.get(f"{name}_times"), rec.get(f"{yardstick}_times")
    if times and yard and len(times) == len(yard):
        return median([t / y for t, y in zip(times, yard, strict=True)])
    return ratio(rec.get(f"{name}_ms"), _yardstick(rec, f"{yardstick}_ms", standalone))


def _cell(rec: dict[str, Any], floors: dict[str, float | None]) -> str:
    if rec.get("status") != "ok":
        return str(rec.get("status"))
    gb = f" · {fmt_gb(rec['extra_bytes'])} GB" if rec.get("extra_bytes") is not None else ""
    return f"{fmt_ratio(_paired(rec, 'fwdbwd', 'paired_floor', floors))}{gb}"


def render_tables(data: dict[str, Any]) -> str:
    floors = {k: v.get("floor_ms") for k, v in data["floor"].items()}
    gemms = {k: v.get("gemm1_ms") for k, v in data["floor"].items()}
    providers = list(dict.fromkeys(r["provider"] for r in data["main"] + data["pertoken"] + data["cpu_memory"]))
    parts = [f"# Kernel benchmark: {data['env']['device_name']} ({data['env']['device']})", ""]
    parts.append("Versions: " + ", ".join(f"{k} {v}" for k, v in data["env"]["packages"].items() if v))
    parts.append(f"`ours` = hf_flce. Peaked inputs raise each target logit by {data.get('peak_raise')}.")
    parts.append("`ours ÷ it` below 1 means ours is faster. GB = GiB above the inputs at the peak of one fwd+bwd.")

    if data["main"]:
        idx = _index(data["main"])
        keys = list(dict.fromkeys((r["shape"], r["dist"]) for r in data["main"]))
        parts += ["", "## fwd+bwd ÷ 3-GEMM floor · extra memory (grads included)", ""]
        parts.append(
            "Each provider's calls are timed in turns with the floor's three cuBLAS GEMMs run back to back: each "
            "call is divided by the floor run just before it, and the table gives the median of those ratios (a GPU "
            "at its power limit changes its clocks within a fraction of a second). `floor ms` and `1 GEMM ms`: the "
            "shape's GEMMs timed on their own, for scale. "
            + (
                "Times are of calls queued behind that yardstick, as inside a model (host time before a host read "
                "hidden); the Details give each call isolated on an idle GPU too."
                if any(r.get("fwdbwd_isolated_ms") for r in data["main"])
                else "Times are of isolated calls on an idle GPU."
            )
        )
        parts.append("")
        rows = []
        for shape, dist in keys:
            fl = data["floor"].get(shape, {})
            cells = [_cell(idx[(shape, dist, p)], floors) if (shape, dist, p) in idx else "" for p in providers]
            rows.append([shape, dist, fmt_ms(fl.get("floor_ms")), fmt_ms(fl.get("gemm1_ms")), *cells])
        parts.append(markdown_table(["shape", "dist", "floor ms", "1 GEMM ms", *providers], rows))

        parts += ["", "## Details", ""]
        rows = []
        for r in data["main"]:
            ours = idx.get((r["shape"], r["dist"], "ours"))
            ms = _ok(r, "fwdbwd_ms")
            rows.append(
                [
                    r["shape"],
                    r["dist"],
                    r["provider"],
                    fmt_ms(ms),
                    fmt_ratio(_paired(r, "fwdbwd", "paired_floor", floors)),
                    fmt_ratio(_paired(r, "fwdbwd_isolated", "paired_floor_isolated", {})),
                    fmt_ratio(ratio(_ok(ours, "fwdbwd_ms"), ms)),
                    fmt_ms(_ok(r, "fwd_ms")),
                    fmt_ratio(_paired(r, "fwd", "paired_gemm", gemms)),
                    fmt_ratio(_paired(r, "fwd_isolated", "paired_gemm_isolated", {})),
                    fmt_gb(_ok(r, "extra_bytes")),
                    fmt_gb(_minus(_ok(r, "extra_bytes"), _ok(r, "grad_bytes"))),
                    fmt_err(_ok(r, "dx_err")),
                    fmt_err(_ok(r, "dw_err")),
                    fmt_err(_ok(r, "loss_err")),
                    r["status"],
                ]
            )
        headers = ["shape", "dist", "provider", "fwd+bwd ms", "÷ floor", "isolated ÷ floor", "ours ÷ it"]
        headers += ["fwd ms (no grad)", "÷ 1 GEMM", "isolated ÷ 1 GEMM"]
        headers += ["extra GB", "extra − grads GB", "dX err", "dW err", "loss err", "status"]
        parts.append(markdown_table(headers, rows))

    if data["pertoken"]:
        idx = _index(data["pertoken"])
        parts += ["", '## Per-token path (reduction="none", random upstream gradient)', ""]
        if data["env"].get("device") == "cuda":
            parts += [
                "At 1 GiB (the op's default budget) hf_flce keeps the logits of mistral-7b and of the `-3k` shapes "
                "whole from forward to backward; at llama3-8b and qwen3-0.6b it keeps what fits of them and "
                "recomputes the rest.",
                "",
            ]
        rows = []
        for r in data["pertoken"]:
            ms = _ok(r, "fwdbwd_ms")
            ours = _ok(idx.get((r["shape"], "flat", "ours")), "fwdbwd_ms")
            rows.append(
                [
                    r["shape"],
                    r["provider"],
                    fmt_ms(ms),
                    fmt_ratio(_paired(r, "fwdbwd", "paired_floor", floors)),
                    fmt_ratio(_paired(r, "fwdbwd_isolated", "paired_floor_isolated", {})),
                    fmt_ratio(ratio(ours, ms)),
                ]
                + [fmt_gb(_ok(r, "extra_bytes")), fmt_err(_ok(r, "dx_err")), fmt_err(_ok(r, "dw_err")), r["status"]]
            )
        headers = ["shape", "provider", "fwd+bwd ms", "÷ floor", "isolated ÷ floor", "ours ÷ it", "extra GB"]
        headers += ["dX err", "dW err", "status"]
        parts.append(markdown_table(headers, rows))

    if data["masked"]:
        parts += ["", "## 50% prompt-masked batch vs unmasked (fwd+bwd)", ""]
        rows = [
            [r["shape"], r["provider"], fmt_ms(_ok(r, "unmasked_ms")), fmt_ms(_ok(r, "fwdbwd_ms"))]
            + [fmt_ratio(ratio(_ok(r, "fwdbwd_ms"), _ok(r, "unmasked_ms"))), r["status"]]
            for r in data["masked"]
        ]
        parts.append(
            markdown_table(["shape", "provider", "unmasked ms", "masked ms", "masked ÷ unmasked", "status"], rows)
        )

    if data["memory_vs_n"]:
        ns = list(dict.fromkeys(r["n"] for r in data["memory_vs_n"]))
        by = {(r["provider"], r["n"]): r for r in data["memory_vs_n"]}
        parts += ["", "## Extra memory (GB) and time (ms, one call) vs N", ""]
        rows = []
        for p in dict.fromkeys(r["provider"] for r in data["memory_vs_n"]):
            cells = []
            for n in ns:
                r = by.get((p, n), {})
                ok = r.get("status") == "ok"
                cells.append(
                    f"{fmt_gb(r.get('extra_bytes'))} ({fmt_ms(r.get('fwdbwd_ms'))})" if ok else r.get("status", "")
                )
            rows.append([p, *cells])
        parts.append(markdown_table(["provider", *(f"N={n}" for n in ns)], rows))

    if data["cpu_memory"]:
        parts += ["", "## CPU: peak RSS above the inputs for one fwd+bwd (fresh process per provider)", ""]
        rows = [
            [r["shape"], r["provider"], fmt_ms(_ok(r, "fwdbwd_ms")), fmt_gb(_ok(r, "rss_extra_bytes"))]
            + [fmt_gb(_ok(r, "grad_bytes")), r.get("method", ""), r["status"]]
            for r in data["cpu_memory"]
        ]
        parts.append(
            markdown_table(["shape", "provider", "fwd+bwd ms", "peak RSS Δ GB", "grads GB", "method", "status"], rows)
        )
    return "\n".join(parts) + "\n"


def render_plots(data: dict[str, Any], path: Path) -> None:
    floors = {k: v.get("floor_ms") for k, v in data["floor"].items()}
    has_mem = any(_ok(r, "extra_bytes") for r in data["main"])
    # the memory-vs-N section takes two panels (memory and time), the CPU's one
    panels = [bool(data["main"]), has_mem, bool(data["memory_vs_n"] or data["cpu_memory"]), bool(data["memory_vs_n"])]
    if not any(panels):  # e.g. only the pertoken or masked section: their tables carry it all
        return
    fig, axes = new_figure(sum(panels), width=12)
    if fig is None or not axes:
        return
    axes_iter = iter(axes)
    if data["main"]:
        keys = list(dict.fromkeys((r["shape"], r["dist"]) for r in data["main"]))
        idx = _index(data["main"])
        providers = list(dict.fromkeys(r["provider"] for r in data["main"]))

        def series(value: Callable[[dict[str, Any] | None, str], float | None]) -> dict[str, list[float | None]]:
            return {p: [value(idx.get((s, d, p)), s) for s, d in keys] for p in providers}

        groups = [f"{s}\n{d}" for s, d in keys]
        bar_groups(
            next(axes_iter),
            groups,
            series(lambda r, s: _paired(r, "fwdbwd", "paired_floor", floors)),
            "fwd+bwd ÷ 3-GEMM floor",
            "Time ratio to the floor (dashed: 1.0 and 1.33 = recompute)",
            hlines=(1.0, 4 / 3),
        )
        if has_mem:
            bar_groups(
                next(axes_iter),
                groups,
                series(lambda r, s: None if _ok(r, "extra_bytes") is None else _ok(r, "extra_bytes") / 2**30),
                "extra GiB (log)",
                "Peak memory above the inputs, gradients included",
                log=True,
            )
    if data["memory_vs_n"]:
        ns = sorted({r["n"] for r in data["memory_vs_n"]})
        by = {(r["provider"], r["n"]): r for r in data["memory_vs_n"]}
        provs = list(dict.fromkeys(r["provider"] for r in data["memory_vs_n"]))

        def per_n(key: str, scale: float) -> dict[str, list[float | None]]:
            return {
                p: [None if _ok(by.get((p, n)), key) is None else by[(p, n)][key] / scale for n in ns] for p in provs
            }

        missing = "(missing points: OOM)"
        line_series(
            next(axes_iter),
            ns,
            per_n("extra_bytes", 2**30),
            "N (tokens)",
            "extra GiB (log)",
            f"Extra memory vs N, gradients included {missing}",
            log=True,
        )
        line_series(
            next(axes_iter),
            ns,
            per_n("fwdbwd_ms", 1.0),
            "N (tokens)",
            "fwd+bwd ms (log)",
            f"Time of one fwd+bwd vs N {missing}",
            log=True,
        )
    elif data["cpu_memory"]:
        rows = data["cpu_memory"]
        vals = {
            r["provider"]: [None if _ok(r, "rss_extra_bytes") is None else r["rss_extra_bytes"] / 2**30] for r in rows
        }
        bar_groups(next(axes_iter), [rows[0]["shape"]], vals, "peak RSS Δ GiB", "CPU peak RSS above the inputs")
    save_figure(fig, path)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__, "kernel")
    p.add_argument("--shapes", help="comma list of shape names or NxHxV[xSOFTCAP] (default: the device's set)")
    p.add_argument("--providers", help=f"comma list from {list(PROVIDERS)}")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list from {SECTIONS}")
    p.add_argument("--dists", default="flat,peaked")
    p.add_argument("--focus-shapes", help="shapes of the pertoken and masked sections")
    p.add_argument(
        "--pertoken-shapes",
        help="shapes of the pertoken section (default: the focus shapes, whose logits the per-token path recomputes, "
        "and on a GPU shapes whose logits it keeps whole)",
    )
    p.add_argument("--memory-base", help="shape whose H and V the memory section uses (CPU: the whole shape)")
    p.add_argument("--memory-n", help="comma list of token counts for the memory section")
    p.add_argument("--reps", type=int, help="timed calls")
    p.add_argument("--worker-cpu-mem", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    setup_run(args)
    defaults = DEFAULTS[args.device]
    split = lambda s: [t for t in s.split(",") if t]  # noqa: E731
    args.shapes = split(args.shapes) if args.shapes else list(defaults.shapes)
    args.providers = split(args.providers) if args.providers else list(defaults.providers)
    unknown = [name for name in args.providers if name not in PROVIDERS]
    if unknown:
        p.error(f"unknown providers {unknown}; choose from {list(PROVIDERS)}")
    args.sections = split(args.sections)
    args.dists = split(args.dists)
    args.focus_shapes = split(args.focus_shapes) if args.focus_shapes else list(defaults.focus)
    args.pertoken_shapes = (
        split(args.pertoken_shapes) if args.pertoken_shapes else [*args.focus_shapes, *defaults.kept_whole]
    )
    args.memory_base = args.memory_base or defaults.memory_base
    args.memory_n = [int(n) for n in split(args.memory_n)] if args.memory_n else list(defaults.memory_n)
    if args.quick:
        args.memory_n = args.memory_n[:2]
    args.warmup = args.warmup if args.warmup is not None else 1 if args.quick else defaults.warmup
    args.reps = (
        args.reps if args.reps is not None else (1 if args.device == "cpu" else 2) if args.quick else defaults.reps
    )
    return args


def finish(data: dict[str, Any], out: Path) -> None:
    finish_report(data, out, "kernel", render_tables, render_plots)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        finish(load_json(args.from_json), Path(args.out))
        return 0
    if args.worker_cpu_mem:
        res = cpu_memory_worker(args.worker_cpu_mem, parse_shape(args.shapes[0]), args.seed, args.reps)
        write_json(Path(args.worker_out), res)
        return 0

    dev = Device(args.device)
    torch.manual_seed(args.seed)
    bench = Bench(args, dev)
    print(f"[env] {json.dumps(bench.data['env'])}", flush=True)
    shapes = [parse_shape(s) for s in args.shapes]
    focus = [parse_shape(s) for s in args.focus_shapes]
    if "main" in args.sections:
        bench.main(shapes)
    if "pertoken" in args.sections:
        bench.pertoken([parse_shape(s) for s in args.pertoken_shapes])
    if "masked" in args.sections:
        bench.masked(focus)
    if "memory" in args.sections:
        if dev.accelerator:
            bench.memory_vs_n(parse_shape(args.memory_base), args.memory_n)
        else:
            bench.cpu_memory(parse_shape(args.memory_base))
    bench.save()
    finish(bench.data, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
