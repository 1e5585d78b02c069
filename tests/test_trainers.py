"""FLCESFTTrainer and FLCEDPOTrainer against stock TRL: same seed, fp32 CPU, two steps, every logged value.

Each comparison trains a tiny model with TRL's trainer and with ours on the same data and seed, and requires every
logged value (train and eval) to agree to rtol 1e-5. DPO runs use SGD: Adam's first step moves each weight by about
``lr * sign(grad)``, which turns rounding-level gradient differences in near-zero entries into lr-sized weight
differences; gradient accuracy itself is checked against float64 in ``test_dpo_gradients_match_float64``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from unittest import mock

import pytest
import torch
import transformers
from test_patches import (
    VISION_LANGUAGE,
    assert_same_gradients,
    image_batch,
    make_batch,
    make_model,
    make_vision_language_model,
)
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer, SFTConfig, SFTTrainer
from trl.trainer.utils import add_fused_lm_head

from hf_flce import FLCEDPOTrainer, FLCEGRPOTrainer, FLCEKTOTrainer, FLCERLOOTrainer, FLCESFTTrainer
from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
from hf_flce.patches.late_head_grad import LateHeadGrad
from hf_flce.trainers import add_flce_lm_head
from hf_flce.trainers.compat import trl_problems

RTOL, ATOL = 1e-5, 1e-6
UNCOMPARED = ("runtime", "per_second", "epoch", "step_time")
TRAIN_ROWS = 48  # a few steps need few rows; tokenizing (and precomputing reference log-probs) costs per row
ALL_DPO_LOSSES = [
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


class LogRecorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _base_args(config_cls, tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    return config_cls(**{**defaults, **overrides})


def run_sft(cls, tokenizer, tmp_path, *, arch="qwen2", dataset="sft_chat", model=None, **overrides):
    recorder = LogRecorder()
    data = load_toy_dataset(dataset, test_size=16)
    trainer = cls(
        model=model if model is not None else build_tiny_model(tokenizer, arch=arch),
        args=_base_args(SFTConfig, tmp_path, **overrides),
        train_dataset=data["train"].select(range(TRAIN_ROWS)),
        eval_dataset=data["test"],
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    trainer.train()
    return recorder.logs, trainer


def run_dpo(cls, tokenizer, tmp_path, *, arch="qwen2", reference="ref_model", peft_config=None, **overrides):
    recorder = LogRecorder()
    # Own fingerprints: TRL caches precomputed reference log-probs by dataset fingerprint and model hash, and the
    # second trainer must compute them rather than read the first one's.
    data = {
        split: rows.map(lambda row: row, new_fingerprint=f"{cls.__name__}-{split}")
        for split, rows in load_toy_dataset("preference", test_size=16).items()
    }
    model = build_tiny_model(tokenizer, arch=arch)
    extra = {}
    if reference == "ref_model":
        extra["ref_model"] = build_tiny_model(tokenizer, arch=arch)
    elif reference == "path":
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    trainer = cls(
        model=model,
        args=_base_args(DPOConfig, tmp_path, optim="sgd", learning_rate=0.1, **overrides),
        train_dataset=data["train"].select(range(TRAIN_ROWS)),
        eval_dataset=data["test"],
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[recorder],
        **extra,
    )
    trainer.train()
    return recorder.logs, trainer


def assert_logs_match(stock: list[dict], ours: list[dict], beta: float | None = None) -> None:
    assert len(stock) == len(ours) and stock
    for row_stock, row_ours in zip(stock, ours, strict=True):
        assert set(row_stock) == set(row_ours)
        logps = [abs(v) for k, v in row_stock.items() if "logps/" in k]
        for key, expected in row_stock.items():
            if key.endswith(UNCOMPARED):
                continue
            atol = ATOL
            if beta is not None and "rewards/" in key and not key.endswith("accuracies"):
                # beta * (logp - ref_logp): both sums carry rtol-level rounding, and the difference cancels it.
                atol = max(ATOL, RTOL * beta * max(logps, default=0.0))
            assert math.isclose(row_ours[key], expected, rel_tol=RTOL, abs_tol=atol), (key, expected, row_ours[key])


def _compare_sft(tokenizer, tmp_path, **kwargs):
    stock, _ = run_sft(SFTTrainer, tokenizer, tmp_path / "stock", **kwargs)
    ours, trainer = run_sft(FLCESFTTrainer, tokenizer, tmp_path / "ours", **kwargs)
    assert_logs_match(stock, ours)
    return ours, trainer


def _compare_dpo(tokenizer, tmp_path, **kwargs):
    stock, _ = run_dpo(DPOTrainer, tokenizer, tmp_path / "stock", **kwargs)
    ours, trainer = run_dpo(FLCEDPOTrainer, tokenizer, tmp_path / "ours", **kwargs)
    assert_logs_match(stock, ours, beta=trainer.beta)
    return ours, trainer


# ---------------------------------------------------------------- TRL internals and API surface


def test_trl_internals_we_rely_on_are_present():
    assert trl_problems() == []


def test_trl_internals_check_names_a_trainer_that_stopped_using_the_fused_head():
    import trl.trainer.grpo_trainer as trl_grpo

    real = inspect.getsource

    def source_without_the_head_call(obj):
        text = real(obj)
        return text.replace("fused_lm_head=True", "fused_lm_head=False") if obj is trl_grpo else text

    with mock.patch("hf_flce.trainers.compat.inspect.getsource", source_without_the_head_call):
        assert trl_problems() == ["trl.trainer.grpo_trainer no longer calls the model with fused_lm_head=True"]


@pytest.mark.parametrize(
    "ours, stock",
    [
        (FLCESFTTrainer, SFTTrainer),
        (FLCEDPOTrainer, DPOTrainer),
        (FLCEKTOTrainer, KTOTrainer),
        (FLCEGRPOTrainer, GRPOTrainer),
        (FLCERLOOTrainer, RLOOTrainer),
    ],
)
def test_constructor_takes_everything_trl_does(ours, stock):
    trl_params = list(inspect.signature(stock.__init__).parameters)
    our_params = list(inspect.signature(ours.__init__).parameters)
    assert our_params[: len(trl_params)] == trl_params
    assert our_params[len(trl_params) :] == ["flce_backend", "flce_memory_budget", "flce_defer_head_grad"]
    assert issubclass(ours, stock)


# ---------------------------------------------------------------- the fused head against TRL's


def _heads(tokenizer, **config):
    models = [build_tiny_model(tokenizer), build_tiny_model(tokenizer)]
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    for model in models:
        for key, value in config.items():
            setattr(model.config, key, value)
    add_fused_lm_head(models[0], outputs=fields)
    add_flce_lm_head(models[1], outputs=fields)
    return models, fields


@pytest.mark.parametrize(
    "config", [{}, {"final_logit_softcapping": 3.0, "logit_scale": 0.5}], ids=["plain", "scale+softcap"]
)
@pytest.mark.parametrize("shifted", [True, False], ids=["labels", "shift_labels"])
def test_head_matches_trl_contract(tokenizer, config, shifted):
    (stock, ours), fields = _heads(tokenizer, **config)
    ids = torch.randint(0, len(tokenizer), (3, 11))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 7:] = -100
    key = "labels" if shifted else "shift_labels"
    out_stock = stock(input_ids=ids, fused_lm_head=True, **{key: labels})
    out_ours = ours(input_ids=ids, fused_lm_head=True, **{key: labels})
    for name in (*fields, "label_mask", "loss"):
        a, b = getattr(out_stock, name), getattr(out_ours, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(b, a, rtol=RTOL, atol=2e-6, msg=name)
    # Differentiable log-probabilities and entropy: same gradients through a per-token upstream.
    weights = torch.rand_like(out_stock.log_probs)
    for out in (out_stock, out_ours):
        ((out.log_probs * weights).sum() + out.entropy.sum()).backward()
    for (name, p_stock), p_ours in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p_ours.grad, p_stock.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "name", ["Llama4ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "OPTForCausalLM", "FalconH1ForCausalLM"]
)
def test_head_calls_the_decoder_the_class_calls(name):
    """The head calls the decoder the stock forward calls where it is not ``base_model``'s: Llama 4's text model
    (whose ``base_model_prefix``, ``language_model``, names no attribute, so ``base_model`` is the model itself), and
    where it is not ``model``: GPT-2's ``transformer``, GPT-NeoX's ``gpt_neox`` (OPT's ``model`` calls its
    ``model.decoder``); Falcon-H1 scales its logits. The scalar NLL and every gradient are stock's."""
    stock = make_model(name)
    ours = copy.deepcopy(stock)
    add_flce_lm_head(ours)
    ids, labels = make_batch()
    stock(input_ids=ids, labels=labels).loss.backward()
    ours(input_ids=ids, labels=labels, fused_lm_head=True, fused_loss_type="nll").token_loss.backward()
    assert_same_gradients(
        {n: p.grad for n, p in ours.named_parameters() if p.grad is not None},
        {n: p.grad for n, p in stock.named_parameters() if p.grad is not None},
    )


