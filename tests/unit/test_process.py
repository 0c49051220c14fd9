"""Process helpers (asyncrl.procs.process) and error flattening, against real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from asyncrl.errors import RunError, flatten
from asyncrl.procs.process import exit_status, group_runs, has_exited, stat_fields, stopped_by_signal


def _wait_zombie(proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 5
    while exit_status(proc.pid) is None:  # not reaped: Popen only reaps on poll()/wait()
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-c", "import sys; sys.exit(3)"], 3),
        (["-c", "import time; time.sleep(60)"], -signal.SIGKILL),
    ],
)
def test_exit_status_of_an_unreaped_process(argv: list[str], expected: int) -> None:
    proc = subprocess.Popen([sys.executable, *argv])
    try:
        assert exit_status(proc.pid) is None and not has_exited(proc.pid)
        if expected < 0:
            os.kill(proc.pid, -expected)
        _wait_zombie(proc)
        assert exit_status(proc.pid) == expected and has_exited(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert exit_status(proc.pid) is None and has_exited(proc.pid)  # reaped: gone


def test_stop_signal_exit_codes() -> None:
    assert [c for c in (-15, -2, 143, 130, -9, 1, 0, None) if stopped_by_signal(c)] == [
        -15, -2, 143, 130
    ]


def test_flatten_nested_groups_in_order() -> None:
    a, b, c = RunError("a"), ValueError("b"), KeyError("c")
    group = BaseExceptionGroup("outer", [a, ExceptionGroup("inner", [b, c])])
    assert flatten(group) == [a, b, c]
    assert flatten(a) == [a]


def _sleep_forever() -> None:
    time.sleep(60)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _kernel_keeps_reaped_status() -> bool:
    """Linux 6.15 and later keep a reaped process's status on a pidfd opened before."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 15)


@pytest.mark.anyio
async def test_wait_exit_status_of_a_killed_child_and_of_a_reaped_one() -> None:
    import multiprocessing

    import anyio

    from asyncrl.procs.process import wait_exit_status

    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_sleep_forever)
    child.start()
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                codes: list[int | None] = []

                async def wait() -> None:
                    codes.append(await wait_exit_status(child.pid, child))

                tg.start_soon(wait)
                await anyio.sleep(0.05)  # waiting on the live process
                os.kill(child.pid, signal.SIGKILL)
        assert codes == [-signal.SIGKILL]
        child.join(5)  # reaped by its Process object: the object still knows the code
        assert await wait_exit_status(child.pid, child) == -signal.SIGKILL
    finally:
        child.kill()
        child.join(5)
    # gone before the wait began, nobody to ask: unknown, and no polling for it (within_s
    # is 60 s here: the test's timeout ends it if it waits)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with anyio.fail_after(5):
        assert await wait_exit_status(proc.pid, within_s=60) is None


