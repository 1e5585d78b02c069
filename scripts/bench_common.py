"""Helpers shared by the benchmark scripts: device timing and memory, guarded calls, tables, JSON and plots."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

GiB = 1 << 30
PEER_PACKAGES = ("torch", "triton", "transformers", "liger-kernel", "cut-cross-entropy", "trl", "datasets")


class Device:
    """Timing and memory statistics for one device type.

    ``cuda`` and ``npu`` time with device events and read the caching allocator's peak; ``cpu`` times with the wall
    clock and has no allocator statistics (see :func:`cpu_peak_rss_delta` for its memory).
    """

    def __init__(self, kind: str) -> None:
        if kind == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)
        self.kind = kind
        self.torch_device = torch.device(kind)
        self.mod = None if kind == "cpu" else getattr(torch, kind)

    @property
    def accelerator(self) -> bool:
        return self.mod is not None

    def name(self) -> str:
        if self.mod is not None:
            return str(self.mod.get_device_name())
        return platform.processor() or platform.machine()

    def sync(self) -> None:
        if self.mod is not None:
            self.mod.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.mod is not None:
            self.mod.empty_cache()

    def allocated(self) -> int:
        return int(self.mod.memory_allocated()) if self.mod is not None else 0

    def reset_peak(self) -> None:
        if self.mod is not None:
            self.mod.reset_peak_memory_stats()

    def peak(self) -> int:
        return int(self.mod.max_memory_allocated()) if self.mod is not None else 0

    def _time_one(self, fn: Callable[[], Any]) -> float:
        """One call of ``fn``, waited for; milliseconds (device events on an accelerator, the wall clock on CPU)."""
        if self.mod is None:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    def time_ms(self, fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
        """Run ``fn`` ``warmup`` times, then time ``reps`` calls one by one (each waited for); milliseconds."""
        return self.time_rounds([fn], warmup, reps)[0]

    def time_rounds(
        self, fns: Sequence[Callable[[], Any]], warmup: int, reps: int, settle_s: float = 0.0
    ) -> list[list[float]]:
        """``reps`` rounds of one timed call of each of ``fns`` in turn, after ``warmup`` untimed rounds and then more
        until ``settle_s`` seconds have passed; the milliseconds per function. A GPU at its power limit runs below its
        top clock, and the clock it settles at depends on the load of the last second or so (an H200 at 700 W: 1980
        MHz idle, ~1400-1600 under these GEMMs). Timed in turns after settling, the calls meet the same clocks; a
        yardstick timed apart from what it measures can be off by 10% either way."""
        self._settle(fns, warmup, settle_s)
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(reps):
            for fn, out in zip(fns, times, strict=True):
                out.append(self._time_one(fn))
        return times

    def _settle(self, fns: Sequence[Callable[[], Any]], warmup: int, settle_s: float) -> None:
        start = time.perf_counter()
        done = 0
        while done < warmup or time.perf_counter() - start < settle_s:
            for fn in fns:
                fn()
            self.sync()
            done += 1

    def time_queued(
        self, yardstick: Callable[[], Any], fn: Callable[[], Any], warmup: int, reps: int, settle_s: float
    ) -> dict[str, list[float]]:
        """``fn`` against ``yardstick`` in ``reps`` rounds after settling (``time_rounds``), milliseconds of each
        timed two ways: ``queued`` and ``yardstick`` (one after the other behind an untimed call of the yardstick),
        ``isolated`` and ``yardstick_isolated`` (each alone on an idle GPU, as ``time_rounds`` times them).

        Queued is how an op runs inside a model: the host enqueues it while the GPU is still busy with earlier work,
        so host time before the op's first host synchronisation is hidden and only what follows such a read shows;
        both calls start on a GPU already under load (clocks at its power limit). Isolated, the GPU waits for every
        host step before the first kernel, and starts from the clocks of a short idle spell."""
        self._settle([yardstick, fn], warmup, settle_s)
        times: dict[str, list[float]] = {"yardstick": [], "queued": [], "yardstick_isolated": [], "isolated": []}
        for _ in range(reps):
            times["yardstick_isolated"].append(self._time_one(yardstick))
            times["isolated"].append(self._time_one(fn))
            marks = [self.mod.Event(enable_timing=True) for _ in range(3)]
            yardstick()
            marks[0].record()
            yardstick()
            marks[1].record()
            fn()
            marks[2].record()
            marks[2].synchronize()
            times["yardstick"].append(float(marks[0].elapsed_time(marks[1])))
            times["queued"].append(float(marks[1].elapsed_time(marks[2])))
        return times

    def extra_memory(self, fn: Callable[[], Any]) -> tuple[Any, int]:
        """``fn()`` and its peak allocation above what was allocated before it (inputs excluded, outputs included)."""
        self.free()
        self.sync()
        base = self.allocated()
        self.reset_peak()
        out = fn()
        self.sync()
        return out, self.peak() - base


def with_triton_backend(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``fn`` with every hf_flce call inside it on ``TritonTileOps(**options)``. The call's plan keeps that backend,
    so the backward that follows uses it too."""
    from unittest import mock

    import hf_flce.api
    from hf_flce.backends.triton_tiles import TritonTileOps

    backend = TritonTileOps(**options)

    def call(*args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(hf_flce.api, "resolve_backend", lambda name, device: backend):
            return fn(*args, **kwargs)

    return call


def with_tile_path(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on cuBLAS float32 logits and the tile passes, the path GPUs before Hopper take (what
    ``HF_FLCE_GEMM_EPILOGUE=0`` does for a whole process): the "ours_tile_path" providers of the kernel benchmark."""
    return with_triton_backend(fn, gemm_epilogue=False)


def with_env(fn: Callable[..., Any], **env: str) -> Callable[..., Any]:
    """``fn`` with the environment variables ``env`` set during each call: hf_flce reads its switches when a call
    plans its work, and the backward that follows keeps that plan. ``with_env(fn, HF_FLCE_DW_FP32_SUM="1")`` is the
    benchmarks' "ours_fp32_sum" provider."""
    from unittest import mock

    def call(*args: Any, **kwargs: Any) -> Any:
        with mock.patch.dict(os.environ, env):
            return fn(*args, **kwargs)

    return call


def pick_device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def describe_error(exc: BaseException) -> str:
    """``"OOM"`` for out-of-memory errors, else a one-line ``error: Type: message``."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return "OOM"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"error: {type(exc).__name__}: {first[:200]}"


def guarded(dev: Device, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, reason)`` when it raises; memory is released either way on failure."""
    reason = None
    try:
        return fn(), None
    except Exception as exc:  # a failing provider must never stop the run
        reason = describe_error(exc)
    dev.free()  # outside the except block, so the traceback's frames (and their tensors) are gone
    return None, reason


def try_import(module: str) -> tuple[Any, str | None]:
    """The module, or ``None`` and ``"n/a: <import error>"``."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:
        return None, f"n/a: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc) else ''}"


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PEER_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def env_info(dev: Device) -> dict[str, Any]:
    return {
        "device": dev.kind,
        "device_name": dev.name(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "cuda": torch.version.cuda,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu_limits": gpu_limits() if dev.kind == "cuda" else {},
    }


def gpu_limits() -> dict[str, str]:
    """The GPU's power limit and clocks from ``nvidia-smi`` (empty where it is missing): under load these GPUs run
    at their power limit, below their top clock, so timings depend on both."""
    fields = ("power.limit", "clocks.max.sm", "clocks.sm", "temperature.gpu")
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(fields, (v.strip() for v in line.split(",")), strict=False))


def base_parser(doc: str | None, stem: str) -> argparse.ArgumentParser:
    """The options both benchmarks share; ``stem`` names the output files (``stem.json``, ``.md``, ``.png``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu", "npu"), default=None, help="default: cuda if present, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--warmup", type=int, help="untimed calls first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default="outputs/bench", help=f"folder for {stem}.json, {stem}.md and {stem}.png")
    p.add_argument("--from-json", help=f"only redraw the tables and plots from {stem}.json (comma list: merged)")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p


def setup_run(args: argparse.Namespace) -> None:
    args.device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)


def finish_report(
    data: dict[str, Any], out: Path, stem: str, tables: Callable[[dict], str], plots: Callable[[dict, Path], None]
) -> None:
    """Write ``stem.md`` and ``stem.png`` from ``data`` under ``out`` and print the tables."""
    text = tables(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    plots(data, out / f"{stem}.png")
    print(text)


def load_json(paths: str) -> dict[str, Any]:
    """One saved result file, or several (comma-separated, e.g. a run split under a time limit) merged:
    lists are concatenated, dicts updated, anything else taken from the first file."""
    merged: dict[str, Any] = {}
    for path in paths.split(","):
        for key, value in json.loads(Path(path).read_text()).items():
            if key not in merged:
                merged[key] = value
            elif isinstance(value, list):
                merged[key] = merged[key] + value
            elif isinstance(value, dict) and key != "env":
                merged[key] = {**merged[key], **value}
    return merged


# ---------------------------------------------------------------- CPU memory


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_peak_rss_delta(fn: Callable[[], Any]) -> tuple[Any, int, str]:
    """``fn()``, its peak resident memory above the resident memory before it, and how that was read.

    Linux: the peak (``VmHWM``) is reset by writing 5 to ``/proc/self/clear_refs`` and read back afterwards. Elsewhere
    the process's lifetime peak (``ru_maxrss``) is used, which is only meaningful in a fresh process.
    """
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss"
    base = _status_bytes("VmRSS") if method.startswith("VmHWM") else None
    if base is None:
        method = "ru_maxrss"
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = fn()
    peak = _status_bytes("VmHWM") if method.startswith("VmHWM") else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out, max(0, peak - base), method


# ---------------------------------------------------------------- subprocess workers


def run_worker(argv: Sequence[str], timeout: float | None = None, stream: bool = False) -> dict[str, Any]:
    """Run ``python argv... --worker-out FILE`` in a fresh process and return the JSON it wrote there.

    ``stream`` lets the worker print straight to this process's output (live logs) instead of capturing it. A crash,
    a timeout or a missing file becomes ``{"error": ...}`` (with the tail of stderr when captured).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "result.json"
        cmd = [sys.executable, *argv, "--worker-out", str(out_file)]
        sys.stdout.flush()
        try:
            proc = subprocess.run(cmd, capture_output=not stream, text=True, timeout=timeout, env=os.environ.copy())
        except subprocess.TimeoutExpired:
            return {"error": f"error: worker timed out after {timeout} s"}
        if out_file.exists():
            return json.loads(out_file.read_text())
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        return {"error": f"error: worker exit {proc.returncode}: {tail[:400] or 'see the log above'}"}


# ---------------------------------------------------------------- formatting


def fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def fmt_gb(value: float | None) -> str:
    return "—" if value is None else f"{value / GiB:.2f}"


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def fmt_err(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON, atomically (a run cut off by a time limit leaves the last complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


# ---------------------------------------------------------------- plots


def new_figure(n_panels: int, width: float = 7.0, height: float = 4.2):
    """A figure of ``n_panels`` stacked axes, or ``(None, [])`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print(f"[plot] matplotlib unavailable, no PNG: {exc}")
        return None, []
    fig, axes = plt.subplots(n_panels, 1, figsize=(width, height * n_panels), squeeze=False)
    return fig, list(axes[:, 0])


def bar_groups(
    ax,
    groups: Sequence[str],
    series: dict[str, Sequence[float | None]],
    ylabel: str,
    title: str,
    hlines: Sequence[float] = (),
    log: bool = False,
) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series; missing values leave a gap."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        if not ys:  # n/a, OOM or failed everywhere: no bar, no legend entry, the colour slot kept
            continue
        ax.bar(xs, ys, width=width, label=label, color=f"C{i % 10}")
    for y in hlines:
        ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log and any(v and v > 0 for values in series.values() for v in values):
        ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=4)


def line_series(
    ax,
    xs: Sequence[float],
    series: dict[str, Sequence[float | None]],
    xlabel: str,
    ylabel: str,
    title: str,
    log: bool = False,
) -> None:
    """One line per series over ``xs``; missing points (OOM, errors) are left out. ``log``: a logarithmic y axis."""
    for i, (label, values) in enumerate(series.items()):
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=f"C{i % 10}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if any(x > 0 for x in xs):
        ax.set_xscale("log", base=2)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=3)


def save_figure(fig, path: Path) -> None:
    if fig is None:
        return
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"[plot] wrote {path}")
