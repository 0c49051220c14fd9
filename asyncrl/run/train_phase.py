"""The train phase: a ready group until it is trained (pure: no anyio, no sockets).

:class:`TrainPhase` holds the rules from a committed group to an optimizer step, on the run's
one table of live groups (:class:`~asyncrl.policy.live.LiveGroups`); the train pump
(:class:`~asyncrl.run.train_step.StepAssembler`) and the publisher call it::

    READY ──next_chunk()──► taken (the open step's) ──finish_step()──► trained
      │  ▲                      │                        gate closed until end_refit()
      │  └──── abort_step() ◄───┘ (the trainer dropped the step's gradients)
      └─ next_chunk(): evicted (too old) or filtered (dynamic sampling) ──► gone

The rollout phase (:mod:`asyncrl.run.rollout_phase`) brings the groups to READY.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from asyncrl.policy.groups import READY, Group
from asyncrl.policy.counts import StepStats
from asyncrl.policy.live import LiveGroups, SchedulerError

__all__ = ["Taken", "TrainPhase"]


@dataclass(frozen=True)
class Taken:
    """What :meth:`TrainPhase.next_chunk` handed out: groups for the open step (empty: wait
    for a commit) and the ids of groups dropped for good (evicted or filtered)."""

    groups: list[Group]
    evicted: list[str]


class TrainPhase:
    """Eviction, dynamic sampling, the open step's chunks, its abort and its finish.

    Args:
        table: the run's live groups (shared with the rollout phase).
    """

    def __init__(self, table: LiveGroups) -> None:
        self._table = table

    def next_chunk(self) -> Taken:
        """Drop what can never train (or would train on nothing), then take the open step's
        next chunk as the sampler selects it (may be empty: wait for a commit and ask again).

        Raises:
            SchedulerError: the run is finished, a refit is going on, or the sampler chose
                against the rules (a group not ready, too stale, stamped for another step, or
                too few or too many).
        """
        t, sampler = self._table, self._table.sampler
        if t.finished:
            raise SchedulerError("the run is finished; there is no step to assemble")
        if not t.gate_open:
            raise SchedulerError("a step is assembled only once the previous refit is done")
        dropped = self._filter_uniform()
        for g in sampler.evict(t):
            group = t.group(g.group_id)
            if group.state != READY:
                raise SchedulerError(f"{sampler.name} evicted {group.group_id} ({group.state})")
            t.drop(group, "evicted")
            dropped.append(group.group_id)
        remaining = t.prompts_per_step - t.taken
        least = min(t.min_chunk_groups, remaining)
        chosen = [t.group(g.group_id) for g in sampler.select(t, least, remaining)]
        if chosen and not least <= len(chosen) <= remaining:
            raise SchedulerError(
                f"{sampler.name} selected {len(chosen)} groups; the step needs "
                f"{least}..{remaining}"
            )
        for group in chosen:
            if group.state != READY:
                raise SchedulerError(f"{sampler.name} selected {group.group_id} ({group.state})")
            staleness = t.trainer_version - group.start_version
            if staleness > sampler.max_staleness:
                raise SchedulerError(
                    f"{sampler.name} selected {group.group_id} at staleness {staleness}, "
                    f"above its bound {sampler.max_staleness}"
                )
            if group.target_step is not None and group.target_step != t.trainer_version:
                raise SchedulerError(
                    f"{group.group_id} is stamped for step {group.target_step}, not "
                    f"{t.trainer_version}"
                )
            t.take(group)
        return Taken(chosen, dropped)

    def _filter_uniform(self) -> list[str]:
        """Dynamic sampling: drop the ready groups whose rewards are all (nearly) equal, up
        to the step's cap."""
        t = self._table
        if t.filter_min_std is None:
            return []
        dropped = []
        for group in [g for g in t.live if g.state == READY and not g.informative]:
            rewards = group.rewards
            if len(rewards) > 1 and statistics.pstdev(rewards) > t.filter_min_std:
                group.informative = True  # never looked at again
                continue
            if t.stats.filtered_groups >= t.filter_max_drops:
                # past this step's cap it may train now; a later step judges it afresh
                t.stats.filter_cap_reached = True
                continue
            t.drop(group, "zero_variance")
            dropped.append(group.group_id)
        return dropped

    def abort_step(self) -> int:
        """The open step failed on the trainer (which dropped its gradients): its groups are
        ready again, in their order, and the step is assembled anew. Returns how many went
        back.

        Raises:
            SchedulerError: a refit is going on (the step was taken already).
        """
        if not self._table.gate_open:
            raise SchedulerError("abort_step() during a refit: the step was already taken")
        return len(self._table.untake())

    def finish_step(self) -> None:
        """The open step has all its groups and took its optimizer step: its groups are the
        trainer's, the trainer is one version ahead, and nothing is dispatched until
        :meth:`end_refit`.

        Raises:
            SchedulerError: the step does not have exactly ``prompts_per_step`` groups.
        """
        t = self._table
        if t.taken != t.prompts_per_step:
            raise SchedulerError(
                f"step {t.trainer_version} has {t.taken} of {t.prompts_per_step} groups"
            )
        t.step_taken()

    def end_refit(self) -> StepStats:
        """The generators serve the trainer's version: dispatch goes on. Returns the ended
        step's counters (folded into the run's totals).

        Raises:
            SchedulerError: no refit is going on.
        """
        if self._table.gate_open:
            raise SchedulerError("end_refit() without a refit")
        return self._table.refit_ended()
