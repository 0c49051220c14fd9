"""The rollout rank's supervisor (asyncrl.procs.supervisor) with real child processes: restarts
within its count, what a dead worker left is killed before the next starts, stop signals
are forwarded, and a lost controller ends it with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.procs.supervisor import CONTROLLER_LOST, supervise

pytestmark = pytest.mark.timeout(60)


def child(tmp_path: Path, body: str) -> list[str]:
    """A worker stand-in: counts its starts in ``runs`` (``n`` is this start's number)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        from pathlib import Path
        runs = Path({str(tmp_path / "runs")!r})
        n = len(runs.read_text()) + 1 if runs.exists() else 1
        runs.write_text("x" * n)
    """) + textwrap.dedent(body))
    return [sys.executable, str(script)]


def runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text())


def test_a_dying_worker_is_started_again_until_it_exits_0(tmp_path: Path) -> None:
    cmd = child(tmp_path, "sys.exit(0 if n == 3 else 1)")
    assert supervise(cmd, max_restarts=3, backoff_s=0) == 0
    assert runs(tmp_path) == 3


def test_the_count_spent_its_last_code_is_the_ranks(tmp_path: Path) -> None:
    cmd = child(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert supervise(cmd, max_restarts=2, backoff_s=0) == 128 + signal.SIGKILL
    assert runs(tmp_path) == 3  # the first start and two restarts


def test_a_worker_that_lost_its_controller_is_not_started_again(tmp_path: Path) -> None:
    """On another node the controller's pid cannot be watched: the worker says it lost the
    controller with its exit code, and no new worker would ever get an Init."""
    cmd = child(tmp_path, f"sys.exit({CONTROLLER_LOST} if n == 2 else 1)")
    assert supervise(cmd, max_restarts=5, backoff_s=0) == 1
    assert runs(tmp_path) == 2  # a failure restarted, then the loss ends it


def test_what_a_dead_worker_left_is_killed_before_the_next_starts(tmp_path: Path) -> None:
    """The worker starts an 'engine' in its session and dies; the engine must be gone before
    the second worker starts (it would hold the GPU's memory)."""
    cmd = child(tmp_path, f"""
        if n == 1:
            engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            Path({str(tmp_path / "engine")!r}).write_text(str(engine.pid))
            os._exit(1)
        pid = int(Path({str(tmp_path / "engine")!r}).read_text())
        alive = os.path.exists(f"/proc/{{pid}}") and "Z" not in open(f"/proc/{{pid}}/stat").read().split(")")[1][:3]
        sys.exit(3 if alive else 0)
    """)
    assert supervise(cmd, max_restarts=1, backoff_s=0) == 0
    assert runs(tmp_path) == 2


def test_a_stop_signal_is_forwarded_and_not_restarted(tmp_path: Path) -> None:
    cmd = child(tmp_path, f"""
        def stop(signum, frame):
            Path({str(tmp_path / "got")!r}).write_text(str(signum))
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, stop)
        Path({str(tmp_path / "up")!r}).write_text("")
        time.sleep(60)
    """)
    code = f"import sys; from asyncrl.procs.supervisor import CONTROLLER_LOST, supervise; sys.exit(supervise({cmd!r}, max_restarts=3, backoff_s=0))"
    rank = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "up").exists():
            assert time.monotonic() < deadline and rank.poll() is None
            time.sleep(0.02)
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert (tmp_path / "got").read_text() == str(int(signal.SIGTERM))
    assert runs(tmp_path) == 1
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


def test_a_lost_controller_ends_it_with_one_line(tmp_path: Path) -> None:
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cmd = child(tmp_path, f"""
        pid = {controller.pid}
        os.kill(pid, signal.SIGKILL)
        while os.path.exists(f"/proc/{{pid}}") and "Z" not in open(f"/proc/{{pid}}/stat").read().split(")")[1][:3]:
            time.sleep(0.01)
        sys.exit(1)  # as a worker does when its controller dies
    """)
    read, write = os.pipe()
    try:
        code = supervise(cmd, max_restarts=3, controller_pid=controller.pid, console=write,
                         backoff_s=0, log_path="/x/rollout-0.log")
    finally:
        controller.wait()
        os.close(write)
    line = os.read(read, 4096).decode()
    os.close(read)
    assert code == 1 and runs(tmp_path) == 1
    assert line == (f"asyncrl: error: the controller (global rank 0, pid {controller.pid}) died "
                    "with exit code -9; the workers stopped their engines and removed the run's "
                    "files (this rank's log: /x/rollout-0.log)\n")


def test_a_killed_controller_is_reported_though_a_stop_signal_follows(tmp_path: Path) -> None:
    """torchrun SIGTERMs the other ranks right after rank 0 (the controller) was killed,
    while the worker still cleans up: the supervisor says the controller died (what
    happened), not that it was stopped (what followed)."""
    import threading

    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cmd = child(tmp_path, f"""
        Path({str(tmp_path / "up")!r}).write_text("1")
        time.sleep(60)  # cleaning up: only the stop signal ends it
    """)

    def kill_controller_then_stop_this_rank() -> None:
        while not (tmp_path / "up").exists():
            time.sleep(0.02)
        controller.kill()  # stays a zombie until the test reaps it
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)  # what torchrun does next

    read, write = os.pipe()
    threading.Thread(target=kill_controller_then_stop_this_rank, daemon=True).start()
    try:
        code = supervise(cmd, max_restarts=3, controller_pid=controller.pid, console=write,
                         backoff_s=0, log_path="/x/rollout-0.log")
    finally:
        controller.kill()
        controller.wait()
        os.close(write)
    line = os.read(read, 4096).decode()
    os.close(read)
    assert code == 1 and runs(tmp_path) == 1
    assert line.startswith(f"asyncrl: error: the controller (global rank 0, pid {controller.pid}) "
                           "died with exit code -9;"), line


