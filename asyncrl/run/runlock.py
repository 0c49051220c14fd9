"""One writer per run directory: ``run.output_dir``, ``checkpoint.dir`` and ``export.dir`` are
locked while a run owns them, and a second run on one of them is refused before it starts
anything.

::

    controller start ── lock <dir>/run.lock of each ── ... ── end: unlock, unlink
                          └─ held: RunDirectoryInUseError (pid, host, since; exit 2)
    asyncrl run ── looks (takes nothing) ── then starts torchrun

The controller's process holds the locks for the whole run (it is rank 0 under
``asyncrl run`` and ``torchrun -m asyncrl.launch``, the host when embedded). They are POSIX
record locks (``fcntl`` F_SETLK on the whole file), which the kernel drops when the process
exits, however it exits: a lock left by a dead run (SIGKILL, a lost machine) is taken over
by the next run, which logs ``run_lock_taken_over`` with what the file said. The file body
(pid, host, start time) is only for the message.

Why record locks rather than ``flock``: they can be tested without being taken (F_GETLK), so
``asyncrl run``'s look can never make a starting run fail; and they are not inherited by
forked children, so a forked helper of a killed controller cannot keep its directory locked.
Their traps are handled here: a process's own locks never conflict with each other (the paths
this process holds are recorded too, for two embedded controllers in one host), and closing
any descriptor of the file drops the lock (only this module opens it). Releasing unlinks the
file; a run that locked a file unlinked under it tries again on the new one.

On a shared file system record locks work where the file system supports them (NFS: lockd);
the pid and host in the message then name a process on another machine.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import structlog

from asyncrl.config import Config
from asyncrl.errors import RunDirectoryInUseError

__all__ = ["LOCK_FILE", "RunLock", "check_free", "lock_run"]

log = structlog.get_logger("asyncrl.run.runlock")

LOCK_FILE = "run.lock"
_FLOCK = struct.Struct("hhqqi4x")
"""``struct flock`` on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (32 bytes)."""
_HELD: dict[str, str] = {}
"""Directories locked by this process, with when (record locks of one process never conflict,
and this process must not open their files: closing a descriptor would drop its lock)."""
_HELD_GUARD = threading.Lock()


@dataclass
class RunLock:
    """The locks a run holds; :meth:`release` drops them (idempotent)."""

    paths: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        while self.fds:
            fd, path = self.fds.pop(), self.paths.pop()
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)  # drops the lock
            with _HELD_GUARD:
                _HELD.pop(os.path.dirname(path), None)


def _dirs(config: Config) -> list[tuple[str, str]]:
    """``(field, directory)`` of each directory the run writes that another run must not:
    ``checkpoint.dir`` (a save can be asked for at any time) and ``export.dir`` (when the run
    exports) are locked apart even inside ``run.output_dir``, where another run's may point."""
    named = [("run.output_dir", config.run.output_dir), ("checkpoint.dir", config.checkpoint.dir)]
    if config.export.at_end or config.export.every_steps:
        named.append(("export.dir", config.export.dir))
    out: dict[str, str] = {}
    for name, directory in named:
        out.setdefault(os.path.realpath(directory), name)
    return [(name, directory) for directory, name in out.items()]


def lock_run(config: Config) -> RunLock:
    """Lock the run's directories (creating them) for this process, or raise
    :class:`~asyncrl.errors.RunDirectoryInUseError` naming the run that holds one (nothing
    is left locked then)."""
    held = RunLock()
    try:
        for name, directory in _dirs(config):
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, LOCK_FILE)
            fd = _take(name, directory, path)
            if fd is not None:
                held.fds.append(fd)
                held.paths.append(path)
    except BaseException:
        held.release()
        raise
    return held


def check_free(config: Config) -> None:
    """Raise :class:`~asyncrl.errors.RunDirectoryInUseError` if a live run holds one of the
    run's directories; takes nothing and creates nothing (``asyncrl run`` asks before it
    starts a process)."""
    for name, directory in _dirs(config):
        path = os.path.join(directory, LOCK_FILE)
        _refuse_if_mine(name, directory, path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # no lock file: free (or a directory we may not read: the run will say)
        try:
            holder = _holder(fd)
        except OSError:
            continue  # a file system without record locks: the run will say (see _take)
        finally:
            os.close(fd)
        if holder is not None:
            raise _in_use(name, directory, path, holder)


def _refuse_if_mine(name: str, directory: str, path: str) -> None:
    """Another run of this process (an embedding host's second controller) holds it."""
    with _HELD_GUARD:
        since = _HELD.get(directory)
    if since is not None:
        body = {"pid": os.getpid(), "host": socket.gethostname(), "started": since}
        raise _in_use(name, directory, path, os.getpid(), body)


def _take(name: str, directory: str, path: str) -> int | None:
    """The locked descriptor of ``path``; ``None`` on a file system without record locks
    (logged: the run goes on unguarded rather than not at all)."""
    _refuse_if_mine(name, directory, path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    try:
                        holder = _holder(fd)
                    except OSError:
                        holder = None  # the file's body names it
                    raise _in_use(name, directory, path, holder) from None
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning("run_lock_unavailable", path=path, error=str(exc))
                    return None
                raise
            finally:
                os.close(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)  # its holder released (and unlinked) it under us: the new one
            continue
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        with _HELD_GUARD:
            _HELD[directory] = started
        _write_body(fd, path, started)
        return fd


def _write_body(fd: int, path: str, started: str) -> None:
    """Who holds it, for another run's message; best effort (a full disk: the lock holds)."""
    old = os.pread(fd, 4096, 0)
    if old.strip():  # a run that died without releasing it (its lock died with it)
        log.info("run_lock_taken_over", path=path, previous=old.decode(errors="replace").strip())
    body = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(body).encode() + b"\n", 0)
    except OSError as exc:
        log.warning("run_lock_body_not_written", path=path, error=str(exc))


def _holder(fd: int) -> int | None:
    """The pid holding a lock on the file (F_GETLK: takes nothing), ``None`` if free. On a
    shared file system the pid may be another host's (or 0)."""
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    l_type, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return None if l_type == fcntl.F_UNLCK else pid


def _in_use(
    name: str, directory: str, path: str, pid: int | None, body: dict[str, Any] | None = None
) -> RunDirectoryInUseError:
    """The error naming the holder: its pid from the kernel (``None`` or 0: unknown there,
    e.g. on another host), its host and start time from the file (when they are its)."""
    if body is None:
        try:
            with open(path) as f:  # not held by this process: closing it drops nothing
                body = json.load(f)
        except (OSError, ValueError):
            body = {}
    if not isinstance(body, dict):
        body = {}
    if not pid:
        pid = body.get("pid")
    if body.get("pid") != pid:  # written by an earlier holder, or not yet by this one
        body = {}
    host = body.get("host", "?")
    since = str(body.get("started", "?")).replace("T", " ").replace("+00:00", " UTC")
    return RunDirectoryInUseError(
        f"{name}: {directory} is in use by another run (pid {pid} on host {host}, since "
        f"{since}; lock file {path}). Fix: wait for that run to end, stop it (kill {pid} on "
        f"{host}), or set another {name}."
    )
