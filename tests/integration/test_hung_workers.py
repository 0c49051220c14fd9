"""A worker that stops answering without dying (SIGSTOP) is found by the heartbeat, named
and killed, and its death takes the retry policy's path: a rollout worker is restarted and
the run finishes every step; a trainer stops the run with a ``WorkerHungError`` naming it.
Each through the embedded controller and under ``torchrun -m asyncrl.launch``; after each,
no process of the run and no run file is left.

The heartbeat here probes every 0.5 s and calls a worker hung after 3 s of silence; the
times from the SIGSTOP to the kill and to the named error are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
import pytest
import structlog

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config, FailuresConfig  # noqa: E402
from asyncrl.errors import WorkerHungError  # noqa: E402
from asyncrl.procs.process import has_exited  # noqa: E402
from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from integration_support import (  # noqa: E402
    BASE,
    assert_nothing_left,
    merge,
    read_metrics,
    run_files,
    session_processes,
    to_toml,
    training,
    worker_pids,
)

pytestmark = [pytest.mark.usefixtures("no_stray_processes"), pytest.mark.timeout(240)]

TIMEOUT_S = 3.0
BEAT = {"heartbeat_timeout_s": TIMEOUT_S}
INTERVAL_S = FailuresConfig(**BEAT).heartbeat_interval_s
"""The probe interval the run derives from the timeout: 0.25 s (a twelfth of it)."""
EARLIEST_S = TIMEOUT_S - INTERVAL_S
"""SIGSTOP → kill, at least: the last answer may have come up to a tick before the stop."""
SILENT_MAX_S = TIMEOUT_S + 2 * INTERVAL_S
"""The silence a hung worker is found with, at most, on the heartbeat's own clock: its ticks
come an interval apart, and a tick more than an interval late has the lateness forgiven
(``HeartbeatTracker.tick``). The wall clock from the SIGSTOP has no such bound on a busy
machine; its figures are printed (``pytest -s``) and kept in docs/failures.md."""
HANG_GUARD_S = 60
"""How long to wait for the kill before the test gives up: a guard, not a bound."""
LAUNCH_S = 180
RUN = {"eval": {"num_prompts": 0}, "generator": {"options": {"token_delay_s": 0.003}}}
"""Every run here: no evaluation, and generation slow enough to be going on at the stop."""


def _report(what: str, seconds: float) -> None:
    print(f"\nheartbeat: {what}: {seconds:.2f} s (interval {INTERVAL_S} s, timeout {TIMEOUT_S} s)")


async def _until_exited(pid: int, within_s: float) -> float:
    """Seconds until ``pid`` has exited (a zombie counts), polled."""
    start = time.monotonic()
    with anyio.fail_after(within_s):
        while not has_exited(pid):
            await anyio.sleep(0.02)
    return time.monotonic() - start


async def _stop_until_hung(
    cfg: Config, worker: str
) -> tuple[WorkerHungError, dict[str, int], float]:
    """Run ``cfg`` embedded, SIGSTOP ``worker`` after two steps, and return the
    :class:`WorkerHungError` the controller raised, every worker's pid and the seconds from
    the stop to the error. After it, nothing of the run is left.

    Raises:
        Failed: the controller raised no WorkerHungError.
    """
    ctl = asyncrl.Controller(cfg)
    pids: dict[str, int] = {}
    start = time.monotonic()
    with pytest.raises(WorkerHungError) as info:
        async with ctl:
            pids.update(worker_pids(ctl))
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctl.train)
                while ctl.status().step < 2:
                    await anyio.sleep(0.01)
                os.kill(pids[worker], signal.SIGSTOP)
                start = time.monotonic()
    named_after = time.monotonic() - start
    assert_nothing_left(ctl, pids.values())
    return info.value, pids, named_after


# --------------------------------------------------------------------------- embedded
@pytest.mark.asyncio
async def test_embedded_a_stopped_rollout_worker_is_named_restarted_and_the_run_finishes(
    make_config: Callable[..., Config],
) -> None:
    cfg = make_config(
        run={"num_steps": 60},  # enough after the stop for the restart (3 s + 2 s)
        cluster={"rollout_ranks": 2},
        failures=BEAT,
        **RUN,
    )
    with structlog.testing.capture_logs() as logs:
        async with asyncrl.Controller(cfg) as ctl:
            async with training(ctl) as result:
                while ctl.status().step < 2:
                    await anyio.sleep(0.01)
                stopped = worker_pids(ctl)["rollout:1"]
                os.kill(stopped, signal.SIGSTOP)
                killed_after = await _until_exited(stopped, HANG_GUARD_S)
                with anyio.fail_after(60):  # its rank starts a new one (about 2 s)
                    while worker_pids(ctl).get("rollout:1") in (None, stopped):
                        await anyio.sleep(0.05)
            new_pid = worker_pids(ctl)["rollout:1"]
    _report("embedded rollout worker, SIGSTOP → killed", killed_after)
    assert killed_after >= EARLIEST_S, killed_after
    summary = result[0]
    assert new_pid != stopped
    assert len(summary.steps) == cfg.run.num_steps
    trained = sum(e["trained"] for e in summary.ledger)
    assert trained == cfg.run.num_steps * cfg.grpo.prompts_per_step
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in summary.ledger), summary.ledger
    (hung,) = [e for e in logs if e["event"] == "worker_hung"]
    assert (hung["group"], hung["rank"], hung["pid"]) == ("rollout", 1, stopped)
    assert hung["log"].endswith("rollout-1.log")
    assert TIMEOUT_S <= hung["silent_s"] <= SILENT_MAX_S, hung
    assert hung["last_answer"] is not None  # it had answered before it was stopped
    (restarted,) = [r for r in read_metrics(cfg) if r["kind"] == "worker_restarted"]
    assert (restarted["worker"], restarted["exit_code"]) == ("rollout:1", -signal.SIGKILL)
    assert restarted["error"].startswith("worker rollout:1 hung: it answered no health probe")
    assert_nothing_left(ctl, [stopped, new_pid])


@pytest.mark.asyncio
async def test_embedded_a_stopped_trainer_stops_the_run_with_a_named_hung_error(
    make_config: Callable[..., Config],
) -> None:
    cfg = make_config(run={"num_steps": 1000}, failures=BEAT, **RUN)
    err, pids, named_after = await _stop_until_hung(cfg, "trainer:0")
    _report("embedded trainer, SIGSTOP → WorkerHungError out of the controller", named_after)
    assert (err.group, err.rank, err.pid, err.exit_code) == (
        "trainer", 0, pids["trainer:0"], -signal.SIGKILL)
    assert err.log_path is not None and err.log_path.endswith("trainer-0.log")
    assert TIMEOUT_S <= err.silent_s <= SILENT_MAX_S and err.last_answer is not None
    text = str(err)
    assert text.startswith("worker trainer:0 hung: it answered no health probe for ")
    assert "its last answer came at " in text and f"its log: {err.log_path}" in text
    assert named_after >= EARLIEST_S, named_after
    stopped = [r for r in read_metrics(cfg) if r["kind"] == "stopped"]
    assert len(stopped) == 1 and "trainer:0 hung" in stopped[0]["deaths"][0]


@pytest.mark.asyncio
async def test_embedded_a_stopped_rollout_worker_without_restarts_stops_the_run(
    make_config: Callable[..., Config],
) -> None:
    """``failures.rollout_restarts = 0``: the hung rollout worker's death stops the run, and
    the error says it hung."""
    cfg = make_config(run={"num_steps": 1000}, failures={**BEAT, "rollout_restarts": 0}, **RUN)
    err, pids, _ = await _stop_until_hung(cfg, "rollout:0")
    assert (err.group, err.rank, err.pid) == ("rollout", 0, pids["rollout:0"])
    assert str(err).startswith("worker rollout:0 hung: it answered no health probe for ")
    assert not [r for r in read_metrics(cfg) if r["kind"] == "worker_restarted"]


# --------------------------------------------------------------------------- launch
class _Launch:
    """``torchrun --nproc-per-node N -m asyncrl.launch run.toml`` in a session of its own,
    its output read line by line with the time each line came."""

    def __init__(self, tmp_path: Path, model_dir: Path, nproc: int, **over: dict) -> None:
        data = merge(BASE, over)
        data["model"] = {"path": str(model_dir)}
        data["run"]["output_dir"] = "out"
        path = tmp_path / "run.toml"
        path.write_text(to_toml(data) + "\n")
        self.metrics = tmp_path / "out" / "metrics.jsonl"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            *torchrun_log_args(str(tmp_path / "torchrun")),  # not a /tmp/torchelastic_*
            "--standalone", "-m", "asyncrl.launch", str(path),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.metrics.read_text().splitlines()]

    def files_left(self) -> list[str]:
        """The run's socket and shared-memory directories that still exist."""
        return run_files(next(r["run_id"] for r in self.records() if r["kind"] == "config"))

    def wait_steps(self, n: int) -> None:
        deadline = time.monotonic() + LAUNCH_S
        while not (self.metrics.exists() and self.metrics.read_text().count('"train"') >= n):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.05)

    def process(self, match: Callable[[psutil.Process], bool]) -> psutil.Process:
        found = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if match(p)]
        assert len(found) == 1, found
        return found[0]

    def stop(self, match: Callable[[psutil.Process], bool]) -> tuple[psutil.Process, float]:
        """After two steps, SIGSTOP the one process ``match`` picks: it, and when it stopped."""
        self.wait_steps(2)
        proc = self.process(match)
        proc.send_signal(signal.SIGSTOP)
        return proc, time.monotonic()

    def finish(self) -> int:
        try:
            self.proc.wait(timeout=LAUNCH_S)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._reader.join(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        assert session_processes(self.proc.pid) == [], "processes of the launch outlived it"
        return self.proc.returncode

    def output(self) -> str:
        return "".join(line for _, line in self.lines)[-6000:]

    def first(self, text: str) -> float:
        return next(t for t, line in self.lines if text in line)


def _environ_rank(p: psutil.Process) -> str | None:
    try:
        return p.environ().get("RANK") if "asyncrl.launch" in " ".join(p.cmdline()) else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def test_launch_a_stopped_rollout_worker_is_named_restarted_and_the_run_finishes(
    tmp_path: Path, model_dir: Path
) -> None:
    """Rank 1 (rollout 0) supervises its worker: the worker is stopped, found hung, killed,
    and its rank starts a new one; the launch exits 0 with every step."""
    num_steps = 30
    run = _Launch(tmp_path, model_dir, 2, run={"num_steps": num_steps}, failures=BEAT, **RUN)
    try:
        worker, start = run.stop(lambda p: "--rank" in p.cmdline() and "rollout" in p.cmdline())
        worker.wait(HANG_GUARD_S)  # its supervisor reaps it
        killed_after = time.monotonic() - start
    finally:
        rc = run.finish()
    _report("launch rollout worker, SIGSTOP → killed", killed_after)
    assert rc == 0, run.output()
    assert killed_after >= EARLIEST_S, killed_after
    records = run.records()
    assert len([r for r in records if r["kind"] == "train"]) == num_steps
    (restarted,) = [r for r in records if r["kind"] == "worker_restarted"]
    assert (restarted["worker"], restarted["exit_code"]) == ("rollout:0", -signal.SIGKILL)
    assert restarted["error"].startswith("worker rollout:0 hung: it answered no health probe")
    assert any("worker_hung" in line for _, line in run.lines), run.output()  # rank 0's log
    assert run.files_left() == []


def test_launch_a_stopped_trainer_rank_stops_the_run_with_a_named_hung_error(
    tmp_path: Path, model_dir: Path
) -> None:
    """Three ranks: trainer 0 (with the controller), trainer 1, rollout 0. Trainer rank 1 is
    stopped; it is named hung and killed, and rank 0 prints one ``asyncrl: error:`` line
    naming it; every rank exits and nothing of the run is left."""
    run = _Launch(tmp_path, model_dir, 3, run={"num_steps": 1000},
                  cluster={"trainer_ranks": 2}, failures=BEAT, **RUN)
    try:
        trainer1, start = run.stop(lambda p: _environ_rank(p) == "1")
    finally:
        rc = run.finish()
    errors = [(t, line) for t, line in run.lines if line.startswith("asyncrl: ")]
    assert rc != 0 and len(errors) == 1, run.output()
    named_after = errors[0][0] - start
    _report("launch trainer rank 1, SIGSTOP → the asyncrl: error line", named_after)
    line = errors[0][1]
    assert line.startswith(
        "asyncrl: error: worker trainer:1 hung: it answered no health probe for "), line
    assert f"(pid {trainer1.pid})" in line and "trainer-1.log" in line, line
    assert "its last answer came at " in line, line
    assert named_after >= EARLIEST_S, named_after
    assert run.files_left() == []


SUSPEND_S = 10.0
"""A suspend of every process of the launch: about 3 times the workers' limit on the
controller's silence (interval + timeout = 3.25 s)."""
NAMED_SILENT_MAX_S = INTERVAL_S + TIMEOUT_S + 2 * INTERVAL_S
"""The silence a worker names its stopped controller with, at most, on its own clock: its
limit (interval + timeout), then its watch ticks every interval, one maybe late by as much.
The wall clock from the SIGSTOP to the line has no such bound on a busy machine; its
figures are printed and kept in docs/failures.md."""


def test_launch_a_stopped_controller_is_named_by_its_worker_after_a_suspend_it_outlived(
    tmp_path: Path, model_dir: Path
) -> None:
    """Two ranks: rank 0 (the controller and trainer 0) and rank 1 (rollout 0's supervisor)
    with its worker. First every process of the launch is stopped for 10 s, as a job
    suspend does, and continued (the workers first, the controller 0.3 s later): the run
    trains on, nobody named. Then rank 0 alone is stopped: the worker, on this host, names it
    within interval + timeout in the launch's one ``asyncrl: error:`` line (rank 1 speaks)
    and removes the run's files; the stopped rank 0 is then killed, as torchrun's agent does
    30 s after it asked it to stop, and nothing of the launch is left."""
    run = _Launch(tmp_path, model_dir, 2, run={"num_steps": 100_000}, failures=BEAT, **RUN)
    try:
        run.wait_steps(2)
        agent = psutil.Process(run.proc.pid)
        ranks = agent.children(recursive=True)
        for proc in [agent, *ranks]:
            proc.send_signal(signal.SIGSTOP)
        time.sleep(SUSPEND_S)
        steps = run.metrics.read_text().count('"train"')
        for proc in reversed(ranks):  # the worker, its supervisor, then the controller
            if _environ_rank(proc) == "0":
                time.sleep(0.3)
            proc.send_signal(signal.SIGCONT)
        agent.send_signal(signal.SIGCONT)
        run.wait_steps(steps + 5)  # it trains on
        assert not [line for _, line in run.lines if line.startswith("asyncrl: ")], run.output()
        rank0 = run.process(lambda p: _environ_rank(p) == "0")
        rank0.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline = stopped_at + HANG_GUARD_S
        while not any(line.startswith("asyncrl: ") for _, line in run.lines):
            assert time.monotonic() < deadline, run.output()
            time.sleep(0.05)
        (said_at, line), *more = [(t, x) for t, x in run.lines if x.startswith("asyncrl: ")]
        named_after = said_at - stopped_at
        assert run.files_left() == []  # removed by the worker, before its line
        rank0.kill()  # never continued: what torchrun's agent does after its grace
    finally:
        rc = run.finish()
    _report("launch controller (rank 0), SIGSTOP → its worker's asyncrl: error line",
            named_after)
    assert rc != 0 and more == [], run.output()
    prefix = f"asyncrl: error: the controller (pid {rank0.pid}) sent worker rollout:0 nothing for "
    assert line.startswith(prefix), line
    silent_s = float(line.removeprefix(prefix).split(" s ")[0])
    assert INTERVAL_S + TIMEOUT_S <= silent_s <= NAMED_SILENT_MAX_S, line  # (rounded to 0.1 s)
    assert "not run" not in line, line  # the suspend it outlived is not part of this silence
    assert (f"(its heartbeat probes come every {INTERVAL_S:.3g} s; failures.heartbeat_timeout_s "
            f"= {TIMEOUT_S:g} s), though its process lives: it is stopped") in line, line
    assert "the workers stop their engines and remove the run's files" in line, line
    assert line.rstrip().endswith("rollout-0.log)"), line
    assert TIMEOUT_S <= named_after, named_after  # its last probe came at most a tick before
