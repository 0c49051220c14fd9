"""Deadlines on reward calls (``failures.reward_timeout_s``): user code that may never return.

A coroutine past its deadline is cancelled. A thread cannot be stopped, so a sync call past
its deadline is *abandoned*: its awaiter moves on, and the thread runs on until the call
returns, if ever. Such calls run on this module's daemon threads, never on anyio's worker
threads, which are not daemons: the interpreter joins those at exit, so one call stuck there
would hang the process's exit forever. Abandoned threads still running are counted; past
:data:`MAX_ABANDONED_THREADS` no new call starts (:class:`AbandonedThreadsError`), so a reward
that hangs on every group cannot pile up threads without bound.

::

    clock = CallClock()               # what the bounded call is doing, and since when
    value = await in_thread(fn, x, limiter=lim, clock=clock, timeout_s=60.0)
    # fn may call clock.restart(i) before each of several calls: each gets its own deadline
    # Overdue(clock's call, what was running) once the call in progress is late

Code inside a bounded call says what it is running with ``with running("reward 'x' (m:x)")``
(a no-op outside one), so a timeout names the reward function, not just ``score()``.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from asyncrl.errors import RunError

__all__ = [
    "MAX_ABANDONED_THREADS",
    "AbandonedThreadsError",
    "CallClock",
    "Overdue",
    "abandoned_threads",
    "clocked",
    "in_thread",
    "running",
]

MAX_ABANDONED_THREADS = 16
"""Abandoned reward threads that may still be running (stuck) at once; one more call in a
thread is refused. Each may hold a socket, a lock or memory; 16 is far more than a healthy run
ever abandons (the failure budget, ``failures.max_failed_groups``, is 16 by default)."""

IDLE_EXIT_S = 10.0
"""A pool thread with no call for this long exits (anyio's worker threads do the same)."""

T = TypeVar("T")


class AbandonedThreadsError(RunError):
    """Too many reward calls abandoned past their deadline are still running in their threads
    (:data:`MAX_ABANDONED_THREADS`): the run stops rather than start more."""


class Overdue(Exception):
    """A bounded call passed its deadline (caught by the scorer, which names the call)."""

    def __init__(self, call: int, running: tuple[str, ...], timeout_s: float) -> None:
        super().__init__(f"call {call} did not return within {timeout_s:g} s")
        self.call = call
        """The clock's call index at the time (e.g. which sample of a group)."""
        self.running = running
        """What the call said it was running (see :func:`running`)."""
        self.timeout_s = timeout_s


class CallClock:
    """What a bounded call is doing: which of its calls is in progress, since when, and what
    runs inside it. Written by the code under the deadline (on its thread or in its tasks),
    read by the awaiter; plain attribute writes and list appends are atomic under the GIL."""

    def __init__(self) -> None:
        self.call = 0
        self.started = time.monotonic()
        self.running: list[str] = []

    def restart(self, call: int) -> None:
        """Call ``call`` begins: its deadline counts from now."""
        self.call = call
        self.started = time.monotonic()

    def left_s(self, timeout_s: float) -> float:
        """Seconds before the call in progress is late (<= 0: it is)."""
        return self.started + timeout_s - time.monotonic()

    def overdue(self, timeout_s: float) -> Overdue:
        return Overdue(self.call, tuple(self.running), timeout_s)


_CLOCK: contextvars.ContextVar[CallClock | None] = contextvars.ContextVar(
    "asyncrl_call_clock", default=None
)


@contextmanager
def clocked(clock: CallClock) -> Iterator[None]:
    """Make ``clock`` the current call's clock (for :func:`running`) inside the block, in
    this task's context (tasks started inside inherit it)."""
    token = _CLOCK.set(clock)
    try:
        yield
    finally:
        _CLOCK.reset(token)


@contextmanager
def running(what: str) -> Iterator[None]:
    """Name ``what`` as running in the current bounded call while the block runs, for its
    timeout error (and after it, when the block was cancelled). A no-op outside a bounded
    call."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    clock.running.append(what)
    try:
        yield
    except BaseException as exc:
        # A call cancelled at its deadline stays listed (it was running then; the awaiter
        # reads the list after the cancellation); one that raised is over.
        if isinstance(exc, Exception):
            clock.running.remove(what)
        raise
    clock.running.remove(what)


# ---------------------------------------------------------------------- the daemon threads
class _Pool:
    """Daemon threads that take calls from one queue; an idle one exits after
    :data:`IDLE_EXIT_S`. ``_idle`` counts the waiting threads no queued call is meant for
    (puts happen under the lock, so a thread that times out sees whether a call came). The
    queue is bounded by its callers: :func:`in_thread` holds a limiter token while its call is
    queued or runs. (Not ``concurrent.futures``: its threads are joined at exit too.)"""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            self._calls.put(call)
            if self._idle:
                self._idle -= 1
                return
        threading.Thread(target=self._work, name="asyncrl-reward", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._calls.empty():
                        self._idle -= 1
                        return
                continue
            call()
            with self._lock:
                self._idle += 1


_POOL = _Pool()
_LOCK = threading.Lock()
_abandoned = 0
"""Calls abandoned by their awaiter whose thread still runs (under ``_LOCK``)."""


def abandoned_threads() -> int:
    """Calls abandoned past their deadline (or by cancellation) that are still running."""
    return _abandoned


class _Call:
    """One call on a pool thread, and its outcome."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], clock: CallClock) -> None:
        self._context = contextvars.copy_context()
        self._context.run(_CLOCK.set, clock)
        self._fn, self._args = fn, args
        self._token = anyio.lowlevel.current_token()
        self.done = anyio.Event()
        self.finished = False
        self._abandoned = False
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:  # on a pool thread
        global _abandoned
        try:
            self._value = self._context.run(self._fn, *self._args)
        except BaseException as exc:  # re-raised in the awaiter
            self._error = exc
        with _LOCK:
            self.finished = True
            if self._abandoned:
                _abandoned -= 1
                return  # nobody waits
        try:
            anyio.from_thread.run_sync(self.done.set, token=self._token)
        except Exception:  # the loop is gone (its run ended): nobody waits either
            pass

    def abandon(self) -> None:
        global _abandoned
        with _LOCK:
            if not self.finished:
                self._abandoned = True
                _abandoned += 1

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


async def in_thread(
    fn: Callable[..., T],
    *args: Any,
    limiter: anyio.abc.CapacityLimiter | None = None,
    clock: CallClock | None = None,
    timeout_s: float | None = None,
) -> T:
    """``fn(*args)`` on a daemon thread (``clock`` is the current clock there, so
    :func:`running` inside it reports to it), awaited while holding a token of ``limiter``
    (default: anyio's default thread limiter). An environment's ``score_async`` runs its
    blocking parts with it: unlike ``anyio.to_thread.run_sync``, a cancellation (the deadline)
    does not wait for the thread.

    With ``timeout_s``: once the call in progress (``clock.restart`` starts another) has run
    longer, the thread is abandoned and :class:`Overdue` raised. Cancellation: the thread is
    abandoned at once (its token is released; it still counts as abandoned until it
    returns).

    Raises:
        Overdue: the deadline passed.
        AbandonedThreadsError: :data:`MAX_ABANDONED_THREADS` abandoned calls still run.
        BaseException: whatever ``fn`` raised.
    """
    clock = clock if clock is not None else CallClock()
    async with limiter or anyio.to_thread.current_default_thread_limiter():
        if _abandoned >= MAX_ABANDONED_THREADS:
            raise AbandonedThreadsError(
                f"{_abandoned} reward calls abandoned past their deadline "
                "(failures.reward_timeout_s) are still running in their threads, the most "
                f"asyncrl lets pile up ({MAX_ABANDONED_THREADS}). Fix: find why the reward "
                "hangs (the reward_failed log lines name it and the prompt); make it return, "
                "e.g. give its network calls a timeout"
            )
        call = _Call(fn, args, clock)
        clock.restart(0)
        _POOL.submit(call.run)
        try:
            while not call.finished:
                if timeout_s is None:
                    await call.done.wait()
                    continue
                left = clock.left_s(timeout_s)
                if left <= 0:
                    raise clock.overdue(timeout_s)
                with anyio.move_on_after(left):
                    await call.done.wait()
        finally:
            call.abandon()  # a no-op once it finished
    return call.result()
