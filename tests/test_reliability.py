"""Reliability: resuming a patched run loses nothing, checkpoints load without hf_flce, bad CLI input fails clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from datasets import Dataset

from hf_flce import apply_flce, cli
from hf_flce.data import build_tiny_model, build_tokenizer, data_file
from hf_flce.patches.registry import MODEL_TYPES

VOCAB = 128
STEPS, SAVE_AT = 6, 3
CHILD_ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return apply_flce(transformers.LlamaForCausalLM(config))


def _dataset() -> Dataset:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (8, 12), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100  # masked prompts
    labels[::3, -2:] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _trainer(model, output_dir) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        optim="adamw_torch",
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=_dataset())


def _losses(trainer) -> dict[int, float]:
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 6-step run (checkpoints at 3 and 6) and a fresh model and trainer resumed from step 3."""
    root = tmp_path_factory.mktemp("reliability")
    full_model, fused = _llama(seed=0), []
    # Every training forward must take the fused path (no logits).
    full_model.register_forward_hook(lambda module, args, out: fused.append(out.logits is None))
    full = _trainer(full_model, root / "full")
    full.train()
    assert fused == [True] * STEPS * 2  # 2 micro-batches per step
    checkpoint = root / "full" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "trainer_state.json").exists()
    # The "killed" run restarts from scratch: other init weights, new trainer, new output dir.
    resumed_model, resumed_fused = _llama(seed=1), []
    resumed_model.register_forward_hook(lambda module, args, out: resumed_fused.append(out.logits is None))
    resumed = _trainer(resumed_model, root / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # Only steps 4-6 ran again, fused: 3 steps of 2 micro-batches.
    assert resumed_fused == [True] * (STEPS - SAVE_AT) * 2
    return root, full, resumed


def test_resume_from_checkpoint_continues_the_same_run(runs):
    root, full, resumed = runs
    expected, got = _losses(full), _losses(resumed)
    assert sorted(expected) == list(range(1, STEPS + 1))
    # Steps 1-3 come from the checkpoint's log history, steps 4-6 were logged once each by the resumed run.
    assert sorted(got) == sorted(expected) and sum("loss" in log for log in resumed.state.log_history) == STEPS
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=0), step
    assert resumed.state.global_step == full.state.global_step == STEPS
    params = dict(full.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=1e-5, atol=1e-7, msg=name)
    # The resumed run saved its own final checkpoint too.
    assert (root / "resumed" / f"checkpoint-{STEPS}" / "trainer_state.json").exists()


