#!/usr/bin/env bash
# Jobs on one GPU (docs/jobs.md), after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md). Results under $OUT.
#   bash benchmarks/gpu/run_jobs.sh [SIZES]   # benchmarks/jobs_engine.py: one engine serving
#       0, 1, 2, 4 and 8 jobs' rank-32 adapters in one batch (default 1.5b)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
timeout ${LIMIT:-540} python3 benchmarks/jobs_engine.py --sizes "${1:-1.5b}" \
  --jobs ${JOBS:-0,1,2,4,8} --rank ${RANK:-32} --out "$OUT/jobs_engine.jsonl" \
  >> "$OUT/jobs_engine.log" 2>&1
echo "jobs_engine rc=$?"
grep -E " jobs: |Error|error" "$OUT/jobs_engine.log" | cut -c1-300 | tail -20
