"""Convergence on CPU in fp32: stock transformers/TRL against hf_flce, same seed, same data, every step compared.

* One tiny model per family (Llama, Qwen2 with tied embeddings, Qwen3, Mistral with a sliding window, Qwen3-MoE, Mixtral),
  trained with AdamW for 30 steps on the bundled prompt-completion text: right padding, prompts masked with -100,
  two micro-batches accumulated per step. Stock and ``apply_flce`` are compared on the loss of every step, every
  parameter after every step, the held-out log-probs and the fused eval loss.
* ``FLCESFTTrainer`` against ``trl.SFTTrainer`` and ``FLCEDPOTrainer`` against ``trl.DPOTrainer``, 20 steps each:
  every logged metric (eval included), every parameter after every step, and the held-out log-probs.

Tolerances come from ``convergence_utils.TOLERANCES["fp32-cpu"]``. Curves go to ``outputs/convergence/cpu`` (or
``$HF_FLCE_CONVERGENCE_OUT``) for ``scripts/convergence_report.py``. Run: ``make test-convergence``.
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
import torch
from convergence_utils import (
    FAMILY_CONFIGS,
    IGNORE_INDEX,
    TOLERANCES,
    Batch,
    Trajectory,
    build_model,
    compare_runs,
    eval_logprobs,
    first_bad_index,
    first_bad_snapshot,
    first_bad_value,
    fp64_verdict,
    logprob_problem,
    max_relative_difference,
    parameters_of,
    train,
    write_suite,
)
from transformers import TrainerCallback

from hf_flce import apply_flce
from hf_flce.data import build_tiny_model, build_tokenizer, data_file, load_toy_dataset

pytestmark = pytest.mark.slow

TOL = TOLERANCES["fp32-cpu"]
STEPS, ACCUM, MICRO_BATCH, LR = 30, 2, 8, 2e-3
TRAINER_STEPS = 20
HELD_OUT = 16
VOCAB = 1024  # the tokenizer's ~600 tokens, padded as real vocabularies are
# Families whose fused loss runs in several chunks (a small memory budget); the others take the default (one chunk).
CHUNKED = {"qwen2-tied": 1 << 18, "mistral-sliding": 1 << 17, "qwen3-moe": 1 << 18}
OUT = Path(os.environ.get("HF_FLCE_CONVERGENCE_OUT", "outputs/convergence/cpu"))
# Wall-clock keys of the Trainer's logs: the only ones that may differ.
TIMING_KEYS = {
    f"{split}_{what}" for split in ("train", "eval") for what in ("runtime", "samples_per_second", "steps_per_second")
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine they spin.
    threads, _ = torch.get_num_threads(), torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tokenize(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a prompt-completion row in the chat template, the prompt masked."""
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    assert full.startswith(prompt)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    completion_ids = tokenizer(full[len(prompt) :], add_special_tokens=False).input_ids
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-pad to the longest example; padding is masked in ``attention_mask`` and ``labels``."""
    width = max(len(ids) for ids, _ in examples)
    batch: Batch = {
        "input_ids": torch.full((len(examples), width), pad_id),
        "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
        "labels": torch.full((len(examples), width), IGNORE_INDEX),
    }
    for row, (ids, labels) in enumerate(examples):
        batch["input_ids"][row, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][row, : len(ids)] = 1
        batch["labels"][row, : len(ids)] = torch.tensor(labels)
    return batch


@pytest.fixture(scope="module")
def data(tokenizer) -> tuple[list[list[Batch]], Batch]:
    """``STEPS`` steps of ``ACCUM`` micro-batches from the bundled prompt-completion rows (shuffled, cycled), and
    a held-out batch made of the last ``HELD_OUT`` rows."""
    lines = data_file("sft_prompt_completion").read_text().splitlines()
    examples = [tokenize(tokenizer, json.loads(line)) for line in lines if line]
    train_rows, held_out = examples[:-HELD_OUT], examples[-HELD_OUT:]
    order = list(range(len(train_rows)))
    random.Random(0).shuffle(order)
    wanted = STEPS * ACCUM * MICRO_BATCH
    picked = [train_rows[order[i % len(order)]] for i in range(wanted)]
    micro = [collate(picked[i : i + MICRO_BATCH], tokenizer.pad_token_id) for i in range(0, wanted, MICRO_BATCH)]
    steps = [micro[i : i + ACCUM] for i in range(0, len(micro), ACCUM)]
    return steps, collate(held_out, tokenizer.pad_token_id)


def test_data_has_padding_masking_and_accumulation(data):
    steps, held_out = data
    assert len(steps) == STEPS and all(len(s) == ACCUM for s in steps)
    first = steps[0][0]
    assert (first["attention_mask"] == 0).any(), "no padding"
    scored = first["labels"] != IGNORE_INDEX
    assert (first["attention_mask"].bool() & ~scored).any(), "no masked prompt tokens"
    assert scored.any() and (held_out["labels"] != IGNORE_INDEX).any()


# --------------------------------------------------------------------------------------------- patched models
def _check(name: str, problems: list[str | None], record: dict) -> None:
    """Write the run's record (curves and problems) and fail with every problem, first divergences first."""
    problems = [p for p in problems if p]
    record.update(name=name, reference="stock", passed=not problems, problems=problems)
    write_suite(OUT / f"{name}.json", "cpu-fp32", [record], tolerance=TOL.__dict__)
    assert not problems, f"{name}: ours diverged from stock:\n  " + "\n  ".join(problems)


