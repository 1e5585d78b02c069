"""``hf-flce sft`` / ``hf-flce dpo``: TRL's arguments and errors, hf_flce's trainers, launched like ``trl``."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import trl
import trl.scripts.dpo
import trl.scripts.sft

from hf_flce import cli
from hf_flce.data import build_tiny_model, build_tokenizer, data_file, toy_training_defaults
from hf_flce.data.toy import parse_example_args
from hf_flce.trainers import FLCEDPOTrainer, FLCESFTTrainer

TINY_RUN = ["--max_steps", "2", "--bf16", "false", "--report_to", "none", "--save_strategy", "no", "--use_cpu"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A saved tiny model with its tokenizer, and one dataset directory per command (``load_dataset(dir)``)."""
    root = tmp_path_factory.mktemp("cli")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    for command, name in (("sft", "sft_chat"), ("dpo", "preference")):
        (root / command).mkdir()
        rows = data_file(name).read_text().splitlines()[:40]
        (root / command / "train.jsonl").write_text("\n".join(rows) + "\n")
    return root


def _args(workdir, command, *extra):
    return [
        "--model_name_or_path",
        str(workdir / "model"),
        "--dataset_name",
        str(workdir / command),
        "--output_dir",
        str(workdir / f"out-{command}"),
        *TINY_RUN,
        *extra,
    ]


@pytest.mark.parametrize("command, trl_script", [("sft", trl.scripts.sft), ("dpo", trl.scripts.dpo)])
def test_parser_is_trls_plus_the_flce_options(command, trl_script):
    ours, theirs = cli.make_parser(command), trl_script.make_parser()
    assert ours.dataclass_types == [*theirs.dataclass_types, cli.FLCEArguments]
    flce = [["--flce_backend", "--flce-backend"], ["--flce_memory_budget", "--flce-memory-budget"]]
    flce.append(["--flce_defer_head_grad", "--flce-defer-head-grad"])
    assert sorted(a.option_strings for a in ours._actions) == sorted([a.option_strings for a in theirs._actions] + flce)


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_toy_defaults_name_fields_of_the_installed_config(command):
    """Each of the examples' defaults is a field of the installed TRL config: one the parser lacks (transformers
    renamed ``gradient_checkpointing`` to ``activation_checkpointing``) would come back as an extra namespace."""
    config_cls = trl.SFTConfig if command == "sft" else trl.DPOConfig
    fields = {f.name for f in dataclasses.fields(config_cls)}
    defaults = toy_training_defaults(command)
    assert set(defaults) <= fields
    assert defaults.get("activation_checkpointing", defaults.get("gradient_checkpointing")) is False
    args = parse_example_args(command, ["--output_dir", "x"])
    assert args.embedded_model and args.embedded_data
    assert args.training.gradient_checkpointing is False and args.training.max_length == 256


def test_metrics_recorder_reports_the_median_interval_rate(monkeypatch):
    """tokens/s is the median of the logging intervals' rates after the first, so that the first step's compiles and a
    one-off slow step do not decide it; every step still counts in ``tokens_per_second_all``."""
    from types import SimpleNamespace

    from hf_flce.data import toy

    clock = [0.0]
    monkeypatch.setattr(toy.time, "perf_counter", lambda: clock[0])
    recorder = toy.MetricsRecorder()
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    step_seconds = [5.0, 1, 1, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 2, 1]  # a compile, then a slow step in the second interval
    tokens = 0
    for i, seconds in enumerate(step_seconds, start=1):
        recorder.on_step_begin(None, state, None)
        clock[0] += seconds
        recorder.on_step_end(None, state, None)
        state.global_step, tokens = i, tokens + 100
        if i % 5 == 0:
            recorder.on_log(None, state, None, logs={"loss": 1.0, "num_tokens": tokens})
    summary = recorder.summary()
    assert summary["first_step_seconds"] == 5.0
    assert summary["tokens_per_second_all"] == pytest.approx(1500 / sum(step_seconds))
    assert summary["tokens_per_second"] == pytest.approx((500 / 13 + 500 / 6) / 2)  # intervals 6-10 and 11-15
    assert [log["train_seconds"] for log in summary["logs"]] == [9.0, 22.0, 28.0]


def test_flce_options_reach_our_trainer(workdir, tmp_path):
    """``--flce_*`` arguments, and the same keys in a ``--config`` YAML file, become the trainer's keywords; TRL's own
    trainer refuses them by name, and a backend that does not exist is the parser's error."""
    budget = ["--flce_memory_budget", "1048576"]
    parsed = cli.make_parser("sft").parse_args_and_config(_args(workdir, "sft", *budget, "--flce_defer_head_grad"))
    assert parsed[-1] == cli.FLCEArguments(flce_memory_budget=1 << 20, flce_defer_head_grad=True)
    trainer = cli.train("sft", *parsed)
    assert (trainer.flce_memory_budget, trainer.flce_defer_head_grad, trainer.flce_backend) == (1 << 20, True, "auto")
    assert trainer.state.global_step == 2
    config = tmp_path / "config.yaml"
    config.write_text("flce_backend: torch\nflce_memory_budget: 4096\n")
    parsed = cli.make_parser("dpo").parse_args_and_config(_args(workdir, "dpo", "--config", str(config)))
    assert parsed[-1].changed() == {"flce_backend": "torch", "flce_memory_budget": 4096}
    with pytest.raises(
        ValueError, match="--flce_backend, --flce_memory_budget: options of hf_flce's trainers, which DPOTrainer"
    ):
        cli.train("dpo", *parsed, trainer_cls=trl.DPOTrainer)
    with pytest.raises(SystemExit):
        cli.make_parser("sft").parse_args_and_config(_args(workdir, "sft", "--flce_backend", "cuda"))


