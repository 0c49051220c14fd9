# Sourced by the GPU demo benchmarks (run_kill_resume.sh, run_restart.sh) after vLLM 0.26 was
# staged into /tmp/site (shared/gpu/README.md): the environment of gpu_env.sh (.whl-trainer
# brings psutil), and the demo's model, made once (runs/tiny-arith/model). Expects $OUT.
source benchmarks/gpu/gpu_env.sh
if [ ! -f runs/tiny-arith/model/config.json ]; then
  python3 -m asyncrl_arith.make_model runs/tiny-arith/model --threads 8 > "$OUT/make_model.json" 2> "$OUT/make_model.err" || { tail -30 "$OUT/make_model.err"; exit 1; }
fi
