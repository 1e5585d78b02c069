"""``hf-flce sft|dpo|kto|grpo|rloo``: TRL's arguments and errors, hf_flce's trainers, launched like ``trl``."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import trl

from hf_flce import cli
from hf_flce.data import build_tiny_model, build_tokenizer, data_file, toy, toy_training_defaults
from hf_flce.data.toy import parse_example_args
from hf_flce.trainers import FLCEDPOTrainer, FLCEGRPOTrainer, FLCEKTOTrainer, FLCERLOOTrainer, FLCESFTTrainer

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
    # unpaired preferences for KTO (a completion and whether it is desirable), prompts only for GRPO and RLOO
    pairs = [json.loads(row) for row in data_file("preference").read_text().splitlines()[:20]]
    unpaired = [
        dict(prompt=p["prompt"], completion=p[key], label=key == "chosen")
        for p in pairs
        for key in p
        if key != "prompt"
    ]
    prompts = [dict(prompt=p["prompt"]) for p in pairs]
    for command, rows in (("kto", unpaired), ("grpo", prompts)):
        (root / command).mkdir()
        (root / command / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
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


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_parser_is_trls_plus_the_flce_options(command):
    ours, theirs = cli.make_parser(command), importlib.import_module(f"trl.scripts.{command}").make_parser()
    assert ours.dataclass_types == [*theirs.dataclass_types, cli.FLCEArguments]
    flce = [["--flce_backend", "--flce-backend"], ["--flce_memory_budget", "--flce-memory-budget"]]
    flce.append(["--flce_defer_head_grad", "--flce-defer-head-grad"])
    assert sorted(a.option_strings for a in ours._actions) == sorted([a.option_strings for a in theirs._actions] + flce)


@pytest.mark.parametrize("command", ["sft", "dpo", "grpo"])
def test_toy_defaults_name_fields_of_the_installed_config(command):
    """Each of the examples' defaults is a field of the installed TRL config: one the parser lacks (transformers
    renamed ``gradient_checkpointing`` to ``activation_checkpointing``) would come back as an extra namespace."""
    config_cls = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig}[command]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    defaults = toy_training_defaults(command)
    assert set(defaults) <= fields
    assert defaults.get("activation_checkpointing", defaults.get("gradient_checkpointing")) is False
    args = parse_example_args(command, ["--output_dir", "x"])
    assert args.embedded_model and args.embedded_data
    assert args.training.gradient_checkpointing is False
    if command == "grpo":
        assert args.script.reward_funcs == [toy.TOY_REWARD] and args.training.num_generations == 4
    else:
        assert args.training.max_length == 256


def test_grpo_example_reward_only_for_the_bundled_prompts():
    """The toy reward reads the bundled data's answers: it is the default only when no dataset is named, and a reward
    named on the command line replaces it."""
    assert parse_example_args("grpo", []).script.reward_funcs == [toy.TOY_REWARD]
    assert parse_example_args("grpo", ["--dataset_name", "trl-lib/DeepMath-103K"]).script.reward_funcs is None
    named = parse_example_args("grpo", ["--reward_funcs", "think_format_reward"])
    assert named.script.reward_funcs == ["think_format_reward"]
    assert toy.reference_word_overlap(
        [[{"role": "assistant", "content": "Grass is green!"}], "no"],
        [[{"role": "assistant", "content": "Grass is green."}]] * 2,
    ) == [1.0, 0.0]


def test_metrics_recorder_reports_the_median_interval_rate(monkeypatch):
    """tokens/s is the median of the logging intervals' rates after the first, so that the first step's compiles and a
    one-off slow step do not decide it; every step still counts in ``tokens_per_second_all``."""
    from types import SimpleNamespace

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


def test_kto_trains_with_our_trainer(workdir):
    parsed = cli.make_parser("kto").parse_args_and_config(_args(workdir, "kto", "--flce_backend", "torch"))
    trainer = cli.train("kto", *parsed)
    assert isinstance(trainer, FLCEKTOTrainer) and trainer.flce_backend == "torch"
    assert trainer.state.global_step == 2
    assert trainer.ref_model is not None


REWARDS_MODULE = """
def completion_length(completions, **kwargs):
    return [len(str(completion)) / 40.0 for completion in completions]
