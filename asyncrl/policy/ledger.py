"""Which prompts of each epoch were trained, and which were dropped and why (pure, no I/O).

The prompt stream names every prompt by its position ``i`` (:class:`~asyncrl.data.prompts.
PromptStream`): epoch ``i // prompts_per_epoch``, in a seeded order. The ledger records each
position once, as *trained* or as *dropped* (``evicted``, ``aborted``, ``failed``, ``unused``,
``zero_variance``: dynamic sampling),
in sorted runs of positions, so a run of a million prompts costs a few integers per epoch. It
is saved in every checkpoint; a resumed run carries it on, and :meth:`PromptLedger.report`
shows, per epoch, that no prompt was lost (every position below the stream's frontier is
accounted for or still live) and none was trained twice.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EpochReport", "PromptLedger", "Runs"]

DROP_REASONS = ("evicted", "aborted", "failed", "unused", "zero_variance")


class Runs:
    """A set of non-negative integers as sorted, disjoint, non-adjacent ``[start, end)`` runs."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, i: int) -> bool:
        k = bisect.bisect_right(self._starts, i) - 1
        return k >= 0 and i < self._ends[k]

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def add(self, i: int) -> bool:
        """Add ``i``; ``False`` if it was already there."""
        k = bisect.bisect_right(self._starts, i) - 1
        if k >= 0 and i < self._ends[k]:
            return False
        joins_left = k >= 0 and self._ends[k] == i
        joins_right = k + 1 < len(self._starts) and self._starts[k + 1] == i + 1
        if joins_left and joins_right:
            self._ends[k] = self._ends[k + 1]
            del self._starts[k + 1], self._ends[k + 1]
        elif joins_left:
            self._ends[k] = i + 1
        elif joins_right:
            self._starts[k + 1] = i
        else:
            self._starts.insert(k + 1, i)
            self._ends.insert(k + 1, i + 1)
        return True

    def count_in(self, lo: int, hi: int) -> int:
        """How many members lie in ``[lo, hi)``."""
        return sum(max(0, min(e, hi) - max(s, lo)) for s, e in zip(self._starts, self._ends))

    def runs(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends)]

    @classmethod
    def of_runs(cls, runs: Iterable[Iterable[int]]) -> Runs:
        out = cls()
        for start, end in sorted((int(a), int(b)) for a, b in runs):
            if start >= end or (out._ends and start <= out._ends[-1]):
                raise ValueError(f"runs must be sorted, disjoint and non-empty: [{start}, {end})")
            out._starts.append(start)
            out._ends.append(end)
        return out


@dataclass
class EpochReport:
    """One epoch of the prompt stream as the ledger saw it."""

    epoch: int
    prompts: int
    """Positions in the epoch (``prompts_per_epoch``)."""
    trained: int
    dropped: dict[str, int] = field(default_factory=dict)
    live: int = 0
    """Dispatched and not yet trained or dropped (generating, ready, or to be dispatched again
    after a resume)."""
    lost: int = 0
    """Positions below the stream's frontier that are neither trained, dropped nor live: a
    prompt the run lost (must be 0)."""
    repeated: int = 0
    """Positions recorded twice (must be 0)."""


class PromptLedger:
    """Trained and dropped positions of the prompt stream, by epoch."""

    def __init__(self, prompts_per_epoch: int) -> None:
        if prompts_per_epoch < 1:
            raise ValueError(f"prompts_per_epoch must be >= 1, got {prompts_per_epoch}")
        self.prompts_per_epoch = prompts_per_epoch
        self._trained = Runs()
        self._dropped = {reason: Runs() for reason in DROP_REASONS}
        self.repeated: list[int] = []
        """Positions recorded a second time (the first 100), for the report."""
        self.num_repeated = 0

    def record_trained(self, indices: Iterable[int]) -> None:
        for i in indices:
            self._record(i, self._trained)

    def record_dropped(self, indices: Iterable[int], reason: str) -> None:
        if reason not in self._dropped:
            raise ValueError(f"unknown drop reason {reason!r}; one of {DROP_REASONS}")
        for i in indices:
            self._record(i, self._dropped[reason])

    def _record(self, i: int, into: Runs) -> None:
        if i < 0:
            raise ValueError(f"prompt position {i} is negative")
        seen = i in self._trained or any(i in r for r in self._dropped.values())
        if seen or not into.add(i):
            self.num_repeated += 1
            if len(self.repeated) < 100:
                self.repeated.append(i)

    @property
    def num_trained(self) -> int:
        return len(self._trained)

    def num_dropped(self, reason: str) -> int:
        return len(self._dropped[reason])

    def report(self, frontier: int, live: Iterable[int] = ()) -> list[EpochReport]:
        """Per epoch up to the one holding position ``frontier - 1`` (the stream's next fresh
        position is ``frontier``; ``live`` are the positions still in play)."""
        live_set = Runs()
        for i in live:
            live_set.add(i)
        per = self.prompts_per_epoch
        repeats = Counter(i // per for i in self.repeated)
        out = []
        for epoch in range((frontier + per - 1) // per):
            lo, hi = epoch * per, min((epoch + 1) * per, frontier)
            trained = self._trained.count_in(lo, hi)
            dropped = {r: n for r, runs in self._dropped.items() if (n := runs.count_in(lo, hi))}
            in_play = live_set.count_in(lo, hi)
            out.append(
                EpochReport(
                    epoch=epoch,
                    prompts=per,
                    trained=trained,
                    dropped=dropped,
                    live=in_play,
                    lost=(hi - lo) - trained - sum(dropped.values()) - in_play,
                    repeated=repeats[epoch],
                )
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts_per_epoch": self.prompts_per_epoch,
            "trained": self._trained.runs(),
            "dropped": {r: runs.runs() for r, runs in self._dropped.items()},
            "repeated": list(self.repeated),
            "num_repeated": self.num_repeated,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PromptLedger:
        ledger = cls(int(state["prompts_per_epoch"]))
        ledger._trained = Runs.of_runs(state["trained"])
        for reason, runs in state["dropped"].items():
            if reason not in ledger._dropped:
                raise ValueError(f"unknown drop reason {reason!r} in a saved ledger")
            ledger._dropped[reason] = Runs.of_runs(runs)
        ledger.repeated = [int(i) for i in state["repeated"]]
        ledger.num_repeated = int(state["num_repeated"])
        return ledger