def _summary(ours: Trajectory, stock: Trajectory, ours_logp: torch.Tensor, stock_logp: torch.Tensor) -> dict:
    return {
        "max_loss_abs_diff": max(abs(a - b) for a, b in zip(ours.losses, stock.losses)),
        "max_param_rel_diff": max_relative_difference(ours.final, stock.final),
        "max_eval_logprob_abs_diff": float((ours_logp - stock_logp).abs().max()),
    }


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_patched_model_trains_like_stock(family, data):
    steps, held_out = data
    stock = build_model(family, VOCAB)
    initial = copy.deepcopy(stock)
    ours = apply_flce(copy.deepcopy(stock), memory_budget=CHUNKED.get(family))
    if family == "qwen2-tied":
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    stock_run = train(stock, steps, lr=LR, snapshot=True)
    ours_run = train(ours, steps, lr=LR, snapshot=True)
    stock_logp, ours_logp = eval_logprobs(stock, held_out), eval_logprobs(ours, held_out)
    # The fused path in eval mode (skip_logits=True) against the stock eval loss on the held-out batch.
    stock.eval(), ours.eval()
    with torch.no_grad():
        stock_eval = stock(**held_out).loss.item()
        ours_eval = ours(**held_out, skip_logits=True).loss.item()
    problems = [
        *compare_runs(ours_run, stock_run, TOL),
        logprob_problem(ours_logp, stock_logp, TOL),
        first_bad_value("fused eval loss", [ours_eval], [stock_eval], TOL.loss),
    ]
    arbiter = None
    if any(problems):  # tell fp32 rounding noise from a bug: judge both runs against float64
        within_noise, arbiter = fp64_verdict(initial, steps, LR, ours_run, stock_run)
        print(f"{family}: outside the table: {[p for p in problems if p]}; {arbiter}")
        problems = [] if within_noise else [*problems, arbiter]
    record = {
        "curves": {"stock": stock_run.losses, "ours": ours_run.losses},
        "grad_norms": {"stock": stock_run.grad_norms, "ours": ours_run.grad_norms},
        "summary": {
            **_summary(ours_run, stock_run, ours_logp, stock_logp),
            "eval_loss": {"stock": stock_eval, "ours": ours_eval},
            "memory_budget": CHUNKED.get(family),
        },
        "fp64_arbiter": arbiter,
    }
    _check(f"patch-{family}", problems, record)


