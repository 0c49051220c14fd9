"""A rollout rank that outlives its worker: the torchrun rank starts the worker as a child
process and starts it again, in place, when it dies (``failures.rollout_restarts``).

::

    torchrun agent ── rank (this supervisor: no engine) ── worker (a session of its own)
                                                                         └── engine processes

torchrun stops the whole job when one of its ranks exits, so the rank itself must stay
alive while its worker comes back. The worker runs in a session of its own: after it dies,
whatever it left (an engine process holding GPU memory) is killed as a group before the next
one starts. The controller watches the worker's pid, sends its groups elsewhere, takes the
new process's ``Hello`` and refits it; it also holds the run's budget and stops the run when
it is spent (this side's count only keeps a crash loop from going on forever).

Exits: the worker's own code once it exits 0 (``Shutdown``), after a stop signal (forwarded
to the worker, which cleans up: 128 + N), once the controller is gone (1: its pid exited
here, or the worker said so with :data:`CONTROLLER_LOST`: on another node where the
controller's pid cannot be watched, or a controller silent past the heartbeat's timeout), or
once this rank's restarts are used up (the last code).

The rank that speaks for the run (it keeps the launch's stderr) hands its worker a pipe
(:data:`LAST_WORDS_ENV`): a worker that found the controller silent writes its one line
there, and the supervisor prints it while the controller still lives (a dead one is named
here, from its exit status).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence

import structlog

from asyncrl.procs.process import (
    PARENT_ENV,
    exit_status,
    group_runs,
    has_exited,
    kill_process_group,
    pid_exists,
    stopped_by_signal,
)

__all__ = ["LAST_WORDS_ENV", "last_words_fd", "supervise"]

log = structlog.get_logger("asyncrl.procs.supervisor")

CONTROLLER_LOST = 3
"""A supervised worker's exit code once it stopped because the controller is gone (dead,
or silent past the heartbeat's timeout: another node's, cut off): it is not started again,
and this rank exits 1. Any other failure is a death the worker is restarted after."""
STATUS_READ_S = 0.3
"""How long a dead worker stays a zombie before it is reaped, so the controller's watcher
(woken by its pidfd) reads its exit code from ``/proc``."""
LOST_GRACE_S = 40.0
"""After the controller exited: how long the worker has to finish closing its engine (the
worker runtime bounds that at 30 s) or to notice the loss and clean up, before SIGTERM, and
then before SIGKILL."""
GROUP_GONE_S = 10.0
"""How long to wait for a dead worker's leftover processes to go after SIGKILL."""
LAST_WORDS_ENV = "ASYNCRL_LAST_WORDS_FD"
"""In a supervised worker's environment: the descriptor of a pipe to its supervisor, where it
writes the line it would print if it spoke for the run (:func:`last_words_fd`)."""


