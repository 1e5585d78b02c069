#!/usr/bin/env bash
# hf_flce under distributed training on 2 GPUs (NCCL), in about 4 minutes. Run from the repository root:
#
#   scripts/distributed_gpu.sh            # logs and JSON under $OUT (default outputs/distributed_gpu)
#
# 1. tests/test_distributed.py with NCCL: vocabulary-parallel op, DTensor heads, DDP, FSDP1, FSDP2 (and DeepSpeed
#    ZeRO-3 when deepspeed is importable) against single-process references.
#    Its Trainer test runs HF Trainer with DDP on a patched tiny Llama (torchrun).
# 2. The same Trainer check under `accelerate launch` with FSDP2: loss and gradients vs one process.
# 3. HF Trainer on a Qwen3-0.6B-sized model under `accelerate launch` with FSDP2, hf_flce vs stock: tokens/s and
#    peak memory per rank (bench_flce.json, bench_stock.json, summary in distributed.log).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
set -uo pipefail
OUT=${OUT:-outputs/distributed_gpu}
LOG="$OUT/distributed.log"
mkdir -p "$OUT"
rc=0
note() { echo "=== $* ($(date +%H:%M:%S))" | tee -a "$LOG"; }
LAUNCH="accelerate launch --num_processes 2 --main_process_port ${PORT:-29511}"

note env
{
	nvidia-smi -L
	python3 -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count())'
	python3 -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>/dev/null || echo "deepspeed not installed: ZeRO-3 tests skip"
} 2>&1 | tee -a "$LOG"

note "pytest tests/test_distributed.py (NCCL)"
timeout 180 python3 -m pytest -q -p no:cacheprovider -m distributed tests/test_distributed.py 2>&1 | tee -a "$LOG" || rc=1

note "Trainer check under accelerate launch (FSDP2)"
timeout 75 $LAUNCH --config_file examples/accelerate/fsdp2.yaml --mixed_precision no \
	tests/distributed_trainer.py check "$OUT/check_fsdp2" >"$OUT/check_fsdp2.log" 2>&1 || {
	rc=1
	tail -30 "$OUT/check_fsdp2.log" | tee -a "$LOG"
}
python3 - "$OUT/check_fsdp2" <<'PY' 2>&1 | tee -a "$LOG" || rc=1
import json, pathlib, sys
files = sorted(pathlib.Path(sys.argv[1]).glob("rank*.json"))
if not files:
    sys.exit("no results: see check_fsdp2.log")
for f in files:
    r = json.loads(f.read_text())["trainer"]
    if r["failure"]:
        sys.exit(f"{f.name}: {r['failure']}")
    worst = max(r["errors"].values())
    print(f.name, r["notes"], f"max relative error {worst:.2e}")
    if not worst <= 2e-5:
        sys.exit(f"{f.name}: errors above 2e-5")
PY

for mode in stock flce; do
	note "FSDP2 Trainer bench ($mode)"
	flag=$([ $mode = stock ] && echo --stock)
	timeout 120 $LAUNCH --config_file examples/accelerate/fsdp2.yaml tests/distributed_trainer.py bench "$OUT" $flag \
		>"$OUT/bench_$mode.log" 2>&1 || {
		rc=1
		tail -30 "$OUT/bench_$mode.log" | tee -a "$LOG"
	}
done
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("stock", "flce"):
    f = out / f"bench_{name}.json"
    if f.exists():
        r = json.loads(f.read_text())
        peaks = ", ".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(f"{r['label']:>8}: {r['tokens_per_s']:,.0f} tokens/s on {r['world_size']} GPUs ({r['distributed_type']}), "
              f"peak GiB per rank [{peaks}], losses {[round(x, 3) for x in r['losses']]}")
PY
note "done (rc=$rc)"
exit $rc
