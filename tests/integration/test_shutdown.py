"""The shutdown matrix: however the ``async with Controller(...)`` block ends, the right error
comes out and nothing is left behind (processes, the socket directory, shared memory).

=============================== ==============================================================
case                            expected
=============================== ==============================================================
success                         ``train()`` returns; clean exit
exception in the host's body    that exception, unchanged
host cancellation               the host's cancel scope catches it; the exit is prompt
worker fails at start           ``WorkerStartupError`` naming the worker and its log
worker SIGKILLed mid-run        ``WorkerDiedError`` naming group, rank, exit code -9 and log
bad environment option          ``ConfigError`` naming it, before anything exists
=============================== ==============================================================
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from integration_support import assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]


class HostError(Exception):
    """Raised by the test itself inside the ``async with`` body."""


async def _wait_for_steps(ctl: asyncrl.Controller, n: int) -> None:
    with anyio.fail_after(60):
        while ctl.status().step < n:
            await anyio.sleep(0.02)


def _slow(make_config: Callable[..., Config], **sections: dict) -> Config:
    """A run long enough to be interrupted mid-way."""
    return make_config(
        run={"num_steps": 1000},
        generator={"options": {"token_delay_s": 0.002}},
        eval={"num_prompts": 0},
        **sections,
    )


async def test_success_leaves_nothing(make_config: Callable[..., Config]) -> None:
    cfg = make_config(run={"num_steps": 2}, eval={"num_prompts": 0})
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        summary = await ctl.train()
    assert len(summary.steps) == 2
    assert_nothing_left(ctl, pids.values())


async def test_exception_in_body_propagates_and_cleans_up(
    make_config: Callable[..., Config],
) -> None:
    cfg = _slow(make_config)
    with pytest.raises(HostError, match="host gave up"):
        async with asyncrl.Controller(cfg) as ctl:
            pids = worker_pids(ctl)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctl.train)
                await _wait_for_steps(ctl, 1)  # the pumps are running
                raise HostError("host gave up")
    assert_nothing_left(ctl, pids.values())


async def test_host_cancellation_mid_run(make_config: Callable[..., Config]) -> None:
    """The host's deadline falls in the middle of training: the block is cancelled, the
    workers leave on the Shutdown message (no signal needed) well within the grace period."""
    cfg = _slow(make_config, cluster={"shutdown_grace_s": 10.0})
    with anyio.move_on_after(120) as scope:
        async with asyncrl.Controller(cfg) as ctl:
            pids = worker_pids(ctl)
            # now that the workers are up, let the deadline fall in the middle of training
            scope.deadline = anyio.current_time() + 1.5
            deadline = time.monotonic() + 1.5
            await ctl.train()
            pytest.fail("train() of 1000 steps returned before the deadline")
    took = time.monotonic() - deadline
    assert scope.cancelled_caught
    steps = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert 0 < len(steps) < 1000, "the deadline did not fall mid-run"
    assert_nothing_left(ctl, pids.values())
    assert took < cfg.cluster.shutdown_grace_s, f"shutdown took {took:.1f} s: signals were needed"
    for name in pids:
        log = os.path.join(cfg.run.output_dir, "logs", f"{name.replace(':', '-')}.log")
        assert "worker_stopping" in Path(log).read_text(), f"{name} did not leave on Shutdown"


@pytest.mark.parametrize("group", ["rollout", "trainer"])
async def test_worker_failing_at_start(make_config: Callable[..., Config], group: str) -> None:
    section = "generator" if group == "rollout" else "trainer"
    cfg = make_config(**{section: {"options": {"fail_at_start": True}}})
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.WorkerStartupError) as info:
        async with ctl:
            pytest.fail("entered the block although a worker failed to start")
    message = str(info.value)
    assert f"{group}:0" in message
    assert f"{section}.options.fail_at_start" in message  # the worker's own reason
    log_path = os.path.join(cfg.run.output_dir, "logs", f"{group}-0.log")
    assert log_path in message
    assert "fail_at_start" in Path(log_path).read_text()
    assert_nothing_left(ctl)


async def test_worker_killing_itself_mid_run(make_config: Callable[..., Config]) -> None:
    """The generator SIGKILLs itself after 6 groups (``crash_after_groups``)."""
    cfg = make_config(
        run={"num_steps": 1000}, eval={"num_prompts": 0},
        generator={"options": {"crash_after_groups": 6}},
        failures={"rollout_restarts": 0},  # restarts: tests/integration/test_restarts.py
    )
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.WorkerDiedError) as info:
        async with ctl:
            pids = worker_pids(ctl)
            await ctl.train()
    err = info.value
    assert (err.group, err.rank, err.exit_code) == ("rollout", 0, -signal.SIGKILL)
    assert err.log_path == os.path.join(cfg.run.output_dir, "logs", "rollout-0.log")
    assert "rollout:0" in str(err) and "-9" in str(err) and err.log_path in str(err)
    assert_nothing_left(ctl, pids.values())


@pytest.mark.parametrize(("victim", "rollout_ranks"), [("trainer:0", 1), ("rollout:1", 2)])
async def test_worker_killed_by_the_host_mid_run(
    make_config: Callable[..., Config], victim: str, rollout_ranks: int
) -> None:
    """The host SIGKILLs a worker it learned from the control plane's peers. With two rollout
    ranks, torchrun then stops the other one as well: still one error, for the victim."""
    cfg = _slow(
        make_config, cluster={"rollout_ranks": rollout_ranks}, failures={"rollout_restarts": 0}
    )
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.WorkerDiedError) as info:
        async with ctl:
            pids = worker_pids(ctl)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctl.train)
                await _wait_for_steps(ctl, 1)
                os.kill(pids[victim], signal.SIGKILL)
                await anyio.sleep_forever()  # the controller must end this block
    err = info.value
    group, rank = victim.split(":")
    assert (err.group, err.rank, err.exit_code) == (group, int(rank), -signal.SIGKILL)
    assert err.log_path == os.path.join(cfg.run.output_dir, "logs", f"{group}-{rank}.log")
    assert_nothing_left(ctl, pids.values())


async def test_bad_environment_option_fails_before_anything_exists(
    make_config: Callable[..., Config],
) -> None:
    cfg = make_config(environment={"options": {"num_trian": 3}})
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.ConfigError, match="num_trian"):
        async with ctl:
            pytest.fail("entered the block with a bad environment option")
    assert ctl.addresses is None, "sockets were bound (and a run directory made) regardless"
    assert not Path(cfg.run.output_dir, "logs").exists()


@pytest.mark.parametrize(
    ("fault", "says"),
    [("raise", "score() raised ValueError: cannot parse"), ("nan", "non-finite reward (nan)")],
)
async def test_a_bad_reward_ends_the_run_naming_the_environment(
    make_config: Callable[..., Config], fault: str, says: str
) -> None:
    """A reward function that raises, or returns NaN, ends the run with one RunError line
    naming the environment, the prompt and the completion (not an advantages error deep in
    the trainer, not a 170-line traceback)."""
    cfg = make_config(
        run={"num_steps": 50},
        environment={"options": {"score_fault": fault, "score_fault_after": 40}},
        eval={"num_prompts": 0},
    )
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.RunError) as info:
        async with ctl:
            pids = worker_pids(ctl)
            await ctl.train()
    message = str(info.value)
    assert message.startswith("environment 'repeat-digit' (environment.name): ")
    assert says in message and "for prompt 'train:" in message and "\n" not in message
    assert_nothing_left(ctl, pids.values())


async def test_plugin_mistakes_fail_before_anything_exists(
    make_config: Callable[..., Config],
) -> None:
    """Backend options are checked by the backend's plugin in the controller, before any
    process is spawned; an unknown environment names environment.name."""
    cfg = make_config(generator={"options": {"token_dleay_s": 0.1}})
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.ConfigError) as info:
        async with ctl:
            pytest.fail("entered the block with a bad generator option")
    assert str(info.value).startswith(
        "generator.options.token_dleay_s: unknown key. Fix: did you mean 'token_delay_s'?"
    )
    assert ctl.addresses is None and not Path(cfg.run.output_dir, "logs").exists()

    ctl = asyncrl.Controller(make_config("env", environment={"name": "repeat-digits"}))
    with pytest.raises(asyncrl.PluginError, match=r"^environment.name: no environment named "
                                                  r"'repeat-digits' is installed"):
        async with ctl:
            pytest.fail("entered the block with an unknown environment")
    assert ctl.addresses is None
