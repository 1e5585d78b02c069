"""``hf-flce sft`` and ``hf-flce dpo``: ``trl sft`` and ``trl dpo`` with hf_flce's trainers.

The arguments are exactly TRL's: the parser is TRL's own (``ScriptArguments``, ``SFTConfig``/``DPOConfig``,
``ModelConfig``, ``DatasetMixtureConfig``, ``--config`` YAML files), and bad arguments get TRL's errors. Like
``trl``, the ``hf-flce`` command launches the training through ``accelerate launch`` (arguments that TRL's parser
does not know, such as ``--num_processes`` or ``--accelerate_config``, go to accelerate). Each launched process runs
``python -m hf_flce.cli``, which trains in-process; so does ``accelerate launch -m hf_flce.cli sft ...``.
``HF_FLCE_DEFER_HEAD_GRAD=1`` gives the SFT trainer ``flce_defer_head_grad=True`` (TRL's parser has no place for it).

Example:
    hf-flce sft --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir out
    accelerate launch --num_processes 2 -m hf_flce.cli dpo --model_name_or_path ... --dataset_name ...
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("sft", "dpo")
# ``HF_FLCE_DEFER_HEAD_GRAD=1 hf-flce sft ...``: ``FLCESFTTrainer(flce_defer_head_grad=True)``
DEFER_HEAD_GRAD_ENV = "HF_FLCE_DEFER_HEAD_GRAD"


def make_parser(command: str, prog: str | None = None):
    """TRL's own parser for ``trl <command>`` (same dataclasses, same options)."""
    import trl.scripts.dpo
    import trl.scripts.sft

    module = {"sft": trl.scripts.sft, "dpo": trl.scripts.dpo}[command]
    return module.make_parser(prog=prog or f"hf-flce {command}")


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
    else:
        accepted = [("chosen", "rejected")]
    if not any(set(names) <= set(columns) for names in accepted):
        wanted = " or ".join(" and ".join(repr(n) for n in names) for names in accepted)
        raise ValueError(f"hf-flce {command}: the training dataset has columns {columns}; it needs {wanted}")


def train(
    command: str,
    script_args,
    training_args,
    model_args,
    dataset_args,
    *,
    dataset=None,
    model=None,
    trainer_cls=None,
    **kwargs,
):
    """What ``trl <command>`` does after parsing, with :class:`~hf_flce.FLCESFTTrainer` or
    :class:`~hf_flce.FLCEDPOTrainer`: build the model arguments, load the dataset (unless ``dataset`` is given),
    train, save, optionally push. ``model`` (an instance) replaces ``--model_name_or_path``, ``trainer_cls`` the
    trainer class (e.g. TRL's own, for comparisons); ``kwargs`` go to the trainer. Returns the trainer."""
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from .options import env_flag
    from .trainers import FLCEDPOTrainer, FLCESFTTrainer

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
    if trainer_cls is None:
        trainer_cls = FLCESFTTrainer if command == "sft" else FLCEDPOTrainer
        # hf_flce's own trainer option, which TRL's parser has no place for (the DPO trainer refuses it)
        if env_flag(DEFER_HEAD_GRAD_ENV):
            kwargs.setdefault("flce_defer_head_grad", True)
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
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
        rest, fail_with_unknown_args=False
    )
    train(command, script_args, training_args, model_args, dataset_args)
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
    sub = parser.add_subparsers(dest="command", metavar="{sft,dpo}")
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
