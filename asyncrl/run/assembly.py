"""One optimizer step on the trainer ranks, assembled from the scheduler's chunks.

::

    next_chunk() ─► evictions ─► ready groups ─► BeginStep (first chunk) ─► TrainChunk per chunk
                                                                          ─► FinishStep

The step streams in: each chunk is packed, sharded over the trainer ranks and trained as soon
as the scheduler hands it out; gradients are normalized once, by the step's token count, at
``FinishStep``. A train call that raises on a trainer rank (the worker lives on; the trainer
drops the step's gradients) gives the step's groups back to the buffer and the step is
assembled and trained again, within ``failures.train_step_retries`` (:mod:`asyncrl.policy.failures`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from asyncrl.run.groups import Group
from asyncrl.config import Config
from asyncrl.errors import NonFiniteError, RemoteCallError, RunError, flatten
from asyncrl.policy.failures import FailureBudget
from asyncrl.policy.grpo import nonfinite_cause, pack_groups, shard_batch
from asyncrl.run.intake import Signal
from asyncrl.wire.messages import BeginStep, FinishStep, TrainChunk
from asyncrl.wire.rpc import ControlPlane
from asyncrl.policy.schedule import Scheduler
from asyncrl.obs.steps import StepRecord

__all__ = ["StepAssembler"]

log = structlog.get_logger("asyncrl.run.assembly")


class _StepFailed(Exception):
    """A train call raised on a trainer rank (which dropped the step's gradients)."""

    def __init__(self, error: RemoteCallError) -> None:
        super().__init__(str(error))
        self.error = error


class StepAssembler:
    """Trains steps for the train pump. ``ready`` is the pipeline's table of complete,
    scored groups by id (shared: groups leave it when trained, come back if a step fails)."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        trainers: list[str],
        scheduler: Scheduler,
        ready: dict[str, Group],
        committed: Signal,
        changed: Signal,
        failures: FailureBudget,
        now: Callable[[], float],
        weights: anyio.Lock,
    ) -> None:
        self.config = config
        self.control = control
        self.trainers = trainers
        self.sched = scheduler
        self.ready = ready
        self.committed = committed
        self.changed = changed
        self.failures = failures
        self.now = now
        self.weights = weights

    async def train(
        self, step: int, rec: StepRecord, before_finish: Callable[[StepRecord], Awaitable[None]]
    ) -> list[Any]:
        """Train step ``step`` (retrying it as the failure budget allows); returns the
        trainers' ``StepResult``s. The scheduler's step is complete, not yet finished.

        ``before_finish(rec)`` is awaited before the ``FinishStep`` call and must take the
        pipeline's weights lock: this releases it if ``FinishStep`` fails, the caller once
        the new weights are published."""
        while True:
            try:
                finish = await self._train_step(step, rec, before_finish)
                break
            except _StepFailed as exc:
                if not self.failures.step_failed(step, str(exc.error).splitlines()[0]):
                    raise RunError(
                        f"step {step} failed {self.failures.step_failures} times "
                        f"(failures.train_step_retries = "
                        f"{self.config.failures.train_step_retries}); the last: {exc.error}"
                    ) from exc.error
                # the trainers dropped the step's gradients; its groups are ready again
                taken = {g.group_id: g for g in rec.groups}
                for gid in self.sched.abort_step():
                    self.ready[gid] = taken[gid]
                rec.restart()
                self.committed.notify()
        self.failures.step_done()
        self._check_finite(step, rec, finish)
        return finish

    def _check_finite(self, step: int, rec: StepRecord, finish: list[Any]) -> None:
        """A step whose loss or gradient norm is not finite was not applied by the trainers:
        skip it within ``failures.max_nonfinite_steps``, else stop the run naming the likely
        cause (the weights lock ``FinishStep`` took is released: no refit follows)."""
        bad = [r for r in finish if not (math.isfinite(r.loss) and math.isfinite(r.grad_norm))]
        if not bad:
            return
        loss, grad_norm = bad[0].loss, bad[0].grad_norm
        if self.failures.nonfinite_step(step, loss, grad_norm):
            rec.nonfinite_skipped = True
            return
        self.weights.release()
        budget = (
            f"; {self.failures.nonfinite_steps} such steps, failures.max_nonfinite_steps = "
            f"{self.config.failures.max_nonfinite_steps}"
        )
        raise NonFiniteError(
            nonfinite_cause(
                step, loss, grad_norm, rec.groups,
                normalize=self.config.grpo.normalize_advantages, budget=budget,
            )
        )  # fmt: skip

    async def _train_step(
        self, step: int, rec: StepRecord, before_finish: Callable[[StepRecord], Awaitable[None]]
    ) -> list[Any]:
        """Open step ``step`` on the trainers, train it chunk by chunk as the scheduler hands
        out groups, and take the optimizer step; returns the trainers' ``StepResult``s.

        Raises:
            _StepFailed: a train call raised on a trainer (the worker lives on).
        """
        cfg = self.config
        opened = False
        while self.sched.taken < cfg.grpo.prompts_per_step:
            chunk = self.sched.next_chunk()
            for gid in chunk.evicted:
                self.ready.pop(gid)
                log.info("group_evicted", group_id=gid, step=step)
            if chunk.evicted or chunk.groups:
                self.changed.notify()  # capacity freed: the rollout pump may dispatch
            if not chunk.groups:
                t = self.now()
                await self.committed.wait()  # only a commit can make a chunk possible
                rec.waited(t, self.now())
                continue
            groups = [self.ready.pop(gid) for gid in chunk.groups]
            rec.groups += groups  # before any await: a failed step gives them back
            if not opened:
                rec.train_start = self.now()
                log.debug("step_started", step=step)
                await self._train_call([BeginStep(step=step)] * len(self.trainers))
                opened = True
            batch = pack_groups(
                groups, normalize=cfg.grpo.normalize_advantages, environment=cfg.environment.name
            )
            shards = shard_batch(batch, len(self.trainers))
            await anyio.lowlevel.checkpoint()  # ~1 ms of packing: let samples in
            busy = self.now()
            results = await self._train_call([TrainChunk(step=step, batch=x) for x in shards])
            rec.train_busy_s += self.now() - busy
            rec.chunk_results += results  # type: ignore[arg-type]
            rec.chunks += 1
        num_tokens = sum(r.num_loss_tokens for r in rec.chunk_results)
        await before_finish(rec)
        busy = self.now()
        try:
            finish = await self._train_call(
                [FinishStep(step=step, num_loss_tokens=num_tokens)] * len(self.trainers)
            )
        except BaseException:
            self.weights.release()
            raise
        rec.train_end = self.now()
        rec.train_busy_s += rec.train_end - busy
        return finish

    async def _train_call(self, requests: list[Any]) -> list[Any]:
        """One request to each trainer rank; a call that raised there is a :class:`_StepFailed`
        (the others' calls were abandoned here; the trainers serve calls in order)."""
        try:
            return await self.control.call_each(
                self.trainers, requests, timeout_s=self.config.cluster.call_timeout_s
            )
        except Exception as exc:
            leaves = [e for e in flatten(exc) if not isinstance(e, anyio.get_cancelled_exc_class())]
            if leaves and all(isinstance(e, RemoteCallError) for e in leaves):
                raise _StepFailed(leaves[0]) from exc
            raise
