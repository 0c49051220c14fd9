"""Set-up shared by the scheduling tests (test_schedule.py, test_schedule_properties.py,
test_phases.py, test_phases_episodes.py, test_dapo_sampler.py): the built-in samplers by name, the
strategies that draw a random schedule's shape, the capacities it derives from its fractions,
the run's table of live groups built from them, and :class:`Phases`: the real table and its
two real phases driven one group-level event at a time (a sample back, a commit, a failure),
each event sent as the message the controller would get.

Set-up only, never an expected value: each test keeps its own ledger and rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st

from asyncrl.checkpoints import directory as ckpt
from asyncrl.environment import Prompt
from asyncrl.policy import samplers as sp
from asyncrl.policy.groups import ABORTING, GENERATING, SCORING, CompletedSample, Group
from asyncrl.policy.live import LiveGroups, Wait
from asyncrl.run.arrivals import ArrivalKind, Sent
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.train_phase import TrainPhase
from asyncrl.wire.messages import Sample, SampleDone

SAMPLERS: dict[str, Callable[[int, float], sp.Sampler]] = {
    "in_order": lambda w, r: sp.InOrderSampler(sp.InOrderConfig(max_lookahead_versions=w)),
    "gated": lambda w, r: sp.GatedSampler(sp.GatedConfig(max_staleness_versions=max(1, w))),
    "oversampled": lambda w, r: sp.OversampledSampler(
        sp.OversampledConfig(max_staleness_versions=max(1, w), over_sampling_ratio=r)
    ),
    "ready_first": lambda w, r: sp.ReadyFirstSampler(
        sp.ReadyFirstConfig(max_staleness_versions=max(1, w))
    ),
}
"""Each built-in sampler from a window ``w`` (in_order's lookahead, the others' staleness
bound, at least 1) and an over-sampling ratio ``r`` (oversampled only)."""


def shape_strategies(
    *, max_W: int, max_steps: int, max_ratio: float, max_extra: int
) -> dict[str, st.SearchStrategy]:
    """Hypothesis strategies for a random schedule's shape, by keyword: ``seed``; ``P``
    prompts per step of ``N`` samples; window ``W``; ``steps``; over-sampling ``ratio``;
    ``extra`` buffer groups, ``inflight_frac`` and ``chunk_frac`` (as :func:`caps` takes
    them)."""
    return dict(
        seed=st.integers(0, 2**32 - 1),
        P=st.integers(1, 4),
        N=st.integers(1, 3),
        W=st.integers(0, max_W),
        steps=st.integers(1, max_steps),
        ratio=st.floats(1.0, max_ratio),
        extra=st.integers(0, max_extra),
        inflight_frac=st.floats(0.05, 1.0),
        chunk_frac=st.floats(0.01, 1.0),
    )


class Caps(NamedTuple):
    """A schedule's capacities."""

    cap: int
    """``max_buffered_groups``."""
    max_inflight: int
    """``max_inflight_samples``."""
    min_chunk: int
    """``min_chunk_groups``."""


def caps(
    sampler: sp.Sampler, P: int, N: int, extra: int, inflight_frac: float, chunk_frac: float
) -> Caps:
    """Capacities from fractions: the sampler's required buffer plus ``extra`` groups, a
    fraction of the buffer's samples in flight (at least one group's), a fraction of a step per
    chunk (at least one group)."""
    cap = sampler.required_buffer_capacity(P) + extra
    return Caps(
        cap=cap,
        max_inflight=max(N, math.ceil(cap * N * inflight_frac)),
        min_chunk=max(1, math.ceil(P * chunk_frac)),
    )


def live_groups(
    sampler: sp.Sampler,
    *,
    P: int,
    N: int,
    steps: int,
    cap: int | None = None,
    inflight: int | None = None,
    min_chunk: int = 1,
    filter_drops: int = 0,
) -> LiveGroups:
    """A table of live groups of ``steps`` steps of ``P`` prompts times ``N`` samples; the
    buffer defaults to the sampler's required capacity and the samples in flight to a full
    buffer's; ``filter_drops > 0``: dynamic sampling of groups with all rewards equal, at
    most that many a step."""
    cap = cap or sampler.required_buffer_capacity(P)
    return LiveGroups(
        sampler,
        prompts_per_step=P,
        samples_per_prompt=N,
        num_steps=steps,
        max_buffered_groups=cap,
        max_inflight_samples=inflight or cap * N,
        min_chunk_groups=min_chunk,
        filter_min_std=0.0 if filter_drops else None,
        filter_max_drops=filter_drops,
    )


TOKENS = np.array([3, 1, 4], dtype=np.int32)
LOGPROBS = np.full(3, -0.5, dtype=np.float32)
DONE = Sample(TOKENS, LOGPROBS, "stop")
CUT = Sample(TOKENS[:1], LOGPROBS[:1], "abort")


def prompt_of(index: int) -> tuple[Prompt, list[int]]:
    """Prompt-stream position ``index``: a prompt whose ids are ``[index]``."""
    return Prompt(id=f"p{index}", text=f"prompt {index}"), [index]


