"""Staleness samplers: the policy half of scheduling (pure, no I/O).

A sampler answers four questions for the run's two phases (:mod:`asyncrl.run.rollout_phase`,
:mod:`asyncrl.run.train_phase`), which with the table of live groups
(:class:`~asyncrl.policy.live.LiveGroups`) own every piece of state and check every invariant
(capacity, the staleness bound, each group counted once); the sampler only chooses:

* :meth:`Sampler.admit` — may one more prompt group be dispatched now, and for which step
  (``None`` when it is not bound to one)? This is where generation is held back;
* :meth:`Sampler.select` — which ready groups go into the open optimizer step now;
* :meth:`Sampler.evict` — which ready groups can never be trained any more;
* :meth:`Sampler.should_abort_inflight` — after a refit, is a still-generating group hopeless?

Versions: the trainer version ``v`` is the number of optimizer steps taken; step ``v`` is the
one being assembled. A group's ``start_version`` is the generator's installed version when it
was dispatched; trained at step ``v`` its staleness is ``v - start_version``. Every sampler
declares the bound it keeps (:attr:`Sampler.max_staleness`); the scheduler refuses a selection
that breaks it.

Built in (entry points in the ``asyncrl.samplers`` group; docs/modes.md maps them to modes):

============== ==================================================================================
``in_order``   exact batch→step matching: the k-th batch of P groups trains at step k, admitted
               once ``k <= v + L``. L = 0 is synchronous on-policy training.
``gated``      streaming with gated dispatch: any complete groups, earliest deadline (oldest
               start version) first; admission and selection keep a schedule feasible in which
               every group trains within W versions, so nothing is ever wasted.
``oversampled`` streaming with over-sampling: dispatch never waits for the trainer, only for
               ``ceil(r * P * (W + 1))`` unconsumed groups; groups that fall out of the window
               are evicted, generating ones aborted at the refit that makes them hopeless.
``ready_first`` whatever completes first within the window; stale groups evicted or aborted;
               unconsumed work capped at ``(W + 1) * P`` like ``gated``.
============== ==================================================================================

A custom sampler is a distribution with an entry point in ``asyncrl.samplers`` naming a
:class:`SamplerPlugin` (see ``plugins/asyncrl-sampler-dapo``). Each sampler also describes its
own mode (:class:`DescribesMode`) and capacity (:meth:`Sampler.required_buffer_capacity`), so
the core never switches on a sampler's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from asyncrl.errors import config_error

__all__ = [
    "IN_FLIGHT_CHOICES",
    "DecidesInFlight",
    "DescribesMode",
    "GatedConfig",
    "GatedSampler",
    "GroupView",
    "InOrderConfig",
    "InOrderSampler",
    "OversampledConfig",
    "OversampledSampler",
    "ReadyFirstConfig",
    "ReadyFirstSampler",
    "Sampler",
    "SamplerPlugin",
    "SchedulerView",
    "in_flight_at_refit",
    "slack",
]


# --------------------------------------------------------------------------- what samplers see
class GroupView(Protocol):
    """A live group as the scheduler shows it (read-only for samplers)."""

    group_id: str
    index: int
    """Dispatch order (0, 1, 2, ...): also the group's position in the prompt stream."""
    start_version: int
    target_step: int | None
    ready: bool
    """Every sample came back and was scored."""
    ready_seq: int
    """Completion order among ready groups (-1 while not ready)."""
    rewards: Sequence[float]
    """The samples' rewards once ready (empty before)."""


class SchedulerView(Protocol):
    """The scheduler's state as samplers see it (read-only)."""

    trainer_version: int
    generator_version: int
    prompts_per_step: int
    taken: int
    """Groups already in the open step (step ``trainer_version``)."""
    start_version_counts: Mapping[int, int]
    """Live groups per start version."""

    @property
    def num_live(self) -> int:
        """``len(live)``, without building the list (admission runs per dispatch)."""

    @property
    def live(self) -> Sequence[GroupView]:
        """Untrained groups still counted against capacity (generating or ready, not being
        aborted), in dispatch order."""


