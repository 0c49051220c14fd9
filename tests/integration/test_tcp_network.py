"""``cluster.network = "tcp"``: the run's sockets on TCP with CURVE, the embedded controller and
its spawned workers on one host (the bigram backends, real processes).

The run trains as over ipc://, and a foreign process that connects to every TCP socket the
run listens on (found from the processes' listening sockets, not from asyncrl) with random
bytes, a plain ZeroMQ peer sending well-formed frames, and CURVE with keys of its own is
refused at each: the run goes on, no frame of its reaches a socket (no frame rejected: none
was read), and each refusal is logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import structlog

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from integration_support import assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

INTRUDER = r"""
import os, socket, sys, time
import zmq
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import FromWorker, Hello, PROTOCOL_VERSION
hello = Codec(FromWorker).encode(Hello(protocol_version=PROTOCOL_VERSION, group="rollout",
                                       rank=0, world_size=1, pid=os.getpid(), log_path=""))
ctx = zmq.Context()
for endpoint in sys.argv[1:]:
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as raw:
        raw.sendall(os.urandom(2048))
    for kind in (zmq.DEALER, zmq.PUSH):
        for curve in (False, True):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            if kind == zmq.DEALER:
                s.setsockopt(zmq.IDENTITY, b"rollout:0")
            if curve:  # CURVE, with keys that are not the run's
                server_public, _ = zmq.curve_keypair()
                public, secret = zmq.curve_keypair()
                s.setsockopt(zmq.CURVE_SERVERKEY, server_public)
                s.setsockopt(zmq.CURVE_PUBLICKEY, public)
                s.setsockopt(zmq.CURVE_SECRETKEY, secret)
            s.connect(f"tcp://{host}:{port}")
            try:
                s.send_multipart(list(hello), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection ever completed: nothing to send on
            time.sleep(0.2)
            s.close()
ctx.term()
print("intruded", len(sys.argv) - 1)
"""


def _listening(pids: list[int]) -> list[str]:
    """Every TCP socket these processes listen on, as host:port."""
    out = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                out.append(f"{conn.laddr.ip}:{conn.laddr.port}")
    return out


async def test_a_tcp_run_trains_and_refuses_a_process_without_the_keys(
    make_config: Callable[..., Config],
) -> None:
    num_steps = 3
    cfg = make_config(run={"num_steps": num_steps}, cluster={"network": "tcp"})
    with structlog.testing.capture_logs() as logs:
        async with asyncrl.Controller(cfg) as ctl:
            addresses = ctl.addresses
            assert addresses is not None and addresses.keys is not None
            assert addresses.control.startswith("tcp://127.0.0.1:")
            assert addresses.data.startswith("tcp://127.0.0.1:")
            pids = worker_pids(ctl)
            # the controller's control and data sockets (this process may hold other tests'
            # listeners), and what the workers listen on: trainer rank 0's weights socket
            own = [a[len("tcp://"):] for a in (addresses.control, addresses.data)]
            assert set(own) <= set(_listening([os.getpid()])), own
            theirs = _listening(list(pids.values()))
            assert len(theirs) == 1, theirs
            sockets = own + theirs
            intruder = subprocess.run([sys.executable, "-c", INTRUDER, *sockets],
                                      capture_output=True, text=True, timeout=60)  # fmt: skip
            assert intruder.returncode == 0, intruder.stderr[-2000:]
            summary = await ctl.train()
        assert_nothing_left(ctl, pids.values())
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    assert sum(summary.rejected_frames.values()) == 0, summary.rejected_frames
    # the controller's refusals (its sockets) and trainer rank 0's (its weights socket), in
    # its log file
    refused = [e for e in logs if e["event"] == "peer_refused"]
    for path in (Path(cfg.run.output_dir) / "logs").glob("*.log"):
        for line in path.read_text().splitlines():
            if '"peer_refused"' in line:
                refused.append(json.loads(line))
    # per socket: the plain DEALER and PUSH fail the handshake, the CURVE ones with foreign
    # server keys too (random bytes are dropped before any handshake, unlogged)
    by_socket: dict[str, int] = {}
    for e in refused:
        by_socket[e["socket"]] = by_socket.get(e["socket"], 0) + 1
    assert set(by_socket) == {f"tcp://{s}" for s in sockets}, refused
    assert all(n >= 4 for n in by_socket.values()), by_socket
    # (a peer that hangs up mid-handshake is "the handshake failed", EPIPE)
    assert all(e["reason"].startswith(("not a CURVE handshake with this run's server key",
                                       "the handshake failed")) for e in refused), refused  # fmt: skip
    assert all(e["run_keys"] == addresses.keys.fingerprint for e in refused)


async def test_a_tcp_run_refits_over_gloo_broadcasts(make_config: Callable[..., Config]) -> None:
    """The refit that crosses hosts: ``nccl`` (a gloo group on the CPU) instead of shm, every
    refit verified (the generators' logprobs against the trainer's)."""
    num_steps = 3
    cfg = make_config(run={"num_steps": num_steps}, cluster={"network": "tcp", "rollout_ranks": 2},
                      refit={"transport": "nccl", "verify_every_steps": 1})  # fmt: skip
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        await ctl.train()
    assert_nothing_left(ctl, pids.values())
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    # a check that fails stops the run (RefitError); each passed one is recorded
    checks = [r for r in read_metrics(cfg) if r["kind"] == "refit_verify"]
    assert {(r["worker"], r["version"]) for r in checks} == {
        (f"rollout:{w}", v) for w in range(2) for v in range(1, num_steps + 1)
    }, checks
    assert max(r["max_abs"] for r in checks) <= 1.5e-6  # 4.8e-7 measured (float32 rounding)
