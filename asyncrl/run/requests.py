"""The engine requests in flight: the one unit of rollout work (pure; no I/O).

Everything the controller asks of a rollout worker's engine is a :class:`Request` of ``n``
samples of one prompt, and every sample that comes back is looked up here first:

- a single-turn group's request (``answered=False``, its id the group's, ``n`` samples): the
  group's ``n`` one-turn episodes, sent as one request so that the engine shares their
  prompt's prefix; each sample fills its episode's slot in the group;
- an *answered* request (``answered=True``, ``n = 1``): one turn of a multi-turn episode, or one
  prompt of an evaluation; its sample goes back to the coroutine that asked
  (:mod:`asyncrl.run.asking`), which goes on from there. Its id is ``<group>/<episode>#<k>``
  (``k`` counting the episode's requests, retries included, so a late sample of an earlier
  request is never taken for a later one; ``<group>/<episode>@<d>#<k>`` when the group runs
  again after its ``d``-th failure, while the failed run's abandoned requests may still be in
  flight); an evaluation's is ``eval-<label>-<i>/0#<k>`` and belongs to no scheduler group.

:class:`RequestTable` keeps which requests are in flight on which worker and how many samples
each still owes: a worker's load. The :class:`~asyncrl.run.rollout_phase.RolloutPhase` owns it.

A request ends when its last sample comes back (complete, or cut short by an abort), when its
worker reports it failed, or when its worker is lost. A coroutine that stops waiting for its
answer (it was cancelled) *abandons* the request: it stays until its sample comes back, so the
worker's load stays true, and then it is discarded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Request", "RequestTable", "request_id"]


def request_id(group_id: str, index: int, k: int, dispatch: int = 0) -> str:
    """The id of episode ``index``'s ``k``-th answered request in group ``group_id``,
    dispatched ``dispatch`` times before (its retries: the failed dispatch's abandoned
    requests may still be in flight when the group runs again, and an id must not repeat while
    they are)."""
    return f"{group_id}/{index}#{k}" if not dispatch else f"{group_id}/{index}@{dispatch}#{k}"


@dataclass(slots=True)
class Request:
    """One engine request in flight."""

    request_id: str
    group_id: str
    """The scheduler group it serves; ``""`` for an evaluation's."""
    index: int
    """An answered request's episode, by its index in the group (a group's request: 0)."""
    n: int
    """Samples it asked for."""
    worker: str
    version: int
    """The weight version the generators served when it was sent (its tokens' oldest)."""
    answered: bool
    """Its sample goes back to the coroutine that asked; otherwise it fills the group's slots."""
    to_come: int = 0
    """Samples still owed by the engine."""
    abandoned: bool = False
    """Whoever asked stopped waiting (cancelled): its sample is discarded when it comes."""

    @property
    def evaluation(self) -> bool:
        """An evaluation's request: no scheduler group waits for it."""
        return not self.group_id


class RequestTable:
    """The requests in flight, by id, and the samples each worker still owes."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._owed: Counter[str] = Counter()
        self._by_group: dict[str, dict[str, Request]] = {}
        """The same requests by group id (a refit's aborts and a failure look a group's up)."""

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: str) -> bool:
        return request in self._requests

    def __iter__(self) -> Iterator[Request]:
        """The requests in flight, in the order they were sent."""
        return iter(list(self._requests.values()))

    def get(self, request: str) -> Request | None:
        return self._requests.get(request)

    def owed(self, worker: str) -> int:
        """Samples ``worker`` still owes: its load."""
        return self._owed[worker]

    def start(
        self, request: str, group_id: str, index: int, n: int, worker: str, *, version: int,
        answered: bool,
    ) -> Request:
        """Record a request of ``n`` samples sent to ``worker``.

        Raises:
            ValueError: a request with this id is in flight already.
        """
        if request in self._requests:
            raise ValueError(f"request {request!r} is in flight already")
        entry = Request(request, group_id, index, n, worker, version, answered, to_come=n)
        self._requests[request] = entry
        self._by_group.setdefault(group_id, {})[request] = entry
        self._owed[worker] += n
        return entry

    def received(self, entry: Request) -> None:
        """One sample of ``entry`` came back; after its last, the request is gone."""
        entry.to_come -= 1
        self._owed[entry.worker] -= 1
        if entry.to_come == 0:
            self._forget(entry)

    def end(self, request: str) -> Request:
        """Its worker said it failed, or its answer came back: it is gone, with whatever it
        still owed.

        Raises:
            KeyError: no such request in flight.
        """
        entry = self._requests[request]
        self._forget(entry)
        self._owed[entry.worker] -= entry.to_come
        entry.to_come = 0
        return entry

    def abandon(self, request: str) -> bool:
        """Whoever asked stopped waiting. False when the request is not in flight (it ended)
        or was abandoned already (its worker was told to abort it then)."""
        entry = self._requests.get(request)
        if entry is None or entry.abandoned:
            return False
        entry.abandoned = True
        return True

    def lose(self, worker: str) -> list[Request]:
        """``worker`` died: its requests are gone (returned, in the order they were sent)."""
        lost = [r for r in self._requests.values() if r.worker == worker]
        for r in lost:
            self._forget(r)
        self._owed[worker] = 0
        return lost

    def of_group(self, group_id: str) -> list[Request]:
        """The requests in flight of ``group_id`` (its own, or its episodes' turns), in the
        order they were sent."""
        return list(self._by_group.get(group_id, {}).values())

    def problems(self) -> list[str]:
        """Where the table by group is not the table by id (none: ``[]``); for tests."""
        indexed = {rid: e for of_group in self._by_group.values() for rid, e in of_group.items()}
        if indexed != self._requests or not all(self._by_group.values()):
            odd = sorted(indexed.keys() ^ self._requests.keys())[:5]
            return [f"requests {odd} are in one of the tables by id and by group, not both"]
        return []

    def _forget(self, entry: Request) -> None:
        del self._requests[entry.request_id]
        of_group = self._by_group[entry.group_id]
        del of_group[entry.request_id]
        if not of_group:
            del self._by_group[entry.group_id]