CHILD = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoHfFlce(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_flce":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoHfFlce())
    try:
        import hf_flce
    except ModuleNotFoundError:
        pass
    else:
        sys.exit("hf_flce is still importable")

    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    ckpt, ids_file, expected_file = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert type(model) is LlamaForCausalLM and "forward" not in model.__dict__
    with torch.no_grad():
        logits = model(input_ids=torch.load(ids_file)).logits
    torch.testing.assert_close(logits, torch.load(expected_file), rtol=1e-5, atol=1e-6)
    assert not any(name.split(".")[0] == "hf_flce" for name in sys.modules)
    print("stock load ok", tuple(logits.shape))
    """
)


def test_checkpoint_loads_in_stock_transformers_without_hf_flce(runs):
    root, full, _ = runs
    model = full.model.eval()
    assert "forward" in model.__dict__  # still the patched instance
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # labels=None: the stock path
    torch.save(ids, root / "ids.pt")
    torch.save(logits, root / "logits.pt")
    checkpoint = root / "full" / f"checkpoint-{STEPS}"
    assert "hf_flce" not in (checkpoint / "config.json").read_text()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(checkpoint), str(root / "ids.pt"), str(root / "logits.pt")],
        cwd=root,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stock load ok (2, 9, 128)" in out.stdout


# CLI: bad input must fail with an error that says what is wrong.

TINY_RUN = ["--max_steps", "1", "--bf16", "false", "--report_to", "none", "--save_strategy", "no", "--use_cpu"]


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    """A saved tiny model and tokenizer, a good SFT dataset, and two bad ones (not JSON, wrong columns)."""
    root = tmp_path_factory.mktemp("cli-bad")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    datasets = {
        "good": data_file("sft_chat").read_text().splitlines()[:8],
        "dpo-good": data_file("preference").read_text().splitlines()[:8],
        "not-json": ["this is not json", "{'single': 'quotes'}"],
        "columns": [json.dumps({"question": "2+2?", "answer": "4"})] * 8,
        "dpo-columns": [json.dumps({"prompt": "2+2?", "completion": "4"})] * 8,
    }
    for name, lines in datasets.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _run(root, command, model, dataset, *extra):
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(dataset), "--output_dir", str(root / "out")]
    return cli.run_in_process([command, *argv, *TINY_RUN, *extra])


def test_missing_paths_exit_nonzero_naming_the_path(tmp_path):
    missing = tmp_path / "nonexistent"
    argv = ["--model_name_or_path", str(missing / "model"), "--dataset_name", str(missing / "data")]
    out = subprocess.run(
        [sys.executable, "-m", "hf_flce.cli", "sft", *argv, "--output_dir", str(tmp_path / "out"), *TINY_RUN],
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError") and str(missing / "data") in last, out.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_missing_model_names_the_path(cli_dir):
    missing = cli_dir / "nonexistent-model"
    with pytest.raises(OSError, match=str(missing)):
        _run(cli_dir, "sft", missing, cli_dir / "good")


def test_dataset_that_is_not_json_fails_readably(cli_dir):
    from datasets.exceptions import DatasetGenerationError

    with pytest.raises(DatasetGenerationError) as info:
        _run(cli_dir, "sft", cli_dir / "model", cli_dir / "not-json")
    # The cause says what is wrong with the file.
    assert "JSON parse error" in str(info.value.__cause__)


@pytest.mark.parametrize(
    "command, dataset, match",
    [
        ("sft", "columns", r"'question', 'answer'.*'messages'"),
        ("dpo", "dpo-columns", r"'prompt', 'completion'\].*'chosen' and 'rejected'"),
    ],
)
def test_dataset_without_expected_columns_fails_readably(cli_dir, command, dataset, match):
    with pytest.raises(ValueError, match=match):
        _run(cli_dir, command, cli_dir / "model", cli_dir / dataset)


class _Built(Exception):
    """Raised by a stand-in trainer class, to inspect what the CLI would train without training."""


def _capture(**kwargs):
    raise _Built(kwargs)


@pytest.mark.parametrize("command", cli.COMMANDS)
@pytest.mark.parametrize("asked", [False, True])
def test_trust_remote_code_only_when_asked(cli_dir, command, asked):
    parser = cli.make_parser(command)
    dataset = cli_dir / ("good" if command == "sft" else "dpo-good")  # prompt, chosen, rejected
    argv = ["--model_name_or_path", str(cli_dir / "model"), "--dataset_name", str(dataset)]
    argv += ["--output_dir", str(cli_dir / "out"), *TINY_RUN, *(["--trust_remote_code", "true"] if asked else [])]
    if command in ("grpo", "rloo"):
        argv += ["--reward_funcs", "think_format_reward"]
    parsed = parser.parse_args_and_config(argv)
    with pytest.raises(_Built) as info:
        cli.train(command, *parsed, trainer_cls=_capture)
    assert info.value.args[0]["args"].model_init_kwargs["trust_remote_code"] is asked


def test_custom_code_in_a_checkpoint_is_never_run_by_default(cli_dir, tmp_path):
    model = tmp_path / "custom"
    model.mkdir()
    marker = tmp_path / "custom-code-ran"
    config = {"model_type": "hf_flce_custom", "auto_map": {"AutoConfig": "custom.Config"}}
    (model / "config.json").write_text(json.dumps(config))
    (model / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        _run(cli_dir, "sft", model, cli_dir / "good")
    assert not marker.exists()


def test_unsupported_model_type_lists_the_supported_ones():
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=VOCAB)
    )
    with pytest.raises(ValueError) as info:
        apply_flce(mamba)
    message = str(info.value)
    assert "'mamba'" in message and "MambaForCausalLM" in message
    assert all(model_type in message for model_type in MODEL_TYPES)
    assert "forward" not in mamba.__dict__  # nothing was patched
