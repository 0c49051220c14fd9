"""The run's CURVE keys and the guard of its tcp:// sockets (asyncrl/wire/curve.py), on real
ZeroMQ sockets over loopback TCP: the run's peers talk; a peer with other keys, without CURVE,
or sending random bytes is refused at the handshake, named, and delivers nothing."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest
import zmq

from asyncrl.wire.curve import KeysError, RunKeys
from asyncrl.wire.transport import DEALER, ROUTER, Context

WAIT_MS = 10_000  # a hang guard: every wait returns when its event comes (~1-5 ms measured)


def _refusals(ctx: Context, n: int) -> list:
    """Wait until the guard has counted ``n`` refusals; its recent ones."""
    assert ctx.guard is not None
    deadline = time.monotonic() + WAIT_MS / 1e3
    while time.monotonic() < deadline:
        total, recent = ctx.guard.refusals()
        if total >= n:
            return recent
        time.sleep(0.01)
    return ctx.guard.refusals()[1]


def _nothing_arrives(server) -> None:
    assert server.raw.poll(300, zmq.POLLIN) == 0, "a frame got through"


@pytest.fixture
def served():
    keys = RunKeys.generate()
    ctx = Context(keys)
    server = ctx.socket(ROUTER, bind="tcp://127.0.0.1:*")
    yield keys, ctx, server, server.last_endpoint
    ctx.close()


def test_key_file_round_trips_with_mode_0600_and_refuses_looser(tmp_path: Path) -> None:
    keys = RunKeys.generate()
    path = tmp_path / "keys.json"
    keys.write(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert RunKeys.read(str(path)) == keys
    with pytest.raises(FileExistsError):
        keys.write(str(path))  # never overwritten
    os.chmod(path, 0o644)
    with pytest.raises(KeysError, match="mode 0600, not 644. Fix: chmod 600"):
        RunKeys.read(str(path))
    with pytest.raises(KeysError, match="cannot read"):
        RunKeys.read(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not an asyncrl key file"),
        ('{"server_public": "x"}', "not an asyncrl key file"),
        ('{"server_public": "x", "server_secret": "y", "client_public": "z", '
         '"client_secret": "w"}', "server_public is 1 characters"),
    ],
)
def test_malformed_keys_are_named(text: str, match: str) -> None:
    with pytest.raises(KeysError, match=match):
        RunKeys.from_json(text, "keys.json")


def test_the_secret_keys_never_show_in_a_repr() -> None:
    keys = RunKeys.generate()
    for text in (repr(keys), str(keys), repr([keys])):
        assert keys.server_secret.decode() not in text and keys.client_secret.decode() not in text
        assert keys.fingerprint in text


def test_a_public_key_of_another_pair_is_refused() -> None:
    a, b = RunKeys.generate(), RunKeys.generate()
    mixed = RunKeys(a.server_public, b.server_secret, a.client_public, a.client_secret)
    with pytest.raises(KeysError, match="does not belong to its secret key"):
        RunKeys.from_json(mixed.to_json(), "keys.json")


def test_the_runs_peers_talk_over_curve(served) -> None:
    keys, _, server, endpoint = served
    client_ctx = Context(keys)
    try:
        client = client_ctx.socket(DEALER, connect=endpoint, identity="worker-0")
        client.raw.send_multipart([b"hello"])
        assert server.raw.poll(WAIT_MS, zmq.POLLIN)
        assert server.raw.recv_multipart() == [b"worker-0", b"hello"]
        assert server.raw.getsockopt(zmq.CURVE_SERVER) == 1
    finally:
        client_ctx.close()


def test_another_runs_client_key_is_refused_by_zap_and_named(served) -> None:
    keys, ctx, server, endpoint = served
    other = RunKeys.generate()
    # knows the server's public key, presents a client key of its own
    intruder = RunKeys(keys.server_public, keys.server_secret, other.client_public,
                       other.client_secret)  # fmt: skip
    bad = Context(intruder)
    try:
        sock = bad.socket(DEALER, connect=endpoint)
        sock.raw.send_multipart([b"inject"])
        (refused,) = _refusals(ctx, 1)
        assert refused.socket == "zap" and refused.peer == "127.0.0.1"
        assert "client key is not this run's" in refused.reason
        _nothing_arrives(server)
    finally:
        bad.close()


@pytest.mark.parametrize("how", ["foreign keys", "no curve", "random bytes"])
def test_a_peer_without_the_keys_fails_the_handshake_and_injects_nothing(served, how) -> None:
    _, ctx, server, endpoint = served
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    if how == "random bytes":  # not even a ZeroMQ greeting: dropped, no handshake event
        with socket.create_connection((host, int(port)), timeout=WAIT_MS / 1e3) as raw:
            raw.sendall(os.urandom(4096))
            try:
                while raw.recv(4096):  # the server's greeting, then its close
                    pass
            except ConnectionResetError:
                pass
        _nothing_arrives(server)
        return
    else:
        plain = zmq.Context()
        try:
            sock = plain.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if how == "foreign keys":
                other = RunKeys.generate()
                for option, value in other.client_options().items():
                    sock.setsockopt(option, value)
            sock.connect(endpoint)
            sock.send_multipart([b"inject"])
            assert _refusals(ctx, 1), "the handshake was not refused"
            sock.close()
        finally:
            plain.term()
    recent = _refusals(ctx, 1)
    assert recent and recent[0].socket == endpoint, recent
    assert "not a CURVE handshake with this run's server key" in recent[0].reason or \
        "handshake failed" in recent[0].reason, recent
    _nothing_arrives(server)


def test_tcp_without_keys_is_refused_before_any_socket() -> None:
    ctx = Context()
    try:
        with pytest.raises(ValueError, match="needs the run's CURVE keys"):
            ctx.socket(ROUTER, bind="tcp://127.0.0.1:*")
    finally:
        ctx.close()
