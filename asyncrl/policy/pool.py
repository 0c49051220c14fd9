"""Which rollout workers take work, and the run's budget of restarts: a pure state machine.

::

    SERVING ──lost()──► RESTARTING ──returned()──► SYNCING ──synced()──► SERVING
       ▲                 (its process starts        (its refit to the        │
       │                  again, in place)           current weights)        │
       └─────────────────────────────────────────────────────────────────────┘
    lost() with the budget spent (``failures.rollout_restarts``): False, the run stops

Only SERVING workers get groups, evaluations, refits and probes. A worker lost while
SYNCING restarts again (if the budget allows). This module does no I/O and imports nothing
of the run; its user, the run's restart handling (``Restarts`` in ``asyncrl.run.restarts``),
holds the pool and does the I/O: it has the lost worker's groups dispatched again and the
returned one refitted.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RESTARTING", "SERVING", "SYNCING", "PoolError", "RolloutPool"]

SERVING, RESTARTING, SYNCING = "serving", "restarting", "syncing"


class PoolError(RuntimeError):
    """An event that is impossible in the worker's state (a bug in the caller)."""


class RolloutPool:
    """The rollout workers (``group:rank`` identities, in rank order) and their states."""

    def __init__(self, workers: Sequence[str], max_restarts: int) -> None:
        self.workers = list(workers)
        self.max_restarts = max_restarts
        self.restarts = 0
        """Restarts granted so far in the run (all workers together)."""
        self._state = dict.fromkeys(self.workers, SERVING)

    @property
    def serving(self) -> list[str]:
        """The workers that take work now, in rank order."""
        return [w for w in self.workers if self._state[w] == SERVING]

    def state(self, worker: str) -> str:
        return self._state[worker]

    def lost(self, worker: str) -> bool:
        """``worker`` died. True: it will be started again (its work goes elsewhere until it
        is back); False: the budget is spent and the run must stop."""
        state = self._state[worker]
        if state == RESTARTING:
            raise PoolError(f"{worker} was lost while restarting")
        if self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        self._state[worker] = RESTARTING
        return True

    def returned(self, worker: str) -> None:
        """``worker``'s new process is ready; it needs the current weights."""
        self._expect(worker, RESTARTING, "returned")
        self._state[worker] = SYNCING

    def synced(self, worker: str) -> None:
        """``worker`` serves the current weights: it takes work again."""
        self._expect(worker, SYNCING, "synced")
        self._state[worker] = SERVING

    def _expect(self, worker: str, state: str, event: str) -> None:
        if self._state[worker] != state:
            raise PoolError(f"{worker} {event} while {self._state[worker]}, not {state}")
