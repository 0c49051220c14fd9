"""DAPO-style dynamic sampling as an asyncrl sampler plugin (entry point ``dynamic``).

Over-sampled streaming (:class:`asyncrl.plugin.sampler.OversampledSampler`) plus one rule: a ready
group whose rewards are all (nearly) equal is evicted instead of trained, because its GRPO
advantages are all zero. A guard keeps a solved (or hopeless) task from filtering forever: when
more than ``max_filtered_fraction`` of the last ``window_groups`` ready groups were filtered
(measured once that many were seen), groups are trained unfiltered until the share drops.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from asyncrl.plugin.sampler import (
    OversampledConfig,
    OversampledSampler,
    SamplerPlugin,
    SchedulerView,
)

__all__ = ["DynamicConfig", "DynamicSampler", "plugin"]


class DynamicConfig(OversampledConfig, tag="dynamic", tag_field="name"):
    """Over-sampled streaming that drops groups without a learning signal."""

    min_reward_std: float = 0.0
    """A group whose rewards' standard deviation is <= this is dropped (0: only groups whose
    samples all got the very same reward)."""
    max_filtered_fraction: float = 0.9
    """When more than this share of the last ``window_groups`` ready groups was dropped,
    train groups unfiltered (a solved or hopeless task must not stall the run)."""
    window_groups: int = 64
    """How many recent ready groups the share is measured over."""


class DynamicSampler(OversampledSampler):
    name = "dynamic"

    def __init__(self, config: DynamicConfig) -> None:
        super().__init__(config)
        if config.min_reward_std < 0:
            raise ValueError(
                f"min_reward_std: must be >= 0, got {config.min_reward_std}. Fix: use 0.0"
            )
        if not 0 <= config.max_filtered_fraction < 1:
            raise ValueError(
                f"max_filtered_fraction: must be in [0, 1), got {config.max_filtered_fraction}. "
                "Fix: use e.g. 0.9"
            )
        if config.window_groups < 1:
            raise ValueError(f"window_groups: must be >= 1, got {config.window_groups}. Fix: 64")
        self.min_std = config.min_reward_std
        self.max_fraction = config.max_filtered_fraction
        self._recent: deque[bool] = deque(maxlen=config.window_groups)
        self._judged: set[str] = set()
        self.filtered = 0

    def describe(self) -> str:
        """The mode line ``asyncrl check-config`` prints (``DescribesMode``)."""
        W = self.window
        return (
            f"DAPO dynamic sampling ({self.name}, max_staleness_versions={W}, "
            f"over_sampling_ratio={self.ratio:g}, min_reward_std={self.min_std:g}): over-sampled "
            f"streaming that drops groups whose rewards are all equal; staleness <= {W}; "
            "dropped groups and groups that fall out of the window are wasted"
        )

    def _uninformative(self, rewards: Any) -> bool:
        return len(rewards) < 2 or statistics.pstdev(rewards) <= self.min_std

    def evict(self, view: SchedulerView) -> list[Any]:
        out = super().evict(view)  # stale groups first
        stale = {g.group_id for g in out}
        for g in view.live:
            if not g.ready or g.group_id in stale or g.group_id in self._judged:
                continue
            self._judged.add(g.group_id)
            drop = self._uninformative(g.rewards)
            full = len(self._recent) == self._recent.maxlen
            share = sum(self._recent) / len(self._recent) if full else 0.0
            if drop and share <= self.max_fraction:
                out.append(g)
                self.filtered += 1
                self._judged.discard(g.group_id)  # it leaves the scheduler now
            self._recent.append(drop)
        live = {g.group_id for g in view.live}
        self._judged &= live  # forget groups that were trained or dropped
        return out

    def state_dict(self) -> dict[str, int]:
        return {"filtered": self.filtered}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.filtered = int(state.get("filtered", 0))


plugin = SamplerPlugin(DynamicConfig, DynamicSampler)
