"""Two simulated nodes on one machine: ``torchrun --nnodes 2 --rdzv-backend c10d`` in two sets of
Linux namespaces (user, mount, UTS, pid), each with its own host name, its own ``/dev/shm`` and
``/tmp/asyncrl-<user>`` (so no ipc socket or shared-memory file can cross), names resolved by an
``/etc/hosts`` of their own (node0 = 127.0.0.10, node1 = 127.0.0.11), talking over loopback TCP.

What runs across hosts today: the rendezvous, the controller found through torchrun's store,
its keys handed over the store, the worker's CURVE connection to the controller's TCP socket.
What is refused, by design until the controller watches remote workers by heartbeat rather than
by pid (docs/multi-node.md): the worker on the other node, named with both hosts, before any
Init; both nodes then stop with nothing left behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl_example_backend.model import write_model_dir  # noqa: E402
from integration_support import free_port  # noqa: E402

NAMESPACES = ["unshare", "--user", "--map-root-user", "--mount", "--uts", "--pid", "--fork",
              "--kill-child", "--mount-proc"]  # fmt: skip
TIMEOUT_S = 120


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
num_steps = 2
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
[refit]
transport = "nccl"
[eval]
num_prompts = 4
"""


def _node(tmp: Path, n: int, port: int) -> subprocess.Popen[str]:
    """Node ``n``: its namespaces, its mounts, then torchrun (one rank) joining the other."""
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{port}", "--rdzv-id", "two-nodes",
        "--log-dir", str(tmp / f"torchrun-{n}"), "-m", "asyncrl.launch", str(tmp / "run.toml"),
        "--set", f"cluster.host=127.0.0.1{n}",
    ]  # fmt: skip
    script = "; ".join([
        f"hostname node{n}",
        f"mount --bind {shlex.quote(str(tmp / 'hosts'))} /etc/hosts",
        "mount -t tmpfs tmpfs /dev/shm",
        'runs="/tmp/asyncrl-$(id -un)"; mkdir -p "$runs"',
        'mount -t tmpfs -o mode=700 tmpfs "$runs"',
        "exec " + shlex.join(torchrun),
    ])  # fmt: skip
    return subprocess.Popen([*NAMESPACES, "sh", "-c", script], cwd=tmp, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def test_a_worker_on_another_node_reaches_the_controller_and_is_refused_by_name(
    tmp_path: Path,
) -> None:
    write_model_dir(tmp_path / "model")
    (tmp_path / "run.toml").write_text(CONFIG.format(model=tmp_path / "model", out=tmp_path / "out"))
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n127.0.0.10 node0\n127.0.0.11 node1\n")
    port = free_port()
    nodes = [_node(tmp_path, 0, port)]
    time.sleep(0.5)  # node0 hosts the rendezvous store
    nodes.append(_node(tmp_path, 1, port))
    outs, started = [], time.monotonic()
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))[0])
    except subprocess.TimeoutExpired:
        for node in nodes:
            os.killpg(node.pid, signal.SIGKILL)
        pytest.fail(f"the two nodes did not stop within {TIMEOUT_S} s")
    said = [line for out in outs for line in out.splitlines() if line.startswith("asyncrl: error:")]
    assert len(said) == 1, outs  # rank 0's one line, on whichever node won rank 0
    (line,) = said
    assert "runs on another host than the controller" in line, line
    assert ("'node1', the controller on 'node0'" in line) or ("'node0', the controller on 'node1'" in line), line
    assert "rollout:0" in line
    assert all(node.returncode != 0 for node in nodes), [node.returncode for node in nodes]
