"""What a config's asynchrony settings amount to: the mode in one line, the derived
capacities, and advice (pure; ``asyncrl check-config`` prints it, docs/modes.md explains it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import Config
from asyncrl.policy.schedule import Scheduler

__all__ = ["ModeReport", "describe", "make_scheduler"]


@dataclass(frozen=True)
class ModeReport:
    mode: str
    """One line: the mode, its sampler and knobs, and what it guarantees."""
    capacities: dict[str, Any]
    advice: list[str] = field(default_factory=list)
    """Settings that are legal but probably not what was meant (each with its fix)."""


def _line(sampler: Any, P: int) -> str:
    name = sampler.name
    if name == "in_order":
        L = sampler.lookahead
        if L == 0:
            return (
                "sync on-policy (in_order, max_lookahead_versions=0): every sample is "
                "trained against the weights that generated it"
            )
        return (
            f"async, exact batch->step (in_order, max_lookahead_versions={L}): batch k "
            f"trains at step k; staleness <= {L}; nothing wasted"
        )
    W = sampler.max_staleness
    if name == "gated":
        return (
            f"streaming, gated dispatch (gated, max_staleness_versions={W}): any complete "
            f"groups, oldest first; staleness <= {W}; nothing wasted"
        )
    if name == "oversampled":
        return (
            f"streaming, over-sampled (oversampled, max_staleness_versions={W}, "
            f"over_sampling_ratio={sampler.ratio:g}): dispatch never waits for the "
            f"trainer; staleness <= {W}; groups that fall out of the window are wasted"
        )
    if name == "ready_first":
        return (
            f"streaming, ready first (ready_first, max_staleness_versions={W}): whatever "
            f"completes first; staleness <= {W}; stragglers past the window are wasted"
        )
    return f"custom sampler {name!r}: staleness <= {W} (its own documentation says more)"


def describe(config: Config) -> ModeReport:
    """The mode, capacities and advice for a validated config."""
    sampler = config.make_sampler()
    P, N = config.grpo.prompts_per_step, config.grpo.samples_per_prompt
    chunk = config.min_groups_for_streaming_train
    need = sampler.required_buffer_capacity(P)
    capacities: dict[str, Any] = {
        "prompts_per_step (P)": P,
        "samples_per_prompt (N)": N,
        "staleness bound (versions)": sampler.max_staleness,
        "max_buffered_groups": f"{config.max_buffered_groups} (the sampler needs >= {need})",
        "max_inflight_samples": config.max_inflight_samples,
        "min_groups_for_streaming_train": (
            f"{chunk} (1 to {math.ceil(P / chunk)} chunks per optimizer step)"
        ),
        "refit": (
            "drain first (at most %gs), then " % config.refit.drain_timeout_s
            if config.refit.drain
            else ""
        )
        + f"abort hopeless groups, load over {config.refit.transport} "
        f"({config.refit.bucket_size_mb} MiB buckets), invalidate the prefix cache",
    }
    advice = []
    if chunk < P and sampler.name == "in_order" and sampler.max_staleness == 0:
        advice.append(
            "pipeline.min_groups_for_streaming_train: in sync mode the whole batch is "
            "generated before training can start anyway, so chunks only add trainer round "
            f"trips. Fix: set it to prompts_per_step ({P}) or 0"
        )
    if config.refit.drain and sampler.name == "in_order" and sampler.max_staleness == 0:
        advice.append("refit.drain: sync mode has nothing in flight at a refit. Fix: remove it")
    if (
        config.max_inflight_samples < P * N
        and sampler.name == "in_order"
        and sampler.max_staleness == 0
    ):
        advice.append(
            f"pipeline.max_inflight_samples: {config.max_inflight_samples} < P * N = {P * N}, "
            "so a sync step generates its batch in several waves. Fix: raise it if the engines "
            "can run P * N samples at once"
        )
    return ModeReport(_line(sampler, P), capacities, advice)


def make_scheduler(cfg: Config, train_prompts: int = 0) -> Scheduler:
    """The run's :class:`~asyncrl.policy.schedule.Scheduler` with the configured sampler and caps
    (``train_prompts``: the train split's size, for the ledger's epochs: each epoch drops the
    remainder of a batch)."""
    per_step = cfg.grpo.prompts_per_step
    return Scheduler(
        cfg.make_sampler(),
        prompts_per_step=cfg.grpo.prompts_per_step,
        samples_per_prompt=cfg.grpo.samples_per_prompt,
        num_steps=cfg.run.num_steps,
        max_buffered_groups=cfg.max_buffered_groups,
        max_inflight_samples=cfg.max_inflight_samples,
        min_chunk_groups=cfg.min_groups_for_streaming_train,
        prompts_per_epoch=max(1, train_prompts // per_step * per_step),
    )
