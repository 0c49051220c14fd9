"""Watching and stopping processes that are not necessarily our children (Linux).

* :func:`wait_pid_exit` waits on a *pidfd*, which becomes readable the moment the process
  exits, whoever its parent is (torchrun's ranks are siblings of rank 0; the controller of an
  embedded run is no parent of the ranks either).
* :func:`wait_exit_status` (and :class:`ProcessExit`, which holds the pidfd for a caller that
  waits on several processes) waits the same way and returns the exit status: from
  ``/proc/<pid>/stat`` while the process is a zombie (field 52), and once its parent has
  reaped it (torchrun's agent polls every 0.1 s) from the pidfd itself, which keeps the status
  since Linux 6.15 (``PIDFD_GET_INFO``) when it was opened before the process was reaped. So a
  rank's death is reported with its exit code although we are not its parent, whoever wins
  the race to its zombie.
* :func:`die_with_parent` makes a rank stop when its launcher dies (``kill -9`` of
  ``asyncrl run`` or of the torchrun agent, the embedding host): torchrun puts every rank in
  a session of its own, so nothing else would reach it and it would train on headless.
"""

from __future__ import annotations

import os
import fcntl
import select
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

__all__ = [
    "ORPHAN_KILL_S",
    "PARENT_ENV",
    "ProcessExit",
    "die_with_parent",
    "exit_status",
    "group_runs",
    "has_exited",
    "is_dying",
    "kill_process_group",
    "lost_owner",
    "parent_pid",
    "pid_exists",
    "process_name",
    "stat_fields",
    "stopped_by_signal",
    "wait_exit_status",
    "wait_pid_exit",
]

log = structlog.get_logger("asyncrl.procs.process")

ORPHAN_KILL_S = 60.0
"""After its launcher died, how long a rank has to stop in order (SIGTERM's path: workers told
to stop, engines closed, files removed) before it SIGKILLs its own process group. Longer than
the orderly stop's own bounds at their defaults (an engine close 30 s; the controller's 2 s
for a peer to name a cause, then a worker's grace); the bigram runs of
``tests/integration/test_orphans.py`` are gone 1.1-7 s after the kill, in order."""
PARENT_ENV = "ASYNCRL_PARENT_PID"
"""Set by a launcher in its children's environment (its own pid): a child whose parent is
already another process when it starts watching was orphaned while it started."""
_LOST: list[int] = []
"""The owner whose exit stopped this process (see :func:`die_with_parent`)."""

_STOP_EXITS = frozenset(
    {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}
)


async def wait_pid_exit(pid: int) -> None:
    """Wait until process ``pid`` (not necessarily our child) has exited.

    Cancellation: stops waiting.
    """
    with ProcessExit(pid) as exit_:
        await exit_.wait()


async def wait_exit_status(pid: int, child: Any = None, within_s: float = 2.0) -> int | None:
    """Wait until process ``pid`` (not necessarily our child) has exited; return its exit
    status (:meth:`ProcessExit.status`). ``child``: its ``multiprocessing.Process`` when it is
    ours.

    Cancellation: stops waiting.
    """
    with ProcessExit(pid, child) as exit_:
        await exit_.wait()
        return await exit_.status(within_s)