def test_head_without_a_decoder_is_a_clear_error():
    """A model of a class the registry does not know, whose ``base_model_prefix`` names no attribute (as Llama 4's
    text model's does), is refused by name, not called as its own decoder."""

    class CustomLM(transformers.LlamaPreTrainedModel):
        base_model_prefix = "backbone"

        def __init__(self, config):
            super().__init__(config)
            self.decoder = transformers.LlamaModel(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    model = CustomLM(make_model("LlamaForCausalLM").config)
    add_flce_lm_head(model)
    ids, labels = make_batch()
    with pytest.raises(ValueError, match="CustomLM has no decoder at `backbone`"):
        model(input_ids=ids, labels=labels, fused_lm_head=True, fused_loss_type="nll")


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
def test_head_on_vision_language_models(name):
    """The trainers' head on the vision-language models the patchers take (their images passed to the backbone):
    TRL's head's per-token fields, and the scalar NLL (plus an MoE model's aux loss) with every gradient as stock's loss
    has them."""
    stock = make_vision_language_model(name, tie=False)
    trl_head, ours = copy.deepcopy(stock), copy.deepcopy(stock)
    fields = ("log_probs", "entropy", "is_top1")
    add_fused_lm_head(trl_head, outputs=fields)
    add_flce_lm_head(ours, outputs=fields)
    inputs = image_batch(name)
    with torch.no_grad():
        out_trl = trl_head(**inputs, fused_lm_head=True)
        out_ours = ours(**inputs, fused_lm_head=True)
    for field in (*fields, "label_mask", "loss"):
        torch.testing.assert_close(getattr(out_ours, field), getattr(out_trl, field), rtol=RTOL, atol=2e-6, msg=field)
    ref = stock(**inputs)
    ref.loss.backward()
    out = ours(**inputs, fused_lm_head=True, fused_loss_type="nll")
    # an MoE model's loss adds the weighted load-balancing loss, as stock's does
    (out.token_loss if getattr(ref, "aux_loss", None) is None else out.loss).backward()
    assert_same_gradients(
        {n: p.grad for n, p in ours.named_parameters() if p.grad is not None},
        {n: p.grad for n, p in stock.named_parameters() if p.grad is not None},
    )


def tiny_llava_with_processor():
    """A tiny LLaVA (one-layer CLIP tower, 8x8 images in four patches) with a ``LlavaProcessor`` built offline: the
    bundled tokenizer plus an ``<image>`` token and a chat template that places it where a message has an image."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' %}{{- '<image>' }}{%- else %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    images = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    # CLIP's class token counts as an extra image token, which the "default" strategy then drops: 4 tokens per image
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=4,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=template,
    )
    # test_patches' tiny LLaVA, with this tokenizer's vocabulary and image token
    _, settings = VISION_LANGUAGE["LlavaForConditionalGeneration"]
    text = dict(settings["text_config"], vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(**dict(settings, text_config=text, image_token_index=image_token), tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config), processor


def image_chat_rows(n: int, preference: bool):
    """``n`` rows of one 8x8 image and a question about it: a conversation (SFT), or a prompt with a chosen and a
    rejected answer (DPO)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    colours = ("red", "green", "blue")
    rows = []
    for i in range(n):
        question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour of image {i}?"}]}]
        answers = [
            [{"role": "assistant", "content": [{"type": "text", "text": f"Mostly {colours[(i + k) % 3]}."}]}]
            for k in (0, 1)
        ]
        text = (
            dict(prompt=question, chosen=answers[0], rejected=answers[1])
            if preference
            else dict(messages=question + answers[0])
        )
        rows.append({"images": [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))], **text})
    return Dataset.from_list(rows)


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_trains_a_vision_language_model_like_trl(task, tmp_path):
    """TRL's vision-language path (a processor, images in the dataset, its vision collator): the images reach the
    backbone through the fused head, and every logged value, train and eval, is stock TRL's."""
    model, processor = tiny_llava_with_processor()
    rows = image_chat_rows(20, preference=task == "dpo")
    pairs = {"sft": (SFTConfig, SFTTrainer, FLCESFTTrainer), "dpo": (DPOConfig, DPOTrainer, FLCEDPOTrainer)}
    config_cls, stock_cls, ours_cls = pairs[task]
    extra = dict(optim="sgd", learning_rate=0.1) if task == "dpo" else {}  # SGD: see the module's docstring
    logs = {}
    for name, cls in (("stock", stock_cls), ("ours", ours_cls)):
        recorder = LogRecorder()
        trainer = cls(
            model=copy.deepcopy(model),
            args=_base_args(config_cls, tmp_path / name, max_steps=3, eval_steps=3, max_length=None, **extra),
            train_dataset=rows.select(range(12)),
            eval_dataset=rows.select(range(12, 20)),
            processing_class=processor,
            callbacks=[recorder],
            **({"ref_model": copy.deepcopy(model)} if task == "dpo" else {}),
        )
        trainer.train()
        logs[name] = recorder.logs
    assert any("eval_loss" in row for row in logs["ours"])
    assert_logs_match(logs["stock"], logs["ours"], beta=trainer.beta if task == "dpo" else None)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_head_scalar_loss_types(tokenizer, loss_type, monkeypatch):
    from hf_flce import engine

    def no_recompute(*args, **kwargs):
        raise AssertionError("SFT nll/dft must take the three-GEMM path, not the per-token recompute")

    monkeypatch.setattr(engine, "_recompute_grads", no_recompute)
    (stock, ours), _ = _heads(tokenizer)
    ids = torch.randint(0, len(tokenizer), (2, 9))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    out = stock(input_ids=ids, labels=labels, fused_lm_head=True)
    per_token = -out.log_probs * (out.log_probs.exp().detach() if loss_type == "dft" else 1.0)
    (per_token.sum() / 7).backward()
    mine = ours(input_ids=ids, labels=labels, fused_lm_head=True, fused_loss_type=loss_type, num_items_in_batch=7)
    mine.token_loss.backward()
    assert not mine.log_probs.requires_grad and not mine.entropy.requires_grad
    torch.testing.assert_close(mine.token_loss, per_token.sum() / 7, rtol=RTOL, atol=ATOL)
    for p_stock, p_ours in zip(stock.parameters(), ours.parameters()):
        torch.testing.assert_close(p_ours.grad, p_stock.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("upcast", [False, True], ids=["", "cast_lm_head_to_fp32"])
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_head_defers_the_head_grad(tokenizer, loss_type, upcast):
    """``defer_head_grad=True``: the loss and every gradient as the default head's, with lm_head's weight gradient
    accumulated after the layers' instead of first. TRL's per-token contract (DPO's) is refused where it would take a
    gradient, as is a non-bool."""
    models = [build_tiny_model(tokenizer), build_tiny_model(tokenizer)]
    order = []
    for defer, model in zip((False, True), models):
        add_flce_lm_head(model, cast_lm_head_to_fp32=upcast, defer_head_grad=defer)
        for name, param in (("head", model.lm_head.weight), ("layer", model.model.layers[-1].mlp.down_proj.weight)):
            param.register_post_accumulate_grad_hook(lambda _, name=name, defer=defer: order.append((defer, name)))
    ids = torch.randint(0, len(tokenizer), (2, 9))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    outs = [
        model(input_ids=ids, labels=labels, fused_lm_head=True, fused_loss_type=loss_type, num_items_in_batch=7)
        for model in models
    ]
    for out in outs:
        out.token_loss.backward()
    torch.testing.assert_close(outs[1].token_loss, outs[0].token_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outs[1].entropy, outs[0].entropy, rtol=RTOL, atol=ATOL)
    for (name, p_default), p_deferred in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(p_deferred.grad, p_default.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert order == [(False, "head"), (False, "layer"), (True, "layer"), (True, "head")]
    with pytest.raises(ValueError, match="defer_head_grad=True needs a scalar loss"):
        models[1](input_ids=ids, labels=labels, fused_lm_head=True)
    with torch.no_grad():  # nothing to defer: TRL's per-token contract, as evaluation asks for it
        assert models[1](input_ids=ids, labels=labels, fused_lm_head=True).log_probs.shape == (2, 8)
    with pytest.raises(TypeError, match="defer_head_grad must be a bool"):
        add_flce_lm_head(models[0], defer_head_grad=1)


def test_head_under_no_grad_and_generation(tokenizer):
    (_, ours), _ = _heads(tokenizer)
    ids = torch.randint(0, len(tokenizer), (2, 6))
    with torch.no_grad():
        out = ours(input_ids=ids, labels=ids, fused_lm_head=True)
    assert not out.log_probs.requires_grad and not out.loss.requires_grad
    assert ours(input_ids=ids).logits.shape == (2, 6, ours.config.vocab_size)  # the original forward
    assert ours.generate(input_ids=ids[:, :3], max_new_tokens=2, do_sample=False).shape == (2, 5)
    with pytest.raises(ValueError, match="needs `labels`"):
        ours(input_ids=ids, fused_lm_head=True)


def test_head_copies_pickles_and_frees_as_its_model(tokenizer, tmp_path):
    """``add_flce_lm_head`` binds its forward to the model weakly and rebinds it on a copy: ``copy.deepcopy`` (a
    reference model, an EMA copy) and ``torch.save``/``torch.load`` give a model whose forward, fused or not, runs the
    copy's weights (the first version's plain forward ran the original's), and ``del model`` frees the model with
    no reference cycle left for the garbage collector. A head over an instance patch, an earlier head or a wrapper
    bound to the instance (accelerate's autocast one) calls that forward for its plain one, the copy's with the
    copy."""
    import gc
    import pickle
    import types

    from torch.multiprocessing.reductions import StorageWeakRef

    from hf_flce import apply_flce
    from hf_flce.trainers.head import has_flce_head

    ids = torch.randint(0, len(tokenizer), (2, 7))
    stock = build_tiny_model(tokenizer)

    def halved_logits(self, *args, **kwargs):  # a wrapper bound to the instance, as accelerate's autocast one is
        out = type(self).forward(self, *args, **kwargs)
        out.logits = out.logits / 2
        return out

    for base in ("class", "instance patch", "earlier head", "bound wrapper"):
        model = copy.deepcopy(stock)
        if base == "instance patch":
            apply_flce(model, backend="torch")
        elif base == "earlier head":
            add_flce_lm_head(model, outputs=("log_probs",))
        elif base == "bound wrapper":
            model.forward = types.MethodType(halved_logits, model)
        add_flce_lm_head(model, outputs=("log_probs", "entropy"))
        copies = [copy.deepcopy(model)]
        if base == "bound wrapper":  # a local function does not pickle, with the head as without it
            with pytest.raises((AttributeError, pickle.PicklingError), match="local"):
                pickle.dumps(model)
        else:
            torch.save(model, tmp_path / "model.pt")
            copies.append(torch.load(tmp_path / "model.pt", weights_only=False))
        for other in copies:
            with torch.no_grad():
                for param in other.parameters():
                    param.mul_(1.5)
            moved = copy.deepcopy(stock)
            moved.load_state_dict(other.state_dict())
            assert has_flce_head(other) and other.forward.__self__ is other
            plain_logits = moved(input_ids=ids).logits / (2 if base == "bound wrapper" else 1)
            torch.testing.assert_close(other(input_ids=ids).logits, plain_logits, rtol=0, atol=0)
            fused = other(input_ids=ids, labels=ids, fused_lm_head=True)
            assert fused.entropy is not None
            logits = moved(input_ids=ids).logits[:, :-1].double()
            want = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            torch.testing.assert_close(fused.log_probs.double(), want, rtol=RTOL, atol=ATOL)
            if base == "instance patch":  # the plain forward is the patch's: a loss without logits
                out = other(input_ids=ids, labels=ids)
                assert out.logits is None and out.loss is not None
        model(input_ids=ids, labels=ids, fused_lm_head=True, fused_loss_type="nll").loss.backward()
        weight = StorageWeakRef(model.lm_head.weight.untyped_storage())
        forward = model.forward
        gc.disable()
        try:
            del model
            assert weight.expired(), base
        finally:
            gc.enable()
        with pytest.raises(ReferenceError, match="model has been deleted"):
            forward(input_ids=ids)


def test_head_refuses_an_unsupported_logit_scale_when_added(tokenizer):
    """The config's logit scale is read at each call (a copy's config is its own), and checked when the head is
    added: a scale the op cannot fold into its temperature raises there, not at the first training step."""
    model = build_tiny_model(tokenizer)
    model.config.logit_scale = -1.0
    with pytest.raises(NotImplementedError, match="positive logit scale"):
        add_flce_lm_head(model)


def _recorded_budgets(monkeypatch) -> list:
    """The ``memory_budget`` each fused-head call passes to the op, recorded while the real op runs."""
    from hf_flce.trainers import head

    budgets = []
    real = head.head_linear_cross_entropy

    def recording(*args, **kwargs):
        budgets.append(kwargs.get("memory_budget"))
        return real(*args, **kwargs)

    monkeypatch.setattr(head, "head_linear_cross_entropy", recording)
    return budgets


def test_head_takes_the_in_model_budget(tokenizer, monkeypatch):
    from hf_flce.options import BUDGET_ENV, DEFAULT_BUDGET_CPU

    budgets = _recorded_budgets(monkeypatch)
    ids = torch.randint(0, len(tokenizer), (2, 9))
    results = []
    for options in ({}, {"memory_budget": 12345}):
        model = build_tiny_model(tokenizer)
        add_flce_lm_head(model, outputs=("log_probs", "entropy"), **options)
        results.append(model(input_ids=ids, labels=ids, fused_lm_head=True))
    monkeypatch.setenv(BUDGET_ENV, str(10**6))
    model(input_ids=ids, labels=ids, fused_lm_head=True, fused_loss_type="nll")
    model = build_tiny_model(tokenizer)
    add_flce_lm_head(model)
    model(input_ids=ids, labels=ids, fused_lm_head=True)
    # Half the op's default on the hidden states' device (CPU here); an explicit budget wins, then the environment's.
    assert budgets == [DEFAULT_BUDGET_CPU // 2, 12345, 12345, 10**6]
    torch.testing.assert_close(results[1].log_probs, results[0].log_probs, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("user_budget", [None, 777 << 10], ids=["default", "flce_memory_budget"])
@pytest.mark.parametrize("trainer_cls", ["sft", "dpo"])
def test_trainers_heads_take_the_in_model_budget(tokenizer, tmp_path, monkeypatch, user_budget, trainer_cls):
    from hf_flce.options import DEFAULT_BUDGET_ACCELERATOR, DEFAULT_BUDGET_CPU

    budgets = _recorded_budgets(monkeypatch)
    if trainer_cls == "dpo":
        trainer = FLCEDPOTrainer(
            model=build_tiny_model(tokenizer),
            ref_model=build_tiny_model(tokenizer),
            args=_base_args(DPOConfig, tmp_path, eval_strategy="no"),
            train_dataset=load_toy_dataset("preference").select(range(8)),
            processing_class=tokenizer,
            flce_memory_budget=user_budget,
        )
    else:
        trainer = FLCESFTTrainer(
            model=build_tiny_model(tokenizer),
            args=_base_args(SFTConfig, tmp_path, eval_strategy="no"),
            train_dataset=load_toy_dataset("sft_chat").select(range(8)),
            processing_class=tokenizer,
            flce_memory_budget=user_budget,
        )
    trainer.model.train()
    trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader()))).backward()
    default = DEFAULT_BUDGET_CPU if trainer.model.device.type == "cpu" else DEFAULT_BUDGET_ACCELERATOR
    expected = user_budget if user_budget is not None else default // 2
    assert budgets == [expected] * (2 if trainer_cls == "dpo" else 1)  # DPO: the policy's call and the reference's


# ---------------------------------------------------------------- SFT


def test_sft_default_nll(tokenizer, tmp_path):
    logs, trainer = _compare_sft(tokenizer, tmp_path)
    assert {"loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy"} <= set().union(*logs)
    assert "hf-flce" in trainer._tag_names


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_defer_head_grad(tokenizer, tmp_path, loss_type):
    """``flce_defer_head_grad=True``: TRL's logs (train and eval) with gradient accumulation, lm_head's gradient
    computed at the end of each micro-batch's backward; refused by the DPO trainer and for a non-bool."""
    kwargs = dict(loss_type=loss_type, gradient_accumulation_steps=2)
    stock, _ = run_sft(SFTTrainer, tokenizer, tmp_path / "stock", **kwargs)
    deferred = functools.partial(FLCESFTTrainer, flce_defer_head_grad=True)
    with mock.patch.object(LateHeadGrad, "weight_grad", autospec=True, side_effect=LateHeadGrad.weight_grad) as late:
        ours, trainer = run_sft(deferred, tokenizer, tmp_path / "ours", **kwargs)
    assert_logs_match(stock, ours)
    assert trainer.flce_defer_head_grad and late.call_count == 2 * 2  # two steps of two micro-batches
    with pytest.raises(ValueError, match="flce_defer_head_grad=True is for FLCESFTTrainer"):
        FLCEDPOTrainer(model=build_tiny_model(tokenizer), flce_defer_head_grad=True)
    with pytest.raises(TypeError, match="flce_defer_head_grad must be a bool"):
        FLCESFTTrainer(model=build_tiny_model(tokenizer), flce_defer_head_grad="yes")


def test_bad_flce_options_raise_at_construction(tokenizer, tmp_path, monkeypatch):
    """Named by their ``flce_`` names before any data is prepared, not at the first step's head call."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for options, error, message in (
        (dict(flce_backend="bogus"), ValueError, "flce_backend must be one of"),
        (dict(flce_memory_budget=0), ValueError, "flce_memory_budget must be > 0"),
        (dict(flce_memory_budget="1GiB"), TypeError, "flce_memory_budget must be an int"),
    ):
        with pytest.raises(error, match=message):
            FLCESFTTrainer(model=build_tiny_model(tokenizer), **options)
    data = load_toy_dataset("sft_chat", test_size=16)["train"].select(range(4))
    args = _base_args(SFTConfig, tmp_path, use_cpu=True, eval_strategy="no")
    with pytest.raises(ValueError, match="flce_backend='triton' on cpu: backend='triton' runs on CUDA"):
        FLCESFTTrainer(
            model=build_tiny_model(tokenizer), args=args, train_dataset=data, processing_class=tokenizer,
            flce_backend="triton",
        )  # fmt: skip


def test_sft_dft(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, loss_type="dft")


def test_sft_completion_only(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, dataset="sft_prompt_completion", completion_only_loss=True)


def test_sft_assistant_only(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, assistant_only_loss=True)


def test_sft_packing_bfd(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, packing=True, packing_strategy="bfd", max_length=96)


def test_sft_padding_free(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, padding_free=True, max_length=None, per_device_train_batch_size=3)


def test_sft_gradient_accumulation(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, gradient_accumulation_steps=3, average_tokens_across_devices=True)


def test_sft_moe_aux_loss(tokenizer, tmp_path):
    logs, _ = _compare_sft(tokenizer, tmp_path, arch="qwen2_moe", gradient_accumulation_steps=2)
    assert any("aux_loss" in row for row in logs) and any("eval_aux_loss" in row for row in logs)


def test_sft_gemma2_softcap(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, arch="gemma2")


def test_sft_label_smoothing(tokenizer, tmp_path):
    _compare_sft(tokenizer, tmp_path, label_smoothing_factor=0.1)


def test_sft_eval_never_builds_logits(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer)
    vocab = model.config.vocab_size
    logits_built = []
    calls = []

    def record(module, args, output):
        # The fused loss runs as lm_head's own forward (so sharding engines gather it); logits would be [..., V].
        calls.append(1)
        logits_built.append(isinstance(output, torch.Tensor) and output.dim() >= 2 and output.shape[-1] == vocab)

    model.lm_head.register_forward_hook(record)
    _, trainer = run_sft(FLCESFTTrainer, tokenizer, tmp_path, model=model)
    calls.clear()
    logits_built.clear()
    trainer.evaluate()
    assert calls and not any(logits_built)


def test_sft_model_path_and_peft(tokenizer, tmp_path):
    from peft import LoraConfig

    build_tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = load_toy_dataset("sft_chat").select(range(TRAIN_ROWS))
    trainer = FLCESFTTrainer(
        model=str(tmp_path / "model"),
        args=_base_args(SFTConfig, tmp_path, max_steps=2, eval_strategy="no"),
        train_dataset=data,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.train().training_loss > 0


# ---------------------------------------------------------------- DPO


def test_dpo_sigmoid(tokenizer, tmp_path):
    logs, _ = _compare_dpo(tokenizer, tmp_path)
    keys = set().union(*logs)
    expected = {"rewards/chosen", "rewards/margins", "logps/chosen", "logits/chosen", "entropy", "mean_token_accuracy"}
    assert expected | {"num_tokens", "eval_rewards/accuracies"} <= keys


def test_dpo_all_loss_types_combined(tokenizer, tmp_path):
    weights = [0.1 * (i + 1) for i in range(len(ALL_DPO_LOSSES))]
    _compare_dpo(tokenizer, tmp_path, loss_type=ALL_DPO_LOSSES, loss_weights=weights, label_smoothing=0.1)


def test_dpo_sigmoid_plus_sft(tokenizer, tmp_path):
    _compare_dpo(tokenizer, tmp_path, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])


def test_dpo_ld_alpha_and_wpo(tokenizer, tmp_path):
    _compare_dpo(tokenizer, tmp_path, ld_alpha=0.5, use_weighting=True)


def test_dpo_precomputed_reference(tokenizer, tmp_path):
    _compare_dpo(tokenizer, tmp_path, reference="path", precompute_ref_log_probs=True)


def test_dpo_peft_reference_is_base_model(tokenizer, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    _, trainer = _compare_dpo(tokenizer, tmp_path, reference=None, peft_config=lora)
    assert trainer.ref_model is None


def test_dpo_moe(tokenizer, tmp_path):
    logs, _ = _compare_dpo(tokenizer, tmp_path, arch="qwen2_moe")
    assert any("aux_loss" in row for row in logs)


def test_dpo_gradients_match_float64(tokenizer, tmp_path):
    """One WPO step's gradients: ours are as close to a float64 run of TRL's code as TRL's fp32 ones."""
    data = load_toy_dataset("preference").select(range(TRAIN_ROWS))
    args = _base_args(DPOConfig, tmp_path, use_weighting=True, eval_strategy="no")
    grads = {}
    for name, cls, dtype in (
        ("f64", DPOTrainer, torch.float64),
        ("trl", DPOTrainer, None),
        ("ours", FLCEDPOTrainer, None),
    ):
        model, ref = (build_tiny_model(tokenizer, dtype=dtype) for _ in range(2))
        trainer = cls(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer)
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model.train()
        trainer.compute_loss(trainer.model, batch).backward()
        grads[name] = torch.cat([p.grad.double().flatten() for p in trainer.model.parameters()])
    err = {k: ((grads[k] - grads["f64"]).norm() / grads["f64"].norm()).item() for k in ("trl", "ours")}
    assert err["ours"] <= max(2 * err["trl"], 1e-6), err


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ALL_DPO_LOSSES)
def test_dpo_each_loss_type(tokenizer, tmp_path, loss_type):
    _compare_dpo(tokenizer, tmp_path, loss_type=[loss_type], label_smoothing=0.1 if loss_type == "exo_pair" else 0.0)
