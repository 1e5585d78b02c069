"""GPU reliability checks for hf_flce (issue #9). On one H100/H200: python3 scripts/reliability_gpu.py --out DIR

Sections; each is guarded, so one that fails records its traceback and the others still run:
  assert       a target outside [0, V) fails with a readable message on CUDA: a ValueError from the host read that
               compaction makes anyway, or, where the op may not sync (graph capture), a device-side assert (in child
               processes: that assert poisons the CUDA context)
  determinism  loss and gradients bitwise identical over runs, by default and with use_deterministic_algorithms(True)
  sanitizer    the Triton kernels at odd shapes under compute-sanitizer memcheck and racecheck, in the background
  training     a tiny Llama patched with apply_flce, 1000 steps over varying batch shapes: finite loss, flat memory,
               a bounded number of compiled Triton variants, steady tokens/s

Writes reliability.json, reliability.md, training.png and sanitizer.log under --out and exits 1 if a check fails.
--device cpu is a smoke run of the script itself: the CUDA-only parts are skipped with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import math
import os
import re
import shutil
import signal
import site
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

# cuBLAS reads this when CUDA starts, and use_deterministic_algorithms(True) requires it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
sys.path[:0] = [str(SCRIPT.parent), str(ROOT)]

from bench_common import Device, env_info, markdown_table, write_json  # noqa: E402

SECTIONS = ("assert", "determinism", "sanitizer", "training")
CHILD_OK = "@@SANITIZE_CHILD_OK"
MIB = float(1 << 20)


# ------------------------------------------------------------------------------------------------------------- results


class Report:
    def __init__(self, meta: dict) -> None:
        self.meta = meta
        self.sections: dict[str, dict] = {}
        self.checks: list[dict] = []

    def check(self, section: str, name: str, ok: bool, value=None, limit=None, note: str | None = None) -> None:
        status = "pass" if ok else "fail"
        self.checks.append(dict(section=section, name=name, status=status, value=value, limit=limit, note=note))

    def skip(self, section: str, name: str, reason: str) -> None:
        self.checks.append(dict(section=section, name=name, status="skip", value=None, limit=None, note=reason))

    def failed(self) -> bool:
        errors = any(s["status"] == "error" for s in self.sections.values())
        return errors or any(c["status"] == "fail" for c in self.checks)

    def write(self, out: Path) -> None:
        report = dict(meta=self.meta, ok=not self.failed(), checks=self.checks, sections=self.sections)
        write_json(out / "reliability.json", report)
        (out / "reliability.md").write_text(markdown(self))


@contextlib.contextmanager
def guarded(report: Report, name: str):
    """Runs one section: an exception marks it as an error, with its traceback, and the script goes on."""
    sec = report.sections.setdefault(name, {})
    sec["status"] = "running"
    start = time.perf_counter()
    try:
        yield sec
        sec["status"] = "done"
    except Exception as exc:
        sec.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        report.check(name, "section ran to completion", False, sec["error"])
        print(f"[{name}] ERROR\n{sec['traceback']}", flush=True)
    finally:
        sec["seconds"] = round(time.perf_counter() - start, 2)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def clip(text: str, tail: int, head: int = 0) -> str:
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n... [{len(text) - head - tail} characters cut] ...\n{text[-tail:]}"


def child_env(extra: dict | None = None, drop: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


def spawn(cmd: list[str], env: dict, stdout=subprocess.PIPE) -> subprocess.Popen:
    """Starts ``cmd`` in a process group of its own (a timeout kills all of it), stderr merged into stdout."""
    return subprocess.Popen(
        cmd, env=env, cwd=str(ROOT), stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def reap(proc: subprocess.Popen, timeout: float) -> tuple[str, bool]:
    """The process's output, and whether it ran past ``timeout`` seconds (its group is then killed)."""
    try:
        return proc.communicate(timeout=max(timeout, 1.0))[0] or "", False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] or "", True


def run_child(cmd: list[str], env: dict, timeout: float) -> dict:
    start = time.perf_counter()
    proc = spawn(cmd, env)
    output, timed_out = reap(proc, timeout)
    return dict(rc=proc.returncode, output=output, seconds=round(time.perf_counter() - start, 2), timed_out=timed_out)


# --------------------------------------------------------------------------------------------- 1. a bad target

ASSERT_CHILD = r"""
import ctypes, os, sys, traceback
import torch, hf_flce

torch.manual_seed(0)
hidden = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
weight = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
target = torch.randint(0, 1000, (64,), device="cuda")
target[3], target[7] = -100, int(sys.argv[1])
if len(sys.argv) > 2:  # the path without compaction (graph capture, compile): a device-side assert
    hf_flce.engine._can_compact = lambda device: False
torch.cuda.synchronize()
code = 3
try:
    loss = hf_flce.fused_linear_cross_entropy(hidden, weight, target)
    loss.backward()
    torch.cuda.synchronize()
    print("@@NO_ERROR loss", float(loss), flush=True)
except Exception as exc:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    print(f"@@RAISED {type(exc).__name__} at {frame.filename}:{frame.lineno} in {frame.name}", flush=True)
    print("@@EXC_BEGIN\n" + str(exc) + "\n@@EXC_END", flush=True)
    code = 17
# The device's assert text goes through C stdio, which os._exit does not flush; os._exit skips tearing down the
# poisoned CUDA context.
ctypes.CDLL(None).fflush(None)
os._exit(code)
"""

