"""The demo's engines on two simulated nodes: FSDP2 training on node0 (with the controller),
vLLM generating on node1 (the CPU build, or on the GPU: ``gpu``), each node in namespaces of
its own (user, mount, UTS, pid and network: a veth pair is the only link, so no ipc socket,
shared-memory file or abstract socket can cross; where no veth pair can be made, one loopback
network), the controller's sockets on TCP with CURVE and every refit a gloo broadcast across
the link, verified on the far side. Sync mode and one seed: the per-step
rewards equal a one-node run of the same config (tests/integration/nodes_support.py).

``gpu`` (the GPU machine): the engine on GPU 0 and the trainer on node0's CPUs (node0 sees no
GPU), so the refit is a gloo broadcast across the link into host memory, which the engine
copies to its GPU; its figures are in docs/refit.md. There one node cannot hold a CPU trainer
next to a GPU engine (torchrun gives both ranks the same devices), so the rewards are printed,
not compared. ``two_gpus`` (two GPUs, not run yet): the trainer on GPU 0 of node0, the engine on
GPU 1 of node1, every refit an NCCL broadcast between them."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from integration_support import session_processes  # noqa: E402
from nodes_support import Node, finish, namespaces_work, one_node_rewards, two_nodes  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not namespaces_work(),
                       reason="needs unprivileged user, mount, UTS, pid and network namespaces"),
]  # fmt: skip

STEPS = 4
TIMEOUT_S = 420  # one run with the engine's start: 60-100 s on 2 cores

CONFIG = """
[run]
name = "two-nodes-demo"
output_dir = "{out}"
seed = 0
num_steps = {steps}
log_format = "json"
[model]
path = "{model}"
[cluster]
trainer_ranks = 1
rollout_ranks = 1
network = "tcp"
shutdown_grace_s = 5
[grpo]
prompts_per_step = 16
samples_per_prompt = 8
max_new_tokens = 8
[pipeline]
min_groups_for_streaming_train = 16
[pipeline.sampler]
name = "in_order"
max_lookahead_versions = 0
[trainer]
backend = "fsdp2"
micro_batch_size = 64
options = {{ lr = 1e-4 }}
[generator]
backend = "vllm"
options = {{ {engine}, enforce_eager = true }}
[environment]
name = "arithmetic"
[refit]
transport = "nccl"
verify_every_steps = 1
[eval]
num_prompts = 0
[metrics]
sinks = ["jsonl"]
"""


ENGINES = {
    "cpu": "cpu_kvcache_space_gib = 1",
    "gpu": "gpu_memory_utilization = 0.25",
    "two_gpus": "gpu_memory_utilization = 0.25",
}
# each node's pid 1 reaps, as a host's init does: torchrun as pid 1 (a container's layout,
# tests/integration/test_two_nodes.py's) left each stopped worker's rank waiting 10 s for its
# zombies to go, 18 s of the 47 s two-node run on 2 cores
HOST = Node(reaping_init=True)
NODES: dict[str, tuple[Node, Node]] = {
    "cpu": (HOST, HOST),
    "gpu": (replace(HOST, env={"CUDA_VISIBLE_DEVICES": ""}), HOST),  # node0's trainer on CPUs: gloo
    "two_gpus": (replace(HOST, env={"CUDA_VISIBLE_DEVICES": "0"}),
                 replace(HOST, env={"CUDA_VISIBLE_DEVICES": "1"})),  # fmt: skip
}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.parametrize("where", [
    "cpu",
    pytest.param("gpu", marks=pytest.mark.gpu),
    # the NCCL path across nodes: the trainer on GPU 0, the engine on GPU 1 (not run yet)
    pytest.param("two_gpus", marks=[pytest.mark.gpu, pytest.mark.skipif(
        _gpus() < 2, reason="NCCL between two nodes needs two GPUs (one rank per device)")]),
])  # fmt: skip
def test_the_demo_on_two_nodes_trains_as_on_one(tmp_path: Path, where: str) -> None:
    from asyncrl_arith.make_model import make_model

    make_model(tmp_path / "model")  # the demo's warm start (shipped weights)
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(out=tmp_path / "out", model=tmp_path / "model", steps=STEPS,
                                    engine=ENGINES[where]))  # fmt: skip
    started = time.monotonic()
    with two_nodes(tmp_path, config, NODES[where]) as (link, nodes):
        outs = [finish(node, started + TIMEOUT_S) for node in nodes]
        said = [line for out in outs for line in out.splitlines() if "asyncrl: error" in line]
        assert [n.returncode for n in nodes] == [0, 0], (said, [o[-3000:] for o in outs])
        assert [session_processes(n.pid) for n in nodes] == [[], []]
    two_nodes_s = time.monotonic() - started
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # every refit crossed the link (gloo) and was checked on node1 against the trainer
    verified = [r for r in records if r["kind"] == "refit_verify"]
    assert [(r["worker"], r["version"]) for r in verified] == [
        ("rollout:0", v) for v in range(1, STEPS + 1)
    ], verified
    connected = [json.loads(line) for line in outs[0].splitlines()
                 if '"worker_connected"' in line and '"rollout:0"' in line]  # fmt: skip
    assert [c.get("host") for c in connected] == ["node1"], outs[0][-3000:]
    rewards = [r["reward"] for r in train]
    refits = [(round(r["refit_s"], 3), round(r["refit_work_s"], 3)) for r in train]
    print(f"\ntwo {link} nodes ({where}): rewards {rewards}, {two_nodes_s:.0f} s; refit s "
          f"(whole, trainer's work) {refits}; refit checks {[r['max_abs'] for r in verified]}")
    if where != "cpu":
        return
    started = time.monotonic()
    assert rewards == one_node_rewards(tmp_path, config, TIMEOUT_S)
    print(f"one node: the same rewards, {time.monotonic() - started:.0f} s")
