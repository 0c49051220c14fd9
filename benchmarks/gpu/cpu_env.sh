# Sourced from the repo root by the GPU host's CPU-only benchmarks (run_episodes_cpu.sh,
# run_gateway_cpu.sh): installs the small wheels carried in .whl/ into /tmp/site, puts the
# repo's distributions on the path (register_plugins.py), hides CUDA, and writes what the host
# is to $OUT/host.txt (OUT defaults to /tmp/out).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
export PYTHONPATH=$(python3 benchmarks/gpu/register_plugins.py /tmp/site):/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export CUDA_VISIBLE_DEVICES=
{ nproc; lscpu | grep -E "Model name|^CPU\(s\)"; python3 --version; } | tee "$OUT/host.txt"
