"""CPU smoke test of the benchmark scripts at tiny sizes: they run end to end, write JSON, tables and plots."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_file(path: Path, module_name: str) -> ModuleType:
    """A script or example (not a package module) imported from its file as ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _load(name: str) -> ModuleType:
    return load_file(SCRIPTS / f"{name}.py", f"_bench_{name}")


def _by_provider(rows: list[dict], **match) -> dict[str, dict]:
    return {r["provider"]: r for r in rows if all(r.get(k) == v for k, v in match.items())}


def test_kernel_reference_and_peaked_inputs() -> None:
    """The benchmark's chunked fp32 reference matches float64 autograd; "peaked" raises target logits by 14."""
    kernel = _load("benchmark_kernel")
    dev = kernel.Device("cpu")
    shape = kernel.Shape("t", 48, 16, 300, 30.0)
    x, w, y = kernel.make_inputs(shape, "flat", dev, seed=3)
    scale = torch.randn(shape.n)
    nll, dx, dw = kernel.reference(x, w, y, scale, shape.softcap)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = F.linear(x64, w64)
    z = torch.tanh(z / shape.softcap) * shape.softcap
    ref = F.cross_entropy(z, y, ignore_index=kernel.IGNORE, reduction="none")
    ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), scale.double())
    torch.testing.assert_close(nll.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1e-4, atol=1e-6)

    xp, wp, yp = kernel.make_inputs(shape, "peaked", dev, seed=3)
    valid = yp != kernel.IGNORE
    rows = torch.arange(shape.n)[valid]
    raise_ = (xp.float() - x.float())[valid] @ w.float().T
    assert torch.equal(yp, y) and torch.equal(wp, w)
    torch.testing.assert_close(
        raise_[torch.arange(len(rows)), y[valid]], torch.full((len(rows),), 14.0), atol=0.15, rtol=0
    )


def test_kernel_benchmark_cpu(tmp_path: Path, capsys) -> None:
    kernel = _load("benchmark_kernel")
    argv = ["--device", "cpu", "--quick", "--shapes", "64x32x512,64x32x512x30", "--focus-shapes", "64x32x512"]
    argv += ["--memory-base", "128x32x1024", "--providers", "stock,liger,ours"]
    argv += ["--threads", "1", "--out", str(tmp_path)]
    assert kernel.main(argv) == 0
    data = json.loads((tmp_path / "kernel.json").read_text())

    for dist in ("flat", "peaked"):
        rows = _by_provider(data["main"], shape="64x32x512", dist=dist)
        assert set(rows) == {"stock", "liger", "ours"}
        assert rows["liger"]["status"].startswith("n/a")
        for name in ("stock", "ours"):
            assert rows[name]["status"] == "ok", rows[name]
            assert rows[name]["fwdbwd_ms"] > 0 and rows[name]["dx_err"] < 5e-2 and rows[name]["dw_err"] < 5e-2
            # the floor timed in turns with the provider, once per timed call
            assert len(rows[name]["paired_floor_times"]) == len(rows[name]["fwdbwd_times"])
            assert rows[name]["paired_floor_ms"] > 0
            if dist == "flat":
                assert len(rows[name]["paired_gemm_times"]) == len(rows[name]["fwd_times"])
    assert _by_provider(data["main"], shape="64x32x512x30")["ours"]["status"] == "ok"
    assert kernel.unsupported("torch_lce", kernel.stock_loss, kernel.parse_shape("64x32x512x30")) == "n/a: no softcap"
    assert data["floor"]["64x32x512"]["floor_ms"] > 0
    assert _by_provider(data["pertoken"])["ours"]["status"] == "ok"
    assert _by_provider(data["pertoken"])["ours"]["paired_floor_ms"] > 0
    assert _by_provider(data["masked"])["stock"]["unmasked_ms"] > 0
    mem = _by_provider(data["cpu_memory"])
    assert mem["stock"]["status"] == "ok" and mem["stock"]["rss_extra_bytes"] >= 0, mem["stock"]
    assert (tmp_path / "kernel.md").read_text().count("|") > 20
    assert (tmp_path / "kernel.png").stat().st_size > 0
    assert "÷ floor" in capsys.readouterr().out

    # Tables and plots can be redrawn from the JSON alone.
    redo = tmp_path / "redo"
    assert kernel.main(["--device", "cpu", "--from-json", str(tmp_path / "kernel.json"), "--out", str(redo)]) == 0
    assert (redo / "kernel.md").read_text() == (tmp_path / "kernel.md").read_text()


