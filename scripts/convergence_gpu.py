"""bf16 convergence on a GPU: stock bf16 and hf_flce bf16 against a stock fp32 run (the ground truth).

For each model, four runs start from the same weights and see the same batches: stock transformers in fp32 (TF32
off); under bf16 autocast with fp32 master weights (as ``Trainer(bf16=True)``), stock, stock with its head's logits
kept in float32 ("fp32-logits": what an exact fused head computes) and ``apply_flce``. The check
(``TOLERANCES["bf16-gpu"]`` in ``tests/convergence_utils.py``):

- gradient error: one held-out micro-batch's gradients at the same weights (the initial ones, and the fp32 run's
  trained ones, where the logits are peaked) against the fp32 model's, for the head's weight and for all parameters:
  ours' error at most ``max_gradient_error_ratio`` x stock bf16's. Deterministic up to the GPU's summation order,
  this is what compares the heads: a gradient off by 0.5% of its norm would read ~1.1x (errors of ~1e-2 add in
  quadrature);
- trajectory: ours' distance to the fp32 run, for the loss curve (mean relative difference over steps) and the final
  parameters (relative L2 distance), at most ``max_distance_ratio`` x the larger of the two other bf16 runs'. These
  distances are mostly the body's bf16 error, shared by every bf16 run and amplified by training: the same seed rerun
  moves ours / stock by up to 0.3, and the exact head reads 0.55-1.21x stock's (docs/PERF_NOTES.md v37). This part
  catches a run that leaves the others, not a head that rounds differently;
- ours' mean loss distance stays under a sanity bound.

Distances of held-out log-probs, the time per step and the peak memory are reported too.

Data: a synthetic language over the whole vocabulary, generated here: Zipf-distributed tokens, half of which
always have the same successor (near-deterministic targets, where bf16 logits lose most), variable lengths with
right padding, the first quarter of each row masked as a prompt, two micro-batches accumulated per step.

Usage (from the repository root, ``make test-convergence-gpu``)::

    python scripts/convergence_gpu.py --out outputs/convergence/gpu   # ~4 min on one H100
    python scripts/convergence_gpu.py --models llama-32k --steps 50   # a shorter run
    python scripts/convergence_gpu.py --preset gemma --seed 1         # Gemma 2 (logit cap 30) and Gemma 3 heads
    python scripts/convergence_gpu.py --device cpu --preset smoke     # CPU smoke test of the script itself

Writes ``<out>/gpu.json`` (curves and summary; ``scripts/convergence_report.py`` plots it); exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from convergence_utils import (  # noqa: E402
    IGNORE_INDEX,
    TOLERANCES,
    Batch,
    build_model,
    count_targets,
    eval_logprobs,
    loss_curve_distance,
    parameter_distance,
    train,
    write_suite,
)

from hf_flce import apply_flce  # noqa: E402

TOL = TOLERANCES["bf16-gpu"]
# Run lengths of each preset (the command line overrides them): 200 steps of 2 x 8 x 512 = 8192 tokens.
RUNS = {
    "default": dict(steps=200, seq=512, micro_batch=8),
    "gemma": dict(steps=200, seq=512, micro_batch=8),
    "smoke": dict(steps=5, seq=32, micro_batch=4),
}
# (label, autocast dtype, head): the runs of each model. "fp32-logits" is stock bf16 with its head's logits (and their
# gradient) kept in float32 from the same bf16 operands: what an exact fused head computes, so its distance to the
# fp32 run tells how far a more exact head alone moves a bf16 trajectory (the noise ours is compared within).
VARIANTS = (
    ("fp32", None, "stock"),
    ("stock", torch.bfloat16, "stock"),
    ("fp32-logits", torch.bfloat16, "fp32-logits"),
    ("ours", torch.bfloat16, "flce"),
)
BF16_RUNS = [label for label, dtype, _ in VARIANTS if dtype is not None]
# name -> (family, model settings). 4 layers, realistic vocabularies and widths.
PRESETS: dict[str, dict[str, tuple[str, dict]]] = {
    "default": {
        "llama-32k": (
            "llama",
            dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=4, num_attention_heads=12,
                 num_key_value_heads=4),
        ),
        "qwen3-152k-tied": (
            "qwen3",
            dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
        ),
    },
    # Gemma heads, the largest vocabularies (make test-convergence-gpu runs the default preset only, ~4 min on an
    # H100; this one takes ~8 min)
    "gemma": {
        # Gemma 2's final-logit cap of 30 (the epilogue's hardware tanh) on its 256k vocabulary
        "gemma2-256k-softcap": (
            "gemma2-softcap",
            dict(vocab_size=256000, hidden_size=1152, intermediate_size=3072, num_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, final_logit_softcapping=30.0),
        ),
        # Gemma 3 1B's head (V = 2^18, H = 1152, tied) on a 4-layer body
        "gemma3-262k-tied": (
            "gemma3-tied",
            dict(vocab_size=262144, hidden_size=1152, intermediate_size=3072, num_layers=4, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256),
        ),
    },
    "smoke": {
        "llama-smoke": ("llama", dict(vocab_size=2048, hidden_size=64, num_layers=2)),
        "qwen3-smoke-tied": ("qwen3", dict(vocab_size=4096, hidden_size=64, num_layers=2, tie_word_embeddings=True)),
        "gemma2-smoke-softcap": ("gemma2-softcap", dict(vocab_size=4096, hidden_size=64, num_layers=2)),
        "gemma3-smoke-tied": ("gemma3-tied", dict(vocab_size=4096, hidden_size=64, num_layers=2)),
    },
}  # fmt: skip


def synthetic_rows(vocab: int, rows: int, seq: int, seed: int) -> Batch:
    """``rows`` right-padded rows of a synthetic language over ``vocab`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    zipf = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.1)
    frequent = torch.randperm(vocab, generator=gen)  # which ids are frequent: spread over the vocabulary
    successor = torch.randint(vocab, (vocab,), generator=gen)
    fixed = torch.rand(vocab, generator=gen) < 0.5
    draws = frequent[torch.multinomial(zipf.float(), rows * seq, replacement=True, generator=gen)].view(rows, seq)
    ids = draws.clone()
    for t in range(1, seq):
        prev = ids[:, t - 1]
        ids[:, t] = torch.where(fixed[prev], successor[prev], draws[:, t])
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=gen)
    position = torch.arange(seq)
    attention = position < lengths[:, None]
    labels = torch.where(attention & (position >= lengths[:, None] // 4), ids, IGNORE_INDEX)
    return {"input_ids": torch.where(attention, ids, 0), "attention_mask": attention.long(), "labels": labels}


def make_steps(
    vocab: int, steps: int, accum: int, micro: int, seq: int, seed: int = 0
) -> tuple[list[list[Batch]], Batch]:
    """``steps`` optimizer steps of ``accum`` micro-batches, and a held-out batch of ``micro`` rows."""
    data = synthetic_rows(vocab, (steps * accum + 1) * micro, seq, seed=seed)
    micro_batches = [{k: v[i : i + micro] for k, v in data.items()} for i in range(0, steps * accum * micro, micro)]
    held_out = {k: v[-micro:] for k, v in data.items()}
    return [micro_batches[i : i + accum] for i in range(0, len(micro_batches), accum)], held_out


def prepare(model: torch.nn.Module, head: str) -> torch.nn.Module:
    """``model`` with the named head: stock's, ``apply_flce``'s, or stock's with float32 logits from bf16 operands."""
    if head == "flce":
        apply_flce(model)
    elif head == "fp32-logits":
        output = model.get_output_embeddings()

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hidden.device.type, enabled=False):
                return F.linear(hidden.to(torch.bfloat16).float(), output.weight.to(torch.bfloat16).float())

        output.forward = forward
    return model


def gradient_error(model: torch.nn.Module, batch: Batch, device: torch.device) -> dict[str, dict[str, float]]:
    """One micro-batch's gradients at ``model``'s weights, of each bf16 run's head under autocast, against stock
    fp32's: ``‖g - g_fp32‖ / ‖g_fp32‖`` for the output head's weight (the embedding when tied) and for all
    parameters. Deterministic where the trajectories are not: the same weights and batch for every run."""
    num_items = count_targets(batch["labels"]).to(device)
    grads = {}
    for label, dtype, head in VARIANTS:
        run = prepare(copy.deepcopy(model).to(device), head).train()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            run(**{k: v.to(device) for k, v in batch.items()}, num_items_in_batch=num_items).loss.backward()
        weight = run.get_output_embeddings().weight
        all_grads = {n: p.grad.float() for n, p in run.named_parameters() if p.grad is not None}
        grads[label] = {"head": {"head": weight.grad.float()}, "all": all_grads}
        del run
    ref = grads.pop("fp32")
    return {part: {label: parameter_distance(g[part], ref[part]) for label, g in grads.items()} for part in ref}


def run_model(name: str, family: str, settings: dict, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    vocab = settings["vocab_size"]
    started = time.perf_counter()
    steps, held_out = make_steps(vocab, args.steps, args.accum, args.micro_batch, args.seq, args.seed)
    base = build_model(family, **settings, seed=args.seed)
    print(f"[{name}] {sum(p.numel() for p in base.parameters()) / 1e6:.0f}M parameters, data in "
          f"{time.perf_counter() - started:.1f}s", flush=True)  # fmt: skip
    runs, logprobs = {}, {}
    for label, dtype, head in VARIANTS:
        model = prepare(copy.deepcopy(base).to(device), head)
        runs[label] = train(model, steps, lr=args.lr, autocast=dtype)
        logprobs[label] = eval_logprobs(model, held_out)  # fp32 eval: the weights' quality, not the eval's dtype
        print(f"[{name}] {label}: final loss {runs[label].losses[-1]:.4f}, "
              f"{1e3 * runs[label].seconds_per_step:.0f} ms/step, peak {runs[label].peak_gib:.1f} GiB", flush=True)  # fmt: skip
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    truth = runs["fp32"]
    # the held-out batch's gradients at the initial weights and at the fp32 run's trained ones (peaked logits)
    trained = copy.deepcopy(base)
    loaded = trained.load_state_dict(truth.final, strict=False)  # tied weights are in truth.final once
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    gradients = {
        "initial": gradient_error(base, held_out, device),
        "trained": gradient_error(trained, held_out, device),
    }
    for point, errors in gradients.items():
        shown = ", ".join(f"{part} " + " / ".join(f"{errors[part][k]:.3e}" for k in BF16_RUNS) for part in errors)
        print(f"[{name}] gradient error vs fp32 at the {point} weights ({' / '.join(BF16_RUNS)}): {shown}", flush=True)
    mask = held_out["labels"][:, 1:] != IGNORE_INDEX
    distance = {
        "loss_curve": {k: loss_curve_distance(runs[k].losses, truth.losses) for k in BF16_RUNS},
        "final_params": {k: parameter_distance(runs[k].final, truth.final) for k in BF16_RUNS},
        "eval_logprobs_mean_abs": {k: float((logprobs[k] - logprobs["fp32"]).abs()[mask].mean()) for k in BF16_RUNS},
    }
    problems = []
    for point, errors in gradients.items():
        for part, values in errors.items():
            if not values["ours"] <= TOL.max_gradient_error_ratio * values["stock"]:
                problems.append(
                    f"gradient error ({part}, {point} weights): ours {values['ours']:.4g} > "
                    f"{TOL.max_gradient_error_ratio:g} x stock's {values['stock']:.4g}"
                )
    for key in ("loss_curve", "final_params"):
        ours, others = distance[key]["ours"], max(distance[key]["stock"], distance[key]["fp32-logits"])
        if not ours <= TOL.max_distance_ratio * others:
            problems.append(
                f"{key}: ours' distance to fp32 {ours:.4g} > {TOL.max_distance_ratio:g} x the larger of stock's and "
                f"fp32-logits' {others:.4g}"
            )
    if not distance["loss_curve"]["ours"] <= TOL.max_loss_distance:
        problems.append(f"loss_curve: ours' mean relative distance to fp32 exceeds {TOL.max_loss_distance:g}")

    return {
        "name": name,
        "reference": "fp32",
        "config": {"family": family, **settings},
        "curves": {k: r.losses for k, r in runs.items()},
        "grad_norms": {k: r.grad_norms for k, r in runs.items()},
        "summary": {
            "distance_to_fp32": distance,
            "gradient_error": gradients,
            "ms_per_step": {k: 1e3 * r.seconds_per_step for k, r in runs.items()},
            "peak_gib": {k: r.peak_gib for k, r in runs.items()},
            "tokens_per_step": args.accum * args.micro_batch * args.seq,
            "seconds": time.perf_counter() - started,
        },
        "passed": not problems,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/convergence/gpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--models", help="comma-separated subset of the preset's models")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: 200; smoke: 5)")
    parser.add_argument("--seq", type=int, help="row length in tokens (default: 512; smoke: 32)")
    parser.add_argument("--micro-batch", type=int, help="rows per micro-batch (default: 8; smoke: 4)")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic data and the initial weights")
    args = parser.parse_args(argv)
    for key, value in RUNS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # The fp32 run is the ground truth: no TF32 anywhere.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    models = PRESETS[args.preset]
    names = args.models.split(",") if args.models else list(models)
    unknown = set(names) - set(models)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; the preset has {sorted(models)}")

    records = [run_model(name, *models[name], args) for name in names]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    import transformers

    path = write_suite(
        Path(args.out) / "gpu.json",
        "bf16-gpu",
        records,
        device=device,
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
        settings=vars(args),
        tolerance=TOL.__dict__,
    )
    print(f"\n{'model':<18} {'distance to fp32':<24}" + "".join(f"{k:>13}" for k in BF16_RUNS)
          + "".join(f"{k + ' ÷ stock':>20}" for k in BF16_RUNS[1:]))  # fmt: skip
    for record in records:
        summary = record["summary"]
        rows = dict(summary["distance_to_fp32"])
        rows.update(
            {f"grad {point} {part}": v for point, e in summary["gradient_error"].items() for part, v in e.items()}
        )
        for key, values in rows.items():
            ratio = {k: values[k] / values["stock"] if values["stock"] else None for k in BF16_RUNS[1:]}
            shown = "".join("{:>20}".format("—" if r is None else f"{r:.3f}") for r in ratio.values())
            print(f"{record['name']:<18} {key:<24}" + "".join(f"{values[k]:>13.4g}" for k in BF16_RUNS) + shown)
        for problem in record["problems"]:
            print(f"FAILED {record['name']}: {problem}")
    print(f"wrote {path} in {time.perf_counter() - started:.0f}s")
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
