"""Held-out evaluation: greedy samples of the eval split on the generators' current weights.

Each eval prompt is one question asked of the same engines as training (an answered request,
:mod:`asyncrl.run.asking`; a multi-turn environment's is a greedy episode, whose turns are),
scored as training scores its samples; nothing trains on them. The rollout phase owns the
requests in flight; the evaluator owns the results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import structlog

from asyncrl.data.prompts import Tokenizer
from asyncrl.environment import Environment, Prompt
from asyncrl.errors import RunError
from asyncrl.policy.groups import Group
from asyncrl.run.asking import Asker, Question, RequestFailed
from asyncrl.run.context import RunContext
from asyncrl.run.scoring import ScoreError, Scorer

if TYPE_CHECKING:
    from asyncrl.run.episodes import EpisodeRunner

__all__ = ["Evaluator"]

log = structlog.get_logger("asyncrl.run.evaluation")

_MISSING = object()
"""An eval prompt not generated and scored yet."""


class Evaluator:
    """Runs held-out evaluations through the run's engines."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        environment: Environment,
        tokenizer: Tokenizer,
        asker: Asker,
        scorer: Scorer,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.config, self.serving, self.metrics, self.now = ctx.config, ctx.serving, ctx.metrics, ctx.now
        self._prefix = ctx.id_prefix
        self.asker, self.scorer = asker, scorer
        self.episodes = episodes
        """A multi-turn environment's runner: it evaluates by running greedy episodes."""
        self.env = environment
        self.tok = tokenizer
        self.records: list[dict[str, Any]] = []
        """Every evaluation of the run, in order."""
        self._running: anyio.Event | None = None

    async def evaluate(self, label: str, version: int) -> dict[str, Any]:
        """Greedy held-out accuracy of weights ``version``, which the generators serve
        (nothing else should be generating). A prompt whose generation failed for good, or
        whose scoring failed under ``failures.on_reward_error = "drop_group"``, counts as
        incorrect (``failed_groups``); a multi-turn environment's record adds each score
        component's mean over the scored episodes (``reward/<name>``, as a step's record has:
        e.g. an environment's tool-call rate).

        Raises:
            RunError: it did not end within ``cluster.call_timeout_s``.
            ScoreError: a score failed under ``failures.on_reward_error = "fail_run"``.

        Cancellation: outstanding requests are abandoned (their workers told to abort them).
        """
        n = self.config.eval.num_prompts
        prompts = list(self.env.dataset("eval"))[:n]
        start, timeout = self.now(), self.config.cluster.call_timeout_s
        scores: list[Any] = [_MISSING] * len(prompts)
        with anyio.move_on_after(timeout) as scope:
            if self.episodes is not None:
                scores = await self.episodes.evaluate(label, prompts)
            else:
                await self._samples(label, prompts, version, scores)
        if scope.cancelled_caught:
            missing = [p.id for p, s in zip(prompts, scores) if s is _MISSING]
            raise RunError(
                f"evaluation {label!r}: {len(missing) if missing else 'some'} of its "
                f"{len(prompts)} prompts were not generated and scored within {timeout:g} s "
                f"(cluster.call_timeout_s); outstanding: {', '.join(missing[:5]) or '?'}"
                f"{' ...' if len(missing) > 5 else ''}; rollout workers serving: "
                f"{', '.join(self.serving()) or 'none (every one is restarting)'}. Fix: see the "
                "rollout workers' logs; raise cluster.call_timeout_s if the engines are just "
                "slow, or lower eval.num_prompts (or episode.deadline_s)"
            )
        correct = [s is not None and bool(s.correct) for s in scores]
        scored = [s for s in scores if s is not None]
        names = sorted({k for s in scored for k in s.components})
        components = {f"reward/{k}": float(np.mean([s.components.get(k, 0.0) for s in scored]))
                      for k in names}  # fmt: skip
        return self._record(label, version, len(prompts), correct,
                            sum(s is None for s in scores), start, components)  # fmt: skip

    async def _samples(
        self, label: str, prompts: list[Prompt], version: int, out: list[Any]
    ) -> None:
        """One greedy sample of each prompt, scored as training's are, into ``out``: each
        one's :class:`~asyncrl.policy.groups.CompletedSample`, or ``None`` if it failed."""
        ids = await anyio.to_thread.run_sync(self.tok.encode_prompts, prompts)
        max_tokens = self.config.grpo.max_new_tokens
        fatal: list[ScoreError] = []

        async def one(i: int) -> None:
            question = Question(f"{self._prefix}eval-{label}-{i}", 0, evaluation=True)
            try:
                sample, _ = await self.asker.ask(question, ids[i], max_tokens, 0.0)
            except RequestFailed as exc:
                log.warning("eval_request_failed", prompt=prompts[i].id, error=str(exc))
                out[i] = None
                return
            group = Group(question.group_id, prompts[i].id, ids[i], version, None, self.now(),
                          [sample], index=i, prompt_text=prompts[i].display, prompt=prompts[i])  # fmt: skip
            try:
                (out[i],) = await self.scorer.score(group)
            except ScoreError as exc:
                if self.config.failures.on_reward_error == "fail_run":
                    fatal.append(exc)  # raised as itself below, not in an exception group
                    tg.cancel_scope.cancel()
                    return
                log.error("reward_failed", group_id=group.group_id, error=str(exc),
                          action="counted as incorrect")  # fmt: skip
                out[i] = None

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        if fatal:
            raise fatal[0]

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
