#!/usr/bin/env bash
# benchmarks/generation.py's options part on the GPU host with py-spy recording each engine's
# rows after its warm-up (generation.py --profile: the steady state, engine core and front end),
# then where each process's time went (benchmarks/profile_top.py). py-spy comes from its wheel
# in .whl (pip download py-spy==0.4.3 --no-deps -d .whl), installed here into /tmp/spy. Arguments
# go to generation.py; pick rows so that each engine serves one request shape, e.g. the request
# as asyncrl sends it on vLLM's scheduler (engine 0) and on asyncrl's (engine 1):
#   bash benchmarks/gpu/profile_generation.sh --options-prompts 192 --rows "at the end" \
#     --option-repeats 2
# Writes $OUT/generation.json, .log, profile-engine<i>.txt (py-spy raw) and, per engine and
# process, profile-engine<i>-<role>.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/spy .whl/py_spy-*.whl \
  || { echo "no py-spy wheel in .whl" >&2; exit 2; }
export PATH=/tmp/spy/bin:$PATH
timeout "${LIMIT:-560}" python3 benchmarks/generation.py --work /tmp/gen-work --parts options \
  --profile "$OUT" --out "$OUT/generation.json" "$@" > "$OUT/generation.log" 2>&1
rc=$?
grep -E "^\||^  |tok/s|Error|error|py-spy" "$OUT/generation.log" | grep -v "INFO\|WARNING" | tail -40 | cut -c1-300
for raw in "$OUT"/profile-engine?.txt; do
  [ -f "$raw" ] || continue
  for role in engine-core front; do
    python3 benchmarks/profile_top.py "$raw" --role "$role" --top 50 \
      --match scheduler,logprob,serial,output_processor,sampler > "${raw%.txt}-$role.txt" 2>&1
    echo "== ${raw##*/} $role"; head -30 "${raw%.txt}-$role.txt"
  done
done
exit $rc
