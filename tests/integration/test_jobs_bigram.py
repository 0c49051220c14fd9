"""A run of jobs (docs/jobs.md) end to end on the bigram engines: real processes and sockets,
one engine and one trainer shared by every job.

What each run must show: a failing job stops alone with its named error while the others run
to their end and learn exactly as they do alone, while jobs are added and stopped; a
controller killed with SIGKILL resumes every job from its own checkpoint, no prompt of any job
lost or trained twice; nothing left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl.checkpoints.directory import latest, open_checkpoint  # noqa: E402
from asyncrl.config.loading import from_dict  # noqa: E402
from asyncrl.run.controller import Controller  # noqa: E402
from integration_support import (  # noqa: E402
    assert_nothing_left, config_dict, controller_pid, launch, merge, to_toml, worker_pids,
)

pytestmark = pytest.mark.usefixtures("no_stray_processes")
TIMEOUT_S = 240

# job "a" trains in lockstep (no lookahead): what it trains depends on nothing but its seed,
# so a run of it beside other jobs must train exactly what a run of it alone does
LOCKSTEP = {"sampler": {"name": "in_order", "max_lookahead_versions": 0}}
JOBS: dict[str, dict[str, Any]] = {
    "a": {"run": {"seed": 1, "num_steps": 4}, "pipeline": LOCKSTEP},
    "b": {"run": {"seed": 2}, "environment": {"name": "repeat-digit-turns"}},
    "c": {"run": {"seed": 3},
          "environment": {"name": "repeat-digit",
                          "options": {"score_fault": "raise", "score_fault_after": 20}}},
    "d": {"run": {"seed": 4, "num_steps": 40}, "lr": 0.2, "weight": 2.0},
}  # fmt: skip


def _records(path: Path, kind: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _learning(out: Path, job: str) -> list[tuple[Any, ...]]:
    """What job ``job`` trained, step by step: the trainer's loss and gradient norm (from
    the batches it got) and the rewards."""
    return [(r["step"], r["loss"], r["grad_norm"], r["reward"], r["groups"])
            for r in _records(out / "jobs" / job / "metrics.jsonl", "train")]  # fmt: skip


async def _command(*argv: str) -> tuple[int, str]:
    """``asyncrl jobs ARGV`` as a user runs it from another shell (in a thread: it blocks
    until the run answers); its exit code and what it printed (stdout, else stderr)."""
    import contextlib
    import io

    from asyncrl.cli import main

    def run() -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["jobs", *argv])
        return code, (out.getvalue() if argv[0] == "list" else err.getvalue())

    return await anyio.to_thread.run_sync(run)


async def _run(cfg: Any) -> tuple[Any, dict[str, int]]:
    async with Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        summary = await ctl.train()
    assert_nothing_left(ctl, pids.values())
    return summary, pids


@pytest.mark.asyncio
async def test_four_jobs_one_failing_one_stopped_one_added_the_others_learn_as_alone(
    tmp_path: Path, model_dir: Path
) -> None:
    """Four jobs, two environments, one engine and one trainer: job c's reward raises after
    20 scores; once a has trained a step, job e is added through the controller's API and d
    is stopped, both with ``asyncrl jobs`` from another shell (which also lists the jobs,
    refuses a job the run does not have or a table that sets the model, and a request file
    that does not decode changes nothing). c stops with its error, d stops (its requests
    aborted, closed on every worker: it trains no more), e runs its steps from its own start, a and b run to their end, each
    with its own directory, checkpoints and metrics; a (lockstep) trains bit for bit what it
    trains alone in a run of its own."""
    slow = {"generator": {"options": {"token_delay_s": 0.002}}}
    cfg = from_dict(config_dict(model_dir, tmp_path / "four", run={"num_steps": 3}, **slow,
                                jobs=JOBS))  # fmt: skip
    async with Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        async with anyio.create_task_group() as tg:
            done: list[Any] = []

            async def train() -> None:
                done.append(await ctl.train())

            tg.start_soon(train)
            with anyio.fail_after(60):
                while not [j for j in ctl.jobs.list() if j["job"] == "a" and j["step"] >= 1]:
                    await anyio.sleep(0.01)
            with pytest.raises(ValueError, match="in this run already"):
                ctl.add_job("a", {})
            # from another shell: asyncrl jobs add / stop / list against the run's directory
            out = str(tmp_path / "four")
            assert await _command("add", out, "e", "--set", "run.seed=7",
                                  "--set", "run.num_steps=2") == (0, "")  # fmt: skip
            code, err = await _command("stop", out, "z")
            assert code == 1 and "no job 'z' in this run" in err, (code, err)
            code, err = await _command("add", out, "x", "--set", "model.path=/x")
            assert code == 1 and "jobs.x.model: is not a job's" in err
            (tmp_path / "four/jobs.d/inbox/0-hostile.json").write_bytes(b"\x00{not json")
            code, listed = await _command("list", out)
            states = dict(line.split()[:2] for line in listed.splitlines()
                          if line.split()[:1] in (["a"], ["b"], ["c"], ["d"], ["e"]))  # fmt: skip
            assert code == 0 and states["d"] == "running"  # 40 steps, until stopped below
            assert await _command("stop", out, "d") == (0, "")
            d_steps = len(_records(tmp_path / "four/jobs/d/metrics.jsonl", "train"))
            assert await ctl.jobs.stop("d") == "stopped"  # stopped already: said again
            with pytest.raises(KeyError, match="no job 'z'"):
                await ctl.jobs.stop("z")
            assert {j["job"] for j in ctl.status().jobs} == {"a", "b", "c", "d", "e"}
    assert_nothing_left(ctl, pids.values())
    assert not (tmp_path / "four/jobs.d").exists()  # the inbox goes with the run
    ended = {j["job"]: j for j in done[0].jobs}
    assert {n: (j["state"], j["step"]) for n, j in ended.items() if n not in "cd"} == {
        "a": ("finished", 4), "b": ("finished", 3), "e": ("finished", 2)}  # fmt: skip
    # d's last step may have been taken but not yet recorded when the stop came
    assert ended["d"]["state"] == "stopped" and ended["d"]["step"] in (d_steps, d_steps + 1)
    assert d_steps < 40 and ended["c"]["state"] == "failed"
    assert ended["c"]["error"].startswith("ScoreError:") and "testing knob" in ended["c"]["error"]
    assert len(_records(tmp_path / "four/jobs/d/metrics.jsonl", "train")) == d_steps
    assert [r["step"] for r in _records(tmp_path / "four/jobs/e/metrics.jsonl", "train")] == [1, 2]
    for name in "abe":
        checkpoint = Path(ended[name]["checkpoint"])
        assert checkpoint.parent == tmp_path / "four/checkpoints/jobs" / name
    run_metrics = tmp_path / "four/metrics.jsonl"
    assert [r["job"] for r in _records(run_metrics, "job_ended") if r["state"] == "failed"] == ["c"]
    c_ended = _records(tmp_path / "four/jobs/c/metrics.jsonl", "job_ended")
    assert c_ended[0]["state"] == "failed" and "ScoreError" in c_ended[0]["error"]

    alone = from_dict(config_dict(model_dir, tmp_path / "alone", run={"num_steps": 3},
                                  jobs={"a": JOBS["a"]}))  # fmt: skip
    await _run(alone)
    together = _learning(tmp_path / "four", "a")
    assert len(together) == 4 and together == _learning(tmp_path / "alone", "a")
    assert together[0][1:3] != _learning(tmp_path / "four", "d")[0][1:3]  # d is not a


def test_killed_with_sigkill_every_job_resumes_where_it_was(
    tmp_path: Path, model_dir: Path
) -> None:
    """``python -m asyncrl.launch`` with three jobs, a checkpoint after every step; the whole
    run is SIGKILLed once every job has saved one. ``--resume`` goes on with each job from its
    own newest checkpoint: each job's steps after it follow on, and its prompt ledger (kept in
    its checkpoints) has no prompt lost or trained twice."""
    data = merge(config_dict(model_dir, tmp_path / "out"), {
        "run": {"num_steps": 8}, "checkpoint": {"every_steps": 1, "keep_last": 8},
        "generator": {"options": {"token_delay_s": 0.002}}, "eval": {"num_prompts": 0},
        "jobs": {"a": {"run": {"seed": 1}}, "b": {"run": {"seed": 2, "num_steps": 6}},
                 "c": {"environment": {"name": "repeat-digit-turns"}}},
    })  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(to_toml(data) + "\n")
    jobs = tmp_path / "out/jobs"
    proc = launch(config)
    try:
        deadline = time.monotonic() + 120
        while not all(_records(jobs / j / "metrics.jsonl", "checkpoint") for j in "abc"):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.02)
        os.kill(controller_pid(proc), signal.SIGKILL)  # its own session: torchrun's rank 0
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.communicate()
    # each job's newest committed checkpoint (its record may not have been written yet)
    saved = {j: open_checkpoint(latest(tmp_path / "out/checkpoints/jobs" / j)).step
             for j in "abc"}  # fmt: skip
    before = {j: len(_records(jobs / j / "metrics.jsonl", "train")) for j in "abc"}
    resumed = launch(config, "--resume")
    out, _ = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, out[-4000:]
    for job, steps in (("a", 8), ("b", 6), ("c", 8)):
        assert f"job {job}: finished at step {steps} of {steps}" in out
        trained = [r["step"] for r in _records(jobs / job / "metrics.jsonl", "train")]
        assert trained[before[job]:] == list(range(saved[job] + 1, steps + 1)), (job, trained)
        ledger = _records(jobs / job / "metrics.jsonl", "ledger")[-1]["epochs"]
        assert sum(e["lost"] for e in ledger) == 0 and sum(e["repeated"] for e in ledger) == 0
        assert sum(e["trained"] for e in ledger) == steps * 4  # prompts_per_step = 4
