"""The wake-up signal the run's loops wait on (a book change, a commit)."""

from __future__ import annotations

import anyio

__all__ = ["Signal"]


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
