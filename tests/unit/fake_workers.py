"""Scripted fake workers against a real control plane (real ZeroMQ over ipc://), shared by
test_rpc.py and test_heartbeat.py.

A fake worker is a DEALER speaking the wire protocol by hand, so each test decides exactly
what the worker says and when; the control plane is the controller's real
:class:`ControlPlane` on a ROUTER the test binds.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import (
    PROTOCOL_VERSION,
    Call,
    FromWorker,
    Health,
    HealthResult,
    Hello,
    Init,
    Ready,
    Reply,
    ToWorker,
)
from asyncrl.wire.rpc import ControlPlane
from asyncrl.wire.transport import DEALER, ROUTER, AsyncSocket, Context, ipc_address


def init_for(hello: Hello) -> Init:
    """The Init every fake worker is sent: its config names the worker's group."""
    return Init(run_id="r1", config={"who": hello.group}, data_address="ipc://data")


class FakeWorker:
    """A DEALER with identity ``group:rank`` whose Hello names process ``pid`` (by default
    the test's own)."""

    def __init__(
        self, ctx: Context, address: str, group: str, rank: int, pid: int | None = None
    ) -> None:
        self.identity = f"{group}:{rank}"
        self.group, self.rank = group, rank
        self.pid = os.getpid() if pid is None else pid
        self.sock: AsyncSocket = ctx.socket(DEALER, connect=address, identity=self.identity)
        self.tx = Codec(FromWorker)
        self.rx = Codec(ToWorker)

    async def say(self, msg: Any) -> None:
        await self.sock.send(self.tx.encode(msg))

    async def hear(self) -> Any:
        """The next message from the controller.

        Raises:
            TimeoutError: none came within 5 s.
        """
        with anyio.fail_after(5):
            return self.rx.decode(await self.sock.recv())

    async def handshake(
        self, *, version: int = PROTOCOL_VERSION, ready: bool = True, host: str = ""
    ) -> Init:
        """Hello (protocol ``version``), the controller's Init, then Ready unless told not to.

        Raises:
            AssertionError: the controller answered something other than Init.
        """
        await self.say(
            Hello(protocol_version=version, group=self.group, rank=self.rank, world_size=1,
                  pid=self.pid, log_path=f"/logs/{self.group}-{self.rank}.log", host=host)
        )  # fmt: skip
        init = await self.hear()
        assert isinstance(init, Init), init
        if ready:
            await self.say(Ready(backend="fake", capabilities={"x": 1}))
        return init

    async def answer_health(self, times: int | None = None, *, pid: int | None = None) -> None:
        """Answer ``times`` health probes (forever if None) with ``HealthResult(pid)`` (this
        worker's pid by default).

        Raises:
            AssertionError: a call other than Health came.

        Cancellation: stops waiting for the next probe.
        """
        answered = 0
        while times is None or answered < times:
            call = self.rx.decode(await self.sock.recv())
            assert isinstance(call, Call) and isinstance(call.request, Health), call
            result = HealthResult(pid=self.pid if pid is None else pid)
            await self.say(Reply(call_id=call.call_id, result=result))
            answered += 1


def bind_plane(
    run_dir: str,
    *,
    init: Callable[[Hello], Init] = init_for,
    router_mandatory: bool = True,
    **options: Any,
) -> tuple[ControlPlane, Context, str]:
    """A fresh context, a ROUTER bound at ``run_dir``'s control address, and a
    :class:`ControlPlane` on it (``options``: its keyword arguments). The caller runs the
    plane and closes the context."""
    ctx = Context()
    address = ipc_address(run_dir, "control")
    router = ctx.socket(ROUTER, bind=address, router_mandatory=router_mandatory)
    return ControlPlane(router, init, **options), ctx, address


@asynccontextmanager
async def control_plane(
    run_dir: str, **options: Any
) -> AsyncIterator[tuple[ControlPlane, Context, str, anyio.abc.TaskGroup]]:
    """:func:`bind_plane`, its reader running in a task group the body may start tasks in;
    on exit the group is cancelled and the context closed.

    Cancellation: cancels the reader and every task the body started.
    """
    control, ctx, address = bind_plane(run_dir, **options)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(control.run)
            yield control, ctx, address, tg
            tg.cancel_scope.cancel()
    finally:
        ctx.close()
