"""The controller: one anyio task group that owns the whole run.

::

    async with Controller(config) as ctl:      # bind sockets, spawn/attach workers, handshake
        summary = await ctl.train()            # rollout pump ∥ feeder ∥ train pump (+ evals)
    # on exit, error or cancellation: Shutdown → grace → SIGTERM → SIGKILL, sockets and
    # shared-memory files removed; no task outlives the block

Tasks in the controller's task group and what ends them:

    control reader   ROUTER → replies / Ready / Dead (raises on Dead)      cancelled at exit
    data router      PULL → each sample to its job's feeder (run/intake.py)  cancelled at exit
    watchers         one per worker: pidfd / torchrun agent exit → WorkerDiedError
    heartbeat        Health to each worker every interval; kills a hung one (run/heartbeat.py)
    sync-<worker>    a restarted rollout worker's refit (run/restarts.py); cancelled with
                     the watchers, before the workers are stopped
    the loops        train() runs them (run/loops.py: feeder, pumps, lag, watchdog); they
                     finish after ``run.num_steps``

The controller asks the loops (:class:`~asyncrl.run.loops.Pipeline`) for a handful of things:
``resume``, ``run``, ``request_checkpoint`` / ``save_checkpoint``, ``status``, the two
logprob probes and ``close``; restarts go through :class:`~asyncrl.run.restarts.Restarts`.

Embedded in an asyncio application, the controller spawns its worker groups itself with
torchrun; under ``torchrun -m asyncrl.launch`` the workers already exist and attach.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import numpy as np
import structlog

from asyncrl.checkpoints.directory import CheckpointError
from asyncrl.checkpoints.saving import open_resume, reward_code_of
from asyncrl.config import Config, to_dict
from asyncrl.config.jobs import resolve_paths
from asyncrl.errors import (
    AsyncRLError,
    ConfigError,
    NoSpaceError,
    WorkerDiedError,
    WorkerStartupError,
    flatten,
)
from asyncrl.procs.spawn import (
    CONTROLLER_PID_FILE,
    SpawnedGroup,
    reap_stale_runs,
    spawn_group,
    stop_processes,
    worker_args,
    worker_env,
)
from asyncrl.obs.log import MetricsWriter
from asyncrl.obs.startup import Startup
from asyncrl.wire.messages import Hello, Init, TokenBatch
from asyncrl.config.modes import make_groups
from asyncrl.run.intake import DataRouter
from asyncrl.run.jobs import Jobs, Shared
from asyncrl.run.loops import Pipeline, RunStatus, RunSummary
from asyncrl.run.heartbeat import Heartbeat
from asyncrl.run.preflight import check_before_spawn
from asyncrl.procs.gpu_memory import MemoryPlan
from asyncrl.run.restarts import Restarts
from asyncrl.procs.process import exit_status, has_exited, host_id, stopped_by_signal
from asyncrl.procs.space import shm_dir
from asyncrl.wire.rpc import ControlPlane
from asyncrl.run.runlock import lock_run
from asyncrl.procs.space import no_space_in
from asyncrl.wire.curve import KEYS_ENV, KeysError, RunKeys
from asyncrl.wire.transport import (
    PULL,
    ROUTER,
    Context,
    Rejections,
    ipc_address,
    make_private_dir,
    run_dir_of,
    tcp_address,
)

__all__ = ["Addresses", "Controller", "RunStatus", "RunSummary"]

log = structlog.get_logger("asyncrl.run.controller")


@dataclass(frozen=True)
class Addresses:
    """Where workers find the controller (handed to attached workers by the launcher), and the
    run's CURVE keys (every socket's, ipc as tcp: docs/protocol.md, "Who may connect")."""

    run_id: str
    run_dir: str
    control: str
    data: str
    transfer: str
    log_dir: str
    keys: RunKeys | None = None

    @classmethod
    def make(cls, config: Config) -> Addresses:
        """A fresh run's: a private directory under ``/tmp`` (those of dead runs reaped first)
        for its ipc sockets, its log directory and its keys (read from ``cluster.keys_file``,
        or made). With ``tcp`` the sockets are to be bound on ``cluster.host`` (their ports
        read back: :meth:`bound`).

        Raises:
            ConfigError: ``cluster.keys_file`` cannot be read or is not a key file."""
        cluster = config.cluster
        keys = _run_keys(cluster.keys_file)
        run_id = uuid.uuid4().hex[:12]
        base = os.path.dirname(run_dir_of(run_id))
        make_private_dir(base)
        reap_stale_runs(base)
        run_dir = make_private_dir(run_dir_of(run_id))
        Path(run_dir, CONTROLLER_PID_FILE).write_text(str(os.getpid()))
        log_dir = os.path.join(config.run.output_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        if cluster.network == "tcp":
            tcp = tcp_address(cluster.host)
            return cls(run_id, run_dir, tcp, tcp, tcp, log_dir, keys)
        sockets = [ipc_address(run_dir, name) for name in ("control", "data", "weights-0")]
        return cls(run_id, run_dir, *sockets, log_dir, keys)

    def bound(self, control: str, data: str) -> Addresses:
        """These addresses with the endpoints the controller's sockets were bound to."""
        return replace(self, control=control, data=data)

    def weights(self, trainer0: dict[str, Any]) -> str:
        """Trainer rank 0's weights socket, from its capabilities (it binds a ``tcp://`` one
        on a port of its own choosing and reports it)."""
        return str(trainer0.get("weights_endpoint") or self.transfer)

    def worker_env(self) -> dict[str, str]:
        """What spawned workers need in their environment to reach the sockets: the keys."""
        return {KEYS_ENV: self.keys.to_json()} if self.keys is not None else {}


