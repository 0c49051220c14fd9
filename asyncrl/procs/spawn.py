"""Worker processes: spawning torchrun groups, watching them, and stopping them for good.

Every worker reports its pid in ``Hello``. Death is noticed without polling:

* a *pidfd* per worker (``os.pidfd_open``) becomes readable the moment that process exits,
  whoever its parent is (so it also works under ``torchrun -m asyncrl.launch``);
* for groups the controller spawned itself, ``Process.wait()`` on the torchrun agent.

torchrun puts each rank in a session of its own, so a rank's process group holds the rank and
the engine processes it started. Stopping is: ``Shutdown`` message, grace, SIGTERM to the
agent (torchrun forwards it), grace, then SIGKILL to every rank's process group and the agent.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import structlog

from asyncrl.errors import WorkerDiedError
from asyncrl.procs.process import (
    PARENT_ENV,
    has_children,
    kill_process_group,
    pid_exists,
    wait_exit_status,
    wait_pid_exit,
)
from asyncrl.wire.rpc import Peer
from asyncrl.procs.space import shm_dir

__all__ = [
    "CONTROLLER_PID_FILE",
    "TORCHRUN",
    "SpawnedGroup",
    "parse_torchrun_exit",
    "reap_stale_runs",
    "spawn_group",
    "stop_processes",
    "torchrun_log_args",
    "watch_peer",
    "worker_args",
    "worker_env",
]

CONTROLLER_PID_FILE = "controller.pid"
"""In each run's private directory: the pid of the controller that owns it."""

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
"""How the controller starts a worker group: torchrun as a module of the controller's own
interpreter, so the workers run the same Python and packages whatever ``PATH`` says (the
``torchrun`` script on ``PATH`` may be another environment's). Once the config key
``cluster.torchrun`` (issue 50), whose default already meant this."""

log = structlog.get_logger("asyncrl.procs.spawn")

AGENT_EXIT_S = 0.2
"""Once every worker of a run that is stopping has exited, how long a torchrun agent may take
to exit on its own before it is killed: it has nothing left to do, but torch elastic's way
out (its next monitor tick, its exit barrier, its store) took 0.5-1.3 s a group, paid by every
run's stop (2-core machine; each test's run too)."""

_EXIT_RE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


@dataclass
class SpawnedGroup:
    """A torchrun agent the controller started, with its ranks' log files."""

    group: str
    nproc: int
    process: anyio.abc.Process
    agent_log: str
    log_dir: str
    worker_pids: list[int] = field(default_factory=list)

    def worker_log(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"{self.group}-{rank}.log")


def parse_torchrun_exit(text: str) -> dict[int, int]:
    """Exit codes per rank from torchrun's failure summary (``rank : 1 ... exitcode : -9``)."""
    return {int(r): int(c) for r, c in _EXIT_RE.findall(text)}


def torchrun_log_args(scratch_dir: str) -> list[str]:
    """torchrun's ``--log-dir``, pointed at ``scratch_dir``: a directory that goes with the
    run. torchrun makes (empty) per-attempt directories there; left to itself, it makes a
    ``/tmp/torchelastic_*`` directory per launch and never removes it. Every torchrun that
    asyncrl starts passes this."""
    return [f"--log-dir={scratch_dir}"]


