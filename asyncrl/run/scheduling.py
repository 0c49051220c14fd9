"""The run's :class:`~asyncrl.policy.schedule.Scheduler`, built from its config (the
controller builds one per run; ``asyncrl check-config`` describes the same settings with
:func:`asyncrl.config.modes.describe`)."""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.policy.schedule import Scheduler

__all__ = ["make_scheduler"]


def make_scheduler(cfg: Config, train_prompts: int = 0) -> Scheduler:
    """The run's :class:`~asyncrl.policy.schedule.Scheduler` with the configured sampler (a
    fresh one: it keeps state) and caps (``train_prompts``: the train split's size, for the
    ledger's epochs: each epoch drops the remainder of a batch)."""
    per_step = cfg.grpo.prompts_per_step
    return Scheduler(
        cfg.make_sampler(),
        prompts_per_step=per_step,
        samples_per_prompt=cfg.grpo.samples_per_prompt,
        num_steps=cfg.run.num_steps,
        max_buffered_groups=cfg.max_buffered_groups,
        max_inflight_samples=cfg.max_inflight_samples,
        min_chunk_groups=cfg.min_groups_for_streaming_train,
        prompts_per_epoch=max(1, train_prompts // per_step * per_step),
    )
