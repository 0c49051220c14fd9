"""Held-out evaluation: greedy samples of the eval split on the generators' current weights.

Evaluation requests are tagged (group ids ``eval-<label>-<i>``) and go to the same engines as
training; the rollout book keeps them (:meth:`~asyncrl.run.book.RolloutBook.add_evals`), their
samples come back on the data socket like any other, and the feeder hands each scored group
here (:meth:`Evaluator.scored`) instead of to the scheduler, so they never reach a training
batch.
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
from asyncrl.data.prompts import Tokenizer
from asyncrl.run.book import RolloutBook
from asyncrl.wire.messages import Generate, GenRequest
from asyncrl.wire.rpc import ControlPlane

__all__ = ["Evaluator"]

log = structlog.get_logger("asyncrl.run.evaluation")


class _Results:
    """One evaluation's scored groups as they come in."""

    def __init__(self, group_ids: list[str]) -> None:
        self.samples: dict[str, list[Any]] = {}
        self._expected = len(group_ids)
        self.done = anyio.Event()
        if not group_ids:
            self.done.set()

    def add(self, group_id: str, samples: list[Any]) -> None:
        self.samples[group_id] = samples
        if len(self.samples) == self._expected:
            self.done.set()


class Evaluator:
    """Runs held-out evaluations through the run's engines; the rollout book keeps their
    requests, ``serving()`` says which workers serve."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        environment: Environment,
        tokenizer: Tokenizer,
        book: RolloutBook,
        serving: Callable[[], list[str]],
        metrics: Any,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.control = control
        self.env = environment
        self.tok = tokenizer
        self.book = book
        self.serving = serving
        self.metrics = metrics
        self.now = now
        self.records: list[dict[str, Any]] = []
        """Every evaluation of the run, in order."""
        self._running: anyio.Event | None = None
        self._open: dict[str, _Results] = {}
        """The evaluation waiting for each evaluation group, by id."""

    async def evaluate(self, label: str, version: int) -> dict[str, Any]:
        """Greedy held-out accuracy of weights ``version``, which the generators serve
        (nothing else should be generating). Cancellation: outstanding eval groups are
        abandoned."""
        n = self.config.eval.num_prompts
        prompts = list(self.env.dataset("eval"))[:n]
        ids = await anyio.to_thread.run_sync(self.tok.encode_prompts, prompts)
        gids = self.book.add_evals(label, list(zip(prompts, ids)), version, self.now())
        results = _Results(gids)
        self._open.update(dict.fromkeys(gids, results))
        start = self.now()
        try:
            await self.resend()
            with anyio.fail_after(self.config.cluster.call_timeout_s):
                await results.done.wait()
        finally:
            self.book.drop_evals(gids)
            for gid in gids:
                self._open.pop(gid, None)
        correct = [s.correct for gid in gids for s in results.samples[gid]]
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

    def scored(self, group_id: str, samples: list[Any]) -> None:
        """An evaluation group's samples are scored (the feeder's call; one whose
        evaluation was abandoned is ignored)."""
        results = self._open.pop(group_id, None)
        if results is not None:
            results.add(group_id, samples)

    async def resend(self) -> None:
        """Send the evaluation groups waiting for a worker over the workers that serve (with
        none serving, they wait for the next call: a worker back)."""
        placed = self.book.place_evals(self.serving())
        timeout = self.config.cluster.call_timeout_s
        for worker, sent in placed.items():  # one that died: its groups come back (worker_lost)
            requests = [
                GenRequest(
                    group_id=s.group_id,
                    prompt_ids=s.prompt_ids,
                    n=s.n,
                    max_tokens=self.config.grpo.max_new_tokens,
                    temperature=0.0,
                    greedy=True,
                )
                for s in sent
            ]
            await self.control.call_unless_restarting(
                worker, Generate(requests=requests), timeout_s=timeout
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
