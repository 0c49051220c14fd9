# Sourced by the GPU demo benchmarks (run_kill_resume.sh, run_restart.sh) after vLLM 0.26 was
# staged into /tmp/site (shared/gpu/README.md): installs the carried wheels (.whl, and
# .whl-trainer for psutil) next to it, puts the plugins on the path, and makes the demo's
# model once (runs/tiny-arith/model). Expects $OUT.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || true
[ -d .whl-trainer ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-trainer/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):$PYTHONPATH
export VLLM_USE_FLASHINFER_SAMPLER=0
if [ ! -f runs/tiny-arith/model/config.json ]; then
  python3 -m asyncrl_arith.make_model runs/tiny-arith/model --threads 8 > "$OUT/make_model.json" 2> "$OUT/make_model.err" || { tail -30 "$OUT/make_model.err"; exit 1; }
fi
