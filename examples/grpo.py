"""Online RL (GRPO) with :class:`hf_flce.FLCEGRPOTrainer`.

With no arguments it runs offline on a CPU: a tiny Qwen2 with random weights samples four completions of each bundled
prompt (``hf_flce/data/sft_prompt_completion.jsonl``), rewarded by the share of the bundled answer's words they contain
(``hf_flce.data.toy.reference_word_overlap``). It accepts every ``trl grpo`` argument:

    python examples/grpo.py                                         # embedded tiny default
    python examples/grpo.py --loss_type dr_grpo --beta 0.04 --num_iterations 2
    python examples/grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --output_dir outputs/qwen-grpo --bf16
    python examples/grpo.py --stock_trl                             # TRL's own GRPOTrainer

``--metrics_json PATH`` writes the logged metrics (rewards among them) and peak memory. In a script of your own, only
the class name changes from TRL:

    trainer = FLCEGRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[...], args=GRPOConfig(...),
                              train_dataset=prompts)
    trainer.train()

``hf-flce rloo ...`` runs :class:`hf_flce.FLCERLOOTrainer` with the same arguments.
"""

from __future__ import annotations

from trl import GRPOTrainer

from hf_flce import FLCEGRPOTrainer
from hf_flce.data.toy import run_example


def main(argv: list[str] | None = None) -> dict:
    """Train with FLCEGRPOTrainer (or TRL's GRPOTrainer with ``--stock_trl``); return the recorded metrics."""
    return run_example("grpo", FLCEGRPOTrainer, GRPOTrainer, argv)


if __name__ == "__main__":
    main()
