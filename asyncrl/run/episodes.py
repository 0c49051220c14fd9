"""The controller's episode runner: the episodes of a multi-turn environment, as coroutines.

::

    rollout pump ──rollout.dispatch()──► Sent: a group of n episodes (no worker)
        └─► EpisodeRunner.start(sent): n episode tasks, each ``environment.run_episode``
              Episode.generate() ──Asker.ask()──► one answered request per turn
              (:mod:`asyncrl.run.asking`), its sample back to the episode
              the episode returns its Score ──rollout.episode_ended()──► COMPLETE: ctx.commit()

The rollout phase (:mod:`asyncrl.run.rollout_phase`) owns what is in flight, turns included;
the asker owns the slot each turn's answer is delivered into; the runner owns the episode tasks
and each one's cancel scope.

An episode's failure (``run_episode`` raised, or a turn failed for good) fails its group under
``[failures]``, as a failed generation does: its other episodes are cancelled and their turns
aborted; the group is retried after a back-off, or dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import structlog

from asyncrl.config import Config
from asyncrl.data.prompts import Tokenizer
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
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.arrivals import ArrivalKind, Sent
from asyncrl.run.asking import Asker, Question, RequestFailed
from asyncrl.run.context import RunContext
from asyncrl.run.episode_sample import training_sample
from asyncrl.run.wake import Pacer, Signal

__all__ = ["EpisodeFailed", "EpisodeRunner", "build_runner"]

log = structlog.get_logger("asyncrl.run.episodes")

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


class EpisodeFailed(RequestFailed):
    """An episode cannot go on: its environment raised, or returned nothing to train."""


@dataclass
class _GroupRun:
    """One dispatch of a group: its episodes' cancel scopes, how many ended, and whether it
    was cancelled or failed (its episodes then end unreported: the rollout phase forgot them). An
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
        rollout: the run's rollout phase (the owner of every turn in flight).
        asker: where each turn is asked of an engine (:mod:`asyncrl.run.asking`).
        record: a fresh token-exact record for a prompt (``Trajectory``).
        commit: ``commit(group_id, samples)``: a group's episodes all ended, scored
            (:meth:`RunContext.commit <asyncrl.run.context.RunContext.commit>`).
        changed: the live groups changed (an episode ended).
        fail_group: ``fail_group(group_id, prompt_id, error, retryable, tg)``: an episode
            failed (a back-off before its group's retry runs in ``tg``); returns the turns to
            abort by worker (the rollout phase's answer).
        limits, deadline_s, on_truncation, temperature: ``[episode]`` and ``[grpo]``.
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
        rollout: RolloutPhase,
        asker: Asker,
        record: Callable[[Prompt], Record],
        commit: Callable[[str, list[Any]], None],
        changed: Signal,
        fail_group: Callable[[str, str, str, bool, anyio.abc.TaskGroup], dict[str, list[str]]],
        limits: Limits,
        deadline_s: float,
        on_truncation: str,
        temperature: float,
        tools: ToolBox | None = None,
        parser: ToolCallParser | None = None,
        take_metrics: Callable[[], Mapping[str, Any]] | None = None,
        id_prefix: str = "",
    ) -> None:
        self._prefix = id_prefix
        """Before the evaluations' ids: a job's name and ``:``, else none."""
        self._env, self._rollout, self._asker, self._record = environment, rollout, asker, record
        self._commit, self._changed, self._fail_group = commit, changed, fail_group
        self._limits, self._deadline_s, self._on_truncation = limits, deadline_s, on_truncation
        self._temperature = temperature
        self._tools, self._parser = tools, parser
        self._env_metrics = take_metrics
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
        """Start the ``sent.n`` episodes of a group the rollout phase dispatched."""
        if self._tg is None:
            raise RuntimeError("EpisodeRunner.start() before run()")
        assert sent.prompt is not None and not sent.worker
        run = _GroupRun(sent, dispatch=self._rollout.retries(sent.group_id))
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

    # ------------------------------------------------------------------ aborts
    def cancel(self, group_ids: Sequence[str]) -> None:
        """The rollout phase aborted these groups: cancel their episodes (each then ends with no
        sample; their turns were abandoned by the rollout phase and their workers told)."""
        for gid in group_ids:
            run = self._runs.get(gid)
            if run is not None:
                run.cancel()

    # ------------------------------------------------------------------ one episode
    async def _episode(self, run: _GroupRun, index: int) -> None:
        gid = run.sent.group_id
        scope = run.scope(index)
        sample: CompletedSample | None = None
        failure: RequestFailed | None = None
        try:
            with scope:
                sample = await self._play(run, index)
        except RequestFailed as exc:
            failure = exc
        finally:
            del run.scopes[index]
            run.ended += 1
            if run.ended == run.sent.n and self._runs.get(gid) is run:
                del self._runs[gid]
        if run.failed:
            return  # its group failed meanwhile: the rollout phase forgot it
        if failure is not None:
            self._failed(run, index, failure)
            return
        arrival = self._rollout.episode_ended(gid, index, sample)
        self._changed.notify()
        if arrival.kind is ArrivalKind.COMPLETE:  # scored already: ready to train
            assert arrival.group is not None
            self._commit(gid, list(arrival.group.samples))

    def _failed(self, run: _GroupRun, index: int, failure: RequestFailed) -> None:
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
                self._tg.start_soon(self._asker.abort_quietly, worker, ids)

    async def _play(self, run: _GroupRun, index: int) -> CompletedSample | None:
        """Run episode ``index`` of ``run``'s group to its score; ``None`` when cancelled.

        Raises:
            RequestFailed: the environment raised, or a turn failed for good.
        """
        sent = run.sent
        assert sent.prompt is not None
        await self._pacer.turn()
        record = self._record(sent.prompt)
        question = Question(sent.group_id, index, dispatch=run.dispatch)
        episode = self._episode_of(question, sent.prompt, record)
        truncated, score = await self._until_done(episode, sent.prompt)
        self._count(episode, truncated, record.splits)
        return self._sample(record, score, truncated)

    def _episode_of(self, question: Question, prompt: Prompt, record: Record) -> Episode:
        async def source(prompt_ids: list[int], max_tokens: int) -> Generated:
            sample, version = await self._asker.ask(question, prompt_ids, max_tokens,
                                                    self._temperature)  # fmt: skip
            await self._pacer.turn()  # the agent goes on from here: one episode per pass
            return Generated(sample.token_ids, sample.logprobs, sample.finish_reason, version,
                             sample.versions)  # fmt: skip

        return Episode(
            episode_id=question.episode, prompt=prompt, record=record, source=source,
            limits=self._limits, tools=self._tools, parser=self._parser,
            evaluation=question.evaluation,
        )  # fmt: skip

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, label: str, prompts: Sequence[Prompt]) -> list[Score | None]:
        """One greedy episode of each of ``prompts`` on the current weights, all at once
        (outside the scheduler: nothing trains on them); each one's score, or ``None`` if it
        failed. A truncated episode scores 0.

        Cancellation: every evaluation episode is cancelled (its turn aborted)."""
        scores: list[Score | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            question = Question(f"{self._prefix}eval-{label}-{i}", 0, evaluation=True)
            await self._pacer.turn()
            episode = self._episode_of(question, prompts[i], self._record(prompts[i]))
            try:
                scores[i] = (await self._until_done(episode, prompts[i]))[1]
            except RequestFailed as exc:
                log.warning("eval_episode_failed", episode=question.episode, error=str(exc))

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
            except (RequestFailed, anyio.get_cancelled_exc_class()):
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
    asker: Asker,
    fail_group: Callable[[str, str, str, bool, anyio.abc.TaskGroup], dict[str, list[str]]],
    deadline_s: float | None = None,
    parts: EnvironmentParts | None = None,
) -> EpisodeRunner:
    """The run's episode runner, from ``[episode]``: the environment's tools (its ``tools``
    attribute) in one :class:`ToolBox` with the ``episode.tool_parser``, each episode's
    token-exact :class:`~asyncrl.env.trajectory.Trajectory` (the model's chat template and its
    end-of-turn tokens), and each turn asked through ``asker``. ``deadline_s`` overrides ``episode.deadline_s`` (the gateway
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

    config, now, ep = ctx.config, ctx.now, ctx.config.episode
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

    limits = Limits(ep.max_turns, ep.max_context_tokens,
                    ep.max_turn_tokens or config.grpo.max_new_tokens)  # fmt: skip
    return EpisodeRunner(
        environment, rollout=ctx.rollout, asker=asker, record=record, commit=ctx.commit,
        changed=ctx.changed, fail_group=fail_group, limits=limits,
        deadline_s=ep.deadline_s if deadline_s is None else deadline_s,
        on_truncation=ep.on_truncation, temperature=config.grpo.temperature, tools=box,
        parser=parser,
        take_metrics=parts.take_metrics, id_prefix=ctx.id_prefix,
    )  # fmt: skip
