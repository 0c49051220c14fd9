"""Two simulated nodes on one machine for the multi-node tests: ``torchrun --nnodes 2
--rdzv-backend c10d -m asyncrl.launch`` in two sets of Linux namespaces (user, mount, UTS, pid;
optionally network), each with its own host name, ``/dev/shm`` and ``/tmp/asyncrl-<user>`` (a
stray ipc socket or shared-memory file cannot cross: it would not be there), and an
``/etc/hosts`` of its own naming ``node0`` and ``node1``. torchrun ranks the nodes by name, so
node0 holds global rank 0 (the controller). Used by tests/integration/test_two_nodes.py (the
bigram backends) and tests/e2e/test_two_nodes_vllm.py (the demo: FSDP2 and vLLM)."""

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
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl.procs.spawn import torchrun_log_args
from integration_support import free_port

NODE = ["--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
"""A node's own namespaces besides its user (and network) namespace."""
NAMESPACES = ["unshare", "--user", "--map-root-user", *NODE]
LOOPBACK = "127.0.0.1"
"""The loopback nodes' addresses: node0 = 127.0.0.10, node1 = 127.0.0.11 (one network)."""
WIRED = "10.99.0.1"
"""The wired nodes' subnet: node0 = 10.99.0.10, node1 = 10.99.0.11, on a veth pair."""


@dataclass(frozen=True)
class Node:
    """What one simulated node runs: ``command`` (default: ``torchrun --nnodes 2
    --nproc-per-node 1 ... -m asyncrl.launch CONFIG --set cluster.host=<its address>`` joining
    the other node), with more ``--set``s for that default and ``env`` on top of ours."""

    env: dict[str, str] = field(default_factory=dict)
    sets: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    reaping_init: bool = False
    """Whether the node's pid 1 reaps what is orphaned there, as a host's init does (``sh``
    runs the command and stays). By default the command is pid 1, as in a container without
    an init, and reaps nothing: what a stopped worker leaves in its process group stays a
    zombie there, and its rank waits out ``asyncrl.procs.supervisor.GROUP_GONE_S`` (10 s)
    for the group to go (a vLLM worker's rank does: ``worker_leftovers_remain``)."""


PAIR = (Node(), Node())


def namespaces_work() -> bool:
    try:
        return subprocess.run([*NAMESPACES, "sh", "-c", "hostname x && mount -t tmpfs t /dev/shm"],
                              capture_output=True, timeout=20).returncode == 0  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False


def wires_work() -> bool:
    """Whether a veth pair can be made in a network namespace of our own (``ip`` from
    iproute2 is needed: the GPU machine's image has none)."""
    try:
        return subprocess.run(
            ["unshare", "--user", "--map-root-user", "--net",
             "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            capture_output=True, timeout=20,
        ).returncode == 0  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False


def write_hosts(tmp: Path, subnet: str = LOOPBACK) -> None:
    """The nodes' ``/etc/hosts`` (bound over theirs)."""
    (tmp / "hosts").write_text(f"127.0.0.1 localhost\n{subnet}0 node0\n{subnet}1 node1\n")


def node(
    tmp: Path, n: int, port: int, config: Path, spec: Node = PAIR[0], *,
    enter: list[str] = NAMESPACES, subnet: str = LOOPBACK, wait_for: Path | None = None,
) -> subprocess.Popen[str]:
    """Node ``n``: its namespaces (``enter``), its mounts, then what ``spec`` runs; its
    address is ``subnet`` + ``n``. ``wait_for``: a file to wait for first (its network being
    wired)."""
    torchrun = list(spec.command) or [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{port}", "--rdzv-id", "two-nodes",
        *torchrun_log_args(str(tmp / f"torchrun-{n}")), "-m", "asyncrl.launch",
        str(config), "--set", f"cluster.host={subnet}{n}",
        *(a for x in spec.sets for a in ("--set", x)),
    ]  # fmt: skip
    run = shlex.join(torchrun)
    script = [
        f"hostname node{n}",
        f"mount --bind {shlex.quote(str(tmp / 'hosts'))} /etc/hosts",
        "mount -t tmpfs tmpfs /dev/shm",
        'runs="/tmp/asyncrl-$(id -un)"; mkdir -p "$runs"',
        'mount -t tmpfs -o mode=700 tmpfs "$runs"',
        *([run, "exit $?"] if spec.reaping_init else ["exec " + run]),
    ]  # fmt: skip
    if wait_for is not None:
        script.insert(0, f"while [ ! -e {shlex.quote(str(wait_for))} ]; do sleep 0.05; done")
    return subprocess.Popen([*enter, "sh", "-c", "; ".join(script)], cwd=tmp, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **spec.env},
                            start_new_session=True)  # fmt: skip


def start_nodes(
    tmp: Path, config: Path, specs: tuple[Node, Node] = PAIR
) -> list[subprocess.Popen[str]]:
    """Two nodes on this host's loopback (``write_hosts(tmp)`` first)."""
    port = free_port()
    first = node(tmp, 0, port, config, specs[0])
    time.sleep(0.5)  # node0 hosts the rendezvous store
    return [first, node(tmp, 1, port, config, specs[1])]


@contextlib.contextmanager
def two_nodes(
    tmp: Path, config: Path, specs: tuple[Node, Node] = PAIR
) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    """Wired nodes where a veth pair can be made, else loopback ones: yields which, and the
    nodes (killed on the way out if still running). Writes the hosts file."""
    if wires_work():
        write_hosts(tmp, WIRED)
        with wired_nodes(tmp, config, specs) as (nodes, _):
            yield "wired", nodes
        return
    write_hosts(tmp, LOOPBACK)
    nodes = start_nodes(tmp, config, specs)
    try:
        yield "loopback", nodes
    finally:
        for proc in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _net(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _settled(proc: subprocess.Popen, what: str, until: float) -> None:
    """Wait until ``proc`` has exec'd its final ``sleep``: its namespaces made and set up.
    Its network namespace alone is not enough: ``unshare --user --map-root-user`` makes it
    before it writes the user namespace's uid map, and an ``nsenter --user`` in between
    fails (seen on a loaded machine)."""
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before it was set up")
        try:
            comm = Path(f"/proc/{proc.pid}/comm").read_text().strip()
        except FileNotFoundError:  # exited since the poll
            continue
        if comm == "sleep":
            return
        assert time.monotonic() < until, f"{what} was not set up in time"
        time.sleep(0.01)


@contextlib.contextmanager
def wired_nodes(
    tmp: Path, config: Path, specs: tuple[Node, Node] = PAIR
) -> Iterator[tuple[list[subprocess.Popen[str]], Callable[[], None]]]:
    """Two nodes, each in a network namespace of its own, joined by a veth pair (node0's end
    ``veth0``, 10.99.0.10; node1's ``veth1``, 10.99.0.11): no loopback between them. Yields
    the nodes and ``cut``, which takes node0's end down (node1 is cut off; nothing is killed).
    ``write_hosts(tmp, WIRED)`` first.

    A holder process owns the user namespace and node0's network; node0 enters both, node1
    enters the user namespace and makes its own network, which the holder's side wires."""
    holder = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
         "ip link set lo up && exec sleep 3600"], start_new_session=True,
    )  # fmt: skip
    user = ["nsenter", "--target", str(holder.pid), "--user", "--preserve-credentials"]
    nodes: list[subprocess.Popen[str]] = []
    try:
        until = time.monotonic() + 30  # a guard: set up in milliseconds
        _settled(holder, "the namespace holder", until)
        wired = tmp / "wired"
        port = free_port()  # a fresh namespace: any port is free there
        nodes.append(node(tmp, 0, port, config, specs[0],
                          enter=[*user, "--net", "unshare", *NODE], subnet=WIRED,
                          wait_for=wired))  # fmt: skip
        nodes.append(node(tmp, 1, port, config, specs[1], enter=[*user, "unshare", "--net", *NODE],
                          subnet=WIRED, wait_for=wired))  # fmt: skip
        # nsenter execs unshare (the same pid), which then makes node1's network: until it
        # has, the pid is in this test's network namespace
        while _net(nodes[1].pid) in (_net(holder.pid), _net(os.getpid())):
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


