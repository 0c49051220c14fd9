"""``asyncrl check-config``'s mode report: each sampler describes its own mode and capacity;
the report singles out no sampler by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncrl.config import Config, EnvironmentConfig, ModelConfig, PipelineConfig, RefitConfig
from asyncrl.config.modes import describe
from asyncrl.policy.samplers import DescribesMode, OversampledConfig, OversampledSampler

# model_dir: the fixture in conftest.py


def config(model_dir: Path, sampler: Any, **sections: Any) -> Config:
    return Config(
        model=ModelConfig(path=str(model_dir)),
        environment=EnvironmentConfig(name="x"),
        pipeline=PipelineConfig(sampler=sampler),
        **sections,
    )


# The lines the report printed when modes.py switched on sampler names (written out by hand:
# moving them into the samplers must not change a word).
LINES = [
    ({"name": "in_order", "max_lookahead_versions": 0},
     "sync on-policy (in_order, max_lookahead_versions=0): every sample is trained against "
     "the weights that generated it"),
    ({"name": "in_order", "max_lookahead_versions": 2},
     "async, exact batch->step (in_order, max_lookahead_versions=2): batch k trains at step k; "
     "staleness <= 2; nothing wasted"),
    ({"name": "gated", "max_staleness_versions": 3},
     "streaming, gated dispatch (gated, max_staleness_versions=3): any complete groups, "
     "oldest first; staleness <= 3; nothing wasted"),
    ({"name": "oversampled", "max_staleness_versions": 1, "over_sampling_ratio": 1.5},
     "streaming, over-sampled (oversampled, max_staleness_versions=1, over_sampling_ratio=1.5): "
     "dispatch never waits for the trainer; staleness <= 1; groups that fall out of the window "
     "are wasted"),
    ({"name": "ready_first", "max_staleness_versions": 2},
     "streaming, ready first (ready_first, max_staleness_versions=2): whatever completes first; "
     "staleness <= 2; stragglers past the window are wasted"),
]  # fmt: skip


@pytest.mark.parametrize(("table", "line"), LINES, ids=[t["name"] for t, _ in LINES])
def test_each_built_in_sampler_describes_its_mode(
    model_dir: Path, table: dict[str, Any], line: str
) -> None:
    report = describe(config(model_dir, table))
    assert report.mode == line


def test_the_dapo_plugin_describes_its_own_mode(model_dir: Path) -> None:
    """``dynamic`` is an over-sampled sampler, but says what it adds (and its name)."""
    table = {"name": "dynamic", "max_staleness_versions": 2, "min_reward_std": 0.1}
    report = describe(config(model_dir, table))
    assert report.mode.startswith(
        "DAPO dynamic sampling (dynamic, max_staleness_versions=2, over_sampling_ratio=1.5, "
        "min_reward_std=0.1): "
    )
    assert "staleness <= 2" in report.mode
    assert report.capacities["max_buffered_groups"] == "72 (the sampler needs >= 72)"  # 1.5*16*3


class _Plain(OversampledSampler):
    """A custom sampler that does not describe itself."""

    name = "plain"
    describe = None  # type: ignore[assignment]


def test_a_sampler_without_a_description_is_shown_by_its_bound(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = _Plain(OversampledConfig(max_staleness_versions=4))
    assert not isinstance(sampler, DescribesMode)
    cfg = config(model_dir, {"name": "oversampled"})
    monkeypatch.setitem(cfg.__dict__, "sampler", sampler)  # what Config.sampler holds
    assert describe(cfg).mode == (
        "custom sampler 'plain': staleness <= 4 (its own documentation says more)"
    )


def test_sync_advice_follows_the_bound_not_the_name(model_dir: Path) -> None:
    """The sync-mode advice is for any sampler whose bound is 0 versions (on-policy)."""
    sync = {"name": "in_order", "max_lookahead_versions": 0}
    drained = describe(config(model_dir, sync, refit=RefitConfig(drain=True)))
    assert [a.split(":")[0] for a in drained.advice] == ["refit.drain"]
    chunked = config(model_dir, sync)
    chunked = msgspec.structs.replace(
        chunked, pipeline=msgspec.structs.replace(chunked.pipeline, max_inflight_samples=8,
                                                  min_groups_for_streaming_train=4),
    )  # fmt: skip
    assert [a.split(":")[0] for a in describe(chunked).advice] == [
        "pipeline.min_groups_for_streaming_train", "pipeline.max_inflight_samples",
    ]  # fmt: skip
    async_ = config(model_dir, {"name": "gated"}, refit=RefitConfig(drain=True))
    assert describe(async_).advice == []


def test_the_objective_line_and_its_advice(model_dir: Path) -> None:
    from asyncrl.config import GRPOConfig, LossConfig

    table = {"name": "gated", "max_staleness_versions": 1}
    report = describe(config(model_dir, table))
    assert report.capacities["objective"] == (
        "grpo advantages (r - group mean) / group std; a token ratio against the generator's "
        "logprobs, clipped to [0.8, 1.2]; importance weight 1 (the proximal policy is the "
        "generator's); token-mean over the step"
    )
    assert not report.advice
    streamed = describe(Config(
        model=ModelConfig(path=str(model_dir)), environment=EnvironmentConfig(name="x"),
        pipeline=PipelineConfig(sampler=table, min_groups_for_streaming_train=2),
        grpo=GRPOConfig(prompts_per_step=8, advantage_estimator="reinforce_pp",
                        normalize_advantages=False, reward_weights={"format": 0.2, "correct": 1},
                        reward_normalization="group"),
        loss=LossConfig(correction="token_mask", ratio_level="sequence", aggregation="constant",
                        proximal_policy="current"),
    ))  # fmt: skip
    assert streamed.capacities["objective"] == (
        "rewards 1*correct + 0.2*format, each normalized in its group; "
        "reinforce_pp advantages (r - group mean, normalized over each chunk); GSPO's sequence "
        "ratio against the trainer's own logprobs at the step's start (decoupled PPO), clipped "
        "to [0.8, 1.2]; tokens whose trainer/generator ratio leaves [0.5, 2] masked; token sum "
        "/ (sequences x 16) (Dr. GRPO)"
    )
    assert [a.split(" ", 1)[0] for a in streamed.advice] == [
        "grpo.advantage_estimator", "grpo.normalize_advantages"]


def test_the_objective_line_names_the_kl_the_refresh_and_the_mini_steps(model_dir: Path) -> None:
    from asyncrl.config import GRPOConfig, LossConfig

    table = {"name": "gated", "max_staleness_versions": 1}

    def report(grpo: GRPOConfig, loss: LossConfig, chunk: int = 0):
        return describe(Config(
            model=ModelConfig(path=str(model_dir)), environment=EnvironmentConfig(name="x"),
            pipeline=PipelineConfig(sampler=table, min_groups_for_streaming_train=chunk),
            grpo=grpo, loss=loss,
        ))  # fmt: skip

    decoupled = report(GRPOConfig(mini_steps=2), LossConfig(proximal_policy="current",
                                                            kl_coef=0.05))  # fmt: skip
    assert decoupled.capacities["objective"].endswith(
        "against the trainer's own logprobs at the step's start (decoupled PPO), recomputed by "
        "a refresh forward before the first optimizer step, clipped to [0.8, 1.2]; the "
        "trainer/generator ratio truncated at 2; token-mean over the step; KL to the initial "
        "weights (k3, x 0.05, in the loss: a reference forward per step); 2 optimizer steps "
        "per RL step (1 pass(es) of 2 mini-batch(es))"
    )
    assert decoupled.advice == []
    stale = report(GRPOConfig(prompts_per_step=16, update_epochs=2),
                   LossConfig(kl_in="reward"), chunk=4)  # fmt: skip
    assert [a.split(" ", 2)[:2] for a in stale.advice] == [
        ["loss.kl_in", "="], ["with", "several"], ["grpo.mini_steps/update_epochs", ">"]]


def test_dynamic_sampling_twice_over_is_advised_against(model_dir: Path) -> None:
    from asyncrl.config import GRPOConfig

    both = describe(Config(
        model=ModelConfig(path=str(model_dir)), environment=EnvironmentConfig(name="x"),
        pipeline=PipelineConfig(sampler={"name": "dynamic", "max_staleness_versions": 1}),
        grpo=GRPOConfig(dynamic_sampling=True),
    ))  # fmt: skip
    assert any(a.startswith("grpo.dynamic_sampling with the dynamic sampler") for a in both.advice)
