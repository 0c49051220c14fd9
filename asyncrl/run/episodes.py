"""The controller's episode runner: the episodes of a multi-turn environment, as coroutines.

::

    rollout pump ──book.dispatch()──► Sent: a group of n episodes (no worker)
        └─► EpisodeRunner.start(sent): n episode tasks, each ``environment.run_episode``
              Episode.generate() ──book.start_turn()──► a worker ──Cast(Generate([1 request]))──►
              Feeder ◄──SampleDone── worker; book.sample_arrived(): TURN ──turn_arrived()──► it
              the episode returns its Score ──book.episode_ended()──► COMPLETE: commit

The book (:mod:`asyncrl.run.book`) owns what is in flight, turns included; the runner owns
what waits: the episode tasks, each one's cancel scope, and the slot each turn's answer is
delivered into. Every turn request ends exactly one way: its sample comes back (``TURN``), its
worker reports it failed (``TURN_FAILED``), its worker is lost (:meth:`turns_lost`), or its
episode is cancelled (the book abandons it and the worker is told to abort it).

An episode's failure (``run_episode`` raised, or a turn failed for good) fails its group under
``[failures]``, as a failed generation does: its other episodes are cancelled and their turns
aborted; the group is retried after a back-off, or dropped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import structlog

from asyncrl.config import Config
from asyncrl.data.prompts import Tokenizer, sample_seed
from asyncrl.env.capabilities import EnvironmentParts, check_environment
from asyncrl.env.episode import (
    Episode,
    EpisodeEnvironment,
    EpisodeLimit,
    EpisodeStats,
    Generated,
    Limits,
    Record,
)
from asyncrl.env.tool_parsers import ToolCallParser
from asyncrl.env.trajectory import TemplateMismatch
from asyncrl.env.toolbox import ToolBox
from asyncrl.env.tools import Tool
from asyncrl.environment import Prompt, Score
from asyncrl.policy.groups import CompletedSample
from asyncrl.run import book as bk
from asyncrl.run.arrivals import ArrivalKind, Sent
from asyncrl.run.context import RunContext
from asyncrl.run.episode_sample import training_sample
from asyncrl.run.wake import Pacer, Signal
from asyncrl.run.turns import TurnRequest, turn_id
from asyncrl.wire.messages import GenRequest, Sample

__all__ = ["EpisodeFailed", "EpisodeRunner", "TurnLost", "build_runner"]

log = structlog.get_logger("asyncrl.run.episodes")

TURN_ATTEMPTS = 3
"""Requests one turn may take when its worker reports a (retryable) failure; a worker lost
does not count (the turn goes to another worker at once)."""

ABORT_TIMEOUT_S = 10.0
"""Bound on telling a worker to abort the turn of a cancelled episode (shielded)."""

TOOL_CONCURRENCY = 64
"""Tool calls running at once across the run (more wait their turn, the wait counted in
``tool_wait_*``; docs/environments.md). A guard against runaway fan-out, not a measured
optimum (no measurement chose 64): a step's ``tool_in_flight_max`` says how close a run comes,
and a tool that must be rationed (a rate-limited API) limits itself. Once the config key
``episode.max_concurrent_tools`` (issue 50)."""


SPLITS_LOGGED = 10
"""Template splits of a run logged (``episode_split`` warnings); the step's ``episode_splits``
counts them all. A template that splits does so in most episodes (Qwen3's at every user turn
after reasoning), so the first few say why (the turn and the first difference, what the
``episode.on_template_mismatch = "refuse"`` of before issue 50 was for) and the rest would only
repeat it."""


class _SplitLog:
    """Logs the first :data:`SPLITS_LOGGED` template splits of a run
    (:class:`~asyncrl.env.trajectory.TemplateMismatch`: the episode, the turn and where the
    template's re-render first differs from what was recorded)."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, mismatch: TemplateMismatch) -> None:
        self.seen += 1
        if self.seen <= SPLITS_LOGGED:
            log.warning("episode_split", episode=mismatch.episode, turn=mismatch.turn,
                        position=mismatch.position, where=mismatch.where,
                        recorded=mismatch.recorded, rendered=mismatch.rendered,
                        note=f"the first {SPLITS_LOGGED} of the run are logged; the step's "
                        "episode_splits counts them all (docs/environments.md, 'The prefix "
                        "check')")  # fmt: skip


class EpisodeFailed(Exception):
    """An episode cannot go on: its environment raised, or a turn failed for good."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class TurnLost(Exception):
    """Why a turn request ended without a sample (internal to the runner)."""

    def __init__(self, message: str, *, retryable: bool, counts: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.counts = counts
        """Whether it counts against ``TURN_ATTEMPTS`` (a lost worker does not)."""


@dataclass
class _Slot:
    """Where one turn request's answer is delivered."""

    done: anyio.Event = field(default_factory=anyio.Event)
    sample: Sample | None = None
    lost: TurnLost | None = None

    def answer(self, sample: Sample | None, lost: TurnLost | None = None) -> None:
        self.sample, self.lost = sample, lost
        self.done.set()


@dataclass
class _Asker:
    """One episode's turn requests: their ids (``k`` counts requests, retries included) and
    the worker of the last one."""

    group_id: str
    index: int
    evaluation: bool = False
    worker: str = ""
    requests: int = 0
    dispatch: int = 0
    """The group's dispatches before this one (its retries): part of each turn id."""

    @property
    def episode(self) -> str:
        return f"{self.group_id}/{self.index}"

    def next_id(self) -> str:
        self.requests += 1
        return turn_id(self.group_id, self.index, self.requests - 1, self.dispatch)


@dataclass
class _GroupRun:
    """One dispatch of a group: its episodes' cancel scopes, how many ended, and whether it
    was cancelled or failed (its episodes then end unreported: the book forgot them). An
    episode whose task starts after the cancel gets a scope cancelled already."""

    sent: Sent
    dispatch: int = 0
    """The group's retries before this dispatch (its turn ids must differ from theirs)."""
    scopes: dict[int, anyio.CancelScope] = field(default_factory=dict)
    ended: int = 0
    failed: bool = False
    cancelled: bool = False

    @property
    def prompt_id(self) -> str:
        return self.sent.prompt.id if self.sent.prompt is not None else "?"

    def scope(self, index: int) -> anyio.CancelScope:
        scope = self.scopes[index] = anyio.CancelScope()
        if self.cancelled:
            scope.cancel()
        return scope

    def cancel(self) -> None:
        self.cancelled = True
        for scope in self.scopes.values():
            scope.cancel()


class EpisodeRunner:
    """Runs the episodes of the groups the rollout pump dispatches.

    Args:
        environment: the multi-turn environment.
        book: the run's rollout book (the owner of every group and turn in flight).
        record: a fresh token-exact record for a prompt (``Trajectory``).
        send: ``send(worker, request)``: ask ``worker`` for one turn (a ``GenRequest``).
        abort: ``abort(worker, turn_ids)``: tell ``worker`` to abort these turns.
        serving: the rollout workers that serve now.
        changed: the book changed (an episode ended); also waited on while no worker serves.
        committed: a group is ready to train.
        now: the run's clock.
        fail_group: ``fail_group(group_id, prompt_id, error, retryable, tg)``: an episode
            failed (a back-off before its group's retry runs in ``tg``); returns the turns to
            abort by worker (the book's answer).
        limits, deadline_s, on_truncation, temperature, seed: ``[episode]`` and ``[grpo]``.
        tools, parser: the run's tools and tool-call parser (``None``: the environment has no
            tools).
        take_metrics: the environment's ``take_metrics`` (:class:`~asyncrl.environment.StepMetrics`,
            as :func:`~asyncrl.env.capabilities.check_environment` found it; ``None``: it has
            none), whose figures go into each step record.
    """

    def __init__(
        self,
        environment: EpisodeEnvironment,
        *,
        book: bk.RolloutBook,
        record: Callable[[Prompt], Record],
        send: Callable[[str, Any], Awaitable[Any]],
        abort: Callable[[str, list[str]], Awaitable[Any]],
        serving: Callable[[], Sequence[str]],
        changed: Signal,
        committed: Signal,
        now: Callable[[], float],
        fail_group: Callable[[str, str, str, bool, anyio.abc.TaskGroup], dict[str, list[str]]],
        limits: Limits,
        deadline_s: float,
        on_truncation: str,
        temperature: float,
        seed: int,
        tools: ToolBox | None = None,
        parser: ToolCallParser | None = None,
        take_metrics: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self._env, self._book, self._record = environment, book, record
        self._send, self._abort, self._serving = send, abort, serving
        self._changed, self._committed, self._now = changed, committed, now
        self._fail_group = fail_group
        self._limits, self._deadline_s, self._on_truncation = limits, deadline_s, on_truncation
        self._temperature, self._seed = temperature, seed
        self._tools, self._parser = tools, parser
        self._env_metrics = take_metrics
        self._slots: dict[str, _Slot] = {}
        """Turn id → where its answer goes, for every turn an episode waits for."""
        self._runs: dict[str, _GroupRun] = {}
        """Group id → its current dispatch."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._stats = EpisodeStats()
        self._pacer = Pacer()
        """Episodes' agent code runs one piece per pass of the loop (at a start, after each
        turn): woken together they would hold the loop for all of it (:class:`Pacer`)."""

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the episode tasks until cancelled (the run's end).

        Cancellation: every episode is cancelled (its turn aborted, its tools cancelled)."""
        async with anyio.create_task_group() as tg:
            await tg.start(self._pacer.run, name="episode-pacer")
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    def start(self, sent: Sent) -> None:
        """Start the ``sent.n`` episodes of a group the book dispatched."""
        if self._tg is None:
            raise RuntimeError("EpisodeRunner.start() before run()")
        assert sent.prompt is not None and not sent.worker
        run = _GroupRun(sent, dispatch=self._book.retries(sent.group_id))
        self._runs[sent.group_id] = run
        for i in range(sent.n):
            self._tg.start_soon(self._episode, run, i, name=f"episode-{sent.group_id}/{i}")

    def take_stats(self) -> EpisodeStats:
        """The counters since the last call (a step's); counting starts afresh."""
        stats, self._stats = self._stats, EpisodeStats()
        return stats

    def take_metrics(self) -> dict[str, Any]:
        """A step record's episode and tool figures since the last call (``episode_*``,
        ``tool_*``: :meth:`EpisodeStats.metrics`, :meth:`ToolStats.metrics
        <asyncrl.env.toolbox.ToolStats.metrics>`), each tool's busy time on the run's
        clock (``tool_busy``: the timeline's tool lanes), and the environment's own figures
        if it has a ``take_metrics()`` (the gateway's ``gateway_*``)."""
        out: dict[str, Any] = dict(self.take_stats().metrics())
        if self._env_metrics is not None:  # the gateway's, say
            out.update(self._env_metrics())
        if self._tools is not None:
            tools = self._tools.take_stats()
            out.update(tools.metrics())
            out["tool_busy"] = tools.busy_by_tool()
        return out

    # ------------------------------------------------------------------ what comes back
    def turn_arrived(self, turn: TurnRequest, sample: Sample) -> None:
        """The book's ``TURN``: hand the sample to the episode waiting for it."""
        slot = self._slots.get(turn.turn_id)
        if slot is not None:
            slot.answer(sample)

    def turn_failed(self, turn: TurnRequest, error: str, retryable: bool) -> None:
        """The book's ``TURN_FAILED``: the worker could not generate the turn."""
        slot = self._slots.get(turn.turn_id)
        if slot is not None:
            slot.answer(None, TurnLost(error, retryable=retryable, counts=True))

    def turns_lost(self, turns: Sequence[TurnRequest]) -> None:
        """Their worker died: each episode asks another worker (not counted as a failure)."""
        for turn in turns:
            slot = self._slots.get(turn.turn_id)
            if slot is not None:
                lost = TurnLost(f"worker {turn.worker} died", retryable=True, counts=False)
                slot.answer(None, lost)

    def cancel(self, group_ids: Sequence[str]) -> None:
        """The book aborted these groups: cancel their episodes (each then ends with no
        sample; their turns were abandoned by the book and their workers told)."""
        for gid in group_ids:
            run = self._runs.get(gid)
            if run is not None:
                run.cancel()

    # ------------------------------------------------------------------ one episode
    async def _episode(self, run: _GroupRun, index: int) -> None:
        gid = run.sent.group_id
        scope = run.scope(index)
        sample: CompletedSample | None = None
        failure: EpisodeFailed | None = None
        try:
            with scope:
                sample = await self._play(run, index)
        except EpisodeFailed as exc:
            failure = exc
        finally:
            del run.scopes[index]
            run.ended += 1
            if run.ended == run.sent.n and self._runs.get(gid) is run:
                del self._runs[gid]
        if run.failed:
            return  # its group failed meanwhile: the book forgot it
        if failure is not None:
            self._failed(run, index, failure)
            return
        arrival = self._book.episode_ended(gid, index, sample)
        self._changed.notify()
        if arrival.kind is ArrivalKind.COMPLETE:  # scored already: ready to train
            assert arrival.group is not None
            if self._book.commit(gid, list(arrival.group.samples), self._now()):
                self._committed.notify()

    def _failed(self, run: _GroupRun, index: int, failure: EpisodeFailed) -> None:
        gid = run.sent.group_id
        self._stats.failed += 1
        run.failed = True
        run.cancel()
        log.warning("episode_failed", episode=f"{gid}/{index}", error=str(failure))
        assert self._tg is not None
        turns = self._fail_group(gid, run.prompt_id, f"episode {gid}/{index}: {failure}",
                                 failure.retryable, self._tg)  # fmt: skip
        if turns:
            for worker, ids in turns.items():
                self._tg.start_soon(self._abort_quietly, worker, ids)

    async def _play(self, run: _GroupRun, index: int) -> CompletedSample | None:
        """Run episode ``index`` of ``run``'s group to its score; ``None`` when cancelled.

        Raises:
            EpisodeFailed: the environment raised, or a turn failed for good.
        """
        sent = run.sent
        assert sent.prompt is not None
        await self._pacer.turn()
        record = self._record(sent.prompt)
        asker = _Asker(sent.group_id, index, dispatch=run.dispatch)
        episode = self._episode_of(asker, sent.prompt, record)
        truncated, score = await self._until_done(episode, sent.prompt)
        self._count(episode, truncated, record.splits)
        return self._sample(record, score, truncated)

    def _episode_of(self, asker: _Asker, prompt: Prompt, record: Record) -> Episode:
        async def source(prompt_ids: list[int], max_tokens: int) -> Generated:
            return await self._turn(asker, prompt_ids, max_tokens)

        return Episode(
            episode_id=asker.episode, prompt=prompt, record=record, source=source,
            limits=self._limits, tools=self._tools, parser=self._parser,
            evaluation=asker.evaluation,
        )  # fmt: skip

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, label: str, prompts: Sequence[Prompt]) -> list[Score | None]:
        """One greedy episode of each of ``prompts`` on the current weights, all at once
        (outside the scheduler: nothing trains on them); each one's score, or ``None`` if it
        failed. A truncated episode scores 0.

        Cancellation: every evaluation episode is cancelled (its turn aborted)."""
        scores: list[Score | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            asker = _Asker(f"eval-{label}-{i}", 0, evaluation=True)
            await self._pacer.turn()
            episode = self._episode_of(asker, prompts[i], self._record(prompts[i]))
            try:
                scores[i] = (await self._until_done(episode, prompts[i]))[1]
            except EpisodeFailed as exc:
                log.warning("eval_episode_failed", episode=asker.episode, error=str(exc))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return scores

    async def _until_done(self, episode: Episode, prompt: Prompt) -> tuple[str | None, Score]:
        """Await the environment's ``run_episode`` under the episode's deadline: the reason
        it was truncated (or ``None``), and its score (reward 0 when truncated)."""
        truncated: str | None = None
        score = Score(reward=0.0)
        with anyio.move_on_after(self._deadline_s) as deadline:
            try:
                score = await self._env.run_episode(prompt, episode)
            except EpisodeLimit as limit:
                truncated = limit.reason
            except (EpisodeFailed, anyio.get_cancelled_exc_class()):
                raise
            except Exception as exc:
                raise EpisodeFailed(f"run_episode raised {type(exc).__name__}: {exc}") from exc
        if deadline.cancelled_caught:
            truncated = "deadline"
        if not isinstance(score, Score):
            raise EpisodeFailed(f"run_episode returned {type(score).__name__}, not a Score")
        if truncated is not None:
            score = Score(reward=0.0)
        return truncated, score

    def _count(self, episode: Episode, truncated: str | None, splits: int) -> None:
        stats = self._stats
        stats.episodes += 1
        stats.splits += splits
        stats.turns += episode.turns
        stats.tool_calls += episode.tool_calls
        if truncated is not None:
            stats.truncated[truncated] = stats.truncated.get(truncated, 0) + 1

    def _sample(self, record: Record, score: Score, truncated: str | None) -> CompletedSample:
        """The episode as one training sample (:func:`asyncrl.run.episode_sample.training_sample`).

        Raises:
            EpisodeFailed: the episode generated nothing (no turn to train).
        """
        sample = training_sample(record.samples(), score, truncated,
                                 mask_truncated=self._on_truncation == "mask")  # fmt: skip
        if sample is None and truncated == "deadline":  # a slow engine: worth another try
            raise EpisodeFailed(f"episode.deadline_s ({self._deadline_s:g} s) passed before "
                                "its first turn ended")  # fmt: skip
        if sample is None:
            raise EpisodeFailed("run_episode returned before its first turn", retryable=False)
        return sample

    # ------------------------------------------------------------------ one turn
    async def _turn(self, asker: _Asker, prompt_ids: list[int], max_tokens: int) -> Generated:
        """One turn of ``asker``'s episode: a request on a worker the book picks (the last
        one while it is not much busier), retried on another when its worker is lost, and
        at most ``TURN_ATTEMPTS`` times when its worker reports a failure.

        Raises:
            EpisodeFailed: the turn failed ``TURN_ATTEMPTS`` times, or for good.

        Cancellation: the turn is abandoned and its worker told to abort it.
        """
        failures = 0
        while True:
            tid = asker.next_id()
            chosen = asker.worker = await self._place(asker, tid)
            version = self._book.generator_version
            try:
                sample = await self._request(tid, chosen, prompt_ids, max_tokens, asker.evaluation)
            except TurnLost as lost:
                failures += lost.counts
                if not lost.retryable or failures >= TURN_ATTEMPTS:
                    raise EpisodeFailed(f"turn failed on {chosen}: {lost}",
                                        retryable=lost.retryable) from None  # fmt: skip
                continue
            await self._pacer.turn()  # the agent goes on from here: one episode per pass
            return Generated(
                sample.token_ids, sample.logprobs, sample.finish_reason, version, sample.versions
            )

    async def _place(self, asker: _Asker, tid: str) -> str:
        """The worker for turn ``tid`` (the book charges it); waits while none serves."""
        book = self._book
        while True:
            serving = self._serving()
            if asker.evaluation:
                chosen = book.start_eval_turn(tid, asker.group_id, serving, asker.worker)
            else:
                chosen = book.start_turn(tid, asker.group_id, asker.index, serving, asker.worker)
            if chosen is not None:
                return chosen
            if not asker.evaluation and not book.generating(asker.group_id):
                # its group is being aborted: the runner cancels this episode at once
                await anyio.sleep_forever()
            await self._changed.wait()

    async def _request(
        self, tid: str, worker: str, prompt_ids: list[int], max_tokens: int, greedy: bool
    ) -> Sample:
        slot = self._slots[tid] = _Slot()
        request = GenRequest(
            group_id=tid, prompt_ids=prompt_ids, n=1, max_tokens=max_tokens,
            temperature=self._temperature, greedy=greedy, seed=sample_seed(self._seed, tid),
        )  # fmt: skip
        try:
            await self._send(worker, request)
            await slot.done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                to = self._book.abandon_turn(tid)
                if to is not None:
                    await self._abort_quietly(to, [tid])
            raise
        finally:
            del self._slots[tid]
        if slot.lost is not None:
            raise slot.lost
        assert slot.sample is not None
        return slot.sample

    async def _abort_quietly(self, worker: str, turn_ids: list[str]) -> None:
        """Tell ``worker`` to abort these turns, bounded; a failure is only logged (the
        turns' samples, if any, are discarded when they come)."""
        with anyio.move_on_after(ABORT_TIMEOUT_S):
            try:
                await self._abort(worker, turn_ids)
            except Exception as exc:  # noqa: BLE001 - the worker may be gone; nothing waits
                log.warning("turn_abort_failed", worker=worker, turns=len(turn_ids), error=str(exc))


def _tools(
    tools: Sequence[Tool], config: Config, now: Callable[[], float]
) -> tuple[ToolBox | None, ToolCallParser | None]:
    """The environment's tools (checked: :class:`~asyncrl.environment.HasTools`) in one
    :class:`ToolBox`, and the ``episode.tool_parser``; ``(None, None)`` without tools.

    Raises:
        PluginError: ``episode.tool_parser`` names no installed parser.
    """
    from asyncrl.env.tool_parsers import load_tool_parser

    if not tools:
        return None, None
    ep = config.episode
    box = ToolBox(tools, timeout_s=ep.tool_timeout_s, max_concurrent=TOOL_CONCURRENCY,
                  now=now)  # fmt: skip
    return box, load_tool_parser(ep.tool_parser, "episode.tool_parser")


def build_runner(
    ctx: RunContext,
    environment: EpisodeEnvironment,
    *,
    tokenizer: Tokenizer,
    fail_group: Callable[[str, str, str, bool, anyio.abc.TaskGroup], dict[str, list[str]]],
    deadline_s: float | None = None,
    parts: EnvironmentParts | None = None,
) -> EpisodeRunner:
    """The run's episode runner, from ``[episode]``: the environment's tools (its ``tools``
    attribute) in one :class:`ToolBox` with the ``episode.tool_parser``, each episode's
    token-exact :class:`~asyncrl.env.trajectory.Trajectory` (the model's chat template and its
    end-of-turn tokens), and turn requests sent as one-request ``Generate`` casts (no reply:
    the sample is the answer). ``deadline_s`` overrides ``episode.deadline_s`` (the gateway
    keeps its sessions' deadlines itself: an episode waiting for an agent has none). The
    environment's optional capabilities (``tools``, ``take_metrics``) are ``parts``, as the
    caller's :func:`~asyncrl.env.capabilities.check_environment` found them (without: checked
    here), and the runner is given them.

    Raises:
        ConfigError: the model has no chat template.
        PluginError: ``episode.tool_parser`` names no installed parser; the environment's
            ``tools`` are not :func:`~asyncrl.env.tools.tool` functions, or another of its
            optional capabilities is of the wrong kind (naming it and the member).
    """
    from asyncrl.env.trajectory import Trajectory
    from asyncrl.errors import config_error
    from asyncrl.run.preflight import end_token_ids
    from asyncrl.wire.messages import Abort, Generate

    config, book, control, now = ctx.config, ctx.book, ctx.control, ctx.now
    ep, timeout = config.episode, config.cluster.call_timeout_s
    template = tokenizer.chat_template
    if template is None:
        raise config_error("model.chat_template", "a multi-turn environment needs a chat template "
                           "and the model directory has none",
                           "save one with the tokenizer, or set model.chat_template")  # fmt: skip
    if parts is None:
        parts = check_environment(environment, config.environment.name, scored=True)
    box, parser = _tools(parts.tools, config, now)
    definitions = box.definitions() if box is not None else None
    ends = end_token_ids(config.model.path) or None

    split = _SplitLog()

    def record(prompt: Prompt) -> Record:
        return Trajectory(template, tokenizer, prompt.chat(), tools=definitions, episode=prompt.id,
                          end_token_ids=ends, on_split=split)  # fmt: skip

    async def send(worker: str, request: Any) -> None:
        await control.cast_unless_restarting(worker, Generate(requests=[request]))

    async def abort(worker: str, turn_ids: list[str]) -> None:
        await control.call_unless_restarting(worker, Abort(group_ids=turn_ids), timeout_s=timeout)

    limits = Limits(ep.max_turns, ep.max_context_tokens,
                    ep.max_turn_tokens or config.grpo.max_new_tokens)  # fmt: skip
    return EpisodeRunner(
        environment, book=book, record=record, send=send, abort=abort, serving=ctx.serving,
        changed=ctx.changed, committed=ctx.committed, now=now, fail_group=fail_group, limits=limits,
        deadline_s=ep.deadline_s if deadline_s is None else deadline_s,
        on_truncation=ep.on_truncation,
        temperature=config.grpo.temperature, seed=config.run.seed, tools=box, parser=parser,
        take_metrics=parts.take_metrics,
    )  # fmt: skip
