"""Whether the engine may take requests now, while it takes turns with a trainer on one GPU
(``cluster.placement = "take_turns"``; docs/one-gpu.md). No engine calls here: the backend
makes them, and tells an :class:`EngineTurn` what happened.

::

    awake ──close()──► closing ──slept()──► asleep ──weights_back()──► weights ──woke()──► awake
      ▲   (new requests wait; the backend     (GPU memory      (the refit loads the new
      │    stops those inside and waits for    released)        weights into it, then the
      │    drained())                                           KV cache comes back)
      └──────────────────────── reopen() (a sleep that failed) ◄─ closing

Every request to the engine runs inside :meth:`EngineTurn.request`: it waits there while the
engine is not awake, so a request that arrives during a transition is held, never sent to an
engine that is falling asleep or has no weights, and never dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Literal

import anyio

__all__ = ["EngineTurn", "TurnState"]

TurnState = Literal["awake", "closing", "asleep", "weights"]


class EngineTurn:
    """The engine's turn: its state, the requests inside it, and who waits for what."""

    def __init__(self) -> None:
        self._state: TurnState = "awake"
        self._open = anyio.Event()
        self._open.set()
        self._inside = 0
        self._empty = anyio.Event()
        self._empty.set()
        self.waiting = 0
        """Requests held at the door now (they go in at the wake)."""
        self.weights_valid = True
        """Whether the engine's weights can serve: false from a sleep that released them until
        a refit loaded new ones into the woken memory (:meth:`loaded`)."""

    @property
    def state(self) -> TurnState:
        return self._state

    @property
    def inside(self) -> int:
        """Requests in the engine now."""
        return self._inside

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Hold a request until the engine is awake, then count it in the engine while the
        caller runs it. Cancellation: a held request leaves the queue at once."""
        while self._state != "awake":
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1
        self._inside += 1
        if self._inside == 1:
            self._empty = anyio.Event()
        try:
            yield
        finally:
            self._inside -= 1
            if self._inside == 0:
                self._empty.set()

    def close(self) -> None:
        """A sleep begins: new requests wait. The backend then stops the requests inside (they
        come back out and wait for the wake) and waits for :meth:`drained`."""
        if self._state != "awake":
            raise RuntimeError(f"sleep while the engine is {self._state}")
        self._state = "closing"
        self._open = anyio.Event()

    async def drained(self) -> None:
        """Return once no request is in the engine."""
        await self._empty.wait()

    def slept(self, *, weights_kept: bool) -> None:
        """The engine released its memory; ``weights_kept``: its weights come back as they were
        (saved in host memory), else only a refit can give it weights again."""
        self._expect("closing", "slept")
        self._state = "asleep"
        self.weights_valid = weights_kept

    def reopen(self) -> None:
        """The sleep failed before the engine released anything: serve again as before."""
        self._expect("closing", "reopen")
        self._state = "awake"
        self._open.set()

    def weights_back(self) -> None:
        """The weights' memory is back (a refit loads into it next)."""
        self._expect("asleep", "weights_back")
        self._state = "weights"

    def loaded(self) -> None:
        """A refit loaded a whole version into the woken weights."""
        self.weights_valid = True

    def woke(self) -> None:
        """The KV cache is back and the weights serve: the held requests go in.

        Raises:
            RuntimeError: the weights were released and no refit loaded new ones.
        """
        self._expect("weights", "woke")
        if not self.weights_valid:
            raise RuntimeError("the engine woke without weights (no refit loaded them)")
        self._state = "awake"
        self._open.set()

    def _expect(self, state: TurnState, what: str) -> None:
        if self._state != state:
            raise RuntimeError(f"{what}() while the engine is {self._state} (expected {state})")
