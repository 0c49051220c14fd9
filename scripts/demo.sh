#!/usr/bin/env bash
# Install, build the tiny arithmetic model (random init + short supervised warm start), then
# run async GRPO with one training rank and one vLLM rollout rank under torchrun, and draw it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
CONFIG=${1:-examples/tiny_arith.toml}
.venv/bin/python -m asyncrl_arith.make_model runs/tiny-arith/model
# asyncrl run = torchrun --nproc-per-node 2 -m asyncrl.launch "$CONFIG" on this node
.venv/bin/asyncrl run "$CONFIG" "${@:2}"
if [ "$CONFIG" = examples/tiny_arith.toml ]; then
  .venv/bin/asyncrl plot runs/tiny-arith  # reward, staleness, the run's timeline
fi
