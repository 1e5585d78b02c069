#!/usr/bin/env bash
# hf_flce under distributed training on 2 GPUs (NCCL), in about 6 minutes. Run from anywhere in the repository:
#
#   bash scripts/distributed_gpu.sh        # results under $OUT (default outputs/distributed_gpu)
#
# 1. tests/test_distributed.py with NCCL: the vocabulary-parallel op, DTensor heads, DDP, FSDP1 (both
#    use_orig_params), FSDP2 and DeepSpeed ZeRO-3 against single-process references, HF Trainer under DDP, and
#    FLCESFTTrainer under DDP and FSDP2 (torchrun) against one process.
# 2. Under `accelerate launch` with examples/accelerate/fsdp2.yaml: the HF Trainer check (tests/distributed_trainer.py)
#    and FLCESFTTrainer through accelerate's own FSDP2 (lm_head.weight a sharded DTensor outside its call, whole
#    inside); with examples/accelerate/zero3.yaml: FLCESFTTrainer under DeepSpeed ZeRO-3. Both against the same
#    trainer in one process on the concatenated batch: every logged value, gradients, parameters.
# 3. tokens/s and peak memory per rank on a Qwen3-0.6B-sized model under FSDP2 (bf16): HF Trainer stock vs patched,
#    TRL's SFTTrainer vs FLCESFTTrainer (tests/distributed_bench.py), with ratios ours / stock.
#
# Wheels not on the machine come from .whl/*.whl and .whl/ds/*.whl (DeepSpeed and its dependencies), installed with
# pip --no-index --no-deps into a --target folder. Every step runs under a timeout inside one time budget (BUDGET_S,
# default 540 s), so a hang cannot take the whole run. $OUT receives three files: distributed.log (steps and the
# summary), steps.log (every step's full output) and results.json (versions, steps, checks, benchmark numbers).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-outputs/distributed_gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOG=$OUT/distributed.log
DETAIL=$OUT/steps.log
: >"$LOG"
: >"$DETAIL"
say() { echo "$*" | tee -a "$LOG"; }

gpus=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
if [ "${gpus:-0}" -lt 2 ]; then
	say "scripts/distributed_gpu.sh needs 2 CUDA GPUs; $PY sees ${gpus:-none (torch not importable)}." \
		"On CPU, 'make test' runs the same tests with gloo."
	exit 2
fi

BUDGET_S=${BUDGET_S:-540}
DEADLINE=$((SECONDS + BUDGET_S))
RESERVE_S=15 # kept for the summary
WORK=$(mktemp -d "${TMPDIR:-/tmp}/hf_flce_dist.XXXXXX")
SITE=${SITE:-/tmp/site}
PORT=${PORT:-29511}
mkdir -p "$WORK/logs" "$WORK/sft"
say "=== hf_flce distributed GPU run $(date -u +%FT%TZ), budget ${BUDGET_S}s, work folder $WORK"

