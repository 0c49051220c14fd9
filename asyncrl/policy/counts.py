"""What became of the run's groups, counted: one step's counters (:class:`StepStats`) and the
counts that add up to the run's totals (:class:`Counts`). Pure data; the table of live groups
(:mod:`asyncrl.policy.live`) counts each event once, in the open step's."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

__all__ = ["Counts", "StepStats"]


@dataclass
class Counts:
    """What became of the run's groups: one step's (a :class:`StepStats` is one), or the
    run's so far (:attr:`~asyncrl.policy.live.LiveGroups.totals`: the sum of every step's).
    Each event is counted once, in the open step's; the run's totals are only ever a sum of
    steps' counts, so the two cannot disagree."""

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
    """Complete groups left untrained when the run ended (counted only by the rollout
    phase's ``close``, after the run's last checkpoint)."""
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
