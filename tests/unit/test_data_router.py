"""The data socket read once for every job (:class:`asyncrl.run.intake.DataRouter`): each sample
and failure to its job's intake by its group id, in order; what decodes to nothing or names no
running job is counted and dropped; a full intake holds the router instead of queueing more."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from asyncrl.run import intake as intake_module
from asyncrl.run.intake import DataRouter, job_of
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import DataBatch, DataMessage, GroupFailed, Sample, SampleDone
from asyncrl.wire.transport import Rejections

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

SAMPLE = Sample(np.array([3, 4], np.int32), np.zeros(2, np.float32), "stop")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Socket:
    """The data socket: frames as a worker encodes them."""

    def __init__(self) -> None:
        self.tx, self.rx = anyio.create_memory_object_stream[list](64)
        self.codec = Codec(DataMessage)

    def __enter__(self) -> _Socket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tx.close()
        self.rx.close()

    def send(self, msg: object) -> None:
        self.tx.send_nowait(self.codec.encode(msg))

    async def recv(self) -> list:
        return await self.rx.receive()

    def recv_nowait(self) -> list | None:
        try:
            return self.rx.receive_nowait()
        except anyio.WouldBlock:
            return None


def test_a_jobs_ids_name_it_and_the_runs_own_name_none() -> None:
    assert job_of("g12") == "" and job_of("g12/0#1") == "" and job_of("eval-start-3") == ""
    assert job_of("math:g12") == "math" and job_of("math:g12/0@1#2") == "math"


async def test_each_item_reaches_its_jobs_intake_in_order_and_strangers_are_counted() -> None:
    rejections = Rejections()
    with _Socket() as socket, DataRouter(socket, rejections) as router:  # type: ignore[arg-type]
        own, math = router.intake(""), router.intake("math")
        with pytest.raises(ValueError, match="has an intake already"):
            router.intake("math")
        socket.send(SampleDone("g1", "rollout:0", 0, SAMPLE))
        socket.send(DataBatch([SampleDone("math:g1", "rollout:1", 0, SAMPLE),
                               GroupFailed("g2", "rollout:1", "E", "m"),
                               SampleDone("math:g1", "rollout:1", 1, SAMPLE),
                               SampleDone("code:g1", "rollout:1", 0, SAMPLE)]))  # fmt: skip
        socket.tx.send_nowait([b"\x00not msgpack"])
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.run)
            got = [await own.receive(), await own.receive()]
            assert [type(m).__name__ for m in got] == ["SampleDone", "GroupFailed"]
            assert [(m.group_id, m.index) for m in (await math.receive(), await math.receive())] \
                == [("math:g1", 0), ("math:g1", 1)]
            while sum(rejections.counts.values()) < 2:
                await anyio.sleep(0.01)
            router.close("math")  # the job ended: its items are strangers' from now on
            socket.send(SampleDone("math:g2", "rollout:0", 0, SAMPLE))
            while sum(rejections.counts.values()) < 3:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert rejections.counts == {"data": 3}


async def test_a_full_intake_holds_the_router_and_loses_nothing(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(intake_module, "INTAKE_SIZE", 2)
    with _Socket() as socket, DataRouter(socket, Rejections()) as router:  # type: ignore[arg-type]
        own = router.intake("")
        for i in range(6):
            socket.send(SampleDone(f"g{i}", "rollout:0", 0, SAMPLE))
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.run)
            await anyio.sleep(0.1)
            assert own.statistics().current_buffer_used == 2  # bounded: the rest wait
            got = [(await own.receive()).group_id for _ in range(6)]
            tg.cancel_scope.cancel()
    assert got == [f"g{i}" for i in range(6)]
