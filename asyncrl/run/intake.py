"""What comes in on the data socket: the feeder that hands each sample to the rollout book
(:mod:`asyncrl.run.book`), scores complete groups (off the event loop, or on it) and commits
them; and the wake-up signal the loops wait on.

::

    PULL ──► Feeder ──book.sample_arrived()──► stored │ rejected (counted) │ complete
                                                                            │ score (inline or thread)
                            evaluation group ◄── Evaluator.scored() ◄───────┤
                                                  book.commit() ◄───────────┘ ──► committed
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from asyncrl.config import Config
from asyncrl.data.deadlines import AbandonedThreadsError, CallClock, Overdue, clocked, in_thread
from asyncrl.data.prompts import Tokenizer
from asyncrl.environment import Environment, Prompt
from asyncrl.errors import ProtocolError, RunError
from asyncrl.obs.steps import StepRecord
from asyncrl.run import book as bk
from asyncrl.policy.groups import CompletedSample, Group
from asyncrl.wire.codec import Codec
from asyncrl.run.turns import Turn
from asyncrl.run.wake import Signal
from asyncrl.wire.messages import DataBatch, DataMessage, GroupFailed, Sample, SampleDone
from asyncrl.wire.transport import AsyncSocket, Rejections, peer_name

if TYPE_CHECKING:
    from asyncrl.run.evaluation import Evaluator
    from asyncrl.run.restarts import Redispatcher

__all__ = [
    "Feeder",
    "ScoreError",
    "ScoreTimeout",
    "Scorer",
    "score_samples",
]

INLINE_SCORE_MAX_S = 0.0005
"""An environment with ``score_on_loop = True`` has its groups scored on the event loop while
scoring one costs less than this on average (a slow environment goes to worker threads,
keeping the loop's lag in check)."""

FEED_SLICE_S = 0.0005
"""The feeder takes queued samples for at most this long before it gives the loop back (with
16-group dispatch rounds: loop lag p99 4.9 ms at 11,000 samples/s on a 16-core host, against
6.3 ms with 1 ms slices and 32-group rounds; benchmarks/modes.py --part lag)."""

ASYNC_SCORE_CONCURRENCY = 64
"""``score_async`` calls in flight at once (over all groups) for an async environment."""


log = structlog.get_logger("asyncrl.run.intake")


class ScoreError(RunError):
    """The environment's ``score()`` (or ``score_async()``) raised or returned a non-finite
    reward."""


class ScoreTimeout(ScoreError):
    """A ``score()`` / ``score_async()`` call did not return within
    ``failures.reward_timeout_s`` (the message names the call, what ran inside it, the prompt
    and the deadline)."""


class TurnReceiver(Protocol):
    """Where episodes' turns go (:class:`~asyncrl.run.episodes.EpisodeRunner`)."""

    def turn_arrived(self, turn: Turn, sample: Sample) -> None: ...

    def turn_failed(self, turn: Turn, error: str, retryable: bool) -> None: ...


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
    groups, each cancelled at its deadline) instead of calling ``score``."""

    def __init__(
        self, env: Environment, tok: Tokenizer, env_name: str, *, timeout_s: float
    ) -> None:
        self._args = (env, tok, env_name)
        self._timeout_s = timeout_s
        self._limiter = anyio.CapacityLimiter(4)
        self._cost_s = float("inf")  # unknown until measured: the first group uses a thread
        self._scored = 0
        self._spent_s = 0.0  # scoring time since take_spent()
        self._on_loop = getattr(env, "score_on_loop", False) is True
        score_async = getattr(env, "score_async", None)
        self._score_async = score_async if callable(score_async) else None
        self._async_limiter = anyio.CapacityLimiter(ASYNC_SCORE_CONCURRENCY)

    @property
    def cheap(self) -> bool:
        return self._on_loop and self._score_async is None and self._cost_s < INLINE_SCORE_MAX_S

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


class Feeder:
    """Reads the data socket into the rollout book; scores and commits complete groups.

    ``step_record()`` is the open step's record (it counts the samples the engines cut
    short); ``changed`` wakes the rollout pump (once per batch of samples), ``committed`` the
    train pump (once per commit).
    """

    def __init__(
        self,
        config: Config,
        *,
        data: AsyncSocket,
        book: bk.RolloutBook,
        scorer: Scorer,
        evaluator: Evaluator,
        redispatch: Redispatcher,
        rejections: Rejections,
        changed: Signal,
        committed: Signal,
        now: Callable[[], float],
        step_record: Callable[[], StepRecord],
        turns: TurnReceiver | None = None,
    ) -> None:
        self.config = config
        self.turns = turns
        """Where an episode's turn goes (the episode runner; ``None``: single-turn)."""
        self.data = data
        self.book = book
        self.scorer = scorer
        self.evaluator = evaluator
        self.redispatch = redispatch
        self.rejections = rejections
        self.changed = changed
        self.committed = committed
        self.now = now
        self.step_record = step_record

    async def run(self) -> None:
        """Read samples from the data socket until cancelled.

        A frame that does not decode, or a sample for a group that is not generating (a late
        duplicate, a stranger's), is rejected and counted (socket ``data``); it never ends the
        run. A malformed sample from the worker the group was sent to, a generation failure
        of an evaluation group, or an environment whose ``score()`` raises or returns a
        non-finite reward (``failures.on_reward_error = "fail_run"``) ends it with a
        :class:`~asyncrl.errors.RunError` naming the culprit. Under ``"drop_group"`` such a
        training group is dropped (within ``failures.max_failed_groups``) and such an
        evaluation group counted as incorrect.

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

    def _take_frames(self, codec: Codec, frames: Any, tg: anyio.abc.TaskGroup) -> None:
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            self.rejections.reject("data", "?", str(exc))
            return
        for item in msg.items if isinstance(msg, DataBatch) else (msg,):
            if isinstance(item, GroupFailed):
                self._take_failure(item, tg)
            else:
                self._take_sample(item, tg)

    def _take_failure(self, msg: GroupFailed, tg: anyio.abc.TaskGroup) -> None:
        arrival = self.book.check_failure(msg)
        if arrival.kind == bk.REJECTED:
            self.rejections.reject("data", peer_name(msg.worker), arrival.detail)
        elif arrival.kind == bk.EVALUATION:
            error = f"{msg.error_type}: {msg.message}"
            raise RunError(f"evaluation group {msg.group_id} failed on {msg.worker}: {error}")
        elif arrival.kind == bk.TURN_FAILED:
            assert self.turns is not None and arrival.turn is not None
            error = f"{msg.error_type}: {msg.message}"
            self.turns.turn_failed(arrival.turn, error, msg.retryable)
        elif arrival.kind != bk.DISCARDED:  # DISCARDED: an abandoned turn's; nobody waits
            assert arrival.group is not None
            self.redispatch.group_failed(arrival.group, msg, arrival.aborting, tg)

    def _take_sample(self, msg: SampleDone, tg: anyio.abc.TaskGroup) -> None:
        arrival = self.book.sample_arrived(msg)
        kind = arrival.kind
        if kind == bk.REJECTED:
            self.rejections.reject("data", peer_name(msg.worker), arrival.detail)
        elif kind == bk.MALFORMED:
            raise RunError(
                f"{msg.worker} returned a malformed sample {msg.index} for group "
                f"{msg.group_id}: {arrival.detail}; the generation backend "
                f"{self.config.generator.backend!r} broke its contract"
            )
        elif kind == bk.TURN:
            assert self.turns is not None and arrival.turn is not None
            assert arrival.sample is not None
            self.turns.turn_arrived(arrival.turn, arrival.sample)  # as the book took it
        elif kind == bk.EVAL_COMPLETE:
            assert arrival.group is not None
            self._score_eval(arrival.group, tg)
        elif kind != bk.EVAL_PENDING:
            if msg.sample.finish_reason == "abort":
                self.step_record().aborted_samples += 1
            if kind == bk.COMPLETE:
                assert arrival.group is not None
                self._complete(arrival.group, tg)

    def _complete(self, group: Group, tg: anyio.abc.TaskGroup) -> None:
        """A group's last sample arrived: score and commit it."""
        self._score(group, tg, self._commit, self._score_failed)

    def _score_eval(self, group: Group, tg: anyio.abc.TaskGroup) -> None:
        """An evaluation group's sample arrived: score it for its evaluation."""
        self._score(group, tg, self.evaluator.scored, self._eval_score_failed)

    def _score(
        self,
        group: Group,
        tg: anyio.abc.TaskGroup,
        scored: Callable[[str, list[CompletedSample]], None],
        failed: Callable[[Group, ScoreError], None],
    ) -> None:
        """Score ``group`` now (a cheap environment) or in a task (scoring in a thread), then
        ``scored(group_id, samples)``, or ``failed(group, error)``."""
        if not self.scorer.cheap:
            tg.start_soon(self._score_threaded, group, scored, failed)
            return
        try:
            samples = self.scorer.inline(group)
        except ScoreError as exc:
            failed(group, exc)
        else:
            scored(group.group_id, samples)

    async def _score_threaded(
        self,
        group: Group,
        scored: Callable[[str, list[CompletedSample]], None],
        failed: Callable[[Group, ScoreError], None],
    ) -> None:
        try:
            samples = await self.scorer.threaded(group)
        except ScoreError as exc:
            failed(group, exc)
        else:
            scored(group.group_id, samples)

    def _score_failed(self, group: Group, exc: ScoreError) -> None:
        """``failures.on_reward_error``: stop the run, or drop the group."""
        if self.config.failures.on_reward_error == "fail_run":
            raise exc
        gid = group.group_id
        log.error("reward_failed", group_id=gid, error=str(exc), action="group dropped")
        self.redispatch.score_failed(gid, f"group {gid}: {exc}")

    def _eval_score_failed(self, group: Group, exc: ScoreError) -> None:
        """``failures.on_reward_error``: stop the run, or count the evaluation group as
        incorrect (it is not the run's to drop; the evaluation goes on)."""
        if self.config.failures.on_reward_error == "fail_run":
            raise exc
        gid = group.group_id
        log.error("reward_failed", group_id=gid, error=str(exc), action="counted as incorrect")
        self.evaluator.score_failed(gid, len(group.samples))

    def _commit(self, gid: str, samples: list[CompletedSample]) -> None:
        if self.book.commit(gid, samples, self.now()):  # False: the run ended meanwhile
            self.committed.notify()
