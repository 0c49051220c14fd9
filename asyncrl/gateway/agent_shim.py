"""Runs a managed agent so that it cannot outlive the controller (standard library only: it is
started as a script, without importing asyncrl).

``python agent_shim.py COMMAND...`` with ``ASYNCRL_AGENT_OWNER`` set to the controller's pid,
as the leader of a process group of its own (the controller starts it in a new session): it
starts ``COMMAND`` in that group, waits for it and exits with its status. When the controller
exits, however it exits (a ``kill -9`` included), a thread waiting on the controller's pidfd
kills the whole group, so the agent and whatever it started go with it. The controller ends a
session's agent the same way: SIGKILL to the group.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading

OWNER_ENV = "ASYNCRL_AGENT_OWNER"


def _kill_group(*_: object) -> None:
    os.killpg(0, signal.SIGKILL)


def main() -> int:
    owner = int(os.environ.pop(OWNER_ENV, "0") or 0)
    if not owner or len(sys.argv) < 2:
        print(f"usage: {OWNER_ENV}=<pid> agent_shim.py COMMAND...", file=sys.stderr)
        return 2
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:
        return 1  # the controller is gone already
    if os.getppid() != owner:  # reparented before the pidfd was open: the owner is gone
        return 1
    signal.signal(signal.SIGTERM, _kill_group)

    def watch() -> None:
        select.select([fd], [], [])
        _kill_group()

    threading.Thread(target=watch, name="agent-owner-watch", daemon=True).start()
    try:
        child = subprocess.Popen(sys.argv[1:])
    except OSError as exc:
        print(f"asyncrl: cannot start the agent {sys.argv[1:]!r}: {exc}", file=sys.stderr)
        return 127
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
