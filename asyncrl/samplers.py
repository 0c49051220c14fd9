"""Staleness samplers: one object decides what may be generated and what may be trained.

Pure state, no I/O. Both pumps consult the same sampler:

* rollout pump: :meth:`Sampler.admit` before dispatching the next batch of prompts (gated
  samplers refuse until the trainer has advanced far enough — this is where staleness is
  bounded);
* train pump: :meth:`Sampler.evict` then :meth:`Sampler.select` a chunk of complete groups;
* refit: :meth:`Sampler.should_abort_inflight` for each group still generating;
* config check: :meth:`Sampler.required_buffer_capacity`.

Versions: the trainer version ``v`` is the number of optimizer steps taken; step ``v`` is the
one being assembled. A group's ``start_version`` is the generator's installed version when it
was dispatched; its staleness when trained at step ``v`` is ``v - start_version``.

Only ``in_order`` is built in so far; the streaming samplers (gated, over-sampled) implement
the same protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .buffer import Group, ReplayBuffer

__all__ = ["InOrderSampler", "Sampler"]


@runtime_checkable
class Sampler(Protocol):
    name: str

    def admit(self, trainer_version: int) -> int | None:
        """Admit the next batch: its target step, or ``None`` to wait for the trainer."""

    def select(
        self, buffer: ReplayBuffer, trainer_version: int, min_groups: int, max_groups: int
    ) -> list[Group]:
        """Choose between ``min_groups`` and ``max_groups`` ready groups to train at
        ``trainer_version``, or none. Does not remove them."""

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Group]:
        """Ready groups that can never be trained any more. Does not remove them."""

    def should_abort_inflight(self, group: Group, trainer_version: int) -> bool:
        """Whether a still-generating group is hopeless after the refit to ``trainer_version``."""

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        """Groups the buffer must hold so that the pumps cannot deadlock."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class InOrderSampler:
    """Exact batch→step matching: the k-th admitted batch trains at step k.

    Batch ``t`` is admitted only once ``t <= trainer_version + max_lookahead_versions``; the
    rollout gate is closed during each refit, so its groups start on weights of version
    ``>= t - max_lookahead_versions`` and are trained at step ``t``: staleness is at most the
    lookahead. ``max_lookahead_versions = 0`` is synchronous on-policy training.
    """

    name = "in_order"

    def __init__(self, max_lookahead_versions: int) -> None:
        if max_lookahead_versions < 0:
            raise ValueError("max_lookahead_versions must be >= 0")
        self.lookahead = max_lookahead_versions
        self._cursor = -1  # last admitted step

    @property
    def cursor(self) -> int:
        return self._cursor

    def admit(self, trainer_version: int) -> int | None:
        step = self._cursor + 1
        if step > trainer_version + self.lookahead:
            return None
        self._cursor = step
        return step

    def select(
        self, buffer: ReplayBuffer, trainer_version: int, min_groups: int, max_groups: int
    ) -> list[Group]:
        if min_groups < 1 or max_groups < min_groups:
            raise ValueError(f"need 1 <= min_groups <= max_groups, got {min_groups}, {max_groups}")
        eligible = [
            g for g in buffer.ready_groups() if g.target_step == trainer_version
        ][:max_groups]
        return eligible if len(eligible) >= min_groups else []

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Group]:
        return [
            g
            for g in buffer.ready_groups()
            if g.target_step is not None and g.target_step < trainer_version
        ]

    def should_abort_inflight(self, group: Group, trainer_version: int) -> bool:
        return False  # every admitted group is within the window by construction

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * (self.lookahead + 1)

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self._cursor, "max_lookahead_versions": self.lookahead}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._cursor = int(state["cursor"])
