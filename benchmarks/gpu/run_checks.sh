#!/usr/bin/env bash
# On the GPU host, after vLLM 0.26 was staged into /tmp/site (shared/gpu/README.md): the GPU
# tests and benchmarks/modes.py (every mode, and the controller's loop lag, on this host's
# CPUs). Small wheels the image lacks travel in .whl/. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0
{ nproc; lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name --format=csv,noheader; } | tee "$OUT/host.txt"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/host.txt"
tail -5 "$OUT/gpu_tests.txt"
timeout 240 python3 benchmarks/modes.py --out "$OUT/modes.json" "$@" > "$OUT/modes.txt" 2>&1
echo "modes rc=$?" | tee -a "$OUT/host.txt"
tail -14 "$OUT/modes.txt"