def test_a_worker_that_outlives_its_controller_is_stopped_not_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller dies while the worker still runs (a new one, before its handshake,
    would wait for an Init that never comes): the supervisor stops the worker's session
    after a grace and exits 1 without starting another."""
    import threading

    monkeypatch.setattr("asyncrl.procs.supervisor.LOST_GRACE_S", 0.5)
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cmd = child(tmp_path, f"""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf: only SIGKILL ends it
        Path({str(tmp_path / "up")!r}).write_text(str(os.getpid()))
        time.sleep(60)
    """)

    def kill_controller_once_up() -> None:
        while not (tmp_path / "up").exists():
            time.sleep(0.02)
        controller.kill()

    threading.Thread(target=kill_controller_once_up, daemon=True).start()
    start = time.monotonic()
    try:
        code = supervise(cmd, max_restarts=3, controller_pid=controller.pid, backoff_s=0)
    finally:
        controller.kill()
        controller.wait()
    worker = int((tmp_path / "up").read_text())
    assert code == 1 and runs(tmp_path) == 1
    assert time.monotonic() - start < 10  # two graces of 0.5 s, then SIGKILL
    assert not psutil.pid_exists(worker)


def test_a_worker_still_closing_when_the_controller_ends_exits_0(tmp_path: Path) -> None:
    """After Shutdown the controller may exit while the worker still closes a slow engine:
    that is a normal end (0, no line), not a lost controller (it was, on an H200 with vLLM)."""
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cmd = child(tmp_path, f"""
        pid = {controller.pid}
        os.kill(pid, signal.SIGKILL)  # the controller ends first
        time.sleep(1.0)  # closing the engine
        sys.exit(0)
    """)
    read, write = os.pipe()
    try:
        code = supervise(cmd, max_restarts=3, controller_pid=controller.pid, console=write,
                         backoff_s=0)
    finally:
        controller.wait()
        os.close(write)
    assert code == 0 and runs(tmp_path) == 1
    assert os.read(read, 4096) == b""
    os.close(read)


def _says_lost(tmp_path: Path, then: str = "") -> list[str]:
    """A worker that writes its line to its supervisor's pipe, then (after ``then``) exits
    as a worker that took the controller for gone on its silence does."""
    from asyncrl.procs.supervisor import LAST_WORDS_ENV

    return child(tmp_path, f"""
        fd = int(os.environ[{LAST_WORDS_ENV!r}])
        os.write(fd, b"asyncrl: error: the controller (pid 7) sent worker rollout:0 nothing\\n")
        {then}
        sys.exit({CONTROLLER_LOST})
    """)


def _console_of(cmd: list[str], controller: subprocess.Popen) -> tuple[int, bytes]:
    read, write = os.pipe()
    try:
        code = supervise(cmd, max_restarts=3, controller_pid=controller.pid, console=write,
                         backoff_s=0, log_path="/x/rollout-0.log")
    finally:
        controller.kill()
        controller.wait()
        os.close(write)
    said = os.read(read, 4096)
    os.close(read)
    return code, said


def test_a_silent_controllers_line_is_said_by_the_speaking_rank(tmp_path: Path) -> None:
    """The worker found the controller silent, though its process lives (stopped): the
    supervisor cannot tell why from the exit code, so it prints the worker's own line."""
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code, said = _console_of(_says_lost(tmp_path), controller)
    assert code == 1 and runs(tmp_path) == 1
    assert said == b"asyncrl: error: the controller (pid 7) sent worker rollout:0 nothing\n"


def test_no_line_of_the_worker_once_the_controller_exited_by_itself(tmp_path: Path) -> None:
    """A controller that exited 0 said its own words: the worker's are not printed too."""
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    code, said = _console_of(_says_lost(tmp_path, then=f"""
        pid = {controller.pid}
        while os.path.exists(f"/proc/{{pid}}") and "Z" not in open(f"/proc/{{pid}}/stat").read().split(")")[1][:3]:
            time.sleep(0.01)
    """), controller)
    assert code == 1 and runs(tmp_path) == 1
    assert said == b""
