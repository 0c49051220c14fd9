"""The scheduler's vocabulary: group states, the slot it keeps per group, and the decisions
and counters it hands to the pumps (:mod:`asyncrl.policy.schedule`). Pure data."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

__all__ = [
    "ABORTING",
    "GENERATING",
    "READY",
    "RETRYING",
    "SCORING",
    "Chunk",
    "Counts",
    "Dispatch",
    "SchedulerError",
    "Slot",
    "StepStats",
    "Wait",
]

GENERATING, SCORING, READY, ABORTING = "generating", "scoring", "ready", "aborting"
RETRYING = "retrying"
"""Generation failed and will be tried again (still live: it keeps its place and its step)."""


class SchedulerError(RuntimeError):
    """An event that the state does not allow (a bug in a pump or a sampler)."""


@dataclass
class Slot:
    """A dispatched group the scheduler still tracks (what samplers see as a GroupView)."""

    group_id: str
    index: int
    start_version: int
    target_step: int | None
    n: int
    state: str = GENERATING
    finished: int = 0
    ready_seq: int = -1
    rewards: Sequence[float] = ()
    retries: int = 0
    """Times its generation failed and was retried (a worker's death is not counted)."""
    informative: bool = False
    """Dynamic sampling found its rewards spread out (it keeps it, and does not look again)."""

    @property
    def ready(self) -> bool:
        return self.state == READY


@dataclass(frozen=True)
class Dispatch:
    """Dispatch prompt ``index`` of the prompt stream as group ``group_id``."""

    group_id: str
    index: int
    start_version: int
    target_step: int | None
    n: int


@dataclass(frozen=True)
class Wait:
    """Nothing to dispatch now, and why: ``gate`` (a refit is going on), ``buffer`` (live
    groups at capacity), ``samples`` (samples in flight at capacity), ``sampler`` (the sampler
    holds generation back), ``enough`` (the work in flight covers the rest of the run),
    ``finished`` (the last step is trained), ``workers`` (no rollout worker serves: the
    rollout book's answer while every one is restarting)."""

    reason: str


@dataclass(frozen=True)
class Chunk:
    """What :meth:`Scheduler.next_chunk` decided: groups to train now (empty: wait) and groups
    evicted for good."""

    step: int
    groups: list[str]
    evicted: list[str]


@dataclass
class Counts:
    """The scheduler's counts of what became of its groups: one step's (a :class:`StepStats`
    is one), or the run's so far (:attr:`~asyncrl.policy.schedule.Scheduler.totals`: the sum
    of every step's). Each event is counted once, in the open step's; the run's totals are
    only ever a sum of steps' counts, so the two cannot disagree."""

    dispatched_groups: int = 0
    """Groups dispatched: new prompts, and after a resume the prompts that were in flight
    (a group sent again after its generation failed or its worker died is not counted)."""
    trained_groups: int = 0
    """Groups trained by the step's optimizer step (counted when it is taken)."""
    evicted_groups: int = 0
    """Ready groups dropped by the sampler: too old to train."""
    filtered_groups: int = 0
    """Ready groups dropped by dynamic sampling: their rewards were all (nearly) equal, so
    their advantages would all be 0 (``grpo.dynamic_sampling``)."""
    aborted_groups: int = 0
    """Generating groups aborted: hopeless at a refit, or still generating at the end."""
    failed_groups: int = 0
    """Groups dropped because their generation or scoring failed for good."""
    unused_groups: int = 0
    """Complete groups left untrained when the run ended (only :meth:`Scheduler.close
    <asyncrl.policy.schedule.Scheduler.close>` counts them, after the run's last
    checkpoint)."""
    wasted_samples: int = 0
    """The samples of every group above that left untrained."""

    def __add__(self, other: Counts) -> Counts:
        """Both counts together (of :class:`Counts`' fields only: a step's other stats do not
        add up over a run)."""
        return Counts(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                         for f in fields(Counts)})  # fmt: skip


@dataclass
class StepStats(Counts):
    """Counters of one step (from the end of the previous step's refit to the end of its
    own): its :class:`Counts`, and what is the step's alone."""

    staleness: Counter[int] = field(default_factory=Counter)
    inflight_samples_max: int = 0
    generation_retries: int = 0
    """Failed generations that will be tried again (the step's alone: a checkpoint does not
    keep them, so a run total of them would restart at every resume)."""
    filter_cap_reached: bool = False
    """The step dropped as many groups as dynamic sampling may (4 x ``grpo.prompts_per_step``:
    :data:`asyncrl.config.modes.DYNAMIC_SAMPLING_DROPS_PER_PROMPT`) and trained the rest of
    its uniform groups as they were."""
