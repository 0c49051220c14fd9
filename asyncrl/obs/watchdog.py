"""A watchdog outside the event loop: when the controller's loop stops turning (a blocking
call, a runaway computation, a deadlock on a lock), a thread notices and logs every thread's
stack, so the cause is in the log while the run is still stuck.

::

    tg.start_soon(LoopWatchdog(10.0, dump_dir=...).run)   # the loop beats every threshold/8;
                                                          # a thread checks the beats

The thread belongs to the ``run`` task: cancelling the task stops and joins it.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path

import anyio
import structlog

__all__ = ["STALL_WARNING_S", "LoopLag", "LoopWatchdog", "stacks"]

STALL_WARNING_S = 10.0
"""The controller's watchdog threshold: when its event loop has not turned for this long (a
blocking call starves both pumps), every thread's stack is logged (also
``<run.output_dir>/logs/stall-*.txt``). Once the config key ``run.stall_warning_s`` (issue 50):
the loop's lag p99 stays in milliseconds even at 1,000 gateway sessions (docs/gateway.md), so
10 s is never a slow turn, always something stuck; ``0``: off."""

log = structlog.get_logger("asyncrl.obs.watchdog")


def stacks() -> str:
    """Every thread's current stack, the loop's included."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---")
        parts.append("".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class LoopWatchdog:
    """Watches the event loop it runs on while :meth:`run` runs (as a task of the owner's
    task group): a stall of more than ``threshold_s`` is logged once (``event_loop_stalled``,
    with every thread's stack; also written to ``dump_dir/stall-<unix time>.txt``) and passed
    to ``on_stall(seconds, stacks)``; ``event_loop_resumed`` follows when the loop turns
    again. ``threshold_s <= 0``: off."""

    def __init__(
        self,
        threshold_s: float,
        *,
        dump_dir: str | None = None,
        on_stall: Callable[[float, str], None] | None = None,
    ) -> None:
        self.threshold_s = threshold_s
        self.dump_dir = dump_dir
        self.on_stall = on_stall
        self._beat = time.monotonic()
        self._stop = threading.Event()

    async def run(self) -> None:
        """Beat until cancelled; the watching thread lives exactly as long (joined here)."""
        if self.threshold_s <= 0:
            return
        self._beat = time.monotonic()
        self._stop.clear()
        thread = threading.Thread(target=self._watch, name="asyncrl-loop-watchdog", daemon=True)
        thread.start()
        try:
            while True:
                self._beat = time.monotonic()
                await anyio.sleep(self.threshold_s / 8)
        finally:
            self._stop.set()
            thread.join()  # at once: the thread waits on the event

    def _watch(self) -> None:
        stalled = False
        while not self._stop.wait(self.threshold_s / 4):
            late = time.monotonic() - self._beat
            if late > self.threshold_s and not stalled:
                stalled = True
                self._report(late)
            elif stalled and late < self.threshold_s / 2:
                stalled = False
                log.warning("event_loop_resumed")

    def _report(self, late: float) -> None:
        text = stacks()
        path = None
        if self.dump_dir:
            path = Path(self.dump_dir) / f"stall-{int(time.time())}.txt"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            except OSError:
                path = None
        log.error("event_loop_stalled", seconds=round(late, 1), stacks=text,
                  dump=str(path) if path else None)  # fmt: skip
        if self.on_stall is not None:
            self.on_stall(late, text)


class LoopLag:
    """How late the event loop wakes up from a short sleep, measured every ``interval_s``
    (a blocked loop starves both pumps); each step's record takes the figures since the last
    (bounded)."""

    def __init__(self, interval_s: float = 0.01, keep: int = 100_000) -> None:
        self.interval_s = interval_s
        self._lags: deque[float] = deque(maxlen=keep)

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            t = time.perf_counter()
            await anyio.sleep(self.interval_s)
            self._lags.append(max(0.0, time.perf_counter() - t - self.interval_s))

    def take(self) -> list[float]:
        """The delays measured since the last take."""
        lags = list(self._lags)
        self._lags.clear()
        return lags
