"""What a config's asynchrony settings amount to: the mode in one line, the derived
capacities, and advice (pure; ``asyncrl check-config`` prints it, docs/modes.md explains it);
and the run's table of live groups (:class:`~asyncrl.policy.live.LiveGroups`), built from the
same settings (:func:`make_groups`: the controller builds one per run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import Config, required_buffer_capacity
from asyncrl.config.engines import DRAIN_TIMEOUT_S
from asyncrl.policy.samplers import DescribesMode, in_flight_at_refit
from asyncrl.policy.live import LiveGroups

__all__ = [
    "DYNAMIC_SAMPLING_DROPS_PER_PROMPT", "DYNAMIC_SAMPLING_MIN_STD", "ModeReport", "describe",
    "make_groups", "objective", "run_steps",
]


@dataclass(frozen=True)
class ModeReport:
    mode: str
    """One line: the mode, its sampler and knobs, and what it guarantees."""
    capacities: dict[str, Any]
    advice: list[str] = field(default_factory=list)
    """Settings that are legal but probably not what was meant (each with its fix)."""


def _line(sampler: Any) -> str:
    """The sampler's own account of its mode, or a custom sampler's bound."""
    if isinstance(sampler, DescribesMode):
        return sampler.describe()
    return (
        f"custom sampler {sampler.name!r}: staleness <= {sampler.max_staleness} (its own "
        "documentation says more)"
    )


def describe(config: Config) -> ModeReport:
    """The mode, capacities and advice for a validated config (its sampler describes the
    mode and its capacity; no sampler is singled out by name)."""
    sampler = config.sampler
    sync = sampler.max_staleness == 0  # on-policy (sync), whichever sampler keeps it
    P, N = config.grpo.prompts_per_step, config.grpo.samples_per_prompt
    chunk = config.min_groups_for_streaming_train
    need = required_buffer_capacity(config)
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
            "drain first (at most %gs), then " % DRAIN_TIMEOUT_S
            if config.refit.drain
            else ""
        )
        + f"abort hopeless groups, load over {config.refit.transport} "
        f"({config.refit.bucket_size_mb} MiB buckets), invalidate the prefix cache; "
        + (
            "requests in flight recompute their KV cache, then go on"
            if in_flight_at_refit(sampler) == "reprefill"
            else "requests in flight go on"
        ),
    }
    if config.cluster.placement == "take_turns":
        capacities["placement"] = (
            "take turns: the engines sleep while the trainer steps (one chunk per step), the "
            "refit wakes them; samples in flight at the switch "
            + ("are drained first (at most %gs), the rest " % DRAIN_TIMEOUT_S
               if config.refit.drain else "")
            + "stop, and go on from their tokens after the wake (prefilled again by the new "
            "weights)"
        )  # fmt: skip
    capacities["objective"] = objective(config)
    advice = _objective_advice(config, chunk < P)
    if chunk < P and sync:
        advice.append(
            "pipeline.min_groups_for_streaming_train: in sync mode the whole batch is "
            "generated before training can start anyway, so chunks only add trainer round "
            f"trips. Fix: set it to prompts_per_step ({P}) or 0"
        )
    if config.refit.drain and sync:
        advice.append("refit.drain: sync mode has nothing in flight at a refit. Fix: remove it")
    if in_flight_at_refit(sampler) == "reprefill" and (sync or config.refit.drain):
        advice.append(
            "pipeline.sampler.in_flight_at_refit: nothing is in flight at a refit (sync mode or "
            'refit.drain), so there is nothing to re-prefill. Fix: remove it'
        )
    if config.max_inflight_samples < P * N and sync:
        advice.append(
            f"pipeline.max_inflight_samples: {config.max_inflight_samples} < P * N = {P * N}, "
            "so a sync step generates its batch in several waves. Fix: raise it if the engines "
            "can run P * N samples at once"
        )
    return ModeReport(_line(sampler), capacities, advice)


def objective(config: Config) -> str:
    """What a step optimizes, in one line: the advantage estimator, the ratio, its clip, the
    proximal policy and the off-policy correction (docs/losses.md)."""
    g, loss = config.grpo, config.loss
    estimator = g.advantage_estimator
    if estimator == "grpo":
        estimator += " advantages (r - group mean)" + (" / group std" if g.normalize_advantages
                                                       else ", not divided by the std (Dr. GRPO)")  # fmt: skip
    elif estimator == "rloo":
        estimator += " advantages (r - the mean of the group's other samples)"
    else:
        estimator += " advantages (r - group mean, normalized over each chunk)"
    ratio = "GSPO's sequence ratio" if loss.ratio_level == "sequence" else "a token ratio"
    proximal = loss.proximal_policy
    against = ("the trainer's own logprobs at the step's start (decoupled PPO)"
               if proximal == "current" else "the generator's logprobs")  # fmt: skip
    if proximal == "current" and g.updates_per_step > 1:
        against += ", recomputed by a refresh forward before the first optimizer step"
    correction = {
        "tis": f"the trainer/generator ratio truncated at {loss.is_cap:g}",
        "token_mask": f"tokens whose trainer/generator ratio leaves [{loss.mismatch_low:g}, "
                      f"{loss.mismatch_high:g}] masked",
        "sequence_mask": f"sequences whose geometric-mean ratio leaves [{loss.mismatch_low:g}, "
                         f"{loss.mismatch_high:g}] masked",
        "none": "no correction",
    }[loss.correction]  # fmt: skip
    if proximal != "current" and loss.correction in ("tis", "none"):
        correction = "importance weight 1 (the proximal policy is the generator's)"
    rewards = ""
    if g.reward_weights:
        terms = " + ".join(f"{w:g}*{k}" for k, w in sorted(g.reward_weights.items()))
        each = ", each normalized in its group" if g.reward_normalization == "group" else ""
        rewards = f"rewards {terms}{each}; "
    aggregation = {
        "token_mean": "token-mean over the step",
        "sequence_mean": "each sequence's token-mean, averaged over the step's sequences",
        "constant": f"token sum / (sequences x "
                    f"{loss.aggregation_constant or g.max_new_tokens}) (Dr. GRPO)",
    }[loss.aggregation]  # fmt: skip
    return (f"{rewards}{estimator}; {ratio} against {against}, clipped to "
            f"[{1 - loss.clip_eps_low:g}, {1 + loss.clip_eps_high:g}]; {correction}; "
            f"{aggregation}{_kl_and_steps(config)}")  # fmt: skip


def _kl_and_steps(config: Config) -> str:
    """The objective line's tail: the KL term and the optimizer steps per RL step."""
    g, loss = config.grpo, config.loss
    out = ""
    if loss.kl_coef:
        reference = loss.reference_path or "the initial weights"
        where = ("in the loss" if loss.kl_in == "loss"
                 else "subtracted from each sample's reward")  # fmt: skip
        out += (f"; KL to {reference} ({loss.kl_estimator}, x {loss.kl_coef:g}, {where}: a "
                "reference forward per step)")
    if g.updates_per_step > 1:
        out += (f"; {g.updates_per_step} optimizer steps per RL step "
                f"({g.update_epochs} pass(es) of {g.mini_steps} mini-batch(es))")
    return out


