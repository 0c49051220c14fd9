#!/usr/bin/env bash
# The tiny-arith demo on a GPU host (trainer and engine share GPU 0), after vLLM 0.26 was
# staged into /tmp/site (shared/gpu/README.md). Writes results under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):$PYTHONPATH
export VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import asyncrl, vllm, torch; print('asyncrl', asyncrl.__version__, 'vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
/usr/bin/time -v python3 -m asyncrl_arith.make_model runs/tiny-arith/model --threads 8 > "$OUT/make_model.json" 2> "$OUT/make_model.err" || { tail -30 "$OUT/make_model.err"; exit 1; }
tail -1 "$OUT/make_model.json"
start=$(date +%s)
set +e
python3 -m torch.distributed.run --nproc-per-node 2 -m asyncrl.launch examples/tiny_arith_gpu.toml "$@" > "$OUT/demo.log" 2>&1
rc=$?
set -e
echo "demo rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$OUT/gpu.txt"
cp runs/tiny-arith-gpu/metrics.jsonl "$OUT/" 2>/dev/null || true
cp runs/tiny-arith-gpu/logs/rollout-0.log "$OUT/rollout-0.log" 2>/dev/null || true
grep -E "eval_finished|step_finished|error|Error" "$OUT/demo.log" | tail -40 | cut -c1-300
exit $rc