def scored(rewards: list[float]) -> list[CompletedSample]:
    """A group's scored samples with these rewards."""
    return [CompletedSample(TOKENS, LOGPROBS, "stop", float(r), r > 0) for r in rewards]


class Dispatch(NamedTuple):
    """A group :meth:`Phases.dispatch` sent."""

    group_id: str
    index: int
    start_version: int
    target_step: int | None
    n: int


class Chunk(NamedTuple):
    """What :meth:`Phases.next_chunk` took for step ``step``, and dropped."""

    step: int
    groups: list[str]
    evicted: list[str]


class Phases:
    """The real table of live groups and its two real phases, driven by group-level events:
    each group goes to a rollout worker of its own (there are as many as samples may be in
    flight), so a lost worker loses exactly one group. Reads fall through to the table."""

    def __init__(self, table: LiveGroups) -> None:
        self.table = table
        self.workers = [f"w{i}" for i in range(table.max_inflight_samples)]
        self.rollout = RolloutPhase(table, self.workers)
        self.training = TrainPhase(table)
        self._worker: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)

    def slot(self, group_id: str) -> Group:
        return self.table.group(group_id)

    def aborting(self, group_id: str) -> bool:
        return self.table.group(group_id).state == ABORTING

    # rollout phase
    def dispatch(self) -> Dispatch | Wait:
        sent = self.rollout.dispatch(self.workers, prompt_of, 0.0)
        if not isinstance(sent, Sent):
            return sent
        g = self.table.group(sent.group_id)
        self._worker[g.group_id] = sent.worker
        return Dispatch(g.group_id, g.index, g.start_version, g.target_step, g.n)

    def sample_finished(self, group_id: str) -> str | None:
        """One more sample of ``group_id`` back: ``None``, ``"commit"`` or ``"discard"``."""
        g = self.table.group(group_id)
        index = g.samples.index(None)
        sample = CUT if g.state == ABORTING else DONE
        arrival = self.rollout.sample_arrived(
            SampleDone(group_id, self._worker[group_id], index, sample)
        )
        return {ArrivalKind.PENDING: None, ArrivalKind.COMPLETE: "commit",
                ArrivalKind.DISCARDED: "discard"}[arrival.kind]  # fmt: skip

    def committed(self, group_id: str, rewards: list[float] | None = None) -> None:
        """``group_id`` is scored with ``rewards`` (all 1.0 when not given)."""
        if rewards is None:
            rewards = [1.0] * self.table.group(group_id).n
        assert self.rollout.commit(group_id, scored(rewards), 0.0), f"{group_id} not scoring"

    def failed(self, group_id: str, *, retry: bool) -> None:
        """Generation (or, for a group being scored, scoring) of ``group_id`` failed."""
        if self.table.state_of(group_id) == SCORING:
            assert self.rollout.score_failed(group_id)
        else:
            self.rollout.failed(group_id, retry=retry)

    def retry(self, group_id: str) -> None:
        self.rollout.retry(group_id)

    def requeue(self, group_id: str) -> None:
        """``group_id``'s worker (its own) was lost."""
        assert self.table.state_of(group_id) == GENERATING
        assert self.rollout.worker_lost(self._worker[group_id]).again == 1

    def begin_refit(self) -> list[str]:
        return _ids(self.rollout.begin_refit())

    def close(self) -> list[str]:
        return _ids(self.rollout.close())

    # train phase
    def next_chunk(self) -> Chunk:
        step = self.table.trainer_version
        taken = self.training.next_chunk()
        return Chunk(step, [g.group_id for g in taken.groups], taken.evicted)

    def abort_step(self) -> list[str]:
        back = [g.group_id for g in self.table.in_step]
        self.training.abort_step()
        return back

    def finish_step(self) -> None:
        self.training.finish_step()

    def end_refit(self) -> Any:
        return self.training.end_refit()

    # a checkpoint
    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Restore ``state`` (with made-up samples of its rewards for the ready groups)."""
        groups = [
            ckpt.SavedGroup.of(Group(
                f"g{g['index']}", f"p{g['index']}", [g["index"]], g["start_version"],
                None if g["target_step"] < 0 else g["target_step"], 0.0,
                scored(g["rewards"]), index=g["index"],
            ))
            for g in state["ready"]
        ]  # fmt: skip
        ckpt.restore(self.table, ckpt.ControllerState(
            step=state["trainer_version"], finished=False, scheduler=state, groups=groups))  # fmt: skip
        return [g.group_id for g in self.table.ready_groups()]


def _ids(aborts: Any) -> list[str]:
    """The groups an abort reached, by id (each group's request carries its id)."""
    return list(aborts.gone) + [gid for ids in aborts.by_worker.values() for gid in ids]


def phases(sampler: sp.Sampler, **kwargs: Any) -> Phases:
    """:class:`Phases` around :func:`live_groups` ``(sampler, **kwargs)``."""
    return Phases(live_groups(sampler, **kwargs))
