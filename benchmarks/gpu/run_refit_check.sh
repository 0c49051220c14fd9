#!/usr/bin/env bash
# benchmarks/refit_check.py on the GPU host, after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md); carry .whl with the call. Arguments go to refit_check.py:
#   bash benchmarks/gpu/run_refit_check.sh --sizes 0.5b --dtypes bfloat16 --steps 30
# The table and its JSON: $OUT/refit-check-<sizes>.{txt,json}.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/gpu_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
name="refit-check-$(echo "$*" | tr -c 'A-Za-z0-9.-' '_' | cut -c1-60)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/$name.txt"
timeout "${LIMIT:-560}" python3 benchmarks/refit_check.py --work /tmp/refit-check \
  --out "$OUT/$name.json" "$@" >> "$OUT/$name.txt" 2>&1
echo "rc=$?"
grep -E "^\||wrote|Error" "$OUT/$name.txt" | tail -20