# A readable error names the range: engine.kept_rows's ValueError, or check_target_range's device-side assert.
READABLE = re.compile(r"outside \[0, V=\d+\)")


def section_assert(report: Report, sec: dict, args) -> None:
    import hf_flce

    target = torch.randint(0, 50, (8,))
    target[2] = 50
    try:
        hf_flce.fused_linear_cross_entropy(torch.randn(8, 16), torch.randn(50, 16), target)
        sec["cpu"] = "no error raised"
    except Exception as exc:
        sec["cpu"] = f"{type(exc).__name__}: {exc}"
    ok = sec["cpu"].startswith("ValueError:") and "outside [0, V=50)" in sec["cpu"]
    report.check("assert", "CPU: ValueError names the bad target", ok, sec["cpu"])
    if args.device != "cuda":
        report.skip("assert", "CUDA: the bad target is named", "no CUDA device: skipped")
        return

    env = child_env(drop=("CUDA_LAUNCH_BLOCKING", "TORCH_USE_CUDA_DSA", "PYTORCH_NO_CUDA_MEMORY_CACHING"))
    cases = {
        "target = V (1000)": ["1000"],
        "target = -1 (ignore_index is -100)": ["-1"],
        "target = V, no compaction (device-side assert)": ["1000", "no-compaction"],
    }
    procs = {name: spawn([sys.executable, "-c", ASSERT_CHILD, *argv], env) for name, argv in cases.items()}
    deadline = time.perf_counter() + args.assert_timeout
    sec["cases"] = {}
    for name, proc in procs.items():
        output, timed_out = reap(proc, deadline - time.perf_counter())
        exception = output.partition("@@EXC_BEGIN\n")[2].partition("\n@@EXC_END")[0]
        raised = re.search(r"^@@RAISED (.*)$", output, re.M)
        raised = raised[1] if raised else "nothing raised"
        # The message may come in the exception, in the device's assert output, or both.
        places = {"exception": exception, "device assert output": output.replace(exception, "")}
        where = " and ".join(place for place, text in places.items() if READABLE.search(text)) or "nowhere"
        first_line = next((s.strip() for s in output.splitlines() if READABLE.search(s) or "Assertion" in s), None)
        sec["cases"][name] = dict(
            exit_code=proc.returncode, timed_out=timed_out, raised=raised, output=clip(output, 4000)
        )
        ok = proc.returncode == 17 and not timed_out  # 17: the child caught an exception
        note = None if ok else clip(output, 600)
        check = f"{name}: error raised without CUDA_LAUNCH_BLOCKING"
        value = f"timed out after {args.assert_timeout:.0f} s" if timed_out else f"exit {proc.returncode}, {raised}"
        report.check("assert", check, ok, value, note=note)
        check = f"{name}: 'outside [0, V=...)' is readable"
        report.check("assert", check, where != "nowhere", f"message in {where}", note=first_line)


# --------------------------------------------------------------------- inputs and one fused call, for sections 2 and 3


def make_inputs(case: dict, n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    target = torch.randint(0, v, (n,), device=device, generator=gen)
    target[torch.rand(n, device=device, generator=gen) < case.get("ignore", 0.0)] = -100
    class_weight = torch.rand(v, device=device, generator=gen) + 0.5 if case.get("class_weight") else None
    upstream = [torch.randn(n, device=device, generator=gen) for _ in range(3)]
    bias = randn(v, scale=0.1) if case.get("bias") else None
    return dict(x=randn(n, h), w=randn(v, h, scale=2.0 / h**0.5), b=bias, y=target, cw=class_weight, g=upstream)


def flce_step(case: dict, inp: dict, backend: str, budget: int | None = None) -> dict[str, torch.Tensor]:
    """One forward and backward of the fused loss: the loss, the stats when asked for, and the gradients. The loss of
    reduction="none" and the differentiable stats are weighted by random upstream gradients before backward."""
    import hf_flce

    x, w = inp["x"].detach().requires_grad_(), inp["w"].detach().requires_grad_()
    b = None if inp["b"] is None else inp["b"].detach().requires_grad_()
    stats, reduction, g = case.get("stats", False), case.get("reduction", "mean"), inp["g"]
    options = dict(reduction=reduction, class_weight=inp["cw"], return_stats=stats, **case.get("options", {}))
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=case.get("autocast", False)):
        out = hf_flce.fused_linear_cross_entropy(x, w, inp["y"], b, backend=backend, memory_budget=budget, **options)
    loss, st = out if stats else (out, None)
    objective = loss if reduction == "mean" else (loss * g[0]).sum()
    if st is not None:
        objective = objective + (st.logprobs * g[1]).sum() + (st.entropy * g[2]).sum()
    objective.backward()
    result = dict(loss=loss.detach(), d_hidden=x.grad, d_weight=w.grad)
    if b is not None:
        result["d_bias"] = b.grad
    if st is not None:
        result.update(logprobs=st.logprobs.detach(), entropy=st.entropy.detach(), lse=st.lse)
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------- 2. bitwise determinism

