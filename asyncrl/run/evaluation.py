"""Held-out evaluation: greedy samples of the eval split on the generators' current weights.

Evaluation requests are tagged (group ids ``eval-<label>-<i>``) and go to the same engines as
training; the rollout book keeps them (:meth:`~asyncrl.run.book.RolloutBook.add_evals`), their
samples come back on the data socket like any other, and the feeder hands each scored group
here (:meth:`Evaluator.scored`) instead of to the scheduler, so they never reach a training
batch. The book owns the requests (which wait for a worker, which are on one); the evaluator
owns the results (which groups of each evaluation are scored, which were correct).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import structlog

from asyncrl.environment import Environment
from asyncrl.data.prompts import Tokenizer
from asyncrl.errors import RunError
from asyncrl.run.context import RunContext

if TYPE_CHECKING:
    from asyncrl.run.episodes import EpisodeRunner
from asyncrl.run.restarts import send_generate
from asyncrl.wire.messages import GenRequest

__all__ = ["Evaluator"]

log = structlog.get_logger("asyncrl.run.evaluation")


class _Results:
    """One evaluation's results as its groups are scored: which are outstanding, whether
    each sample was correct, how many groups failed to score."""

    def __init__(self, group_ids: list[str]) -> None:
        self.outstanding = set(group_ids)
        self.correct: list[bool] = []
        self.failed = 0
        self.done = anyio.Event()
        if not group_ids:
            self.done.set()

    def add(self, group_id: str, correct: list[bool], *, failed: bool = False) -> bool:
        """``group_id``'s samples' correctness (``failed``: its scoring failed), if it is one
        of this evaluation's groups still outstanding (whether it was)."""
        if group_id not in self.outstanding:
            return False
        self.outstanding.remove(group_id)
        self.correct += correct
        self.failed += failed
        if not self.outstanding:
            self.done.set()
        return True


