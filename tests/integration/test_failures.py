"""Failures the run survives, injected through the bigram backends' and the repeat-digit
environment's testing knobs (docs/testing.md): an engine that fails on one request (retried
with back-off), one that keeps failing (dropped, its step gets a fresh prompt), a request the
engine refuses for its own data (dropped at once), a reward function that raises or hangs
(the run stops naming the prompt, or drops the group), and a train step that fails on the
trainer (its groups go back and the step is trained again). Each budget, once spent, stops the
run with an error that names the cause and the fix."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.data.deadlines import abandoned_threads  # noqa: E402
from asyncrl.errors import RunError  # noqa: E402
from asyncrl.policy import failures as failure_policy  # noqa: E402
from asyncrl.run.scoring import ScoreTimeout  # noqa: E402
from integration_support import read_metrics  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

STEPS, P = 3, 4
FAULTY = [f"train:{i}" for i in range(0, 64, 4)]  # a quarter of the prompts


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries after 0.05 s (doubled), not RETRY_BACKOFF_S's 1 s: the tests stay quick."""
    monkeypatch.setattr(failure_policy, "RETRY_BACKOFF_S", 0.05)


async def _train(cfg: Config) -> asyncrl.RunSummary:
    async with asyncrl.Controller(cfg) as ctl:
        return await ctl.train()


def _sum(cfg: Config, key: str) -> int:
    return sum(r[key] for r in read_metrics(cfg) if r["kind"] == "train")


def _ledger(summary: asyncrl.RunSummary) -> tuple[int, dict[str, int], int, int]:
    dropped: dict[str, int] = {}
    for e in summary.ledger:
        for k, v in e["dropped"].items():
            dropped[k] = dropped.get(k, 0) + v
    trained = sum(e["trained"] for e in summary.ledger)
    return trained, dropped, sum(e["lost"] for e in summary.ledger), sum(
        e["repeated"] for e in summary.ledger
    )


async def test_an_engine_failure_is_retried(make_config: Callable[..., Config]) -> None:
    cfg = make_config(
        run={"num_steps": STEPS},
        generator={"options": {"fail_groups": ["g1", "g5"], "fail_times": 2}},
        eval={"num_prompts": 0},
    )
    summary = await _train(cfg)
    assert len(summary.steps) == STEPS
    assert _sum(cfg, "generation_retries") == 4  # two groups, two failed attempts each
    assert _ledger(summary) == (STEPS * P, {}, 0, 0)


async def test_a_group_that_keeps_failing_is_dropped_and_replaced(
    make_config: Callable[..., Config],
) -> None:
    """``in_order`` stamps groups for steps: the dropped group's step gets a fresh prompt."""
    cfg = make_config(
        run={"num_steps": STEPS},
        generator={"options": {"fail_groups": ["g2"], "fail_times": 99}},
        failures={"generation_retries": 1},
        eval={"num_prompts": 0},
    )
    summary = await _train(cfg)
    assert [s["groups"] for s in summary.steps] == [P] * STEPS
    assert _sum(cfg, "failed_groups") == 1 and _sum(cfg, "generation_retries") == 1
    assert _ledger(summary) == (STEPS * P, {"failed": 1}, 0, 0)

    strict = make_config(
        "strict",
        run={"num_steps": STEPS},
        generator={"options": {"fail_groups": ["g2"], "fail_times": 99}},
        failures={"generation_retries": 1, "max_failed_groups": 0},
        eval={"num_prompts": 0},
    )
    with pytest.raises(RunError, match=r"1 groups failed for good.*group g2 .*injected engine"
                       r" failure 2.*Fix: see the generation_failed"):  # fmt: skip
        await _train(strict)


