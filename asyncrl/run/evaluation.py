"""Held-out evaluation: greedy samples of the eval split on the generators' current weights.

Evaluation requests are tagged (group ids ``eval-<label>-<i>``) and go to the same engines as
training; their samples come back on the data socket like any other, and the feeder hands
them here instead of to the scheduler, so they never reach a training batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import structlog

from asyncrl.config import Config
from asyncrl.environment import Environment
from asyncrl.run.intake import Generating
from asyncrl.wire.messages import Generate, GenRequest
from asyncrl.data.prompts import Tokenizer
from asyncrl.policy.pool import RolloutPool
from asyncrl.wire.rpc import ControlPlane

__all__ = ["Evaluator"]

log = structlog.get_logger("asyncrl.run.evaluation")


class Evaluator:
    """Runs held-out evaluations through the pipeline's engines.

    ``generating`` is the pipeline's table of groups whose samples are coming back: an
    evaluation registers its groups there for the feeder, which sets their ``eval_done``.
    """

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        environment: Environment,
        tokenizer: Tokenizer,
        pool: RolloutPool,
        generating: dict[str, Generating],
        metrics: Any,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.control = control
        self.env = environment
        self.tok = tokenizer
        self.pool = pool
        self.generating = generating
        self.metrics = metrics
        self.now = now
        self.records: list[dict[str, Any]] = []
        """Every evaluation of the run, in order."""
        self._running: anyio.Event | None = None
        self._waiting: list[tuple[str, Generating]] = []
        """Groups whose worker died, waiting for a worker that serves."""

    async def evaluate(self, label: str, version: int) -> dict[str, Any]:
        """Greedy held-out accuracy of weights ``version``, which the generators serve
        (nothing else should be generating). Cancellation: outstanding eval groups are
        abandoned."""
        n = self.config.eval.num_prompts
        prompts = list(self.env.dataset("eval"))[:n]
        ids = await anyio.to_thread.run_sync(self.tok.encode_prompts, prompts)
        groups = []
        for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
            pending = Generating(
                prompt, prompt_ids, "", 1, version, None, self.now(), eval_done=anyio.Event()
            )
            groups.append((f"eval-{label}-{i}", pending))
        waits = [pending for _, pending in groups]
        start = self.now()
        timeout = self.config.cluster.call_timeout_s
        try:
            await self.resend(groups)
            with anyio.fail_after(timeout):
                for pending in waits:
                    assert pending.eval_done is not None
                    await pending.eval_done.wait()
        finally:
            for gid, _ in groups:
                self.generating.pop(gid, None)
            self._waiting = [g for g in self._waiting if g[0] not in dict(groups)]
        correct = [s.correct for p in waits for s in p.samples]  # type: ignore[union-attr]
        record = {
            "kind": "eval",
            "label": label,
            "version": version,
            "accuracy": float(np.mean(correct)) if correct else 0.0,
            "num_prompts": len(prompts),
            "seconds": self.now() - start,
            "start": start,
            "end": self.now(),
        }
        if self.metrics is not None:
            self.metrics.write(record)
        log.info("eval_finished", **{k: v for k, v in record.items() if k != "kind"})
        self.records.append(record)
        return record

    async def resend(self, groups: list[tuple[str, Generating]]) -> None:
        """Send evaluation ``groups`` (by id) over the workers that serve, with those whose
        worker died before; with none serving, they wait for the next call (a worker back)."""
        self._waiting += groups
        serving = self.pool.serving
        if not serving or not self._waiting:
            return
        groups, self._waiting = self._waiting, []
        requests: dict[str, list[GenRequest]] = {}
        for i, (gid, pending) in enumerate(groups):
            pending.worker = serving[i % len(serving)]
            self.generating[gid] = pending
            requests.setdefault(pending.worker, []).append(
                GenRequest(
                    group_id=gid,
                    prompt_ids=pending.prompt_ids,
                    n=1,
                    max_tokens=self.config.grpo.max_new_tokens,
                    temperature=0.0,
                    greedy=True,
                )
            )
        timeout = self.config.cluster.call_timeout_s
        for worker, reqs in requests.items():  # one that died: its groups come back (worker_lost)
            await self.control.call_unless_restarting(
                worker, Generate(requests=reqs), timeout_s=timeout
            )

    def start_validation(
        self, tg: Any, version: int, on_record: Callable[[dict[str, Any]], None]
    ) -> None:
        """Evaluate weights ``version`` in ``tg`` while training goes on (call
        :meth:`wait_validation` before the generators' weights change); then hand the record
        to ``on_record`` in a worker thread."""
        done = self._running = anyio.Event()

        async def validate() -> None:
            try:
                record = await self.evaluate(f"step-{version}", version)
            finally:
                done.set()
                if self._running is done:
                    self._running = None
            await anyio.to_thread.run_sync(on_record, record)

        tg.start_soon(validate, name=f"validation-{version}")

    async def wait_validation(self) -> None:
        """Until the evaluation started by :meth:`start_validation` is done (if one runs)."""
        if self._running is not None:
            await self._running.wait()