@runtime_checkable
class Sampler(Protocol):
    name: str
    max_staleness: int
    """The hard bound: the scheduler refuses to train a group staler than this."""
    over_dispatch: float
    """How much unconsumed work may exist relative to what the run still needs (1.0: only
    what is needed; the over-sampling ratio for samplers that expect to waste some)."""

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        """Groups (generating + ready) the buffer must hold so that the pumps cannot deadlock
        (also the default ``pipeline.max_buffered_groups``)."""

    def admit(self, view: SchedulerView) -> tuple[bool, int | None]:
        """``(True, target_step)`` to dispatch one more group now (``target_step`` may be
        ``None``), ``(False, None)`` to wait until the trainer advances."""

    def select(self, view: SchedulerView, min_groups: int, max_groups: int) -> list[Any]:
        """Between ``min_groups`` and ``max_groups`` ready live groups for the open step, or
        none. The scheduler takes them."""

    def evict(self, view: SchedulerView) -> list[Any]:
        """Ready live groups that can never be trained (the scheduler drops and counts them)."""

    def should_abort_inflight(self, group: GroupView, trainer_version: int) -> bool:
        """Whether a generating group can never be trained once the trainer is at
        ``trainer_version``."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


@runtime_checkable
class DescribesMode(Protocol):
    """What a sampler may add to :class:`Sampler`: its mode in words. Every built-in sampler
    has it; without it ``asyncrl check-config`` shows a custom sampler with its staleness
    bound."""

    def describe(self) -> str:
        """One line: the mode, the sampler's name and knobs, and what it guarantees (the
        staleness bound as ``staleness <= W``, and what is wasted), for ``asyncrl
        check-config`` (:func:`asyncrl.config.modes.describe`; docs/modes.md)."""


IN_FLIGHT_CHOICES = ("continue", "reprefill")


@runtime_checkable
class DecidesInFlight(Protocol):
    """What a sampler may add to :class:`Sampler`: what becomes of the requests in flight at
    a refit (episodes' turns included). Every built-in sampler has it (the knob
    ``in_flight_at_refit``); without it they continue."""

    in_flight_at_refit: str
    """``"continue"``: they go on with the new weights, over the KV cache the old ones
    computed (what the engine keeps through its pause); ``"reprefill"``: the new weights
    first recompute their KV cache from their tokens (one prefill of each sequence in
    flight per refit). Either way nothing generated is thrown away, and each token keeps
    the version that generated it."""


def in_flight_at_refit(sampler: Any) -> str:
    """``sampler``'s choice for the requests in flight at a refit (:class:`DecidesInFlight`;
    ``"continue"`` for a sampler without one).

    Raises:
        ConfigError: a choice other than ``"continue"`` and ``"reprefill"`` (a plugin's).
    """
    if not isinstance(sampler, DecidesInFlight):
        return "continue"
    choice = sampler.in_flight_at_refit
    if choice not in IN_FLIGHT_CHOICES:
        raise config_error(
            "pipeline.sampler.in_flight_at_refit",
            f"sampler {getattr(sampler, 'name', sampler)!r} chose {choice!r}",
            f"choose one of {', '.join(IN_FLIGHT_CHOICES)} (the sampler plugin's own setting)",
        )
    return choice


@dataclass(frozen=True)
class SamplerPlugin:
    """What an ``asyncrl.samplers`` entry point names.

    ``config`` is a frozen msgspec struct with ``tag=<name>, tag_field="name"`` and defaults
    for every knob: the run config's ``[pipeline.sampler]`` table is converted to it (unknown
    keys are errors naming the field). ``create(config)`` builds the sampler.
    """

    config: type[msgspec.Struct]
    create: Callable[[Any], Sampler]


class _Knobs(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    in_flight_at_refit: Literal["continue", "reprefill"] = "continue"
    """What becomes of the requests in flight at a refit (:class:`DecidesInFlight`):
    ``"continue"`` on the new weights over the KV cache the old ones computed, or
    ``"reprefill"``: the new weights recompute it from their tokens first."""


# --------------------------------------------------------------------------- in_order
class InOrderConfig(_Knobs, tag="in_order", tag_field="name"):
    """Exact batch→step matching: the batch dispatched k-th trains at step k."""

    max_lookahead_versions: int = 1
    """How many weight versions generation may run ahead (0 = synchronous on-policy). 1 overlaps
    each step's generation with the previous step's training; raise it to run further ahead, at
    the cost of staleness."""


class InOrderSampler:
    """Group ``k`` belongs to batch ``k // P`` and trains at step ``k // P``; batch ``t`` is
    admitted only once ``t <= v + L``. The rollout gate is closed during each refit, so its
    groups start on weights ``>= t - L``: staleness is at most the lookahead L, and with L = 0
    every sample is generated by the weights it is trained against."""

    name = "in_order"
    over_dispatch = 1.0

    def __init__(self, config: InOrderConfig) -> None:
        if config.max_lookahead_versions < 0:
            raise ValueError(
                f"max_lookahead_versions: must be >= 0, got {config.max_lookahead_versions}. "
                "Fix: use 0 for synchronous on-policy training or >= 1 for async"
            )
        self.lookahead = config.max_lookahead_versions
        self.max_staleness = self.lookahead
        self.in_flight_at_refit = config.in_flight_at_refit
        self._admitted = 0

    def describe(self) -> str:
        L = self.lookahead
        if L == 0:
            return (
                f"sync on-policy ({self.name}, max_lookahead_versions=0): every sample is "
                "trained against the weights that generated it"
            )
        return (
            f"async, exact batch->step ({self.name}, max_lookahead_versions={L}): batch k "
            f"trains at step k; staleness <= {L}; nothing wasted"
        )

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * (self.lookahead + 1)

    def admit(self, view: SchedulerView) -> tuple[bool, int | None]:
        step = self._admitted // view.prompts_per_step
        if step > view.trainer_version + self.lookahead:
            return False, None
        self._admitted += 1
        return True, step

    def select(self, view: SchedulerView, min_groups: int, max_groups: int) -> list[Any]:
        v = view.trainer_version
        eligible = [g for g in view.live if g.ready and g.target_step == v][:max_groups]
        return eligible if len(eligible) >= min_groups else []

    def evict(self, view: SchedulerView) -> list[Any]:
        v = view.trainer_version
        return [g for g in view.live if g.ready and g.target_step is not None and g.target_step < v]

    def should_abort_inflight(self, group: GroupView, trainer_version: int) -> bool:
        return group.target_step is not None and group.target_step < trainer_version

    def state_dict(self) -> dict[str, int]:
        return {"admitted": self._admitted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._admitted = int(state["admitted"])


def _window(versions: int) -> int:
    """A streaming sampler's window W, checked."""
    if versions < 1:
        raise ValueError(
            f"max_staleness_versions: must be >= 1, got {versions}. Fix: use >= 1 (for "
            'on-policy training use name = "in_order" with max_lookahead_versions = 0)'
        )
    return versions