async def spawn_group(
    *,
    group: str,
    nproc: int,
    control_address: str,
    log_dir: str,
    scratch_dir: str,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> SpawnedGroup:
    """Start ``torchrun --standalone --nproc-per-node nproc -m asyncrl.launch --worker group``.

    The agent's own output goes to ``<log_dir>/torchrun-<group>.log``; each rank writes
    ``<log_dir>/<group>-<rank>.log``. ``args``: more arguments for ``asyncrl.launch``.
    torchrun's own per-attempt directories go under ``scratch_dir``, the run's private
    directory (:func:`torchrun_log_args`).
    """
    os.makedirs(log_dir, exist_ok=True)
    agent_log = os.path.join(log_dir, f"torchrun-{group}.log")
    cmd = [
        *TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--monitor-interval=0.5",
        *torchrun_log_args(os.path.join(scratch_dir, f"torchelastic-{group}")),
        "-m",
        "asyncrl.launch",
        "--worker",
        group,
        "--control",
        control_address,
        "--log-dir",
        log_dir,
        *(args or []),
    ]
    full_env = dict(os.environ)
    # a launcher's pid meant for this process's own ranks (asyncrl run): not these workers'
    # (torchrun is their parent; they watch this controller)
    full_env.pop(PARENT_ENV, None)
    full_env.update(env or {})
    with open(agent_log, "ab") as out:
        process = await anyio.open_process(
            cmd, stdin=None, stdout=out, stderr=out, env=full_env, start_new_session=True
        )
    log.info("group_spawned", group=group, nproc=nproc, pid=process.pid, log=agent_log)
    return SpawnedGroup(group, nproc, process, agent_log, log_dir)


async def watch_peer(peer: Peer, spawned: SpawnedGroup | None, grace_s: float = 10.0) -> None:
    """Return never; raise :class:`WorkerDiedError` when the worker's process exits.

    For a spawned group, waits (up to ``grace_s``) for the torchrun agent to report the
    rank's exit code. Cancellation: stops watching.
    """
    exit_code = await wait_exit_status(peer.pid)  # no need to be its parent
    if exit_code is None and spawned is not None:  # a kernel that keeps no reaped status
        with anyio.move_on_after(grace_s):
            await spawned.process.wait()
        try:
            text = Path(spawned.agent_log).read_text(errors="replace")
            exit_code = parse_torchrun_exit(text).get(peer.rank)
        except OSError:
            pass
    raise WorkerDiedError(peer.group, peer.rank, exit_code, peer.log_path or None)


async def stop_processes(
    spawned: list[SpawnedGroup], worker_pids: list[int], grace_s: float, *,
    clean: bool = False,
) -> None:
    """Escalate SIGTERM → SIGKILL over the agents and every worker's process group. A
    ``clean`` stop (the run ended without an error, so no agent is writing a worker's
    failure to its log): once the workers have exited within ``grace_s``, an agent still
    there after :data:`AGENT_EXIT_S` is killed (its group with it), having nothing left to
    supervise.

    Runs shielded; never raises. Returns when everything is gone (or after SIGKILL).
    """
    with anyio.CancelScope(shield=True):

        async def wait_all(deadline_s: float, *, agents: bool = True) -> bool:
            with anyio.move_on_after(deadline_s):
                for pid in worker_pids:
                    await wait_pid_exit(pid)
                for g in spawned:
                    if agents:
                        await g.process.wait()
                    while g.process.returncode is None and has_children(g.process.pid):
                        await anyio.sleep(0.02)  # a rank the agent started (a supervisor)
                return True
            return False

        if clean and await wait_all(grace_s, agents=False):
            if await wait_all(AGENT_EXIT_S):
                return
            for g in spawned:
                if g.process.returncode is None:
                    kill_process_group(g.process.pid, signal.SIGKILL)
            await wait_all(5)
            return
        if not clean and await wait_all(grace_s):
            return
        for g in spawned:
            if g.process.returncode is None:
                kill_process_group(g.process.pid, signal.SIGTERM)
        for pid in worker_pids:
            kill_process_group(pid, signal.SIGTERM)
        if await wait_all(grace_s):
            return
        log.warning("processes_killed", pids=worker_pids)
        for pid in worker_pids:
            kill_process_group(pid, signal.SIGKILL)
        for g in spawned:
            kill_process_group(g.process.pid, signal.SIGKILL)
        await wait_all(5)


def reap_stale_runs(base: str) -> list[str]:
    """Remove the run directories under ``base`` (ipc sockets) and their shared-memory
    directories whose controller is gone: what a run killed as a whole (SIGKILL to every
    process, a lost machine) could not remove itself. Returns the run ids removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except FileNotFoundError:
        return removed
    for entry in entries:
        try:
            pid = int(Path(entry.path, CONTROLLER_PID_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a run directory, or one being created
        if pid_exists(pid):  # this process's own directory included
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        shutil.rmtree(shm_dir(entry.name), ignore_errors=True)
        removed.append(entry.name)
    if removed:
        log.info("stale_run_files_removed", run_ids=removed)
    return removed


def worker_args(restarts: int) -> list[str]:
    """The worker command's extra arguments: every rank watches this controller from its
    start (it stops once the controller is gone, even before the handshake); a rank whose
    worker may be restarted ``restarts`` times supervises it (:mod:`asyncrl.procs.supervisor`)."""
    pid = ["--controller-pid", str(os.getpid())]
    return ["--max-restarts", str(restarts), *pid] if restarts else pid


def worker_env(group: str) -> dict[str, str]:
    """Environment for spawned workers: nothing beyond what the process needs to start."""
    env = {"ASYNCRL_GROUP": group, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
