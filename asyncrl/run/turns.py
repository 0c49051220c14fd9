"""The turns of multi-turn episodes in flight: one engine request each (pure; no I/O).

An episode (:mod:`asyncrl.run.episodes`) asks for one turn at a time; each turn is one
request on one rollout worker, with an id of its own (``<group>/<episode>#<k>``, ``k``
counting the episode's requests, retries included, so a late sample of an earlier request is
never taken for a later one; ``<group>/<episode>@<d>#<k>`` when the group runs again after
its ``d``-th failure, while the failed run's abandoned turns may still be in flight).
:class:`TurnTable` keeps which turns are in flight on which worker; the
:class:`~asyncrl.run.book.RolloutBook` owns it, and counts its turns in each worker's load.

A turn ends when its sample comes back (complete, or cut short by an abort), when its worker
reports it failed, or when its worker is lost. An episode that stops waiting for its turn (it
was cancelled) *abandons* it: the turn stays until its sample comes back, so the worker's load
stays true, and then it is discarded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["TurnRequest", "TurnTable", "turn_id"]


def turn_id(group_id: str, index: int, k: int, dispatch: int = 0) -> str:
    """The id of episode ``index``'s ``k``-th request in group ``group_id``, dispatched
    ``dispatch`` times before (its retries: the failed dispatch's abandoned turns may still
    be in flight when the group runs again, and an id must not repeat while they are)."""
    return f"{group_id}/{index}#{k}" if not dispatch else f"{group_id}/{index}@{dispatch}#{k}"


@dataclass(slots=True)
class TurnRequest:
    """One turn request in flight."""

    turn_id: str
    group_id: str
    index: int
    """The episode's index in its group."""
    worker: str
    version: int = 0
    """The weight version the generators served when it was sent (its tokens' oldest)."""
    abandoned: bool = False
    """Its episode stopped waiting (cancelled): its sample is discarded when it comes."""
    evaluation: bool = False
    """A turn of an evaluation episode (no scheduler group: the evaluator waits for it)."""


class TurnTable:
    """The turns in flight, by id, and how many each worker serves."""

    def __init__(self) -> None:
        self._turns: dict[str, TurnRequest] = {}
        self._per_worker: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, turn: str) -> bool:
        return turn in self._turns

    def __iter__(self) -> Iterator[TurnRequest]:
        """The turns in flight, in the order they were sent."""
        return iter(list(self._turns.values()))

    def get(self, turn: str) -> TurnRequest | None:
        return self._turns.get(turn)

    def on(self, worker: str) -> int:
        """Turns in flight on ``worker``."""
        return self._per_worker[worker]

    def start(
        self, turn: str, group_id: str, index: int, worker: str, *, version: int = 0,
        evaluation: bool = False,
    ) -> TurnRequest:
        """Record a turn sent to ``worker``.

        Raises:
            ValueError: a turn with this id is in flight already.
        """
        if turn in self._turns:
            raise ValueError(f"turn {turn!r} is in flight already")
        entry = self._turns[turn] = TurnRequest(turn, group_id, index, worker, version, evaluation=evaluation)
        self._per_worker[worker] += 1
        return entry

    def end(self, turn: str) -> TurnRequest:
        """The turn's sample came back, or its worker said it failed: it is gone.

        Raises:
            KeyError: no such turn in flight.
        """
        entry = self._turns.pop(turn)
        self._per_worker[entry.worker] -= 1
        return entry

    def abandon(self, turn: str) -> bool:
        """Its episode stopped waiting. False when the turn is not in flight (it ended) or was
        abandoned already (its worker was told to abort it then)."""
        entry = self._turns.get(turn)
        if entry is None or entry.abandoned:
            return False
        entry.abandoned = True
        return True

    def lose(self, worker: str) -> list[TurnRequest]:
        """``worker`` died: its turns are gone (returned, in the order they were sent)."""
        lost = [t for t in self._turns.values() if t.worker == worker]
        for t in lost:
            del self._turns[t.turn_id]
        self._per_worker[worker] = 0
        return lost

    def of_group(self, group_id: str) -> list[TurnRequest]:
        """The turns in flight of ``group_id``'s episodes."""
        return [t for t in self._turns.values() if t.group_id == group_id]

    def per_worker(self) -> dict[str, int]:
        """Turns in flight per worker (workers with none left out)."""
        return {w: n for w, n in self._per_worker.items() if n}
