"""Two simulated nodes on one machine: ``torchrun --nnodes 2 --rdzv-backend c10d`` in two sets of
Linux namespaces (user, mount, UTS, pid), each with its own host name, its own ``/dev/shm`` and
``/tmp/asyncrl-<user>`` (so no ipc socket or shared-memory file can cross), names resolved by an
``/etc/hosts`` of their own (node0 = 127.0.0.10, node1 = 127.0.0.11), talking over loopback TCP
only: the controller's sockets with CURVE, the refit over gloo (``refit.transport = "nccl"``).
The run directory (config, model, metrics) is shared, as a cluster's shared file system is.

torchrun ranks the nodes by name, so node0's rank is global rank 0: the controller and trainer
rank 0 there, rollout rank 0 on node1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from asyncrl_example_backend.model import write_model_dir  # noqa: E402
from integration_support import free_port, session_processes  # noqa: E402

NODE = ["--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
"""A node's own namespaces besides its user (and network) namespace."""
NAMESPACES = ["unshare", "--user", "--map-root-user", *NODE]
WIRED = "10.99.0.1"
"""The wired nodes' subnet: node0 = 10.99.0.10, node1 = 10.99.0.11, on a veth pair."""
TIMEOUT_S = 120
HEARTBEAT = "heartbeat_interval_s = 0.5\nheartbeat_timeout_s = 3.0\n"
"""A node lost is named within 3.5 s (timeout + interval)."""


def _namespaces_work() -> bool:
    try:
        return subprocess.run([*NAMESPACES, "sh", "-c", "hostname x && mount -t tmpfs t /dev/shm"],
                              capture_output=True, timeout=20).returncode == 0  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [
    pytest.mark.skipif(not _namespaces_work(),
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
    tmp: Path, *, steps: int, delay: float = 0.0, failures: str = "", subnet: str = "127.0.0.1"
) -> Path:
    write_model_dir(tmp / "model")
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(model=tmp / "model", out=tmp / "out", steps=steps,
                                    delay=delay, failures=failures))  # fmt: skip
    (tmp / "hosts").write_text(f"127.0.0.1 localhost\n{subnet}0 node0\n{subnet}1 node1\n")
    return config


def _node(
    tmp: Path, n: int, port: int, *, enter: list[str] = NAMESPACES, subnet: str = "127.0.0.1",
    wait_for: Path | None = None,
) -> subprocess.Popen[str]:
    """Node ``n``: its namespaces (``enter``), its mounts, then torchrun (one rank) joining the
    other; its address is ``subnet`` + ``n``. ``wait_for``: a file to wait for first (its
    network being wired)."""
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{port}", "--rdzv-id", "two-nodes",
        *torchrun_log_args(str(tmp / f"torchrun-{n}")), "-m", "asyncrl.launch",
        str(tmp / "run.toml"), "--set", f"cluster.host={subnet}{n}",
    ]  # fmt: skip
    script = [
        f"hostname node{n}",
        f"mount --bind {shlex.quote(str(tmp / 'hosts'))} /etc/hosts",
        "mount -t tmpfs tmpfs /dev/shm",
        'runs="/tmp/asyncrl-$(id -un)"; mkdir -p "$runs"',
        'mount -t tmpfs -o mode=700 tmpfs "$runs"',
        "exec " + shlex.join(torchrun),
    ]  # fmt: skip
    if wait_for is not None:
        script.insert(0, f"while [ ! -e {shlex.quote(str(wait_for))} ]; do sleep 0.05; done")
    return subprocess.Popen([*enter, "sh", "-c", "; ".join(script)], cwd=tmp, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _start(tmp: Path) -> list[subprocess.Popen[str]]:
    port = free_port()
    first = _node(tmp, 0, port)
    time.sleep(0.5)  # node0 hosts the rendezvous store
    return [first, _node(tmp, 1, port)]


def _net(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@contextlib.contextmanager
def _wired_nodes(tmp: Path) -> Iterator[tuple[list[subprocess.Popen[str]], Callable[[], None]]]:
    """Two nodes, each in a network namespace of its own, joined by a veth pair (node0's end
    ``veth0``, 10.99.0.10; node1's ``veth1``, 10.99.0.11): no loopback between them. Yields
    the nodes and ``cut``, which takes node0's end down (node1 is cut off; nothing is killed).

    A holder process owns the user namespace and node0's network; node0 enters both, node1
    enters the user namespace and makes its own network, which the holder's side wires."""
    holder = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
         "ip link set lo up && exec sleep 3600"], start_new_session=True,
    )  # fmt: skip
    user = ["nsenter", "--target", str(holder.pid), "--user", "--preserve-credentials"]
    nodes: list[subprocess.Popen[str]] = []
    try:
        until = time.monotonic() + 10
        while _net(holder.pid) == _net(os.getpid()):
            assert time.monotonic() < until, "the holder made no network namespace"
            time.sleep(0.01)
        wired = tmp / "wired"
        port = free_port()  # a fresh namespace: any port is free there
        nodes.append(_node(tmp, 0, port, enter=[*user, "--net", "unshare", *NODE],
                           subnet=WIRED, wait_for=wired))  # fmt: skip
        nodes.append(_node(tmp, 1, port, enter=[*user, "unshare", "--net", *NODE],
                           subnet=WIRED, wait_for=wired))  # fmt: skip
        while _net(nodes[1].pid) == _net(holder.pid):  # nsenter execs unshare: same pid
            assert time.monotonic() < until, "node1 made no network namespace"
            time.sleep(0.01)

        def ip(where: int, *commands: str) -> None:
            for command in commands:
                subprocess.run(["nsenter", "--target", str(where), "--user",
                                "--preserve-credentials", "--net", "ip", *command.split()],
                               check=True, capture_output=True, timeout=10)  # fmt: skip

        ip(holder.pid, f"link add veth0 type veth peer name veth1 netns {nodes[1].pid}",
           f"addr add {WIRED}0/24 dev veth0", "link set veth0 up")  # fmt: skip
        ip(nodes[1].pid, "link set lo up", f"addr add {WIRED}1/24 dev veth1", "link set veth1 up")
        wired.touch()
        yield nodes, lambda: ip(holder.pid, "link set veth0 down")
    finally:
        for proc in [*nodes, holder]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _finish(node: subprocess.Popen[str], deadline: float) -> str:
    try:
        return node.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        out = node.communicate()[0]
        pytest.fail(f"node did not stop in time:\n{out[-3000:]}")


