"""``hf-flce <command>``: ``trl <command>`` with hf_flce's trainer, for sft, dpo, kto, grpo and rloo.

The arguments are TRL's: the parser is TRL's own (the script's ``ScriptArguments``, its ``SFTConfig``, ``DPOConfig``,
``KTOConfig``, ``GRPOConfig`` or ``RLOOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``, ``--config`` YAML files;
``grpo`` and ``rloo`` take TRL's ``--reward_funcs`` and ``--reward_model_name_or_path``), and bad arguments get TRL's
errors, plus :class:`FLCEArguments`, the trainers' own options (``--flce_backend``, ``--flce_memory_budget``,
``--flce_defer_head_grad``; also keys of the YAML file). Like ``trl``, the ``hf-flce`` command launches the training
through ``accelerate launch`` (arguments that the parser does not know, such as ``--num_processes`` or
``--accelerate_config``, go to accelerate). Each launched process runs ``python -m hf_flce.cli``, which trains
in-process; so does ``accelerate launch -m hf_flce.cli sft ...``.

Example:
    hf-flce sft --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir out
    hf-flce sft ... --flce_defer_head_grad --flce_memory_budget 536870912
    hf-flce grpo --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/DeepMath-103K --reward_funcs accuracy_reward
    accelerate launch --num_processes 2 -m hf_flce.cli dpo --model_name_or_path ... --dataset_name ...
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields
from typing import Literal

from .options import BACKENDS

COMMANDS = ("sft", "dpo", "kto", "grpo", "rloo")
# TRL's reward functions that ``--reward_funcs`` names (as ``trl grpo`` does); any other name is a dotted import path.
REWARD_FUNCTIONS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)
# ``HF_FLCE_DEFER_HEAD_GRAD=1 hf-flce sft ...``: as ``--flce_defer_head_grad``
DEFER_HEAD_GRAD_ENV = "HF_FLCE_DEFER_HEAD_GRAD"


@dataclass
class FLCEArguments:
    """The options of hf_flce's trainers that TRL's dataclasses have no place for, as command-line arguments and
    ``--config`` YAML keys. Each is the trainer's keyword of the same name (:class:`~hf_flce.FLCESFTTrainer`)."""

    flce_backend: Literal[BACKENDS] = field(
        default="auto", metadata={"help": "Kernels of the fused head: auto picks by device (triton on CUDA)."}
    )
    flce_memory_budget: int | None = field(
        default=None,
        metadata={"help": "Bytes of logits-sized buffers alive at once in the head (default: half the op's)."},
    )
    flce_defer_head_grad: bool = field(
        default=False,
        metadata={
            "help": f"SFT only: lm_head's weight gradient at the end of the backward (a lower peak for one more "
            f"GEMM). {DEFER_HEAD_GRAD_ENV}=1 sets it too."
        },
    )

    def changed(self) -> dict:
        """The options set to something other than their default."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


def make_parser(command: str, prog: str | None = None):
    """TRL's own parser for ``trl <command>`` (same dataclasses, same options), with :class:`FLCEArguments` last."""
    import importlib

    from trl import TrlParser

    module = importlib.import_module(f"trl.scripts.{command}")
    prog = prog or f"hf-flce {command}"
    return TrlParser((*module.make_parser(prog=prog).dataclass_types, FLCEArguments), prog=prog)


def _load_dataset(script_args, dataset_args):
    from accelerate.logging import get_logger
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        if script_args.dataset_name:
            get_logger(__name__).warning(
                "Both `datasets` and `dataset_name` are provided; `datasets` is used and `dataset_name` ignored."
            )
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    raise ValueError("Either `datasets` or `dataset_name` must be provided.")


