#!/usr/bin/env bash
# benchmarks/generation.py on the GPU host, after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md, benchmarks/gpu/install_staged.sh). Arguments go to generation.py;
# the model is written once per host (/tmp/gen-work). Writes $OUT/generation.json and .log.
#   bash benchmarks/gpu/run_generation.sh --parts options --options-prompts 192
#   bash benchmarks/gpu/run_generation.sh --parts options --options-prompts 192 \
#     --rows logprobs,seed --option-repeats 3
#   bash benchmarks/gpu/run_generation.sh --parts side --in-flight 4096,16,1
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${LIMIT:-560}" python3 benchmarks/generation.py --work /tmp/gen-work \
  --out "$OUT/generation.json" "$@" > "$OUT/generation.log" 2>&1
rc=$?
grep -E "^\||^  |tok/s|Error|error" "$OUT/generation.log" | grep -v "INFO\|WARNING" | tail -60 | cut -c1-300
exit $rc
