"""Where rewards are scored: a complete group's samples decoded and passed to the environment's
``score()`` (or ``score_async()``), each call under ``failures.reward_timeout_s``, in a worker
thread or, for an environment that proves cheap and says it is safe, on the event loop
(:class:`Scorer`). The feeder (:mod:`asyncrl.run.intake`) hands it each complete group and
commits what it returns.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from asyncrl.data.deadlines import AbandonedThreadsError, CallClock, Overdue, clocked, in_thread
from asyncrl.data.prompts import Tokenizer
from asyncrl.env.capabilities import EnvironmentParts, check_environment
from asyncrl.environment import Environment, Prompt
from asyncrl.errors import RunError
from asyncrl.policy.groups import CompletedSample, Group

__all__ = ["ScoreError", "ScoreTimeout", "Scorer", "score_samples"]

INLINE_SCORE_MAX_S = 0.0005
"""An environment with ``score_on_loop = True`` has its groups scored on the event loop while
scoring one costs less than this on average (a slow environment goes to worker threads,
keeping the loop's lag in check)."""

ASYNC_SCORE_CONCURRENCY = 64
"""``score_async`` calls in flight at once (over all groups) for an async environment."""



class ScoreError(RunError):
    """The environment's ``score()`` (or ``score_async()``) raised or returned a non-finite
    reward."""


class ScoreTimeout(ScoreError):
    """A ``score()`` / ``score_async()`` call did not return within
    ``failures.reward_timeout_s`` (the message names the call, what ran inside it, the prompt
    and the deadline)."""


def score_samples(
    env: Environment,
    tok: Tokenizer,
    env_name: str,
    prompt: Prompt,
    samples: list[Any],
    clock: CallClock | None = None,
) -> list[CompletedSample]:
    """Decode and score each sample with ``score()`` (in a worker thread, or inline); each
    ``score()`` call restarts ``clock`` (its deadline counts from then).

    Raises:
        ScoreError: ``score()`` raised or returned a non-finite reward (naming the
            environment, the prompt and the completion).
    """
    out = []
    for i, s in enumerate(samples):
        completion = tok.decode(s.token_ids)
        if clock is not None:
            clock.restart(i)
        try:
            score = env.score(prompt, completion)
        except Exception as exc:
            raise _raised(env_name, "score", prompt, completion, exc) from exc
        out.append(_completed(env_name, "score", prompt, completion, s, score))
    return out


def _raised(
    env_name: str, method: str, prompt: Prompt, completion: str, exc: Exception
) -> ScoreError:
    return ScoreError(
        f"environment {env_name!r} (environment.name): {method}() raised "
        f"{type(exc).__name__}: {exc} for prompt {prompt.id!r} and completion "
        f"{completion[:80]!r}"
    )


def _late(
    env_name: str, method: str, prompt: Prompt, completion: str, late: Overdue, fate: str
) -> ScoreTimeout:
    inside = f", stuck in {', '.join(late.running)}" if late.running else ""
    return ScoreTimeout(
        f"environment {env_name!r} (environment.name): {method}() did not return within "
        f"{late.timeout_s:g} s (failures.reward_timeout_s) for prompt {prompt.id!r} and "
        f"completion {completion[:80]!r}{inside}; {fate}. Fix: make it return (a timeout on "
        "its network calls, a bound on its loops), or raise failures.reward_timeout_s"
    )


def _completed(
    env_name: str, method: str, prompt: Prompt, completion: str, sample: Any, score: Any
) -> CompletedSample:
    """The sample with its checked score (a ``ScoreError`` for a non-finite reward)."""
    try:
        reward = float(score.reward)
        components = {str(k): float(v) for k, v in getattr(score, "components", {}).items()}
    except Exception as exc:
        raise _raised(env_name, method, prompt, completion, exc) from exc
    if not math.isfinite(reward):
        raise ScoreError(
            f"environment {env_name!r} (environment.name): {method}() returned a non-finite "
            f"reward ({reward}) for prompt {prompt.id!r} and completion "
            f"{completion[:80]!r}; rewards must be finite numbers"
        )
    return CompletedSample(
        sample.token_ids,
        sample.logprobs,
        sample.finish_reason,
        reward,
        bool(score.correct),
        components,
        versions=sample.versions,
    )


class Scorer:
    """Scores complete groups, each ``score()`` / ``score_async()`` call under a deadline
    (``timeout_s``, ``failures.reward_timeout_s``): a call past it fails its group with a
    :class:`ScoreTimeout`.

    ``score()`` runs on a daemon thread (:func:`asyncrl.data.deadlines.in_thread`; the thread of a
    call past its deadline is abandoned), or on the event loop itself while the environment
    proves cheap *and* says that is safe (``score_on_loop = True``): a thread hop costs 2-14
    ms of latency on a loaded 2-core host for 0.06 ms of arithmetic scoring. No deadline can
    stop a call on the loop, and one that hangs there stops the whole controller, so only an
    environment that promises its ``score()`` always returns at once (pure arithmetic on the
    completion: no I/O, no locks, no user code) is called there, never the ``dataset``
    environment's reward functions. The choice follows a moving average of the measured cost
    of the scoring itself (not of the hop); the first group always goes to a thread.

    An environment with ``async def score_async(prompt, completion)`` is never cheap: its
    groups go to :meth:`threaded`, which awaits ``score_async`` on the event loop for all of a
    group's samples at once (at most :data:`ASYNC_SCORE_CONCURRENCY` calls in flight over all
    groups, each cancelled at its deadline) instead of calling ``score``.

    The environment's optional capabilities (``score_async``, ``score_on_loop``) are checked
    once, here (:func:`~asyncrl.env.capabilities.check_environment`; ``parts``, when the
    caller has checked them already), and never looked up again.

    Raises:
        PluginError: one is of the wrong kind, or the environment has no way to score (no
            ``score``, ``score_async`` or ``run_episode``), naming it and the method.
    """

    def __init__(
        self,
        env: Environment,
        tok: Tokenizer,
        env_name: str,
        *,
        timeout_s: float,
        parts: EnvironmentParts | None = None,
    ) -> None:
        if parts is None:
            parts = check_environment(env, env_name, scored=True)
        self._args = (env, tok, env_name)
        self._timeout_s = timeout_s
        self._limiter = anyio.CapacityLimiter(4)
        self._cost_s = float("inf")  # unknown until measured: the first group uses a thread
        self._scored = 0
        self._spent_s = 0.0  # scoring time since take_spent()
        self._on_loop = parts.score_on_loop
        self._score_async = parts.score_async
        self._async_limiter = anyio.CapacityLimiter(ASYNC_SCORE_CONCURRENCY)

    @property
    def cheap(self) -> bool:
        return self._on_loop and self._score_async is None and self._cost_s < INLINE_SCORE_MAX_S

    async def score(self, group: Group) -> list[CompletedSample]:
        """Score a group inline while the environment is :attr:`cheap`, else
        :meth:`threaded` (raising as it does)."""
        return self.inline(group) if self.cheap else await self.threaded(group)

    def inline(self, group: Group) -> list[CompletedSample]:
        """Score a group on the calling thread, with no deadline (see the class docstring)."""
        samples, cost = self._timed(group, None)
        self._note(cost)
        return samples

    async def threaded(self, group: Group) -> list[CompletedSample]:
        """Score a group off the inline path: ``score_async`` awaited for its samples
        concurrently when the environment has it, else ``score`` on a daemon thread, each
        call under the deadline. Cancellation: awaited scores are cancelled; a thread is
        abandoned.

        Raises:
            ScoreError: as :func:`score_samples` (the first failing sample's).
            ScoreTimeout: a call did not return within ``timeout_s``.
            AbandonedThreadsError: too many calls abandoned past their deadline still run.
        """
        if self._score_async is not None:
            return await self._awaited(group)
        clock = CallClock()
        try:
            samples, cost = await in_thread(
                self._timed,
                group,
                clock,
                limiter=self._limiter,
                clock=clock,
                timeout_s=self._timeout_s,
            )
        except Overdue as late:
            completion = self._args[1].decode(group.samples[late.call].token_ids)
            fate = "its thread was abandoned (a thread cannot be stopped)"
            raise _late(self._args[2], "score", group.prompt, completion, late, fate) from None
        self._note(cost)
        return samples

    async def _awaited(self, group: Group) -> list[CompletedSample]:
        env_name, prompt = self._args[2], group.prompt
        completions = [self._args[1].decode(s.token_ids) for s in group.samples]
        scores: list[Any] = [None] * len(completions)
        failed: list[tuple[int, Exception]] = []

        async def one(i: int) -> None:
            async with self._async_limiter:
                clock = CallClock()  # its deadline counts from here, not from the queue
                try:
                    with clocked(clock), anyio.move_on_after(self._timeout_s) as deadline:
                        score = self._score_async(prompt, completions[i])  # type: ignore[misc]
                        scores[i] = await score
                except Exception as exc:  # the first failing sample's is raised below
                    failed.append((i, exc))
                    tg.cancel_scope.cancel()
                    return
                if deadline.cancelled_caught:
                    late = clock.overdue(self._timeout_s)
                    args = ("score_async", prompt, completions[i], late, "it was cancelled")
                    failed.append((i, _late(env_name, *args)))
                    tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for i in range(len(completions)):
                tg.start_soon(one, i)
        if failed:
            i, exc = min(failed, key=lambda f: f[0])
            if isinstance(exc, (ScoreTimeout, AbandonedThreadsError)):
                raise exc
            raise _raised(env_name, "score_async", prompt, completions[i], exc) from exc
        return [
            _completed(env_name, "score_async", prompt, c, s, score)
            for c, s, score in zip(completions, group.samples, scores)
        ]

    def _timed(
        self, group: Group, clock: CallClock | None
    ) -> tuple[list[CompletedSample], float]:
        start = time.perf_counter()
        samples = score_samples(*self._args, group.prompt, group.samples, clock)
        return samples, time.perf_counter() - start

    def _note(self, cost: float) -> None:
        self._cost_s = 0.8 * self._cost_s + 0.2 * cost if self._scored else cost
        self._scored += 1
        self._spent_s += cost

    def take_spent(self) -> float:
        """Seconds spent in ``score`` (inline or on threads; ``score_async`` is not timed)
        since the last call: a step record's ``score_s``."""
        spent, self._spent_s = self._spent_s, 0.0
        return spent
