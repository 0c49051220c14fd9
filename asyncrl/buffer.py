"""The replay buffer: prompt groups reserved at dispatch, committed by group id.

Pure state (no I/O, no locks, no torch): the controller's event loop is its only writer.

A group's slot is *reserved* when its prompt is dispatched, stamped with the generator's
installed weight version at that moment (``start_version``) and, for samplers that match
batches to steps, a ``target_step``. Slots stay in dispatch order, so start versions never
decrease along the buffer. The slot is *committed* (becomes ready) when every sample of the
group came back with its reward; commits may arrive in any order and find their slot by id.
Groups leave the buffer when the train pump takes them or the sampler evicts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BufferError", "CompletedSample", "Group", "ReplayBuffer"]


class BufferError(RuntimeError):
    """An impossible buffer transition (unknown id, double commit, over capacity)."""


@dataclass(frozen=True)
class CompletedSample:
    token_ids: Any  # int32 array
    logprobs: Any  # float32 array, aligned with token_ids
    finish_reason: str
    reward: float
    correct: bool


@dataclass
class Group:
    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    start_version: int
    target_step: int | None
    dispatched_at: float
    samples: list[CompletedSample] = field(default_factory=list)
    end_version: int | None = None
    committed_at: float | None = None

    @property
    def ready(self) -> bool:
        return self.end_version is not None


class ReplayBuffer:
    """Groups in dispatch order.

    Args:
        capacity: the most groups (reserved + ready) it may hold; exceeding it is a bug in the
            caller's backpressure and raises.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._groups: dict[str, Group] = {}  # insertion order = dispatch order

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(list(self._groups.values()))

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def get(self, group_id: str) -> Group:
        try:
            return self._groups[group_id]
        except KeyError:
            raise BufferError(f"unknown group {group_id!r}") from None

    @property
    def num_ready(self) -> int:
        return sum(1 for g in self._groups.values() if g.ready)

    @property
    def num_reserved(self) -> int:
        return len(self._groups) - self.num_ready

    def reserve(
        self,
        group_id: str,
        *,
        prompt_id: str,
        prompt_ids: list[int],
        start_version: int,
        target_step: int | None,
        now: float,
    ) -> Group:
        """Add an unready slot at the end of the buffer."""
        if group_id in self._groups:
            raise BufferError(f"group {group_id!r} is already in the buffer")
        if len(self._groups) >= self.capacity:
            raise BufferError(f"buffer is full ({self.capacity} groups)")
        if self._groups:
            last = next(reversed(self._groups.values()))
            if start_version < last.start_version:
                raise BufferError(
                    f"start version {start_version} < {last.start_version} of the previous slot"
                )
        group = Group(group_id, prompt_id, list(prompt_ids), start_version, target_step, now)
        self._groups[group_id] = group
        return group

    def commit(
        self, group_id: str, samples: list[CompletedSample], *, end_version: int, now: float
    ) -> Group:
        """Fill a reserved slot and mark it ready."""
        group = self.get(group_id)
        if group.ready:
            raise BufferError(f"group {group_id!r} was already committed")
        if not samples:
            raise BufferError(f"group {group_id!r} committed without samples")
        if end_version < group.start_version:
            raise BufferError(f"group {group_id!r} ends before it starts")
        group.samples = list(samples)
        group.end_version = end_version
        group.committed_at = now
        return group

    def remove(self, group_ids: Iterable[str]) -> list[Group]:
        """Take groups out (ready or not); unknown ids raise before anything is removed."""
        ids = list(group_ids)
        for gid in ids:
            self.get(gid)
        return [self._groups.pop(gid) for gid in ids]

    def ready_groups(self) -> list[Group]:
        return [g for g in self._groups.values() if g.ready]
