#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit, integration, e2e; GPU tests skip
# without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
