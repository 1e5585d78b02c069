#!/usr/bin/env bash
# One command for the GPU machine: install the carried peer wheels, then run the chosen steps, logging to $OUT.
#
#   scripts/gpu_suite.sh [env] [tests] [kernel] [training]     (no step named: all four, in that order)
#
# A full kernel run (6 shapes x 8 providers x flat/peaked, plus pertoken, masked, memory-vs-N) is estimated at 6-8
# minutes on one H100/H200, most of it torch.compile and CCE autotuning; a full training run at about 4-5 minutes.
# kernel.json and training.json are rewritten after every shape/provider, so a run cut off at the limit keeps what it
# finished; split runs are merged afterwards with `--from-json a.json,b.json --out DIR` (tables and plots only).
# Extra arguments for the benchmarks come from the environment, e.g. to split under the 10-minute limit:
#   KERNEL_ARGS="--sections main --shapes llama3-8b,qwen2.5-7b,mistral-7b" scripts/gpu_suite.sh kernel
#   KERNEL_ARGS="--sections main,pertoken,masked,memory --shapes qwen3-0.6b,gemma2-2b,accuracy" ...
#   TRAINING_ARGS="--models qwen3-0.6b --quick" scripts/gpu_suite.sh training
#   PYTEST_ARGS="-x -k triton" scripts/gpu_suite.sh tests
# Run it from the repository root with .whl carried. Output: $OUT/suite.log and $OUT/bench/{kernel,training}.{json,md,png}
# (seven files, inside the device tool's limit of eight).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
	export PYTHONPATH=/tmp/site:$PWD || exit 1
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu_suite}
BENCH="$OUT/bench"
LOG="$OUT/suite.log"
mkdir -p "$BENCH"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests kernel training)
rc=0

note() { echo "=== $* ($(date +%H:%M:%S))" | tee -a "$LOG"; }

for step in "${steps[@]}"; do
	note "step $step"
	case "$step" in
	env)
		{
			nvidia-smi -L
			nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
			python3 -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)'
			python3 -c 'import importlib.metadata as m
for p in ("liger-kernel", "cut-cross-entropy", "trl", "datasets", "dill", "multiprocess", "xxhash", "pyarrow", "accelerate", "peft"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)'
			python3 -c 'import liger_kernel.transformers, cut_cross_entropy, trl.kernels, trl.trainer.utils, hf_flce; print("imports ok")'
		} 2>&1 | tee -a "$LOG" || rc=1
		;;
	tests)
		# Exit status 5 means no test carries the gpu marker yet: not a failure of the suite.
		python3 -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} tests 2>&1 | tee -a "$LOG"
		status=$?
		[ $status -ne 0 ] && [ $status -ne 5 ] && rc=1
		;;
	kernel)
		python3 scripts/benchmark_kernel.py --device cuda --out "$BENCH" ${KERNEL_ARGS:-} 2>&1 | tee -a "$LOG" || rc=1
		;;
	training)
		python3 scripts/benchmark_training.py --device cuda --out "$BENCH" ${TRAINING_ARGS:-} 2>&1 | tee -a "$LOG" || rc=1
		;;
	*)
		echo "unknown step '$step' (use env, tests, kernel, training)" | tee -a "$LOG"
		rc=2
		;;
	esac
done
note "done, status $rc"
exit $rc