@pytest.mark.anyio
async def test_the_status_of_a_sibling_that_its_parent_reaps_at_once() -> None:
    """torchrun's agent reaps a rank that the controller, its sibling, watches: the status is
    not the controller's to wait for, and the agent may take the zombie before ``/proc`` is
    read. A pidfd opened while the process lived keeps it (Linux 6.15 and later)."""
    import anyio

    from asyncrl.procs.process import wait_exit_status

    with subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; r = subprocess.Popen(['sleep', '60']); "
         "print(r.pid, flush=True); r.wait(); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as agent:  # fmt: skip
        rank = int(agent.stdout.readline())
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                codes: list[int | None] = []

                async def watch() -> None:
                    codes.append(await wait_exit_status(rank))

                tg.start_soon(watch)
                await anyio.sleep(0.05)
                # the agent's reaping happens while this loop is blocked: /proc shows nothing
                os.kill(rank, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while os.path.exists(f"/proc/{rank}"):
                    assert time.monotonic() < deadline, "the agent never reaped the rank"
                    time.sleep(0.005)
        agent.kill()
    expected = -signal.SIGKILL if _kernel_keeps_reaped_status() else None
    assert codes == [expected]


def test_is_dying() -> None:
    from asyncrl.procs.process import is_dying

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_dying(proc.pid) and not is_dying(os.getpid())
        os.kill(proc.pid, signal.SIGKILL)
        _wait_zombie(proc)
        assert is_dying(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert is_dying(proc.pid)  # reaped


# ------------------------------------------------------------------ die_with_parent
# A "launcher" starts a "rank" in a session of its own (as torchrun does), then is killed;
# the rank must stop by itself. The rank writes what happened to a file.
_RANK = r"""
import os, signal, subprocess, sys, time
from asyncrl.procs.process import PARENT_ENV, die_with_parent, lost_owner

out, mode, also = sys.argv[1], sys.argv[2], int(sys.argv[3])

def on_term(signum, frame):
    with open(out + ".term", "w") as f:
        f.write(str(lost_owner()))
    sys.exit(0)

signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else on_term)
if mode == "orphan":  # its launcher dies before it starts watching
    while os.getppid() == int(os.environ[PARENT_ENV]):
        time.sleep(0.01)
die_with_parent(also=also, kill_after_s=0.2)
with open(out + ".ready", "w") as f:
    if mode == "ignore":  # something it started, in its process group
        f.write(str(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid))
time.sleep(60)
"""
_LAUNCHER = r"""
import os, subprocess, sys, time
env = dict(os.environ, ASYNCRL_PARENT_PID=str(os.getpid()))
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                        start_new_session=True, env=env)
print(rank.pid, flush=True)
if sys.argv[3] != "orphan":
    time.sleep(60)
"""


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30  # a hang guard, not a bound: it takes well under 1 s
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.02)


@contextmanager
def _rank(tmp_path: Path, mode: str, also: int = 0) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """A launcher and its rank (started as above); both killed at the end if still there."""
    out = tmp_path / "rank"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, _RANK, str(out), mode, str(also)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    rank = 0
    try:
        assert launcher.stdout is not None
        rank = int(launcher.stdout.readline())
        yield launcher, rank, out
    finally:
        for pid in (launcher.pid, rank):
            try:
                if pid:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.communicate()


def _file(path: Path) -> str:
    deadline = time.monotonic() + 30  # a hang guard
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never written"
        time.sleep(0.02)
    return path.read_text()


def _ready(out: Path) -> None:
    deadline = time.monotonic() + 30  # a hang guard
    while not out.with_suffix(".ready").exists():
        assert time.monotonic() < deadline, "the rank never started watching"
        time.sleep(0.02)


def test_a_rank_whose_launcher_is_killed_gets_sigterm(tmp_path: Path) -> None:
    with _rank(tmp_path, "term") as (launcher, rank, out):
        _ready(out)
        launcher.kill()
        launcher.wait()
        assert _file(out.with_suffix(".term")) == str(launcher.pid)  # its orderly path ran
        _wait_gone([rank])


def test_a_rank_that_ignores_sigterm_is_killed_with_its_group(tmp_path: Path) -> None:
    with _rank(tmp_path, "ignore") as (launcher, rank, out):
        _ready(out)
        child = int(_file(out.with_suffix(".ready")))
        try:
            launcher.kill()
            launcher.wait()
            _wait_gone([rank, child])  # SIGKILL to the rank's group, kill_after_s later
        finally:
            if not _gone(child):
                os.kill(child, signal.SIGKILL)
        assert not out.with_suffix(".term").exists()


def test_a_rank_stops_when_the_controller_it_watches_exits(tmp_path: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as controller:
        with _rank(tmp_path, "term", also=controller.pid) as (launcher, rank, out):
            _ready(out)
            controller.kill()
            controller.wait()
            assert _file(out.with_suffix(".term")) == str(controller.pid)
            _wait_gone([rank])
            assert launcher.poll() is None  # its parent lives: the controller was the cause


def test_a_rank_orphaned_while_it_started_stops_at_once(tmp_path: Path) -> None:
    """Its launcher exited before the rank called die_with_parent: its parent now (init, a
    subreaper) is not the launcher ASYNCRL_PARENT_PID names, so it stops at once."""
    with _rank(tmp_path, "orphan") as (launcher, rank, out):
        launcher.wait()
        assert _file(out.with_suffix(".term")) == str(launcher.pid)
        _wait_gone([rank])


def test_a_group_left_with_a_zombie_runs_no_more() -> None:
    """The supervisor waits for a dead worker's process group to go: a member that is only a
    zombie (dead, its parent not reaping it) holds nothing and must not make it wait out its
    bound, though ``killpg(pgid, 0)`` still finds the group."""
    code = ("import os, sys, time\npid = os.fork()\nif pid == 0:\n    os.setpgid(0, 0)\n"
            "    os._exit(0)\nprint(pid, flush=True)\ntime.sleep(30)\n")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while (stat_fields(child) or [b"?"])[0] != b"Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(child, 0)  # the group is still there for kill()
        assert not group_runs(child)
        assert group_runs(os.getpgid(parent.pid))  # a live member counts
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
