#!/usr/bin/env bash
# The tiny-arith demo on a GPU host, after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md). Writes results under $OUT/$NAME.
#   bash benchmarks/gpu/run_demo.sh                      # trainer and engine share GPU 0
#   NAME=split bash benchmarks/gpu/run_demo.sh --set 'cluster.rollout_gpus=[1]'
#   NAME=fp8 bash benchmarks/gpu/run_demo.sh --set 'generator.options.kv_cache_dtype="fp8"'
# Extra arguments go to asyncrl.launch; the model is made once (runs/tiny-arith/model).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || true
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):$PYTHONPATH
export VLLM_USE_FLASHINFER_SAMPLER=0
NAME=${NAME:-tiny-arith-gpu}
OUT=${OUT:-/tmp/out}/$NAME
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import asyncrl, vllm, torch; print('asyncrl', asyncrl.__version__, 'vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
if [ ! -f runs/tiny-arith/model/config.json ]; then
  /usr/bin/time -v python3 -m asyncrl_arith.make_model runs/tiny-arith/model --threads 8 > "$OUT/make_model.json" 2> "$OUT/make_model.err" || { tail -30 "$OUT/make_model.err"; exit 1; }
  tail -1 "$OUT/make_model.json"
fi
run_dir=$PWD/runs/$NAME
start=$(date +%s)
set +e
timeout ${LIMIT:-300} python3 -m torch.distributed.run --nproc-per-node 2 -m asyncrl.launch \
  examples/tiny_arith_gpu.toml --set "run.name=\"$NAME\"" --set "run.output_dir=\"$run_dir\"" "$@" \
  > "$OUT/demo.log" 2>&1
rc=$?
set -e
echo "demo $NAME rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$OUT/gpu.txt"
cp "$run_dir/metrics.jsonl" "$OUT/" 2>/dev/null || true
cp "$run_dir/logs/rollout-0.log" "$OUT/rollout-0.log" 2>/dev/null || true
grep -E "eval_finished|error|Error" "$OUT/demo.log" | tail -10 | cut -c1-300
exit $rc
