"""One sink on its own thread, fed by a bounded queue (used by
:class:`~asyncrl.obs.log.MetricsWriter` for every sink that is not synchronous).

::

    writer (event loop) --put_nowait--> queue (bounded) --get--> sink thread --> sink.log(...)
          full? drop + count                                       raised? log once, disable

Guarantees: :meth:`SinkThread.put` never blocks; the sink's factory and methods run only on
the sink's thread; a sink that raises is logged once and gets nothing more (its ``close`` is
still tried); :meth:`SinkThread.join` returns by its deadline plus a short grace, leaving a
sink stuck in a call behind as a daemon thread (logged) rather than hanging the run's exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog

from asyncrl.sinks import Sink, SinkPlugin

__all__ = ["SinkThread", "deliver"]

log = structlog.get_logger("asyncrl.metrics")

_STOP = object()
_GRACE_S = 5.0  # after the deadline: for a sink to finish the call it is in and close


def deliver(sink: Sink, record: Mapping[str, Any]) -> None:
    """Hand ``record`` to ``sink``: a ``config`` record to ``log_config`` first, then every
    record to ``log``."""
    if record.get("kind") == "config":
        sink.log_config(record.get("config") or {})
    sink.log(record)


class SinkThread:
    """Runs the sink ``plugin`` makes on a thread named ``asyncrl-sink-<name>``; the thread
    starts at once and ends after :meth:`join` (or after the sink raised)."""

    def __init__(
        self, name: str, plugin: SinkPlugin, options: dict[str, Any], capacity: int,
        **kwargs: str,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.dropped = 0
        """Records refused because the queue was full (counted by :meth:`put`)."""
        self.abandoned = 0
        """Records still queued at the close deadline, never delivered."""
        self.error: BaseException | None = None
        """What the sink raised (it is disabled since)."""
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._failed = threading.Event()
        self._abandon = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(plugin, options, kwargs), name=f"asyncrl-sink-{name}",
            daemon=True,
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, record: Mapping[str, Any]) -> None:
        """Queue ``record`` without blocking: dropped (and counted) when the queue is full,
        ignored once the sink has failed. Call from one thread at a time."""
        if self._failed.is_set():
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "metrics_sink_lagging", sink=self.name, queue=self.capacity,
                    hint="records are dropped while the queue is full; the count is logged "
                    "at close",
                )

    def stop(self, deadline: float) -> None:
        """Ask the thread to finish once the records already queued are delivered (waits for
        room in a full queue until ``deadline``, a ``time.monotonic()`` reading)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._abandon.set()

    def join(self, deadline: float) -> None:
        """Wait for the thread until ``deadline``; past it, drop what is still queued, wait a
        short grace for the sink's current call and ``close``, then leave the thread (a
        daemon) and log ``metrics_sink_stuck``. Logs the records dropped, if any."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abandon.set()
            try:  # wakes a thread waiting on an empty queue
                self._queue.put_nowait(_STOP)
            except queue.Full:
                pass  # not empty: the thread sees the abandon flag at its next record
            self._thread.join(_GRACE_S)
        if self._thread.is_alive():
            log.warning("metrics_sink_stuck", sink=self.name, grace_s=_GRACE_S)
        if self.dropped or self.abandoned:
            log.warning(
                "metrics_sink_dropped", sink=self.name, dropped=self.dropped,
                abandoned=self.abandoned,
            )

    def _run(self, plugin: SinkPlugin, options: dict[str, Any], kwargs: dict[str, str]) -> None:
        sink: Sink | None = None
        try:
            sink = plugin(options, **kwargs)
            while True:
                item = self._queue.get()
                if item is _STOP or self._abandon.is_set():
                    self._discard(item)
                    break
                deliver(sink, item)
        except Exception as exc:
            self._fail(exc)
        finally:
            if sink is not None:
                try:
                    sink.close()
                except Exception as exc:
                    self._fail(exc)

    def _discard(self, item: Any) -> None:
        """Count the records left when the thread stops (none after a plain stop)."""
        items = [item]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self.abandoned += sum(1 for i in items if i is not _STOP)

    def _fail(self, exc: Exception) -> None:
        self._failed.set()
        if self.error is None:
            self.error = exc
            log.error(
                "metrics_sink_failed", sink=self.name, error=f"{type(exc).__name__}: {exc}",
                hint="the sink is disabled; the run goes on (metrics.jsonl has every record)",
                exc_info=exc,
            )
