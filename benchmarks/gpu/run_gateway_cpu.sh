#!/usr/bin/env bash
# benchmarks/gateway.py on the GPU host's CPUs (16 cores; CUDA hidden): the gateway's overhead
# per call at 1 and 1,000 concurrent sessions on the example engine, with cores to spare for the
# load generator and the workers (on the 2-core dev box they share the controller's). Needs only
# the small wheels of .whl/ (pyzmq, msgspec, structlog, jsonschema and its four, starlette,
# uvicorn, httptools, h11, httpx and its own: carry .whl with the call); no vLLM. From the repo root:
#
#   bash benchmarks/gpu/run_gateway_cpu.sh      # ~4 min; writes $OUT/gateway-16core.json
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/cpu_env.sh
python3 benchmarks/gateway.py --machine 16core --out "$OUT/gateway-16core.json" ${GATEWAY_ARGS:-} \
  > "$OUT/gateway.txt" 2>&1 || { tail -40 "$OUT/gateway.txt"; exit 1; }
tail -40 "$OUT/gateway.txt" | cut -c1-400
