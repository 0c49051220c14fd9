"""The paced garbage collector (asyncrl/obs/collector.py): a young collection on every tick,
a full one once its interval has passed; the host's collector back as it was afterwards."""

from __future__ import annotations

import gc

import anyio
import pytest

from asyncrl.obs.collector import Pacing, collector_paused, pace


def test_pacing_collects_young_and_all_generations_on_its_interval() -> None:
    pacing = Pacing(full_interval_s=1.0, now=10.0)
    ticks = [10.05 + 0.05 * i for i in range(60)]  # 10.05 .. 13.0, every 0.05 s
    fulls = [t for t in ticks if pacing.generation(t) == 2]
    # by hand: the first at or after 11.0, then at or after each one + 1.0
    assert fulls == pytest.approx([11.0, 12.0, 13.0], abs=0.051)
    assert Pacing(0.0, now=0.0).generation(1e9) == 0  # 0: never a full one


@pytest.mark.asyncio
async def test_the_pacer_collects_on_the_clock_with_the_automatic_collector_off() -> None:
    seen: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        with collector_paused(True, 0.01):
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            seen.clear()
            with anyio.move_on_after(0.35):
                await pace(0.01, 0.1)
            # young collections on the ticks, a full one once 0.1 s passed, at most one per
            # 0.1 s: so at most 3 in 0.35 s. How many of each a busy machine lets through is
            # the clock's (the schedule itself: the fake-clock test above)
            assert seen.count(0) >= 1 and 1 <= seen.count(2) <= 3, seen
            assert set(seen) <= {0, 2}
            seen.clear()
            garbage = [[]]
            garbage[0].append(garbage)  # a cycle the automatic collector would find
            del garbage
            for _ in range(20_000):  # far past any young threshold: nothing collects now
                [[]]
            assert seen == []
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(callback)


@pytest.mark.parametrize(("freeze", "young_s"), [(True, 0.01), (False, 0.01), (True, 0.0)])
def test_the_host_collector_is_back_also_when_the_run_raises(freeze: bool, young_s: float) -> None:
    """An embedding host's collector is as it was afterwards, a raise included; with
    ``young_s = 0`` Python's own collector runs untouched."""
    before = gc.get_threshold()
    gc.set_threshold(500, 7, 9)  # the host's own settings
    try:
        with pytest.raises(RuntimeError, match="the run failed"):
            with collector_paused(freeze, young_s):
                assert gc.isenabled() == (young_s == 0)
                assert (gc.get_freeze_count() > 0) == freeze
                raise RuntimeError("the run failed")
        assert gc.isenabled() and gc.get_freeze_count() == 0
        assert gc.get_threshold() == (500, 7, 9)
    finally:
        gc.set_threshold(*before)


def test_a_host_that_had_its_collector_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with collector_paused(False, 0.01):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
