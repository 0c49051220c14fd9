"""The anyio adapter over ZeroMQ (real sockets over ipc:// in a private directory).

The adapter's hard part is that one edge-triggered file descriptor serves both directions
of a socket: a task waiting to receive must still wake when another task's send (or
receive) consumed the edge. These tests drive exactly those interleavings.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import anyio
import pytest

from asyncrl.wire.transport import (
    DEALER,
    PULL,
    PUSH,
    ROUTER,
    Context,
    Rejections,
    ipc_address,
    make_private_dir,
    peer_name,
)

def _bytes(frames: list) -> list[bytes]:
    return [bytes(f.buffer) if hasattr(f, "buffer") else bytes(f) for f in frames]


@pytest.mark.asyncio
async def test_push_pull_across_tasks_in_order(run_dir: str) -> None:
    ctx = Context()
    try:
        addr = ipc_address(run_dir, "data")
        pull = ctx.socket(PULL, bind=addr)
        push = ctx.socket(PUSH, connect=addr)
        got: list[list[bytes]] = []

        async def receive() -> None:
            for _ in range(200):
                got.append(_bytes(await pull.recv()))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)  # waits before anything is sent
                await anyio.sleep(0.01)
                for i in range(200):
                    await push.send([b"m", str(i).encode(), b"x" * (i % 7)])
        assert got == [[b"m", str(i).encode(), b"x" * (i % 7)] for i in range(200)]
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_a_send_nobody_waits_behind_does_not_give_the_loop_back(run_dir: str) -> None:
    """With no sender parked at the high-water mark, a send queues at once and returns
    without a pass of the loop (the send lock's would cost one a message): a task started
    before 100 sends has not run after them."""
    ctx = Context()
    try:
        addr = ipc_address(run_dir, "data")
        pull = ctx.socket(PULL, bind=addr)
        push = ctx.socket(PUSH, connect=addr)
        ran: list[bool] = []

        async def other() -> None:
            ran.append(True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            for i in range(100):
                await push.send([str(i).encode()])
            assert ran == []
        with anyio.fail_after(10):
            got = [_bytes(await pull.recv()) for _ in range(100)]
        assert got == [[str(i).encode()] for i in range(100)]
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_many_concurrent_senders_with_backpressure(run_dir: str) -> None:
    """50 tasks share one PUSH socket whose high-water mark is tiny, the reader is slow:
    senders must wait (without blocking the loop), and every message arrives exactly once,
    each sender's messages in order."""
    ctx = Context()
    try:
        addr = ipc_address(run_dir, "data")
        pull = ctx.socket(PULL, bind=addr, hwm=2)
        push = ctx.socket(PUSH, connect=addr, hwm=2)
        senders, per_sender = 50, 20
        received: list[tuple[int, int]] = []
        ticks = 0

        async def sender(s: int) -> None:
            for i in range(per_sender):
                await push.send([s.to_bytes(2, "little"), i.to_bytes(2, "little")])

        async def ticker() -> None:  # proves the loop keeps running while senders wait
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.sleep(0.001)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                async with anyio.create_task_group() as send_tg:
                    for s in range(senders):
                        send_tg.start_soon(sender, s)
                    for n in range(senders * per_sender):
                        if n % 100 == 0:
                            await anyio.sleep(0.005)  # a slow reader
                        s, i = _bytes(await pull.recv())
                        received.append((int.from_bytes(s, "little"), int.from_bytes(i, "little")))
                tg.cancel_scope.cancel()
        assert sorted(received) == [(s, i) for s in range(senders) for i in range(per_sender)]
        for s in range(senders):
            assert [i for (t, i) in received if t == s] == list(range(per_sender))
        assert ticks > 5
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_cancelled_recv_leaves_socket_usable(run_dir: str) -> None:
    ctx = Context()
    try:
        addr = ipc_address(run_dir, "data")
        pull = ctx.socket(PULL, bind=addr)
        push = ctx.socket(PUSH, connect=addr)
        for _ in range(3):
            with anyio.move_on_after(0.05) as scope:
                await pull.recv()
            assert scope.cancelled_caught
        await push.send([b"after"])
        with anyio.fail_after(5):
            assert _bytes(await pull.recv()) == [b"after"]

        # cancelling receives over and over while messages flow loses none of them
        async def produce() -> None:
            for i in range(100):
                await push.send([i.to_bytes(2, "little")])
                await anyio.sleep(0)

        got: list[int] = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                while len(got) < 100:
                    with anyio.move_on_after(0.0005):
                        got.append(int.from_bytes(_bytes(await pull.recv())[0], "little"))
        assert got == list(range(100))
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_reader_wakes_when_another_task_sends_on_the_same_socket(run_dir: str) -> None:
    """Task A waits in recv on a DEALER while task B sends on that same DEALER; the ROUTER
    echoes. The send may consume the FD's edge that announced the reply: A must still wake."""
    ctx = Context()
    try:
        addr = ipc_address(run_dir, "control")
        router = ctx.socket(ROUTER, bind=addr)
        dealer = ctx.socket(DEALER, connect=addr, identity="w:0")
        replies: list[bytes] = []

        async def echo() -> None:
            while True:
                ident, body = _bytes(await router.recv())
                assert ident == b"w:0"
                await router.send([ident, body + b"!"])

        async def read() -> None:
            for _ in range(50):
                replies.append(_bytes(await dealer.recv())[0])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(echo)
                async with anyio.create_task_group() as inner:
                    inner.start_soon(read)
                    for i in range(50):
                        await dealer.send([str(i).encode()])
                        await anyio.sleep(0)
                tg.cancel_scope.cancel()
        assert replies == [f"{i}!".encode() for i in range(50)]
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_parked_reader_wakes_after_a_send_consumed_its_edge(run_dir: str) -> None:
    """Deterministic version of the race above. While task A is parked waiting for the socket
    to become readable, a message for it arrives *and* — before the loop polls again — a
    send on the same socket processes ZeroMQ's command mailbox, which clears the FD's
    readiness. Only the adapter's wake-up after every operation lets A see the message."""
    ctx = Context()
    try:
        addr = ipc_address(run_dir, "control")
        router = ctx.socket(ROUTER, bind=addr)
        dealer = ctx.socket(DEALER, connect=addr, identity="w:0")
        await dealer.send([b"hello"])  # the ROUTER learns the route to w:0
        with anyio.fail_after(5):
            assert _bytes(await router.recv()) == [b"w:0", b"hello"]
        got: list[list[bytes]] = []

        async def reader() -> None:
            got.append(_bytes(await dealer.recv()))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await anyio.sleep(0.05)  # A is parked in wait_readable
                # from here on no await: the loop cannot poll the FD in between
                router.send_nowait([b"w:0", b"reply"])
                time.sleep(0.05)  # the reply reaches the dealer's pipe; its FD signals
                dealer.send_nowait([b"ping"])  # processes the mailbox: readiness is gone
        assert got == [[b"reply"]]
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_send_nowait_and_close(run_dir: str) -> None:
    ctx = Context()
    addr = ipc_address(run_dir, "data")
    pull = ctx.socket(PULL, bind=addr)
    push = ctx.socket(PUSH, connect=addr)
    push.send_nowait([b"now"])
    with anyio.fail_after(5):
        assert _bytes(await pull.recv()) == [b"now"]
    push.close()
    push.close()  # idempotent
    ctx.close()
    ctx.close()  # idempotent
    # libzmq leaves the ipc:// file behind even after close: the controller removes the whole
    # private run directory instead (checked by the integration tests)


def test_private_dir_and_address_checks(tmp_path: Path) -> None:
    d = make_private_dir(str(tmp_path / "a" / "b"))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError, match="0700"):
        make_private_dir(str(open_dir))
    assert ipc_address("/tmp/x", "control") == "ipc:///tmp/x/control.sock"
    with pytest.raises(ValueError, match="too long"):
        ipc_address("/tmp/" + "d" * 120, "control")


def test_peer_names_are_printable() -> None:
    assert peer_name(b"rollout:0") == "rollout:0"
    assert peer_name(b"\x00k\x8b\x45\x67") == "hex:006b8b4567"
    assert peer_name(b"") == "hex:"
    assert peer_name("trainer:1") == "trainer:1"


def test_rejections_count_per_socket() -> None:
    r = Rejections()
    r.reject("data", "hex:00", "cannot decode")
    r.reject("data", "x", "y")
    r.reject("weights", "x", "y")
    assert r.counts == {"data": 2, "weights": 1} and r.total == 3
