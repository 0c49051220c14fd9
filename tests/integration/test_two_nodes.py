"""Two simulated nodes on one machine (``nodes_support``) with the bigram backends, talking
over TCP only: the controller's sockets with CURVE, the refit over gloo (``refit.transport =
"nccl"``). On loopback (node0 = 127.0.0.10, node1 = 127.0.0.11) for training and a node
killed; each node in a network namespace of its own, joined by a veth pair, for a node cut
off. The run directory (config, model, metrics) is shared, as a cluster's shared file system
is. node0 holds the controller and trainer rank 0, node1 rollout rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl_example_backend.model import write_model_dir  # noqa: E402
from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from integration_support import session_processes  # noqa: E402
from nodes_support import (  # noqa: E402
    LOOPBACK,
    Node,
    WIRED,
    finish,
    namespaces_work,
    one_node_rewards,
    start_nodes,
    two_nodes,
    wired_nodes,
    write_hosts,
)

TIMEOUT_S = 120
HEARTBEAT = "heartbeat_timeout_s = 3.0\n"
"""A node lost is named within 3.25 s (timeout + interval: the probes come every 0.25 s, a
twelfth of the timeout)."""
ENDS_WITHIN_S = 30
"""A run with a fault ends within 30 s (the fault matrix's requirement, docs/testing.md).
When exactly a silent node is named is the heartbeat's (tests/unit/test_heartbeat.py, on a
fake clock); the figures from the kill are printed (``pytest -s``)."""


pytestmark = [
    pytest.mark.skipif(not namespaces_work(),
                       reason="needs unprivileged user, mount, UTS and pid namespaces"),
    pytest.mark.usefixtures("no_stray_processes"),
]  # fmt: skip

CONFIG = """
[model]
path = "{model}"
[environment]
name = "repeat-digit"
[run]
num_steps = {steps}
seed = 0
output_dir = "{out}"
[cluster]
trainer_ranks = 1
rollout_ranks = 1
network = "tcp"
startup_timeout_s = 60
shutdown_grace_s = 3
[grpo]
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 16
[trainer]
backend = "bigram"
options = {{ lr = 0.5 }}
[generator]
backend = "bigram"
options = {{ token_delay_s = {delay} }}
[refit]
transport = "nccl"
verify_every_steps = 1
[failures]
{failures}
[eval]
num_prompts = 4
"""


def _write(
    tmp: Path, *, steps: int, delay: float = 0.0, failures: str = "", subnet: str = LOOPBACK
) -> Path:
    write_model_dir(tmp / "model")
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(model=tmp / "model", out=tmp / "out", steps=steps,
                                    delay=delay, failures=failures))  # fmt: skip
    write_hosts(tmp, subnet)
    return config


def _records(tmp: Path) -> list[dict]:
    path = tmp / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(tmp: Path, nodes: list[subprocess.Popen[str]], step: int) -> None:
    deadline = time.monotonic() + 60
    while not any(r["kind"] == "train" and r["step"] >= step for r in _records(tmp)):
        assert all(n.poll() is None for n in nodes), [n.poll() for n in nodes]
        assert time.monotonic() < deadline, "no train step within 60 s"
        time.sleep(0.1)


def test_two_nodes_train_as_one_with_every_refit_crossing_them_verified(tmp_path: Path) -> None:
    steps = 3
    config = _write(tmp_path, steps=steps)
    nodes = start_nodes(tmp_path, tmp_path / "run.toml")
    deadline = time.monotonic() + TIMEOUT_S
    outs = [finish(node, deadline) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    records = _records(tmp_path)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # every refit verified on the far node (a failed check stops the run)
    verified = [(r["worker"], r["version"]) for r in records if r["kind"] == "refit_verify"]
    assert verified == [("rollout:0", v) for v in range(1, steps + 1)], verified
    # the rollout worker was on node1, the controller (rank 0) on node0
    connected = [json.loads(line) for line in outs[0].splitlines()
                 if '"worker_connected"' in line and '"rollout:0"' in line]  # fmt: skip
    assert [c.get("host") for c in connected] == ["node1"], outs[0][-3000:]
    # the same seed on one node: the same rewards, step by step
    assert [r["reward"] for r in train] == one_node_rewards(tmp_path, config, TIMEOUT_S)


def test_a_node_killed_mid_run_is_named_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    """node1 (the rollout rank) dies whole: the controller names it lost, with its host,
    within timeout + interval, waits as long again for a new process from node1 (a restart
    there) that never comes, and node0 stops with nothing left behind."""
    _write(tmp_path, steps=1000, delay=0.02, failures=HEARTBEAT)
    nodes = start_nodes(tmp_path, tmp_path / "run.toml")
    _wait_for_step(tmp_path, nodes, 1)
    killed = time.monotonic()
    os.killpg(nodes[1].pid, signal.SIGKILL)  # unshare, hence its pid namespace: all of node1
    nodes[1].communicate()
    out = finish(nodes[0], killed + 60)
    took = time.monotonic() - killed
    said = [line for line in out.splitlines() if line.startswith("asyncrl: error:")]
    assert len(said) == 1, out[-3000:]
    assert "worker rollout:0 on host 'node1'" in said[0] and "is lost" in said[0], said
    assert "failures.heartbeat_timeout_s = 3 s" in said[0], said
    assert nodes[0].returncode == 1
    # named at 3-3.25 s, 3 s more for a successor; then the orderly stop of node0
    assert took < ENDS_WITHIN_S, took
    details = (tmp_path / "out" / "logs" / "error.txt").read_text()
    assert "no new process of rollout:0 came from 'node1' within 3 s more" in details, details
    assert session_processes(nodes[0].pid) == []
    print(f"\nkilled: node0 stopped {took:.1f} s after node1 was killed")


def test_a_worker_killed_on_the_other_node_is_restarted_there_and_refitted(
    tmp_path: Path,
) -> None:
    """node1's rollout worker is SIGKILLed (its node lives): its rank there starts it again,
    the controller takes the new process's Hello (from the same host) as the old one's
    death, hands its groups back, and the refit forms a new broadcast group for it. The run
    ends as planned, every step trained and every later refit verified on node1."""
    steps = 8
    _write(tmp_path, steps=steps, delay=0.02, failures=HEARTBEAT)
    nodes = start_nodes(tmp_path, tmp_path / "run.toml")
    _wait_for_step(tmp_path, nodes, 2)
    workers = [p for p in psutil.Process(nodes[1].pid).children(recursive=True)
               if "--worker" in p.cmdline() and "rollout" in p.cmdline()]  # fmt: skip
    assert len(workers) == 1, workers
    workers[0].kill()
    deadline = time.monotonic() + TIMEOUT_S
    outs = [finish(node, deadline) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-3000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))
    restarted = [r for r in records if r["kind"] == "worker_restarted"]
    assert [r["worker"] for r in restarted] == ["rollout:0"], records
    events = [json.loads(line).get("event") for line in outs[0].splitlines()
              if line.startswith("{")]  # fmt: skip
    assert "worker_restarting" in events and "worker_back" in events, outs[0][-3000:]
    verified = [r["version"] for r in records if r["kind"] == "refit_verify"]
    assert verified[-1] == steps, verified
    print(f"\nrestarted on node1 in {restarted[0]['seconds']} s; how it was seen: "
          f"{[e for e in events if e in ('worker_replaced', 'worker_lost', 'worker_dead')]}")


def test_the_controllers_node_killed_stops_the_other_node(tmp_path: Path) -> None:
    """node0 (the controller) dies whole: node1's worker hears nothing more and stops, and its
    node with it, within the heartbeat timeout (or sooner, when torchrun's agent sees its
    rendezvous store gone)."""
    _write(tmp_path, steps=1000, delay=0.02, failures=HEARTBEAT)
    nodes = start_nodes(tmp_path, tmp_path / "run.toml")
    _wait_for_step(tmp_path, nodes, 1)
    killed = time.monotonic()
    os.killpg(nodes[0].pid, signal.SIGKILL)
    nodes[0].communicate()
    finish(nodes[1], killed + 60)
    took = time.monotonic() - killed
    assert nodes[1].returncode != 0
    # torchrun's agent sees its store go, or the worker's own watch its silence (3.5 s)
    assert took < ENDS_WITHIN_S, took
    assert session_processes(nodes[1].pid) == []
    print(f"\ncontroller's node killed: node1 stopped {took:.1f} s after")


def test_a_node_cut_off_by_its_network_is_named_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    """node1 keeps running but its link goes down (each node in its own network namespace,
    joined by a veth pair): the controller names it lost within timeout + interval and node0
    stops clean; node1's worker, hearing nothing more, stops by itself."""
    _write(tmp_path, steps=1000, delay=0.02, failures=HEARTBEAT, subnet=WIRED)
    with wired_nodes(tmp_path, tmp_path / "run.toml") as (nodes, cut):
        _wait_for_step(tmp_path, nodes, 1)
        cut_at = time.monotonic()
        cut()
        out = finish(nodes[0], cut_at + 60)
        took = time.monotonic() - cut_at
        said = [line for line in out.splitlines() if line.startswith("asyncrl: error:")]
        assert len(said) == 1, out[-3000:]
        assert "worker rollout:0 on host 'node1'" in said[0] and "is lost" in said[0], said
        assert nodes[0].returncode == 1
        assert took < ENDS_WITHIN_S, took  # lost at 3-3.25 s, 3 s for a successor, the stop
        assert session_processes(nodes[0].pid) == []
        # node1 is alive but alone: its worker stops on the controller's silence
        log = tmp_path / "out" / "logs" / "rollout-0.log"
        until = time.monotonic() + 15
        while "ControllerLostError" not in log.read_text():
            assert time.monotonic() < until, log.read_text()[-3000:]
            time.sleep(0.1)
        alone = time.monotonic() - cut_at
        # ...and its process with it. What stays is torchrun's agent, waiting on a store it
        # cannot reach (torch's own timeouts: minutes); a scheduler ends it with the job
        # (srun --kill-on-bad-exit, a Job's failure policy). Measured: node0 out 7.2 s after
        # the cut (3.4-4.1 s before a lost worker got heartbeat_timeout_s to come back).
        until = time.monotonic() + 15
        while len(left := session_processes(nodes[1].pid)) > 2:
            assert time.monotonic() < until, [p.cmdline() for p in left]
            time.sleep(0.1)
        assert [p.cmdline()[0] for p in left] == ["unshare", sys.executable], left
        assert "torch.distributed.run" in left[1].cmdline()
        print(f"\ncut: node0 stopped {took:.1f} s after the cut, node1's worker {alone:.1f} s")