def finish(proc: subprocess.Popen[str], deadline: float) -> str:
    """The node's output once it exits; killed (and the test failed) past ``deadline``."""
    try:
        return proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"node did not stop in time:\n{out[-3000:]}")


def one_node_rewards(tmp: Path, config: Path, timeout_s: float) -> list[float]:
    """The same run on one node, both ranks on this host (its output in ``tmp/one-node``):
    the rewards of its training steps."""
    out = tmp / "one-node"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *torchrun_log_args(str(tmp / "torchrun-one")), "-m", "asyncrl.launch", str(config),
         "--set", f"run.output_dir={out}"],
        cwd=tmp, check=True, capture_output=True, timeout=timeout_s,
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in records if r["kind"] == "train"]


@dataclass
class Wire:
    """Two network namespaces joined by a veth pair (``veth0`` 10.99.0.10 in the first,
    ``veth1`` 10.99.0.11 in the second), each held by a process of its own."""

    holders: tuple[int, int]

    def enter(self, n: int) -> list[str]:
        """A command prefix that runs in side ``n``'s network (and the user namespace)."""
        return ["nsenter", "--target", str(self.holders[n]), "--user", "--preserve-credentials",
                "--net"]  # fmt: skip

    def sent(self) -> int:
        """Bytes sent so far from side 0 to side 1 (``veth0``'s transmit counter)."""
        # /proc/net is the reading process's network's (sysfs stays this test's)
        out = subprocess.run([*self.enter(0), "cat", "/proc/net/dev"], check=True,
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        for line in out.stdout.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "veth0":
                return int(counters.split()[8])  # receive: 8 columns, then transmit bytes
        raise AssertionError(f"no veth0 in {out.stdout}")


@contextlib.contextmanager
def wire() -> Iterator[Wire]:
    """A :class:`Wire`; every process of both sides is killed at the end (``wires_work()``
    first)."""
    first = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
         "ip link set lo up && exec sleep 3600"], start_new_session=True,
    )  # fmt: skip
    procs = [first]
    try:
        until = time.monotonic() + 30  # a guard: set up in milliseconds
        _settled(first, "the first side", until)
        second = subprocess.Popen(
            ["nsenter", "--target", str(first.pid), "--user", "--preserve-credentials",
             "unshare", "--net", "sleep", "3600"], start_new_session=True,
        )  # fmt: skip
        procs.append(second)
        _settled(second, "the second side", until)
        link = Wire((first.pid, second.pid))

        def ip(n: int, *commands: str) -> None:
            for command in commands:
                subprocess.run([*link.enter(n), "ip", *command.split()], check=True,
                               capture_output=True, timeout=10)  # fmt: skip

        ip(0, f"link add veth0 type veth peer name veth1 netns {second.pid}",
           f"addr add {WIRED}0/24 dev veth0", "link set veth0 up")  # fmt: skip
        ip(1, "link set lo up", f"addr add {WIRED}1/24 dev veth1", "link set veth1 up")
        yield link
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
