"""The engine's death: seen once, by the watch on its processes; known to every call into it.

vLLM's front end notices a dead engine core only on its next request, and some calls into a
dead engine never return (``pause_generation``, a ``collective_rpc`` into a killed worker).
:class:`EngineDeath` owns the verdict: :meth:`~EngineDeath.watch` declares it the moment one
of the engine's processes exits (the backend also declares it when vLLM's own errors say the
engine is gone first), and :meth:`~EngineDeath.race` ends a call into the engine's workers
(the backend's ``_bounded`` calls: pause, resume, loads, aborts) with
:class:`~asyncrl.plugin.backend.EngineDeadError` then, also one made in a shielded scope (a refit's
abort after the watch cancelled the worker), which would otherwise hold the worker until
``rpc_timeout_s`` while its heartbeat goes unanswered. Generation and scoring requests need
no race: vLLM's front end fails them itself when the engine dies.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from asyncrl.plugin.backend import EngineDeadError
from asyncrl.plugin.common import ProcessExit, is_dying, parent_pid, process_name

__all__ = ["EngineDeath", "Probe", "first_death"]

T = TypeVar("T")

UNNAMED = "a process is gone (the engine watch has not named it)"
"""The reason when vLLM's front end saw the death before the watch could name the process."""


def first_death(codes: Mapping[int, int | None], parents: Mapping[int, int | None]) -> int:
    """Of the engine's processes found dead or dying together (``codes``: each one's exit
    status, ``None`` when unknown; the first one seen first), the death the others followed.

    A process that a signal killed (a negative status) comes before one that exited by
    itself (the engine core exits after it saw a worker die); among those, the one highest
    in the engine's process tree (``parents``: each process's parent when the watch began),
    since its children die with it (killed when it is gone), never the other way round; then
    the one seen first.
    """

    def depth(pid: int) -> int:
        d, up = 0, parents.get(pid)
        while up in parents and d < len(parents):  # bounded: parents is no tree if pids reused
            d, up = d + 1, parents.get(up)
        return d

    def rank(pid: int) -> tuple[bool, int]:
        code = codes[pid]
        return (code is None or code >= 0, depth(pid))

    return min(codes, key=rank)  # min keeps the first of equals: the one seen first


@dataclass(frozen=True)
class Probe:
    """A liveness probe of the engine: ``ask`` is a call the engine core answers between two
    engine steps (a utility call), made every ``interval_s``; no answer within ``timeout_s``
    and the engine is hung (stopped, or deadlocked in a step, for example a worker stuck in a
    collective): its processes are alive, so no exit would ever say so."""

    ask: Callable[[], Awaitable[object]]
    interval_s: float
    timeout_s: float
    setting: str
    """The setting ``timeout_s`` comes from, named in the reason."""

    @classmethod
    def heartbeat(cls, llm: Any, failures: Any) -> Probe | None:
        """The engine's probe on the run's heartbeat settings (``failures``; ``None`` when
        the heartbeat is off): ``asyncrl_alive`` on every engine worker, a utility call the
        core relays between two engine steps whatever the scheduler is doing (paused for a
        refit included), so a stopped or deadlocked core or worker leaves it unanswered, also
        while the engine is idle."""
        timeout = failures.heartbeat_timeout_s
        if not timeout:
            return None
        return cls(
            functools.partial(llm.collective_rpc, "asyncrl_alive", timeout=timeout),
            failures.heartbeat_interval_s,
            timeout,
            "failures.heartbeat_timeout_s",
        )


