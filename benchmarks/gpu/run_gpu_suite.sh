#!/usr/bin/env bash
# tests/gpu on the GPU host, whole, after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md); carry .whl (pytest-asyncio, pytest-timeout, pytest-reverse, structlog,
# jsonschema and its four, uvicorn, httptools, psutil) and .whl-trainer (DeepSpeed and what it
# imports, docs/training-throughput.md) with the call:
#   bash benchmarks/gpu/run_gpu_suite.sh                       # tests/gpu in its default order
#   bash benchmarks/gpu/run_gpu_suite.sh tests/gpu --reverse   # reversed: no test may lean on
#                                                              # what another left behind
# Arguments (default: tests/gpu) go to pytest. Each run's output: $OUT/gpu-suite-<n>.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/gpu_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/gpu-suite-$(find "$OUT" -name 'gpu-suite-*.txt' | wc -l).txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$log"
echo "pytest ${*:-tests/gpu}" | tee -a "$log"
start=$(date +%s)
timeout "${LIMIT:-560}" python3 -m pytest -q -s -p no:cacheprovider --durations=10 \
  "${@:-tests/gpu}" >> "$log" 2>&1
echo "rc=$? in $(( $(date +%s) - start )) s"
grep -E "passed|failed|error|held logprobs, max|^FAILED|^ERROR" "$log" | tail -15
