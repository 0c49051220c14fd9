"""Restart and redispatch: what happens to work whose worker or whose generation failed.

* A rollout worker that dies is restarted in place while the run's budget allows
  (``failures.rollout_restarts``; its rank supervises it, :mod:`asyncrl.procs.supervisor`):
  :class:`Restarts` owns the pool of rollout workers (which serve, the restarts left,
  :class:`~asyncrl.policy.pool.RolloutPool`) and carries a restart through::

      watch(): WorkerDiedError ─► restart: pool.lost() ─► the control plane forgets it
        ─► loops.worker_lost() (its groups to the workers that serve) ─► its new process
        ready (its supervisor watched) ─► pool.returned() ─► sync task: loops.refit_worker()
        ─► pool.synced() ─► loops.worker_serves() (it takes work again); watch() goes on
        with the new process at once (a death while it syncs is a new restart). No restart
        granted: watch() raises the death. The sync tasks are :class:`Restarts`' own:
        :meth:`Restarts.close` cancels them when the run ends, before the workers stop.

* A generation that fails is retried after a back-off, or dropped within the failure budget;
  a group whose scoring fails is dropped; a lost worker's groups are sent again at once:
  :class:`Redispatcher`. The failure budget decides (:mod:`asyncrl.policy.failures`); the
  live groups keep the groups and their prompts (:mod:`asyncrl.policy.live`).

* Requests go out with :func:`send_generate` (the rollout pump's groups): a
  worker found restarting is skipped, its groups come back through ``worker_lost``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import anyio.abc
import structlog

from asyncrl.config import Config
from asyncrl.errors import (
    WorkerDiedError,
    WorkerHungError,
    WorkerLostError,
    WorkerOrphanedError,
    WorkerRestarting,
    WorkerStartupError,
)
from asyncrl.policy.failures import FailureBudget
from asyncrl.policy.pool import SYNCING, RolloutPool
from asyncrl.procs.process import ProcessExit, parent_pid, stopped_by_signal, wait_pid_exit
from asyncrl.procs.spawn import SpawnedGroup, watch_peer
from asyncrl.policy.live import LiveGroups
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.requests import Request
from asyncrl.policy.groups import Group
from asyncrl.wire.messages import Generate, GenRequest, GroupFailed
from asyncrl.wire.rpc import ControlPlane

__all__ = ["Redispatcher", "Restarts", "WorkerLoops", "send_generate"]

log = structlog.get_logger("asyncrl.run.restarts")


async def _remote_death(
    peer: Any, lost: Callable[[Any], Awaitable[WorkerDiedError]]
) -> WorkerDiedError:
    """Wait until ``peer``, on another host, is gone: its last words or its successor's
    ``Hello`` (``Peer.gone``: a death named as such), or the heartbeat's ``lost`` verdict."""
    verdict: list[WorkerDiedError] = []
    async with anyio.create_task_group() as tg:

        async def silent() -> None:
            verdict.append(await lost(peer))
            tg.cancel_scope.cancel()

        tg.start_soon(silent)
        await peer.gone.wait()
        tg.cancel_scope.cancel()
    if verdict:
        return verdict[0]
    host = peer.host_name
    return WorkerDiedError(
        peer.group, peer.rank, None, peer.log_path or None,
        message=f"worker {peer.identity} on host {host!r} (pid {peer.pid} there) died: "
        f"{'its last words came' if peer.last_words else 'a new process of it said Hello'}; "
        f"its log, on {host!r}: {peer.log_path or 'n/a'}",
    )


async def send_generate(control: ControlPlane, by_worker: dict[str, list[GenRequest]]) -> None:
    """One ``Generate`` to each worker of ``by_worker`` with its requests, each sent without an
    answer to wait for (a :class:`~asyncrl.wire.messages.Cast`: the samples are the answer),
    all at once (a worker's socket at its high-water mark holds up no other's). A worker that
    died meanwhile and is restarting is skipped: its groups were sent again already, or will
    be (``worker_lost``).

    Cancellation: the sends are abandoned (the requests may still reach the engines).
    """
    async with anyio.create_task_group() as tg:
        for worker, requests in by_worker.items():
            tg.start_soon(control.cast_unless_restarting, worker, Generate(requests=requests))


class WorkerLoops(Protocol):
    """What a restart asks of the run's loops (:class:`~asyncrl.run.loops.Pipeline`)."""

    async def worker_lost(self, worker: str) -> None:
        """Send ``worker``'s groups to the workers that serve (or let them wait for one)."""

    async def refit_worker(self, worker: str) -> int:
        """Refit ``worker`` alone to the trainer's weights; returns their version."""

    async def worker_serves(self, worker: str) -> None:
        """``worker`` takes work again."""


