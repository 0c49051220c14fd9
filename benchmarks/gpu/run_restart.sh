#!/usr/bin/env bash
# benchmarks/restart.py on the GPU demo (examples/tiny_arith_gpu.toml: FSDP2 and vLLM sharing
# GPU 0, CUDA IPC refits): the rollout worker and then vLLM's EngineCore are SIGKILLed while
# the run goes on; each is restarted in place on the same GPU. After vLLM 0.26 was staged
# into /tmp/site (shared/gpu/README.md); carry .whl and .whl-trainer (psutil).
#   KILLS=2 bash benchmarks/gpu/run_restart.sh [--set k=v ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/demo_env.sh
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/gpu-memory-before.csv" || true
timeout ${LIMIT:-540} python3 benchmarks/restart.py --config examples/tiny_arith_gpu.toml \
  --kills "${KILLS:-2}" --set run.num_steps=60 --workdir "$PWD/runs/restart-gpu" \
  --out "$OUT/restart-gpu.json" --timeout 480 "$@" 2>&1 | tee "$OUT/restart-gpu.txt" | tail -25 \
  && rc=0 || rc=$?
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/gpu-memory-after.csv" || true
cp runs/restart-gpu/launch.log "$OUT/" 2>/dev/null || true
cp runs/restart-gpu/logs/rollout-0.log "$OUT/" 2>/dev/null || true
exit $rc