# fmt: off
DET_CASES = (
    dict(name="mean"),
    dict(name="mean, 30% ignored", ignore=0.3),
    dict(name="mean, 30% ignored, multi-chunk", ignore=0.3, multi_chunk=True),
    dict(name="none + upstream grad", reduction="none"),
    dict(name="none + upstream grad, 30% ignored", reduction="none", ignore=0.3),
    dict(name="none + upstream grad, 30% ignored, multi-chunk", reduction="none", ignore=0.3, multi_chunk=True),
    dict(name="none + stats grads + smoothing/z-loss/softcap, multi-chunk", reduction="none", ignore=0.3,
         multi_chunk=True, stats=True, options=dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)),
    dict(name="mean, autocast bf16 over fp32 weight + bias, multi-chunk", ignore=0.3, multi_chunk=True,
         autocast=True, bias=True),
)
# fmt: on


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def section_determinism(report: Report, sec: dict, args) -> None:
    import hf_flce.engine as engine

    device = torch.device(args.device)
    n, h, v, small = (4097, 1024, 50257, 64 << 20) if device.type == "cuda" else (257, 64, 5003, 1 << 20)
    sec["shape"] = dict(N=n, H=h, V=v, small_budget_bytes=small, backend=args.backend)
    sec["cases"] = {}
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    for case in [c for c in DET_CASES if not args.det_cases or c["name"] in args.det_cases]:
        # bf16 throughout, or fp32 parameters under bf16 autocast
        dtype = torch.float32 if case.get("autocast") else torch.bfloat16
        inp = make_inputs(case, n, h, v, dtype, device, seed=0)
        budget = small if case.get("multi_chunk") else None
        info = sec["cases"][case["name"]] = dict(memory_budget=budget)
        for mode in ("default", "deterministic"):
            name = f"{case['name']} [{mode}]: bitwise identical over {args.det_runs} runs"
            torch.use_deterministic_algorithms(mode == "deterministic")
            try:
                results = []
                for _ in range(args.det_runs):
                    # counts the logits GEMMs: the chunks of forward and the recomputed chunks of backward
                    with mock.patch.object(engine, "compute_logits", wraps=engine.compute_logits) as gemms:
                        results.append(flce_step(case, inp, args.backend, budget))
                    sync(device)
                info["logit_gemms_per_run"] = gemms.call_count
                ref = results[0]
                differ = sorted({k for result in results[1:] for k in ref if not same_bits(ref[k], result[k])})
                finite = all(bool(torch.isfinite(t.float()).all()) for t in ref.values())
                info[mode] = dict(mismatched=differ, finite=finite)
                value = f"differs: {', '.join(differ)}" if differ else "identical"
                note = None if finite else "non-finite values"
                report.check("determinism", name, not differ and finite, value, note=note)
            except Exception as exc:
                info[mode] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
                report.check("determinism", name, False, info[mode]["error"][:300])
            finally:
                torch.use_deterministic_algorithms(was_deterministic)
        print(f"[determinism] {case['name']}: {json.dumps(info)}", flush=True)


# ------------------------------------------------------------------------ 3. compute-sanitizer over the Triton kernels

# fmt: off
SAN_CASES = (  # budget_rows: a memory budget of that many rows of logits, for several chunks
    dict(name="one token", n=1, h=64, v=32003),
    dict(name="prime V = 32003, ragged tail", n=37, h=64, v=32003, ignore=0.3),
    dict(name="V < block, N*V odd", n=33, h=48, v=1000),
    dict(name="multi-chunk + bias", n=61, h=64, v=4099, budget_rows=7, ignore=0.2, bias=True),
    dict(name="all tokens ignored", n=16, h=64, v=1000, ignore=1.0),
    dict(name="softcap + smoothing + z-loss + class weights + temperature", n=29, h=64, v=5003, ignore=0.2,
         class_weight=True, options=dict(softcap=20.0, label_smoothing=0.1, z_loss=1e-3, temperature=0.7)),
    dict(name="none + stats grads", n=29, h=64, v=5003, ignore=0.25, reduction="none", stats=True,
         options=dict(label_smoothing=0.05)),
    dict(name="none + stats grads, recomputed chunks", n=45, h=64, v=4099, ignore=0.2, reduction="none", stats=True,
         budget_rows=6, options=dict(softcap=30.0)),
    dict(name="many rows (1 warp per row)", n=2300, h=32, v=1031, ignore=0.1),
)
# fmt: on


