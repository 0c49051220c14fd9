"""Score fixed token sequences on the engines and on the trainer: the logprobs behind refit
verification and behind ``Controller.generator_logprobs`` / ``trainer_logprobs``."""

from __future__ import annotations

from collections.abc import Callable
import anyio
import numpy as np

from asyncrl.errors import WorkerRestarting
from asyncrl.policy.grpo import shard_tokens
from asyncrl.wire.messages import ComputeLogprobs, LogprobsResult, ScoreTokens, TokenBatch
from asyncrl.wire.rpc import ControlPlane

__all__ = ["Probes"]


class Probes:
    """Logprob queries over the control plane (each call bounded by ``timeout_s``).

    ``serving()``: the rollout workers that serve now (those :meth:`agreement` scores);
    ``workers``: every rollout worker, in rank order (the order of its results).
    """

    def __init__(
        self,
        control: ControlPlane,
        trainers: list[str],
        *,
        serving: Callable[[], list[str]],
        workers: list[str],
        timeout_s: float,
    ) -> None:
        self.control = control
        self.trainers = trainers
        self.serving = serving
        self.workers = workers
        self.timeout_s = timeout_s

    async def generator_logprobs(
        self, batch: TokenBatch, *, worker: str, temperature: float = 1.0
    ) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under one generator's current weights."""
        result = await self.control.call(
            worker, ScoreTokens(batch=batch, temperature=temperature), timeout_s=self.timeout_s
        )
        assert isinstance(result, LogprobsResult)
        return np.asarray(result.logprobs, np.float32)

    async def trainer_logprobs(
        self, batch: TokenBatch, *, temperature: float = 1.0, policy: str = "current"
    ) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under the trainer's current weights, those
        weights as sent to the generators (``policy = "sent"``: rounded to ``model.dtype``), or
        its reference policy (``policy = "reference"``); sequences are sharded over the
        trainer ranks and reassembled in order."""
        shards = shard_tokens(batch, len(self.trainers))
        results = await self.control.call_each(
            self.trainers,
            [ComputeLogprobs(batch=shard, temperature=temperature, policy=policy)
             for shard in shards],
            timeout_s=self.timeout_s,
        )  # fmt: skip
        return np.concatenate([np.asarray(r.logprobs, np.float32) for r in results])  # type: ignore[union-attr]

    async def scores(self, batch: TokenBatch) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``batch``'s logprobs on every serving generator (in rank order) and on the trainer's
        weights as sent to them (``policy = "sent"``), scored concurrently: the refit check's evidence. A generator restarting, or that dies
        meanwhile, is left out (a restarted worker is refitted alone and not verified).
        Cancellation: the outstanding calls are abandoned."""
        results: dict[str, np.ndarray] = {}

        async def generator(worker: str) -> None:
            try:
                results[worker] = await self.generator_logprobs(batch, worker=worker)
            except WorkerRestarting:
                pass  # it died meanwhile: left out (its restart refits it, unverified)

        async def trainer() -> None:
            results[""] = await self.trainer_logprobs(batch, policy="sent")

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            for worker in self.serving():
                tg.start_soon(generator, worker)
        trainer_logprobs = results.pop("")
        return {w: results[w] for w in self.workers if w in results}, trainer_logprobs