class EngineDeath:
    """Why the engine can no longer serve (``reason``: ``None`` while it can)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._declared: anyio.Event | None = None  # made in the event loop, on first wait

    def declare(self, reason: str) -> None:
        """The engine is dead: ``reason`` names the process and its exit code. The first
        reason stays."""
        if self.reason is None:
            self.reason = reason
        if self._declared is not None:
            self._declared.set()

    async def wait(self) -> None:
        """Return once the engine is declared dead."""
        if self.reason is not None:
            return
        if self._declared is None:
            self._declared = anyio.Event()
        await self._declared.wait()

    def error(self) -> EngineDeadError:
        """The error a call into the dead engine raises (names the process when known)."""
        what = self.reason or UNNAMED
        return EngineDeadError(
            f"vLLM engine process {what}; the engine cannot serve any more "
            "(this worker's log shows the engine's last words)"
        )

    async def race(self, call: Coroutine[Any, Any, T]) -> T:
        """``await call``, unless the engine is declared dead first (or was already): then
        ``call`` is cancelled (or never started) and :meth:`error` raised. Errors of ``call``
        pass as they are.

        Cancellation: ``call`` is cancelled.
        """
        if self.reason is not None:
            call.close()
            raise self.error()
        result: list[T] = []
        failure: list[Exception] = []

        async def run(scope: anyio.CancelScope) -> None:
            try:
                result.append(await call)
            except Exception as exc:  # noqa: BLE001 - raised below, outside the task group
                failure.append(exc)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, tg.cancel_scope)
            await self.wait()
            tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        if result:
            return result[0]
        raise self.error()

    async def watch(self, pids: list[int], probe: Probe | None = None) -> None:
        """Never return while every process in ``pids`` runs (and, with ``probe``, the engine
        answers it); declare the first death (its process's name and exit code: of those that
        exit together, the one the others followed, :func:`first_death`), or the hang, and
        raise :meth:`error`.

        Raises:
            EngineDeadError: a process exited, the engine left a probe unanswered for
                ``probe.timeout_s``, or ``pids`` is empty.

        Cancellation: stops watching.
        """
        if not pids:
            self.declare("missing: none was running when the watch began (was it started?)")
            raise self.error()
        names = {pid: process_name(pid) for pid in pids}
        parents = {pid: parent_pid(pid) for pid in pids}  # read while they live
        # the engine core is our multiprocessing child: vLLM's monitor may reap it before we
        # read its status from /proc, but its Process object keeps the exit code; the others'
        # pidfds, opened now, keep theirs after the core reaps them
        children = {p.pid: p for p in multiprocessing.active_children() if p.pid in names}
        exits = {pid: ProcessExit(pid, children.get(pid)) for pid in pids}
        seen: list[int] = []

        async def one(pid: int, scope: anyio.CancelScope) -> None:
            await exits[pid].wait()
            seen.append(pid)  # no await since the pidfd fired: first seen, first here
            scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                for pid in pids:
                    tg.start_soon(one, pid, tg.cancel_scope)
                if probe is not None:
                    core = next((p for p in pids if p in children), pids[0])
                    tg.start_soon(self._probe, probe, f"{names[core]} (pid {core})",
                                  tg.cancel_scope)  # fmt: skip
            if seen:
                # the deaths one death causes come with it: whatever else is dead or dying now
                together = [seen[0], *(p for p in pids if p != seen[0] and is_dying(p))]
                codes = {p: await exits[p].status() for p in together}
                pid = first_death(codes, parents)
                how = "unknown" if codes[pid] is None else str(codes[pid])
                self.declare(f"{names[pid]} (pid {pid}) exited with code {how}")
        finally:
            for exit_ in exits.values():
                exit_.close()
        raise self.error()

    async def _probe(self, probe: Probe, core: str, scope: anyio.CancelScope) -> None:
        """Ask ``probe`` every interval; declare the hang at the first unanswered one."""
        while True:
            with anyio.move_on_after(probe.timeout_s) as waited:
                await probe.ask()
            if waited.cancelled_caught:
                self.declare(
                    f"{core} answered no liveness probe in {probe.timeout_s:g} s "
                    f"({probe.setting}): it, or an engine worker it waits on, is stopped or "
                    "deadlocked (the processes are alive; they are killed now)"
                )
                scope.cancel()
                return
            await anyio.sleep(probe.interval_s)
