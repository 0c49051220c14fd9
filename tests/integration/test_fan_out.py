"""The ``nccl`` weight transfer over gloo sends each bucket across a link once per host:
the sender in one network namespace, three readers in another, a veth pair between them,
and the bytes it carried counted (its transmit counter). Told the readers' host, the sender
reaches one of them (the host's leader), which passes each bucket on to the other two; told
nothing, gloo's own tree over the four ranks crosses the link twice per bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodes_support import WIRED, wire, wires_work

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not wires_work(), reason="needs network namespaces and iproute2's ip"),
    pytest.mark.timeout(180),
]

READERS = 3
BUCKETS = 4
MIB = 8
PAYLOAD = BUCKETS * (MIB << 20)
SCRIPT = Path(__file__).with_name("_broadcast_node.py")


def _broadcast(tmp: Path, hosts: str) -> tuple[float, list[float]]:
    """One broadcast of BUCKETS buckets to READERS readers beyond the link: the bytes the
    link carried per payload byte, and the seconds per bucket. Every reader got every bucket
    (SHA-256 compared)."""
    where = tmp / ("told" if hosts.strip(",") else "not-told")
    where.mkdir()
    env = {**os.environ, "ASYNCRL_NCCL_TIMEOUT_S": "60"}
    with wire() as link:
        before = link.sent()
        procs = [subprocess.Popen(
            [*link.enter(1), sys.executable, str(SCRIPT), "read", str(where), f"rollout:{i}",
             str(BUCKETS)], env={**env, "GLOO_SOCKET_IFNAME": "veth1"},
        ) for i in range(READERS)]  # fmt: skip
        procs.append(subprocess.Popen(
            [*link.enter(0), sys.executable, str(SCRIPT), "send", str(where), str(READERS),
             str(BUCKETS), str(MIB), hosts],
            env={**env, "GLOO_SOCKET_IFNAME": "veth0", "ASYNCRL_NCCL_HOST": f"{WIRED}0"},
        ))  # fmt: skip
        try:
            assert [p.wait(timeout=120) for p in procs] == [0] * (READERS + 1)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        carried = link.sent() - before
    sent = json.loads((where / "sent").read_text())
    for i, digest in enumerate(sent["digests"]):
        got = {(where / f"a{i}-rollout:{r}").read_text() for r in range(READERS)}
        assert got == {digest}, (i, got)
    return carried / PAYLOAD, sent["seconds"]


def test_a_bucket_crosses_the_link_once_per_host(tmp_path: Path) -> None:
    once, fan_s = _broadcast(tmp_path, ",".join(["node1"] * READERS))
    tree, tree_s = _broadcast(tmp_path, ",".join([""] * READERS))
    print(f"\nlink bytes per payload byte: told the host {once:.3f} "
          f"({sum(fan_s) / BUCKETS * 1e3:.0f} ms a bucket), not told {tree:.3f} "
          f"({sum(tree_s) / BUCKETS * 1e3:.0f} ms)")
    # measured: told 1.001-1.003 (TCP and the store's traffic on top), not told 2.002-2.005
    assert 1.0 <= once < 1.1, once
    assert tree > 1.9, tree
