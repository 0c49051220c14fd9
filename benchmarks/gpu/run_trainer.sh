#!/usr/bin/env bash
# On the GPU host (one call, no vLLM needed): install the small wheels of .whl-trainer/
# (DeepSpeed built from its source package, its pure dependencies, pydantic, msgspec, pyzmq,
# structlog), make this checkout's plugins visible, run benchmarks/trainer.py with ARGS.
#   bash benchmarks/gpu/run_trainer.sh --gpus 1 --cases fsdp2,fsdp2-bare,...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-trainer/*.whl 2>&1 | tail -2
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
timeout ${LIMIT:-560} python3 benchmarks/trainer.py --out "$OUT/trainer.jsonl" "$@" 2>&1 | tee "$OUT/trainer.log" \
  | grep -E "GPU |failed|Error|error" | cut -c1-300