def test_defer_head_grad_from_the_environment(workdir, monkeypatch):
    """``HF_FLCE_DEFER_HEAD_GRAD=1`` reaches ``FLCESFTTrainer``; the DPO trainer refuses it; a value that is not a
    flag is a ValueError naming the variable."""
    monkeypatch.setenv(cli.DEFER_HEAD_GRAD_ENV, "1")
    trainer = cli.train("sft", *cli.make_parser("sft").parse_args_and_config(_args(workdir, "sft")))
    assert trainer.flce_defer_head_grad and trainer.state.global_step == 2
    with pytest.raises(ValueError, match="flce_defer_head_grad=True is for FLCESFTTrainer"):
        cli.train("dpo", *cli.make_parser("dpo").parse_args_and_config(_args(workdir, "dpo")))
    monkeypatch.setenv(cli.DEFER_HEAD_GRAD_ENV, "yes")
    with pytest.raises(ValueError, match=f"{cli.DEFER_HEAD_GRAD_ENV} must be 1, 0, true or false"):
        cli.train("sft", *cli.make_parser("sft").parse_args_and_config(_args(workdir, "sft")))


def test_sft_trains_with_our_trainer(workdir):
    parser = cli.make_parser("sft")
    parsed = parser.parse_args_and_config(_args(workdir, "sft", "--loss_type", "dft"))
    trainer = cli.train("sft", *parsed)
    assert isinstance(trainer, FLCESFTTrainer)
    assert trainer.state.global_step == 2
    assert trainer.args.model_init_kwargs["trust_remote_code"] is False  # never on unless asked
    assert (workdir / "out-sft" / "config.json").exists()


def test_dpo_runs_in_process(workdir, monkeypatch):
    trainers = []
    monkeypatch.setattr(FLCEDPOTrainer, "train", lambda self, **kw: trainers.append(self))
    assert cli.run_in_process(["dpo", *_args(workdir, "dpo", "--loss_type", "sigmoid", "sft")]) == 0
    (trainer,) = trainers
    assert trainer.loss_types == ["sigmoid", "sft"]
    assert trainer.ref_model is not None  # loaded from the model path, like TRL


@pytest.mark.parametrize(
    "argv, error, match",
    [
        (["--model_name_or_path", "MODEL", "--output_dir", "OUT"], ValueError, "Either `datasets` or `dataset_name`"),
        (["--model_name_or_path", "MODEL", "--dataset_name", "MISSING"], FileNotFoundError, "missing"),
        (["--model_name_or_path", "DATA", "--dataset_name", "DATA"], ValueError, "Unrecognized model"),
    ],
    ids=["no-dataset", "missing-dataset-path", "not-a-model"],
)
def test_trl_errors(workdir, argv, error, match):
    paths = {"MODEL": workdir / "model", "DATA": workdir / "sft", "MISSING": workdir / "missing", "OUT": workdir / "o"}
    argv = [str(paths.get(a, a)) for a in argv] + TINY_RUN
    with pytest.raises(error, match=match):
        cli.run_in_process(["sft", *argv])


def test_unknown_loss_type_is_rejected_by_trls_parser(workdir, capsys):
    with pytest.raises(SystemExit):
        cli.run_in_process(["sft", *_args(workdir, "sft", "--loss_type", "bogus")])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "sft" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bogus"])


def test_launch_goes_through_accelerate(workdir, monkeypatch):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    args = _args(workdir, "sft")
    assert cli.main(["sft", "--num_processes", "2", *args]) == 0
    (accelerate_args,) = launched
    assert accelerate_args.module and accelerate_args.training_script == "hf_flce.cli"
    assert accelerate_args.num_processes == 2
    assert accelerate_args.training_script_args == ["sft", *args]


def test_remove_subsequence():
    assert cli._remove_subsequence(["a", "--x", "1", "b", "--x", "2"], ["--x", "2"]) == ["a", "1", "b", "--x"]


@pytest.mark.slow
def test_console_script_end_to_end(workdir):
    # next to this interpreter (a virtualenv's bin, not always on PATH), else on PATH
    exe = shutil.which("hf-flce", path=os.path.dirname(sys.executable)) or shutil.which("hf-flce")
    exe = exe or pytest.skip("hf-flce is not installed (pip install -e .)")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [exe, "sft", "--num_processes", "1", *_args(workdir, "sft")], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Training completed." in out.stdout
    # The module form, as `accelerate launch -m hf_flce.cli` runs it on each rank.
    out = subprocess.run([sys.executable, "-m", "hf_flce.cli", "dpo", *_args(workdir, "dpo")], env=env, text=True)
    assert out.returncode == 0