def _run_keys(keys_file: str) -> RunKeys:
    if not keys_file:
        return RunKeys.generate()
    try:
        return RunKeys.read(keys_file)
    except KeysError as exc:
        raise ConfigError(f"cluster.keys_file: {exc}") from None


AttachHook = Callable[[Addresses, anyio.abc.TaskGroup], Awaitable[None]]


class Controller(anyio.AsyncContextManagerMixin):
    """Owns a run: workers, sockets, pumps. Use as ``async with Controller(config) as ctl``.

    Args:
        config: a validated :class:`~asyncrl.config.Config`.
        attach: ``None`` to spawn the worker groups as torchrun subprocesses. Otherwise an
            async callback ``attach(addresses, task_group)`` called once the sockets are bound;
            it must make the workers connect (``asyncrl.launch`` uses it to publish the
            addresses and to serve rank 0's own worker inside this task group).

        resume: ``None`` for a fresh run; ``"latest"`` for the newest checkpoint in
            ``checkpoint.dir``, or a checkpoint directory (or a directory of them). The run
            goes on from that step boundary: trainer state, scheduler, ready groups, prompt
            stream and ledger restored; the generators refitted before any dispatch.
        allow_changed: with ``resume``, the settings that change what the checkpoint means
            (docs/checkpointing.md, "Resuming with changed settings") that may still differ
            from the checkpoint's: fields or sections (``["loss.clip_eps_low",
            "grpo.temperature"]``, ``["loss"]``, ``["model.tokenizer"]``) or ``["all"]``;
            what ``--allow-changed`` gives on the command line.
        launched_at: when the run was launched (``time.time()``), the origin of the
            ``startup`` record (:mod:`asyncrl.obs.startup`); ``None``: entering the block.
            ``asyncrl.launch`` gives its launcher's process start.

    Entering raises :class:`~asyncrl.errors.WorkerStartupError` if a worker dies or the
    handshake exceeds ``cluster.startup_timeout_s``, and
    :class:`~asyncrl.checkpoints.directory.CheckpointError` (before anything starts) for a checkpoint
    that is missing, corrupt, from another run or of a finished run, and
    :class:`~asyncrl.errors.RunDirectoryInUseError` while another live run holds
    ``run.output_dir``, ``checkpoint.dir`` or ``export.dir`` (held until the block is left);
    a worker dying later raises :class:`~asyncrl.errors.WorkerDiedError` out of the block.
    """

    def __init__(
        self,
        config: Config,
        *,
        attach: AttachHook | None = None,
        resume: str | None = None,
        allow_changed: Sequence[str] = (),
        launched_at: float | None = None,
    ) -> None:
        self.config = config
        self._attach = attach
        self._launched_at = launched_at
        self._resume = resume
        self._allow_changed = list(allow_changed)
        self._pipeline: Pipeline | None = None
        self._jobs: Jobs | None = None
        self._new_run()
        self.addresses: Addresses | None = None

    def _new_run(self) -> None:
        """The state of one run, fresh for each ``async with`` (a second run of this
        controller sees nothing of the first's: its agents, its hung workers, its restarts)."""
        self._spawned: list[SpawnedGroup] = []
        """The torchrun agents this run spawned."""
        self._restarts = Restarts(self.config)
        """The rollout workers that serve, and their restarts in place (run/restarts.py)."""
        self._heartbeat = Heartbeat(self.config.failures)
        self._deaths: list[WorkerDiedError] = []
        """Worker deaths in the order they were seen (the first is the root cause)."""

    def _running_pipeline(self) -> Pipeline:
        if self._jobs is not None:
            raise RuntimeError(
                "the run has jobs ([jobs.<name>]): each job's status, checkpoints and steps are "
                "its own; use Controller.jobs (list, add, stop) and the jobs' directories"
            )
        if self._pipeline is None:
            raise RuntimeError(
                "the controller is not running: call this inside `async with Controller(...)`"
            )
        return self._pipeline

    @property
    def jobs(self) -> Jobs:
        """The run's jobs (a config with ``[jobs.<name>]`` tables; docs/jobs.md): ``list()``
        where each stands, ``add(job)`` another, ``await stop(name)`` one.

        Raises:
            RuntimeError: not running, or the run has no jobs."""
        if self._jobs is None:
            raise RuntimeError("the run has no jobs: add [jobs.<name>] tables to its config "
                               "(docs/jobs.md), inside `async with Controller(...)`")  # fmt: skip
        return self._jobs

    def add_job(self, name: str, table: dict[str, Any]) -> None:
        """Start job ``name`` in the running run: ``table`` as its ``[jobs.<name>]`` table
        would be written in the config (a relative ``environment.base_dir`` is the current
        directory's). It starts at once (its environment loaded, its adapter opened on the
        trainers), and the run goes on until it ends too.

        Raises:
            ConfigError: the table is wrong (naming the field and the fix).
            ValueError: the run has a job of that name already.
            RuntimeError: not running, or the run has no jobs."""
        self.jobs.add_table(name, resolve_paths({name: table}, os.path.abspath)[name])

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Controller]:
        self._new_run()
        self._entered_at = self._launched_at or time.time()
        try:
            async with self._running():
                yield self
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()) and not self._deaths:
                raise
            errors = [e for e in flatten(exc) if not isinstance(e, anyio.get_cancelled_exc_class())]
            root = _root_cause(self._deaths, errors)
            if root is not None and root is not exc:
                raise root from None
            raise

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        cfg = self.config
        # plugin, option and tokenizer errors (a bad environment option, a generator option,
        # a context too short for the prompts...) come before anything exists on disk: nothing
        # is left to clean up when they raise
        environment, tokenizer, memory = await check_before_spawn(cfg)
        # one run per directory: a second one is refused here, before anything of it exists
        lock = lock_run(cfg)
        try:
            async with self._owning(environment, tokenizer, memory):
                yield
        finally:
            lock.release()

    @asynccontextmanager
    async def _owning(
        self, environment: Any, tokenizer: Any, memory: MemoryPlan
    ) -> AsyncIterator[None]:
        """The run proper, once it owns its directories: its sockets, clock and metrics file,
        its workers, its loops; all closed and removed on the way out. ``memory``: the plan
        the preflight made (what a trainer rank holds, whether its state leaves the GPU while
        the engines take their turn)."""
        cfg = self.config
        # the reward code as imported: compared on resume, recorded in each checkpoint
        if cfg.jobs and self._resume not in (None, "latest"):
            raise CheckpointError(
                f"--resume {self._resume}: a run of jobs resumes each job from the newest "
                "checkpoint in its own directory (<checkpoint.dir>/jobs/<name>). Fix: --resume "
                "without a directory (or resume=\"latest\")"
            )
        code = await anyio.to_thread.run_sync(reward_code_of, cfg, environment)
        resume = None if cfg.jobs else await anyio.to_thread.run_sync(lambda: open_resume(
            cfg, self._resume, train_prompts=environment.dataset("train"),
            allow_changed=self._allow_changed, code=code,
        ))  # fmt: skip (a run of jobs: each job resumes from its own checkpoints)
        addr = Addresses.make(cfg)
        ctx = Context(addr.keys)
        t0 = time.perf_counter()  # the run's clock: metrics' "t", the timeline's spans
        wall_t0 = time.time()
        metrics = MetricsWriter.open(cfg, run_id=addr.run_id, origin=t0)
        bound = structlog.contextvars.bound_contextvars(run_id=addr.run_id)
        bound.__enter__()
        try:
            router = ctx.socket(ROUTER, bind=addr.control, router_mandatory=True)
            pull = ctx.socket(PULL, bind=addr.data, hwm=1000, copy=True)  # small messages
            self.addresses = addr = addr.bound(router.last_endpoint, pull.last_endpoint)
            rejections = Rejections(ctx.guard)
            control = self._control_plane(router, addr, rejections, metrics)
            with DataRouter(pull, rejections) as data:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(control.run, name="control-reader")
                    tg.start_soon(data.run, name="data-router")
                    async with self._workers(tg, control, addr, metrics) as trainers:
                        startup = Startup(
                            launched=self._entered_at, controller=wall_t0, ready=time.time(),
                            workers={p.identity: p.startup for p in control.peers.values()
                                     if p.startup is not None},
                        )  # fmt: skip
                        transfer = addr.weights(control.peers["trainer:0"].capabilities)
                        if cfg.jobs:
                            self._jobs = self._make_jobs(control, data, tokenizer, trainers,
                                                         transfer, t0, rejections, metrics)
                            self._restarts.bind(self._jobs, metrics)
                            yield
                            return
                        self._pipeline = Pipeline(
                            cfg, control=control, intake=data.intake(""),
                            environment=environment, tokenizer=tokenizer,
                            groups=make_groups(cfg, len(environment.dataset("train"))),
                            trainers=trainers, restarts=self._restarts,
                            transfer_address=transfer, metrics=metrics, clock_origin=t0,
                            startup=startup, rejections=rejections, reward_code=code,
                            planned_trainer_bytes=memory.trainer_bytes(),
                            offload_trainer_state=memory.offload,
                        )  # fmt: skip
                        self._restarts.bind(self._pipeline, metrics)
                        if resume is not None:
                            await self._pipeline.resume(resume)
                        yield
        finally:
            bound.__exit__(None, None, None)
            if self._pipeline is not None:
                self._pipeline.close()
            self._pipeline = self._jobs = None
            ctx.close()
            metrics.close()
            shutil.rmtree(addr.run_dir, ignore_errors=True)
            shutil.rmtree(shm_dir(addr.run_id), ignore_errors=True)
            log.info("run_stopped", run_id=addr.run_id)

    def _make_jobs(
        self, control: ControlPlane, data: DataRouter, tokenizer: Any, trainers: list[str],
        transfer: str, t0: float, rejections: Rejections, metrics: MetricsWriter,
    ) -> Jobs:
        """The run's jobs over its workers, each of the config's added (started by
        :meth:`train`), once the workers said they serve and train jobs.

        Raises:
            ConfigError: a worker's backend has no jobs protocol (naming it and the fix)."""
        cfg = self.config
        for peer in control.peers.values():
            what = "serves_jobs" if peer.group == "rollout" else "trains_jobs"
            if not peer.capabilities.get(what):
                section = "generator" if peer.group == "rollout" else "trainer"
                backend = getattr(cfg, section).backend
                raise ConfigError(
                    f"jobs: the {section} backend {backend!r} ({peer.identity}) "
                    f"{'serves' if section == 'generator' else 'trains'} one policy only "
                    f"(no {'ServesJobs' if section == 'generator' else 'TrainsJobs'}). Fix: "
                    "use backends that run jobs (docs/jobs.md), or remove the [jobs] tables"
                )
        assert self.addresses is not None
        jobs = Jobs(Shared(
            config=cfg, control=control, router=data, tokenizer=tokenizer, trainers=trainers,
            restarts=self._restarts, transfer_address=transfer, run_id=self.addresses.run_id,
            clock_origin=t0, rejections=rejections, metrics=metrics,
            timeout_s=cfg.cluster.call_timeout_s, engine_samples=cfg.max_inflight_samples,
            log_dir=self.addresses.log_dir,
            resume=self._resume, allow_changed=self._allow_changed,
        ))  # fmt: skip
        for job in cfg.job_list.values():
            jobs.add(job)
        return jobs

    def _control_plane(
        self, router: Any, addr: Addresses, rejections: Rejections, metrics: MetricsWriter
    ) -> ControlPlane:
        """The control plane on ``router``: it expects every rank of both groups and hands
        each its ``Init`` (trainer rank 0 the weights address too)."""
        cfg = self.config
        config_dict = to_dict(cfg)
        # a worker serves no service: it is handed the core's sections alone, which it
        # converts without importing a service's plugin
        worker_config = to_dict(cfg, services=False)
        own_host = host_id()

        def make_init(hello: Hello) -> Init:
            transfer = addr.transfer if (hello.group, hello.rank) == ("trainer", 0) else ""
            return Init(run_id=addr.run_id, config=worker_config, data_address=addr.data,
                        transfer_address=transfer, controller_pid=os.getpid(),
                        controller_host=own_host)  # fmt: skip

        groups = (("trainer", cfg.cluster.trainer_ranks), ("rollout", cfg.cluster.rollout_ranks))
        expected = {f"{group}:{rank}" for group, n in groups for rank in range(n)}
        control = ControlPlane(
            router, make_init, expected=expected, rejections=rejections,
            survivable=self._restarts.survivable, host=own_host,
            remote_ok=cfg.cluster.network == "tcp",
        )  # fmt: skip
        metrics.write({"kind": "config", "run_id": addr.run_id, "config": config_dict})
        log.info("run_started", run_id=addr.run_id, output=cfg.run.output_dir, pid=os.getpid(),
                 event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
        return control

    @asynccontextmanager
    async def _workers(
        self,
        tg: anyio.abc.TaskGroup,
        control: ControlPlane,
        addr: Addresses,
        metrics: MetricsWriter,
    ) -> AsyncIterator[list[str]]:
        """The run's workers, started (or attached), watched and probed for the block; yields
        the trainers' identities. On the way out every worker is told to stop, its process
        stopped (grace, SIGTERM, SIGKILL), and ``tg`` cancelled."""
        watchers = _Scopes()
        clean = False
        try:
            peers = await self._start_workers(tg, control, addr, watchers)
            watchers.start_soon(tg, self._heartbeat.run, control)
            yield [p.identity for p in peers if p.group == "trainer"]
            clean = not self._deaths
        except BaseException:
            # before anything is stopped: a rank that died is the root cause of the
            # collective errors its death caused on the other ranks
            self._note_dead_peers(control)
            self._note_stop(metrics)
            raise
        finally:
            watchers.cancel()
            self._restarts.close()  # its sync tasks: no refit while the workers stop
            with anyio.CancelScope(shield=True):
                await control.shutdown_all()
                pids = [p.pid for p in control.peers.values()  # a remote pid names nothing here
                        if not p.remote and p.pid != os.getpid()]
                await stop_processes(self._spawned, pids, self.config.cluster.shutdown_grace_s,
                                     clean=clean)  # fmt: skip
            tg.cancel_scope.cancel()

    async def _start_workers(
        self,
        tg: anyio.abc.TaskGroup,
        control: ControlPlane,
        addr: Addresses,
        watchers: _Scopes,
    ) -> list[Any]:
        cfg = self.config.cluster
        groups = {"trainer": cfg.trainer_ranks, "rollout": cfg.rollout_ranks}
        if self._attach is None:
            for group, n in groups.items():
                spawned = await spawn_group(
                    group=group, nproc=n, control_address=addr.control, log_dir=addr.log_dir,
                    scratch_dir=addr.run_dir,
                    env={**worker_env(group), **addr.worker_env()},
                    args=worker_args(self._restarts.of_group(group)),
                )  # fmt: skip
                self._spawned.append(spawned)
        else:
            await self._attach(addr, tg)

        async def agent_died(spawned: SpawnedGroup) -> None:
            code = await spawned.process.wait()
            raise WorkerStartupError(
                f"the {spawned.group} group's torchrun agent exited with code {code} before "
                f"all its workers were ready; see {spawned.agent_log} and "
                f"{spawned.log_dir}/{spawned.group}-*.log"
            )

        peers = []
        startup_watch = _Scopes()
        for spawned in self._spawned:
            startup_watch.start_soon(tg, agent_died, spawned)
        try:
            with anyio.fail_after(cfg.startup_timeout_s):
                for group, n in groups.items():
                    peers += await control.wait_ready(group, n)
        except TimeoutError:
            raise WorkerStartupError(
                f"workers were not ready within {cfg.startup_timeout_s:.0f} s "
                f"(cluster.startup_timeout_s); connected: {sorted(control.peers)}; "
                f"logs in {addr.log_dir}"
            ) from None
        finally:
            startup_watch.cancel()
        # a supervised worker is no torchrun rank: its exit code comes from /proc alone
        agents = {s.group: s for s in self._spawned if not self._restarts.of_group(s.group)}
        watch = partial(self._restarts.watch, named=self._heartbeat.named,
                        fatal=self._deaths.append, lost=self._heartbeat.lost)  # fmt: skip
        for peer in peers:
            if peer.remote and not self._restarts.of_group(peer.group):
                # another host's trainer: the heartbeat alone can say it is gone
                watchers.start_soon(tg, self._watch_remote, peer)
            elif peer.remote or peer.pid != os.getpid():  # a remote pid may equal ours
                watchers.start_soon(tg, watch, control, peer, agents.get(peer.group), tg)
        log.info("workers_ready", workers=[p.identity for p in peers])
        return peers

    async def _watch_remote(self, peer: Any) -> None:
        """Raise once ``peer``, on another host, is lost (silent past the heartbeat's
        timeout): a death the run does not outlive."""
        lost = await self._heartbeat.lost(peer)
        self._deaths.append(lost)
        raise lost

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the next step boundary (or at the end of the run), without
        waiting for it (``asyncrl.launch`` does it on SIGUSR1); with jobs, each running job's
        own at its next step boundary."""
        if self._jobs is not None:
            self._jobs.request_checkpoint()
            return
        self._running_pipeline().request_checkpoint()

    async def save_checkpoint(self) -> str | None:
        """Save a checkpoint at the next step boundary (or at the end of the run) and return
        its directory once committed (``None`` if the save failed; the run goes on). Asked
        after the last step boundary, it returns the run's last checkpoint (``None``: none).
        For an embedding application; ``asyncrl.launch`` does the same on SIGUSR1."""
        return await self._running_pipeline().save_checkpoint()

    async def generator_logprobs(
        self, batch: TokenBatch, *, temperature: float = 1.0, rank: int = 0
    ) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under rollout rank ``rank``'s weights.

        With :meth:`trainer_logprobs` this measures the trainer/generator mismatch (it should
        be within bf16 noise right after a refit). Cancellation: the reply is dropped.
        """
        return await self._running_pipeline().generator_logprobs(batch, rank=rank, temperature=temperature)

    async def trainer_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under the trainer's current weights
        (sequences are sharded over the trainer ranks and reassembled in order)."""
        return await self._running_pipeline().trainer_logprobs(batch, temperature=temperature)

    def status(self) -> RunStatus:
        """Where the run stands now: optimizer steps taken, the last checkpoint committed, the
        prompt ledger, the workers' pids and the clock origin of the metrics records; with
        jobs, where each job stands (its steps and checkpoints are its own)."""
        if self._jobs is not None:
            return self._jobs.status()
        return self._running_pipeline().status()

    async def train(self) -> RunSummary:
        """Run ``run.num_steps`` optimizer steps (with the configured evaluations).

        Returns the per-step metrics and evaluation results.

        With jobs (docs/jobs.md): runs every job until each has ended; the summary's
        ``jobs`` says how each did (its own summary: ``Controller.jobs.summaries()``).

        Cancellation: the pumps stop; leaving the ``async with`` block cleans up.
        """
        if self._jobs is not None:
            await self._jobs.run()
            return RunSummary(jobs=self._jobs.list(),
                              metrics_path=os.path.join(self.config.run.output_dir,
                                                        "metrics.jsonl"))  # fmt: skip
        return await self._running_pipeline().run()

    def _note_stop(self, metrics: MetricsWriter) -> None:
        """A run that did not finish (a dead trainer, a run error, a signal): what can be
        saved once the trainer's state is lost is the record of where it stood. The ledger,
        and a ``stopped`` record naming the checkpoint a resume goes on from (the work after
        it is done again: samples of newer weights cannot be trained on the older ones
        within the staleness bound)."""
        if self._pipeline is None:
            return
        status = self._pipeline.status()
        try:
            metrics.write({"kind": "ledger", "epochs": status.ledger})
            metrics.write({
                "kind": "stopped", "step": status.step, "checkpoint": status.checkpoint,
                "deaths": [str(d).splitlines()[0] for d in self._deaths],
            })  # fmt: skip
        except NoSpaceError as exc:  # the disk that stops the run, likely: keep its error
            log.warning("stop_not_recorded", error=str(exc).splitlines()[0])
        log.warning("run_stopped_early", step=status.step, resume_from=status.checkpoint)

    def _note_dead_peers(self, control: ControlPlane) -> None:
        """Record workers whose process has exited but whose watcher has not fired yet."""
        seen = {(e.group, e.rank) for e in self._deaths}
        for peer in control.peers.values():
            if peer.remote or peer.pid == os.getpid() or (peer.group, peer.rank) in seen:
                continue
            if has_exited(peer.pid):
                code = exit_status(peer.pid)
                self._deaths.append(
                    WorkerDiedError(peer.group, peer.rank, code, peer.log_path or None)
                )


def _root_cause(
    deaths: list[WorkerDiedError], errors: list[BaseException]
) -> BaseException | None:
    """The error to report, most telling first: a worker's own last words (its ``Dead``
    message says why, e.g. which engine process died), then the first worker death not caused
    by a stop signal (a rank that torchrun or we stopped with SIGTERM/SIGINT is a consequence:
    it dies of the signal or exits 128 + N after cleaning up), then the first death, else the
    only error. Before all of them, a full file system (a ``NoSpaceError``, here or on a
    worker): what fails after it (a worker that cannot write its log) is its consequence."""
    full = no_space_in(errors)
    reported = [e for e in errors if getattr(e, "reported_by", None)]
    died = deaths + [e for e in errors if isinstance(e, WorkerDiedError) and e not in deaths]
    killed = [e for e in died if not stopped_by_signal(e.exit_code)]
    ranked = reported + killed + died + [e for e in errors if isinstance(e, AsyncRLError)]
    ranked = ([full] if full is not None else []) + ranked
    root = ranked[0] if ranked else (errors[0] if len(errors) == 1 else None)
    for other in errors:
        if other is getattr(root, "__cause__", None):
            continue  # the worker's error that root reports
        if other is not root and not (isinstance(other, AsyncRLError) and str(other) == str(root)):
            first = str(other).splitlines()[0] if str(other) else repr(other)
            log.warning("also_failed", error=first)
    return root


class _Scopes:
    """Tasks the owner can stop as a set without stopping the whole task group."""

    def __init__(self) -> None:
        self._scopes: list[anyio.CancelScope] = []
        self._cancelled = False

    def start_soon(
        self, tg: anyio.abc.TaskGroup, fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> None:
        scope = anyio.CancelScope()
        if self._cancelled:
            return
        self._scopes.append(scope)

        async def guarded() -> None:
            with scope:
                await fn(*args)

        tg.start_soon(guarded)

    def cancel(self) -> None:
        self._cancelled = True
        for scope in self._scopes:
            scope.cancel()
