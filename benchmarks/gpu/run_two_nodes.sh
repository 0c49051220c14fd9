#!/usr/bin/env bash
# Issue 27 on the GPU host, after vLLM 0.26 was staged into /tmp/site (shared/gpu/README.md).
# Results under $OUT.
#   bash benchmarks/gpu/run_two_nodes.sh probe         # do user, mount, UTS, pid and network
#                                                      # namespaces (and a veth pair) work here?
#   bash benchmarks/gpu/run_two_nodes.sh test          # tests/e2e/test_two_nodes_vllm.py[gpu]:
#                                                      # two wired simulated nodes, the engine on
#                                                      # the GPU, every refit a gloo broadcast
#   bash benchmarks/gpu/run_two_nodes.sh refit [ARGS]  # benchmarks/refit.py --placements host
#                                                      # --transport nccl: gloo refit GB/s
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
part=${1:-probe}
shift || true
source benchmarks/gpu/gpu_env.sh
case "$part" in
  probe)
    { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; uname -r
      command -v unshare nsenter ip
      unshare --user --map-root-user --mount --uts --pid --fork --mount-proc \
        sh -c 'hostname x && mount -t tmpfs t /dev/shm && echo namespaces: ok'
      unshare --user --map-root-user --net \
        sh -c 'ip link add v0 type veth peer name v1 && echo veth: ok'
    } 2>&1 | tee "$OUT/probe.txt"
    ;;
  test)
    # the image has no pytest-asyncio or pytest-timeout: their settings are dropped here
    timeout ${LIMIT:-500} python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
      -o asyncio_mode=strict -o filterwarnings=ignore -W ignore::pytest.PytestConfigWarning \
      --basetemp /tmp/two-nodes \
      "tests/e2e/test_two_nodes_vllm.py::test_the_demo_on_two_nodes_trains_as_on_one[gpu]" \
      > "$OUT/two_nodes_gpu.txt" 2>&1
    rc=$?
    echo "two-node test rc=$rc"
    # the run's logs and metrics, each node's torchrun logs
    (cd /tmp/two-nodes && find . \( -name "*.log" -o -name "metrics.jsonl" -o -name "*.txt" \) \
      -size -4M -print0 | tar --null -czf "$OUT/two_nodes_logs.tgz" -T -)
    grep -E "two nodes|passed|failed|skipped|Error" "$OUT/two_nodes_gpu.txt" | cut -c1-600 | tail -20
    ;;
  refit)
    timeout ${LIMIT:-500} python3 benchmarks/refit.py --placements host --transport nccl \
      --out "$OUT/refit-host.jsonl" "$@" 2>&1 | tee "$OUT/refit-host.log" \
      | grep -E "^ *[0-9.]+b |engine started|Error|error" | cut -c1-250
    ;;
esac
