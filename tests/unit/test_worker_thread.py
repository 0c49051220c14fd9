"""The worker runtime's dedicated backend thread (``asyncrl.worker.trainer_runtime._Thread``)."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from asyncrl.worker.trainer_runtime import _Thread


@pytest.mark.asyncio
@pytest.mark.timeout(30)  # a regression deadlocks the loop: fail_after cannot fire then
async def test_calls_run_in_order_on_one_thread_even_when_they_finish_at_once() -> None:
    """A call that finishes before its completion callback is attached runs that callback on
    the event loop's own thread; that must not block the loop (it once deadlocked a trainer
    whose backend factory returned instantly)."""
    thread = _Thread()
    seen: list[tuple[int, int]] = []

    def record(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * 2

    try:
        with anyio.fail_after(20):
            for i in range(300):
                assert await thread.run(record, i) == 2 * i
            # a slow call: the loop keeps running while the thread works
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as tg:
                tg.start_soon(tick)
                await thread.run(time.sleep, 0.1)
                tg.cancel_scope.cancel()
            assert ticks > 10
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
    finally:
        thread.close()
    assert [i for i, _ in seen] == list(range(300))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
