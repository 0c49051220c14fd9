"""When a worker takes its controller for gone although nothing says it died: the rule, pure.

A controller that exits is seen at once where its pid can be watched (the same host:
:meth:`~asyncrl.worker.base.WorkerRuntime.run`). One that lives on without serving is not:
stopped (SIGSTOP, a debugger), its event loop blocked, or on another host that went away
or was cut off. What the worker can see is the controller's silence: the heartbeat probes
every worker with ``Health`` every ``failures.heartbeat_interval_s``
(:mod:`asyncrl.run.heartbeat`), so a worker that heard nothing for
``failures.heartbeat_timeout_s`` beyond the probe it was due (``interval + timeout``)
takes the controller for gone, on one host as across hosts::

    serve_calls: any message ──► heard(now)      (a Health probe also arms the short limit)
    watch, every tick_s:   tick(now) ─┬─ late by more than a tick: its own loop did not run;
                                      │    the silence moves on by the time lost
                                      └─ silent > limit ──► ControllerLostError

**Silence the worker slept through proves nothing.** When every process of the run is
suspended at once (SIGSTOP to a job, as Slurm's suspend does; a paused VM), the worker
wakes to a long silence that its controller, suspended too, could not break. So the watch
measures its own ticks: one that comes more than a tick late means this worker's loop was
not running for that time (stopped with the rest, or blocked), and that time does not
count, as the controller's heartbeat forgives its own late ticks
(:class:`~asyncrl.run.heartbeat.HeartbeatTracker`). The resumed controller then has the
whole limit to be heard again. A tick merely late under load (by less than a tick) is not
forgiven, and every tick adds at least a tick of silence, so a worker whose loop is often
late still names a silent controller, later. CLOCK_MONOTONIC (``time.monotonic``) stands
still while the machine sleeps (a system suspend: no silence at all) but runs while a
process is stopped: that is the gap the ticks see.

**Before the heartbeat reaches the worker.** The controller starts probing once every
worker is ready, up to ``cluster.startup_timeout_s`` after it started them: a worker ready
early may hear nothing until then. Until its first ``Health`` probe the limit is longer by
that much.
"""

from __future__ import annotations

__all__ = ["ControllerSilence"]


class ControllerSilence:
    """How long the controller has been silent, as one worker hears it. Pure: no I/O, the
    times (monotonic seconds) are handed in.

    Args:
        interval_s: the controller's probe interval (``failures.heartbeat_interval_s``).
        timeout_s: the silence past the due probe that makes it gone
            (``failures.heartbeat_timeout_s``).
        startup_s: how much longer the limit is until the first probe came
            (``cluster.startup_timeout_s``).
        tick_s: the watch's own period: how often :meth:`tick` is called.
        now: when the watch starts (the worker serves from then on).

    Raises:
        ValueError: unless ``0 < interval_s < timeout_s``, ``tick_s > 0`` and
            ``startup_s >= 0``.
    """

    def __init__(
        self, *, interval_s: float, timeout_s: float, startup_s: float, tick_s: float, now: float
    ) -> None:
        if not (0 < interval_s < timeout_s and tick_s > 0 and startup_s >= 0):
            raise ValueError(
                f"controller watch: need 0 < interval_s ({interval_s}) < timeout_s "
                f"({timeout_s}), tick_s ({tick_s}) > 0 and startup_s ({startup_s}) >= 0"
            )
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.tick_s = tick_s
        self.probed = False
        """Whether a ``Health`` probe came: the heartbeat reached this worker."""
        self.slept_s = 0.0
        """Time this worker's own loop was found not running, forgiven, in all."""
        self.slept_in_silence_s = 0.0
        """The part of :attr:`slept_s` since the controller was last heard (for the message)."""
        self._heard = now
        self._last_tick = now

    @property
    def limit_s(self) -> float:
        """The silence that makes the controller gone, now."""
        limit = self.interval_s + self.timeout_s
        return limit if self.probed else limit + self.startup_s

    def heard(self, now: float, *, probe: bool = False) -> None:
        """A message from the controller came at ``now`` (``probe``: a ``Health`` probe)."""
        if now > self._heard:
            self._heard = now
            self.slept_in_silence_s = 0.0
        self.probed = self.probed or probe

    def tick(self, now: float) -> float | None:
        """The watch's tick at ``now``: the silence (seconds, the time this worker's loop did
        not run taken out) when it is past :attr:`limit_s`, else ``None``."""
        late = now - self._last_tick - self.tick_s
        if late > self.tick_s:  # this loop did not run: what it missed proves nothing
            self.slept_s += late
            # a message heard since the last tick later than a tick counts as late came
            # after this loop woke up (before, the loop would have ticked on time): the
            # silence since it is all awake. One heard earlier may precede the sleep:
            # forgiven, as a late tick is (the watch names later, never sooner)
            if self._heard <= self._last_tick + 2 * self.tick_s:
                self._heard = min(self._heard + late, now)
                self.slept_in_silence_s += late
        self._last_tick = max(self._last_tick, now)
        silent = now - self._heard
        return silent if silent > self.limit_s else None