def test_ratio_to_the_floor_pairs_each_round() -> None:
    """A call's ratio to the floor is the median of each round's ratio (call ÷ the floor run just before it), so clocks
    that move between rounds cancel; without per-round times it is the ratio of the medians."""
    kernel = _load("benchmark_kernel")
    # qwen3-0.6b peaked on an H100 (session 37): rounds 3-5 ran at lower clocks, but not all by the same amount
    calls = [23.2, 23.0, 27.4, 25.7, 25.4]
    floors = [20.9, 20.8, 25.1, 24.0, 20.9]
    rec = {"status": "ok", "fwdbwd_times": calls, "paired_floor_times": floors, "fwdbwd_ms": 25.4}
    rec["paired_floor_ms"] = 20.9
    assert kernel._paired(rec, "fwdbwd", "paired_floor", {}) == pytest.approx(23.0 / 20.8)  # 1.106, the middle round
    assert 25.4 / 20.9 > 1.2  # the ratio of the medians pairs round 5's call with round 1's floor
    older = {"status": "ok", "shape": "s", "fwd_ms": 3.0}  # a run without paired times: the shape's own GEMM
    assert kernel._paired(older, "fwd", "paired_gemm", {"s": 2.0}) == pytest.approx(1.5)
    assert kernel._paired({"status": "OOM"}, "fwd", "paired_gemm", {}) is None


