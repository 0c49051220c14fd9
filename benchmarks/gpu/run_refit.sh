#!/usr/bin/env bash
# On the GPU host, after vLLM 0.26 was staged into /tmp/site (shared/gpu/README.md):
#   bash benchmarks/gpu/run_refit.sh tests            # tests/gpu (CUDA IPC refits, FP8 KV, the
#                                                     # training contract; carry .whl-trainer too)
#   bash benchmarks/gpu/run_refit.sh 1gpu [ARGS]      # benchmarks/refit.py, one-GPU trainer
#   bash benchmarks/gpu/run_refit.sh fsdp2 [ARGS]     # benchmarks/refit.py, 2-GPU FSDP2 trainer
# Small wheels the image lacks travel in .whl/. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
part=${1:-tests}
shift || true
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
# DeepSpeed and its pure dependencies, for the training-contract classes of tests/gpu
[ -d .whl-trainer ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-trainer/*.whl 2>/dev/null
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "$part" in
  tests)
    timeout ${LIMIT:-500} python3 -m pytest -q -s -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?"
    grep -E "cuda_ipc from|shm from|passed|failed|Error|skipped" "$OUT/gpu_tests.txt" | tail -20
    ;;
  1gpu)
    timeout ${LIMIT:-560} python3 benchmarks/refit.py --out "$OUT/refit.jsonl" "$@" 2>&1 | tee "$OUT/refit-1gpu.log" \
      | grep -E "^ *[0-9.]+b |engine started|Error|error" | cut -c1-250
    ;;
  fsdp2)
    timeout ${LIMIT:-560} python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/refit.py \
      --trainer fsdp2 --out "$OUT/refit.jsonl" "$@" > "$OUT/refit-fsdp2.log" 2>&1
    echo "fsdp2 rc=$?"
    grep -E "^ *[0-9.]+b |started in|Error|error" "$OUT/refit-fsdp2.log" | cut -c1-250 | tail -30
    ;;
esac
