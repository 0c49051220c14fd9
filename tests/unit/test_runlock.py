"""One writer per run directory (asyncrl.run.runlock), against real holder processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import structlog

from asyncrl.config import Config, from_dict
from asyncrl.errors import ConfigError, RunDirectoryInUseError
from asyncrl.run.runlock import LOCK_FILE, check_free, lock_run

_HOLD = r"""
import sys
from asyncrl.config import from_dict
from asyncrl.run.runlock import lock_run
import json
lock = lock_run(from_dict(json.loads(sys.argv[1])))
print("locked", flush=True)
sys.stdin.read()  # until the test closes the pipe (or kills it)
lock.release()
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    from asyncrl_example_backend.model import write_model_dir

    return write_model_dir(tmp_path / "model")


def _data(model_dir: Path, out: Path, checkpoints: Path | None = None) -> dict:
    data = {
        "model": {"path": str(model_dir)},
        "trainer": {"backend": "bigram"},
        "generator": {"backend": "bigram"},
        "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(out)},
    }
    if checkpoints is not None:
        data["checkpoint"] = {"dir": str(checkpoints)}
    return data


def _config(model_dir: Path, out: Path, checkpoints: Path | None = None) -> Config:
    return from_dict(_data(model_dir, out, checkpoints))


@contextmanager
def _holder(data: dict) -> Iterator[subprocess.Popen[str]]:
    """Another process that holds the run's locks until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, json.dumps(data)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _expect_message(exc: BaseException, field: str, directory: Path, pid: int) -> None:
    text = str(exc)
    assert text.startswith(
        f"{field}: {os.path.realpath(directory)} is in use by another run (pid {pid} on host "
        f"{socket.gethostname()}, since "
    ), text
    assert text.endswith(
        f"Fix: wait for that run to end, stop it (kill {pid} on {socket.gethostname()}), "
        f"or set another {field}."
    ), text
    assert " UTC; lock file " in text and "\n" not in text


def test_a_run_locks_its_directories_and_leaves_nothing(model_dir: Path, tmp_path: Path) -> None:
    cfg = _config(model_dir, tmp_path / "out")
    lock = lock_run(cfg)
    files = [tmp_path / "out" / d / LOCK_FILE for d in ("", "checkpoints", "hf")]
    for path in files:
        body = json.loads(path.read_text())
        assert body["pid"] == os.getpid() and body["host"] == socket.gethostname()
    lock.release()
    lock.release()  # idempotent
    assert not any(p.exists() for p in files)
    lock_run(cfg).release()  # and it can be taken again


def test_a_live_run_in_another_process_is_named(model_dir: Path, tmp_path: Path) -> None:
    data = _data(model_dir, tmp_path / "out")
    with _holder(data) as holder:
        cfg = from_dict(data)
        for attempt in (check_free, lock_run):
            with pytest.raises(RunDirectoryInUseError) as info:
                attempt(cfg)
            _expect_message(info.value, "run.output_dir", tmp_path / "out", holder.pid)
        assert isinstance(info.value, ConfigError)  # exit 2 under the launcher
    # once it is gone the directory is free
    check_free(cfg)
    lock_run(cfg).release()


def test_a_second_run_of_this_process_is_refused_and_the_first_keeps_its_lock(
    model_dir: Path, tmp_path: Path
) -> None:
    """Record locks of one process never conflict, and closing any descriptor of the file
    would drop them: the refusal must come from this process's own record, and leave the
    first run's lock in place (another process still sees it held)."""
    data = _data(model_dir, tmp_path / "out")
    cfg = from_dict(data)
    lock = lock_run(cfg)
    try:
        for attempt in (check_free, lock_run):
            with pytest.raises(RunDirectoryInUseError) as info:
                attempt(cfg)
            _expect_message(info.value, "run.output_dir", tmp_path / "out", os.getpid())
        probe = subprocess.run(
            [sys.executable, "-c", _HOLD, json.dumps(data)],
            input="", capture_output=True, text=True, timeout=60,
        )
        assert probe.returncode != 0 and "RunDirectoryInUseError" in probe.stderr
        assert f"(pid {os.getpid()} on host" in probe.stderr
    finally:
        lock.release()


@pytest.mark.parametrize("section", ["checkpoint", "export"])
def test_a_shared_checkpoint_or_export_dir_is_refused_and_nothing_stays_locked(
    model_dir: Path, tmp_path: Path, section: str
) -> None:
    """Two runs with their own output directories but one checkpoint.dir (or export.dir):
    the second is refused naming that field, and its output directory is not left locked."""
    shared = tmp_path / "shared"

    def data(out: Path) -> dict:
        return dict(_data(model_dir, out), **{section: {"dir": str(shared)}})

    with _holder(data(tmp_path / "a")) as holder:
        with pytest.raises(RunDirectoryInUseError) as info:
            lock_run(from_dict(data(tmp_path / "b")))
        _expect_message(info.value, f"{section}.dir", shared, holder.pid)
        assert not (tmp_path / "b" / LOCK_FILE).exists()
        lock_run(_config(model_dir, tmp_path / "b")).release()


def test_export_dir_is_not_locked_when_the_run_exports_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    data = dict(_data(model_dir, tmp_path / "out"), export={"at_end": False})
    lock = lock_run(from_dict(data))
    lock.release()
    assert not (tmp_path / "out" / "hf").exists()


def test_a_dead_runs_lock_is_taken_over(model_dir: Path, tmp_path: Path) -> None:
    data = _data(model_dir, tmp_path / "out")
    with _holder(data) as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    stale = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
    assert stale["pid"] == holder.pid  # the file stays; its lock died with its holder
    cfg = from_dict(data)
    check_free(cfg)
    with structlog.testing.capture_logs() as logs:
        lock = lock_run(cfg)
    try:
        taken = [e for e in logs if e["event"] == "run_lock_taken_over"]
        assert len(taken) == 3 and json.loads(taken[0]["previous"]) == stale
        assert json.loads((tmp_path / "out" / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_looking_creates_nothing(model_dir: Path, tmp_path: Path) -> None:
    check_free(_config(model_dir, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_file_system_without_record_locks_runs_unguarded(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOLCK (NFS without lockd): the run goes on without the lock, and says so."""
    import errno
    import fcntl

    def no_locks(fd: int, cmd: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with structlog.testing.capture_logs() as logs:
        lock = lock_run(_config(model_dir, tmp_path / "out"))
    lock.release()
    assert [e["event"] for e in logs].count("run_lock_unavailable") == 3
    assert lock.fds == []
