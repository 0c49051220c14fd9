"""One optimizer step on the trainer ranks, assembled from the train phase's chunks (then
published to the generators by :class:`asyncrl.run.refit.Publisher`).

::

    StepAssembler.train():  training.next_chunk() ─► evictions ─► ready groups ─► BeginStep (first
                            chunk) ─► TrainChunk per chunk
    ── the caller takes the weights lock ──
    StepAssembler.finish(): FinishStep
    Publisher.publish():    the refit (asyncrl/run/refit.py)
    ── the caller releases it ──

The step streams in: each chunk is packed, sharded over the trainer ranks and trained as soon
as the train phase hands it out; gradients are normalized once, by the step's count of trained
tokens (those its batches' ``loss_mask`` selects, as the trainers counted them in their
``ChunkResult`` s), at ``FinishStep``. A train call that raises on a trainer rank (the worker
lives on; the trainer drops the step's gradients) gives the step's groups back to the buffer
and the step is assembled and trained again, within
:data:`~asyncrl.policy.failures.TRAIN_STEP_RETRIES` (:mod:`asyncrl.policy.failures`).

The step's :class:`~asyncrl.obs.steps.TrainRecord` (its chunks, the trainer's time and waits,
what the refreshes measured) is this module's alone: opened by :meth:`StepAssembler.train`,
written only here, and handed over with the trainers' results by :meth:`StepAssembler.finish`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import msgspec
import numpy as np
import structlog

from asyncrl.config import Config
from asyncrl.errors import NonFiniteError, RemoteCallError, RunError, flatten
from asyncrl.obs.steps import Mismatch, TrainRecord
from asyncrl.policy import failures as failure_policy
from asyncrl.policy.groups import Group
from asyncrl.policy.grpo import (
    concat_batches,
    mini_batches,
    nonfinite_cause,
    pack_groups,
    per_sequence_mean,
    shard_batch,
    trained_per_sequence,
)
from asyncrl.run.context import RunContext
from asyncrl.run.refresh import Refreshed, Refresher
from asyncrl.wire.messages import (
    BeginStep,
    FinishStep,
    TrainBatch,
    TrainChunk,
)

__all__ = ["StepAssembler", "Trained", "normalizer"]

log = structlog.get_logger("asyncrl.run.train_step")


class _StepFailed(Exception):
    """A train call raised on a trainer rank (which dropped the step's gradients)."""

    def __init__(self, error: RemoteCallError) -> None:
        super().__init__(str(error))
        self.error = error


class Trained(NamedTuple):
    """A step whose optimizer step was taken (:meth:`StepAssembler.finish`)."""

    results: list[Any]
    """The trainers' ``StepResult`` s."""
    record: TrainRecord
    """The step's training, handed over: the assembler no longer holds it."""


class StepAssembler:
    """Trains steps for the train pump from the train phase's chunks."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        before_training: Callable[[int, Sequence[Group]], Awaitable[None]] | None = None,
        before_finish: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        config = self.config = ctx.config
        self.control, self.trainers = ctx.control, ctx.trainers
        self.groups, self.training = ctx.groups, ctx.training
        self.committed, self.changed = ctx.committed, ctx.changed
        self.failures, self.now = ctx.failures, ctx.now
        probes, now = ctx.probes, ctx.now
        self._before_training = before_training
        """Called with a step's first chunk's groups in, before the trainers train any of it
        (the refit check's baseline: :meth:`Publisher.baseline`)."""
        self._before_finish = before_finish
        """Awaited once a step has all its groups in, before :meth:`finish` may take the
        weights (a validation of the weights the step's refit replaces): a wait of the
        trainer's, recorded with its others."""
        self._open: TrainRecord | None = None
        """The step being trained, until :meth:`finish` hands it over (a step that failed
        on a trainer is trained again into it)."""
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

    async def train(self, step: int) -> None:
        """Train step ``step`` chunk by chunk until it has all its groups (not yet
        finished), then wait for ``before_finish``; a step that fails on a trainer is
        assembled again. Cancellation: the step is abandoned (the run is over).

        Raises:
            RunError: the step failed more often than ``TRAIN_STEP_RETRIES`` allows.
        """
        if self._open is None:
            self._open = TrainRecord()
        rec = self._open
        while True:
            try:
                await self._train_chunks(step, rec)
                break
            except _StepFailed as exc:
                self._give_back(step, rec, exc)
        if self._before_finish is not None:
            t = self.now()
            await self._before_finish()
            rec.waited(t, self.now())

    async def finish(self, step: int) -> Trained | None:
        """Take the optimizer step of the trained step ``step`` (``FinishStep``); the caller
        holds the weights. Returns the trainers' ``StepResult``s with the step's record, or
        ``None`` when the call failed on a trainer: the step's groups are ready again and
        the step must be trained again (:meth:`train`, then this).

        Raises:
            RunError: the step failed more often than ``TRAIN_STEP_RETRIES`` allows.
            NonFiniteError: a loss or gradient norm that is not finite, once
                ``failures.max_nonfinite_steps`` such steps were skipped.
        """
        rec = self._open
        assert rec is not None, "finish() before train()"
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
        self._open = None
        return Trained(finish, rec)

    async def _finish_step(
        self, step: int, rec: TrainRecord, results: list[Any], sequences: int
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

    async def _mini_steps(self, step: int, rec: TrainRecord) -> list[Any]:
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

    def _give_back(self, step: int, rec: TrainRecord, exc: _StepFailed) -> None:
        """A train call failed: the trainers dropped the step's gradients, so its groups are
        ready again (or the run stops, the retries spent)."""
        if not self.failures.step_failed(step, str(exc.error).splitlines()[0]):
            raise RunError(
                f"step {step} failed {self.failures.step_failures} times (asyncrl.policy."
                f"failures.TRAIN_STEP_RETRIES = {failure_policy.TRAIN_STEP_RETRIES}); the last: "
                f"{exc.error}"
            ) from exc.error
        self.training.abort_step()
        rec.restart()
        self.committed.notify()

    def _check_finite(self, step: int, rec: TrainRecord, finish: list[Any]) -> None:
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

    async def _train_chunks(self, step: int, rec: TrainRecord) -> None:
        """Open step ``step`` on the trainers and train it chunk by chunk as the train phase hands
        out groups, until it has ``grpo.prompts_per_step``.

        Raises:
            _StepFailed: a train call raised on a trainer (the worker lives on).
        """
        opened = False
        while self.groups.taken < self.config.grpo.prompts_per_step:
            chunk = self.training.next_chunk()
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
                await self._before_training(step, tuple(rec.groups))
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

    async def _pack(self, groups: list[Any], rec: TrainRecord) -> TrainBatch:
        """A chunk's groups as a refreshed :class:`TrainBatch` (``loss.aggregation``
        applied); its advantages, sequences and refresh counted in ``rec``."""
        cfg = self.config
        batch = pack_groups(groups, **self._advantage_options)
        if self.refresher.active:
            with _step_failures():  # a refresh that raised on a trainer: the step again
                batch, measured = await self.refresher.refresh(batch, groups)
            _add_refresh(rec, measured)
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


def _add_refresh(rec: TrainRecord, measured: Refreshed) -> None:
    """A chunk's refresh into its step's record: seconds by kind, the KL in the reward, the
    mismatch over the step's trained tokens so far."""
    for kind, seconds in measured.seconds.items():
        rec.refresh_s[kind] = rec.refresh_s.get(kind, 0.0) + seconds
    rec.kl_sum += measured.kl_sum
    rec.kl_tokens += measured.kl_tokens
    if measured.mismatch is not None:
        rec.mismatch = (rec.mismatch or Mismatch()).merged(measured.mismatch)


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
