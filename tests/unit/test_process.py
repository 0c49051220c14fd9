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
