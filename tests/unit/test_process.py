"""Process helpers (asyncrl.process) and error flattening, against real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.errors import RunError, flatten
from asyncrl.process import exit_status, has_exited, stopped_by_signal


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


@pytest.mark.anyio
async def test_exit_code_after_exit_of_a_killed_child_and_of_a_reaped_one() -> None:
    import multiprocessing

    import anyio

    from asyncrl.process import exit_code_after_exit, wait_pid_exit

    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_sleep_forever)
    child.start()
    try:
        os.kill(child.pid, signal.SIGKILL)
        with anyio.fail_after(5):
            await wait_pid_exit(child.pid)
            assert await exit_code_after_exit(child.pid, child) == -signal.SIGKILL
        child.join(5)  # reaped by its Process object: the object still knows the code
        assert await exit_code_after_exit(child.pid, child) == -signal.SIGKILL
    finally:
        child.kill()
        child.join(5)
    # reaped by someone else, nobody to ask: unknown, at once (not after the 2 s of polling)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    start = time.monotonic()
    assert await exit_code_after_exit(proc.pid) is None
    assert time.monotonic() - start < 0.5
