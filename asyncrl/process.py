"""Watching and stopping processes that are not necessarily our children (Linux).

* :func:`wait_pid_exit` waits on a *pidfd*, which becomes readable the moment the process
  exits, whoever its parent is (torchrun's ranks are siblings of rank 0; the controller of an
  embedded run is no parent of the ranks either).
* :func:`exit_status` reads the exit status of a process that has exited but not been reaped
  yet (a zombie keeps it in ``/proc/<pid>/stat``, field 52). Read right after the pidfd fires
  it usually beats the parent's ``waitpid`` (torchrun polls every 0.1-0.5 s), so a rank's
  death can be reported with its exit code even when we are not its parent.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio

__all__ = [
    "exit_code_after_exit",
    "exit_status",
    "has_exited",
    "kill_process_group",
    "parent_pid",
    "pid_exists",
    "process_name",
    "stopped_by_signal",
    "wait_pid_exit",
]

_STOP_EXITS = frozenset(
    {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}
)


async def wait_pid_exit(pid: int) -> None:
    """Wait until process ``pid`` (not necessarily our child) has exited.

    Cancellation: stops waiting.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(pidfd)
    finally:
        os.close(pidfd)


def exit_status(pid: int) -> int | None:
    """The exit status of an exited, not yet reaped process: ``-N`` when signal ``N`` killed
    it, else its exit code. ``None`` when it is still running or already reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    # fields[0] is field 3 (the state); the exit code is field 52 (Linux >= 3.5)
    if len(fields) < 50 or fields[0] not in (b"Z", b"X"):
        return None
    status = int(fields[49])
    if status & 0x7F:
        return -(status & 0x7F)
    return (status >> 8) & 0xFF


async def exit_code_after_exit(pid: int, child: Any = None, within_s: float = 2.0) -> int | None:
    """The exit status of ``pid``, which :func:`wait_pid_exit` saw exit, read until known for
    up to ``within_s``: a killed multithreaded process signals its pidfd (and closes its
    pipes) a moment before it is the zombie whose status ``/proc`` shows. ``child``: its
    ``multiprocessing.Process`` when it is ours, which keeps the code when another waiter of
    that object reaped it (a ``join`` in another thread stores the code a moment after its
    ``waitpid`` took the zombie: keep asking). ``None`` once someone else reaped it without
    telling us, or after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        code = exit_status(pid)
        if code is None and child is not None:
            code = child.exitcode  # polls (waitpid WNOHANG) or returns what a join stored
        if code is not None or time.monotonic() > deadline:
            return code
        if child is None and not pid_exists(pid):  # reaped by a stranger: nobody to ask
            return None
        await anyio.sleep(0.01)


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (``None`` if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts: it has not been reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def has_exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, or already reaped)."""
    return exit_status(pid) is not None or not pid_exists(pid)


def stopped_by_signal(exit_code: int | None) -> bool:
    """Whether an exit code says a stop signal ended the process: it died of SIGTERM/SIGINT
    (``-15``/``-2``) or exited ``128 + N`` after cleaning up on it."""
    return exit_code in _STOP_EXITS


def process_name(pid: int) -> str:
    """The process's name (``comm``), or ``"?"`` if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def kill_process_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal a process group; False when it is already gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
