"""Multi-turn episodes end to end with the bigram backends (real processes and sockets).

The ``repeat-digit-turns`` environment runs two turns per episode with a user turn between
(``asyncrl_example_backend.testenv``); the controller runs the episodes, each turn one request
on a rollout worker, and trains the generated tokens only. What the runs must show: every step
trained on whole episodes (two turns each), evaluations by greedy episodes, an episode that
raises failing its group (retried, then dropped) but never the run, and nothing left behind.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.errors import ConfigError  # noqa: E402
from asyncrl.policy import failures as failure_policy  # noqa: E402
from integration_support import assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]


@pytest.mark.parametrize("rollout_ranks", [1, 2])
async def test_episodes_train_and_evaluate(
    make_config: Callable[..., Config], rollout_ranks: int
) -> None:
    num_steps = 3
    cfg = make_config(
        environment={"name": "repeat-digit-turns"},
        run={"num_steps": num_steps},
        cluster={"rollout_ranks": rollout_ranks},
        grpo={"max_new_tokens": 4},
        episode={"max_turns": 2, "max_context_tokens": 64},
    )
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        summary = await ctl.train()

    records = read_metrics(cfg)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    P, N = cfg.grpo.prompts_per_step, cfg.grpo.samples_per_prompt
    assert all(r["groups"] == P for r in train)
    # episodes end (and are counted) whenever they finish: at least one step's worth ended
    assert sum(r["episodes"] for r in train) >= num_steps * P * N
    assert all(r["episode_turns_mean"] == 2.0 for r in train if r["episodes"])
    assert all(r["episode_failed"] == 0 and r["episode_splits"] == 0 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(e["label"], e["num_prompts"]) for e in evals] == [("start", 4), ("end", 4)]
    assert [e["label"] for e in summary.evals] == ["start", "end"]
    assert_nothing_left(ctl, pids.values())


async def test_a_broken_agent_fails_its_group_not_the_run(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The episodes of the prompts of one digit raise: each time such a group fails (its
    other episodes cancelled), it is retried after a back-off, then dropped for good and
    counted; the run trains every step."""
    cfg = make_config(
        environment={"name": "repeat-digit-turns", "options": {"fail_digits": ["7"]}},
        run={"num_steps": 3},
        grpo={"max_new_tokens": 4},
        failures={"generation_retries": 1, "max_failed_groups": 64},
        eval={"num_prompts": 0},
    )
    monkeypatch.setattr(failure_policy, "RETRY_BACKOFF_S", 0.05)
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        summary = await ctl.train()
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert len(train) == 3 and len(summary.steps) == 3
    # each such group failed twice (its first try, its retry) and was dropped for good
    dropped = sum(e["dropped"].get("failed", 0) for e in summary.ledger)
    assert dropped >= 1 and sum(r["episode_failed"] for r in train) >= 2 * dropped
    assert_nothing_left(ctl, pids.values())


@pytest.mark.parametrize("in_flight", ["continue", "reprefill"])
async def test_turns_in_flight_at_a_refit_go_on_and_keep_the_bound_per_token(
    make_config: Callable[..., Config], in_flight: str
) -> None:
    """Slow tokens (10 ms each) and streaming (gated, W = 1): turns are in flight at every
    refit and go on with the new weights (re-prefilled first, or not, as the sampler says);
    nothing is thrown away, some trained tokens were generated after a refit, and no trained
    token is older than its group nor more than W versions behind the trainer."""
    num_steps = 4
    cfg = make_config(
        environment={"name": "repeat-digit-turns"},
        run={"num_steps": num_steps},
        grpo={"max_new_tokens": 6},
        episode={"max_turns": 2, "max_context_tokens": 64},
        generator={"options": {"token_delay_s": 0.01}},
        pipeline={"sampler": {"name": "gated", "max_staleness_versions": 1,
                              "in_flight_at_refit": in_flight}},
    )  # fmt: skip
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        await ctl.train()
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    for r in train:
        assert 0 <= r["token_staleness_max"] <= r["staleness_max"] <= 1, r
        assert r["token_staleness_mean"] <= r["staleness_mean"] + 1e-9, r
        assert sum(r["token_staleness_hist"].values()) > 0
        assert r["aborted_groups"] == 0 and r["wasted_samples"] == 0
    assert sum(r["tokens_after_refit"] for r in train) > 0, train
    assert sum(r["inflight_at_refit"] for r in train) > 0
    assert_nothing_left(ctl, pids.values())


async def test_weighted_reward_components_train_and_a_missing_one_is_named(
    make_config: Callable[..., Config],
) -> None:
    """grpo.reward_weights trains on the episodes' named components (group-normalized), and
    the components are logged per step; naming one the environment never gives stops the run
    at the first step with the error that names it (the run's processes end with it)."""
    cfg = make_config(
        environment={"name": "repeat-digit-turns"}, run={"num_steps": 2},
        grpo={"max_new_tokens": 4, "reward_weights": {"first": 1.0, "second": 0.5},
              "reward_normalization": "group"},
        eval={"num_prompts": 0},
    )  # fmt: skip
    async with asyncrl.Controller(cfg) as ctl:
        summary = await ctl.train()
    assert len(summary.steps) == 2
    assert all({"reward/first", "reward/second"} <= r.keys() for r in summary.steps)
    bad = make_config(
        environment={"name": "repeat-digit-turns"}, run={"num_steps": 2},
        grpo={"max_new_tokens": 4, "reward_weights": {"first": 1.0, "third": 0.5}},
        eval={"num_prompts": 0},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="'third'.*repeat-digit-turns"):
        async with asyncrl.Controller(bad) as ctl:
            pids = worker_pids(ctl)
            await ctl.train()
    assert_nothing_left(ctl, pids.values())
