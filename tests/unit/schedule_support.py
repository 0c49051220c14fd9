"""Scheduler set-up shared by the scheduler and rollout-book tests (test_schedule.py,
test_schedule_properties.py, test_book.py): the built-in samplers by name, the strategies
that draw a random schedule's shape, the capacities it derives from its fractions, and a
:class:`Scheduler` built from them.

Set-up only, never an expected value: each test keeps its own ledger and rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from hypothesis import strategies as st

from asyncrl.policy import samplers as sp
from asyncrl.policy.schedule import Scheduler

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


def scheduler(
    sampler: sp.Sampler,
    *,
    P: int,
    N: int,
    steps: int,
    cap: int | None = None,
    inflight: int | None = None,
    min_chunk: int = 1,
    filter_drops: int = 0,
) -> Scheduler:
    """A :class:`Scheduler` of ``steps`` steps of ``P`` prompts times ``N`` samples; the
    buffer defaults to the sampler's required capacity and the samples in flight to a full
    buffer's; ``filter_drops > 0``: dynamic sampling of groups with all rewards equal, at
    most that many a step."""
    cap = cap or sampler.required_buffer_capacity(P)
    return Scheduler(
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
