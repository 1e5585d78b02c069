"""Plain ``transformers.Trainer`` with hf_flce patched into a Mistral model: no TRL involved.

``apply_flce_to_mistral(model)`` replaces the instance's forward so that ``model(..., labels=...)`` computes the
loss with the fused ``lm_head`` + cross-entropy (the logits are not built); everything else is the stock Trainer,
including gradient accumulation through ``num_items_in_batch``.

    python examples/hf_trainer.py                          # tiny random Mistral on the bundled chat data, CPU-friendly
    python examples/hf_trainer.py --model_name_or_path mistralai/Mistral-7B-v0.3 --bf16 --max_steps 100
"""

from __future__ import annotations

import argparse

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    MistralConfig,
    MistralForCausalLM,
    Trainer,
    TrainingArguments,
)

from hf_flce import apply_flce_to_mistral
from hf_flce.data import build_tokenizer, load_toy_dataset


def tiny_mistral(tokenizer) -> MistralForCausalLM:
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return MistralForCausalLM(config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", help="a Mistral/Mixtral checkpoint; default: tiny random Mistral")
    parser.add_argument("--output_dir", default="outputs/hf-trainer-tiny")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true")
    opts = parser.parse_args(argv)

    if opts.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(opts.model_name_or_path)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(opts.model_name_or_path, dtype="auto")
    else:
        tokenizer = build_tokenizer()
        model = tiny_mistral(tokenizer)
    model = apply_flce_to_mistral(model)  # before Trainer: accelerate wraps the instance forward at `prepare`

    def tokenize(row):
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template(row["messages"], return_dict=True, truncation=True, max_length=512)
        text = "\n".join(m["content"] for m in row["messages"]) + (tokenizer.eos_token or "")
        return tokenizer(text, truncation=True, max_length=512)

    dataset = load_toy_dataset("sft_chat", test_size=32).map(tokenize, remove_columns=["messages"])
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        learning_rate=opts.learning_rate,
        lr_scheduler_type="cosine",
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=opts.max_steps // 2,
        save_strategy="no",
        report_to="none",
        bf16=opts.bf16,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.accelerator.print(f"eval loss {metrics['eval_loss']:.4f}")
    return metrics


if __name__ == "__main__":
    main()
