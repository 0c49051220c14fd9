"""The loop watchdog sees a blocked event loop from its own thread and names the culprit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import pytest

from asyncrl.obs.watchdog import LoopWatchdog

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def a_blocking_reward_function() -> None:
    time.sleep(0.6)  # blocks the event loop, as a slow synchronous call on it would


async def test_a_blocked_loop_is_reported_with_its_stack(tmp_path: Path) -> None:
    seen: list[tuple[float, str]] = []
    dog = LoopWatchdog(0.2, dump_dir=str(tmp_path), on_stall=lambda s, t: seen.append((s, t)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(dog.run)
        await anyio.sleep(0.1)
        a_blocking_reward_function()
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    assert len(seen) == 1
    seconds, stacks = seen[0]
    assert 0.2 < seconds < 0.6
    assert "a_blocking_reward_function" in stacks  # the loop thread's stack names the culprit
    (dump,) = tmp_path.glob("stall-*.txt")
    assert "a_blocking_reward_function" in dump.read_text()
    assert not [t for t in threading.enumerate() if t.name == "asyncrl-loop-watchdog"]


async def test_a_turning_loop_is_not_reported() -> None:
    seen: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(LoopWatchdog(0.2, on_stall=lambda s, t: seen.append(s)).run)
        for _ in range(10):
            await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert seen == []
    assert not [t for t in threading.enumerate() if t.name == "asyncrl-loop-watchdog"]
