"""Every asynchrony mode through the real controller and real worker processes (bigram engine).

The workload has stragglers: sample lengths are log-normal (median 3 tokens, p99 about 10x)
and every token takes 4 ms, so groups finish out of order and some take far longer than
others. What each run must show, from its metrics.jsonl:

* every step trains exactly P groups, none staler than the mode's bound (staleness histogram);
* modes that promise no waste waste nothing; the others count what they evict or abort, and
  an abort is real: the engine cuts those samples short (finish reason ``abort``);
* the samples in flight never exceed ``pipeline.max_inflight_samples``;
* with ``refit.drain`` no sample is generating when the weights are swapped.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from integration_support import read_metrics

import asyncrl
from asyncrl.config import Config
from asyncrl.config.modes import describe
from asyncrl.run import refit as refit_module

pytestmark = pytest.mark.asyncio

P, N = 4, 4
WORKLOAD = {
    "grpo": {"prompts_per_step": P, "samples_per_prompt": N, "max_new_tokens": 40},
    "generator": {
        "backend": "bigram",
        "options": {"length_median": 3.0, "length_sigma": 1.0, "token_delay_s": 0.004},
    },
    "trainer": {"backend": "bigram", "options": {"lr": 0.5, "step_delay_s": 0.03}},
    "run": {"num_steps": 6},
    "eval": {"num_prompts": 0},
}

MODES = {
    "sync": ({"name": "in_order", "max_lookahead_versions": 0}, 0, True),
    "in_order-2": ({"name": "in_order", "max_lookahead_versions": 2}, 2, True),
    "gated": ({"name": "gated", "max_staleness_versions": 1}, 1, True),
    "oversampled": (
        {"name": "oversampled", "max_staleness_versions": 1, "over_sampling_ratio": 2.0},
        1,
        False,
    ),
    "ready_first": ({"name": "ready_first", "max_staleness_versions": 1}, 1, False),
    "dynamic": (
        {"name": "dynamic", "max_staleness_versions": 1, "over_sampling_ratio": 2.0},
        1,
        False,
    ),
}


async def run(make_config: Callable[..., Config], name: str, **over) -> list[dict]:
    sections = {**WORKLOAD, **over}
    config = make_config(name, **sections)
    async with asyncrl.Controller(config) as ctl:
        summary = await ctl.train()
    assert len(summary.steps) == config.run.num_steps
    return [r for r in read_metrics(config) if r["kind"] == "train"]


@pytest.mark.parametrize("mode", list(MODES))
async def test_mode_keeps_its_bound_and_accounts_for_every_group(
    make_config: Callable[..., Config], mode: str
) -> None:
    sampler, bound, waste_free = MODES[mode]
    steps = await run(
        make_config,
        mode,
        pipeline={
            "sampler": sampler,
            "min_groups_for_streaming_train": 2,
            "max_inflight_samples": 3 * N,
        },
    )
    for r in steps:
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        assert sum(hist.values()) == r["groups"] == P, r
        assert max(hist) <= bound, (mode, hist)
        assert r["inflight_samples_max"] <= 3 * N
        assert 0 <= r["gen_s"] and r["gen_start"] <= r["gen_end"]  # this step's own groups
        if waste_free:
            assert r["wasted_samples"] == 0 and r["aborted_samples"] == 0, r
        assert r["wasted_samples"] == N * (r["evicted_groups"] + r["aborted_groups"])
        assert (
            r["aborted_samples"] <= N * r["aborted_groups"] + N * P
        )  # bounded by what was aborted
    if mode == "sync":
        assert all(r["staleness_max"] == 0 and r["inflight_at_refit"] == 0 for r in steps)
        # the next batch waits for each refit, and the trainer for each batch
        assert sum(r["gate_wait_s"] for r in steps) > 0 and all(r["wait_s"] > 0 for r in steps)
        # the workers' own accounts: the trainer sleeps 0.03 s per FinishStep (step_delay_s)
        for r in steps:
            assert 0.03 <= r["trainer_compute_s"] <= r["train_s"] + 0.01, r
            assert 0 < r["engine_busy_s"] and 0 < r["refit_work_s"] <= r["refit_s"], r
            assert 0 < r["refit_pack_s"] <= r["refit_work_s"], r  # the sender's packing


SHIPPED = Path(__file__).parents[2] / "examples" / "modes"
SHIPPED_MODES = {  # config -> (staleness bound, wastes nothing)
    "sync.toml": (0, True),
    "async_in_order.toml": (1, True),
    "gated.toml": (1, True),
    "oversampled.toml": (1, False),
    "ready_first.toml": (1, False),
}


@pytest.mark.parametrize("name", sorted(p.name for p in SHIPPED.glob("*.toml")))
async def test_each_shipped_mode_config_keeps_its_bound(
    make_config: Callable[..., Config], name: str
) -> None:
    """Each shipped mode config's ``[grpo]`` and ``[pipeline]`` (examples/modes), on the bigram
    engine under this module's long-tail generation: the mode ``asyncrl check-config`` states,
    its staleness bound and its waste. (tests/e2e/test_example_modes.py runs two of them as
    shipped, on vLLM and FSDP2.)"""
    assert name in SHIPPED_MODES, f"a new mode config: add its bound and waste to SHIPPED_MODES"
    bound, waste_free = SHIPPED_MODES[name]
    shipped = tomllib.loads((SHIPPED / name).read_text())
    over = {"grpo": shipped["grpo"], "pipeline": shipped["pipeline"], "run": {"num_steps": 3}}
    mode = describe(make_config(name, **{**WORKLOAD, **over})).mode
    assert f"staleness <= {bound}" in mode or (bound == 0 and "on-policy" in mode), mode
    steps = await run(make_config, name, **over)
    P = shipped["grpo"]["prompts_per_step"]
    for r in steps:
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        assert sum(hist.values()) == P and max(hist) <= bound, (name, hist)
        if waste_free:
            assert r["wasted_samples"] == 0, r
    if bound == 0:
        assert all(r["inflight_at_refit"] == 0 for r in steps)  # nothing spans a refit


async def test_oversampling_aborts_in_the_engine_at_refit(
    make_config: Callable[..., Config],
) -> None:
    """Long stragglers (p99 far above the median) under a tight window: the refit after which
    they can no longer train aborts them, and the engine really cuts them short."""
    steps = await run(
        make_config,
        "abort",
        generator={
            "backend": "bigram",
            "options": {"length_median": 2.0, "length_sigma": 1.6, "token_delay_s": 0.004},
        },
        grpo={"prompts_per_step": P, "samples_per_prompt": N, "max_new_tokens": 200},
        pipeline={
            "sampler": {
                "name": "oversampled",
                "max_staleness_versions": 1,
                "over_sampling_ratio": 2.0,
            },
            "min_groups_for_streaming_train": 1,
        },
        run={"num_steps": 8},
    )
    aborted = sum(r["aborted_groups"] for r in steps)
    cut = sum(r["aborted_samples"] for r in steps)
    assert aborted > 0, steps
    assert 0 < cut <= N * aborted  # the engine returned them cut short ("abort")
    assert all(max(int(k) for k in r["staleness_hist"]) <= 1 for r in steps)


async def test_drain_leaves_nothing_in_flight_at_the_refit(
    make_config: Callable[..., Config],
) -> None:
    steps = await run(
        make_config,
        "drain",
        refit={"drain": True},
        pipeline={"sampler": {"name": "in_order", "max_lookahead_versions": 1}},
    )
    assert all(r["inflight_at_refit"] == 0 and r["drain_timeouts"] == 0 for r in steps), steps
    assert any(r["drain_s"] > 0 for r in steps)


async def test_drain_timeout_lets_the_refit_go_ahead(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(refit_module, "DRAIN_TIMEOUT_S", 0.05)
    steps = await run(
        make_config,
        "drain-timeout",
        generator={
            "backend": "bigram",
            "options": {"length_median": 40.0, "length_sigma": 0.1, "token_delay_s": 0.02},
        },
        refit={"drain": True},
        pipeline={"sampler": {"name": "in_order", "max_lookahead_versions": 1}},
        run={"num_steps": 3},
    )
    assert any(r["drain_timeouts"] == 1 and r["inflight_at_refit"] > 0 for r in steps), steps


async def test_a_long_sample_does_not_hold_back_new_groups(
    make_config: Callable[..., Config],
) -> None:
    """With room for N + 1 samples in flight, a group whose other samples finished leaves
    room for the next group while its long sample runs: samples in flight exceed one group."""
    steps = await run(
        make_config,
        "backpressure",
        pipeline={
            "sampler": {
                "name": "oversampled",
                "max_staleness_versions": 2,
                "over_sampling_ratio": 2.0,
            },
            "min_groups_for_streaming_train": 1,
            "max_inflight_samples": N + 2,
        },
    )
    assert max(r["inflight_samples_max"] for r in steps) > N
    assert all(r["inflight_samples_max"] <= N + 2 for r in steps)


async def test_evicting_the_whole_buffer_wakes_the_rollout_pump(
    make_config: Callable[..., Config],
) -> None:
    """Fast samples, slow steps: everything dispatched at the start finishes before training
    and is buffered; two steps later the rest falls out of the window and is evicted with
    nothing in flight. The eviction frees the capacity the rollout pump was waiting for, so it
    must wake it (the run once hung here, each pump waiting for the other)."""
    steps = await run(
        make_config,
        "evict-all",
        generator={
            "backend": "bigram",
            "options": {"length_median": 2.0, "length_sigma": 0.1, "token_delay_s": 0.0},
        },
        trainer={"backend": "bigram", "options": {"lr": 0.5, "step_delay_s": 0.2}},
        pipeline={
            "sampler": {
                "name": "oversampled",
                "max_staleness_versions": 1,
                "over_sampling_ratio": 1.5,
            },
            "min_groups_for_streaming_train": 1,
        },
        run={"num_steps": 3},
    )
    assert sum(r["evicted_groups"] for r in steps) > 0, steps
    assert all(max(int(k) for k in r["staleness_hist"]) <= 1 for r in steps)


TURN_MODES = {  # mode -> its samples in flight at the switch: drained first (refit.drain)
    "sync": False, "in_order-2": False, "oversampled": False, "ready_first": True,
}


@pytest.mark.parametrize("mode", list(TURN_MODES))
async def test_each_mode_takes_turns_with_the_trainer(
    make_config: Callable[..., Config], mode: str
) -> None:
    """``cluster.placement = "take_turns"``: before each step trains, the engine sleeps (the
    samples in flight stop where they are, or end first with ``refit.drain``) and the
    trainers' state comes back; after the step, the state leaves and the refit wakes the
    engine. The mode's bound and its accounts hold as they do resident; in the asynchronous
    modes samples in flight at a switch go on after the wake (nothing is lost: every step
    trains P groups). The bigram trainer keeps its state in host memory, so nothing moves, but
    every move is asked for (``trainer_offload = "always"``)."""
    sampler, bound, waste_free = MODES[mode]
    drain = TURN_MODES[mode]
    steps = await run(
        make_config, f"turns-{mode}", pipeline={"sampler": sampler},
        cluster={"placement": "take_turns", "trainer_offload": "always"},
        refit={"drain": drain},
    )  # fmt: skip
    for i, r in enumerate(steps):
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        assert sum(hist.values()) == r["groups"] == P and max(hist) <= bound, (mode, hist)
        assert r["turn_sleep_s"] >= 0 and r["turn_to_trainer_s"] >= r["turn_sleep_s"], r
        assert "turn_state_to_host_s" in r and ("turn_state_to_device_s" in r) == (i > 0), r
        if waste_free:
            assert r["wasted_samples"] == 0, r
    held = sum(r["turn_held_requests"] for r in steps)
    if bound == 0 or drain:
        assert held == 0, steps  # nothing in flight at the switch
    else:
        assert held > 0, steps  # in flight at a switch, held across the sleep
