"""The pacer (:class:`asyncrl.run.wake.Pacer`): tasks that ask at once go through one per
pass of the event loop, in order, and a task on a timer gets in between."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import pytest

from asyncrl.run.wake import Pacer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_tasks_asking_together_go_through_one_per_pass_in_order() -> None:
    pacer, passes, released = Pacer(), [0], []

    async def ticker() -> None:  # counts passes of the loop
        while True:
            await anyio.lowlevel.checkpoint()
            passes[0] += 1

    async def worker(i: int) -> None:
        await pacer.turn()
        released.append((i, passes[0]))

    async with anyio.create_task_group() as tg:
        await tg.start(pacer.run)
        tg.start_soon(ticker)
        async with anyio.create_task_group() as workers:
            for i in range(8):
                workers.start_soon(worker, i)
        tg.cancel_scope.cancel()
    assert [i for i, _ in released] == list(range(8))
    ticks = [p for _, p in released]
    assert all(b > a for a, b in zip(ticks, ticks[1:])), ticks  # never two in one pass


async def test_a_timer_waits_for_one_piece_of_work_not_for_all() -> None:
    """Eight tasks of 2 ms of work each, woken together just after a 1 ms timer was set:
    unpaced, all eight pieces run before the sleeping task goes on; paced, three: the
    piece running when the timer came due, the one already let through for the pass in which
    asyncio runs the timer's callback, and the one let through in that pass, ahead of the
    task the callback wakes. Counted in pieces, not in seconds, so a busy machine changes
    nothing."""

    async def pieces_before_the_timer(paced: bool) -> int:
        pacer, go, done, seen = Pacer(), anyio.Event(), [0], []

        async def work() -> None:
            await go.wait()
            if paced:
                await pacer.turn()
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:  # holds the loop, as an agent's render does
                pass
            done[0] += 1

        async with anyio.create_task_group() as tg:
            await tg.start(pacer.run)
            for _ in range(8):
                tg.start_soon(work)
            await anyio.sleep(0.01)  # all waiting for go
            go.set()
            await anyio.sleep(0.001)
            seen.append(done[0])
            tg.cancel_scope.cancel()
        return seen[0]

    assert await pieces_before_the_timer(paced=False) == 8
    assert await pieces_before_the_timer(paced=True) <= 3


async def test_a_cancelled_waiter_leaves_the_queue_and_the_others_go_on() -> None:
    pacer, released = Pacer(), []
    scopes = [anyio.CancelScope() for _ in range(5)]

    async def worker(i: int) -> None:
        with scopes[i]:
            await pacer.turn()
            released.append(i)

    async with anyio.create_task_group() as tg:
        await tg.start(pacer.run)
        async with anyio.create_task_group() as workers:
            for i in range(5):
                workers.start_soon(worker, i)
            await anyio.lowlevel.checkpoint()  # all five asked; at most one let through
            scopes[4].cancel()
        assert pacer.waiting() == 0
        tg.cancel_scope.cancel()
    assert released == [0, 1, 2, 3]
    await pacer.turn()  # the pump is gone: nobody waits
