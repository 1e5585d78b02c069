"""Helpers shared by ``examples/sft.py``, ``examples/dpo.py``, ``examples/grpo.py`` and ``examples/demo.py``: TRL's
argument parser plus a few example options, the embedded tiny model and data (with the GRPO example's reward), and a
callback that records losses, throughput and peak memory."""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from . import build_tiny_model, build_tokenizer, load_toy_dataset, toy_training_defaults

TOY_DATASETS = {"sft": "sft_chat", "dpo": "preference", "grpo": "sft_prompt_completion"}
# The GRPO example's reward on the bundled prompts, as ``--reward_funcs`` names it.
TOY_REWARD = "hf_flce.data.toy.reference_word_overlap"


def reference_word_overlap(completions, solution, **kwargs) -> list[float]:
    """The share of the reference answer's words (``solution``, the bundled answers) that each completion contains:
    a reward in [0, 1] that a tiny model can raise, for the GRPO example."""

    def text(value) -> str:
        return value[-1]["content"] if isinstance(value, list) else str(value)

    rewards = []
    for completion, reference in zip(completions, solution, strict=True):
        wanted = {word.strip(".,!?").lower() for word in text(reference).split()}
        said = {word.strip(".,!?").lower() for word in text(completion).split()}
        rewards.append(len(wanted & said) / max(len(wanted), 1))
    return rewards


@dataclass
class ExampleArgs:
    """Everything an example needs: TRL's four argument dataclasses, hf_flce's trainer options and the example's own
    options."""

    script: object
    training: object
    model: object
    dataset: object
    flce: object
    stock_trl: bool = False
    metrics_json: str | None = None
    vocab_size: int | None = None
    embedded_model: bool = True
    embedded_data: bool = True
    extra: dict = field(default_factory=dict)


def parse_example_args(command: str, argv: list[str] | None = None) -> ExampleArgs:
    """Parse ``hf-flce <command>``'s arguments (TRL's, and hf_flce's trainer options) plus ``--stock_trl`` (run
    TRL's own trainer, for comparison), ``--metrics_json PATH`` and ``--vocab_size N`` (pad the tiny model's
    vocabulary). Without ``--model_name_or_path`` the tiny model is used, and the toy defaults of
    :func:`toy_training_defaults` apply."""
    from ..cli import make_parser

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--stock_trl", action="store_true")
    own.add_argument("--metrics_json")
    own.add_argument("--vocab_size", type=int)
    opts, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    parser = make_parser(command, prog=f"examples/{command}.py")
    embedded_model = not any(a.startswith("--model_name_or_path") for a in rest)
    if embedded_model:
        parser.set_defaults(**toy_training_defaults(command))
    script, training, model, dataset, flce = parser.parse_args_and_config(rest)
    embedded_data = not (script.dataset_name or dataset.datasets)
    if command == "grpo" and embedded_data and not (script.reward_funcs or script.reward_model_name_or_path):
        script.reward_funcs = [TOY_REWARD]  # it reads the bundled data's `solution` column
    return ExampleArgs(
        script=script,
        training=training,
        model=model,
        dataset=dataset,
        flce=flce,
        stock_trl=opts.stock_trl,
        metrics_json=opts.metrics_json,
        vocab_size=opts.vocab_size,
        embedded_model=embedded_model,
        embedded_data=embedded_data,
    )


def toy_model_and_data(command: str, args: ExampleArgs):
    """``(model, tokenizer, dataset)`` for the embedded default: tiny Qwen2 (or the given model path, with
    ``tokenizer`` None so that TRL loads it) and the bundled dataset (or None when a dataset was given)."""
    model = tokenizer = dataset = None
    if args.embedded_model:
        tokenizer = build_tokenizer()
        model = build_tiny_model(tokenizer, vocab_size=args.vocab_size, seed=args.training.seed)
    if args.embedded_data:
        dataset = load_toy_dataset(TOY_DATASETS[command], test_size=32)
        if command == "grpo":  # prompts, with the bundled answers as the reward's reference
            dataset = dataset.rename_column("completion", "solution")
    return model, tokenizer, dataset


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA allocations on a GPU, resident set size on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class MetricsRecorder(TrainerCallback):
    """Records every log (with the time spent in training steps so far), the training tokens per second and the peak
    memory; writes them as JSON at the end when ``path`` is set.

    ``tokens_per_second`` is the steady rate: the median, over the logging intervals after the first, of the
    ``num_tokens`` gained in the interval over the time spent in its training steps. That leaves out one-time work
    (on a GPU, Triton compiles each kernel at the first step, and the first step at a new batch shape is slow, much
    slower in a fresh machine's first process), which would otherwise decide a short run's rate.
    ``tokens_per_second_all`` counts every step, and ``first_step_seconds`` is the first step alone."""

    def __init__(self, path: str | None = None, label: str = "") -> None:
        self.path, self.label = path, label
        self.logs: list[dict] = []
        self.train_seconds = 0.0
        self.first_step_seconds: float | None = None
        self._marks: list[tuple[float, float]] = []  # (train_seconds, num_tokens) at each log that has num_tokens
        self._step_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._step_start
        if self.first_step_seconds is None:
            self.first_step_seconds = seconds
        self.train_seconds += seconds

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, **(logs or {}), "train_seconds": self.train_seconds})
        if logs and "num_tokens" in logs:
            self._marks.append((self.train_seconds, float(logs["num_tokens"])))

    def summary(self) -> dict:
        tokens = max((log.get("num_tokens", 0) for log in self.logs), default=0)
        overall = tokens / self.train_seconds if self.train_seconds else 0.0
        rates = [(n1 - n0) / (t1 - t0) for (t0, n0), (t1, n1) in itertools.pairwise(self._marks) if t1 > t0]
        steady = statistics.median(rates) if rates else overall
        return {
            "label": self.label,
            "logs": self.logs,
            "train_seconds": self.train_seconds,
            "tokens_per_second": steady,
            "tokens_per_second_all": overall,
            "first_step_seconds": self.first_step_seconds,
            "peak_memory_bytes": peak_memory_bytes(),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        }

    def on_train_end(self, args, state, control, **kwargs):
        if self.path and state.is_world_process_zero:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(json.dumps(self.summary(), indent=1))


def run_example(command: str, trainer_cls, stock_cls, argv: list[str] | None = None) -> dict:
    """Parse the example's arguments, then do what ``hf-flce <command>`` does (build ``trainer_cls``, or
    ``stock_cls`` with ``--stock_trl``, train, save) on the embedded tiny model and data unless a model or dataset
    is named. Returns the :class:`MetricsRecorder` summary."""
    from ..cli import train

    args = parse_example_args(command, argv)
    model, tokenizer, dataset = toy_model_and_data(command, args)
    cls = stock_cls if args.stock_trl else trainer_cls
    recorder = MetricsRecorder(args.metrics_json, label=cls.__name__)
    extra = {}
    if command == "dpo" and model is not None and not args.model.use_peft:
        # A model instance has no path to load the reference from: give a frozen copy (PEFT disables the adapter).
        extra["ref_model"] = copy.deepcopy(model)
    if command == "grpo" and model is not None and args.training.beta and not args.model.use_peft:
        # GRPO's KL term loads its reference model from the policy's path: save the tiny model and train from there.
        path = Path(args.training.output_dir) / "initial-model"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        model, tokenizer = str(path), None
    train(
        command,
        args.script,
        args.training,
        args.model,
        args.dataset,
        args.flce,
        dataset=dataset,
        model=model,
        trainer_cls=cls,
        processing_class=tokenizer,
        callbacks=[recorder],
        **extra,
    )
    return recorder.summary()
