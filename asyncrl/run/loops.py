"""The run's loops around its live groups, on one event loop, and what the controller asks of
them.

::

    prompt stream ──► rollout pump ──Generate (one per worker)──► rollout workers
                        │ rollout.dispatch(): gate, capacity, samples         │ SampleDone each
                        │ in flight, the sampler, the least loaded worker      │ (a DataBatch if
                        ▼                                                      ▼  ready together)
                    LiveGroups (asyncrl.policy.live: every group)  ◄── RolloutPhase ◄── Feeder
                        │ ▲ the rollout phase: requests, load per worker       sample_arrived,
                        │ └ (asyncrl.run.rollout_phase), evaluations           score, commit
                        ▼ training.next_chunk(): evictions + a chunk (asyncrl.run.train_phase)
                    train pump ──TrainChunk──► trainer ranks (one open optimizer step)
                        │ ┌ weights lock ─ FinishStep ─ finish_step ─ Abort hopeless groups ─
                        ▼ └ (drain) ─ SendWeights ∥ ReceiveWeights ─ end_refit (gate reopens) ┘
                    samples to disk (run.save_samples), verify (when due), log the step,
                    checkpoint / export, start a validation

Who wakes whom: a change the rollout pump may wait for (a sample back, a chunk taken,
a refit's end) fires ``changed``; a commit fires ``committed``, the train pump's only reason
to look again. The pumps hold no group state: they carry out the phases' decisions and time
the waits. Nothing here blocks the loop (prompts are tokenized and samples scored in threads).

The controller calls :meth:`Pipeline.resume`, ``run``, ``request_checkpoint`` /
``save_checkpoint``, ``status``, the two logprob probes and ``close``; a restart
(:class:`~asyncrl.run.restarts.Restarts`) calls ``worker_lost``, ``refit_worker`` and
``worker_serves``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import structlog

from asyncrl.config import Config
from asyncrl.data.prompts import PromptStream, Tokenizer, sample_seed
from asyncrl.env.capabilities import check_environment
from asyncrl.environment import Environment
from asyncrl.obs.console import Console
from asyncrl.obs.startup import Startup
from asyncrl.obs import collector, sample_export, watchdog
from asyncrl.obs.sample_export import SampleExport
from asyncrl.obs.steps import (
    RefitRecord, RolloutRecord, StepRecord, WorkerTimes, log_step, trainer_memory,
)
from asyncrl.obs.collector import collector_paused, pace
from asyncrl.obs.watchdog import LoopLag, LoopWatchdog
from asyncrl.policy.failures import FailureBudget
from asyncrl.policy.counts import StepStats
from asyncrl.policy.live import LiveGroups
from asyncrl.run.train_step import StepAssembler, Trained
from asyncrl.env.episode import EpisodeEnvironment
from asyncrl.run.arrivals import Sent
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.train_phase import TrainPhase
from asyncrl.checkpoints import directory as ckpt
from asyncrl.run.context import RunContext
from asyncrl.run.asking import build_asker
from asyncrl.run.episodes import EpisodeRunner, build_runner
from asyncrl.run.evaluation import Evaluator
from asyncrl.run.intake import JOB_SEPARATOR, Feeder, Intake
from asyncrl.run.scoring import Scorer
from asyncrl.run.probes import Probes
from asyncrl.run.refit import KVScales, Publisher
from asyncrl.run.turns import Turns
from asyncrl.run.wake import Signal
from asyncrl.services import Served, enabled_services, load_service
from asyncrl.run.restarts import Redispatcher, Restarts, send_generate
from asyncrl.checkpoints.saving import Checkpointer, Resume
from asyncrl.wire.messages import GenRequest, StepResult, TokenBatch
from asyncrl.wire.rpc import ControlPlane
from asyncrl.wire.transport import Rejections

__all__ = ["Pipeline", "RunStatus", "RunSummary"]

DISPATCH_ROUND = 16
"""Groups dispatched per round (one ``Generate`` per worker): bounds the loop time of a round
(about 50 us a group) while still batching requests for the engines."""

log = structlog.get_logger("asyncrl.run.loops")


@dataclass
class RunSummary:
    """What :meth:`Controller.train <asyncrl.run.controller.Controller.train>` returns."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    metrics_path: str = ""
    rejected_frames: dict[str, int] = field(default_factory=dict)
    """Frames each socket refused (``control``, ``data``, ``weights``); see docs/protocol.md."""
    refused_peers: int = 0
    """Connections the controller's sockets refused at the handshake: processes without the
    run's keys, none of whose frames was read (docs/protocol.md, "Who may connect")."""
    resumed_from: int | None = None
    """The step a resumed run started from (``None``: a fresh run)."""
    checkpoint: str | None = None
    """The last checkpoint this run saved."""
    ledger: list[dict[str, Any]] = field(default_factory=list)
    """Per epoch of the prompt stream: prompts trained, dropped (by reason), still live, lost
    (always 0) and repeated (always 0); see :mod:`asyncrl.policy.ledger`."""
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """A run of jobs (docs/jobs.md): how each job ended, as ``Controller.jobs.list()`` says
    it; each job's own summary is ``Controller.jobs.summaries()``'s. Empty otherwise."""


