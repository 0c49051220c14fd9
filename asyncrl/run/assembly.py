"""One optimizer step on the trainer ranks, assembled from the rollout book's chunks, then
published to the generators.

::

    StepAssembler.train():  book.next_chunk() ─► evictions ─► ready groups ─► BeginStep (first
                            chunk) ─► TrainChunk per chunk
    ── the caller takes the weights lock ──
    StepAssembler.finish(): FinishStep
    Publisher.publish():    book.finish_step() (gate closes) ─► Abort hopeless groups ─► drain
                            (optional) ─► KV scales ─► SendWeights ∥ ReceiveWeights ─►
                            book.end_refit() (gate reopens)
    ── the caller releases it ──

The step streams in: each chunk is packed, sharded over the trainer ranks and trained as soon
as the book hands it out; gradients are normalized once, by the step's count of trained
tokens (those its batches' ``loss_mask`` selects, as the trainers counted them in their
``ChunkResult`` s), at ``FinishStep``. A train call that raises on a trainer rank (the worker
lives on; the trainer drops the step's gradients) gives the step's groups back to the buffer
and the step is assembled and trained again, within ``failures.train_step_retries``
(:mod:`asyncrl.policy.failures`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import numpy as np
import structlog

from asyncrl.config import Config
from asyncrl.data.prompts import PromptStream, Tokenizer
from asyncrl.errors import NonFiniteError, RemoteCallError, RunError, WorkerError, flatten
from asyncrl.obs.steps import StepRecord
from asyncrl.policy.failures import FailureBudget
from asyncrl.policy.grpo import (
    concat_batches,
    mini_batches,
    nonfinite_cause,
    pack_groups,
    per_sequence_mean,
    shard_batch,
    trained_per_sequence,
)
from asyncrl.policy.samplers import in_flight_at_refit
from asyncrl.policy.schedule import StepStats
from asyncrl.policy.verify import Agreement, RefitCheck, make_probe, verification_due
from asyncrl.run.book import Aborts, RolloutBook
from asyncrl.run.wake import Signal
from asyncrl.run.probes import Probes
from asyncrl.run.refit import KVScales, RefitReport, refit_generators
from asyncrl.run.refresh import Refresher
from asyncrl.wire.messages import (
    Abort,
    BeginStep,
    FinishStep,
    ReceiverGone,
    TokenBatch,
    TrainBatch,
    TrainChunk,
)
from asyncrl.wire.rpc import ControlPlane
from asyncrl.wire.transport import Rejections

__all__ = ["Publisher", "StepAssembler"]

log = structlog.get_logger("asyncrl.run.assembly")


class _StepFailed(Exception):
    """A train call raised on a trainer rank (which dropped the step's gradients)."""

    def __init__(self, error: RemoteCallError) -> None:
        super().__init__(str(error))
        self.error = error


class StepAssembler:
    """Trains steps for the train pump from the rollout book's chunks."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        trainers: list[str],
        book: RolloutBook,
        committed: Signal,
        changed: Signal,
        failures: FailureBudget,
        probes: Probes,
        now: Callable[[], float],
        before_training: Callable[[int, StepRecord], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.trainers = trainers
        self.book = book
        self.committed = committed
        self.changed = changed
        self.failures = failures
        self.now = now
        self._before_training = before_training
        """Called with a step's first chunk in, before the trainers train any of it (the
        refit check's baseline: :meth:`Publisher.baseline`)."""
        g = config.grpo
        self._advantage_options: dict[str, Any] = dict(
            normalize=g.normalize_advantages, environment=config.environment.name,
            estimator=g.advantage_estimator, weights=g.reward_weights,
            normalization=g.reward_normalization,
        )  # fmt: skip
        """What the advantages of a chunk's groups are made with (``[grpo]``)."""
        self.refresher = Refresher(config, probes, advantage_options=self._advantage_options,
                                   now=now)  # fmt: skip
        self._mini_batched = g.updates_per_step > 1
        """Several optimizer steps per RL step: chunks are packed and refreshed as they
        stream in, and trained once the step has all its groups (:meth:`finish`)."""

    async def train(self, step: int, rec: StepRecord) -> None:
        """Train step ``step`` chunk by chunk until it has all its groups (not yet
        finished); a step that fails on a trainer is assembled again.

        Raises:
            RunError: the step failed more often than ``failures.train_step_retries``.
        """
        while True:
            try:
                await self._train_chunks(step, rec)
                return
            except _StepFailed as exc:
                self._give_back(step, rec, exc)

    async def finish(self, step: int, rec: StepRecord) -> list[Any] | None:
        """Take the optimizer step of the trained step ``step`` (``FinishStep``); the caller
        holds the weights. Returns the trainers' ``StepResult``s, or ``None`` when the call
        failed on a trainer: the step's groups are ready again and the step must be trained
        again (:meth:`train`, then this).

        Raises:
            RunError: the step failed more often than ``failures.train_step_retries``.
            NonFiniteError: a loss or gradient norm that is not finite, once
                ``failures.max_nonfinite_steps`` such steps were skipped.
        """
        busy = self.now()
        try:
            if self._mini_batched:
                finish = await self._mini_steps(step, rec)
            else:
                finish = await self._finish_step(step, rec, rec.chunk_results, rec.sequences)
        except _StepFailed as exc:
            self._give_back(step, rec, exc)
            return None
        rec.train_end = self.now()
        rec.train_busy_s += rec.train_end - busy
        self.failures.step_done()
        return finish

    async def _finish_step(
        self, step: int, rec: StepRecord, results: list[Any], sequences: int
    ) -> list[Any]:
        """``FinishStep`` over the trained chunks' ``results`` (``sequences`` of them train
        a token); the step's loss or gradient norm checked for finiteness.

        Raises:
            _StepFailed: the call raised on a trainer rank.
        """
        num_tokens = sum(r.num_loss_tokens for r in results)  # trained tokens only
        message = FinishStep(step=step, num_loss_tokens=num_tokens,
                             normalizer=normalizer(self.config, sequences))  # fmt: skip
        finish = await self._train_call([message] * len(self.trainers))
        self._check_finite(step, rec, finish)
        return finish

    async def _mini_steps(self, step: int, rec: StepRecord) -> list[Any]:
        """The RL step's optimizer steps: ``grpo.update_epochs`` passes over its sequences,
        each ``grpo.mini_steps`` mini-batches of one optimizer step; returns the trainers'
        last results, with the mean loss over the mini-steps.

        Raises:
            _StepFailed: a call raised on a trainer before the first optimizer step (the
                step is assembled again).
            RunError: one raised after it: the trainer's weights hold part of the step, so
                it cannot be trained again from them.
        """
        g = self.config.grpo
        rec.train_start = self.now()
        parts = mini_batches(concat_batches(rec.batches), g.mini_steps)
        counts = [int(np.count_nonzero(trained_per_sequence(p))) for p in parts]
        losses, finish = [], []
        for epoch, (index, part) in itertools.product(range(g.update_epochs), enumerate(parts)):
            try:
                await self._train_call([BeginStep(step=step)] * len(self.trainers))
                results = await self._train_batch(step, part)
                finish = await self._finish_step(step, rec, results, counts[index])
            except _StepFailed as exc:
                if not losses:
                    raise
                raise RunError(
                    f"step {step}: mini-step {len(losses) + 1} of "
                    f"{g.mini_steps * g.update_epochs} failed on a trainer after "
                    f"{len(losses)} were applied, so the step cannot be trained again from "
                    f"these weights: {exc.error}. Fix: resume from the last checkpoint "
                    "(--resume)"
                ) from exc.error
            rec.chunk_results += results
            rec.chunks += 1
            losses.append(finish[0].loss)
            rec.mini_steps.append(_mini_step_record(epoch, index, results, finish[0]))
        tokens = sum(int(np.count_nonzero(b.loss_mask)) for b in rec.batches)
        return [msgspec.structs.replace(r, loss=float(np.mean(losses)), num_loss_tokens=tokens)
                for r in finish]  # fmt: skip

    def _give_back(self, step: int, rec: StepRecord, exc: _StepFailed) -> None:
        """A train call failed: the trainers dropped the step's gradients, so its groups are
        ready again (or the run stops, the retries spent)."""
        if not self.failures.step_failed(step, str(exc.error).splitlines()[0]):
            raise RunError(
                f"step {step} failed {self.failures.step_failures} times "
                f"(failures.train_step_retries = "
                f"{self.config.failures.train_step_retries}); the last: {exc.error}"
            ) from exc.error
        self.book.abort_step()
        rec.restart()
        self.committed.notify()

    def _check_finite(self, step: int, rec: StepRecord, finish: list[Any]) -> None:
        """A step whose loss or gradient norm is not finite was not applied by the trainers:
        skip it within ``failures.max_nonfinite_steps``, else stop the run naming the likely
        cause."""
        bad = [r for r in finish if not (math.isfinite(r.loss) and math.isfinite(r.grad_norm))]
        if not bad:
            return
        loss, grad_norm = bad[0].loss, bad[0].grad_norm
        if self.failures.nonfinite_step(step, loss, grad_norm):
            rec.nonfinite_skipped = True
            return
        budget = (
            f"; {self.failures.nonfinite_steps} such steps, failures.max_nonfinite_steps = "
            f"{self.config.failures.max_nonfinite_steps}"
        )
        raise NonFiniteError(
            nonfinite_cause(step, loss, grad_norm, rec.groups, budget=budget,
                            **self._advantage_options)
        )  # fmt: skip

    async def _train_chunks(self, step: int, rec: StepRecord) -> None:
        """Open step ``step`` on the trainers and train it chunk by chunk as the book hands
        out groups, until it has ``grpo.prompts_per_step``.

        Raises:
            _StepFailed: a train call raised on a trainer (the worker lives on).
        """
        opened = False
        while self.book.taken < self.config.grpo.prompts_per_step:
            chunk = self.book.next_chunk()
            for gid in chunk.evicted:
                log.info("group_evicted", group_id=gid, step=step)
            if chunk.evicted or chunk.groups:
                self.changed.notify()  # capacity freed: the rollout pump may dispatch
            if not chunk.groups:
                t = self.now()
                await self.committed.wait()  # only a commit can make a chunk possible
                rec.waited(t, self.now())
                continue
            rec.groups += chunk.groups  # before any await: a failed step gives them back
            if self._before_training is not None and not opened and not rec.batches:
                await self._before_training(step, rec)
            if not opened and not self._mini_batched:
                rec.train_start = self.now()
                log.debug("step_started", step=step)
                await self._train_call([BeginStep(step=step)] * len(self.trainers))
                opened = True
            batch = await self._pack(chunk.groups, rec)
            await anyio.lowlevel.checkpoint()  # ~1 ms of packing: let samples in
            if self._mini_batched:
                rec.batches.append(batch)  # trained by finish(), once all are in
                continue
            busy = self.now()
            rec.chunk_results += await self._train_batch(step, batch)
            rec.train_busy_s += self.now() - busy
            rec.chunks += 1

    async def _pack(self, groups: list[Any], rec: StepRecord) -> TrainBatch:
        """A chunk's groups as a refreshed :class:`TrainBatch` (``loss.aggregation``
        applied); its advantages and sequences counted in ``rec``."""
        cfg = self.config
        batch = pack_groups(groups, **self._advantage_options)
        if self.refresher.active:
            with _step_failures():  # a refresh that raised on a trainer: the step again
                batch = await self.refresher.refresh(batch, groups, rec)
        rec.advantages.append(batch.advantages)
        trained = trained_per_sequence(batch)
        rec.sequences += int(np.count_nonzero(trained))
        if cfg.loss.aggregation == "sequence_mean":
            batch = per_sequence_mean(batch, trained)
        return batch

    async def _train_batch(self, step: int, batch: TrainBatch) -> list[Any]:
        """``TrainChunk``: ``batch`` sharded over the trainer ranks, into the open step."""
        shards = shard_batch(batch, len(self.trainers))
        return await self._train_call([TrainChunk(step=step, batch=x) for x in shards])

    async def _train_call(self, requests: list[Any]) -> list[Any]:
        """One request to each trainer rank; a call that raised there is a :class:`_StepFailed`
        (the others' calls were abandoned here; the trainers serve calls in order)."""
        with _step_failures():
            return await self.control.call_each(
                self.trainers, requests, timeout_s=self.config.cluster.call_timeout_s
            )


@contextlib.contextmanager
def _step_failures() -> Iterator[None]:
    """Turn a trainer call that raised on its rank (every leaf a ``RemoteCallError``) into
    :class:`_StepFailed`: the worker lives on, and the step can be assembled again."""
    try:
        yield
    except Exception as exc:
        leaves = [e for e in flatten(exc) if not isinstance(e, anyio.get_cancelled_exc_class())]
        if leaves and all(isinstance(e, RemoteCallError) for e in leaves):
            raise _StepFailed(leaves[0]) from exc
        raise


class Publisher:
    """Publishes the trainer's weights to the generators. Every method that refits
    (:meth:`publish`, :meth:`first`, :meth:`refit_worker`) expects the caller to hold the
    weights lock: the trainer's weights are those sent, and the generators serve them when
    it returns. :meth:`abort` (engines told to drop groups), :meth:`verify` and
    :meth:`check_verified` need no lock.

    ``serving()``: the rollout workers that serve now (a refit goes to them; one that dies
    meanwhile is left out, it is restarted: :meth:`receiver_gone`).
    """

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        trainers: list[str],
        book: RolloutBook,
        serving: Callable[[], list[str]],
        kv: KVScales,
        probes: Probes,
        transfer_address: str,
        changed: Signal,
        rejections: Rejections,
        metrics: Any,
        now: Callable[[], float],
        cancel_episodes: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.trainers = trainers
        self.book = book
        self._cancel_episodes = cancel_episodes
        """Cancels the episodes of aborted groups (a multi-turn environment's runner)."""
        self.serving = serving
        self.kv = kv
        self.probes = probes
        self.transfer_address = transfer_address
        self.changed = changed
        self.rejections = rejections
        self.metrics = metrics
        self.now = now
        self.report = RefitReport()
        """What the last step's refit reported (the generators' busy time, the packing)."""
        self._kv_scales: dict[str, float] | None = None
        """The FP8 KV-cache scales of the last refit (a restarted worker gets them too)."""
        self._probe: TokenBatch | None = None
        """The refit-verification probe batch, frozen from the first trained step."""
        self.check = RefitCheck.of(config.refit)
        """Judges verified refits against the baseline measured before the first update."""
        self._reprefill = in_flight_at_refit(config.sampler) == "reprefill"
        """Requests in flight at a step's refit recompute their KV cache (the sampler's
        choice; docs/modes.md)."""

    async def publish(self, step: int, rec: StepRecord) -> StepStats:
        """Step ``step`` took its optimizer step: bump the version, abort what became
        hopeless, refit. Returns the step's counters. Cancellation: the refit is abandoned
        (the run is over)."""
        # the version bump and the gate's closing are one book event: no dispatch can see
        # version v+1 before the generators serve it
        self.book.finish_step()
        self.changed.notify()
        rec.refit_start = refit_start = self.now()
        log.debug("refit_started", version=step + 1)
        await self.abort(self.book.begin_refit())
        if self.config.refit.drain:
            await self._drain(rec)
        rec.inflight_at_refit = self.book.inflight_samples
        kv_scales = await self.kv.after_step(rec.groups, step + 1)
        self.report = await self._refit(
            step + 1, kv_scales, self.serving(), reprefill=self._reprefill
        )
        self._kv_scales = kv_scales
        rec.refit_end = self.now()
        rec.refit_s = rec.refit_end - refit_start
        stats = self.book.end_refit()
        self.changed.notify()
        return stats

    async def abort(self, aborts: Aborts) -> None:
        """Tell each engine to abort its groups and episodes' turns (their samples still come
        back, cut short, and free their slots), and cancel the aborted groups' episodes."""
        if aborts.count:
            log.info("groups_aborted", count=aborts.count, trainer_version=self.book.trainer_version)
        if aborts.episodes:
            assert self._cancel_episodes is not None
            self._cancel_episodes(aborts.episodes)
        async with anyio.create_task_group() as tg:
            for worker, gids in aborts.by_worker.items():
                tg.start_soon(self._abort_on, worker, gids)

    async def _abort_on(self, worker: str, group_ids: list[str]) -> None:
        # a worker that died: its groups were dispatched again (worker_lost)
        await self.control.call_unless_restarting(
            worker, Abort(group_ids=group_ids), timeout_s=self.config.cluster.call_timeout_s
        )

    async def _drain(self, rec: StepRecord) -> None:
        """Wait until no sample is generating, at most ``refit.drain_timeout_s``."""
        start = self.now()
        with anyio.move_on_after(self.config.refit.drain_timeout_s) as scope:
            while not self.book.drained:
                await self.changed.wait()
        rec.drain_s = self.now() - start
        if scope.cancelled_caught:
            rec.drain_timeouts += 1
            log.warning(
                "drain_timed_out",
                inflight_samples=self.book.inflight_samples,
                timeout_s=self.config.refit.drain_timeout_s,
            )

    async def first(self, resumed: bool, prompts: PromptStream, tokenizer: Tokenizer) -> None:
        """Before the first dispatch: a resumed run refits the generators from the restored
        weights (the engines start from ``model.path``); with an FP8 KV cache, every run
        refits with calibrated scales, so no step runs on scales of 1.0."""
        if resumed or self.kv.enabled:
            kv_scales = await self.kv.initial(prompts, tokenizer)
            self.report = await self._refit(self.book.trainer_version, kv_scales, self.serving())
            self._kv_scales = kv_scales

    async def receiver_gone(self, worker: str) -> None:
        """Rollout ``worker`` died: tell trainer rank 0, so a refit under way leaves it out
        now (its own pid watch sees nothing of another host's process). Needs no lock. A
        trainer that is gone is its own watcher's to report."""
        with contextlib.suppress(WorkerError):
            await self.control.cast(self.trainers[0], ReceiverGone(receiver=worker))

    async def refit_worker(self, worker: str) -> int:
        """Refit restarted ``worker`` alone to the trainer's weights, with the last FP8
        KV-cache scales; returns their version."""
        version = self.book.trainer_version
        await self._refit(version, self._kv_scales, [worker])
        return version

    async def _refit(
        self, version: int, kv_scales: dict[str, float] | None, receivers: list[str],
        *, reprefill: bool = False,
    ) -> RefitReport:
        """Send weights ``version`` (and FP8 KV-cache scales) from the trainers to
        ``receivers`` (``reprefill``: their requests in flight recompute their KV cache);
        return when they serve them. Cancellation: abandons the transfer."""
        report = await refit_generators(
            self.control,
            self.trainers,
            receivers,
            version=version,
            transfer_address=self.transfer_address,
            refit=self.config.refit,
            timeout_s=self.config.cluster.call_timeout_s,
            kv_scales=kv_scales,
            reprefill=reprefill,
        )
        if report.rejected_frames:  # the sender's count covers the whole run
            self.rejections.counts["weights"] = report.rejected_frames
        return report

    async def baseline(self, step: int, rec: StepRecord) -> None:
        """Before the trainers train any of step ``step`` (its first chunk is in ``rec``),
        until the refit check has its baseline: freeze the probe batch from the step's groups
        and score it on both sides, which hold the same weights now (docs/refit.md, 'Refit
        verification'). Before any backward pass: a forward between a backward and its
        optimizer step left FSDP2 (one rank, float32) unable to free a gathered parameter at
        the next backward.

        Raises:
            RefitError: the two sides disagree beyond ``refit.verify_max_noise`` already.
        """
        cfg = self.config.refit
        if self.check.started or not (cfg.verify_first_steps or cfg.verify_every_steps):
            return
        if self._probe is None:
            self._probe = make_probe(rec.groups, cfg.verify_num_sequences)
        if self._probe is None:
            return  # no tokens to probe with yet: the next step's
        start = self.now()
        agreements = self.check.baseline(step, *await self.probes.scores(self._probe))
        self._record_verified(agreements, baseline=True)
        rec.verify_s += self.now() - start

    async def verify(self, step: int, rec: StepRecord) -> None:
        """After step ``step``'s refit, when due (``refit.verify_first_steps``,
        ``verify_every_steps``) and once the baseline was measured: every generator's
        logprobs of the probe batch against the trainer's, judged into ``rec.verify``."""
        cfg = self.config.refit
        if self.check.started and verification_due(
            step + 1, cfg.verify_first_steps, cfg.verify_every_steps
        ):
            start = self.now()
            assert self._probe is not None
            rec.verify = self.check.judge(step + 1, *await self.probes.scores(self._probe))
            self._record_verified(rec.verify)
            rec.verify_s += self.now() - start

    def _record_verified(self, agreements: list[Agreement], *, baseline: bool = False) -> None:
        """A record per generator, ``refit_verify`` (a judged refit) or ``refit_baseline``
        (before any update), and a log line."""
        kind = "refit_baseline" if baseline else "refit_verify"
        for a in agreements:
            if self.metrics is not None:
                self.metrics.write({"kind": kind, **a.metrics(), "time": self.now()})
            log.info("refit_baseline" if baseline else "refit_verified", **a.metrics())

    @staticmethod
    def check_verified(rec: StepRecord) -> None:
        """Stop the run if a generator disagreed with the trainer in ``rec.verify``."""
        for agreement in rec.verify:
            agreement.check()


def _mini_step_record(epoch: int, index: int, results: list[Any], finish: Any) -> dict[str, Any]:
    """One optimizer step of a mini-batched RL step, for the step's ``mini_steps`` list."""
    tokens = sum(r.num_loss_tokens for r in results)
    return {
        "epoch": epoch, "mini_batch": index, "loss": finish.loss, "grad_norm": finish.grad_norm,
        "clip_frac": sum(r.clipped_tokens for r in results) / max(tokens, 1), "tokens": tokens,
        "seconds": finish.seconds,
    }  # fmt: skip


def normalizer(config: Config, sequences: int) -> float:
    """``FinishStep.normalizer`` for ``loss.aggregation``: 0 (the trained tokens) for
    ``token_mean``; the step's trained sequences for ``sequence_mean``; those times
    ``loss.aggregation_constant`` (or ``grpo.max_new_tokens``) for ``constant``."""
    loss = config.loss
    if loss.aggregation == "sequence_mean":
        return float(sequences)
    if loss.aggregation == "constant":
        return float(sequences * (loss.aggregation_constant or config.grpo.max_new_tokens))
    return 0.0
