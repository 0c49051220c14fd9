"""The heartbeat: a worker that stops answering without dying is named and killed.

A worker's death is seen at once (its pidfd, :mod:`asyncrl.procs.spawn`); a worker that lives
on without serving (SIGSTOP, a deadlocked engine, an event loop blocked in a native call)
is not: every call to it would wait for its own timeout, and the run would stall. So the
controller probes every worker with ``Health`` on an interval; the worker's event loop
answers it at once, whatever call it is serving (:mod:`asyncrl.worker`). One that
answers nothing for ``failures.heartbeat_timeout_s`` is hung: it is logged (``worker_hung``:
group, rank, pid, seconds silent, last answer, log file) and killed with SIGKILL (which also
ends a stopped process), and its death takes the path every death takes: its pidfd fires,
the controller's watcher asks :meth:`Heartbeat.named` what it was, and the retry policy
restarts a rollout worker (its groups go elsewhere) or stops the run, naming the hang
(:class:`~asyncrl.errors.WorkerHungError`), not a bare "exit code -9"::

    every heartbeat_interval_s (one task in the controller's task group)
      sync(serving workers) ── a new process: its clock starts; gone (restarting): dropped
      tick(now) ─┬─ probe: Health to each worker with no probe in flight (a task each,
                 │          bounded by heartbeat_timeout_s) ── answer → answered()
                 └─ hung: silent ≥ heartbeat_timeout_s → worker_hung, SIGKILL (pidfd)
    its watcher: pidfd fires → WorkerDiedError → named() → WorkerHungError → retry policy

:class:`HeartbeatTracker` is the pure part (who answered when, who is overdue), driven by
the clock it is given; :class:`Heartbeat` does the I/O around it.

The probes run the other way too: they are how every worker knows its controller still
serves. A worker that hears nothing for ``heartbeat_interval_s + heartbeat_timeout_s`` (the
time its own loop did not run taken out) takes the controller for gone and stops
(:mod:`asyncrl.worker.controller_watch`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

from asyncrl.config import FailuresConfig
from asyncrl.errors import (
    RemoteCallError,
    WorkerDiedError,
    WorkerError,
    WorkerHungError,
    WorkerLostError,
)
from asyncrl.wire.messages import Health
from asyncrl.wire.rpc import ControlPlane, Peer

__all__ = ["Heartbeat", "HeartbeatTracker", "Hung", "Watched"]

log = structlog.get_logger("asyncrl.run.heartbeat")


@dataclass(frozen=True)
class Watched:
    """A worker process the heartbeat probes, and what names it when it hangs."""

    worker: str
    group: str
    rank: int
    pid: int
    log_path: str
    host: str = ""
    """Its host name when it is on another host than the controller (``""``: this one)."""


@dataclass(frozen=True)
class Hung:
    """A worker found hung: silent for ``silent_s`` (from its last answer, or from when it
    was first watched when ``answered`` is false), at least the tracker's timeout."""

    who: Watched
    silent_s: float
    answered: bool
    timeout_s: float

    def reason(self) -> str:
        """One line for the log: how long it has been silent, against which setting."""
        since = "its last answer" if self.answered else "it was ready (it never answered)"
        return (
            f"no answer to a health probe for {self.silent_s:.1f} s since {since} "
            f"(failures.heartbeat_timeout_s = {self.timeout_s:g} s)"
        )


@dataclass
class _Clock:
    who: Watched
    heard: float
    """When it last answered, or when it was first watched."""
    answered: bool = False
    probing: bool = False
    hung: bool = False


