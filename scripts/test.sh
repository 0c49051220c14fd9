#!/usr/bin/env bash
# Install everything, then run the test suite: unit first (pure logic and in-process sockets,
# on both cores), then two lanes side by side:
#   lane 1: contract (the training-backend contract on fsdp2 and deepspeed under torchrun),
#           then integration (real processes on the numpy bigram engine, the fault matrix);
#   lane 2: e2e (vLLM CPU build + FSDP2 / DeepSpeed) with gpu (skipped without CUDA).
# An e2e test waits on one engine or one torchrun world for most of its time and uses about
# one of the CI machine's 2 cores, so the lanes share the machine instead of taking turns;
# unit uses both cores itself and runs alone. A stage that fails stops the whole run (budgets:
# below). At the end the stages' times and the run's slowest tests are printed
# (scripts/suite_report.py), so that what slows the suite shows in the log of the change
# that slowed it (docs/testing.md).
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
# machine, with both lanes running (docs/testing.md has the figures and the date). A stage
# past its budget is named in the report (suite_report.py: "over budget"), so that the change
# that slowed it sees it in its own log; one past twice its budget is stopped and fails the
# run (a hang). Failing at the budget itself would fail CI on a machine slower than this one.
FIRST=("unit 4 -n 2 tests/unit")
if [ "${1:-}" = fast ]; then
  LANE1=("end-to-end 1 -m fast tests/integration")
  LANE2=()
else
  LANE1=("contract 7 tests/contract" "integration 30 tests/integration")
  LANE2=("e2e 29 tests/e2e tests/gpu")
fi
report=$(mktemp -d)
stop_lane2() {  # SIGINT to lane 2's running stage (timeout passes it on to pytest)
  [ -f "$report/lane2.pid" ] && kill -INT "$(cat "$report/lane2.pid")" 2>/dev/null
  touch "$report/lane2.stop"
}
trap 'stop_lane2; wait; rm -rf "$report"' EXIT

# run_lane LANE STAGE...: the stages in order, until one fails; its exit code in LANE.status
run_lane() {
  local lane=$1 stage name budget start code=0
  shift
  for stage in "$@"; do
    [ ! -e "$report/$lane.stop" ] || { code=130; break; }
    set -- $stage
    name=$1 budget=$2
    shift 2
    echo "== $name: $* (budget $budget min)"
    start=$(date +%s)
    timeout --signal=INT --kill-after=60 "$(( 2 * budget ))m" "${PYTEST[@]}" \
      --junitxml="$report/$name.xml" "$@" > "$report/$name.log" 2>&1 &
    echo $! > "$report/$lane.pid"
    wait $! || code=$?
    rm -f "$report/$lane.pid"
    printf '%s\t%s\t%s\t%s\n' "$name" "$budget" "$(( $(date +%s) - start ))" "$code" \
      >> "$report/stages.tsv"
    echo "== $name: exit $code after $(( $(date +%s) - start )) s, its log:"
    flock "$report/out.lock" cat "$report/$name.log"  # one stage's log at a time
    [ "$code" -eq 0 ] || break
  done
  echo "$code" > "$report/$lane.status"
}

run_lane first "${FIRST[@]}"
status=$(cat "$report/first.status")
if [ "$status" -ne 0 ]; then
  .venv/bin/python scripts/suite_report.py "$report"
  exit "$status"
fi
lane2=
if [ ${#LANE2[@]} -gt 0 ]; then
  run_lane lane2 "${LANE2[@]}" &
  lane2=$!
fi
run_lane lane1 "${LANE1[@]}"
status=$(cat "$report/lane1.status")
if [ -n "$lane2" ]; then
  [ "$status" -eq 0 ] || stop_lane2
  wait "$lane2" || true
  [ "$status" -ne 0 ] || status=$(cat "$report/lane2.status" 2>/dev/null || echo 1)
fi
.venv/bin/python scripts/suite_report.py "$report"
exit "$status"
