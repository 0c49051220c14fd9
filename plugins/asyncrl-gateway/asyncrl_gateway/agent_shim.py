"""Runs a managed agent so that nothing it starts outlives its session or the controller
(standard library only: it is started as a script, without importing asyncrl).

``python agent_shim.py COMMAND...`` with ``ASYNCRL_AGENT_OWNER`` set to the controller's pid,
as the leader of a process group of its own (the controller starts it in a new session): it
makes itself a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), starts ``COMMAND``
in its group and waits for whichever comes first:

* the agent exits: the shim exits with its status;
* SIGTERM (the controller ends the session: its reward, its deadline, the run stopping);
* the controller exits, however it exits (a ``kill -9`` included): its pidfd turns readable.

Then, before it exits, it ends every process the agent started: SIGKILL to each of its
descendants, again until it has no child left. As a subreaper it is the parent every orphan of
the agent's tree is given, so a process that left the agent's group and session (``setsid``,
a daemon's double fork) is still its descendant, found in ``/proc`` and killed; when it has
no child (``ECHILD``), nothing the agent started is left, and every zombie was reaped.

The subreaper is this per-agent process, not the controller: a subreaper on the controller
would also be given the orphans of the run's other processes (torchrun's ranks, which sit
in sessions of their own) and would have to reap children that other code waits for.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

OWNER_ENV = "ASYNCRL_AGENT_OWNER"
PR_SET_CHILD_SUBREAPER = 36
"""From ``<linux/prctl.h>``."""


def _subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux 3.4 and later)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (zombies too; each after its parent), from
    ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(b")") + 2 :].split(None, 2)[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def end_descendants() -> None:
    """SIGKILL every descendant of this process and reap them, until none is left. A process
    forked meanwhile is a child of one being killed: it comes to this subreaper and is found
    on the next pass."""
    me = os.getpid()
    while True:
        for pid in descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)  # one child (each pass reaps one; the kills are done already)
        except ChildProcessError:
            return  # no child left, alive or zombie: every descendant has ended


def main() -> int:
    owner = int(os.environ.pop(OWNER_ENV, "0") or 0)
    if not owner or len(sys.argv) < 2:
        print(f"usage: {OWNER_ENV}=<pid> agent_shim.py COMMAND...", file=sys.stderr)
        return 2
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: None)  # seen through wake_r
    try:
        owner_fd = os.pidfd_open(owner)
    except ProcessLookupError:
        return 1  # the controller is gone already
    if os.getppid() != owner:  # reparented before the pidfd was open: the owner is gone
        return 1
    if not _subreaper():
        print("asyncrl: prctl(PR_SET_CHILD_SUBREAPER) failed: a process the agent starts "
              "in a session of its own may outlive it", file=sys.stderr)  # fmt: skip
    try:
        child = subprocess.Popen(sys.argv[1:])
    except OSError as exc:
        print(f"asyncrl: cannot start the agent {sys.argv[1:]!r}: {exc}", file=sys.stderr)
        return 127
    child_fd = os.pidfd_open(child.pid)  # our child, not reaped yet: it cannot fail
    select.select([owner_fd, child_fd, wake_r], [], [])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the end below is not interrupted
    code = 128 + signal.SIGTERM  # ended from outside (SIGTERM, or the controller gone)
    status = child.poll()
    if status is not None:
        code = status if status >= 0 else 128 - status
    end_descendants()
    return code


if __name__ == "__main__":
    sys.exit(main())