def _records(tmp: Path) -> list[dict]:
    path = tmp / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(tmp: Path, nodes: list[subprocess.Popen[str]], step: int) -> None:
    deadline = time.monotonic() + 60
    while not any(r["kind"] == "train" and r["step"] >= step for r in _records(tmp)):
        assert all(n.poll() is None for n in nodes), [n.poll() for n in nodes]
        assert time.monotonic() < deadline, "no train step within 60 s"
        time.sleep(0.1)


def _one_node_rewards(tmp: Path, config: Path, steps: int) -> list[float]:
    """The same run on one node (both ranks on this host, ipc is not used: tcp still)."""
    out = tmp / "one-node"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *torchrun_log_args(str(tmp / "torchrun-one")), "-m", "asyncrl.launch", str(config),
         "--set", f"run.output_dir={out}"],
        cwd=tmp, check=True, capture_output=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in records if r["kind"] == "train"]


def test_two_nodes_train_as_one_with_every_refit_crossing_them_verified(tmp_path: Path) -> None:
    steps = 3
    config = _write(tmp_path, steps=steps)
    nodes = _start(tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    outs = [_finish(node, deadline) for node in nodes]
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
    assert [r["reward"] for r in train] == _one_node_rewards(tmp_path, config, steps)


def test_a_node_killed_mid_run_is_named_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    """node1 (the rollout rank) dies whole: the controller names it lost, with its host,
    within timeout + interval, and node0 stops with nothing left behind."""
    _write(tmp_path, steps=1000, delay=0.02, failures=HEARTBEAT)
    nodes = _start(tmp_path)
    _wait_for_step(tmp_path, nodes, 1)
    killed = time.monotonic()
    os.killpg(nodes[1].pid, signal.SIGKILL)  # unshare, hence its pid namespace: all of node1
    nodes[1].communicate()
    out = _finish(nodes[0], killed + 60)
    took = time.monotonic() - killed
    said = [line for line in out.splitlines() if line.startswith("asyncrl: error:")]
    assert len(said) == 1, out[-3000:]
    assert "worker rollout:0 on host 'node1'" in said[0] and "is lost" in said[0], said
    assert "failures.heartbeat_timeout_s = 3 s" in said[0], said
    assert nodes[0].returncode == 1
    # named at 3-3.5 s; then the orderly stop of node0 (engine, sockets, torchrun's agent)
    assert took < 11, took  # 3.6 s measured (named at 3-3.5 s, then the stop)
    assert session_processes(nodes[0].pid) == []


def test_the_controllers_node_killed_stops_the_other_node(tmp_path: Path) -> None:
    """node0 (the controller) dies whole: node1's worker hears nothing more and stops, and its
    node with it, within the heartbeat timeout (or sooner, when torchrun's agent sees its
    rendezvous store gone)."""
    _write(tmp_path, steps=1000, delay=0.02, failures=HEARTBEAT)
    nodes = _start(tmp_path)
    _wait_for_step(tmp_path, nodes, 1)
    killed = time.monotonic()
    os.killpg(nodes[0].pid, signal.SIGKILL)
    nodes[0].communicate()
    _finish(nodes[1], killed + 60)
    took = time.monotonic() - killed
    assert nodes[1].returncode != 0
    assert took < 11, took  # 1.6 s measured (torchrun's agent saw its store go; the
    # worker's own watch alone: 3.5 s, then the stop)
    assert session_processes(nodes[1].pid) == []


def test_a_node_cut_off_by_its_network_is_named_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    """node1 keeps running but its link goes down (each node in its own network namespace,
    joined by a veth pair): the controller names it lost within timeout + interval and node0
    stops clean; node1's worker, hearing nothing more, stops by itself."""
    _write(tmp_path, steps=1000, delay=0.02, failures=HEARTBEAT, subnet=WIRED)
    with _wired_nodes(tmp_path) as (nodes, cut):
        _wait_for_step(tmp_path, nodes, 1)
        cut_at = time.monotonic()
        cut()
        out = _finish(nodes[0], cut_at + 60)
        took = time.monotonic() - cut_at
        said = [line for line in out.splitlines() if line.startswith("asyncrl: error:")]
        assert len(said) == 1, out[-3000:]
        assert "worker rollout:0 on host 'node1'" in said[0] and "is lost" in said[0], said
        assert nodes[0].returncode == 1
        assert took < 11, took
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
        # (srun --kill-on-bad-exit, a Job's failure policy). Measured: node0 out 3.4-4.1 s
        # after the cut, node1's worker 3.7-4.1 s.
        until = time.monotonic() + 15
        while len(left := session_processes(nodes[1].pid)) > 2:
            assert time.monotonic() < until, [p.cmdline() for p in left]
            time.sleep(0.1)
        assert [p.cmdline()[0] for p in left] == ["unshare", sys.executable], left
        assert "torch.distributed.run" in left[1].cmdline()
        print(f"\ncut: node0 stopped {took:.1f} s after the cut, node1's worker {alone:.1f} s")
