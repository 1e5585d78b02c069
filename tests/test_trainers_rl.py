"""FLCEGRPOTrainer, FLCERLOOTrainer and FLCEKTOTrainer against TRL's trainers: same seed, fp32 CPU, every logged value.

As in ``test_trainers.py``, each comparison trains a tiny model with TRL's trainer and with ours from the same seed and
data. The completions are sampled by the stock forward, so both runs see the same ones; every logged value (rewards,
KL, entropy, clip ratios, the loss and the gradient norm) must agree to rtol 1e-5, and so must the weights after the
last step (SGD, so they move by the gradients themselves).
"""

from __future__ import annotations

import pytest
import torch
from test_trainers import LogRecorder, _base_args, assert_logs_match
from trl import GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RLOOConfig, RLOOTrainer
from trl.data_utils import unpair_preference_dataset

from hf_flce import FLCEGRPOTrainer, FLCEKTOTrainer, FLCERLOOTrainer
from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
from hf_flce.trainers import head

PROMPT_ROWS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def completion_length_reward(completions, **kwargs) -> list[float]:
    """Rewards that differ within each group, so that the advantages (and the policy gradient) are not zero."""
    return [len(str(completion)) / 40.0 for completion in completions]


def _prompts():
    return load_toy_dataset("sft_prompt_completion").select(range(PROMPT_ROWS)).remove_columns("completion")


def run_online(trainer_cls, config_cls, tokenizer, tmp_path, *, model_path=False, peft_config=None, **overrides):
    """Train with an online trainer (GRPO or RLOO); returns its logs and its policy's weights."""
    recorder = LogRecorder()
    model = build_tiny_model(tokenizer)
    if model_path:  # a reference model is then loaded from the same path
        model.save_pretrained(tmp_path / "model")
        tokenizer.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    defaults = dict(
        eval_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=10,
        optim="sgd",
        learning_rate=0.1,
    )
    args = _base_args(config_cls, tmp_path / "run", **{**defaults, **overrides})
    trainer = trainer_cls(
        model=model,
        reward_funcs=completion_length_reward,
        args=args,
        train_dataset=_prompts(),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[recorder],
    )
    trainer.train()
    return recorder.logs, trainer


def assert_same_weights(stock_trainer, our_trainer) -> None:
    stock = dict(stock_trainer.model.named_parameters())
    ours = dict(our_trainer.model.named_parameters())
    assert stock.keys() == ours.keys()
    moved = 0
    for name, value in stock.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved += value.requires_grad
    assert moved


def _compare_online(trainer_pair, config_cls, tokenizer, tmp_path, **kwargs):
    stock_cls, our_cls = trainer_pair
    stock, stock_trainer = run_online(stock_cls, config_cls, tokenizer, tmp_path / "stock", **kwargs)
    ours, our_trainer = run_online(our_cls, config_cls, tokenizer, tmp_path / "ours", **kwargs)
    assert_logs_match(stock, ours)
    assert_same_weights(stock_trainer, our_trainer)
    assert stock[0]["grad_norm"] > 0
    return ours, our_trainer


GRPO = (GRPOTrainer, FLCEGRPOTrainer)
RLOO = (RLOOTrainer, FLCERLOOTrainer)


def test_grpo_default(tokenizer, tmp_path):
    _, trainer = _compare_online(GRPO, GRPOConfig, tokenizer, tmp_path)
    assert head.has_flce_head(trainer.model) and trainer.ref_model is None


def test_grpo_kl_to_a_reference_model(tokenizer, tmp_path):
    logs, trainer = _compare_online(GRPO, GRPOConfig, tokenizer, tmp_path, model_path=True, beta=0.5)
    assert head.has_flce_head(trainer.ref_model)
    assert any(row.get("kl", 0.0) > 0 for row in logs)


def test_grpo_several_iterations_clip_the_ratio(tokenizer, tmp_path):
    # the second iteration's ratio to the old policy's log-probs (a no-grad pass of the fused head) is not 1
    logs, _ = _compare_online(
        GRPO, GRPOConfig, tokenizer, tmp_path, max_steps=4, num_iterations=2, epsilon=0.02, loss_type="grpo"
    )
    assert any(row.get("clip_ratio/region_mean", 0.0) > 0 for row in logs)


def test_grpo_entropy_bonus_and_temperature(tokenizer, tmp_path):
    # entropy_coef makes the entropy part of the loss: the op's per-token entropy gradient
    _compare_online(GRPO, GRPOConfig, tokenizer, tmp_path, entropy_coef=0.5, temperature=0.7, loss_type="dr_grpo")


def test_grpo_lm_head_in_float32(tokenizer, tmp_path):
    _compare_online(GRPO, GRPOConfig, tokenizer, tmp_path, cast_lm_head_to_fp32=True)


def test_grpo_peft_reference_is_the_base_model(tokenizer, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    _compare_online(GRPO, GRPOConfig, tokenizer, tmp_path, peft_config=lora, beta=0.5)


def test_rloo(tokenizer, tmp_path):
    _, trainer = _compare_online(RLOO, RLOOConfig, tokenizer, tmp_path, model_path=True, beta=0.5)
    assert head.has_flce_head(trainer.ref_model)


def run_kto(trainer_cls, tokenizer, tmp_path, **overrides):
    recorder = LogRecorder()
    data = load_toy_dataset("preference", test_size=16)
    data = {
        split: unpair_preference_dataset(rows).map(lambda row: row, new_fingerprint=f"{trainer_cls.__name__}-{split}")
        for split, rows in data.items()
    }
    trainer = trainer_cls(
        model=build_tiny_model(tokenizer),
        ref_model=build_tiny_model(tokenizer),
        args=_base_args(
            KTOConfig, tmp_path, optim="sgd", learning_rate=0.1, per_device_train_batch_size=8, **overrides
        ),
        train_dataset=data["train"].select(range(32)),
        eval_dataset=data["test"],
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    trainer.train()
    return recorder.logs, trainer


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto(tokenizer, tmp_path, loss_type):
    stock, stock_trainer = run_kto(KTOTrainer, tokenizer, tmp_path / "stock", loss_type=loss_type)
    ours, our_trainer = run_kto(FLCEKTOTrainer, tokenizer, tmp_path / "ours", loss_type=loss_type)
    assert_logs_match(stock, ours, beta=our_trainer.beta)
    assert_same_weights(stock_trainer, our_trainer)
    assert head.has_flce_head(our_trainer.ref_model)


@pytest.mark.parametrize("trainer_cls", [FLCEGRPOTrainer, FLCERLOOTrainer, FLCEKTOTrainer])
def test_defer_head_grad_is_refused(trainer_cls):
    with pytest.raises(ValueError, match="flce_defer_head_grad=True is for FLCESFTTrainer"):
        trainer_cls(model=None, flce_defer_head_grad=True)
