"""Supervised fine-tuning with :class:`hf_flce.FLCESFTTrainer`.

With no arguments it runs offline in about a minute on a CPU: a tiny Qwen2 with random weights, a BPE tokenizer
trained on the bundled data, and the bundled chat dataset (``hf_flce/data``). It accepts every ``trl sft``
argument, so it also trains real models:

    python examples/sft.py                                   # embedded tiny default
    python examples/sft.py --loss_type dft --assistant_only_loss --packing
    python examples/sft.py --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara \\
        --output_dir outputs/qwen-sft --bf16 --per_device_train_batch_size 4 --max_length 4096
    python examples/sft.py --stock_trl                       # the same run with TRL's own SFTTrainer
    python examples/sft.py --flce_defer_head_grad            # hf_flce's trainer options: --flce_*

``--metrics_json PATH`` writes the logged losses, tokens/s and peak memory. In a script of your own, only the class
name changes from TRL:

    trainer = FLCESFTTrainer(model="Qwen/Qwen2.5-0.5B", args=SFTConfig(...), train_dataset=ds, peft_config=...)
    trainer.train()
"""

from __future__ import annotations

from trl import SFTTrainer

from hf_flce import FLCESFTTrainer
from hf_flce.data.toy import run_example


def main(argv: list[str] | None = None) -> dict:
    """Train with FLCESFTTrainer (or TRL's SFTTrainer with ``--stock_trl``); return the recorded metrics."""
    return run_example("sft", FLCESFTTrainer, SFTTrainer, argv)


if __name__ == "__main__":
    main()