def sanitize_child(args) -> int:
    """The sanitizer's target: each SAN_CASES case in bf16 and fp32 on the Triton backend, compared with the torch
    backend unless --child-no-reference (under the sanitizer: the plain run has compared them already)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU needs TRITON_INTERPRET=1
    failures = count = 0
    for case in SAN_CASES:
        # The Triton interpreter runs one program at a time: smaller, still odd, sizes on a CPU.
        n, v = (case["n"], case["v"]) if device.type == "cuda" else (min(case["n"], 200), min(case["v"], 8191))
        budget = case["budget_rows"] * v * 6 if "budget_rows" in case else None
        for dtype in (torch.bfloat16, torch.float32):
            count += 1
            label = f"{case['name']} [{str(dtype).removeprefix('torch.')}]"
            start = time.perf_counter()
            try:
                inp = make_inputs(case, n, case["h"], v, dtype, device, seed=len(case["name"]))
                got = {k: t.float() for k, t in flce_step(case, inp, "triton", budget).items()}
                sync(device)
                if args.child_no_reference:
                    print(f"@@CASE ran {label} in {time.perf_counter() - start:.2f} s", flush=True)
                    continue
                worst = 0.0
                for key, ref in flce_step(case, inp, "torch", budget).items():
                    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1e-3)
                    err = float((got[key] - ref.float()).abs().max()) if ref.numel() else 0.0
                    tol = (2e-2 if dtype == torch.bfloat16 and key.startswith("d_") else 1e-3) * scale
                    if not (err <= tol and bool(torch.isfinite(got[key]).all())):
                        raise AssertionError(f"{key}: max |triton - torch| = {err:.3g} > {tol:.3g}")
                    worst = max(worst, err / scale)
                if case.get("ignore", 0.0) >= 1.0 and float(got["loss"].abs().max()) != 0.0:
                    raise AssertionError("all targets ignored but the loss is not 0")
                seconds = time.perf_counter() - start
                print(f"@@CASE ok {label}: max relative difference to torch {worst:.2e} ({seconds:.2f} s)", flush=True)
            except Exception as exc:
                failures += 1
                print(f"@@CASE FAIL {label}: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
    if failures:
        print(f"@@SANITIZE_CHILD_FAIL {failures} of {count} cases", flush=True)
        return 1
    print(f"{CHILD_OK} {count} cases", flush=True)
    return 0


def find_compute_sanitizer() -> str | None:
    """From PATH, CUDA_HOME / CUDA_PATH, /usr/local/cuda*, /opt/nvidia or pip's nvidia packages."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *glob.glob("/usr/local/cuda*")]
    roots += glob.glob("/opt/nvidia/*")
    folders = [f"{root}/{sub}" for root in roots if root for sub in ("bin", "compute-sanitizer")]
    folders += [f"{packages}/nvidia/**" for packages in site.getsitepackages()]
    found = [shutil.which("compute-sanitizer")]
    found += [path for folder in folders for path in sorted(glob.glob(f"{folder}/compute-sanitizer", recursive=True))]
    return next((path for path in found if path and os.path.isfile(path) and os.access(path, os.X_OK)), None)


def sanitizer_start(report: Report, sec: dict, args, out: Path) -> list[dict]:
    """A plain run of the child, which checks its results and warms Triton's cache; then memcheck and racecheck
    started in the background."""
    cuda = args.device == "cuda"
    # Without the caching allocator, memcheck sees each buffer's own bounds.
    env = child_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if cuda else {"TRITON_INTERPRET": "1"})
    child = [sys.executable, str(SCRIPT), "--sanitize-child"]
    plain_run = sec["plain_run"] = run_child(child, env, args.sanitizer_timeout)
    ok = plain_run["rc"] == 0 and CHILD_OK in plain_run["output"]
    name = f"child without sanitizer ({'CUDA' if cuda else 'CPU, Triton interpreter'}): Triton matches torch backend"
    note = None if ok else clip(plain_run["output"], 600)
    report.check("sanitizer", name, ok, f"exit {plain_run['rc']} in {plain_run['seconds']} s", note=note)
    plain_run["output"] = clip(plain_run["output"], 5000)
    name = "compute-sanitizer memcheck / racecheck"
    if not cuda:
        report.skip("sanitizer", name, "no CUDA device: skipped")
        return []
    exe = sec["compute_sanitizer"] = find_compute_sanitizer()
    if exe is None:
        report.skip("sanitizer", name, "compute-sanitizer NOT FOUND (PATH, CUDA_HOME, /usr/local/cuda*, pip nvidia)")
        return []
    sec["version"] = run_child([exe, "--version"], env, 30)["output"].strip().splitlines()[-3:]
    # No limit on the child's start-up, where it imports torch and triton.
    help_text = run_child([exe, "--help"], env, 30)["output"]
    no_launch_limit = ["--launch-timeout", "0"] if "--launch-timeout" in help_text else []
    runs = []
    for tool in ("memcheck", "racecheck"):
        cmd = [exe, "--tool", tool, "--error-exitcode", "9", *no_launch_limit, *child, "--child-no-reference"]
        log = out / f"sanitizer.{tool}.tmp"
        with open(log, "w") as f:
            runs.append(dict(tool=tool, cmd=cmd, proc=spawn(cmd, env, stdout=f), log=log, start=time.perf_counter()))
        print(f"[sanitizer] started {' '.join(cmd)}", flush=True)
    return runs