class Evaluator:
    """Runs held-out evaluations through the run's engines; the rollout book keeps their
    requests, ``serving()`` says which workers serve."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        environment: Environment,
        tokenizer: Tokenizer,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.config, self.control, self.book = ctx.config, ctx.control, ctx.book
        self.serving, self.metrics, self.now = ctx.serving, ctx.metrics, ctx.now
        self.episodes = episodes
        """A multi-turn environment's runner: it evaluates by running greedy episodes."""
        self.env = environment
        self.tok = tokenizer
        self.records: list[dict[str, Any]] = []
        """Every evaluation of the run, in order."""
        self._running: anyio.Event | None = None
        self._open: dict[str, _Results] = {}
        """The results of each evaluation under way, by label."""

    async def evaluate(self, label: str, version: int) -> dict[str, Any]:
        """Greedy held-out accuracy of weights ``version``, which the generators serve
        (nothing else should be generating). A group whose scoring failed under
        ``failures.on_reward_error = "drop_group"`` counts as incorrect.

        Raises:
            RunError: its groups were not all scored within ``cluster.call_timeout_s``.

        Cancellation: outstanding eval groups are abandoned.
        """
        n = self.config.eval.num_prompts
        prompts = list(self.env.dataset("eval"))[:n]
        if self.episodes is not None:
            return self._record(label, version, len(prompts),
                                *await self._episodes(label, prompts))  # fmt: skip
        ids = await anyio.to_thread.run_sync(self.tok.encode_prompts, prompts)
        gids = self.book.add_evals(label, list(zip(prompts, ids)), version, self.now())
        results = self._open[label] = _Results(gids)
        start = self.now()
        try:
            with anyio.move_on_after(self.config.cluster.call_timeout_s):
                await self.resend()
                await results.done.wait()
            if not results.done.is_set():
                raise self._timed_out(label, results, len(gids))
        finally:
            self.book.drop_evals(gids)
            del self._open[label]
        return self._record(label, version, len(prompts), results.correct, results.failed, start)

    async def _episodes(
        self, label: str, prompts: list[Any]
    ) -> tuple[list[bool], int, float, dict[str, float]]:
        """One greedy episode per prompt (a failed one counts as incorrect), bounded as the
        single-turn evaluation is: correctness, failures, when it started, and each score
        component's mean over the scored episodes (``reward/<name>``, as a step's record has:
        e.g. an environment's tool-call rate)."""
        assert self.episodes is not None
        start = self.now()
        with anyio.move_on_after(self.config.cluster.call_timeout_s) as scope:
            scores = await self.episodes.evaluate(label, prompts)
        if scope.cancelled_caught:
            raise RunError(
                f"evaluation {label!r}: its {len(prompts)} episodes did not end within "
                f"{self.config.cluster.call_timeout_s:g} s (cluster.call_timeout_s); workers "
                f"serving: {', '.join(self.serving()) or 'none'}. Fix: raise "
                "cluster.call_timeout_s, or lower eval.num_prompts or episode.deadline_s"
            )
        correct = [s is not None and bool(s.correct) for s in scores]
        scored = [s for s in scores if s is not None]
        names = sorted({k for s in scored for k in s.components})
        components = {f"reward/{k}": float(np.mean([s.components.get(k, 0.0) for s in scored]))
                      for k in names}  # fmt: skip
        return correct, sum(s is None for s in scores), start, components

    def _record(
        self, label: str, version: int, num_prompts: int, correct: list[bool], failed: int,
        start: float, components: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        record = {
            "kind": "eval",
            "label": label,
            "version": version,
            "accuracy": float(np.mean(correct)) if correct else 0.0,
            "num_prompts": num_prompts,
            "failed_groups": failed,
            "seconds": self.now() - start,
            "start": start,
            "end": self.now(),
            **(components or {}),
        }
        if self.metrics is not None:
            self.metrics.write(record)
        log.info("eval_finished", **{k: v for k, v in record.items() if k != "kind"})
        self.records.append(record)
        return record

    def _timed_out(self, label: str, results: _Results, total: int) -> RunError:
        """The error of an evaluation not finished in time: which, what is missing, who
        serves, and the setting."""
        missing = sorted(results.outstanding)
        serving = self.serving()
        return RunError(
            f"evaluation {label!r}: {len(missing)} of its {total} groups were not generated "
            f"and scored within {self.config.cluster.call_timeout_s:g} s "
            f"(cluster.call_timeout_s); outstanding: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; rollout workers serving: "
            f"{', '.join(serving) if serving else 'none (every one is restarting)'}. Fix: see "
            "the rollout workers' logs; raise cluster.call_timeout_s if the engines are just "
            "slow, or lower eval.num_prompts"
        )

    def scored(self, group_id: str, samples: list[Any]) -> None:
        """An evaluation group's samples are scored (the feeder's call; one whose
        evaluation was abandoned is ignored)."""
        self._add(group_id, [s.correct for s in samples], failed=False)

    def score_failed(self, group_id: str, n: int) -> None:
        """Scoring an evaluation group of ``n`` samples failed (``failures.on_reward_error =
        "drop_group"``): its samples count as incorrect."""
        self._add(group_id, [False] * n, failed=True)

    def _add(self, group_id: str, correct: list[bool], *, failed: bool) -> None:
        for results in self._open.values():  # one or two evaluations at most
            if results.add(group_id, correct, failed=failed):
                return

    async def resend(self) -> None:
        """Send the evaluation groups waiting for a worker over the workers that serve, to
        all of them at once (with none serving, they wait for the next call: a worker back).
        Cancellation: the calls are abandoned; the groups stay placed."""
        placed = self.book.place_evals(self.serving())
        cfg = self.config
        by_worker = {
            worker: [
                GenRequest(group_id=s.group_id, prompt_ids=s.prompt_ids, n=s.n,
                           max_tokens=cfg.grpo.max_new_tokens, temperature=0.0, greedy=True)
                for s in sent
            ]  # fmt: skip
            for worker, sent in placed.items()
        }
        await send_generate(self.control, by_worker)

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
