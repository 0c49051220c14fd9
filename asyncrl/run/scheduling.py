"""The run's :class:`~asyncrl.policy.schedule.Scheduler`, built from its config (the
controller builds one per run; ``asyncrl check-config`` describes the same settings with
:func:`asyncrl.config.modes.describe`)."""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.policy.schedule import Scheduler

__all__ = ["DYNAMIC_SAMPLING_DROPS_PER_PROMPT", "DYNAMIC_SAMPLING_MIN_STD", "make_scheduler",
           "run_steps"]  # fmt: skip

DYNAMIC_SAMPLING_MIN_STD = 0.0
"""With ``grpo.dynamic_sampling``: a ready group whose rewards' population standard deviation
is at most this is dropped. ``0``: only groups whose rewards are all equal, DAPO's rule (their
advantages would all be 0). Once the config key ``grpo.dynamic_sampling_min_std`` (issue 50:
no peer exposes a threshold; DAPO and verl drop exactly the uniform groups)."""

DYNAMIC_SAMPLING_DROPS_PER_PROMPT = 4
"""With ``grpo.dynamic_sampling``: a step drops at most this many groups per prompt it trains
(4 x ``grpo.prompts_per_step``); past that cap it trains the uniform groups it gets, so that a
solved or hopeless task cannot stall the run (docs/losses.md, "Dynamic sampling"). Once the
config key ``grpo.dynamic_sampling_max_drops`` (issue 50), whose default ``0`` meant this."""


def make_scheduler(cfg: Config, train_prompts: int = 0) -> Scheduler:
    """The run's :class:`~asyncrl.policy.schedule.Scheduler` with the configured sampler (a
    fresh one: it keeps state) and caps (``train_prompts``: the train split's size, for the
    ledger's epochs: each epoch drops the remainder of a batch)."""
    g = cfg.grpo
    per_step = g.prompts_per_step
    return Scheduler(
        cfg.make_sampler(),
        prompts_per_step=per_step,
        samples_per_prompt=cfg.grpo.samples_per_prompt,
        num_steps=run_steps(cfg, train_prompts),
        max_buffered_groups=cfg.max_buffered_groups,
        max_inflight_samples=cfg.max_inflight_samples,
        min_chunk_groups=cfg.min_groups_for_streaming_train,
        prompts_per_epoch=max(1, train_prompts // per_step * per_step),
        filter_min_std=DYNAMIC_SAMPLING_MIN_STD if g.dynamic_sampling else None,
        filter_max_drops=DYNAMIC_SAMPLING_DROPS_PER_PROMPT * per_step,
    )


def run_steps(cfg: Config, train_prompts: int) -> int:
    """The steps the run trains: ``run.num_steps``, or fewer when ``run.max_num_epochs``
    passes over the train split (``train_prompts`` prompts, each pass ``train_prompts //
    grpo.prompts_per_step`` steps: the remainder of a pass is dropped) come first."""
    epochs = cfg.run.max_num_epochs
    if not epochs:
        return cfg.run.num_steps
    return min(cfg.run.num_steps, epochs * (train_prompts // cfg.grpo.prompts_per_step))