class Restarts:
    """The rollout workers, which of them serve, and their restarts in place, for one run.

    Built with the run (a controller builds one per ``async with``); :meth:`bind` hands it
    the run's loops once they exist (before that, a death is fatal: the run has not
    started), :meth:`close` ends it.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        rollouts = [f"rollout:{rank}" for rank in range(config.cluster.rollout_ranks)]
        self._pool = RolloutPool(rollouts, config.rollout_restarts)
        self._loops: WorkerLoops | None = None
        self._metrics: Any = None
        self._syncs: set[anyio.CancelScope] = set()
        """The sync tasks under way (a restarted worker's refit), cancelled by :meth:`close`."""
        self._closed = False

    def bind(self, loops: WorkerLoops, metrics: Any = None) -> None:
        """The run's loops (and metrics writer) that restarts act on."""
        self._loops, self._metrics = loops, metrics

    def close(self) -> None:
        """The run is over (called with the watchers' end, before the workers are stopped):
        the sync tasks still under way are cancelled and no more start (a refit then would
        race the trainers' shutdown)."""
        self._closed = True
        for scope in self._syncs:
            scope.cancel()

    @property
    def serving(self) -> list[str]:
        """The rollout workers that take work now, in rank order."""
        return self._pool.serving

    @property
    def workers(self) -> list[str]:
        """Every rollout worker, in rank order."""
        return self._pool.workers

    def of_group(self, group: str) -> int:
        """Times a rank of ``group`` may be restarted in place (its rank supervises it)."""
        return self.config.rollout_restarts if group == "rollout" else 0

    def survivable(self, peer: Any) -> bool:
        """Whether ``peer``'s death would be outlived (a rollout worker, restarts left)."""
        pool = self._pool
        return peer.group == "rollout" and (
            self._loops is not None and pool.restarts < pool.max_restarts
        )

    async def watch(
        self,
        control: ControlPlane,
        peer: Any,
        agent: SpawnedGroup | None,
        tg: anyio.abc.TaskGroup,
        *,
        named: Callable[[Any, WorkerDiedError], WorkerDiedError],
        fatal: Callable[[WorkerDiedError], None],
        lost: Callable[[Any], Awaitable[WorkerDiedError]],
    ) -> None:
        """Watch ``peer``'s process (and its torchrun ``agent``, for a rank of one) until it
        dies; restart it in place while the pool grants it, and watch its new process.
        ``named(peer, died)`` says what a death was (a hang the heartbeat killed it for);
        ``fatal(died)`` records a death the run does not outlive, before it is raised.
        A peer on another host is watched through its connection instead (its pid means
        nothing here): its last words or its successor's ``Hello`` (``Peer.gone``), or
        ``lost(peer)``, the heartbeat's verdict that it is silent.

        Raises:
            WorkerDiedError: a death the run does not outlive (or the worker's own last
                words, a ``WorkerError``), or a supervisor that exited too.
            WorkerStartupError: a restarted worker not ready in time.

        Cancellation: stops watching (a sync task runs in ``tg`` until :meth:`close`).
        """
        while True:
            if peer.remote:
                died, supervisor = await _remote_death(peer, lost), None
            else:
                supervisor = parent_pid(peer.pid)  # read while it lives
                # its owner's pidfd, opened while it lives: its exit status, even once reaped
                owner = ProcessExit(supervisor) if supervisor and supervisor > 1 else None
                try:
                    await watch_peer(peer, agent)
                except WorkerDiedError as exc:
                    died = named(peer, exc)  # a hang it was killed for, if so
                    died = await self._orphaned(peer, died, owner)
                finally:
                    if owner is not None:
                        owner.close()
            back = await self._restart(control, peer, died, supervisor, tg)
            if back is None:
                self._budget_spent(peer, died)
                fatal(died)
                raise (peer.last_words or died) from None
            peer = back

    async def _orphaned(
        self, peer: Any, died: WorkerDiedError, owner: ProcessExit | None
    ) -> WorkerDiedError:
        """What ``peer``'s death was when its owner (its parent while it served: a rollout
        rank's supervisor, or the torchrun agent that started it) died first: a
        :class:`WorkerOrphanedError` naming that death (the worker only obeyed its owner
        watch: exit code 143); else ``died`` itself.

        "First" is read from how the owner ended: killed by a signal. An owner that outlives
        its worker ends by returning (a supervisor reaps its worker, then exits with a code;
        it forwards SIGTERM and SIGINT instead of dying of them), so a signal death found
        after the worker's is the one that came before it. An owner that is this process or
        its own launcher is not named: its death stops this controller too, which says so.
        """
        if owner is None or owner.pid in (os.getpid(), os.getppid()):
            return died
        if isinstance(died, WorkerHungError) or not owner.exited():
            return died
        status = await owner.status(within_s=0.5)
        if status is None or status >= 0:  # exited by itself, or unknown: not claimed
            return died
        return WorkerOrphanedError(
            peer.group, peer.rank, died.exit_code, peer.log_path or None,
            owner="supervisor" if self.of_group(peer.group) else "torchrun agent",
            owner_pid=owner.pid, owner_status=status,
        )  # fmt: skip

    def _budget_spent(self, peer: Any, died: WorkerDiedError) -> None:
        """Add a line to ``died`` when the restarts the run allowed were all used."""
        pool = self._pool
        if self._loops is not None and peer.group == "rollout" and pool.max_restarts and (
            pool.restarts >= pool.max_restarts
        ):
            died.add_detail(
                f"rollout workers were restarted {self._pool.restarts} times in this run, "
                "all that failures.rollout_restarts allows"
            )

    async def _restart(
        self,
        control: ControlPlane,
        peer: Any,
        died: WorkerDiedError,
        supervisor: int | None,
        tg: anyio.abc.TaskGroup,
    ) -> Any:
        """``peer`` died: if the pool grants a restart, send its groups elsewhere, wait for
        its new process (its ``supervisor`` starts it), mark it returned, start its refit in
        ``tg`` and return it (to be watched while it syncs). ``None``: no restart (not a
        rollout worker, no run, a stop signal's consequence, the budget spent).

        A remote peer found silent (``died`` a :class:`WorkerLostError`: its node gone or
        cut off, or the worker hangs there) is restarted only if its new process says
        ``Hello`` within ``failures.heartbeat_timeout_s`` more; nothing here can restart it.

        Raises:
            WorkerDiedError: its supervisor exited too.
            WorkerStartupError: its new process was not ready within
                ``cluster.startup_timeout_s``.
        """
        loops = self._loops
        if peer.group != "rollout" or loops is None or stopped_by_signal(died.exit_code):
            return None
        if isinstance(died, WorkerOrphanedError):  # its supervisor is gone: none comes back
            return None
        if isinstance(died, WorkerLostError) and self.survivable(peer):
            with anyio.move_on_after(self.config.failures.heartbeat_timeout_s):
                await peer.gone.wait()  # its successor said Hello: it died and came back
            if not peer.gone.is_set():
                died.add_detail(
                    f"no new process of {peer.identity} came from {peer.host_name!r} within "
                    f"{self.config.failures.heartbeat_timeout_s:g} s more: not restarted"
                )
                return None
        if not self._pool.lost(peer.identity):
            return None
        start = time.perf_counter()
        why = str(peer.last_words or died).splitlines()[0]
        log.warning("worker_restarting", worker=peer.identity, error=why,
                    restart=self._pool.restarts, of=self._pool.max_restarts)  # fmt: skip
        control.forget(peer.identity, WorkerRestarting(f"{peer.identity} is restarting: {why}"))
        await loops.worker_lost(peer.identity)
        timeout = self.config.cluster.startup_timeout_s
        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as watch:

                async def supervisor_gone() -> None:
                    if supervisor:
                        await wait_pid_exit(supervisor)
                        raise WorkerDiedError(peer.group, peer.rank, died.exit_code,
                                              peer.log_path, "and its supervisor exited too")

                watch.start_soon(supervisor_gone)
                back = await control.wait_peer(peer.identity)
                watch.cancel_scope.cancel()
            # before its new process is watched: a death seen at once finds it SYNCING
            self._pool.returned(peer.identity)
            restarted = {"kind": "worker_restarted", "worker": peer.identity,
                         "exit_code": died.exit_code, "error": why}  # fmt: skip
            self._start_sync(tg, loops, restarted, start)
            return back
        raise WorkerStartupError(
            f"{peer.identity} died ({why}) and its new process was not ready within "
            f"{timeout:.0f} s (cluster.startup_timeout_s); see {peer.log_path}"
        )

    def _start_sync(
        self, tg: anyio.abc.TaskGroup, loops: WorkerLoops, restarted: dict[str, Any],
        start: float,
    ) -> None:
        """:meth:`_sync` in ``tg``, under a cancel scope of this object's (see :meth:`close`)."""
        if self._closed:
            return
        scope = anyio.CancelScope()
        self._syncs.add(scope)

        async def sync() -> None:
            try:
                with scope:
                    await self._sync(loops, restarted, start)
            finally:
                self._syncs.discard(scope)

        tg.start_soon(sync, name=f"sync-{restarted['worker']}")

    async def _sync(self, loops: WorkerLoops, restarted: dict[str, Any], start: float) -> None:
        """The restarted worker's new process is ready (and watched): refit it to the
        trainer's weights, then it takes work again; unless it died again meanwhile (that
        death is being handled: its own sync follows)."""
        worker = restarted["worker"]
        if self._pool.state(worker) != SYNCING:
            return
        version = await loops.refit_worker(worker)
        if self._pool.state(worker) != SYNCING:
            return
        self._pool.synced(worker)
        log.info("worker_back", worker=worker, version=version)
        await loops.worker_serves(worker)
        seconds = round(time.perf_counter() - start, 3)
        if self._metrics is not None:
            self._metrics.write({**restarted, "restart": self._pool.restarts, "seconds": seconds})
        log.info("worker_restarted", worker=worker, seconds=seconds)


class Redispatcher:
    """Failed and lost groups' fates. ``wake`` wakes the rollout pump."""

    def __init__(
        self, rollout: RolloutPhase, groups: LiveGroups, *, failures: FailureBudget,
        wake: Callable[[], None],
    ) -> None:
        self.rollout, self.groups = rollout, groups
        self.failures = failures
        self._wake = wake

    def group_failed(
        self, group: Group, msg: GroupFailed, aborting: bool, tg: anyio.abc.TaskGroup
    ) -> None:
        """Retry the group after a back-off (in ``tg``), or drop it (:mod:`asyncrl.policy.failures`);
        one being aborted is simply gone."""
        error = f"{msg.error_type}: {msg.message}"
        self._failed(group.group_id, group.prompt_id, error, msg.retryable, aborting,
                     msg.worker, tg)  # fmt: skip

    def episode_failed(
        self, gid: str, prompt_id: str, error: str, retryable: bool, tg: anyio.abc.TaskGroup
    ) -> dict[str, list[str]]:
        """An episode of group ``gid`` failed (``error`` names it): the group fails as
        :meth:`group_failed` says. Returns the turns its other episodes still wait for, by
        worker (abandoned: tell each worker to abort them)."""
        aborting = not self.rollout.generating(gid)
        return self._failed(gid, prompt_id, error, retryable, aborting, "", tg)

    def _failed(
        self, gid: str, prompt_id: str, error: str, retryable: bool, aborting: bool,
        worker: str, tg: anyio.abc.TaskGroup,
    ) -> dict[str, list[str]]:
        if aborting:  # counted as aborted already: gone, nothing to retry
            turns = self.rollout.failed(gid, retry=False)
            self._wake()
            return turns
        delay = self.failures.generation_failed(
            gid, prompt_id, retries=self.rollout.retries(gid), retryable=retryable,
            error=error, worker=worker or "an episode",
        )  # fmt: skip
        turns = self.rollout.failed(gid, retry=delay is not None)
        self._wake()
        if delay is None:
            where = f" on {worker}" if worker else ""
            self.failures.check_dropped(
                self.groups.failed_groups, f"group {gid} (prompt {prompt_id}){where}: {error}"
            )
        else:
            tg.start_soon(self._retry_after, gid, delay)
        return turns

    def score_failed(self, gid: str, what: str) -> None:
        """Drop a group whose scoring failed; the run stops once the failure budget is spent
        (a group the end of the run left unused is not counted)."""
        if self.rollout.score_failed(gid):
            self._wake()
            self.failures.check_dropped(self.groups.failed_groups, what)

    async def _retry_after(self, gid: str, delay: float) -> None:
        await anyio.sleep(delay)
        self.rollout.retry(gid)  # ignored if it was aborted meanwhile (hopeless, the end)
        self._wake()

    def worker_lost(self, worker: str) -> list[Request]:
        """``worker`` died: its groups are dispatched again first (same prompt, same step, no
        back-off, outside the failure budget). Returns the answered requests it was
        generating (episodes' turns, evaluations' prompts: each asker asks another worker)."""
        lost = self.rollout.worker_lost(worker)
        log.info("groups_redispatched", worker=worker, groups=lost.again,
                 requests=len(lost.answered))  # fmt: skip
        self._wake()
        return lost.answered
