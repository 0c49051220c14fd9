#!/usr/bin/env bash
# benchmarks/ab.py on the GPU host's CPUs, pinned to two cores (taskset 0,1; CUDA hidden): a
# base revision against the work tree on a quiet machine (the 2-core dev box is often busy
# with CI). The host has no git: unpack the base beside the tree first and carry it with .whl
# (the small wheels of run_gateway_cpu.sh):
#
#   mkdir .ab-base && git archive REV | tar -x -C .ab-base     # .ab-base/ is ignored
#   bash benchmarks/gpu/run_ab.sh                              # writes $OUT/ab.json, ab.txt
#
# AB_ARGS adds arguments (e.g. "--part lag --rounds 3"); AB_CORES changes the cores (0,1).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=
{ nproc; lscpu | grep -E "Model name"; python3 --version; echo "cores ${AB_CORES:-0,1}"; } | tee "$OUT/host.txt"
taskset -c "${AB_CORES:-0,1}" python3 benchmarks/ab.py --base-dir .ab-base --out "$OUT/ab.json" \
  ${AB_ARGS:-} > "$OUT/ab.txt" 2>&1 || { tail -40 "$OUT/ab.txt"; exit 1; }
tail -30 "$OUT/ab.txt"
