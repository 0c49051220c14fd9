"""The engine's death: seen once, by the watch on its processes; known to every call into it.

vLLM's front end notices a dead engine core only on its next request, and some calls into a
dead engine never return (``pause_generation``, a ``collective_rpc`` into a killed worker).
:class:`EngineDeath` owns the verdict: :meth:`~EngineDeath.watch` declares it the moment one
of the engine's processes exits (the backend also declares it when vLLM's own errors say the
engine is gone first), and :meth:`~EngineDeath.race` ends a call into the engine's workers
(the backend's ``_bounded`` calls: pause, resume, loads, aborts) with
:class:`~asyncrl.errors.EngineDeadError` then, also one made in a shielded scope (a refit's
abort after the watch cancelled the worker), which would otherwise hold the worker until
``rpc_timeout_s`` while its heartbeat goes unanswered. Generation and scoring requests need
no race: vLLM's front end fails them itself when the engine dies.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from asyncrl.errors import EngineDeadError
from asyncrl.procs.process import exit_code_after_exit, process_name, wait_pid_exit

__all__ = ["EngineDeath", "Probe"]

T = TypeVar("T")

UNNAMED = "a process is gone (the engine watch has not named it)"
"""The reason when vLLM's front end saw the death before the watch could name the process."""


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
        answers it); declare the first one that exits (its name, and its exit code when it can
        be read), or the hang, and raise :meth:`error`.

        Raises:
            EngineDeadError: a process exited, the engine left a probe unanswered for
                ``probe.timeout_s``, or ``pids`` is empty.

        Cancellation: stops watching.
        """
        if not pids:
            self.declare("missing: none was running when the watch began (was it started?)")
            raise self.error()
        names = {pid: process_name(pid) for pid in pids}
        # the engine core is our multiprocessing child: vLLM's monitor may reap it before we
        # read its status from /proc, but its Process object keeps the exit code
        children = {p.pid: p for p in multiprocessing.active_children() if p.pid in names}

        async def one(pid: int, scope: anyio.CancelScope) -> None:
            await wait_pid_exit(pid)
            code = await exit_code_after_exit(pid, children.get(pid))
            how = "unknown" if code is None else str(code)
            self.declare(f"{names[pid]} (pid {pid}) exited with code {how}")
            scope.cancel()

        async with anyio.create_task_group() as tg:
            for pid in pids:
                tg.start_soon(one, pid, tg.cancel_scope)
            if probe is not None:
                core = next((p for p in pids if p in children), pids[0])
                tg.start_soon(self._probe, probe, f"{names[core]} (pid {core})", tg.cancel_scope)
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
