"""A rollout worker that dies is started again in place (``failures.rollout_restarts``): its
groups go to the other workers (or wait for it), it is refitted to the current weights, and
the run finishes with every prompt trained once and the staleness bound kept. The budget
spent, the next death stops the run with one error that says so.

The victims are real processes: SIGKILL to the worker's pid (as the control plane saw it in
``Hello``), at a moment marked by the bigram backend's phase markers.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import structlog.testing

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.obs.timeline import read_records, spans  # noqa: E402
from integration_support import (  # noqa: E402
    assert_nothing_left, read_metrics, training, worker_pids,
)

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.usefixtures("no_stray_processes"),
    pytest.mark.timeout(240),
]


async def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    with anyio.fail_after(timeout_s):
        while not path.exists():
            await anyio.sleep(0.01)


def _check_trained_once(summary: asyncrl.RunSummary, cfg: Config) -> None:
    """Every step trained a full batch, no prompt lost or repeated, staleness within bound."""
    assert len(summary.steps) == cfg.run.num_steps
    trained = sum(e["trained"] for e in summary.ledger)
    assert trained == cfg.run.num_steps * cfg.grpo.prompts_per_step
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in summary.ledger), summary.ledger
    bound = cfg.pipeline.sampler.max_lookahead_versions  # in_order: staleness <= lookahead
    assert max(s["staleness_max"] for s in summary.steps) <= bound


async def _kill_when(ctl: asyncrl.Controller, victim: str, marker: Path) -> int:
    """SIGKILL ``victim`` once ``marker`` exists; returns its pid."""
    await _wait_for(marker)
    pid = worker_pids(ctl)[victim]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.parametrize(
    ("rollout_ranks", "victim", "phase", "transport"),
    [(2, "rollout:1", "generate", "shm"), (1, "rollout:0", "refit", "shm"),
     (2, "rollout:1", "generate", "nccl"), (2, "rollout:1", "refit", "nccl")],
    ids=["one-of-two-mid-generation", "the-only-one-mid-refit", "nccl-one-of-two-mid-generation",
         "nccl-one-of-two-mid-refit"],
)  # fmt: skip
async def test_a_killed_rollout_worker_is_restarted_and_the_run_finishes(
    make_config: Callable[..., Config], tmp_path: Path, rollout_ranks: int, victim: str,
    phase: str, transport: str,
) -> None:
    markers = tmp_path / "markers"
    cfg = make_config(
        run={"num_steps": 20},  # 0.37 s a step here; the restart took 2.1 s
        cluster={"rollout_ranks": rollout_ranks},
        generator={"options": {"token_delay_s": 0.003, "load_delay_s": 0.3,
                               "phase_marker_dir": str(markers)}},
        eval={"num_prompts": 8, "every_steps": 2},
        refit={"transport": transport},
    )
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        async with training(ctl) as result:
            while ctl.status().step < 2:  # a refit already happened
                await anyio.sleep(0.01)
            marker = markers / f"{victim.replace(':', '-')}.{phase}"
            marker.unlink(missing_ok=True)  # the next one, not one seen before
            killed = await _kill_when(ctl, victim, marker)
        new_pid = worker_pids(ctl)[victim]
    summary = result[0]
    assert new_pid != killed and pids[victim] == killed
    _check_trained_once(summary, cfg)
    restarts = [r for r in read_metrics(cfg) if r["kind"] == "worker_restarted"]
    assert [(r["worker"], r["exit_code"]) for r in restarts] == [(victim, -signal.SIGKILL)]
    assert [e["label"] for e in summary.evals][-1] == "end"
    assert_nothing_left(ctl, [killed, new_pid])
    # the run's timeline (asyncrl plot) shows the restart and every step's refit
    timeline = spans(read_records(cfg.run.output_dir))
    (restart,) = [s for s in timeline if s.lane == "restart"]
    assert restart.name == victim
    assert restart.end - restart.start == pytest.approx(restarts[0]["seconds"])
    assert len([s for s in timeline if s.lane == "refit"]) == cfg.run.num_steps


async def test_an_engine_killed_in_the_trainers_turn_starts_again_in_the_engines_turn(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    """``cluster.placement = "take_turns"``: rollout:1 is killed just after it fell asleep
    (the trainer's turn, which lasts at least ``step_delay_s``, 2 s). Its new process says Hello
    at once but gets its Init (and starts its engine) only once the step's refit gave the GPU
    back to the engines; the next switch to the trainer waits for it to serve and puts it to
    sleep with the other one. The run trains every prompt once."""
    markers = tmp_path / "markers"
    cfg = make_config(
        run={"num_steps": 3},
        cluster={"rollout_ranks": 2, "placement": "take_turns", "trainer_offload": "always"},
        trainer={"options": {"step_delay_s": 2.0}},  # a new process says Hello well within
        generator={"options": {"token_delay_s": 0.003, "load_delay_s": 0.05,
                               "phase_marker_dir": str(markers)}},
        eval={"num_prompts": 0},
    )  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        async with asyncrl.Controller(cfg) as ctl:
            async with training(ctl) as result:
                killed = await _kill_when(ctl, "rollout:1", markers / "rollout-1.sleep")
            new_pid = worker_pids(ctl)["rollout:1"]
    _check_trained_once(result[0], cfg)
    events = [(e["event"], e.get("worker")) for e in logs]

    def at(event: str, worker: str | None = "rollout:1", after: int = 0) -> int:
        return next(i for i, e in enumerate(events) if i >= after and e == (event, worker))

    dead = at("worker_restarting")
    held = at("worker_start_held", after=dead)  # its Hello, in the trainer's turn
    admitted = at("worker_start_admitted", after=held)  # the engines' turn: its Init
    assert admitted < at("worker_ready", after=dead)  # its engine started after that
    restarts = [r for r in read_metrics(cfg) if r["kind"] == "worker_restarted"]
    assert [r["worker"] for r in restarts] == ["rollout:1"]
    assert_nothing_left(ctl, [killed, new_pid])


async def test_a_crash_loop_spends_the_budget_and_stops_the_run(
    make_config: Callable[..., Config],
) -> None:
    """The worker SIGKILLs itself after 3 groups, every time it is started: two restarts,
    then the third death stops the run, naming the worker and the budget."""
    cfg = make_config(
        run={"num_steps": 1000},
        eval={"num_prompts": 0},
        generator={"options": {"crash_after_groups": 3}},
        failures={"rollout_restarts": 2},
    )
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.WorkerDiedError) as info:
        async with ctl:
            await ctl.train()
    err = info.value
    assert (err.group, err.rank, err.exit_code) == ("rollout", 0, -signal.SIGKILL)
    assert "restarted 2 times in this run" in str(err)
    assert "failures.rollout_restarts" in str(err)
    restarts = [r for r in read_metrics(cfg) if r["kind"] == "worker_restarted"]
    assert [r["restart"] for r in restarts] == [1, 2]
    assert_nothing_left(ctl)