class ProcessExit:
    """Process ``pid``'s exit (not necessarily our child), through a pidfd opened when this is
    made: make it while the process lives, and its status can be read after whoever is its
    parent reaped it (Linux 6.15 and later). ``child``: its ``multiprocessing.Process`` when
    it is ours. A context manager (the pidfd is closed on leaving)."""

    def __init__(self, pid: int, child: Any = None) -> None:
        self.pid = pid
        self._child = child
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: nothing to wait for, no status kept
            self._fd = None

    def __enter__(self) -> ProcessExit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def exited(self) -> bool:
        """Whether the process has exited (without waiting)."""
        if self._fd is None:
            return True
        return bool(select.select([self._fd], [], [], 0)[0])

    async def wait(self) -> None:
        """Until the process has exited. Cancellation: stops waiting."""
        if self._fd is not None:
            await anyio.wait_readable(self._fd)

    async def status(self, within_s: float = 2.0) -> int | None:
        """Its exit status (``-N`` when signal ``N`` killed it, else its exit code), once it
        exited (:meth:`wait`), read from the first source that has it, for up to
        ``within_s`` (a killed multithreaded process signals its pidfd a moment before it is
        the zombie whose status ``/proc`` shows): the zombie's ``/proc/<pid>/stat``; the
        pidfd, which keeps it after the parent reaped the process; ``child``'s ``exitcode``
        (it polls, or returns what a ``join`` in another thread stored after reaping it).
        ``None`` when none has it: reaped by a stranger on an older kernel, or gone before
        this was made.

        Cancellation: stops reading.
        """
        if self._fd is None:
            return None if self._child is None else self._child.exitcode
        deadline = time.monotonic() + within_s
        while True:
            code = exit_status(self.pid)
            if code is None:
                code = _reaped_status(self._fd)
            if code is None and self._child is not None:
                code = self._child.exitcode
            if code is not None or time.monotonic() > deadline:
                return code
            if self._child is None and not pid_exists(self.pid):  # reaped since the reads
                return _reaped_status(self._fd)  # kept by the kernel, or unknown
            await anyio.sleep(0.01)


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is field 3, the
    state; ``[n]`` is field ``n + 3``); ``None`` when there is no such process here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def group_runs(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` still runs here. A zombie does not count:
    it is dead and holds nothing, only its parent has yet to reap it (an orphan's new parent,
    a container's first process, may take seconds, or never)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = stat_fields(int(name))  # [0] state, [1] ppid, [2] process group
        if fields and len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def boot_id() -> str | None:
    """This boot's id (``None`` where ``/proc`` does not say): with a pid, names a process
    across reboots."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def exit_status(pid: int) -> int | None:
    """The exit status of an exited, not yet reaped process: ``-N`` when signal ``N`` killed
    it, else its exit code. ``None`` when it is still running or already reaped."""
    fields = stat_fields(pid)
    # fields[0] is field 3 (the state); the exit code is field 52 (Linux >= 3.5)
    if fields is None or len(fields) < 50 or fields[0] not in (b"Z", b"X"):
        return None
    return _decode_wait_status(int(fields[49]))


def _decode_wait_status(status: int) -> int:
    """A ``waitpid`` status as an exit code: ``-N`` for signal ``N``."""
    if status & 0x7F:
        return -(status & 0x7F)
    return (status >> 8) & 0xFF


# struct pidfd_info (include/uapi/linux/pidfd.h): mask (u64) at 0, exit_code (s32, a waitpid
# status) at 60, 64 bytes in its first version; PIDFD_GET_INFO = _IOWR(0xFF, 11, that struct)
_PIDFD_GET_INFO = 0xC040FF0B
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_INFO_SIZE = 64


def _reaped_status(pidfd: int) -> int | None:
    """The exit status the pidfd keeps once its process was reaped (Linux 6.15 and later;
    ``None`` before the reaping, on older kernels, or when the call is refused)."""
    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError:  # ENOTTY/EINVAL: no such ioctl; ESRCH: reaped, and no status kept
        return None
    (mask,) = struct.unpack_from("=Q", buf, 0)
    if not mask & _PIDFD_INFO_EXIT:
        return None
    (status,) = struct.unpack_from("=i", buf, 60)
    return _decode_wait_status(status)


def has_children(pid: int) -> bool:
    """Whether a process whose parent is ``pid`` still runs here (a zombie does not count)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat_fields(int(name))  # [0] state, [1] ppid
            if fields and fields[1] == str(pid).encode() and fields[0] not in (b"Z", b"X"):
                return True
    return False


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (``None`` if it is gone)."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else int(fields[1])
    except (ValueError, IndexError):
        return None


def host_id() -> str:
    """This host as process ids see it: its name, its boot and its pid namespace. Two
    processes can watch, signal or wait for each other's pids only when these are equal
    (another machine, or another pid namespace on this one, numbers its processes apart)."""
    try:
        boot, pid_ns = boot_id(), os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot = None
    if boot is None:  # not Linux: the name alone
        boot, pid_ns = "", 0
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


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


_PF_EXITING = 0x4
"""``task_struct.flags`` bit set when a task begins to exit (``/proc/<pid>/stat`` field 9)."""


def is_dying(pid: int) -> bool:
    """Whether process ``pid`` has exited or has begun to: a killed process with many threads
    is marked exiting at once, but its pidfd fires only when its last thread is gone, which
    can come after a child it took down with it has exited."""
    fields = stat_fields(pid)
    if fields is None:
        return True  # reaped
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


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


def die_with_parent(*, also: int = 0, kill_after_s: float = ORPHAN_KILL_S) -> None:
    """From now on, stop this process when its parent exits (its launcher: torchrun's agent,
    the ``asyncrl run`` process, a supervisor), or when process ``also`` does (the controller
    of an embedded run, which is not the parent): SIGTERM to itself, which is the orderly stop
    a launcher's own SIGTERM would start, and SIGKILL to its process group (itself and what it
    started there) if it still lives ``kill_after_s`` later.

    A thread waits on the owners' pidfds. ``PR_SET_PDEATHSIG`` would fire when the parent
    *thread* that forked this process exits, not the parent process (torch 2.13's agent forks
    from its main thread, but nothing promises it), and gives no last resort. An owner that
    is already gone stops it at once: ``also`` (no such process), or the parent named by
    :data:`PARENT_ENV` (this process was orphaned while it started; the variable is taken out
    of the environment, so that this process's own children do not inherit it).
    """
    parent = os.getppid()
    launcher = int(os.environ.pop(PARENT_ENV, "0") or 0)
    fds: dict[int, int] = {}
    if launcher and launcher != parent:  # reparented already: the launcher is gone
        fds[_gone()] = launcher
    else:
        try:
            for pid in dict.fromkeys(p for p in (parent, also) if p):
                fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            fds[_gone()] = pid
        if os.getppid() != parent:  # reparented between the two calls: the parent is gone
            fds[_gone()] = parent
    threading.Thread(
        target=_stop_when_gone, args=(fds, kill_after_s), name="asyncrl-owner-watch", daemon=True
    ).start()


def lost_owner() -> int | None:
    """The pid of the owner whose exit stopped this process (:func:`die_with_parent`), if any."""
    return _LOST[0] if _LOST else None


def _gone() -> int:
    """A descriptor that is readable at once: stands for an owner that already exited."""
    r, w = os.pipe()
    os.close(w)
    return r


def _stop_when_gone(fds: dict[int, int], kill_after_s: float) -> None:
    ready, _, _ = select.select(list(fds), [], [])
    pid = fds[ready[0]]
    for fd in fds:
        os.close(fd)
    _LOST.append(pid)
    log.warning("owner_lost", owner_pid=pid, kill_after_s=kill_after_s)
    # to the main thread: a signal the kernel hands to this thread would not interrupt a
    # blocking call there (the supervisor's select), so its handler would wait for that call
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
    time.sleep(kill_after_s)
    log.error("owner_lost_kill", owner_pid=pid, after_s=kill_after_s)
    if os.getpgrp() == os.getpid():  # a session or group of its own: take what it started
        kill_process_group(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
