#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one short run (about 6 minutes on one H100/H200):
#   1. the kernel tests, gpu-marked ones included (on a GPU the kernels run compiled, not interpreted);
#   2. benchmarks/bench_kernels.py (writes benchmarks/results/kernels.{csv,md});
#   3. algos/grpo.py on CUDA for a few rollout batches, without and with --kernels (the fused log-prob and
#      clipped-loss kernels inside a real training step), so the --kernels path is exercised end to end.
# Logs go to $OUT (default: runs/gpu_checks). Each step has its own time limit, so one hang cannot eat the rest.
#
#     bash benchmarks/gpu_checks.sh && python benchmarks/report.py
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"

echo "== kernel tests" | tee "$OUT/tests.log"
timeout 240 python3 -m pytest -q -s -rfE --tb=short -p no:cacheprovider tests/test_kernels_*.py >> "$OUT/tests.log" 2>&1
tail -30 "$OUT/tests.log"

echo "== kernel benchmark" | tee "$OUT/bench.log"
timeout 330 python3 benchmarks/bench_kernels.py 2>&1 | tee -a "$OUT/bench.log"
cp benchmarks/results/kernels.md benchmarks/results/kernels.csv "$OUT/" 2>/dev/null

echo "== grpo on CUDA, eager then --kernels" | tee "$OUT/grpo.log"
for k in --no-kernels --kernels; do
  timeout 120 python3 algos/grpo.py --device cuda $k --steps 40 --eval-every 20 --eval-examples 300 \
    --pass-k 0 --no-eval-hard --out-dir runs/gpu_checks_grpo --exp-name "grpo$k" > "$OUT/grpo_run.log" 2>&1
  echo "grpo $k: exit $?" | tee -a "$OUT/grpo.log"
  tail -5 "$OUT/grpo_run.log" >> "$OUT/grpo.log"
  cat "runs/gpu_checks_grpo/grpo$k/summary.json" >> "$OUT/grpo.log" 2>/dev/null
done
rm -f "$OUT/grpo_run.log"