def supervise(
    cmd: Sequence[str],
    *,
    max_restarts: int,
    controller_pid: int = 0,
    console: int | None = None,
    backoff_s: float = 1.0,
    log_path: str = "?",
) -> int:
    """Run ``cmd`` (a worker) until it exits 0 or a stop signal comes, starting it again up
    to ``max_restarts`` times when it dies otherwise. ``controller_pid``: once it is gone,
    stop (and, with ``console``, a descriptor of the launch's stderr, say so in one line,
    naming ``log_path``, this rank's log). Returns this rank's exit code."""
    stopping: list[int] = []
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        if child:
            kill_process_group(child[0].pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    restarts = 0
    lost: int | None = None  # the controller's exit status, when it exited before the worker
    try:
        while True:
            env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})  # see die_with_parent
            words, to_words = os.pipe() if console is not None else (-1, -1)
            try:
                if to_words >= 0:
                    env[LAST_WORDS_ENV] = str(to_words)
                child[:] = [subprocess.Popen(list(cmd), start_new_session=True, env=env,
                                             pass_fds=(to_words,) if to_words >= 0 else ())]  # fmt: skip
            except BaseException:
                _close(words)
                raise
            finally:
                _close(to_words)
            pid = child[0].pid
            if stopping:  # a signal came while it was being started
                kill_process_group(pid, stopping[0])
            if _wait(pid, controller_pid):
                # the controller exited first: after a Shutdown (the worker is still closing
                # its engine, and exits 0) or dead (it stops too, once it sees it); either
                # way no new worker, which would wait for an Init that never comes
                lost = _status_soon(controller_pid)
                _stop(pid)
            time.sleep(STATUS_READ_S)
            code = child[0].wait()
            _kill_group(pid)
            said = _last_words(words)
            if code != 0 and lost is not None and lost < 0 and not stopped_by_signal(lost):
                # the controller was killed (it could not say so itself). Before the stop
                # signal is taken for the reason: torchrun sends this rank one right after
                # the controller's death, while the worker is still cleaning up.
                if console is not None:
                    os.write(console, controller_lost_line(controller_pid, lost, log_path))
                return 1
            if code == 0 or stopping:
                return 128 + stopping[0] if stopping and code != 0 else _rank_code(code)
            if code == CONTROLLER_LOST:  # a new worker would wait for an Init never sent
                log.error("controller_lost", restarts=restarts)
                # its line, unless the controller exited (then it said why, or is named below)
                if console is not None and said and not (
                    controller_pid and has_exited(controller_pid)
                ):
                    os.write(console, said)
                return 1
            if controller_pid and has_exited(controller_pid):
                status = exit_status(controller_pid) if lost is None else lost
                # a controller that exited by itself (status >= 0) printed its own line
                if console is not None and (status is None or status < 0):
                    os.write(console, controller_lost_line(controller_pid, status, log_path))
                return 1
            if restarts >= max_restarts:
                log.error("worker_not_restarted", exit_code=code, restarts=restarts)
                return _rank_code(code)
            restarts += 1
            log.warning("worker_restarting", exit_code=code, restart=restarts, of=max_restarts)
            time.sleep(backoff_s)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def last_words_fd() -> int | None:
    """In a supervised worker: the pipe to its supervisor (:data:`LAST_WORDS_ENV`, taken out
    of the environment and kept from the worker's own children); ``None`` when it has none."""
    value = os.environ.pop(LAST_WORDS_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        os.set_inheritable(fd, False)
    except OSError:  # not open here: started by hand, with the variable set
        return None
    return fd


def _last_words(fd: int) -> bytes:
    """What the exited worker wrote to its pipe (at most a line or so), and close it; what
    its leftover processes, killed by now, could hold open does not block the read."""
    if fd < 0:
        return b""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""
    finally:
        os.close(fd)


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def _wait(pid: int, controller_pid: int) -> bool:
    """Until the worker exits (False, not reaped) or the controller does first (True)."""
    fds = [os.pidfd_open(pid)]
    try:
        if controller_pid:
            try:
                fds.append(os.pidfd_open(controller_pid))
            except ProcessLookupError:
                return True
        while True:
            ready, _, _ = select.select(fds, [], [])  # a signal: handled, then waits again
            if fds[0] in ready:
                return False
            if ready:
                return True
    finally:
        for fd in fds:
            os.close(fd)


def _stop(pid: int) -> None:
    """The controller is gone: let the worker clean up and exit (it watches the controller),
    then SIGTERM, then SIGKILL its session."""
    fd = os.pidfd_open(pid)
    try:
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                kill_process_group(pid, sig)
            if select.select([fd], [], [], LOST_GRACE_S)[0]:
                return
    finally:
        os.close(fd)


def _rank_code(code: int) -> int:
    """A child's return code as a process exit code (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def _kill_group(pgid: int) -> None:
    """Kill what the dead worker left in its session and wait (bounded) until it is gone."""
    kill_process_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + GROUP_GONE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if not group_runs(pgid):  # only zombies left, for their new parent to reap
            return
        time.sleep(0.05)
    log.warning("worker_leftovers_remain", pgid=pgid)


def controller_lost_line(pid: int, status: int | str | None, log_path: str) -> bytes:
    """The one line a worker rank prints when the controller (global rank 0) died."""
    how = f" with exit code {status}" if status is not None else ""
    return (
        f"asyncrl: error: the controller (global rank 0, pid {pid}) died{how}; the workers "
        f"stopped their engines and removed the run's files (this rank's log: {log_path})\n"
    ).encode()


def _status_soon(pid: int, within_s: float = 0.5) -> int | None:
    """``pid``'s exit status, read while it is a zombie: its pidfd fires a moment before
    ``/proc`` shows the status (``None``: already reaped, or not readable in time)."""
    deadline = time.monotonic() + within_s
    while True:
        status = exit_status(pid)
        if status is not None or not pid_exists(pid) or time.monotonic() > deadline:
            return status
        time.sleep(0.01)
