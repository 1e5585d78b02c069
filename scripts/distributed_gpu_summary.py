"""Collect what ``scripts/distributed_gpu.sh`` left in its work folder into one ``results.json`` and a short summary.

    python scripts/distributed_gpu_summary.py WORK_DIR OUT_JSON

Reads ``steps.tsv`` (name, exit status, seconds, limit of every step), ``env.json``, the pytest JUnit XML, the
FLCESFTTrainer comparison, the HF Trainer check's per-rank JSON and the benchmark JSON; prints one line per check
(``PASS``/``FAIL``/``SKIP`` and its numbers) and exits 1 when a check failed or did not run.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TOL = 2e-5  # the HF Trainer check: relative error against one process (as tests/test_distributed.py)
LOSS_RTOL = 1e-2  # benchmarks: first logged loss, ours against stock (bf16)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(work: Path) -> dict[str, dict]:
    steps = {}
    path = work / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, status, seconds, limit = (line.split("\t") + ["", "", "", ""])[:4]
            steps[name] = {"status": status, "seconds": seconds, "limit_s": limit}
    return steps


def step_problem(steps: dict, name: str) -> str | None:
    step = steps.get(name)
    if step is None:
        return f"step {name} did not run"
    if step["status"] == "skipped":
        return f"step {name} skipped: out of the time budget"
    if step["status"] == "124":
        return f"step {name} timed out after {step['seconds']} s"
    if step["status"] != "0":
        return f"step {name} exited with {step['status']}"
    return None


def check_deepspeed(env: dict) -> dict:
    version = (env or {}).get("deepspeed")
    ok = bool(version) and not str(version).startswith("not importable")
    return {"status": "PASS" if ok else "FAIL", "detail": f"deepspeed {version}"}


def check_pytest(work: Path, steps: dict) -> dict:
    path = work / "pytest.xml"
    if not path.exists():
        return {"status": "FAIL", "detail": step_problem(steps, "pytest") or "no JUnit report"}
    cases = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            cases["failed"].append(name)
        elif case.find("skipped") is not None:
            cases["skipped"].append(f"{name}: {case.find('skipped').get('message', '')}")
        else:
            cases["passed"].append(name)
    problems = []
    if cases["failed"]:
        problems.append(f"failed: {', '.join(cases['failed'])}")
    zero3_skipped = [s for s in cases["skipped"] if "zero3" in s]
    if zero3_skipped:
        problems.append("the ZeRO-3 tests were skipped")
    problem = step_problem(steps, "pytest")
    if problem and not cases["failed"]:
        problems.append(problem)
    detail = f"{len(cases['passed'])} passed, {len(cases['failed'])} failed, {len(cases['skipped'])} skipped"
    if problems:
        detail += f" ({'; '.join(problems)})"
    return {"status": "FAIL" if problems else "PASS", "detail": detail, **cases}


def check_sft(work: Path, steps: dict, scenario: str) -> dict:
    report = (read_json(work / "sft" / f"compare_{scenario}.json") or {}).get(scenario)
    if report is None:
        problem = step_problem(steps, f"sft_{scenario}") or step_problem(steps, "sft_single") or "no comparison"
        return {"status": "FAIL", "detail": problem}
    worst = ", ".join(f"{k} {v:.1e}" for k, v in report["worst"].items() if k != "initial")
    layouts = [n for n in report["notes"] if n.startswith("lm_head.weight")]
    detail = f"worst relative error: {worst or 'n/a'}; " + "; ".join(layouts)
    if report["problems"]:
        detail = f"{len(report['problems'])} problems, first: {report['problems'][0][:300]} | {detail}"
    return {"status": "FAIL" if report["problems"] else "PASS", "detail": detail, **report}


def check_trainer(work: Path, steps: dict) -> dict:
    files = sorted((work / "sft" / "trainer_check").glob("rank*.json"))
    if not files:
        return {"status": "FAIL", "detail": step_problem(steps, "sft_launch_fsdp2") or "no results"}
    worst, problems, notes = 0.0, [], []
    for path in files:
        result = json.loads(path.read_text())["trainer"]
        notes = result["notes"]
        if result["failure"]:
            problems.append(f"{path.stem}: {result['failure'].strip().splitlines()[-1]}")
            continue
        errors = result["errors"]
        worst = max([worst, *errors.values()])
        bad = [k for k, v in errors.items() if not v <= TOL]
        if bad:
            problems.append(f"{path.stem}: above {TOL}: {bad[:5]}")
    detail = f"{len(files)} ranks, max relative error {worst:.1e} ({', '.join(notes)})"
    if problems:
        detail = f"{'; '.join(problems)} | {detail}"
    return {"status": "FAIL" if problems else "PASS", "detail": detail, "max_rel_error": worst}


def check_bench(bench: dict | None, steps: dict, family: str) -> dict:
    runs = (bench or {}).get("runs", {})
    stock, ours = runs.get(f"{family}_stock"), runs.get(f"{family}_flce")
    if not stock or not ours:
        return {"status": "FAIL", "detail": step_problem(steps, "bench") or "no results"}
    failed = [n for n, r in ((f"{family}_stock", stock), (f"{family}_flce", ours)) if r.get("failure")]
    if failed:
        last = runs[failed[0]]["failure"].strip().splitlines()[-1]
        return {"status": "FAIL", "detail": f"{', '.join(failed)} failed: {last}"}
    ratio = bench["ratios"][family]

    def describe(r: dict) -> str:
        peaks = "/".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        return f"{r['tokens_per_s'] / 1e3:.1f}k tok/s, peak {peaks} GiB"

    peak = "n/a" if ratio["peak_gib"] is None else f"{ratio['peak_gib']:.2f}x"
    detail = (
        f"{bench['config']['model']}: stock {describe(stock)} | hf_flce {describe(ours)} | ours/stock: "
        f"{ratio['tokens_per_s']:.2f}x tok/s, {peak} peak (max over ranks)"
    )
    # Same seed, data and model: the first logged losses must agree (bf16: loosely).
    first_stock, first_ours = stock["losses"][0], ours["losses"][0]
    loss_gap = abs(first_ours - first_stock) / abs(first_stock)
    detail += f"; first loss {first_stock:.4f} / {first_ours:.4f}"
    status = "PASS" if loss_gap <= LOSS_RTOL else "FAIL"
    if status == "FAIL":
        detail = f"first losses differ by {loss_gap:.1e} (> {LOSS_RTOL}) | {detail}"
    return {"status": status, "detail": detail, "stock": stock, "flce": ours, "ratios": ratio}


def main() -> int:
    work, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    steps = read_steps(work)
    env = read_json(work / "env.json") or {}
    bench = read_json(work / "bench.json")
    checks = {
        "deepspeed import": check_deepspeed(env),
        "pytest tests/test_distributed.py (NCCL)": check_pytest(work, steps),
        "HF Trainer, accelerate FSDP2 vs 1 process": check_trainer(work, steps),
        "FLCESFTTrainer, accelerate FSDP2 vs 1 process": check_sft(work, steps, "launch_fsdp2"),
        "FLCESFTTrainer, accelerate ZeRO-3 vs 1 process": check_sft(work, steps, "launch_zero3"),
        "bench HF Trainer, FSDP2": check_bench(bench, steps, "trainer"),
        "bench TRL SFTTrainer vs FLCESFTTrainer, FSDP2": check_bench(bench, steps, "sft"),
    }
    out_json.write_text(
        json.dumps({"env": env, "steps": steps, "checks": checks, "bench": bench}, indent=1, default=str)
    )
    print("SUMMARY " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "gpus") + f"; gpus {env.get('gpus')}")
    print("steps: " + ", ".join(f"{n} {s['status']} in {s['seconds']}s" for n, s in steps.items()))
    for name, check in checks.items():
        print(f"{check['status']:4}  {name}: {check['detail']}")
    failed = [name for name, check in checks.items() if check["status"] != "PASS"]
    print(f"OVERALL {'PASS' if not failed else 'FAIL'}: {len(checks) - len(failed)}/{len(checks)} checks passed")
    return int(bool(failed))


if __name__ == "__main__":
    sys.exit(main())