def _check_columns(command: str, dataset, training_args) -> None:
    """A readable error for a dataset without the columns TRL needs (TRL fails deep in tokenization instead)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None or (getattr(training_args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset"):
        return  # unknown until iterated (streaming), or prepared by the caller
    if command == "sft":
        text = training_args.dataset_text_field
        accepted = [("messages",), ("conversations",), ("prompt", "completion"), (text,), ("input_ids",)]
    elif command == "dpo":
        accepted = [("chosen", "rejected")]
    elif command == "kto":
        accepted = [("prompt", "completion", "label"), ("chosen", "rejected")]
    else:
        accepted = [("prompt",)]
    if not any(set(names) <= set(columns) for names in accepted):
        wanted = " or ".join(" and ".join(repr(n) for n in names) for names in accepted)
        raise ValueError(f"hf-flce {command}: the training dataset has columns {columns}; it needs {wanted}")


def reward_functions(script_args) -> list:
    """``trl grpo``'s and ``trl rloo``'s rewards: the reward model's path, then each of ``--reward_funcs``, a name of
    :data:`REWARD_FUNCTIONS` or a dotted import path (looked up from the working directory, as TRL does)."""
    import importlib
    import os

    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name in REWARD_FUNCTIONS:
            import trl.rewards

            reward = getattr(trl.rewards, name)
            if name == "get_soft_overlong_punishment":  # a factory; TRL's scripts call it with these settings
                reward = reward(max_completion_len=1280, soft_punish_cache=256)
            rewards.append(reward)
        elif "." in name:
            module_name, attribute = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            rewards.append(getattr(importlib.import_module(module_name), attribute))
        else:
            raise ValueError(
                f"Could not load reward function {name!r}: expected one of {list(REWARD_FUNCTIONS)} or a dotted "
                "import path (module.function)"
            )
    if not rewards:
        raise ValueError("hf-flce: grpo and rloo need --reward_funcs or --reward_model_name_or_path")
    return rewards


def train(
    command: str,
    script_args,
    training_args,
    model_args,
    dataset_args,
    flce_args: FLCEArguments | None = None,
    *,
    dataset=None,
    model=None,
    trainer_cls=None,
    **kwargs,
):
    """What ``trl <command>`` does after parsing, with hf_flce's trainer for the command
    (:class:`~hf_flce.FLCESFTTrainer`, ``FLCEDPOTrainer``, ``FLCEKTOTrainer``, ``FLCEGRPOTrainer``,
    ``FLCERLOOTrainer``): build the model arguments, load the dataset (unless ``dataset`` is given), gather the
    rewards (``grpo``, ``rloo``; unless ``reward_funcs`` is given), train, save, optionally push. ``flce_args`` go to
    hf_flce's trainer. ``model`` (an instance) replaces ``--model_name_or_path``, ``trainer_cls`` the trainer class
    (e.g. TRL's own, for comparisons, which takes no ``flce_args``); ``kwargs`` go to the trainer. Returns the
    trainer."""
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from . import trainers
    from .options import env_flag
    from .trainers._common import FLCETrainerMixin

    init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,  # off unless --trust_remote_code
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
    if dataset is None:
        dataset = _load_dataset(script_args, dataset_args)

    _check_columns(command, dataset[script_args.dataset_train_split], training_args)
    flce_options = (flce_args or FLCEArguments()).changed()
    if trainer_cls is None:
        trainer_cls = getattr(trainers, f"FLCE{command.upper()}Trainer")
    if isinstance(trainer_cls, type) and issubclass(trainer_cls, FLCETrainerMixin):
        if env_flag(DEFER_HEAD_GRAD_ENV):
            flce_options.setdefault("flce_defer_head_grad", True)  # trainers with a per-token loss refuse it
        kwargs = {**flce_options, **kwargs}
    elif flce_options:
        names = ", ".join(f"--{name}" for name in flce_options)
        raise ValueError(f"{names}: options of hf_flce's trainers, which {trainer_cls.__name__} does not take")
    if command in ("grpo", "rloo") and "reward_funcs" not in kwargs:
        kwargs["reward_funcs"] = reward_functions(script_args)
    trainer = trainer_cls(
        model=model if model is not None else model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        **kwargs,
    )
    if command == "dpo" and script_args.ignore_bias_buffers:
        import torch

        # DDP cannot broadcast boolean buffers.
        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to https://huggingface.co/{trainer.hub_model_id}.")
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
    return trainer


def run_in_process(argv: list[str]) -> int:
    """Parse ``<command> <args>`` with TRL's parser and train in this process (one rank under accelerate)."""
    command, rest = _split_command(argv)
    if command is None:
        return 0
    parser = make_parser(command)
    train(command, *parser.parse_args_and_config(rest, fail_with_unknown_args=False))
    return 0


def _remove_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (the arguments TRL's parser left for accelerate)."""
    out, pending = [], iter(subsequence)
    expected = next(pending, None)
    for item in items:
        if expected is not None and item == expected:
            expected = next(pending, None)
        else:
            out.append(item)
    return out


def launch(argv: list[str]) -> int:
    """``hf-flce <command> <args>``: validate the arguments with TRL's parser, then ``accelerate launch -m
    hf_flce.cli <command> <training args>`` with the leftover arguments as accelerate's, as ``trl`` does."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    command, rest = _split_command(argv)
    if command is None:
        return 0
    parser = make_parser(command)
    *_, config_remaining, cli_remaining = parser.parse_args_and_config(
        rest, return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _remove_subsequence(rest, cli_remaining)
    accelerate_args = launch_command_parser().parse_args([*launch_args, "-m", "hf_flce.cli", command, *script_args])
    launch_command(accelerate_args)
    return 0


def _split_command(argv: list[str]) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(prog="hf-flce", description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        sub.add_parser(name, help=f"run `trl {name}` with hf_flce's trainer", add_help=False)
    args, _ = parser.parse_known_args(argv[:1])
    if args.command is None:
        parser.print_help()
        return None, []
    return args.command, argv[1:]


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``hf-flce``."""
    return launch(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(run_in_process(sys.argv[1:]))
