"""Preference optimisation (DPO and its variants) with :class:`hf_flce.FLCEDPOTrainer`.

With no arguments it runs offline on a CPU: a tiny Qwen2 with random weights (the reference model is a frozen copy
of it) and the bundled preference pairs (``hf_flce/data/preference.jsonl``). It accepts every
``trl dpo`` argument:

    python examples/dpo.py                                          # embedded tiny default
    python examples/dpo.py --loss_type sigmoid sft --loss_weights 1.0 0.5 --use_weighting
    python examples/dpo.py --use_peft --lora_r 8                    # reference = base model, adapter disabled
    python examples/dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback_binarized --output_dir outputs/qwen-dpo --bf16
    python examples/dpo.py --stock_trl                              # TRL's own DPOTrainer

``--metrics_json PATH`` writes the logged metrics, tokens/s and peak memory. In a script of your own, only the class
name changes from TRL:

    trainer = FLCEDPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", args=DPOConfig(...), train_dataset=pairs)
    trainer.train()
"""

from __future__ import annotations

from trl import DPOTrainer

from hf_flce import FLCEDPOTrainer
from hf_flce.data.toy import run_example


def main(argv: list[str] | None = None) -> dict:
    """Train with FLCEDPOTrainer (or TRL's DPOTrainer with ``--stock_trl``); return the recorded metrics."""
    return run_example("dpo", FLCEDPOTrainer, DPOTrainer, argv)


if __name__ == "__main__":
    main()