def _objective_advice(config: Config, streaming: bool) -> list[str]:
    """Objective settings that are legal but probably not what was meant."""
    g, advice = config.grpo, []
    if g.advantage_estimator == "reinforce_pp" and streaming:
        advice.append(
            "grpo.advantage_estimator = reinforce_pp normalizes over each chunk the trainer "
            "gets, and with pipeline.min_groups_for_streaming_train below prompts_per_step a "
            "step has several. Fix: set min_groups_for_streaming_train = 0 for one "
            "normalization over the step, or accept per-chunk statistics"
        )
    if not g.normalize_advantages and g.advantage_estimator != "grpo":
        advice.append(
            f"grpo.normalize_advantages = false applies to the grpo estimator only; "
            f"{g.advantage_estimator} ignores it. Fix: remove it"
        )
    loss = config.loss
    if g.dynamic_sampling and config.sampler.name == "dynamic":
        advice.append("grpo.dynamic_sampling with the dynamic sampler drops uniform groups "
                      "twice over (the sampler's own rule and the core's). Fix: use one: "
                      "grpo.dynamic_sampling = false, or another sampler")  # fmt: skip
    if loss.kl_in != "loss" and not loss.kl_coef:
        advice.append("loss.kl_in = reward does nothing while loss.kl_coef is 0. Fix: set "
                      "loss.kl_coef > 0, or remove loss.kl_in")  # fmt: skip
    if g.updates_per_step > 1:
        if streaming:
            advice.append(
                "with several optimizer steps per RL step, a step's chunks are refreshed as "
                "they stream in but trained only once all its groups are in (its mini-batches "
                "need the whole step). Fix: nothing, or set "
                "pipeline.min_groups_for_streaming_train = 0")  # fmt: skip
        if loss.proximal_policy == "behaviour":
            advice.append(
                "grpo.mini_steps/update_epochs > 1 with loss.proximal_policy = behaviour clip "
                "every mini-step's ratio against the generator's policy, which lags the "
                "trainer by the run's staleness. Fix: loss.proximal_policy = \"current\" "
                "(decoupled PPO: one refresh forward per step) clips against the weights "
                "before the step")  # fmt: skip
    return advice


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


def make_groups(cfg: Config, train_prompts: int = 0) -> LiveGroups:
    """The run's :class:`~asyncrl.policy.live.LiveGroups` with the configured sampler (a
    fresh one: it keeps state) and caps (``train_prompts``: the train split's size, for the
    ledger's epochs: each epoch drops the remainder of a batch)."""
    g = cfg.grpo
    per_step = g.prompts_per_step
    return LiveGroups(
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
