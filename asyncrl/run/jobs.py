"""A run of jobs (docs/jobs.md): one :class:`~asyncrl.run.loops.Pipeline` per job over the
run's shared workers, each in a task of its own, so that one job's failure ends that job alone.

::

    Jobs ── per job: its environment, metrics file, resume ── OpenJob ──► trainer ranks
      │        Pipeline(job=name, control=JobControl(name), intake=router.intake(name))
      │        ── run ──► finished, or failed (its named error), or stopped
      │        └ on the way out, however it ended: its groups aborted, CloseJob ──► every
      │          worker, its intake closed, its metrics file closed
      └ restarts (run/restarts.py): a restarted engine refitted with every job's adapter

What the jobs share, and who owns it: the workers, sockets, heartbeat and restarts stay the
controller's; the data socket is the router's (run/intake.py: each sample to its job by the
group id's ``<job>:`` prefix); the weights lock is this owner's (one refit at a time: a
trainer rank 0 has one weights socket); the event loop's pacing and watchdog too, once for
all jobs. Everything else is the job's pipeline's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc
import msgspec
import structlog

from asyncrl.checkpoints import directory as ckpt
from asyncrl.checkpoints.saving import Resume, open_resume, reward_code_of
from asyncrl.config.root import Config, Job, derive_job
from asyncrl.errors import ConfigError, flatten
from asyncrl.obs import collector, watchdog
from asyncrl.obs.collector import collector_paused, pace
from asyncrl.obs.log import MetricsWriter
from asyncrl.obs.watchdog import LoopWatchdog
from asyncrl.config.modes import make_groups
from asyncrl.run.intake import DataRouter
from asyncrl.run.jobs_inbox import Inbox, JobAnswer, JobRequest
from asyncrl.run.loops import Pipeline, RunStatus, RunSummary
from asyncrl.run.preflight import checked_environment
from asyncrl.wire.messages import CloseJob, Generate, OpenJob
from asyncrl.wire.rpc import ControlPlane

__all__ = ["JobControl", "JobState", "Jobs", "Shared", "shares"]

log = structlog.get_logger("asyncrl.run.jobs")

STOP_TIMEOUT_S = 30.0
"""A job's way out (its groups aborted, ``CloseJob`` to every worker) is bounded by this: a
worker that does not answer is the heartbeat's to find, not the job's to wait for."""


class JobControl:
    """A job's view of the control plane: every request it sends that has a ``job`` field
    names the job (a ``Generate``'s requests each), so the pipeline's parts, written for one
    run, need not know they run a job. What is not a request passes through to the run's
    control plane (its peers, pids, the served times)."""

    def __init__(self, control: ControlPlane, job: str) -> None:
        self._control, self.job = control, job

    def stamp(self, request: Any) -> Any:
        """``request`` as this job's (itself when it names no job)."""
        if isinstance(request, Generate):
            return Generate(requests=[msgspec.structs.replace(r, job=self.job)
                                      for r in request.requests])  # fmt: skip
        if "job" in type(request).__struct_fields__:
            return msgspec.structs.replace(request, job=self.job)
        return request

    async def call(self, identity: str, request: Any, *, timeout_s: float) -> Any:
        return await self._control.call(identity, self.stamp(request), timeout_s=timeout_s)

    async def cast(self, identity: str, request: Any) -> None:
        await self._control.cast(identity, self.stamp(request))

    async def call_unless_restarting(self, identity: str, request: Any, *, timeout_s: float) -> Any:
        return await self._control.call_unless_restarting(identity, self.stamp(request),
                                                          timeout_s=timeout_s)  # fmt: skip

    async def cast_unless_restarting(self, identity: str, request: Any) -> bool:
        return await self._control.cast_unless_restarting(identity, self.stamp(request))

    async def call_each(
        self, identities: Sequence[str], requests: Sequence[Any], *, timeout_s: float
    ) -> list[Any]:
        return await self._control.call_each(identities, [self.stamp(r) for r in requests],
                                             timeout_s=timeout_s)  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control, name)


@dataclass(frozen=True)
class Shared:
    """What every job's pipeline is built on: the run's, as the controller made it."""

    config: Config
    """The run's config (the jobs' tables are over it; its output directory holds the
    inbox of ``asyncrl jobs``)."""
    control: ControlPlane
    router: DataRouter
    tokenizer: Any
    trainers: list[str]
    restarts: Any
    """The run's :class:`~asyncrl.run.restarts.Restarts` (which rollout workers serve)."""
    transfer_address: str
    run_id: str
    clock_origin: float
    rejections: Any
    metrics: Any
    """The run's own metrics writer: each job's start and end are recorded there too."""
    timeout_s: float
    engine_samples: int
    """Samples the engines may generate at once for all jobs (the run's
    ``pipeline.max_inflight_samples``): split among the running jobs by weight."""
    log_dir: str
    """The run's log directory (the loop watchdog's stack dumps)."""
    resume: str | None = None
    """The controller's ``resume``: each job resumes from its own checkpoints."""
    allow_changed: Sequence[str] = ()