async def test_a_request_at_fault_is_dropped_without_retry(
    make_config: Callable[..., Config], model_dir
) -> None:
    """Prompts are one digit: refusing the token of digit 3 drops every such group at once."""
    import json

    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = make_config(
        run={"num_steps": STEPS},
        pipeline={"sampler": {"name": "gated", "max_staleness_versions": 1}},
        generator={"options": {"request_error_token": vocab["3"]}},
        failures={"max_failed_groups": 100},
        eval={"num_prompts": 0},
    )
    summary = await _train(cfg)
    failed = _sum(cfg, "failed_groups")
    assert failed > 0 and _sum(cfg, "generation_retries") == 0
    trained, dropped, lost, repeated = _ledger(summary)
    assert (trained, dropped.get("failed"), lost, repeated) == (STEPS * P, failed, 0, 0)


@pytest.mark.parametrize("policy", ["fail_run", "drop_group"])
async def test_a_reward_function_that_raises(
    make_config: Callable[..., Config], policy: str
) -> None:
    cfg = make_config(
        run={"num_steps": STEPS},
        environment={"options": {"score_fault": "raise", "score_fault_prompts": FAULTY}},
        failures={"on_reward_error": policy},
        eval={"num_prompts": 0},
    )
    if policy == "fail_run":
        with pytest.raises(RunError, match=r"score\(\) raised ValueError.*prompt 'train:\d+'"):
            await _train(cfg)
        return
    summary = await _train(cfg)
    trained, dropped, lost, _ = _ledger(summary)
    assert trained == STEPS * P and dropped["failed"] >= 1 and lost == 0
    assert _sum(cfg, "failed_groups") == dropped["failed"]


@pytest.mark.parametrize("policy", ["fail_run", "drop_group"])
async def test_a_reward_function_that_hangs(
    make_config: Callable[..., Config], policy: str
) -> None:
    """``score()`` hangs (for 2 s) on a quarter of the prompts: each such call is abandoned at
    its 0.3 s deadline; the run stops naming the prompt and the deadline, or drops the groups
    and trains on. The abandoned threads return by themselves afterwards."""
    cfg = make_config(
        run={"num_steps": STEPS},
        environment={"options": {"score_fault": "hang", "score_fault_prompts": FAULTY,
                                 "score_fault_hang_s": 2.0}},
        failures={"on_reward_error": policy, "reward_timeout_s": 0.3, "max_failed_groups": 100},
        eval={"num_prompts": 0},
    )  # fmt: skip
    try:
        if policy == "fail_run":
            expected = (r"^environment 'repeat-digit' \(environment.name\): score\(\) did not "
                        r"return within 0.3 s \(failures.reward_timeout_s\) for prompt "
                        r"'train:\d+'")  # fmt: skip
            with pytest.raises(ScoreTimeout, match=expected):
                await _train(cfg)
            return
        summary = await _train(cfg)
        trained, dropped, lost, _ = _ledger(summary)
        assert trained == STEPS * P and dropped["failed"] >= 1 and lost == 0
        assert _sum(cfg, "failed_groups") == dropped["failed"]
    finally:
        deadline = time.monotonic() + 10  # each thread sleeps 2 s from its call's start
        while abandoned_threads():
            assert time.monotonic() < deadline, "an abandoned reward thread did not return"
            await anyio.sleep(0.05)


async def test_a_failed_train_step_is_trained_again(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(
        run={"num_steps": STEPS},
        trainer={"options": {"fail_chunk_at_step": 1, "fail_chunk_times": 1}},
        eval={"num_prompts": 0},
    )
    summary = await _train(cfg)
    assert [s["step_retries"] for s in summary.steps] == [0, 1, 0]
    assert _ledger(summary)[0] == STEPS * P

    strict = make_config(
        "strict",
        run={"num_steps": STEPS},
        trainer={"options": {"fail_chunk_at_step": 1, "fail_chunk_times": 5}},
        eval={"num_prompts": 0},
    )
    monkeypatch.setattr(failure_policy, "TRAIN_STEP_RETRIES", 2)
    with pytest.raises(RunError, match=r"step 1 failed 3 times \(asyncrl.policy.failures."
                       r"TRAIN_STEP_RETRIES = 2\).*injected train_chunk failure 3"):  # fmt: skip
        await _train(strict)
