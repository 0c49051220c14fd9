"""The rollout pump, the sample feeder and the train pump, on one event loop.

::

    prompt stream ──► rollout pump ──Generate (one per worker)──► rollout workers
                        │ asks scheduler.dispatch(): gate, capacity,            │ SampleDone each
                        │ samples in flight, the sampler's admission             │ (a DataBatch if
                        │                                                        │ ready together)
                        ▼                                                        ▼
                    Scheduler (asyncrl.policy.schedule: all state and rules) ◄── feeder: sample_finished,
                        │                                                 score off-loop, committed
                        ▼ next_chunk(): evictions + a chunk of ready groups
                    train pump ──TrainChunk──► trainer ranks (one open optimizer step)
                        │ finish_step → begin_refit (Abort hopeless groups; optional drain)
                        ▼ SendWeights ∥ ReceiveWeights → end_refit (gate reopens) → verify

Who wakes whom: every scheduler change (a sample back, a commit, a chunk taken, a refit's end)
fires ``changed``; each pump then asks the scheduler again. The pumps hold no scheduling
state of their own: they carry out the scheduler's decisions and time the waits.

The event loop is the only writer; nothing here blocks it (prompts are tokenized and samples
scored in worker threads).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from asyncrl.run.assembly import StepAssembler
from asyncrl.run.groups import Group
from asyncrl.run.checkpoint_dir import ControllerState
from asyncrl.run.saving import Checkpointer, restore_state
from asyncrl.wire.codec import Codec
from asyncrl.config import Config
from asyncrl.obs.console import Console
from asyncrl.environment import Environment
from asyncrl.errors import ProtocolError, RunError
from asyncrl.run.evaluation import Evaluator
from asyncrl.policy.failures import FailureBudget
from asyncrl.run.intake import Generating, ScoreError, Scorer, Signal, malformed
from asyncrl.wire.messages import (
    Abort,
    DataBatch,
    DataMessage,
    Generate,
    GenRequest,
    GroupFailed,
    SampleDone,
    StepResult,
    TokenBatch,
)
from asyncrl.run.probes import Probes
from asyncrl.data.prompts import PromptStream, Tokenizer, sample_seed
from asyncrl.run.restarts import Redispatcher
from asyncrl.run.refit import KVScales, RefitReport, refit_generators
from asyncrl.policy.pool import SYNCING, RolloutPool
from asyncrl.wire.rpc import ControlPlane
from asyncrl.policy.schedule import Dispatch, Scheduler, StepStats, Wait
from asyncrl.obs.steps import StepRecord, log_step
from asyncrl.wire.transport import AsyncSocket, Rejections, peer_name
from asyncrl.policy.verify import make_probe, verification_due
from asyncrl.obs.watchdog import LoopLag

__all__ = ["Pipeline"]

FEED_SLICE_S = 0.0005
"""The feeder takes queued samples for at most this long before it gives the loop back (with
16-group dispatch rounds: loop lag p99 4.9 ms at 11,000 samples/s on a 16-core host, against
6.3 ms with 1 ms slices and 32-group rounds; benchmarks/modes.py --part lag)."""

DISPATCH_ROUND = 16
"""Groups dispatched per round (one ``Generate`` per worker): bounds the loop time of a round
(about 50 us a group) while still batching requests for the engines."""



log = structlog.get_logger("asyncrl.run.loops")


class Pipeline:
    """The run's loops around its :class:`~asyncrl.policy.schedule.Scheduler`. The
    :class:`~asyncrl.run.controller.Controller` builds it once the workers are ready and owns the
    tasks that run it."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        data_socket: AsyncSocket,
        environment: Environment,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        trainers: list[str],
        rollouts: list[str],
        transfer_address: str,
        metrics: Any,
        clock_origin: float,
        rejections: Rejections | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.data = data_socket
        self.tok = tokenizer
        self.sched = scheduler
        self.trainers = trainers
        self.rollouts = rollouts
        self.pool = RolloutPool(rollouts, config.rollout_restarts)
        """Which rollout workers take work (a dead one is restarted in place)."""
        self.transfer_address = transfer_address
        self.metrics = metrics
        self.console = Console.for_run(config, tokenizer.decode, metrics)
        """The progress bar and sampled completions (closed by the controller)."""
        self.t0 = clock_origin
        deadline_s = config.failures.reward_timeout_s
        self.scorer = Scorer(environment, tokenizer, config.environment.name, timeout_s=deadline_s)
        self.changed = Signal()
        """Fired on every scheduler change the rollout pump (or a drain) may wait for."""
        self.committed = Signal()
        """Fired when a group is committed: the train pump's only reason to look again
        (waking it per sample would cost O(live groups) per sample)."""
        self.steps: dict[int, StepRecord] = {}
        self._generating: dict[str, Generating] = {}
        """Groups whose samples are coming back, by id: what the data socket may deliver."""
        self._ready: dict[str, Group] = {}
        """Complete, scored groups the scheduler has not trained or dropped yet."""
        self._load = {w: 0 for w in rollouts}
        """Samples in flight per rollout worker (dispatch goes to the least loaded)."""
        self.rejections = rejections if rejections is not None else Rejections()
        self._gate_wait_s = 0.0
        """Dispatch time spent waiting for a refit since the last step record."""
        self._refit_report = RefitReport()
        """What the last refit reported (the generators' busy time, the sender's packing)."""
        self.lag = LoopLag()
        """Event-loop wake-up delays (the controller runs it; each step record takes them)."""
        self.history: list[dict[str, Any]] = []
        self.probe: TokenBatch | None = None
        """The refit-verification probe batch, frozen from the first trained step."""
        self.probes = Probes(control, trainers, self.pool, config.cluster.call_timeout_s)
        self.kv = KVScales(control, trainers, rollouts, config.refit,
                           timeout_s=config.cluster.call_timeout_s, metrics=metrics)
        self.prompts = PromptStream(
            environment.dataset("train"), config.grpo.prompts_per_step, config.run.seed
        )
        self.failures = FailureBudget(config.failures)
        self._weights = anyio.Lock()
        """Held from a step's ``FinishStep`` to the end of its refit (the trainer's weights
        and the generators' differ), and by a restarted worker's own refit."""
        self.assembler = StepAssembler(
            config,
            control=control,
            trainers=trainers,
            scheduler=scheduler,
            ready=self._ready,
            committed=self.committed,
            changed=self.changed,
            failures=self.failures,
            now=self.now,
            weights=self._weights,
        )
        self.redispatch = Redispatcher(
            scheduler, generating=self._generating, load=self._load, failures=self.failures,
            changed=self.changed,
        )
        self._kv_scales: dict[str, float] | None = None
        """The FP8 KV-cache scales of the last refit (a restarted worker gets them too)."""
        self.resumed_from: int | None = None
        """The trainer version a resumed run started from (``None``: a fresh run)."""
        self.checkpointer = Checkpointer(
            config,
            control=control,
            trainers=trainers,
            scheduler=scheduler,
            ready=self._ready,
            metrics=metrics,
            train_prompts=environment.dataset("train"),
        )
        self.evaluator = Evaluator(
            config,
            control=control,
            environment=environment,
            tokenizer=tokenizer,
            pool=self.pool,
            generating=self._generating,
            metrics=metrics,
            now=self.now,
        )

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _record(self, step: int) -> StepRecord:
        return self.steps.setdefault(step, StepRecord(step))

    def _pick_rollout(self) -> str:
        return min(self.pool.serving, key=self._load.__getitem__)

    # ------------------------------------------------------------------ rollout pump
    async def rollout_pump(self) -> None:
        """Dispatch groups whenever the scheduler allows, in one ``Generate`` per worker per
        round, until the run's last step is trained.

        Cancellation: stops dispatching; groups already dispatched stay tracked.
        """
        ahead = self.sched.max_buffered_groups
        while not self.sched.finished:
            # tokenize the next prompts off-loop before deciding: a decision and its
            # Generate must not be separated by a refit
            await self.prompts.prefetch(self.sched.next_index + ahead, self.tok)
            if not self.pool.serving:  # every worker is restarting
                await self.changed.wait()
                continue
            decisions: list[Dispatch] = []
            # at most DISPATCH_ROUND groups per round: a first round of hundreds would hold
            # the loop for tens of milliseconds
            while len(decisions) < DISPATCH_ROUND and isinstance(
                d := self.sched.dispatch(), Dispatch
            ):
                decisions.append(d)
            if decisions:
                await self._send_generate(decisions)
                continue
            assert isinstance(d, Wait)
            if d.reason == "finished":
                return
            started = self.now()
            await self.changed.wait()
            if d.reason == "gate":
                self._gate_wait_s += self.now() - started

    async def _send_generate(self, decisions: list[Dispatch]) -> None:
        cfg = self.config.grpo
        now = self.now()
        requests: dict[str, list[GenRequest]] = {}
        for d in decisions:
            retried = self.redispatch.take(d.group_id)
            prompt, prompt_ids = retried if retried else self.prompts.get(d.index)
            worker = self._pick_rollout()
            self._load[worker] += d.n
            self._generating[d.group_id] = Generating(
                prompt, prompt_ids, worker, d.n, d.start_version, d.target_step, now
            )
            requests.setdefault(worker, []).append(
                GenRequest(
                    group_id=d.group_id,
                    prompt_ids=prompt_ids,
                    n=d.n,
                    max_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    seed=sample_seed(self.config.run.seed, d.group_id),
                )
            )
        timeout = self.config.cluster.call_timeout_s
        async with anyio.create_task_group() as tg:
            for worker, reqs in requests.items():
                tg.start_soon(self._call, worker, Generate(requests=reqs), timeout)

    async def _call(self, worker: str, request: Any, timeout: float) -> None:
        # a worker that died: its groups were dispatched again (worker_lost)
        await self.control.call_unless_restarting(worker, request, timeout_s=timeout)

    # ------------------------------------------------------------------ feeder
    async def feed_buffer(self) -> None:
        """Read samples from the data socket; tell the scheduler; score complete groups
        off-loop and commit them.

        A frame that does not decode, or a sample for a group that is not generating (a late
        duplicate, a stranger's), is rejected and counted (socket ``data``); it never ends the
        run. A malformed sample from the worker the group was sent to, a generation failure,
        or an environment whose ``score()`` raises or returns a non-finite reward ends it with
        a :class:`~asyncrl.errors.RunError` naming the culprit.

        Cancellation: stops reading; scoring tasks in flight are cancelled with it.
        """
        codec = Codec(DataMessage)
        async with anyio.create_task_group() as tg:
            while True:
                frames = await self.data.recv()
                # take what else is already queued for at most FEED_SLICE_S, then wake the rollout
                # pump once for the lot (not once per sample) and give the loop back: a
                # never-empty socket must not starve the other tasks
                deadline = time.perf_counter() + FEED_SLICE_S
                while frames is not None:
                    self._take_frames(codec, frames, tg)
                    if time.perf_counter() > deadline:
                        break
                    frames = self.data.recv_nowait()
                self.changed.notify()
                await anyio.lowlevel.checkpoint()

    def _take_frames(self, codec: Codec, frames: Any, tg: Any) -> None:
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            self.rejections.reject("data", "?", str(exc))
            return
        for item in msg.items if isinstance(msg, DataBatch) else (msg,):
            self._take_item(item, tg)

    def _take_item(self, msg: SampleDone | GroupFailed, tg: Any) -> None:
        pending = self._generating.get(msg.group_id)
        if pending is None or pending.worker != msg.worker:
            self.rejections.reject(
                "data",
                peer_name(msg.worker),
                f"{type(msg).__name__} for group {msg.group_id!r}, which is not "
                "generating" + ("" if pending is None else f" on {msg.worker!r}"),
            )
            return
        if isinstance(msg, GroupFailed):
            if pending.eval_done is not None:
                error = f"{msg.error_type}: {msg.message}"
                raise RunError(f"evaluation group {msg.group_id} failed on {msg.worker}: {error}")
            self.redispatch.group_failed(pending, msg, tg)
            return
        self._take_sample(pending, msg, tg)

    def _take_sample(self, pending: Generating, msg: SampleDone, tg: Any) -> None:
        gid = msg.group_id
        if not 0 <= msg.index < pending.n or pending.samples[msg.index] is not None:
            self.rejections.reject(
                "data",
                peer_name(msg.worker),
                f"sample {msg.index} of group {gid!r}: out of range or already received",
            )
            return
        problem = malformed(msg.sample)
        if problem:
            raise RunError(
                f"{msg.worker} returned a malformed sample {msg.index} for group {gid}: "
                f"{problem}; the generation backend {self.config.generator.backend!r} broke "
                "its contract"
            )
        pending.samples[msg.index] = msg.sample
        if pending.eval_done is not None:
            if all(x is not None for x in pending.samples):
                del self._generating[gid]
                self._complete(gid, pending, tg)
            return
        self._load[pending.worker] -= 1
        if msg.sample.finish_reason == "abort":
            self._record(self.sched.trainer_version).aborted_samples += 1
        outcome = self.sched.sample_finished(gid)
        if outcome is not None:
            del self._generating[gid]
        if outcome == "commit":
            self._complete(gid, pending, tg)

    def _complete(self, gid: str, pending: Generating, tg: Any) -> None:
        """A group's last sample arrived: score and commit it now (cheap environment) or in
        a task (scoring in a thread)."""
        if pending.eval_done is not None:
            if self.scorer.cheap:
                self._eval_scored(pending, self.scorer.inline(pending))
            else:
                tg.start_soon(self._score_eval, pending)
        elif self.scorer.cheap:
            try:
                samples = self.scorer.inline(pending)
            except ScoreError as exc:
                self._score_failed(gid, exc)
            else:
                self._commit(gid, pending, samples)
        else:
            tg.start_soon(self._score_and_commit, gid, pending)

    async def _score_and_commit(self, gid: str, pending: Generating) -> None:
        try:
            samples = await self.scorer.threaded(pending)
        except ScoreError as exc:
            self._score_failed(gid, exc)
        else:
            self._commit(gid, pending, samples)

    def _score_failed(self, gid: str, exc: ScoreError) -> None:
        """``failures.on_reward_error``: stop the run, or drop the group."""
        if self.config.failures.on_reward_error == "fail_run":
            raise exc
        log.error("reward_failed", group_id=gid, error=str(exc), action="group dropped")
        if self.sched.tracks(gid):
            self.redispatch.drop(gid, f"group {gid}: {exc}")

    def _commit(self, gid: str, pending: Generating, samples: list[Any]) -> None:
        if not self.sched.tracks(gid):
            return  # the run ended while it was scored (counted as unused)
        self.failures.succeeded(gid)
        index = self.sched.slot(gid).index
        self.sched.committed(gid, [s.reward for s in samples])
        self._ready[gid] = Group(
            gid,
            pending.prompt.id,
            pending.prompt_ids,
            pending.start_version,
            pending.target_step,
            pending.dispatched_at,
            samples,
            end_version=self.sched.generator_version,
            committed_at=self.now(),
            index=index,
            worker=pending.worker,
            prompt_text=pending.prompt.display,
        )
        self.committed.notify()

    async def _score_eval(self, pending: Generating) -> None:
        self._eval_scored(pending, await self.scorer.threaded(pending))

    @staticmethod
    def _eval_scored(pending: Generating, samples: list[Any]) -> None:
        pending.samples = samples
        assert pending.eval_done is not None
        pending.eval_done.set()

    # ------------------------------------------------------------------ train pump
    async def train_pump(self) -> None:
        """Assemble each step from the scheduler's chunks, train it, refit, publish.

        Cancellation: an open optimizer step is abandoned (the run is over).
        """
        async with anyio.create_task_group() as validations:
            await self._train_steps(validations)

    async def _train_steps(self, validations: anyio.abc.TaskGroup) -> None:
        cfg = self.config
        while not self.sched.finished:
            step = self.sched.trainer_version
            rec = self._record(step)
            finish = await self.assembler.train(step, rec, self._before_finish)
            try:  # the assembler took self._weights for FinishStep
                stats = await self._publish(step, rec)
            finally:
                self._weights.release()
            await anyio.lowlevel.checkpoint()  # the pumps go first: logging can wait
            if self.probe is None:
                self.probe = make_probe(rec.groups, cfg.refit.verify_num_sequences)
            if self.probe is not None and verification_due(
                step + 1, cfg.refit.verify_first_steps, cfg.refit.verify_every_steps
            ):
                start = self.now()
                rec.verify = await self.probes.verify(
                    self.probe, step + 1, self.metrics, self.now()
                )
                rec.verify_s = self.now() - start
            self._log_step(rec, finish[0], rec.refit_s, stats)  # type: ignore[arg-type]
            del self.steps[step]
            for agreement in rec.verify:
                agreement.check(*self.kv.verify_tolerance)
            # a step boundary: no step open, the gate open, the trainer at step + 1
            await self.checkpointer.after_step()
            every = cfg.eval.every_steps
            if every and cfg.eval.num_prompts and (step + 1) % every == 0:
                self.evaluator.start_validation(validations, step + 1, self.checkpointer.note_eval)

    async def _before_finish(self, rec: StepRecord) -> None:
        """Before a step's ``FinishStep``: wait for a validation of the weights the refit
        replaces, then hold the weights until the refit is done (not the other way round:
        a validation may wait for a restarted worker, whose refit needs the weights)."""
        t = self.now()
        await self.evaluator.wait_validation()
        rec.waited(t, self.now())
        await self._weights.acquire()

    async def _publish(self, step: int, rec: StepRecord) -> StepStats:
        """The step is taken: bump the version, abort what became hopeless, refit."""
        # the version bump and the gate's closing are one scheduler event: no dispatch
        # can see version v+1 before the generators serve it
        self.sched.finish_step()
        self.changed.notify()
        rec.refit_start = refit_start = self.now()
        log.debug("refit_started", version=step + 1)
        await self._abort(self.sched.begin_refit())
        if self.config.refit.drain:
            await self._drain(rec)
        rec.inflight_at_refit = self.sched.inflight_samples
        await self.refit(step + 1, await self.kv.after_step(rec.groups, step + 1))
        rec.refit_end = self.now()
        rec.refit_s = rec.refit_end - refit_start
        stats = self.sched.end_refit()
        self.changed.notify()
        return stats

    async def _abort(self, group_ids: list[str]) -> None:
        """Tell each engine to abort its groups among ``group_ids`` (their samples still come
        back, cut short, and free their slots)."""
        by_worker: dict[str, list[str]] = {}
        for gid in group_ids:
            pending = self._generating.get(gid)
            if pending is not None:
                by_worker.setdefault(pending.worker, []).append(gid)
        if group_ids:
            log.info(
                "groups_aborted", count=len(group_ids), trainer_version=self.sched.trainer_version
            )
        timeout = self.config.cluster.call_timeout_s
        async with anyio.create_task_group() as tg:
            for worker, gids in by_worker.items():
                tg.start_soon(self._call, worker, Abort(group_ids=gids), timeout)

    async def _drain(self, rec: StepRecord) -> None:
        """Wait until no sample is generating, at most ``refit.drain_timeout_s``."""
        start = self.now()
        with anyio.move_on_after(self.config.refit.drain_timeout_s) as scope:
            while not self.sched.drained:
                await self.changed.wait()
        rec.drain_s = self.now() - start
        if scope.cancelled_caught:
            rec.drain_timeouts += 1
            log.warning(
                "drain_timed_out",
                inflight_samples=self.sched.inflight_samples,
                timeout_s=self.config.refit.drain_timeout_s,
            )

    async def first_refit(self) -> None:
        """Before the first dispatch: a resumed run refits the generators from the restored
        weights (the engines start from ``model.path``); with an FP8 KV cache, every run
        refits with calibrated scales, so no step runs on scales of 1.0."""
        if self.resumed_from is not None or self.kv.enabled:
            kv_scales = await self.kv.initial(self.prompts, self.tok)
            async with self._weights:
                await self.refit(self.sched.trainer_version, kv_scales)

    def restore(self, state: ControllerState) -> None:
        """Take over a checkpoint's state before anything is dispatched: the scheduler (its
        ready groups with their samples, the prompts to dispatch again, the prompt ledger) and
        the prompt stream's position."""
        self._ready.update(restore_state(state, self.sched))
        again = {int(i) for i, _ in state.scheduler["redispatch"]}
        frontier = self.sched.next_index
        start = min(again | {frontier})
        self.prompts.skip_to(start, skip=set(range(start, frontier)) - again)
        self.resumed_from = state.step

    async def finish(self) -> None:
        """The last step is trained: abort what is still generating and wait (bounded) for
        its samples, so the engines are idle for the final evaluation and every dispatched
        group is accounted for."""
        await self._abort(self.sched.close())
        with anyio.move_on_after(self.config.cluster.call_timeout_s):
            while not self.sched.drained:
                await self.changed.wait()
        self._ready.clear()

    async def worker_lost(self, worker: str) -> None:
        """Rollout ``worker`` died and is being restarted (the pool said so): its groups go
        to the workers that serve, or wait for one."""
        evals = self.redispatch.worker_lost(worker)
        await self.evaluator.resend(evals)

    async def worker_back(self, worker: str) -> bool:
        """Rollout ``worker``'s new process is ready: refit it to the trainer's weights (with
        the last FP8 KV-cache scales), then it takes work again. While the weights are held,
        the trainer's are those of ``trainer_version``, which the generators serve. False:
        it died again during its refit (it is restarting again, or the run stops)."""
        self.pool.returned(worker)
        async with self._weights:
            version = self.sched.trainer_version
            await self.refit(version, self._kv_scales, receivers=[worker])
        if self.pool.state(worker) != SYNCING:
            return False
        self.pool.synced(worker)
        self._load[worker] = 0
        log.info("worker_back", worker=worker, version=version)
        await self.evaluator.resend([])
        self.changed.notify()
        return True

    async def refit(
        self,
        version: int,
        kv_scales: dict[str, float] | None = None,
        receivers: list[str] | None = None,
    ) -> None:
        """Send weights ``version`` (and FP8 KV-cache scales) from the trainers to every
        generator that serves (or ``receivers``); return when they serve them. A generator
        that dies meanwhile is left out (it is restarted). Cancellation: abandons the
        transfer."""
        report = await refit_generators(
            self.control,
            self.trainers,
            self.pool.serving if receivers is None else receivers,
            version=version,
            transfer_address=self.transfer_address,
            refit=self.config.refit,
            timeout_s=self.config.cluster.call_timeout_s,
            kv_scales=kv_scales,
        )
        if receivers is None:  # a step's refit (not a restarted worker's): its figures count
            self._refit_report, self._kv_scales = report, kv_scales
        if report.rejected_frames:  # the sender's count covers the whole run
            self.rejections.counts["weights"] = report.rejected_frames

    def _log_step(
        self, rec: StepRecord, result: StepResult, refit_s: float, stats: StepStats
    ) -> None:
        rec.gate_wait_s, self._gate_wait_s = self._gate_wait_s, 0.0
        rec.take_served(self.control.take_served(), self.trainers)
        rec.engine_busy_s = self._refit_report.busy_s
        rec.refit_pack_s = self._refit_report.pack_s
        record = rec.metrics(
            result,
            refit_s,
            stats,
            buffer_ready=self.sched.num_ready,
            buffer_live=self.sched.num_live,
            inflight_samples=self.sched.inflight_samples,
            loop_lags=self.lag.take(),
            rejected_frames=self.rejections.total,
            now=self.now(),
        )
        self.history.append(record)
        if self.metrics is not None:
            self.metrics.write({"kind": "train", **record})
        log_step(record, result, refit_s, rec)
        self.console.step(record, rec.groups)

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, label: str) -> dict[str, Any]:
        """Greedy held-out accuracy of the generators' current weights
        (:class:`~asyncrl.run.evaluation.Evaluator`)."""
        return await self.evaluator.evaluate(label, self.sched.generator_version)