"""
ONLINE_RUN = ["--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "8"]


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    """A reward function in a module of the working directory, which ``--reward_funcs module.function`` imports."""
    module = f"rewards_{tmp_path.name}"
    (tmp_path / f"{module}.py").write_text(REWARDS_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return module


@pytest.mark.parametrize("command, trainer_cls", [("grpo", FLCEGRPOTrainer), ("rloo", FLCERLOOTrainer)])
def test_online_trainers_train_with_our_trainer(workdir, rewards_module, command, trainer_cls):
    """``hf-flce grpo|rloo`` take TRL's ``--reward_funcs``: a name of TRL's reward functions and a dotted path from the
    working directory; both rewards are logged, and the completions come from the policy."""
    rewards = ["--reward_funcs", "think_format_reward", f"{rewards_module}.completion_length"]
    argv = _args(workdir, "grpo", *ONLINE_RUN, *rewards, "--logging_steps", "1")
    trainer = cli.train(command, *cli.make_parser(command).parse_args_and_config(argv))
    assert isinstance(trainer, trainer_cls) and trainer.state.global_step == 2
    assert trainer.reward_funcs[0] is trl.rewards.think_format_reward
    assert trainer.reward_funcs[1] is sys.modules[rewards_module].completion_length
    logged = trainer.state.log_history[0]
    assert logged["rewards/completion_length/mean"] > 0
    assert "rewards/think_format_reward/mean" in logged


def test_rewards_are_trls(workdir, rewards_module, monkeypatch):
    """The rewards that ``trl grpo`` hands its trainer for the same arguments, captured from TRL's own script."""
    captured = {}

    class Captured(Exception):
        pass

    def capture(**kwargs):
        captured.update(kwargs)
        raise Captured

    monkeypatch.setattr(trl, "GRPOTrainer", capture)
    names = [
        "accuracy_reward",
        "think_format_reward",
        "get_soft_overlong_punishment",
        f"{rewards_module}.completion_length",
    ]
    argv = _args(workdir, "grpo", "--reward_model_name_or_path", str(workdir / "model"), "--reward_funcs", *names)
    parsed = cli.make_parser("grpo").parse_args_and_config(argv)
    with pytest.raises(Captured):
        importlib.import_module("trl.scripts.grpo").main(*parsed[:4])
    ours, theirs = cli.reward_functions(parsed[0]), captured["reward_funcs"]
    assert [type(r) for r in ours] == [type(r) for r in theirs]
    overlong = 3  # a new callable each time, equal by its settings
    assert vars(ours[overlong]) == vars(theirs[overlong]) and vars(ours[overlong])
    assert ours[:overlong] + ours[overlong + 1 :] == theirs[:overlong] + theirs[overlong + 1 :]


@pytest.mark.parametrize(
    "command, argv, match",
    [
        ("grpo", [], "grpo and rloo need --reward_funcs or --reward_model_name_or_path"),
        ("rloo", ["--reward_funcs", "no_such_reward"], "Could not load reward function 'no_such_reward'"),
        ("grpo", ["--dataset_name", "{sft}", "--reward_funcs", "think_format_reward"], "it needs 'prompt'"),
        ("kto", ["--dataset_name", "{sft}"], "it needs 'prompt' and 'completion' and 'label' or 'chosen' and"),
    ],
    ids=["no-reward", "unknown-reward", "grpo-columns", "kto-columns"],
)
def test_online_and_kto_errors(workdir, command, argv, match):
    argv = [a.format(sft=workdir / "sft") for a in argv]
    extra = [] if command == "kto" else ONLINE_RUN
    parsed = cli.make_parser(command).parse_args_and_config(
        _args(workdir, command.replace("rloo", "grpo"), *extra, *argv)
    )
    with pytest.raises(ValueError, match=match):
        cli.train(command, *parsed)


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