# Wheels. pydantic 2.14 (DeepSpeed's config) needs typing_extensions >= 4.16: installed from .whl/ds only when the
# machine's is older, so as not to shadow it for nothing.
ds_wheels=()
for w in .whl/ds/*.whl; do
	case $(basename "$w") in
	typing_extensions-*)
		$PY -c 'import sys; from importlib.metadata import version; from packaging.version import Version
sys.exit(Version(version("typing_extensions")) < Version("4.16"))' 2>/dev/null || ds_wheels+=("$w")
		;;
	*) [ -e "$w" ] && ds_wheels+=("$w") ;;
	esac
done
# Two installs, so that a DeepSpeed wheel that does not fit leaves TRL and datasets installed.
for set in base ds; do
	if [ $set = base ]; then wheels=(.whl/*.whl); else wheels=("${ds_wheels[@]}"); fi
	[ -e "${wheels[0]:-}" ] || continue
	$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
		"${wheels[@]}" >"$WORK/logs/pip_$set.log" 2>&1 || {
		say "pip install of the $set wheels failed:"
		tail -n 5 "$WORK/logs/pip_$set.log" | sed 's/^/    /' | tee -a "$LOG"
	}
done
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# DeepSpeed from a py3-none wheel: no compiled ops (the tests use torch's SGD), no nvcc needed.
export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1
export HF_FLCE_HANG_S=${HF_FLCE_HANG_S:-150} # distributed_sft.py dumps its stacks and exits after this long

# run_step NAME CAP_S COMMAND...: run under `timeout` (CAP_S, or what is left of the budget); the full output goes to
# steps.log, one line to distributed.log (with the output's tail on failure), a row to $WORK/steps.tsv.
run_step() {
	local name=$1 cap=$2
	shift 2
	local left=$((DEADLINE - SECONDS - RESERVE_S))
	local limit=$((cap < left ? cap : left))
	if [ "$limit" -lt 20 ]; then
		printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$WORK/steps.tsv"
		say "--- $name: skipped, out of the time budget"
		return 1
	fi
	local start=$SECONDS rc
	timeout -k 10 "$limit" "$@" >"$WORK/logs/$name.log" 2>&1
	rc=$?
	local took=$((SECONDS - start))
	{
		echo "=== $name: exit $rc after ${took}s (limit ${limit}s): $*"
		cat "$WORK/logs/$name.log"
	} >>"$DETAIL"
	printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" >>"$WORK/steps.tsv"
	if [ "$rc" -eq 0 ]; then
		say "--- $name: ok (${took}s)"
	else
		say "--- $name: exit $rc after ${took}s$([ "$rc" -eq 124 ] && echo ", timed out")"
		grep -v -e 'Warning' -e 'warnings.warn' "$WORK/logs/$name.log" | tail -n 25 | sed 's/^/    /' | tee -a "$LOG"
	fi
	return "$rc"
}

run_step env 90 $PY - "$WORK/env.json" <<'PY'
import importlib
import json
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

info = {}
for name in ("torch", "triton", "transformers", "accelerate", "trl", "datasets", "pydantic", "typing_extensions"):
    try:
        info[name] = version(name)
    except PackageNotFoundError:
        info[name] = None
try:
    info["deepspeed"] = importlib.import_module("deepspeed").__version__
except Exception as exc:  # the summary fails this check; the ZeRO-3 tests would skip
    info["deepspeed"] = f"not importable: {type(exc).__name__}: {exc}"
info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
PY
tail -n 1 "$WORK/logs/env.log" | tee -a "$LOG"

# The single-process FLCESFTTrainer reference (one GPU, seconds) runs beside pytest.
(
	start=$SECONDS
	# one visible GPU: with two, Trainer would wrap the model in nn.DataParallel
	CUDA_VISIBLE_DEVICES=0 timeout -k 10 180 $PY tests/distributed_sft.py "$WORK/sft" single >"$WORK/logs/sft_single.log" 2>&1
	printf '%s\t%s\t%s\t%s\n' sft_single $? $((SECONDS - start)) 180 >"$WORK/sft_single.tsv"
) &
single=$!

run_step pytest 300 $PY -m pytest -q -p no:cacheprovider -m distributed tests/test_distributed.py \
	--junitxml="$WORK/pytest.xml"
grep -E '^(FAILED|ERROR|SKIPPED)|passed|failed' "$WORK/logs/pytest.log" | tail -n 12 | sed 's/^/    /' | tee -a "$LOG"

wait "$single"
cat "$WORK/sft_single.tsv" >>"$WORK/steps.tsv" 2>/dev/null
{
	echo "=== sft_single (in the background): $(cut -f2,3 "$WORK/sft_single.tsv" 2>/dev/null)"
	cat "$WORK/logs/sft_single.log"
} >>"$DETAIL"
say "--- sft_single (beside pytest): exit $(cut -f2 "$WORK/sft_single.tsv" 2>/dev/null)"

LAUNCH=($PY -m accelerate.commands.launch --num_processes 2)
run_step sft_launch_fsdp2 120 "${LAUNCH[@]}" --mixed_precision no --main_process_port $((PORT + 1)) \
	--config_file examples/accelerate/fsdp2.yaml tests/distributed_sft.py "$WORK/sft" trainer_check launch_fsdp2
run_step sft_launch_zero3 120 "${LAUNCH[@]}" --mixed_precision no --main_process_port $((PORT + 2)) \
	--config_file examples/accelerate/zero3.yaml tests/distributed_sft.py "$WORK/sft" launch_zero3
for scenario in launch_fsdp2 launch_zero3; do
	timeout -k 5 60 $PY tests/distributed_sft.py compare "$WORK/sft" "$scenario" \
		--json "$WORK/sft/compare_$scenario.json" >"$WORK/logs/compare_$scenario.log" 2>&1
	cat "$WORK/logs/compare_$scenario.log" >>"$DETAIL"
	head -n 1 "$WORK/logs/compare_$scenario.log" | sed 's/^/    /' | tee -a "$LOG"
done

run_step bench 240 "${LAUNCH[@]}" --main_process_port $((PORT + 3)) \
	--config_file examples/accelerate/fsdp2.yaml tests/distributed_bench.py "$WORK/bench.json"

say ""
$PY scripts/distributed_gpu_summary.py "$WORK" "$OUT/results.json" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "=== done in $((SECONDS))s (rc=$rc); full output in $DETAIL"
exit "$rc"
