#!/usr/bin/env python3
"""Host time per statement of an isolated call, inside the call (one GPU, ~30 s): where the time goes that an idle
GPU waits for before the head GEMM (docs/PERF_NOTES.md v20).

    python3 scripts/profile_host_lines.py --shapes mistral-7b,qwen3-0.6b --out outputs/host_lines

The package is copied to a temporary folder with a ``perf_counter_ns`` mark inserted before every statement of the
functions in ``FUNCTIONS`` (by rewriting their syntax trees), and imported from there. One no-grad call and one
fwd+bwd call per shape are then timed many times, each after a synchronisation as the benchmark times them; the
output lists every mark's median time from the call's entry and the gap since the previous mark, which is the cost of
the statement before it (a mark costs ~0.3 µs). Microbenchmarks of the same operations in a loop read 2-4x lower: in
a call, each line's code is cold.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUNCTIONS = {
    "api.py": {"fused_linear_cross_entropy"},
    "engine.py": {"_forward", "_statistics_without_sync", "kept_rows", "_chunk_forward", "_plan_rows", "_outputs"},
    "backends/triton_gemm.py": {"forward", "_gemm", "_launch_tuned", "kept_order", "_launch_target_kernel"},
    "backends/triton_launch.py": {"launch"},
    "backends/triton_scaled.py": {"row_scales"},
}


class _Marker(ast.NodeTransformer):
    def __init__(self, path: str, functions: set[str]):
        self.path, self.functions = path, functions

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        self.generic_visit(node)
        if node.name in self.functions:
            node.body = self._marked(node.body, node.name)
        return node

    def _marked(self, body: list[ast.stmt], function: str) -> list[ast.stmt]:
        out = []
        for statement in body:
            if isinstance(statement, (ast.For, ast.While, ast.If, ast.With)):
                statement.body = self._marked(statement.body, function)
                if getattr(statement, "orelse", None):
                    statement.orelse = self._marked(statement.orelse, function)
            label = f"{self.path}:{function}:{statement.lineno}"
            out.append(ast.parse(f"__import__('builtins').hf_flce_mark({label!r})").body[0])
            out.append(statement)
        return out


def marked_copy(destination: Path) -> None:
    shutil.copytree(REPO / "hf_flce", destination / "hf_flce")
    for path, functions in FUNCTIONS.items():
        source = destination / "hf_flce" / path
        tree = _Marker(path, functions).visit(ast.parse(source.read_text()))
        source.write_text(ast.unparse(ast.fix_missing_locations(tree)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="mistral-7b,qwen3-0.6b")
    p.add_argument("--out", default="outputs/host_lines")
    p.add_argument("--reps", type=int, default=21)
    args = p.parse_args()
    marks: list[tuple[str, int]] = []
    builtins.hf_flce_mark = lambda label: marks.append((label, time.perf_counter_ns()))
    copy = Path(tempfile.mkdtemp(prefix="hf_flce_marked_"))
    marked_copy(copy)
    sys.path[:0] = [str(copy), str(REPO / "scripts")]
    import torch

    import hf_flce

    assert Path(hf_flce.__file__).is_relative_to(copy), hf_flce.__file__
    from profile_head import SHAPES, inputs, isolated_calls

    def profile(label: str, fn) -> list[tuple[str, float]]:
        for _ in range(5):
            fn()
        calls = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            marks.clear()
            start = time.perf_counter_ns()
            fn()
            returned = time.perf_counter_ns()
            torch.cuda.synchronize()
            calls.append([(m, (t - start) / 1e3) for m, t in marks] + [("return", (returned - start) / 1e3)])
        n = min(len(c) for c in calls)
        rows = [(calls[0][i][0], statistics.median(c[i][1] for c in calls)) for i in range(n)]
        print(f"## {label}: us from entry, gap since the previous mark, mark (file:function:line)")
        previous = 0.0
        for mark, at in rows:
            print(f"  {at:9.1f} {at - previous:7.1f}  {mark}")
            previous = at
        return rows

    result = {"gpu": torch.cuda.get_device_name()}
    for name in args.shapes.split(","):
        for label, fn in isolated_calls(name, *inputs(*SHAPES[name])).items():
            result[f"{name}:{label}"] = profile(f"{name} {label}", fn)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_lines.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(copy)


if __name__ == "__main__":
    main()
