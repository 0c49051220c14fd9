#!/usr/bin/env bash
# benchmarks/generation.py on the GPU host under py-spy (its subprocesses too: vLLM's engine
# core, and workers if any), then where each process's time went (benchmarks/profile_top.py).
# py-spy comes from its wheel in .whl (pip download py-spy==0.4.3 --no-deps -d .whl), which
# gpu_env.sh installs into /tmp/site. Arguments go to generation.py; pick rows so that each
# engine serves one request shape, e.g. the request as asyncrl sends it on vLLM's scheduler
# (engine 1) and on asyncrl's (engine 2):
#   bash benchmarks/gpu/profile_generation.sh --parts options --options-prompts 192 \
#     --rows "at the end" --option-repeats 2
# Writes $OUT/generation.json, .log, profile.txt (py-spy raw) and profile-<role>.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/gpu_env.sh
SPY=/tmp/site/bin/py-spy
[ -x "$SPY" ] || { echo "no py-spy in /tmp/site/bin: add its wheel to .whl" >&2; exit 2; }
timeout "${LIMIT:-560}" "$SPY" record --subprocesses --nonblocking --format raw -r 100 \
  -o "$OUT/profile.txt" -- python3 benchmarks/generation.py --work /tmp/gen-work \
  --out "$OUT/generation.json" "$@" > "$OUT/generation.log" 2>&1
rc=$?
grep -E "^\||^  |tok/s|Error|error" "$OUT/generation.log" | grep -v "INFO\|WARNING" | tail -40 | cut -c1-300
for role in engine-core worker front; do
  python3 benchmarks/profile_top.py "$OUT/profile.txt" --role "$role" --top 60 \
    --match scheduler,logprob,serial,output_processor,sampler > "$OUT/profile-$role.txt" 2>&1
  head -45 "$OUT/profile-$role.txt"
done
exit $rc