# --------------------------------------------------------------------------- gated
def slack(
    counts: Mapping[int, int], trainer_version: int, taken: int, per_step: int, window: int
) -> dict[int, int]:
    """Spare training slots per deadline, for groups that must train by a deadline.

    ``counts`` maps a start version to the number of untrained groups that started on it
    (deadline ``start + window``). Steps ``v, v+1, ...`` take ``per_step`` groups each and
    ``taken`` of step ``v``'s are spoken for. Every group can make its deadline (train
    earliest deadline first) iff ``slack[d] >= 0`` for every ``d`` in ``v .. v + window``,
    where ``slack[d] = (d - v + 1) * per_step - taken - #(deadline <= d)``; a deadline before
    ``v`` is already missed (slack -1 at ``v``). Later deadlines cannot exist: groups start
    on a version ``<= v``.
    """
    v = trainer_version
    by_deadline: dict[int, int] = {}
    for start, n in counts.items():
        d = max(start + window, v - 1)
        by_deadline[d] = by_deadline.get(d, 0) + n
    out: dict[int, int] = {}
    due = by_deadline.get(v - 1, 0)
    for d in range(v, v + window + 1):
        due += by_deadline.get(d, 0)
        out[d] = (d - v + 1) * per_step - taken - due
    if by_deadline.get(v - 1, 0):
        out[v] = min(out[v], -1)
    return out


