#!/usr/bin/env bash
# benchmarks/kill_resume.py on the GPU demo (examples/tiny_arith_gpu.toml: FSDP2 and vLLM
# sharing GPU 0, CUDA IPC refits), after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md); carry .whl and .whl-trainer (psutil). Results under $OUT.
#   KILLS=3 bash benchmarks/gpu/run_kill_resume.sh [--set k=v ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/demo_env.sh
timeout ${LIMIT:-540} python3 benchmarks/kill_resume.py --config examples/tiny_arith_gpu.toml \
  --kills "${KILLS:-3}" --workdir "$PWD/runs/kill-resume-gpu" --out "$OUT/kill-resume-gpu.json" \
  --timeout 240 "$@" 2>&1 | tee "$OUT/kill-resume-gpu.txt" | tail -25
cp runs/kill-resume-gpu/life-*.log "$OUT/" 2>/dev/null || true
