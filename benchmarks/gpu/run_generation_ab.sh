#!/usr/bin/env bash
# benchmarks/generation.py --parts side on two trees in one call, on one GPU: a base revision
# (unpacked beside the tree, as for run_ab.sh) and the work tree, one after the other, each
# with its own code and entry points (a metadata folder of its own, never /tmp/site's), after
# vLLM 0.26 was staged into /tmp/site. Arguments go to generation.py; each side's vLLM-alone
# column is measured again, so the two asyncrl columns are read against their own.
#
#   mkdir .ab-base && git archive REV | tar -x -C .ab-base     # .ab-base/ is ignored
#   bash benchmarks/gpu/run_generation_ab.sh --in-flight 2048,16 --prompts 256 --alone vllm
#
# GEN_AB_ORDER sets the order (default "base work"). Writes $OUT/generation-<side>.json/.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || true
[ -d .whl-trainer ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-trainer/*.whl 2>/dev/null
export VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
[ -d .ab-base ] || { echo "no .ab-base/: unpack the base revision there first"; exit 2; }
rc=0
for side in ${GEN_AB_ORDER:-base work}; do
  tree=$PWD
  [ "$side" = base ] && tree=$PWD/.ab-base
  rm -rf "/tmp/meta-$side"
  paths=$(python3 "$tree/benchmarks/gpu/register_plugins.py" "/tmp/meta-$side") || exit 1
  echo "== $side: $(cd "$tree" && git rev-parse --short HEAD 2>/dev/null || echo "$tree")"
  PYTHONPATH="/tmp/meta-$side:$paths:/tmp/site" timeout "${LIMIT:-280}" \
    python3 "$tree/benchmarks/generation.py" --parts side --work /tmp/gen-work \
    --out "$OUT/generation-$side.json" "$@" > "$OUT/generation-$side.log" 2>&1 || rc=$?
  grep -E "^\||tok/s|Error" "$OUT/generation-$side.log" | grep -v "INFO\|WARNING" | tail -12 | cut -c1-240
done
exit $rc