class GatedConfig(_Knobs, tag="gated", tag_field="name"):
    """Streaming with gated dispatch: any complete groups, oldest first, none wasted."""

    max_staleness_versions: int = 1
    """W: the most versions a group may lag the weights it is trained against (>= 1). Raise it
    for throughput at the cost of staleness."""


class GatedSampler:
    """Each group gets a deadline, ``start_version + W``. Admission and selection keep every
    :func:`slack` non-negative (every untrained group can still make its deadline if the
    trainer takes P groups per step), so nothing is ever evicted or aborted:

    * a new group (deadline ``g + W``) is admitted only if every deadline from ``g + W`` on
      has a spare slot;
    * selection takes ready groups earliest deadline first, skipping one whose deadline
      ``e`` would leave no spare slot before ``e``, which a still-generating, earlier-due
      group needs: the trainer waits for a straggler only once it is due.
    """

    name = "gated"
    over_dispatch = 1.0

    def __init__(self, config: GatedConfig) -> None:
        self.window = self.max_staleness = _window(config.max_staleness_versions)
        self.in_flight_at_refit = config.in_flight_at_refit

    def describe(self) -> str:
        W = self.window
        return (
            f"streaming, gated dispatch ({self.name}, max_staleness_versions={W}): any "
            f"complete groups, oldest first; staleness <= {W}; nothing wasted"
        )

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * (self.window + 1)

    def _slack(self, view: SchedulerView) -> dict[int, int]:
        return slack(
            view.start_version_counts,
            view.trainer_version,
            view.taken,
            view.prompts_per_step,
            self.window,
        )

    def admit(self, view: SchedulerView) -> tuple[bool, int | None]:
        spare = self._slack(view)
        due = view.generator_version + self.window
        return all(s >= 1 for d, s in spare.items() if d >= due) and min(spare.values()) >= 0, None

    def select(self, view: SchedulerView, min_groups: int, max_groups: int) -> list[Any]:
        v = view.trainer_version
        spare = self._slack(view)
        if min(spare.values()) < 0:
            return []  # cannot happen while the invariant holds; the scheduler reports it
        ready = sorted(
            (g for g in view.live if g.ready), key=lambda g: (g.start_version, g.ready_seq)
        )
        chosen: list[GroupView] = []
        for g in ready:
            if len(chosen) == max_groups:
                break
            due = g.start_version + self.window
            if all(spare[d] >= 1 for d in range(v, due)):
                chosen.append(g)
                for d in range(v, due):
                    spare[d] -= 1
        return chosen if len(chosen) >= min_groups else []

    def evict(self, view: SchedulerView) -> list[Any]:
        return []

    def should_abort_inflight(self, group: GroupView, trainer_version: int) -> bool:
        return False

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


# --------------------------------------------------------------------------- windowed ones
class _Windowed:
    """Shared by the samplers that may waste work: a group older than W versions is evicted
    (ready) or aborted (generating)."""

    name = ""
    over_dispatch = 1.0
    window = 1

    def _fresh(self, g: GroupView, trainer_version: int) -> bool:
        return trainer_version - g.start_version <= self.window

    def evict(self, view: SchedulerView) -> list[Any]:
        return [g for g in view.live if g.ready and not self._fresh(g, view.trainer_version)]

    def should_abort_inflight(self, group: GroupView, trainer_version: int) -> bool:
        return not self._fresh(group, trainer_version)

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class OversampledConfig(_Knobs, tag="oversampled", tag_field="name"):
    """Streaming with over-sampling: generation never waits for the trainer."""

    max_staleness_versions: int = 1
    """W: groups older than this are evicted (ready) or aborted at refit (generating). Raise it
    for throughput at the cost of staleness."""
    over_sampling_ratio: float = 1.5
    """r >= 1: groups dispatched but not yet trained, evicted or aborted are capped at
    ``ceil(r * prompts_per_step * (W + 1))``, r times what a gated sampler keeps in flight:
    it bounds the waste. Raise it when long stragglers hold steps back (more generation is
    wasted)."""


