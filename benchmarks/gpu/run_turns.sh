#!/usr/bin/env bash
# One GPU taken in turns (docs/one-gpu.md), after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md). Results under $OUT.
#   bash benchmarks/gpu/run_turns.sh bench [SIZES]   # benchmarks/sleep_wake.py (0.5b,1.5b,8b);
#       LORA=32: [lora]'s level-1 sleep, a rank-32 adapter refit
#   bash benchmarks/gpu/run_turns.sh tests           # tests/gpu's sleep tests (vLLM's real sleep)
#   bash benchmarks/gpu/run_turns.sh demo            # the GPU demo resident, then taking turns
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "${1:-bench}" in
  bench)
    timeout ${LIMIT:-540} python3 benchmarks/sleep_wake.py --sizes "${2:-0.5b,1.5b,8b}" \
      --repeats ${REPEATS:-10} --lora ${LORA:-0} --out "$OUT/sleep_wake.jsonl" \
      >> "$OUT/sleep_wake.log" 2>&1
    echo "sleep_wake rc=$?"
    grep -E "^ *[0-9.]+b |Error|error" "$OUT/sleep_wake.log" | cut -c1-300 | tail -20
    ;;
  tests)
    timeout ${LIMIT:-400} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm_gpu.py \
      -k "sleeping or after_the_wake" > "$OUT/turn_tests.txt" 2>&1
    echo "turn tests rc=$?"
    grep -E "^sleep |passed|failed|Error" "$OUT/turn_tests.txt" | cut -c1-300 | tail -20
    ;;
  demo)
    # the same workload resident (the engine's share fixed beside the trainer: the config's
    # 0.25) and taking turns (one chunk a step: a step's groups go to the trainer once the
    # engine sleeps; the engine may take 0.8 of the GPU, the trainer's state offloaded)
    NAME=resident LIMIT=240 bash benchmarks/gpu/run_demo.sh --set run.num_steps=15 \
      --set eval.num_prompts=0 --set pipeline.min_groups_for_streaming_train=0
    NAME=turns LIMIT=240 bash benchmarks/gpu/run_demo.sh --set run.num_steps=15 \
      --set eval.num_prompts=0 --set pipeline.min_groups_for_streaming_train=0 \
      --set 'cluster.placement="take_turns"' --set 'cluster.trainer_offload="always"' \
      --set 'generator.options.gpu_memory_utilization=0.8'
    for name in resident turns; do
      python3 - "$OUT/$name/metrics.jsonl" "$name" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"]
if len(steps) > 2:
    span = steps[-1]["time"] - steps[0]["time"]
    tokens = sum(r["response_tokens"] for r in steps[1:])
    turn = {k: round(sum(r.get(k, 0) for r in steps[1:]) / (len(steps) - 1), 4)
            for k in ("turn_sleep_s", "turn_to_trainer_s", "turn_state_to_host_s",
                      "turn_state_to_device_s", "refit_s")}
    print(f"{sys.argv[2]}: {len(steps)} steps, {span / (len(steps) - 1):.3f} s/step, "
          f"{tokens / span:.0f} tokens/s; per step {turn}")
PY
    done | tee "$OUT/demo_summary.txt"
    ;;
esac
