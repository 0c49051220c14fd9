# Sourced from the repo root by the GPU benchmarks after vLLM 0.26 was staged into /tmp/site
# (shared/gpu/README.md): installs the carried wheels (.whl, and .whl-trainer where it came)
# next to it, puts the repo's distributions on the path (register_plugins.py) and keeps vLLM's
# sampler off FlashInfer, which is not staged.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || true
[ -d .whl-trainer ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-trainer/*.whl 2>/dev/null
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0