# --------------------------------------------------------------------------------------------------- trainers
class Snapshots(TrainerCallback):
    """Every parameter after every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append(parameters_of(model))


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in log.items() if k not in TIMING_KEYS} for log in trainer.state.log_history]


def first_bad_log(ours: list[dict], stock: list[dict]) -> str | None:
    """The earliest logged value outside the tolerance: ``loss`` by the loss row, the rest by the metrics row."""
    if [sorted(o) for o in ours] != [sorted(s) for s in stock]:
        return f"logged different keys: ours {[sorted(o) for o in ours]}, stock {[sorted(s) for s in stock]}"
    found = []
    for key in dict.fromkeys(k for log in stock for k in log):
        steps, got, want = zip(*((s["step"], o[key], s[key]) for o, s in zip(ours, stock) if key in s))
        tol = TOL.loss if key in ("loss", "train_loss") else TOL.metrics
        index = first_bad_index(got, want, tol)
        if index is not None:
            found.append((steps[index], first_bad_value(f"logged {key}", got, want, tol, steps)))
    return min(found)[1] if found else None


def _curves(logs: list[dict], key: str) -> list[float]:
    return [log[key] for log in logs if key in log]


def _train_pair(make_trainer, held_out: Batch) -> tuple[list[str | None], dict]:
    """Train stock and ours (``make_trainer(fused) -> trainer``), then compare logs, parameters and log-probs."""
    runs = {}
    for label, fused in (("stock", False), ("ours", True)):
        trainer = make_trainer(fused)
        snapshots = Snapshots()
        trainer.add_callback(snapshots)
        trainer.train()
        trainer.evaluate()
        model = trainer.accelerator.unwrap_model(trainer.model)
        runs[label] = {
            "logs": _logs(trainer),
            "steps": snapshots.steps,
            "final": parameters_of(model),
            "logprobs": eval_logprobs(model, held_out),
        }
    ours, stock = runs["ours"], runs["stock"]
    assert len(stock["steps"]) == TRAINER_STEPS and _curves(stock["logs"], "loss")
    problems = [
        first_bad_log(ours["logs"], stock["logs"]),
        first_bad_snapshot(ours["steps"], stock["steps"], TOL.params),
        logprob_problem(ours["logprobs"], stock["logprobs"], TOL),
    ]
    keys = sorted({k for log in stock["logs"] for k in log if k not in ("step", "epoch")})
    record = {
        "curves": {label: _curves(run["logs"], "loss") for label, run in runs.items()},
        "metrics": {k: {label: _curves(run["logs"], k) for label, run in runs.items()} for k in keys},
        "summary": {
            "max_param_rel_diff": max_relative_difference(ours["final"], stock["final"]),
            "max_eval_logprob_abs_diff": float((ours["logprobs"] - stock["logprobs"]).abs().max()),
            "logged_keys": keys,
        },
    }
    return problems, record


def _trainer_args(config_cls, tmp_path: Path, **overrides):
    common = dict(
        output_dir=str(tmp_path),
        max_steps=TRAINER_STEPS,
        gradient_accumulation_steps=2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=10,
        per_device_eval_batch_size=8,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=False,
        use_cpu=True,
        dataloader_num_workers=0,
        max_length=128,
    )
    return config_cls(**{**common, **overrides})


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_sft_trainer_matches_trl(arch, tokenizer, data, tmp_path):
    from trl import SFTConfig, SFTTrainer

    from hf_flce import FLCESFTTrainer

    dataset = load_toy_dataset("sft_prompt_completion", test_size=HELD_OUT)
    args = _trainer_args(SFTConfig, tmp_path, per_device_train_batch_size=8, learning_rate=LR)

    def make(fused: bool):
        return (FLCESFTTrainer if fused else SFTTrainer)(
            model=build_tiny_model(tokenizer, arch=arch, vocab_size=VOCAB),
            args=args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            processing_class=tokenizer,
        )

    problems, record = _train_pair(make, data[1])
    _check(f"sft-{arch}", problems, record)


def test_dpo_trainer_matches_trl(tokenizer, data, tmp_path):
    from trl import DPOConfig, DPOTrainer

    from hf_flce import FLCEDPOTrainer

    dataset = load_toy_dataset("preference", test_size=HELD_OUT)
    args = _trainer_args(DPOConfig, tmp_path, per_device_train_batch_size=4, learning_rate=5e-4)

    def make(fused: bool):
        # The reference starts as the policy (same seed); each trainer gives it its own fused head.
        return (FLCEDPOTrainer if fused else DPOTrainer)(
            model=build_tiny_model(tokenizer, vocab_size=VOCAB),
            ref_model=build_tiny_model(tokenizer, vocab_size=VOCAB),
            args=args,
            train_dataset=dataset["train"],
            eval_dataset=dataset["test"],
            processing_class=tokenizer,
        )

    problems, record = _train_pair(make, data[1])
    _check("dpo-qwen2", problems, record)
