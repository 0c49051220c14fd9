#!/usr/bin/env bash
# benchmarks/episodes.py on the GPU host's CPUs (16 cores; CUDA hidden): ~1,000 concurrent
# 4-turn episodes on the example engine, the controller's loop lag with cores to spare for the
# workers (on the 2-core dev box they share the controller's). Needs only the small wheels of
# .whl/ (pyzmq, msgspec, structlog, jsonschema and its four: carry .whl with the call); no
# vLLM. From the repo root:
#
#   bash benchmarks/gpu/run_episodes_cpu.sh      # ~6 min; writes $OUT/episodes-16core.json
#
# then the full run (sweep included) and two more runs of the main workload for the spread.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/cpu_env.sh
if [ "${AGAIN_ONLY:-}" != 1 ]; then
  python3 benchmarks/episodes.py --sweep 0.2 0.4 --machine 16core --out "$OUT/episodes-16core.json" \
    > "$OUT/episodes.txt" 2>&1 || { tail -30 "$OUT/episodes.txt"; exit 1; }
  grep -E '^(run|small|sweep)' "$OUT/episodes.txt" | cut -c1-600
fi
for i in ${AGAIN:-1}; do
  python3 benchmarks/episodes.py --small-prompts 0 --out "$OUT/episodes-again-$i.json" \
    > "$OUT/episodes-again-$i.txt" 2>&1 || { tail -30 "$OUT/episodes-again-$i.txt"; exit 1; }
  grep -E '^run' "$OUT/episodes-again-$i.txt" | cut -c1-600
done
