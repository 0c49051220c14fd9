#!/usr/bin/env bash
# Install everything, then run the whole test suite, fastest first: unit (seconds), integration
# (real processes on the numpy bigram engine, the fault matrix: minutes), e2e (vLLM CPU build +
# FSDP2: minutes), gpu (skipped without CUDA). A stage runs only if the ones before it passed,
# and each stage has a time budget (the whole run must stay well inside CI's 90 minutes).
#
#   bash scripts/test.sh                 # all stages
#   bash scripts/test.sh tests/unit -k x # any pytest arguments: one plain pytest run
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# stage budget (minutes); measured on the 2-core CI machine: unit 0.2, integration 6, e2e 9
for stage in "tests/unit 5" "tests/integration 25" "tests/e2e 35" "tests/gpu 10"; do
  set -- $stage
  echo "== $1 (budget $2 min)"
  start=$(date +%s)
  timeout --signal=INT --kill-after=60 "$2m" .venv/bin/python -m pytest -p no:cacheprovider "$1"
  echo "== $1 took $(( $(date +%s) - start )) s"
done