JobState = Literal["starting", "running", "finished", "failed", "stopped"]


@dataclass
class _Entry:
    job: Job
    state: JobState = "starting"
    error: str = ""
    pipeline: Pipeline | None = None
    summary: RunSummary | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)


class Jobs:
    """The run's jobs: each one's pipeline, run in a task of its own. :meth:`run` runs them
    until every job has ended; :meth:`add` and :meth:`stop` change them while it does;
    :meth:`list` says where each stands. It is the restarts' loops
    (:class:`~asyncrl.run.restarts.WorkerLoops`): each call goes to every running job."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._entries: dict[str, _Entry] = {}
        self._weights = anyio.Lock()
        """One refit at a time over every job (held from a job's ``FinishStep`` to its
        refit's end)."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False

    # ------------------------------------------------------------------ the controller's API
    def add(self, job: Job) -> None:
        """Start ``job`` (now if :meth:`run` runs, else when it starts).

        Raises:
            ValueError: a job of that name is in the run already (running or ended: its
                directory is its own), or the run is over."""
        if job.name in self._entries:
            state = self._entries[job.name].state
            raise ValueError(f"job {job.name!r} is in this run already ({state}); give the new "
                             "one another name")  # fmt: skip
        if self._closed:
            raise ValueError(f"job {job.name!r}: the run is over")
        self._entries[job.name] = entry = _Entry(job)
        if self._tg is not None:
            self._tg.start_soon(self._run_job, entry, name=f"job-{job.name}")

    def add_table(self, name: str, table: dict[str, Any]) -> None:
        """Start job ``name`` of ``table`` (its ``[jobs.<name>]``, paths absolute) over the
        run's config: :meth:`add` of :func:`~asyncrl.config.root.derive_job`'s job.

        Raises:
            ConfigError: the table is wrong. ValueError: as :meth:`add`."""
        self.add(derive_job(self._shared.config, name, table))

    async def stop(self, name: str) -> JobState:
        """Stop job ``name`` (its last checkpoint stands) and wait until it is out; returns
        how it ended (a job that had ended already: how it did).

        Raises:
            KeyError: no job of that name."""
        entry = self._entry(name)
        if entry.state in ("starting", "running"):
            entry.scope.cancel()
            if self._tg is None:  # the jobs do not run (yet, or any more): nothing to wait for
                entry.state = "stopped"
                entry.done.set()
            await entry.done.wait()
        return entry.state

    def list(self) -> list[dict[str, Any]]:
        """Each job, in the order added: its name, state, weight, steps taken, last
        checkpoint, and its error when it failed."""
        out = []
        for name, e in self._entries.items():
            status = e.pipeline.status() if e.pipeline is not None else None
            out.append({
                "job": name, "state": e.state, "weight": e.job.weight,
                "step": status.step if status is not None else 0,
                "num_steps": e.job.config.run.num_steps,
                "checkpoint": status.checkpoint if status is not None else None,
                "error": e.error, "output_dir": e.job.config.run.output_dir,
            })  # fmt: skip
        return out

    def status(self) -> RunStatus:
        """The run's status: its workers and clock, each job's :meth:`list` entry; the
        samples and requests in flight summed over the running jobs."""
        running = [p.status() for p in self._running()]
        return RunStatus(
            step=0, checkpoint=None, ledger=[], workers=self._shared.control.pids(),
            clock_origin=self._shared.clock_origin,
            inflight_samples=sum(s.inflight_samples for s in running),
            requests_in_flight=sum(s.requests_in_flight for s in running), jobs=self.list(),
        )  # fmt: skip

    def request_checkpoint(self) -> None:
        """Ask each running job for a checkpoint at its next step boundary."""
        for pipeline in self._running():
            pipeline.request_checkpoint()

    def summaries(self) -> dict[str, RunSummary]:
        """Each job's summary, of those that finished."""
        return {n: e.summary for n, e in self._entries.items() if e.summary is not None}

    async def run(self) -> dict[str, JobState]:
        """Run every job until each has ended (finished, failed or stopped); returns how each
        ended. The collector is paced and the loop watched once here, for every job.

        Cancellation: every job stops (its way out is shielded and bounded)."""
        young = collector.GC_YOUNG_INTERVAL_S
        try:
            with collector_paused(collector.GC_FREEZE, young):
                async with Inbox(self._shared.config.run.output_dir) as inbox, \
                        anyio.create_task_group() as tg:
                    tg.start_soon(inbox.serve, self._request, name="jobs-inbox")
                    if young:
                        tg.start_soon(pace, young, collector.GC_FULL_INTERVAL_S, name="gc-pacer")
                    tg.start_soon(LoopWatchdog(watchdog.STALL_WARNING_S,
                                               dump_dir=self._shared.log_dir).run,
                                  name="loop-watchdog")  # fmt: skip
                    async with anyio.create_task_group() as jobs:
                        self._tg = jobs
                        for entry in list(self._entries.values()):
                            if entry.state == "starting":  # not stopped before the run
                                jobs.start_soon(self._run_job, entry,
                                                name=f"job-{entry.job.name}")  # fmt: skip
                    self._tg, self._closed = None, True  # a job added from now on: refused
                    tg.cancel_scope.cancel()
        finally:
            self._tg, self._closed = None, True
        return {name: e.state for name, e in self._entries.items()}

    async def _request(self, request: JobRequest) -> JobAnswer:
        """``asyncrl jobs``'s request, from the inbox: a job added, stopped, or the list."""
        try:
            if request.op == "add":
                self.add_table(request.job, request.table)
            elif request.op == "stop":
                await self.stop(request.job)
        except (ConfigError, KeyError, ValueError) as exc:
            return JobAnswer(ok=False, error=str(exc.args[0] if exc.args else exc))
        return JobAnswer(ok=True, jobs=self.list())

    # ------------------------------------------------------------------ restarts' API
    async def worker_lost(self, worker: str) -> None:
        for pipeline in self._running():
            await pipeline.worker_lost(worker)

    async def refit_worker(self, worker: str) -> int:
        """Refit restarted ``worker`` with each running job's newest adapter, one job at a
        time; returns the newest version of all."""
        versions = [await pipeline.refit_worker(worker) for pipeline in self._running()]
        return max(versions, default=0)

    async def worker_serves(self, worker: str) -> None:
        for pipeline in self._running():
            await pipeline.worker_serves(worker)

    # ------------------------------------------------------------------ one job
    async def _run_job(self, entry: _Entry) -> None:
        """Job ``entry`` from its start to its end. Its failure is its own: recorded, logged,
        and the job closed on every worker; the run goes on."""
        job, s = entry.job, self._shared
        started = time.perf_counter()
        metrics = None
        workers_stay = True  # else the run is stopping: its workers with it
        try:
            with entry.scope:
                if await anyio.to_thread.run_sync(self._finished_before, job):
                    entry.state = "finished"  # a resumed run: this job had ended
                    return
                metrics = MetricsWriter.open(job.config, run_id=s.run_id, origin=s.clock_origin)
                entry.pipeline = await self._start(job, metrics)
                entry.state = "running"
                self._reshare()
                self._record("job_started", job.name, seconds=time.perf_counter() - started)
                entry.summary = await entry.pipeline.run()
                entry.state = "finished"
            if entry.state != "finished":
                entry.state = "stopped"
        except Exception as exc:
            entry.state, entry.error = "failed", _first_line(exc)
            log.error("job_failed", job=job.name, error=entry.error)
            log.debug("job_failed_traceback", job=job.name, exc_info=exc)
        except BaseException:  # the run is stopping (cancelled), not this job alone
            entry.state, workers_stay = "stopped", False
            raise
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_TIMEOUT_S):
                await self._close(entry, workers_stay)
            if metrics is not None:
                metrics.write({"kind": "job_ended", "job": job.name, "state": entry.state,
                               "error": entry.error})  # fmt: skip
                metrics.close()
            self._record("job_ended", job.name, state=entry.state, error=entry.error)
            entry.done.set()
            self._reshare()

    async def _start(self, job: Job, metrics: MetricsWriter) -> Pipeline:
        """``job``'s pipeline, its adapter open on the trainers (from its checkpoint when the
        run resumes and the job has one)."""
        s = self._shared
        cfg = job.config
        environment = await anyio.to_thread.run_sync(checked_environment, cfg)
        code = await anyio.to_thread.run_sync(reward_code_of, cfg, environment)
        resume = await anyio.to_thread.run_sync(self._resume_of, job, environment, code)
        metrics.write({"kind": "config", "run_id": s.run_id, "job": job.name,
                       "config": msgspec.to_builtins(cfg)})  # fmt: skip
        opening = OpenJob(job=job.name, seed=cfg.run.seed, lr=job.lr)
        await s.control.call_each(s.trainers, [opening] * len(s.trainers), timeout_s=s.timeout_s)
        pipeline = Pipeline(
            cfg, control=JobControl(s.control, job.name),  # type: ignore[arg-type]
            intake=s.router.intake(job.name), environment=environment, tokenizer=s.tokenizer,
            groups=make_groups(cfg, len(environment.dataset("train"))), trainers=s.trainers,
            restarts=s.restarts, transfer_address=s.transfer_address, metrics=metrics,
            clock_origin=s.clock_origin, rejections=s.rejections, reward_code=code,
            job=job.name, weights=self._weights, loop_tasks=False,
        )  # fmt: skip
        if resume is not None:
            await pipeline.resume(resume)
        return pipeline

    def _finished_before(self, job: Job) -> bool:
        """Whether the run resumes and ``job``'s newest checkpoint is its last (it had run to
        its end before the run stopped: it stays finished)."""
        if self._shared.resume != "latest":
            return False
        newest = ckpt.latest(job.config.checkpoint.dir)
        return newest is not None and bool(ckpt.open_checkpoint(newest).manifest["finished"])

    def _resume_of(self, job: Job, environment: Any, code: dict[str, str]) -> Resume | None:
        """The checkpoint ``job`` resumes from: when the run resumes (``resume = "latest"``;
        the controller refuses a directory with jobs), its newest (none yet: it starts
        afresh)."""
        s = self._shared
        if s.resume != "latest" or ckpt.latest(job.config.checkpoint.dir) is None:
            return None
        return open_resume(job.config, "latest", train_prompts=environment.dataset("train"),
                           allow_changed=s.allow_changed, code=code)  # fmt: skip

    async def _close(self, entry: _Entry, workers_stay: bool) -> None:
        """``entry``'s way out: its intake closed and, while the workers stay (the job ended,
        not the run), its groups aborted on the engines and ``CloseJob`` to every worker. A
        worker that refuses or is gone is logged and left (the job is over either way)."""
        s, name = self._shared, entry.job.name
        pipeline = entry.pipeline
        s.router.close(name)
        if pipeline is not None:
            pipeline.close()
        if not workers_stay:
            return
        if pipeline is not None:
            with suppress(Exception):
                await pipeline.publisher.abort(pipeline.rollout.close())
        closing = CloseJob(job=name)
        workers = [*s.trainers, *s.restarts.serving]

        async def close_on(worker: str) -> None:
            try:
                await s.control.call(worker, closing, timeout_s=s.timeout_s)
            except Exception as exc:
                log.warning("job_not_closed", job=name, worker=worker, error=_first_line(exc))

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(close_on, worker)

    # ------------------------------------------------------------------ helpers
    def _reshare(self) -> None:
        """Split the engines' samples among the running jobs by weight (a job started or
        ended)."""
        running = {n: e for n, e in self._entries.items()
                   if e.state == "running" and e.pipeline is not None}  # fmt: skip
        split = shares(self._shared.engine_samples, {n: e.job.weight for n, e in running.items()})
        for name, samples in split.items():
            pipeline = running[name].pipeline
            assert pipeline is not None
            pipeline.share(samples)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no job {name!r} in this run (jobs: "
                           f"{', '.join(self._entries) or 'none'})") from None  # fmt: skip

    def _running(self) -> list[Pipeline]:
        return [e.pipeline for e in self._entries.values()
                if e.state == "running" and e.pipeline is not None]  # fmt: skip

    def _record(self, kind: str, job: str, **fields: Any) -> None:
        log.info(kind, job=job, **fields)
        if self._shared.metrics is not None:
            self._shared.metrics.write({"kind": kind, "job": job, **fields})


def shares(samples: int, weights: dict[str, float]) -> dict[str, int]:
    """``samples`` split by ``weights`` (each job's share rounded down: the engines are never
    promised more than they have; :meth:`~asyncrl.policy.live.LiveGroups.share` still lets
    each job one group)."""
    total = sum(weights.values())
    return {name: int(samples * w / total) for name, w in weights.items()}


def _first_line(exc: BaseException) -> str:
    """``exc`` in one line, as the job's error: the first error inside a group (the others
    are its consequences: the job's other tasks cancelled)."""
    errors = [e for e in flatten(exc) if not isinstance(e, anyio.get_cancelled_exc_class())]
    first = errors[0] if errors else exc
    text = str(first)
    return f"{type(first).__name__}: {text.splitlines()[0] if text else repr(first)}"