class HeartbeatTracker:
    """Who answered when, and who is overdue. Pure: no I/O, times are handed in.

    Every worker is keyed by its name and watched as one process: a new pid under the same
    name (a restarted worker) starts a fresh clock. A worker is hung once ``timeout_s`` pass
    without an answer; it is reported once and never probed again.

    Silence the controller could not hear is not held against a worker: when ticks come
    more than an interval late (the controller's own event loop was blocked, the machine
    suspended), every clock moves on by the time lost, since answers that arrived meanwhile
    were not read.

    Args:
        interval_s: the time between ticks (``failures.heartbeat_interval_s``).
        timeout_s: the silence that makes a worker hung (``failures.heartbeat_timeout_s``).

    Raises:
        ValueError: unless ``0 < interval_s < timeout_s``.
    """

    def __init__(self, *, interval_s: float, timeout_s: float) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError(
                f"heartbeat: need 0 < interval_s ({interval_s}) < timeout_s ({timeout_s})"
            )
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clocks: dict[str, _Clock] = {}
        self._last_tick: float | None = None

    def sync(self, workers: Iterable[Watched], now: float) -> tuple[list[Watched], list[Watched]]:
        """Watch exactly ``workers`` from now on: returns those newly watched (a new name,
        or a new process under a known one) and those dropped (gone, or replaced)."""
        fresh, dropped = [], []
        current = {w.worker: w for w in workers}
        for name, clock in list(self._clocks.items()):
            if current.get(name) != clock.who:
                dropped.append(clock.who)
                del self._clocks[name]
        for name, who in current.items():
            if name not in self._clocks:
                self._clocks[name] = _Clock(who, heard=now)
                fresh.append(who)
        return fresh, dropped

    def tick(self, now: float) -> tuple[list[Watched], list[Hung]]:
        """One beat: the workers to probe now (each marked as probed until
        :meth:`answered` or :meth:`unanswered`), and those found hung at ``now`` (each
        reported once)."""
        if self._last_tick is not None:
            lost = now - self._last_tick - self.interval_s
            if lost > self.interval_s:  # the controller was not listening
                for clock in self._clocks.values():
                    clock.heard = min(clock.heard + lost, now)
        self._last_tick = now
        probe, hung = [], []
        for clock in self._clocks.values():
            if clock.hung:
                continue
            silent = now - clock.heard
            if silent >= self.timeout_s:
                clock.hung = True
                hung.append(Hung(clock.who, silent, clock.answered, self.timeout_s))
            elif not clock.probing:
                clock.probing = True
                probe.append(clock.who)
        return probe, hung

    def answered(self, who: Watched, now: float) -> None:
        """``who`` answered a probe at ``now`` (ignored once it was replaced or found hung)."""
        clock = self._clocks.get(who.worker)
        if clock is not None and clock.who == who and not clock.hung:
            clock.heard = max(clock.heard, now)
            clock.answered = True
            clock.probing = False

    def unanswered(self, who: Watched) -> None:
        """A probe of ``who`` ended without an answer (it failed, or timed out): it may be
        probed again; its clock runs on."""
        clock = self._clocks.get(who.worker)
        if clock is not None and clock.who == who:
            clock.probing = False

    def silent_s(self, worker: str, now: float) -> float | None:
        """Seconds since ``worker`` was last heard of (``None``: not watched)."""
        clock = self._clocks.get(worker)
        return None if clock is None else now - clock.heard


