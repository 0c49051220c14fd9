"""A run dies with its launcher, and one run directory has one writer.

* ``kill -9`` of ``asyncrl run``, of torchrun's agent (``torchrun -m asyncrl.launch``) or of
  the embedding host (``examples/embed_in_asyncio.py``): every rank and worker of the run is
  gone within :data:`GONE_WITHIN_S` (they used to train on headless, in sessions of their own),
  and the run's socket and shared-memory directories with them.
* a second ``asyncrl run`` on a live run's directory (``--resume latest`` as well) is refused
  with one named line and exit 2 before it starts a process; the first run finishes unharmed.
  Two embedded controllers of one process on one directory, or on one ``checkpoint.dir``,
  likewise.
* a lock left by a dead run is taken over.

Runs are real subprocesses in sessions of their own, on the numpy ``bigram`` backend.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.errors import RunDirectoryInUseError  # noqa: E402
from asyncrl.procs.process import ORPHAN_KILL_S  # noqa: E402
from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from asyncrl.run.runlock import LOCK_FILE, check_free  # noqa: E402
from integration_support import (  # noqa: E402
    BASE,
    merge,
    run_files,
    run_processes,
    to_toml,
)

pytestmark = [pytest.mark.usefixtures("no_stray_processes"), pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
GONE_WITHIN_S = ORPHAN_KILL_S
"""From ``kill -9`` of the launcher to the last process of the run gone, at most: a rank
whose launcher died stops in order, and SIGKILLs its process group if it still lives this
long after (docs/failures.md). The figures (1.1-7 s on 2 cores) are printed (``pytest -s``)."""


def _write_config(tmp_path: Path, model_dir: Path, **over: dict) -> Path:
    data = merge(BASE, {
        "run": {"num_steps": 1000, "output_dir": str(tmp_path / "out")},
        "eval": {"num_prompts": 0},
        "generator": {"options": {"token_delay_s": 0.01}},
    })  # fmt: skip
    data = merge(data, over)
    data["model"] = {"path": str(model_dir)}
    path = tmp_path / "run.toml"
    path.write_text(to_toml(data) + "\n")
    return path


def _command(form: str, config: Path) -> list[str]:
    if form == "asyncrl run":
        return [ASYNCRL, "run", str(config)]
    if form == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            *torchrun_log_args(str(config.parent / "torchrun")),  # not in /tmp/torchelastic_*
            "--standalone", "-m", "asyncrl.launch", str(config),
        ]  # fmt: skip
    return [sys.executable, str(ROOT / "examples" / "embed_in_asyncio.py"), str(config)]


def _start(form: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            _command(form, config), cwd=config.parent, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _metrics(config: Path) -> list[dict]:
    path = config.parent / "out" / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_steps(config: Path, proc: subprocess.Popen[bytes], log: Path, n: int) -> None:
    deadline = time.monotonic() + 120
    while sum(r["kind"] == "train" for r in _metrics(config)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"fewer than {n} steps trained; output:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in _live(procs):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("form", ["asyncrl run", "torchrun", "embedded"])
def test_kill_9_of_the_launcher_leaves_no_rank_running(
    tmp_path: Path, model_dir: Path, form: str
) -> None:
    config = _write_config(tmp_path, model_dir)
    log = tmp_path / "console.log"
    proc = _start(form, config, log)
    procs: list[psutil.Process] = []
    try:
        _wait_steps(config, proc, log, 2)
        run_id = _metrics(config)[0]["run_id"]
        # every process of the run: the launcher's descendants (the ranks, each in a session
        # of its own, and the supervised rollout worker), and an embedded run's torchrun groups
        procs = psutil.Process(proc.pid).children(recursive=True) + run_processes(run_id)
        procs = list({p.pid: p for p in procs}.values())
        assert len(procs) >= 3, procs  # two ranks and the supervised worker, at least
        struck = time.monotonic()
        proc.kill()
        proc.wait()
        while _live(procs) and time.monotonic() - struck < GONE_WITHIN_S:
            time.sleep(0.05)
        seconds = time.monotonic() - struck
        left = _live(procs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(procs)
    print(f"\nORPHANS | {form} | kill -9 | all gone after {seconds:.1f} s")
    assert left == [], f"still running {GONE_WITHIN_S} s after kill -9 of the launcher: {left}"
    assert run_files(run_id) == []
    check_free(asyncrl.load_config(config))  # the directory is free again
    if form != "embedded":  # rank 0 (the controller) says why it stopped, and unlocks
        out = log.read_text()
        assert f"asyncrl: stopped because its launcher (pid {proc.pid}) exited" in out, out
        assert not (tmp_path / "out" / LOCK_FILE).exists()


def _rank0(proc: subprocess.Popen[bytes]) -> int:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == "0" and "asyncrl.launch" in " ".join(p.cmdline()):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError("no rank 0")


def _refused(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``asyncrl run ...`` to its end, failing if it ever has a child process."""
    second = subprocess.Popen([ASYNCRL, *args], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    children = []
    try:
        me = psutil.Process(second.pid)
        while second.poll() is None:
            try:
                children += me.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
        out, err = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.communicate()
    pids = sorted({c.pid for c in children})
    assert pids == [], f"the refused run started processes {pids}; it said: {err[-3000:]}"
    return subprocess.CompletedProcess(second.args, second.returncode, out, err)


def test_a_second_run_on_a_live_directory_is_refused(tmp_path: Path, model_dir: Path) -> None:
    num_steps = 60  # long enough to outlive the two refused attempts (about 5 s each here)
    config = _write_config(tmp_path, model_dir, run={"num_steps": num_steps},
                           checkpoint={"every_steps": 2})
    log = tmp_path / "first.log"
    first = _start("asyncrl run", config, log)
    try:
        _wait_steps(config, first, log, 3)
        controller = _rank0(first)
        out_dir = os.path.realpath(tmp_path / "out")
        for args in (["run", str(config)], ["run", str(config), "--resume", "latest"]):
            second = _refused(args, tmp_path)
            assert first.poll() is None, "the first run ended before the second was refused"
            assert second.returncode == 2, second.stderr
            assert second.stdout == ""
            lines = second.stderr.splitlines()
            assert len(lines) == 1, second.stderr
            assert lines[0].startswith(
                f"asyncrl: error: run.output_dir: {out_dir} is in use by another run (pid "
                f"{controller} on host {socket.gethostname()}, since "
            ), lines[0]
            assert lines[0].endswith(
                f"Fix: wait for that run to end, stop it (kill {controller} on "
                f"{socket.gethostname()}), or set another run.output_dir."
            ), lines[0]
        first.wait(timeout=180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    # the first run is unharmed: it finished, alone in its directory
    assert first.returncode == 0, log.read_text()[-4000:]
    records = _metrics(config)
    assert [r["run_id"] for r in records if r["kind"] == "config"] == [records[0]["run_id"]]
    assert sum(r["kind"] == "train" for r in records) == num_steps
    assert not (tmp_path / "out" / LOCK_FILE).exists()
    assert not (tmp_path / "out" / "checkpoints" / LOCK_FILE).exists()
    assert not (tmp_path / "out" / "hf" / LOCK_FILE).exists()


@pytest.mark.asyncio
async def test_two_embedded_controllers_on_one_directory(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    """In one process too: a second Controller on the live run's output directory, or on its
    checkpoint.dir, is refused before it binds or spawns anything."""
    cfg = make_config("a")
    same_ckpt = make_config("b", checkpoint={"dir": cfg.checkpoint.dir})
    async with asyncrl.Controller(cfg) as first:
        for other, field in ((cfg, "run.output_dir"), (same_ckpt, "checkpoint.dir")):
            second = asyncrl.Controller(other)
            with pytest.raises(RunDirectoryInUseError, match=rf"^{field}: .* \(pid {os.getpid()} "):
                async with second:
                    pytest.fail("a second run entered a live run's directory")
            assert second.addresses is None
        summary = await first.train()
    assert len(summary.steps) == cfg.run.num_steps
    assert not Path(cfg.run.output_dir, LOCK_FILE).exists()


_HOLD_AND_DIE = r"""
import os, sys
from asyncrl.config import load_config
from asyncrl.run.runlock import lock_run
lock_run(load_config(sys.argv[1]))
os.kill(os.getpid(), 9)
"""


def test_a_dead_runs_lock_is_taken_over(tmp_path: Path, model_dir: Path) -> None:
    config = _write_config(tmp_path, model_dir, run={"num_steps": 2})
    holder = subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, str(config)], timeout=60)
    assert holder.returncode == -signal.SIGKILL
    stale = tmp_path / "out" / LOCK_FILE
    assert stale.exists()  # the file of a run that could not clean up: its lock died with it
    done = subprocess.run([ASYNCRL, "run", str(config)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "run_lock_taken_over" in done.stderr
    assert not stale.exists()
