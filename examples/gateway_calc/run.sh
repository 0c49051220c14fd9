#!/usr/bin/env bash
# The gateway's CPU example (docs/gateway.md): the run, and the agent service that trains
# through it, side by side; the service stops when the run ends.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -d runs/tiny-calc/model ]; then
  .venv/bin/python -m asyncrl_arith.make_agent_model calc runs/tiny-calc/model
fi
.venv/bin/asyncrl run examples/tiny_gateway_calc.toml "$@" &
run=$!
trap 'kill -TERM $run 2>/dev/null || true' INT TERM
.venv/bin/python examples/gateway_calc/calc_agent.py --service runs/tiny-gateway-calc/gateway.json &
agents=$!
status=0
wait $run || status=$?
wait $agents || true
exit $status