class Heartbeat:
    """The controller's heartbeat task and what it learnt: which processes it killed as hung.

    Args:
        failures: the run's ``[failures]`` (``heartbeat_timeout_s``, a timeout of 0 turns
            the heartbeat off; the probe interval derived from it, ``heartbeat_interval_s``).
        clock: monotonic seconds (a test's fake clock).
    """

    def __init__(
        self, failures: FailuresConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = failures.heartbeat_interval_s
        self.timeout_s = failures.heartbeat_timeout_s
        self._clock = clock
        self._hung: dict[tuple[str, int], tuple[Hung, float]] = {}
        """Processes killed as hung, by (worker, pid): why, and the wall time of the kill."""
        self._lost: dict[tuple[str, int], _Verdict] = {}
        """Remote worker processes, by (worker, pid), found silent past the timeout (not
        killed: another host's), or waited for."""

    async def lost(self, peer: Peer) -> WorkerLostError:
        """Wait until ``peer``'s process, on another host, is found silent for
        ``heartbeat_timeout_s`` (never while the heartbeat is off); what names it. A new
        process of the same worker (restarted there) is another verdict."""
        verdict = self._lost.setdefault((peer.identity, peer.pid), _Verdict())
        await verdict.found.wait()
        assert verdict.error is not None
        return verdict.error

    async def run(self, control: ControlPlane) -> None:
        """Probe every worker of ``control`` on the interval and kill the hung ones, until
        cancelled (at once returns when the heartbeat is off). The controller's own process
        (rank 0 of a launch, serving trainer rank 0) is not probed: it cannot hang without
        this task hanging too.

        Cancellation: the probes in flight are abandoned (their late answers are dropped);
        the pidfds it holds are closed.
        """
        if not self.timeout_s:
            return
        tracker = HeartbeatTracker(interval_s=self.interval_s, timeout_s=self.timeout_s)
        pidfds: dict[Watched, int] = {}
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    self._beat(control, tracker, pidfds, tg)
                    await anyio.sleep(self.interval_s)
        finally:
            for fd in pidfds.values():
                _close(fd)

    def _beat(
        self, control: ControlPlane, tracker: HeartbeatTracker, pidfds: dict[Watched, int],
        tg: anyio.abc.TaskGroup,
    ) -> None:
        """One tick: watch the serving workers (a pidfd each), kill the hung, probe the rest."""
        now = self._clock()
        fresh, dropped = tracker.sync(self._watched(control), now)
        for who in dropped:
            _close(pidfds.pop(who, None))
        for who in fresh:
            pidfds[who] = -1 if who.host else _pidfd(who.pid)  # a remote pid names nothing here
        probe, hung = tracker.tick(now)
        for found in hung:
            self._kill(found, pidfds.get(found.who, -1))
        for who in probe:
            tg.start_soon(self._probe, control, tracker, who, name=f"health-{who.worker}")

    def named(self, peer: Peer, died: WorkerDiedError) -> WorkerDiedError:
        """What ``peer``'s death was: a :class:`WorkerHungError` naming the hang (with
        ``died``'s further lines, e.g. a spent restart budget) when this heartbeat killed
        that process as hung, else ``died`` itself."""
        found = self._hung.get((peer.identity, peer.pid))
        if found is None or isinstance(died, WorkerHungError):
            return died
        hung, killed_at = found
        return WorkerHungError(
            peer.group, peer.rank, peer.log_path or None, pid=peer.pid,
            silent_s=hung.silent_s,
            last_answer=killed_at - hung.silent_s if hung.answered else None,
            timeout_s=hung.timeout_s, exit_code=died.exit_code,
            detail=str(died).partition("\n")[2],
        )  # fmt: skip

    def _watched(self, control: ControlPlane) -> list[Watched]:
        own = os.getpid()
        return [
            Watched(p.identity, p.group, p.rank, p.pid, p.log_path, p.host_name)
            for p in control.serving()
            if p.remote or p.pid != own
        ]

    async def _probe(
        self, control: ControlPlane, tracker: HeartbeatTracker, who: Watched
    ) -> None:
        try:
            await control.call(who.worker, Health(), timeout_s=self.timeout_s)
        except (WorkerError, RemoteCallError):
            tracker.unanswered(who)  # dead, restarting, or silent: its clock runs on
            return
        tracker.answered(who, self._clock())

    def _kill(self, hung: Hung, pidfd: int) -> None:
        """SIGKILL ``hung``'s process through the pidfd opened while it served (never
        another process that took its pid since), and log it. A worker on another host is
        declared lost instead (:meth:`lost`)."""
        who, now = hung.who, time.time()
        if who.host:
            self._declare_lost(hung, now)
            return
        try:
            if pidfd < 0:
                raise ProcessLookupError  # gone before it was first watched
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            self._hung[(who.worker, who.pid)] = (hung, now)
            action = "killed (SIGKILL)"
        except ProcessLookupError:
            action = "none: it exited meanwhile"  # its watcher reports that death as it was
        last = time.strftime("%H:%M:%S", time.localtime(now - hung.silent_s))
        log.error(
            "worker_hung", worker=who.worker, group=who.group, rank=who.rank, pid=who.pid,
            silent_s=round(hung.silent_s, 2), last_answer=last if hung.answered else None,
            timeout_s=hung.timeout_s, log=who.log_path, action=action, reason=hung.reason(),
        )  # fmt: skip

    def _declare_lost(self, hung: Hung, now: float) -> None:
        who = hung.who
        lost = WorkerLostError(
            who.group, who.rank, who.log_path or None, host=who.host, pid=who.pid,
            silent_s=hung.silent_s, timeout_s=hung.timeout_s,
            last_answer=now - hung.silent_s if hung.answered else None,
        )  # fmt: skip
        verdict = self._lost.setdefault((who.worker, who.pid), _Verdict())
        verdict.error = lost
        verdict.found.set()
        log.error("worker_lost", worker=who.worker, host=who.host, pid=who.pid,
                  silent_s=round(hung.silent_s, 2), timeout_s=hung.timeout_s, log=who.log_path)  # fmt: skip


class _Verdict:
    """Whether a remote worker's process was found lost, and the error that names it."""

    def __init__(self) -> None:
        self.found = anyio.Event()
        self.error: WorkerLostError | None = None


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid`` (``-1``: already gone)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1


def _close(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)