@dataclass(frozen=True)
class RunStatus:
    """Where a run stands (:meth:`Pipeline.status`): optimizer steps taken, the last
    checkpoint committed (this run's, or the one it resumed from), the prompt ledger."""

    step: int
    checkpoint: str | None
    ledger: list[dict[str, Any]]
    workers: dict[str, int] = field(default_factory=dict)
    """The worker processes the controller knows now: pid by name (``rollout:0``...)."""
    clock_origin: float = 0.0
    """``time.perf_counter()`` at the run's time zero: the ``time`` of every metrics record
    counts from it."""
    inflight_samples: int = 0
    """Training samples being generated now (a multi-turn run's: episodes running)."""
    requests_in_flight: int = 0
    """Requests on the rollout workers' engines now: a single-turn group's (``n`` samples
    each), a multi-turn episode's turn, an evaluation prompt's."""
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """A run of jobs (docs/jobs.md): where each stands (``Controller.jobs.list()``); the
    fields above are then the run's, its steps and checkpoints the jobs' own."""


class Pipeline:
    """The run's loops around its :class:`~asyncrl.policy.live.LiveGroups`. The
    :class:`~asyncrl.run.controller.Controller` builds it once the workers are ready and
    runs it in its task group; ``restarts`` says which rollout workers serve;
    ``reward_code``: the reward code's fingerprints taken as the run started (each checkpoint
    records them: :func:`asyncrl.checkpoints.saving.reward_code_of`)."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        intake: Intake,
        environment: Environment,
        tokenizer: Tokenizer,
        groups: LiveGroups,
        trainers: list[str],
        restarts: Restarts,
        transfer_address: str,
        metrics: Any,
        clock_origin: float,
        startup: Startup | None = None,
        rejections: Rejections | None = None,
        reward_code: dict[str, str] | None = None,
        planned_trainer_bytes: int | None = None,
        offload_trainer_state: bool = False,
        job: str = "",
        weights: anyio.Lock | None = None,
        loop_tasks: bool = True,
    ) -> None:
        self.config, self.control, self.tok = config, control, tokenizer
        self.job = job
        """The job this pipeline runs (docs/jobs.md; ``control`` names it on every request),
        ``""``: the run's own."""
        self._loop_tasks = loop_tasks
        """Whether this pipeline paces the collector and watches the event loop (the run's
        one pipeline does; a run of jobs does it once for all of them)."""
        self.planned_trainer_bytes = planned_trainer_bytes
        """What the memory plan says a trainer rank holds at its peak (``None``: not
        known): each step's record sets it beside the measured peaks."""
        self.trainers, self.restarts, self.metrics = trainers, restarts, metrics
        self.rollouts = restarts.workers
        self.services: dict[str, Served] = {}
        """The run's services (``[gateway]`` enabled): one may stand in front of the
        environment (the gateway's sessions are the episodes)."""
        for name in enabled_services(config):
            served = load_service(name, f"{name}.enabled").build(config, environment, tokenizer)
            environment = served.environment
            self.services[name] = served
        self.episodic = isinstance(environment, EpisodeEnvironment)
        """A multi-turn environment: each group is ``n`` episodes (:mod:`asyncrl.run.episodes`)."""
        self.groups = groups
        self.id_prefix = f"{job}{JOB_SEPARATOR}" if job else ""
        self.rollout = RolloutPhase(groups, self.rollouts, episodes=self.episodic,
                                    id_prefix=self.id_prefix)  # fmt: skip
        self.training = TrainPhase(groups)
        self.console = Console.for_run(config, tokenizer.decode, metrics,  # progress, samples
                                       total_steps=groups.num_steps)  # fmt: skip
        if groups.num_steps < config.run.num_steps:
            log.info("run_bounded_by_epochs", steps=groups.num_steps,
                     max_num_epochs=config.run.max_num_epochs, num_steps=config.run.num_steps)  # fmt: skip
        self.t0 = clock_origin
        self.startup = startup
        """The run's start up to its workers being ready: its record follows step 1's."""
        self.changed = Signal()  # a change the rollout pump (or a drain) may wait for
        self.committed = Signal()  # a commit: the train pump's only reason to look again
        self.rejections = rejections if rejections is not None else Rejections()
        self._gate_wait_s = 0.0  # dispatch time spent waiting for a refit, since the last step
        self.lag = LoopLag()  # event-loop wake-up delays (each step record takes them)
        self.history: list[dict[str, Any]] = []
        self.probes = Probes(control, trainers, serving=lambda: restarts.serving,
                             workers=self.rollouts, timeout_s=config.cluster.call_timeout_s)  # fmt: skip
        self.prompts = PromptStream(
            environment.dataset("train"), config.grpo.prompts_per_step, config.run.seed
        )
        self.failures = FailureBudget(config.failures)
        self._weights = weights if weights is not None else anyio.Lock()
        """Held from a step's ``FinishStep`` to the end of its refit (the trainer's weights
        and the generators' differ), and by every other refit: one lock for every job of a
        run (a trainer rank 0 has one weights socket, an engine one receiver)."""
        self.resumed_from: int | None = None  # the trainer version a resumed run started from
        self._reward_code = reward_code
        self._build_parts(environment, tokenizer, intake, transfer_address)
        self.turns = Turns(self._ctx, offload=offload_trainer_state,
                           before_sleep=self.evaluator.wait_validation,
                           drain=self.publisher.drain if config.refit.drain else None)  # fmt: skip
        """Whose turn it is on a GPU the trainer and the engines share (``cluster.placement =
        "take_turns"``; off otherwise)."""

    def _build_parts(
        self, environment: Environment, tokenizer: Tokenizer, intake: Intake, transfer: str
    ) -> None:
        cfg, control, trainers, metrics = self.config, self.control, self.trainers, self.metrics
        ctx = RunContext(
            cfg, control, trainers, self.groups, self.rollout, self.training,
            serving=lambda: self.restarts.serving,
            changed=self.changed, committed=self.committed, failures=self.failures,
            probes=self.probes, metrics=metrics, now=self.now, id_prefix=self.id_prefix,
        )  # fmt: skip
        self._ctx = ctx
        kv = KVScales(control, trainers, self.rollouts,
                      timeout_s=cfg.cluster.call_timeout_s, metrics=metrics)  # fmt: skip
        self.publisher = Publisher(ctx, kv=kv, transfer_address=transfer,
                                   rejections=self.rejections,
                                   cancel_episodes=self._cancel_episodes)  # fmt: skip
        self.redispatch = Redispatcher(self.rollout, self.groups, failures=self.failures,
                                       wake=self.changed.notify)  # fmt: skip
        # the environment the run trains on (a service's, if one stands in front), checked once
        parts = check_environment(environment, cfg.environment.name, scored=True)
        self.asker = build_asker(ctx)
        self.scorer = Scorer(environment, tokenizer, cfg.environment.name,
                             timeout_s=cfg.failures.reward_timeout_s, parts=parts)  # fmt: skip
        self.episodes: EpisodeRunner | None = None
        if self.episodic:
            self.episodes = build_runner(
                ctx, environment, tokenizer=tokenizer, asker=self.asker,
                fail_group=self.redispatch.episode_failed,
                deadline_s=min((s.episode_deadline_s for s in self.services.values()
                                if s.episode_deadline_s is not None), default=None),
                parts=parts,
            )  # fmt: skip
        self.samples: SampleExport | None = None
        """``run.save_samples``: each trained step's sequences on disk (asyncrl/obs/sample_export.py)."""
        if cfg.run.save_samples:
            self.samples = SampleExport(cfg.run.output_dir,
                                        int(sample_export.SAMPLES_FILE_MB * 2**20))  # fmt: skip
        self.checkpointer = Checkpointer(
            cfg, control=control, trainers=trainers, metrics=metrics,
            train_prompts=environment.dataset("train"), code=self._reward_code,
            before_save=self.samples.flushed if self.samples is not None else None,
        )  # fmt: skip
        self.evaluator = Evaluator(ctx, environment=environment, tokenizer=tokenizer,
                                   asker=self.asker, scorer=self.scorer,
                                   episodes=self.episodes)  # fmt: skip
        # a validation of the weights a refit replaces is waited for before they are taken
        # (not the other way round: a validation may wait for a restarted worker, whose
        # refit needs them)
        self.assembler = StepAssembler(ctx, before_training=self._before_training,
                                       before_finish=self.evaluator.wait_validation)  # fmt: skip
        self.feeder = Feeder(ctx, intake=intake, scorer=self.scorer, asker=self.asker,
                             redispatch=self.redispatch, rejections=self.rejections)  # fmt: skip

    # ------------------------------------------------------------------ the controller's API
    async def resume(self, resume: Resume) -> None:
        """Take over a checkpoint before anything is dispatched: the live groups (their
        counts and versions, the ready groups with their samples, the prompts to dispatch
        again, the prompt ledger), the prompt stream's position, and the trainers' state.
        Cancellation: the trainers' load is abandoned (the run stops)."""
        start, skip = ckpt.restore(self.groups, resume.state)
        self.prompts.skip_to(start, skip=skip)
        self.resumed_from = resume.state.step
        await self.checkpointer.resume(resume)

    async def run(self) -> RunSummary:
        """Run ``run.num_steps`` optimizer steps with the configured evaluations; returns
        the run's summary (its ledger and rejected frames also go to the metrics file).

        Cancellation: the loops stop; checkpoint requests still waiting are answered.
        """
        own = self._loop_tasks  # a run of jobs pauses the collector once for all of them
        try:
            with collector_paused(collector.GC_FREEZE and own,
                                  collector.GC_YOUNG_INTERVAL_S if own else 0.0):  # fmt: skip
                await self._run()
        finally:
            self.checkpointer.close()
        return self._summary()

    async def _run(self) -> None:
        cfg = self.config
        async with anyio.create_task_group() as tg:
            if collector.GC_YOUNG_INTERVAL_S and self._loop_tasks:
                tg.start_soon(pace, collector.GC_YOUNG_INTERVAL_S, collector.GC_FULL_INTERVAL_S,
                              name="gc-pacer")  # fmt: skip
            tg.start_soon(self.feeder.run, name="feeder")
            if self.episodes is not None:
                await tg.start(self.episodes.run, name="episodes")
            for name, served in self.services.items():
                await tg.start(served.serve, name=name)
            tg.start_soon(self.lag.run, name="loop-lag")
            if self.samples is not None:  # started: its files are cut back to the resumed step
                await tg.start(self.samples.run, self.resumed_from or 0, name="samples-writer")
            if self._loop_tasks:
                dump_dir = os.path.join(cfg.run.output_dir, "logs")
                tg.start_soon(LoopWatchdog(watchdog.STALL_WARNING_S, dump_dir=dump_dir).run,
                              name="loop-watchdog")  # fmt: skip
            async with self._weights:
                await self.publisher.first(self.resumed_from is not None, self.prompts, self.tok)
            if cfg.eval.num_prompts and cfg.eval.at_start and self.resumed_from is None:
                await self.evaluator.evaluate("start", self.groups.generator_version)
            async with anyio.create_task_group() as pumps:
                pumps.start_soon(self.rollout_pump, name="rollout-pump")
                pumps.start_soon(self.train_pump, name="train-pump")
            if self.samples is not None:
                await self.samples.flushed()  # every trained step's lines, before the writer stops
            await self._finish()
            if cfg.eval.num_prompts and cfg.eval.at_end:
                await self.evaluator.evaluate("end", self.groups.generator_version)
            tg.cancel_scope.cancel()

    def _summary(self) -> RunSummary:
        status, out = self.status(), self.config.run.output_dir
        summary = RunSummary(
            steps=list(self.history), evals=list(self.evaluator.records),
            metrics_path=os.path.join(out, "metrics.jsonl"),
            rejected_frames=dict(self.rejections.counts),
            refused_peers=self.rejections.refused_peers, resumed_from=self.resumed_from,
            checkpoint=status.checkpoint, ledger=status.ledger,
        )
        if self.metrics is not None:
            self.metrics.write({"kind": "sockets", "rejected_frames": summary.rejected_frames,
                                "refused_peers": summary.refused_peers})  # fmt: skip
            self.metrics.write({"kind": "ledger", "epochs": summary.ledger})
        log.info("run_finished", summary=json.dumps(summary.evals),
                 rejected_frames=summary.rejected_frames, refused_peers=summary.refused_peers)  # fmt: skip
        return summary

    def request_checkpoint(self) -> anyio.Event:
        """Ask for a checkpoint at the next step boundary (the end of the run counts as one);
        the event is set once it is committed, or once a save failed."""
        return self.checkpointer.request()

    async def save_checkpoint(self) -> str | None:
        """:meth:`request_checkpoint` and wait for it: the directory committed, or ``None``
        (the save failed, or none was ever saved). Cancellation: the request stays."""
        await self.checkpointer.request().wait()
        return self.status().checkpoint

    def status(self) -> RunStatus:
        last = self.checkpointer.last
        return RunStatus(
            step=self.groups.trainer_version,
            checkpoint=str(last) if last is not None else None,
            ledger=[dataclasses.asdict(e) for e in self.groups.ledger_report()],
            workers=self.control.pids(),
            clock_origin=self.t0,
            inflight_samples=self.groups.inflight_samples,
            requests_in_flight=self.rollout.requests_in_flight,
        )

    async def generator_logprobs(
        self, batch: TokenBatch, *, rank: int = 0, temperature: float = 1.0
    ) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under rollout rank ``rank``'s weights."""
        worker = self.rollouts[rank]
        return await self.probes.generator_logprobs(batch, worker=worker, temperature=temperature)

    async def trainer_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under the trainer's current weights."""
        return await self.probes.trainer_logprobs(batch, temperature=temperature)

    def share(self, samples: int) -> None:
        """This job's share of the engines (a run of jobs: docs/jobs.md): at most ``samples``
        of its samples generating at once, from its next dispatch on."""
        self.groups.share(samples)
        self.changed.notify()

    def close(self) -> None:
        """The run is over: close the progress bar."""
        self.console.close()

    # ------------------------------------------------------------------ restarts' API
    async def worker_lost(self, worker: str) -> None:
        """Rollout ``worker`` died and is being restarted: a refit under way leaves it out,
        its groups go to the workers that serve, or wait for one."""
        await self.publisher.receiver_gone(worker)
        self.asker.lost(self.redispatch.worker_lost(worker))

    async def refit_worker(self, worker: str) -> int:
        """Refit restarted ``worker`` to the trainer's weights (with the last FP8 KV-cache
        scales); returns their version. While the weights are held, the trainer's are those
        of ``trainer_version``, which the generators serve."""
        async with self._weights:
            return await self.publisher.refit_worker(worker)

    async def worker_serves(self, worker: str) -> None:
        """Restarted ``worker`` serves the current weights: it takes work again."""
        self.changed.notify()

    # ------------------------------------------------------------------ helpers
    async def _before_training(self, step: int, groups: Sequence[Any]) -> None:
        """A step's first chunk is in: the refit check's baseline (until it has one: both
        sides score its probe), then the trainer's turn on a shared GPU (the engines sleep)."""
        await self.publisher.baseline(step, groups)
        await self.turns.to_trainer()

    def _cancel_episodes(self, group_ids: list[str]) -> None:
        assert self.episodes is not None  # only a multi-turn run has groups of episodes
        self.episodes.cancel(group_ids)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------ rollout pump
    async def rollout_pump(self) -> None:
        """Dispatch groups whenever the rollout phase allows, in one ``Generate`` per worker per
        round, until the run's last step is trained.

        Cancellation: stops dispatching; groups already dispatched stay live.
        """
        ahead = self.groups.max_buffered_groups
        while not self.groups.finished:
            if not self.turns.dispatching:  # the trainer's turn on a shared GPU
                started = self.now()
                await self.changed.wait()
                self._gate_wait_s += self.now() - started
                continue
            # tokenize the next prompts off-loop before deciding: a decision and its
            # Generate must not be separated by a refit
            await self.prompts.prefetch(self.groups.next_index + ahead, self.tok)
            serving, now = self.restarts.serving, self.now()
            sent: list[Sent] = []
            # at most DISPATCH_ROUND groups per round: a first round of hundreds would hold
            # the loop for tens of milliseconds
            while len(sent) < DISPATCH_ROUND and isinstance(
                d := self.rollout.dispatch(serving, self.prompts.get, now), Sent
            ):
                sent.append(d)
            if sent and self.episodes is not None:
                for s in sent:
                    self.episodes.start(s)
                # a round of episodes starts without a call to await: give the loop back
                # before the next one, as a round's Generate does
                await anyio.lowlevel.checkpoint()
                continue
            if sent:
                await self._send_generate(sent)
                continue
            if d.reason == "finished":
                return
            started = self.now()
            await self.changed.wait()  # "workers": every worker is restarting
            if d.reason == "gate":
                self._gate_wait_s += self.now() - started

    async def _send_generate(self, sent: list[Sent]) -> None:
        cfg = self.config.grpo
        requests: dict[str, list[GenRequest]] = {}
        for s in sent:
            seed = sample_seed(self.config.run.seed, s.group_id)
            requests.setdefault(s.worker, []).append(GenRequest(
                group_id=s.group_id, prompt_ids=s.prompt_ids, n=s.n,
                max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed,
            ))  # fmt: skip
        await send_generate(self.control, requests)

    # ------------------------------------------------------------------ train pump
    async def train_pump(self) -> None:
        """Train each step from the train phase's chunks, publish it, save, until the run's last
        step is trained.

        Cancellation: an open optimizer step is abandoned (the run is over).
        """
        async with anyio.create_task_group() as validations:
            while not self.groups.finished:
                await self._step(validations)

    async def _step(self, validations: anyio.abc.TaskGroup) -> None:
        """One step: trained and published, verified when due, logged, saved."""
        step = self.groups.trainer_version
        trained, stats, refit = await self._train_and_publish(step)
        train = trained.record
        if self.samples is not None:  # what the trainer got, once the step counts
            await self.samples.put(step + 1, train.groups, train.advantages)
        await anyio.lowlevel.checkpoint()  # the pumps go first: logging can wait
        verification = await self.publisher.verify(step)
        workers = WorkerTimes.of(self.control.take_served(), self.trainers)
        rec = StepRecord(step, train=train, refit=refit, verification=verification,
                         rollout=self._take_rollout(step), workers=workers)  # fmt: skip
        self._log_step(rec, trained.results, stats)
        await anyio.lowlevel.checkpoint()  # the record took ~1 ms; the next chunk's packing another
        self.publisher.check_verified(verification)
        # a step boundary: no step open, the gate open, the trainer at step + 1
        groups = self.groups
        await self.checkpointer.after_step(groups.trainer_version, groups.finished,
                                           lambda: ckpt.snapshot(groups))  # fmt: skip
        every, num_prompts = self.config.eval.every_steps, self.config.eval.num_prompts
        if every and num_prompts and (step + 1) % every == 0:
            self.evaluator.start_validation(validations, step + 1, self.checkpointer.note_eval)

    async def _train_and_publish(self, step: int) -> tuple[Trained, StepStats, RefitRecord]:
        """Train step ``step``, take its optimizer step and refit the generators. The
        weights are held from ``FinishStep`` to the end of the refit; a validation of the
        weights the refit replaces is waited for before they are taken (the assembler's
        ``before_finish``)."""
        while True:
            await self.assembler.train(step)
            async with self._weights:
                trained = await self.assembler.finish(step)
                if trained is not None:
                    await self.turns.before_refit()  # the trainer's state out of the way
                    stats, refit = await self.publisher.publish(step, trained.record.groups)
                    await self.turns.to_engines()  # the refit woke them
                    return trained, stats, refit
            # FinishStep failed on a trainer: the step's groups are ready again

    async def _finish(self) -> None:
        """The last step is trained: abort what is still generating and wait (bounded) for
        its samples, so the engines are idle for the final evaluation and every dispatched
        group is accounted for."""
        await self.publisher.abort(self.rollout.close())
        with anyio.move_on_after(self.config.cluster.call_timeout_s):
            while not self.groups.drained:
                await self.changed.wait()

    def _take_rollout(self, step: int) -> RolloutRecord:
        """The rollout side's counters for step ``step``'s record, each taken from the one
        place that counts it (and reset there)."""
        gate_wait_s, self._gate_wait_s = self._gate_wait_s, 0.0
        return RolloutRecord(aborted_samples=self.feeder.take_aborted(step),
                             gate_wait_s=gate_wait_s, score_s=self.scorer.take_spent())  # fmt: skip

    def _log_step(self, rec: StepRecord, results: list[StepResult], stats: StepStats) -> None:
        """The step's record from the trainer ranks' ``results`` (rank 0's loss and norm, the
        largest memory peaks)."""
        groups = self.groups
        result = results[0]
        record = rec.metrics(
            result, rec.refit.refit_s, stats, buffer_ready=groups.num_ready,
            buffer_live=groups.num_live, inflight_samples=groups.inflight_samples,
            loop_lags=self.lag.take(), rejected_frames=self.rejections.total, now=self.now(),
        )  # fmt: skip
        record.update(trainer_memory(results, self.planned_trainer_bytes))
        record.update(self.turns.take())
        if self.episodes is not None:
            record.update(self.episodes.take_metrics())
        self.history.append(record)
        if self.metrics is not None:
            self.metrics.write({"kind": "train", **record})
        log_step(record, result, rec.refit.refit_s, rec)
        self.console.step(record, rec.train.groups)
        if self.startup is not None:
            self._log_startup(record)

    def _log_startup(self, step: dict[str, Any]) -> None:
        """After the first step of a fresh run: where the time to it went (the ``startup``
        record, its log line and the console's)."""
        startup, self.startup = self.startup, None
        if self.resumed_from is not None:
            return  # a resume: its first step is no start's
        first_eval = next(((r["start"], r["end"]) for r in self.evaluator.records
                           if r.get("label") == "start"), None)  # fmt: skip
        refit = (step["refit_start"], step["refit_end"]) if step.get("refit_end") else None
        record = startup.record(first_eval=first_eval, first_step=self.now(), refit=refit)
        if self.metrics is not None:
            self.metrics.write(record)
        self.console.startup(record)
