#!/usr/bin/env bash
# The CPU demo (examples/tiny_arith.toml: vLLM CPU build + FSDP2 on gloo) on the GPU host's CPU
# (AMX), before and after the shipped warm start, with CUDA hidden. Needs the bundle of
# scripts/amx (make_bundle.sh here, then `bash scripts/amx/run_on_host.sh K` for each piece on the
# host); then, from the repo root there:
#
#   bash benchmarks/gpu/run_cpu_demo_amx.sh      # writes $OUT/demo-*.log, $OUT/make_model-*.json
#
# "before" is the recipe make_model trained by default until the warm start was shipped: phase 1
# capped at 600 steps (`--from-scratch --sft-steps 600` computes exactly that); "after" is today's
# default (the shipped weights). Each is followed by the demo's 30 GRPO steps.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
VENV=/opt/amx/venv
export LD_LIBRARY_PATH="/opt/amx/lib:/root/.pyenv/versions/3.11.7/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_VISIBLE_DEVICES=
grep -o 'amx[a-z_0-9]*\|avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$OUT/cpu_flags.txt"
nproc >> "$OUT/cpu_flags.txt"
for which in after before; do
  rm -rf runs/tiny-arith
  if [ "$which" = before ]; then args=(--from-scratch --sft-steps 600); else args=(); fi
  "$VENV/bin/python" -m asyncrl_arith.make_model runs/tiny-arith/model "${args[@]}" \
    > "$OUT/make_model-$which.json" 2> "$OUT/make_model-$which.err" || { tail -20 "$OUT/make_model-$which.err"; exit 1; }
  start=$(date +%s)
  "$VENV/bin/asyncrl" run examples/tiny_arith.toml > "$OUT/demo-$which.log" 2>&1 || { tail -30 "$OUT/demo-$which.log"; exit 1; }
  echo "$which: make_model $(grep -o '"eval_greedy_acc": [0-9.]*' "$OUT/make_model-$which.json");" \
    "$(grep -E '^eval (start|end)' "$OUT/demo-$which.log" | tr '\n' ' ') wall $(( $(date +%s) - start )) s"
  cp runs/tiny-arith/metrics.jsonl "$OUT/metrics-$which.jsonl"
done
