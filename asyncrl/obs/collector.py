"""Python's cyclic garbage collector while training: paced by the clock, not by allocations.

CPython starts a young collection when the tracked objects allocated *net of those freed*
pass a threshold. In the controller's steady state objects die about as fast as they are
made (a call's coroutines, scopes and events live for its second or so), so that count
hardly moves: collections come rarely, and each then scans every object made since the last
one that is still alive, the whole working set of the calls in flight. At 1,000 gateway
sessions on the 16-core host (Python 3.12) that was 14 young collections in 40 s, each
examining ~154,000 objects for 92 ms of CPU, with nothing to collect; every call that arrived
meanwhile waited (the agents' p99 111 ms). See docs/gateway.md "Costs".

So while the loops run, the automatic collector is off and this module's task collects on a
clock::

    every GC_YOUNG_INTERVAL_S (0.05 s)   gc.collect(0): what was made since, still alive
                                         (a few ms: its survivors move on and are not
                                         scanned again by the next one)
    every GC_FULL_INTERVAL_S (60 s)      gc.collect(2) instead: cycles among older
                                         objects (none found in the benchmarks)

Objects that outlive a young collection are freed by reference counting as before; only
*cyclic* garbage among them waits for the next full collection, so memory stays bounded by
what the process makes in cycles per ``GC_FULL_INTERVAL_S``. ``GC_FREEZE`` keeps the
objects alive at the start (the loaded modules, the dataset) out of every scan. Everything is
undone at the end (a raise or cancellation included), so an embedding host gets its
collector back as it was. ``GC_YOUNG_INTERVAL_S = 0``: Python's own collector, untouched.

These were the config keys ``run.gc_freeze``, ``run.gc_young_interval_s`` and
``run.gc_full_interval_s`` until nobody needed to set them (issue 50); a benchmark that
compares with Python's own collector sets ``GC_YOUNG_INTERVAL_S`` before the run starts
(benchmarks/gateway.py ``--gc-young-interval``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

__all__ = [
    "GC_FREEZE", "GC_FULL_INTERVAL_S", "GC_YOUNG_INTERVAL_S", "Pacing", "collector_paused", "pace",
]  # fmt: skip

GC_FREEZE = True
"""While training, exclude the objects alive at its start from the collector's scans
(``gc.freeze``; undone at the end): a full collection over the start-up heap stalled the
controller's event loop 20-30 ms, 5 ms with it."""

GC_YOUNG_INTERVAL_S = 0.05
"""While training, the automatic collector is off and a young collection runs this often (a
few ms each). Left to itself, the collector came rarely and then scanned every call and
episode in flight: at 1,000 gateway sessions, 92 ms pauses with nothing to collect
(benchmarks/gateway.py; docs/gateway.md, "Costs"). ``0``: Python's own collector."""

GC_FULL_INTERVAL_S = 60.0
"""While training (with :data:`GC_YOUNG_INTERVAL_S`), a full collection this often: cyclic
garbage among objects that outlived a young collection waits for it (none was found in the
benchmarks). ``0``: none."""


class Pacing:
    """Which generation to collect at each tick (pure): the youngest, or all of them once
    ``full_interval_s`` has passed since the last full collection (``0``: never)."""

    def __init__(self, full_interval_s: float, now: float) -> None:
        self.full_interval_s = full_interval_s
        self._next_full = now + full_interval_s

    def generation(self, now: float) -> int:
        """The generation to collect at ``now`` (``0`` or ``2``)."""
        if self.full_interval_s and now >= self._next_full:
            self._next_full = now + self.full_interval_s
            return 2
        return 0


@contextmanager
def collector_paused(freeze: bool, young_interval_s: float) -> Iterator[None]:
    """While the block runs: the objects alive now frozen (``freeze``), and (``young_interval_s``
    > 0) the automatic collector off, for :func:`pace` (a task of the block's) to collect on
    the clock instead. Undone on exit, however the block ends."""
    was_enabled = gc.isenabled()
    if freeze:
        gc.collect()
        gc.freeze()
    if young_interval_s:
        gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


async def pace(young_interval_s: float, full_interval_s: float) -> None:
    """Collect on the clock, forever (see the module): a task inside :func:`collector_paused`.

    Cancellation: stops.
    """
    pacing = Pacing(full_interval_s, anyio.current_time())
    while True:
        await anyio.sleep(young_interval_s)
        gc.collect(pacing.generation(anyio.current_time()))
