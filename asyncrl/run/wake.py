"""Wake-ups on the controller's loop: the signal the run's loops wait on (a change of the live
groups, a commit), and the pacer that lets the episodes' work through one piece per pass."""

from __future__ import annotations

from collections import deque

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ["Pacer", "Signal"]


class Signal:
    """Wake every waiter on the next :meth:`notify` (an event re-armed after each use; a
    notify with nobody waiting costs nothing, which matters at thousands of samples a
    second)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class Pacer:
    """Lets the tasks that ask through one per pass of the event loop, in the order they
    asked.

    Why: the loop runs every task that is ready when a pass begins before it looks at its
    timers and sockets again. A data batch wakes up to 16 episodes, a dispatched group 16
    more; each then runs its agent up to its next request (a chat-template render, a
    tokenization), about a millisecond. Woken together they hold one pass for all of it, and
    every other task (a reply, a heartbeat, the train loop) waits as long: the loop lag's
    p99 with ~1,000 episodes in flight was 47 ms (benchmarks/episodes.py). Through the pacer
    each pass runs one such piece, so the others wait for at most one. The work is the same;
    each pass costs a poll of the sockets (tens of microseconds).

    While :meth:`run` is not running, :meth:`turn` returns at once.
    """

    def __init__(self) -> None:
        self._queue: deque[anyio.Event] = deque()
        self._asked = Signal()
        self._running = False

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Let one waiter through per pass until cancelled. Cancellation: every waiter is let
        through (their own cancellation is their owners')."""
        self._running = True
        task_status.started()
        try:
            while True:
                while not self._queue:
                    await self._asked.wait()
                self._queue.popleft().set()
                await anyio.lowlevel.checkpoint()
        finally:
            self._running = False
            while self._queue:
                self._queue.popleft().set()

    async def turn(self) -> None:
        """Wait until this task's turn (at once while the pacer does not run).

        Cancellation: leaves the queue."""
        if not self._running:
            return
        event = anyio.Event()
        self._queue.append(event)
        self._asked.notify()
        try:
            await event.wait()
        except BaseException:
            if not event.is_set():
                self._queue.remove(event)
            raise

    def waiting(self) -> int:
        """Tasks waiting for their turn."""
        return len(self._queue)