def test_kernel_benchmark_one_section_without_plots(tmp_path: Path) -> None:
    # the pertoken section alone has no plot panel: the run still writes its tables (it used to raise in matplotlib)
    kernel = _load("benchmark_kernel")
    argv = ["--device", "cpu", "--quick", "--sections", "pertoken", "--focus-shapes", "64x32x512"]
    assert kernel.main(argv + ["--providers", "ours", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert _by_provider(json.loads((tmp_path / "kernel.json").read_text())["pertoken"])["ours"]["status"] == "ok"
    assert "Per-token path" in (tmp_path / "kernel.md").read_text()
    assert not (tmp_path / "kernel.png").exists()


def test_memory_vs_n_plots_memory_and_time(tmp_path: Path, monkeypatch) -> None:
    """An accelerator's memory section plots extra memory and the time of one call against N, on log axes, leaving
    out the points that ran out of memory."""
    kernel = _load("benchmark_kernel")
    pytest.importorskip("matplotlib")
    rows = []
    for provider, gib, ms in (
        ("stock", (11.7, 47.0, None), (46.0, 205.0, None)),
        ("ours", (1.7, 2.2, 2.5), (36, 149, 293)),
    ):
        for n, extra, time_ms in zip((8192, 32768, 65536), gib, ms):
            ok = extra is not None
            rec = {"shape": f"s@{n}", "n": n, "provider": provider, "status": "ok" if ok else "OOM"}
            rows.append(rec | ({"extra_bytes": extra * 2**30, "grad_bytes": 0, "fwdbwd_ms": time_ms} if ok else {}))
    data = {"floor": {}, "main": [], "memory_vs_n": rows, "cpu_memory": []}
    figures = []
    monkeypatch.setattr(kernel, "save_figure", lambda fig, path: figures.append(fig))
    kernel.render_plots(data, tmp_path / "kernel.png")
    (fig,) = figures
    memory, time = fig.axes
    assert "memory" in memory.get_title() and "Time" in time.get_title()
    assert memory.get_yscale() == time.get_yscale() == "log"
    for ax, stock, ours in ((memory, [11.7, 47.0], [1.7, 2.2, 2.5]), (time, [46.0, 205.0], [36, 149, 293])):
        lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        assert lines == {"stock": pytest.approx(stock), "ours": pytest.approx(ours)}


def test_training_benchmark_cpu(tmp_path: Path) -> None:
    training = _load("benchmark_training")
    argv = ["--device", "cpu", "--models", "tiny-llama", "--tokens", "128", "--seq", "64", "--steps", "1"]
    argv += ["--warmup", "1", "--providers", "stock,liger,ours,ours_late,ours_fp32_sum", "--no-isolate"]
    argv += ["--threads", "1", "--out", str(tmp_path)]
    assert training.main(argv) == 0
    data = json.loads((tmp_path / "training.json").read_text())
    rows = _by_provider(data["results"])
    assert set(rows) == {"stock", "liger", "ours", "ours_late", "ours_fp32_sum"}
    assert rows["liger"]["status"].startswith("n/a")
    for name in ("stock", "ours", "ours_late", "ours_fp32_sum"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["tokens_per_step"] == 128
    # Same seed, same model, same batch: the first-step losses agree, and each is near the float64 head's; dW at the
    # end of the backward trains the same steps.
    assert abs(rows["ours"]["losses"][0] - rows["stock"]["losses"][0]) < 1e-2
    assert rows["ours_late"]["losses"] == pytest.approx(rows["ours"]["losses"], rel=1e-5)
    # on CPU dW is summed in float32 either way (the 16-bit sum is the Hopper path's)
    assert rows["ours_fp32_sum"]["losses"] == rows["ours"]["losses"]
    for name in ("stock", "ours"):
        assert abs(rows[name]["losses"][0] - rows[name]["exact_loss"]) < 1e-2
    assert rows["ours"]["exact_loss"] == rows["stock"]["exact_loss"]
    assert "tiny-llama" in (tmp_path / "training.md").read_text()
    assert (tmp_path / "training.png").stat().st_size > 0


def _one_step_run(training, task: str, providers: str, tmp_path: Path) -> tuple[list[str], dict]:
    """One timed step of ``task`` on tiny-qwen3 (128 tokens in sequences of 32) in this process: the argv and the
    rows by provider."""
    argv = ["--device", "cpu", "--task", task, "--models", "tiny-qwen3", "--tokens", "128", "--seq", "32"]
    argv += ["--steps", "1", "--warmup", "1", "--providers", providers, "--no-isolate", "--threads", "1"]
    argv += ["--out", str(tmp_path)]
    assert training.main(argv) == 0
    return argv, _by_provider(json.loads((tmp_path / f"training_{task}.json").read_text())["results"])


def test_training_benchmark_dpo_step_smoke(tmp_path: Path) -> None:
    training = _load("benchmark_training")
    argv, rows = _one_step_run(training, "dpo", "stock,trl,ours", tmp_path)
    for name in ("stock", "trl", "ours"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["tokens_per_step"] == 128
    # The first step's loss against the same models and batch in float64. The reference differs from the policy, so
    # it is not log 2. TRL's fused head and ours match it to the bf16 backbone's rounding; stock's log-softmax runs on
    # bf16 logits and misses by up to ~5e-2.
    dev = training.bc.Device("cpu")
    policy = training.make_model("tiny-qwen3", dev, torch.bfloat16, 0).double()
    ref = training.make_model("tiny-qwen3", dev, torch.bfloat16, 7).double()
    ids, labels = training.make_preference_batch(policy.config.vocab_size, 128, 32, dev, 0)

    def sequence_logps(model):
        target = labels[:, 1:]
        logps = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
        return (logps * (target != training.IGNORE)).sum(1)

    with torch.no_grad():
        exact = float(training._sigmoid_dpo_loss(sequence_logps(policy), sequence_logps(ref)))
    first = {name: rows[name]["losses"][0] for name in rows}
    assert abs(exact - math.log(2)) > 1e-2
    # The script's own float64 head on the bf16 hidden states: near the all-float64 loss, and near ours and TRL's.
    assert abs(rows["ours"]["exact_loss"] - exact) < 2e-3
    assert (
        abs(first["ours"] - rows["ours"]["exact_loss"]) < 1e-3 and abs(first["trl"] - rows["trl"]["exact_loss"]) < 1e-3
    )
    assert abs(first["ours"] - exact) < 2e-3 and abs(first["trl"] - exact) < 2e-3, (first, exact)
    assert abs(first["stock"] - exact) < 1e-1, (first, exact)
    assert "DPO" in (tmp_path / "training_dpo.md").read_text()
    with pytest.raises(SystemExit):
        training.main([*argv[:-2], "--providers", "ours_late", "--out", str(tmp_path)])


def test_training_benchmark_grpo_step(tmp_path: Path) -> None:
    training = _load("benchmark_training")
    _, rows = _one_step_run(training, "grpo", "stock,liger,trl,ours", tmp_path)
    assert rows["liger"]["status"].startswith("n/a")
    for name in ("stock", "trl", "ours"):
        assert rows[name]["status"] == "ok" and rows[name]["exact_loss"] is None, rows[name]
    assert "No head error" in (tmp_path / "training_grpo.md").read_text()
    # The step's loss at ratio 1 is minus the advantages' mean over completion tokens, whatever the head; its
    # gradient is the head's: in float32 every provider's equals stock's.
    dev = training.bc.Device("cpu")
    grads = {}
    for name in ("stock", "trl", "ours"):
        model = training.make_model("tiny-qwen3", dev, torch.float32, 0)
        ids, labels = training.make_batch(model.config.vocab_size, 128, 32, dev, 0)
        advantages = torch.linspace(-1.0, 1.5, ids.shape[0])
        loss = training.patch_grpo(name, model, advantages)(ids, labels)
        mask = labels[:, 1:] != training.IGNORE
        assert float(loss) == pytest.approx(float(-(advantages[:, None] * mask).sum() / mask.sum()), rel=1e-6)
        loss.backward()
        grads[name] = {k: v.grad for k, v in model.named_parameters()}
    for name in ("trl", "ours"):
        for key, expected in grads["stock"].items():
            torch.testing.assert_close(grads[name][key], expected, rtol=1e-4, atol=1e-7, msg=f"{name} {key}")
    assert grads["stock"]["model.embed_tokens.weight"].abs().sum() > 0  # tied to lm_head


def test_preference_batch_shares_prompts() -> None:
    training = _load("benchmark_training")
    dev = training.bc.Device("cpu")
    ids, labels = training.make_preference_batch(500, 100, 16, dev, seed=3)
    assert ids.shape == (6, 16)
    assert torch.equal(ids[3:, :4], ids[:3, :4])
    assert not torch.equal(ids[3:, 4:], ids[:3, 4:])
    assert (labels[:, :4] == training.IGNORE).all() and torch.equal(labels[:, 4:], ids[:, 4:])


class _FakeGPU:
    """A stand-in for ``torch.cuda`` with a clock of its own: a call on an idle GPU (nothing queued ahead of it)
    costs its host time on top of its GPU time, as an event-timed call does."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.queued = False
        outer = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = 0.0

            def record(self) -> None:
                self.at = outer.clock

            def synchronize(self) -> None:
                outer.queued = False

            def elapsed_time(self, end: Event) -> float:
                return end.at - self.at

        self.Event = Event

    def synchronize(self) -> None:
        self.queued = False

    def kernel(self, gpu_ms: float, host_ms: float) -> None:
        self.clock += gpu_ms + (0.0 if self.queued else host_ms)
        self.queued = True


def test_queued_timing_hides_host_time_only_behind_earlier_work() -> None:
    bc = _load("bench_common")
    dev = bc.Device("cpu")
    dev.mod = fake = _FakeGPU()
    times = dev.time_queued(
        lambda: fake.kernel(3.0, 0.01), lambda: fake.kernel(5.0, 0.5), warmup=1, reps=4, settle_s=0.0
    )
    expected = {"yardstick": 3.0, "queued": 5.0, "yardstick_isolated": 3.01, "isolated": 5.5}
    assert times == {kind: pytest.approx([ms] * 4) for kind, ms in expected.items()}


def test_training_benchmark_processes_interleaved_and_merged(tmp_path: Path, monkeypatch) -> None:
    """``--processes 3``: every provider runs once per round, each round starting one provider later; a cell takes
    the median step time over the processes, their largest peak, and the first process's losses; a cell that failed
    in any process keeps the failure."""
    training = _load("benchmark_training")
    calls: list[str] = []
    step_ms = {"stock": iter([100.0, 140.0, 120.0]), "ours": iter([90.0, 80.0, 85.0])}

    def fake_process(provider: str, args) -> list[dict]:
        calls.append(provider)
        # liger succeeds in the first round only; stock and ours take their next step time
        ms = 1.0 if provider == "liger" else next(step_ms[provider])
        status = "OOM" if provider == "liger" and len(calls) > 3 else "ok"
        row = {"model": "m", "tokens": 512, "provider": provider, "status": status, "step_ms": ms}
        row.update(tokens_per_step=512, tokens_per_s=512 / (ms / 1e3), peak_bytes=int(ms), losses=[ms], step_times=[ms])
        return [row]

    monkeypatch.setattr(training, "run_provider_process", fake_process)
    monkeypatch.setattr(training, "finish", lambda data, out: None)
    argv = ["--device", "cpu", "--models", "tiny-llama", "--tokens", "512", "--providers", "stock,liger,ours"]
    assert training.main([*argv, "--processes", "3", "--out", str(tmp_path)]) == 0
    assert calls == ["stock", "liger", "ours", "liger", "ours", "stock", "ours", "stock", "liger"]
    rows = _by_provider(json.loads((tmp_path / "training.json").read_text())["results"])
    assert rows["stock"]["process_step_ms"] == [100.0, 140.0, 120.0]
    assert rows["stock"]["process_step_times"] == [[100.0], [140.0], [120.0]]
    assert rows["stock"]["step_ms"] == 120.0 and rows["stock"]["tokens_per_s"] == pytest.approx(512 / 0.120)
    assert rows["stock"]["peak_bytes"] == 140 and rows["stock"]["losses"] == [100.0]
    assert rows["ours"]["step_ms"] == 85.0
    assert rows["liger"]["status"] == "OOM"
    with pytest.raises(SystemExit):
        training.parse_args([*argv, "--processes", "0"])


def test_training_benchmark_processes_table_spread(tmp_path: Path) -> None:
    """Two real processes' worth (in this process) of one tiny configuration: the table shows the spread."""
    training = _load("benchmark_training")
    argv = ["--device", "cpu", "--models", "tiny-llama", "--tokens", "128", "--seq", "64", "--steps", "1"]
    argv += ["--warmup", "1", "--providers", "ours", "--no-isolate", "--threads", "1", "--processes", "2"]
    assert training.main([*argv, "--out", str(tmp_path)]) == 0
    row = _by_provider(json.loads((tmp_path / "training.json").read_text())["results"])["ours"]
    assert len(row["process_tokens_per_s"]) == 2 and row["status"] == "ok"
    table = (tmp_path / "training.md").read_text()
    assert "median over 2 processes" in table and "±" in table
