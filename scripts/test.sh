#!/usr/bin/env bash
# Install everything, then run the test suite in two stages, each on both cores:
#   unit:    pure logic and in-process sockets (-n 2): tests/unit and the optional
#            distributions' own tests (backends/asyncrl-torch/tests,
#            plugins/asyncrl-gateway/tests, plugins/asyncrl-trackers/tests; that each passes
#            on its own install is scripts/test_own_installs.sh's, which CI does not run);
#   engines: contract (the training-backend contract on fsdp2 and deepspeed under torchrun),
#            integration (real processes on the numpy bigram engine, the fault matrix) and
#            e2e (vLLM CPU build + FSDP2 / DeepSpeed) with gpu (skipped without CUDA), on two
#            pytest-xdist workers that take the next module when they finish one (--dist
#            loadscope; by class for a test class). The vLLM tests are one unit: they run one
#            after the other on one worker (they check vLLM's leftovers machine-wide) while
#            the other takes everything else, and both take what is left (tests/conftest.py).
# A stage that fails stops the run (budgets: below). At the end the stages' times, each
# suite's test time and the run's slowest tests are printed (scripts/suite_report.py), so
# that what slows the suite shows in the log of the change that slowed it (docs/testing.md).
#
#   bash scripts/test.sh                   # every stage (CI)
#   bash scripts/test.sh fast              # the everyday tier: every unit test, then two runs
#                                          # end to end on the example engine (at most 5 min)
#   bash scripts/test.sh tests/unit -k x   # any pytest arguments: one plain pytest run
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
if [ $# -gt 0 ] && [ "$1" != fast ]; then
  exec "${PYTEST[@]}" "$@"
fi
# Budgets in minutes: about 1.3x each stage's time measured from a fresh clone on a 2-core
# machine (docs/testing.md has the figures and the date). A stage past its budget is named in
# the report (suite_report.py: "over budget"), so that the change that slowed it sees it in
# its own log; one past twice its budget is stopped and fails the run (a hang). Failing at the
# budget itself would fail CI on a machine slower than this one.
UNIT="tests/unit backends/asyncrl-torch/tests plugins/asyncrl-gateway/tests plugins/asyncrl-trackers/tests"
if [ "${1:-}" = fast ]; then
  STAGES=("unit 4 -n 2 $UNIT" "end-to-end 1 -m fast tests/integration")
else
  STAGES=("unit 4 -n 2 $UNIT"
          "engines 30 -n 2 --dist loadscope tests/e2e tests/gpu tests/contract tests/integration")
fi
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
status=0
for stage in "${STAGES[@]}"; do
  set -- $stage
  name=$1 budget=$2
  shift 2
  echo "== $name: $* (budget $budget min)"
  start=$(date +%s)
  timeout --signal=INT --kill-after=60 "$(( 2 * budget ))m" "${PYTEST[@]}" \
    --junitxml="$report/$name.xml" "$@" || status=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$budget" "$(( $(date +%s) - start ))" "$status" \
    >> "$report/stages.tsv"
  [ "$status" -eq 0 ] || break
done
.venv/bin/python scripts/suite_report.py "$report"
exit "$status"
