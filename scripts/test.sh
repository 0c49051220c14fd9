#!/usr/bin/env bash
# Install everything, then run the whole test suite, fastest first: unit (seconds), contract (the
# training-backend contract on fsdp2 and deepspeed under torchrun: ~2 minutes), integration
# (real processes on the numpy bigram engine, the fault matrix: minutes), then e2e (vLLM CPU
# build + FSDP2: minutes) with gpu (skipped without CUDA). A stage runs only if the ones before
# it passed, and each has a time budget (the whole run must stay well inside CI's 90 minutes).
#
#   bash scripts/test.sh                 # all stages
#   bash scripts/test.sh tests/unit -k x # any pytest arguments: one plain pytest run
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# stage budgets in minutes; measured on a 2-core machine: unit 0.8, contract 2.1 (+0.5 the first
# time: DeepSpeed compiles its CPU shared-memory op once), integration 4.8, e2e 10.4
for stage in "5 tests/unit" "10 tests/contract" "25 tests/integration" "35 tests/e2e tests/gpu"; do
  set -- $stage
  budget=$1
  shift
  echo "== $* (budget $budget min)"
  start=$(date +%s)
  timeout --signal=INT --kill-after=60 "${budget}m" .venv/bin/python -m pytest -p no:cacheprovider "$@"
  echo "== $* took $(( $(date +%s) - start )) s"
done