def test_a_key_file_refused_on_one_node_is_said_by_that_node(tmp_path: Path) -> None:
    """node1's copy of the key file is readable by others: its rank says so (naming its host
    and the chmod) and exits 2, and tells rank 0 through torchrun's store, which stops the run
    at once with the same words (not at cluster.startup_timeout_s); both nodes stop, nothing
    left."""
    from asyncrl.wire.curve import RunKeys

    config = _write(tmp_path, steps=1000, failures=HEARTBEAT)
    good, loose = tmp_path / "keys.json", tmp_path / "loose.json"
    RunKeys.generate().write(str(good))
    loose.write_text(good.read_text())
    loose.chmod(0o644)
    started = time.monotonic()
    nodes = start_nodes(tmp_path, config, (
        Node(sets=(f"cluster.keys_file={good}", "cluster.startup_timeout_s=60")),
        Node(sets=(f"cluster.keys_file={loose}",)),
    ))  # fmt: skip
    outs = [finish(n, started + 90) for n in nodes]
    said = [line for line in outs[1].splitlines() if line.startswith("asyncrl: error:")]
    assert said == [
        f"asyncrl: error: cluster.keys_file on 'node1': {loose}: the run's keys must be this "
        f"user's with mode 0600, not 644. Fix: chmod 600 {loose}"
    ], outs[1][-3000:]
    took = time.monotonic() - started
    assert [n.returncode != 0 for n in nodes] == [True, True]
    rank0 = [line for line in outs[0].splitlines() if line.startswith("asyncrl: error:")]
    assert rank0 == [
        f"asyncrl: error: a worker rank could not start; global rank 1: cluster.keys_file on "
        f"'node1': {loose}: the run's keys must be this user's with mode 0600, not 644. Fix: "
        f"chmod 600 {loose}"
    ], outs[0][-3000:]
    assert [session_processes(n.pid) for n in nodes] == [[], []]
    # before cluster.startup_timeout_s (60 s) ran out, which it did not wait for: its clock
    # started after this one
    assert took < 60, took
    print(f"\nrefused on node1: both nodes out in {took:.1f} s")