def sanitizer_finish(report: Report, sec: dict, args, out: Path, runs: list[dict]) -> None:
    logs = []
    for run in runs:
        tool, cmd, proc = run["tool"], " ".join(run["cmd"]), run["proc"]
        _, timed_out = reap(proc, args.sanitizer_timeout - (time.perf_counter() - run["start"]))
        seconds = round(time.perf_counter() - run["start"], 1)
        text = run["log"].read_text(errors="replace")
        run["log"].unlink()
        lines = [line.strip().lstrip("= ") for line in text.splitlines() if line.startswith("=========")]
        summaries = [line for line in lines if "SUMMARY" in line]
        # "ERROR SUMMARY: 0 errors" (memcheck), "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
        errors = max((int(m) for line in summaries for m in re.findall(r"(\d+)\s+errors?", line)), default=None)
        reports = [line for line in lines if re.search(r"Invalid|[Hh]azard|Error|Race", line) and line not in summaries]
        sec[tool] = dict(command=cmd, exit_code=proc.returncode, timed_out=timed_out, seconds=seconds)
        sec[tool].update(summary_lines=summaries, errors=errors, first_reports=reports[:12])
        child_ok = CHILD_OK in text
        ok = proc.returncode == 0 and not timed_out and child_ok and not errors and bool(summaries)
        value = "timeout" if timed_out else f"exit {proc.returncode}; {'; '.join(summaries) or 'no SUMMARY line'}"
        limit = f"exit 0, 0 errors, <= {args.sanitizer_timeout:.0f} s"
        note = f"{seconds} s" + ("" if child_ok else "; the child did not finish its cases")
        report.check("sanitizer", f"compute-sanitizer --tool {tool}", ok, value, limit=limit, note=note)
        logs.append(f"##### {tool}: {cmd}\n{clip(text, 120_000, head=30_000)}\n")
    (out / "sanitizer.log").write_text("\n".join(logs))


# --------------------------------------------------------------------------- 4. training over varying batch shapes


def triton_variants(kernel) -> tuple[int | None, str]:
    """Compiled variants of a ``triton.jit`` kernel. Triton >= 3.2 keeps ``JITFunction.device_caches[device]``, a
    tuple whose first field maps specialisation keys to kernels (the other fields vary by version); Triton <= 3.1
    keeps that map in ``JITFunction.cache[device]``. The interpreter compiles nothing."""
    caches = getattr(kernel, "device_caches", None)
    if isinstance(caches, dict):
        maps = [e[0] if isinstance(e, (tuple, list)) and e else None for e in list(caches.values())]
        if all(isinstance(m, dict) for m in maps):
            return sum(map(len, maps)), "sum over devices of len(JITFunction.device_caches[device][0])"
        return None, "unrecognised JITFunction.device_caches layout"
    cache = getattr(kernel, "cache", None)
    if isinstance(cache, dict):
        return sum(len(m) for m in cache.values() if isinstance(m, dict)), "sum of len(JITFunction.cache[device])"
    return None, f"no known compile cache on {type(kernel).__name__}"


@dataclass
class Template:
    index: int
    batch: int
    seq: int
    attention: torch.Tensor  # [batch, seq], 0 on padding
    label_mask: torch.Tensor  # [batch, seq], False on padding and prompt
    tokens: int  # real (not padding) tokens