class OversampledSampler(_Windowed):
    """Admission only waits for the unconsumed-work cap; selection takes the oldest ready
    groups still inside the window (the ones about to expire), then completion order."""

    name = "oversampled"

    def __init__(self, config: OversampledConfig) -> None:
        self.window = self.max_staleness = _window(config.max_staleness_versions)
        self.in_flight_at_refit = config.in_flight_at_refit
        if not config.over_sampling_ratio >= 1.0:
            raise ValueError(
                f"over_sampling_ratio: must be >= 1, got {config.over_sampling_ratio}. "
                "Fix: use e.g. 1.5 (1.0 over-samples nothing beyond the gated capacity)"
            )
        self.ratio = self.over_dispatch = float(config.over_sampling_ratio)

    def describe(self) -> str:
        W = self.window
        return (
            f"streaming, over-sampled ({self.name}, max_staleness_versions={W}, "
            f"over_sampling_ratio={self.ratio:g}): dispatch never waits for the trainer; "
            f"staleness <= {W}; groups that fall out of the window are wasted"
        )

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return math.ceil(self.ratio * prompts_per_step * (self.window + 1))

    def admit(self, view: SchedulerView) -> tuple[bool, int | None]:
        return True, None  # the scheduler's capacity check is the only limit

    def select(self, view: SchedulerView, min_groups: int, max_groups: int) -> list[Any]:
        v = view.trainer_version
        ready = [g for g in view.live if g.ready and self._fresh(g, v)]
        ready.sort(key=lambda g: (g.start_version, g.ready_seq))
        return ready[:max_groups] if len(ready) >= min_groups else []


class ReadyFirstConfig(_Knobs, tag="ready_first", tag_field="name"):
    """Train whatever completes first within the staleness bound."""

    max_staleness_versions: int = 1
    """W: groups older than this are evicted (ready) or aborted at refit (generating). Raise it
    for throughput at the cost of staleness."""


class ReadyFirstSampler(_Windowed):
    """Completion order within the window; unconsumed work capped at ``(W + 1) * P`` minus
    what the open step already took (the ``gated`` cap, without its deadline guarantee:
    stragglers are dropped instead of waited for)."""

    name = "ready_first"

    def __init__(self, config: ReadyFirstConfig) -> None:
        self.window = self.max_staleness = _window(config.max_staleness_versions)
        self.in_flight_at_refit = config.in_flight_at_refit

    def describe(self) -> str:
        W = self.window
        return (
            f"streaming, ready first ({self.name}, max_staleness_versions={W}): whatever "
            f"completes first; staleness <= {W}; stragglers past the window are wasted"
        )

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * (self.window + 1)

    def admit(self, view: SchedulerView) -> tuple[bool, int | None]:
        limit = (self.window + 1) * view.prompts_per_step - view.taken
        return view.num_live < limit, None

    def select(self, view: SchedulerView, min_groups: int, max_groups: int) -> list[Any]:
        v = view.trainer_version
        ready = sorted(
            (g for g in view.live if g.ready and self._fresh(g, v)), key=lambda g: g.ready_seq
        )
        return ready[:max_groups] if len(ready) >= min_groups else []


# --------------------------------------------------------------------------- entry points
in_order = SamplerPlugin(InOrderConfig, InOrderSampler)
gated = SamplerPlugin(GatedConfig, GatedSampler)
oversampled = SamplerPlugin(OversampledConfig, OversampledSampler)
ready_first = SamplerPlugin(ReadyFirstConfig, ReadyFirstSampler)