def test_workers_on_another_node_join_an_embedded_controller(tmp_path: Path) -> None:
    """An application on node0 embeds the controller (``attach=join_file``); the run's workers,
    trainer and generator, are a torchrun group of their own on node1 (``asyncrl.join``),
    started first. The join file crosses by the shared directory, the trainer binds its
    weights socket on node1 (toward the controller); the rewards of one node."""
    config = _write(tmp_path, steps=3)
    join = tmp_path / "join.json"
    controller = (sys.executable, str(Path(__file__).with_name("_join_controller.py")),
                  str(config), str(join))  # fmt: skip
    workers = (sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *torchrun_log_args(str(tmp_path / "torchrun-1")),
               "-m", "asyncrl.join", str(join), str(config))  # fmt: skip
    started = time.monotonic()
    with two_nodes(tmp_path, config, (Node(command=controller), Node(command=workers))) as (
        link, nodes
    ):
        outs = [finish(n, started + TIMEOUT_S) for n in reversed(nodes)][::-1]
        assert [n.returncode for n in nodes] == [0, 0], [o[-3000:] for o in outs]
    assert not join.exists()
    records = _records(tmp_path)
    train = [r for r in records if r["kind"] == "train"]
    verified = [(r["worker"], r["version"]) for r in records if r["kind"] == "refit_verify"]
    assert verified == [("rollout:0", v) for v in (1, 2, 3)], verified
    took = time.monotonic() - started
    # both workers connected from node1; the trainer bound its weights socket there (on
    # node0's address, where it would have been before asyncrl.wire.transport.toward, the bind
    # fails: EADDRNOTAVAIL, and the run with it)
    lines = [json.loads(x) for x in outs[0].splitlines() if x.startswith("{")]
    hosts = {x["worker"]: x.get("host") for x in lines if x["event"] == "worker_connected"}
    assert hosts == {"trainer:0": "node1", "rollout:0": "node1"}, outs[0][-3000:]
    assert [r["reward"] for r in train] == one_node_rewards(tmp_path, config, TIMEOUT_S)
    print(f"\njoin across {link} nodes: {took:.1f} s, rewards {[r['reward'] for r in train]}")