def build_templates(count: int, min_tokens: int, max_tokens: int, seed: int, device: torch.device) -> list[Template]:
    """Batch shapes: tokens uniform in [min_tokens, max_tokens] over 1, 2 or 4 rows, each right-padded by up to 40%
    and its first up to 30% masked as a prompt."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    templates = []
    for i in range(count):
        total = draw(min_tokens, max_tokens)
        batch = (1, 2, 4)[draw(0, 2)]
        while batch > 1 and total // batch < 32:
            batch //= 2
        seq = total // batch
        attention = torch.ones(batch, seq, dtype=torch.long)
        label_mask = torch.ones(batch, seq, dtype=torch.bool)
        for r in range(batch):
            content = seq - draw(0, int(0.4 * seq))
            attention[r, content:] = 0
            label_mask[r, content:] = False
            label_mask[r, : draw(0, int(0.3 * content))] = False
        tokens = int(attention.sum())
        templates.append(Template(i, batch, seq, attention.to(device), label_mask.to(device), tokens))
    return templates


def window_rates(rec: dict, window: int) -> list[tuple[int, int, float]]:
    """(first step, end step, tokens/s) of each ``window``-step window."""
    spans = [(w0, min(len(rec["ms"]), w0 + window)) for w0 in range(0, len(rec["ms"]), window)]
    return [(w0, w1, sum(rec["tokens"][w0:w1]) / (sum(rec["ms"][w0:w1]) / 1e3)) for w0, w1 in spans]


def section_training(report: Report, sec: dict, args, out: Path) -> None:
    import transformers

    import hf_flce
    from hf_flce.backends import resolve_backend

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    heads = max(4, args.hidden // 64)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max(4096, args.max_tokens),
        tie_word_embeddings=False,
        pad_token_id=0,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).train()
    hf_flce.apply_flce(model, backend=args.backend)
    autocast = cuda and not args.no_autocast
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=cuda)
    backend = resolve_backend(args.backend, device).name
    kernel = None
    if backend == "triton":
        from hf_flce.backends.triton_tiles import _tile_kernel as kernel
    sec["setup"] = dict(params_millions=round(sum(p.numel() for p in params) / 1e6, 2), backend=backend)
    sec["setup"].update(autocast=autocast, optimizer=f"AdamW lr {args.lr}, 20 warm-up steps, grad clip 1.0")
    templates = build_templates(args.window, args.min_tokens, args.max_tokens, args.seed, device)
    # Zipf-like token frequencies over a shuffled vocabulary; fresh token ids every step
    shuffle = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed + 1))
    zipf = (1.0 / (torch.arange(args.vocab) + 10.0) ** 1.1)[shuffle].to(device)
    data_gen = torch.Generator(device=device).manual_seed(args.seed)
    order_gen = torch.Generator().manual_seed(args.seed + 2)
    keys = ("template", "tokens", "loss", "ms", "tokens_per_s", "peak_mib", "rest_mib", "reserved_mib", "triton")
    rec = sec["per_step"] = {k: [] for k in keys}
    start = time.perf_counter()
    try:
        for step in range(args.steps):
            if step % args.window == 0:  # every shape once per window, in a random order
                order = torch.randperm(args.window, generator=order_gen).tolist()
            tpl = templates[order[step % args.window]]
            ids = torch.multinomial(zipf, tpl.batch * tpl.seq, replacement=True, generator=data_gen)
            ids = ids.view(tpl.batch, tpl.seq)
            half = tpl.seq // 2
            ids[:, half : 2 * half] = ids[:, :half]  # the second half repeats the first: something to learn
            ids = ids.masked_fill(tpl.attention == 0, 0)
            labels = ids.masked_fill(~tpl.label_mask, -100)
            for group in optim.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / 20)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, attention_mask=tpl.attention, labels=labels, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            loss_value = loss.item()
            sync(device)
            seconds = time.perf_counter() - t0
            rec["template"].append(tpl.index)
            rec["tokens"].append(tpl.tokens)
            rec["loss"].append(round(loss_value, 5))
            rec["ms"].append(round(seconds * 1e3, 3))
            rec["tokens_per_s"].append(round(tpl.tokens / seconds, 1))
            if cuda:
                rec["peak_mib"].append(round(torch.cuda.max_memory_allocated(device) / MIB, 3))
                rec["rest_mib"].append(round(torch.cuda.memory_allocated(device) / MIB, 3))
                rec["reserved_mib"].append(round(torch.cuda.memory_reserved(device) / MIB, 3))
            rec["triton"].append(None if kernel is None else triton_variants(kernel)[0])
            if step == 0 or (step + 1) % max(1, args.steps // 10) == 0:
                peak = f"{rec['peak_mib'][-1]:.0f} MiB" if cuda else "n/a"
                log = f"[training] step {step + 1}/{args.steps} loss {loss_value:.4f} peak {peak}"
                print(f"{log} {tpl.tokens / seconds:,.0f} tok/s, Triton variants {rec['triton'][-1]}", flush=True)
    finally:  # a run cut short by an error is still summarised and plotted
        sec["seconds_training"] = round(time.perf_counter() - start, 2)
        if rec["loss"]:
            summarize_training(report, sec, args, kernel, cuda)
            try:
                sec["plot"] = plot_training(rec, args, out / "training.png")
            except Exception as exc:
                sec["plot"] = f"failed: {type(exc).__name__}: {exc}"


def summarize_training(report: Report, sec: dict, args, kernel, cuda: bool) -> None:
    check, skip = functools.partial(report.check, "training"), functools.partial(report.skip, "training")
    rec, window, summary = sec["per_step"], args.window, sec.setdefault("summary", {})
    losses = rec["loss"]
    steps, warm = len(losses), min(args.warmup, len(losses) - 1)

    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    k = min(50, steps)
    summary.update(loss_first_50_mean=statistics.fmean(losses[:k]), loss_last_50_mean=statistics.fmean(losses[-k:]))
    value = "all finite" if bad is None else f"non-finite from step {bad}"
    note = (
        f"mean loss: first {k} steps {summary['loss_first_50_mean']:.3f}, last {k} {summary['loss_last_50_mean']:.3f}"
    )
    check(f"loss finite at every step ({steps} steps)", bad is None and steps == args.steps, value, note=note)

    # Every batch shape occurs in the first window, so no variant should be compiled after it.
    count, method = triton_variants(kernel) if kernel is not None else (None, "backend is not triton")
    at = min(window, steps) - 1
    summary.update(triton_variants_method=method, triton_variants_final=count)
    summary["triton_variants_after_first_window"] = rec["triton"][at]
    if count is None:
        skip("Triton variants bounded", method)
    else:
        name = f"Triton variants: after step {at + 1} == after step {steps}, <= {args.max_variants}"
        ok = rec["triton"][at] == count and count <= args.max_variants
        note = f"counted as {method}; every batch shape occurs in the first {window} steps"
        check(name, ok, f"{rec['triton'][at]} -> {count}", limit=f"equal, <= {args.max_variants}", note=note)

    windows = window_rates(rec, window)
    summary["throughput_windows"] = [dict(steps=f"{w0}-{w1 - 1}", tokens_per_s=round(r, 1)) for w0, w1, r in windows]
    steady = [r for _, _, r in windows[1:]]
    cv = statistics.stdev(steady) / statistics.fmean(steady) if len(steady) >= 2 else None
    summary["throughput_cv_after_first_window"] = cv
    if not cuda or cv is None or len(steady) < 6:
        reason = "fewer than 7 windows" if cuda else "CPU smoke run: timing not checked"
        skip("tokens/s steady across windows", reason)
    else:
        # Steady = no drift (the last windows as fast as the first steady ones) and bounded noise. Each window holds
        # the same batch shapes; a small model at 64-2048 tokens per step is launch-bound, so host jitter shows.
        late_over_early = statistics.fmean(steady[-3:]) / statistics.fmean(steady[:3])
        summary["throughput_late_over_early"] = late_over_early
        note = f"{min(steady):,.0f}..{max(steady):,.0f} tok/s; first window {windows[0][2]:,.0f}"
        name = f"tokens/s does not decline: last 3 {window}-step windows / first 3 after warm-up"
        check(name, late_over_early >= args.min_late_over_early, round(late_over_early, 4),
              limit=f">= {args.min_late_over_early}", note=note)  # fmt: skip
        name = f"tokens/s noise over {window}-step windows after the first (coefficient of variation)"
        check(name, cv <= args.max_cv, round(cv, 5), limit=args.max_cv)

    if not cuda:
        skip("peak memory flat", "no CUDA allocator statistics on a CPU")
        return
    peaks, rests = rec["peak_mib"][warm:], rec["rest_mib"][warm:]
    summary["peak_mib_after_warmup"] = dict(max=max(peaks), min=min(peaks))
    summary["reserved_mib"] = dict(at_warmup=rec["reserved_mib"][warm], final=rec["reserved_mib"][-1])
    value = f"{min(rests):.2f}..{max(rests):.2f} MiB"
    check(f"memory between steps constant after step {warm}", max(rests) - min(rests) <= 1.0, value, "spread <= 1 MiB")

    # The same batch shape should peak at the same memory all run long.
    by_shape: dict[int, dict[int, float]] = {}  # shape -> {step: peak MiB}
    for step in range(warm, steps):
        by_shape.setdefault(rec["template"][step], {})[step] = rec["peak_mib"][step]
    spread, shape = max(((max(p.values()) - min(p.values())) / min(p.values()), t) for t, p in by_shape.items())
    summary["per_shape_peak_spread_max"] = dict(relative=spread, template=shape)
    name = "peak memory per batch shape: (max - min) / min over the run"
    note = f"{len(by_shape)} shapes, each seen {min(map(len, by_shape.values()))}+ times after warm-up"
    limit = f"<= {args.max_peak_spread:.1%}"
    check(name, spread <= args.max_peak_spread, f"{spread:.4%} (shape #{shape})", limit, note)

    early_end, late_start = warm + 200, steps - 200
    ratios = []
    for t, p in by_shape.items():
        early = [mib for s, mib in p.items() if s < early_end]
        late = [mib for s, mib in p.items() if s >= late_start]
        if early and late and late_start >= early_end:
            ratios.append((max(late) / max(early), t))
    if ratios:
        ratio, shape = max(ratios)
        summary["late_over_early_peak_max"] = dict(ratio=ratio, template=shape)
        name = f"peak per shape, steps {late_start}+ vs steps {warm}-{early_end - 1}: max ratio"
        check(name, ratio <= 1.01, f"{ratio:.5f} (shape #{shape})", "<= 1.01")

    # Trend of the peaks once each shape's mean is removed, pooled over the shapes.
    xs, ys = [], []
    for p in by_shape.values():
        mean = statistics.fmean(p.values())
        xs += p.keys()
        ys += [mib - mean for mib in p.values()]
    pooled = statistics.linear_regression(xs, ys).slope * 1000.0 if len(xs) > 1 else 0.0
    summary["pooled_slope_mib_per_1000_steps"] = pooled
    median_peak = statistics.median_high(peaks)
    name = "peak memory trend (per-shape means removed), over the run after warm-up"
    limit = f"|trend| x {steps - warm} steps <= 1% of median peak ({median_peak:.0f} MiB)"
    check(name, abs(pooled) * (steps - warm) / 1000.0 <= 0.01 * median_peak, f"{pooled:+.3f} MiB per 1000 steps", limit)


def plot_training(rec: dict, args, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"skipped: matplotlib does not import ({exc})"
    steps = range(1, len(rec["loss"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    if rec["peak_mib"]:
        top.scatter(steps, rec["peak_mib"], s=4, label="peak allocated per step")
        top.plot(steps, rec["rest_mib"], color="black", lw=1, label="allocated between steps")
        top.set(ylabel="MiB", title="hf_flce training run: peak memory per step (varying batch shapes)")
    else:
        top.plot(steps, rec["loss"], lw=1, label="loss")
        top.set(title="loss per step (CPU run: no memory statistics)")
    top.axvline(args.warmup, color="grey", ls=":", lw=1)
    bottom.scatter(steps, rec["tokens_per_s"], s=4, alpha=0.5, label="per step")
    for i, (w0, w1, rate) in enumerate(window_rates(rec, args.window)):
        label = f"{args.window}-step window" if i == 0 else None
        bottom.plot([w0 + 1, w1], [rate, rate], color="red", lw=1.5, label=label)
    bottom.set(ylabel="tokens / s", xlabel="step")
    for ax in (top, bottom):
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "training.png"


# -------------------------------------------------------------------------------------------------------------- output


def cell(value) -> str:
    return "" if value is None else clip(str(value), 300).replace("|", "\\|").replace("\n", " ")


def checks_table(report: Report) -> str:
    fields = ("section", "name", "status", "value", "limit", "note")
    return markdown_table(fields, [[cell(c[f]) for f in fields] for c in report.checks])


def markdown(report: Report) -> str:
    lines = [
        "# hf_flce GPU reliability (issue #9)",
        "",
        f"Result: **{'FAIL' if report.failed() else 'PASS'}**. Details of each section are in reliability.json.",
        "",
        markdown_table(["item", "value"], [[k, cell(v)] for k, v in report.meta.items()]),
        "",
        checks_table(report),
    ]
    if report.sections.get("training", {}).get("plot") == "training.png":
        lines += ["", "![training](training.png)"]
    for name, sec in report.sections.items():
        if sec["status"] == "error":
            lines += ["", f"## Error in section {name}", "", "```", sec["traceback"], "```"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------- main

# Training settings: default on CUDA, default on a CPU.
TRAINING_DEFAULTS = dict(
    steps=(1000, 30),
    window=(100, 10),  # also the number of batch shapes
    warmup=(50, 10),  # steps left out of the memory checks
    vocab=(128256, 5003),
    hidden=(512, 64),
    layers=(4, 2),
    min_tokens=(64, 16),
    max_tokens=(2048, 256),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/reliability", help="folder for the JSON, Markdown, PNG and sanitizer log")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--backend", default="auto", help="hf_flce backend for determinism and training")
    p.add_argument("--sanitize-child", action="store_true", help="internal: the compute-sanitizer target")
    p.add_argument("--child-no-reference", action="store_true", help="internal: skip the torch-backend comparison")
    p.add_argument("--sanitizer-timeout", type=float, default=150.0, help="seconds per sanitizer tool (run together)")
    p.add_argument("--assert-timeout", type=float, default=120.0)
    p.add_argument("--det-runs", type=int, default=3)
    p.add_argument("--det-cases", nargs="*", default=None, help="names of determinism cases (default: all)")
    for key, (on_cuda, on_cpu) in TRAINING_DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"training: default {on_cuda}, {on_cpu} on CPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 on CUDA (default: bf16 autocast)")
    p.add_argument("--max-variants", type=int, default=16, help="bound on compiled Triton variants")
    p.add_argument("--max-cv", type=float, default=0.10, help="bound on the tokens/s coefficient of variation")
    p.add_argument("--min-late-over-early", type=float, default=0.95, help="bound on the tokens/s drift")
    p.add_argument("--max-peak-spread", type=float, default=0.01, help="bound on per-shape peak memory spread")
    args = p.parse_args(argv)
    for key, (on_cuda, on_cpu) in TRAINING_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, on_cuda if args.device == "cuda" else on_cpu)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available (use --device cpu for the smoke run)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sanitize_child:
        return sanitize_child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), **env_info(Device(args.device)))
    meta.update({k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "TRITON_INTERPRET")})
    report = Report(meta)
    if args.device == "cpu":
        print("[reliability] CPU run: the CUDA-only parts are skipped (device-side assert, sanitizer, memory).")
    start = time.perf_counter()

    def run(name: str, section, *extra):
        result = None
        if name in args.sections.split(","):
            with guarded(report, name) as sec:
                result = section(report, sec, args, *extra)
            report.write(out)
        return result

    # The sanitizer tools run in the background, alongside the assert and determinism sections.
    sanitizers = run("sanitizer", sanitizer_start, out) or []
    try:
        run("assert", section_assert)
        run("determinism", section_determinism)
    finally:
        if sanitizers:
            run("sanitizer", sanitizer_finish, out, sanitizers)
    run("training", section_training, out)
    report.meta["total_seconds"] = round(time.perf_counter() - start, 1)
    report.write(out)
    print(f"\n{checks_table(report)}\n\nRESULT: {'FAIL' if report.failed() else 'PASS'}")
    print(f"[reliability] wrote {out}/reliability.json and reliability.md in {report.meta['total_seconds']} s")
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
