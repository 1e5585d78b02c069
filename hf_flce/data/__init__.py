"""Bundled toy data for offline examples, tests and the demo: chat, prompt-completion and preference datasets, a
tokenizer trained on them, and tiny randomly initialised causal LMs.

Example:
    >>> from hf_flce.data import build_tiny_model, build_tokenizer, load_toy_dataset
    >>> tokenizer = build_tokenizer()
    >>> dataset = load_toy_dataset("sft_chat")
    >>> model = build_tiny_model(tokenizer)
    >>> model.config.vocab_size == len(tokenizer)
    True
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

DATA_DIR = Path(__file__).parent
DATASETS = ("sft_chat", "sft_prompt_completion", "preference")

# ChatML with `{% generation %}` markers around the assistant content and its end-of-turn token, so that TRL's
# `assistant_only_loss` trains the model to stop.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def data_file(name: str) -> Path:
    """Path of a bundled dataset (``"sft_chat"``, ``"sft_prompt_completion"`` or ``"preference"``) as JSON lines."""
    if name not in DATASETS:
        raise ValueError(f"unknown bundled dataset {name!r}; choose from {DATASETS}")
    return DATA_DIR / f"{name}.jsonl"


def load_toy_dataset(name: str, test_size: int = 0):
    """Load a bundled dataset as a ``datasets.Dataset``, or a ``DatasetDict`` with ``train``/``test`` splits when
    ``test_size`` > 0 (the last ``test_size`` rows form the test split)."""
    from datasets import Dataset, DatasetDict

    rows = [json.loads(line) for line in data_file(name).read_text().splitlines() if line]
    if test_size <= 0:
        return Dataset.from_list(rows)
    return DatasetDict(train=Dataset.from_list(rows[:-test_size]), test=Dataset.from_list(rows[-test_size:]))


def _corpus():
    for name in DATASETS:
        for line in data_file(name).read_text().splitlines():
            for value in json.loads(line).values():
                for message in value:
                    yield message["content"]


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the bundled text (deterministic), with a ChatML template whose
    assistant turns carry ``{% generation %}`` markers. EOS is ``<|im_end|>``, padding ``<|endoftext|>``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    tokenizer,
    *,
    arch: str = "qwen2",
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    dtype=None,
):
    """A small causal LM with random weights whose vocabulary is the tokenizer's.

    ``arch`` is ``"qwen2"``, ``"llama"``, ``"gemma2"`` (its config's logit cap of 30 included) or ``"qwen2_moe"`` (a
    Mixture-of-Experts model that returns router logits, for the load-balancing loss). ``vocab_size`` pads the
    vocabulary beyond the tokenizer's (as real models do), for a head whose cost shows.
    """
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config, Qwen2MoeConfig

    common = dict(
        vocab_size=max(len(tokenizer), vocab_size or 0),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "gemma2":
        config = Gemma2Config(**common, head_dim=hidden_size // 4)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; choose 'qwen2', 'llama', 'gemma2' or 'qwen2_moe'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return model


def toy_training_defaults(command: str) -> dict:
    """Training-argument defaults that make the tiny model learn the bundled data in about a minute on a CPU
    (``command`` is ``"sft"``, ``"dpo"`` or ``"grpo"``). Arguments given explicitly still win."""
    import dataclasses

    import torch
    from transformers import TrainingArguments

    # Recent transformers releases name TRL's gradient_checkpointing (on by default) activation_checkpointing, the old
    # name an alias; earlier 5.x releases (5.17) know only the old name, and a default for a field the parser lacks
    # would come back from it as an extra namespace.
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    defaults = dict(
        output_dir=f"outputs/{command}-tiny",
        max_steps=60 if command == "sft" else 30,
        per_device_train_batch_size=16 if command == "sft" else 8,
        per_device_eval_batch_size=16,
        learning_rate=3e-3 if command == "sft" else 5e-4,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=30,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        max_length=256,
    )
    defaults[checkpointing] = False  # small activations; recomputing them only costs time
    if command == "grpo":
        # four completions of each of four prompts per step; no evaluation (it would generate too)
        del defaults["max_length"], defaults["eval_steps"]
        defaults.update(max_steps=100, per_device_train_batch_size=16, num_generations=4, max_completion_length=24)
        defaults.update(learning_rate=1e-2, logging_steps=10, eval_strategy="no")
    return defaults
