"""Multi-turn episodes: an environment whose episodes are async functions.

An environment distribution registers its factory under ``asyncrl.environments`` as a
single-turn one does (:mod:`asyncrl.environment`); what makes it multi-turn is an
``async def run_episode(prompt, episode) -> Score`` method (:class:`EpisodeEnvironment`). The
controller calls it once per episode, ``grpo.samples_per_prompt`` episodes per prompt, many at
once on its event loop. The episode awaits :meth:`Episode.generate` as often as it likes (each
call is one turn: one request on the least loaded engine, whose prefix cache serves the growing
conversation), adds observations (tool results, user turns, feedback) as chat messages or as
token ids, runs the tool calls the model made, and returns the episode's :class:`Score`
(``components`` are its named rewards)::

    class Calculator:
        tools = [calc]                           # asyncrl.env.tools.tool-decorated functions

        def dataset(self, split): ...

        async def run_episode(self, prompt, episode):
            while True:
                turn = await episode.generate()
                if not turn.calls and not turn.errors:   # an answer, not a tool call
                    break
                await episode.call_tools(turn)           # results appended as tool messages
            return Score(reward=float(turn.text.strip() == prompt.answer))

What is trained is recorded as token ids (:mod:`asyncrl.env.trajectory`): the prompt, each
turn's generated ids exactly as the engine produced them (with their logprobs), and the
observations rendered once with the chat template and appended as ids; only generated tokens
train. Nothing generated is decoded and re-encoded.

Limits (``[episode]`` in the config): turns, tokens in the conversation (the context), and a
wall-clock deadline. :meth:`Episode.generate` raises :class:`EpisodeLimit` when the next turn
would pass the turn or context limit; an episode that lets it propagate (or that runs past its
deadline) is *truncated*, and ``episode.on_truncation`` says whether it trains with reward 0 or
is dropped. An episode that wants to score a truncated attempt itself catches
:class:`EpisodeLimit` and returns its score.

An exception in ``run_episode`` fails that episode, never the run: its group is retried or
dropped under ``[failures]`` like a group whose generation failed. Cancelling an episode (the
run stops, a refit aborts its group) aborts its engine request and cancels its running tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import anyio
import numpy as np

from asyncrl.env.segments import TrajectorySample
from asyncrl.env.tool_parsers import ToolCallParser
from asyncrl.env.toolbox import ToolBox
from asyncrl.env.tools import ToolCall, ToolCallError, ToolResult
from asyncrl.environment import Prompt, Score

__all__ = ["Episode", "EpisodeEnvironment", "EpisodeLimit", "Limits", "Turn"]

Truncation = Literal["turns", "context", "deadline"]


class EpisodeLimit(Exception):
    """The episode cannot take another turn: ``reason`` is ``"turns"`` (``episode.max_turns``
    turns taken) or ``"context"`` (the conversation fills ``episode.max_context_tokens``)."""

    def __init__(self, reason: Truncation, message: str) -> None:
        super().__init__(message)
        self.reason: Truncation = reason


@dataclass(frozen=True)
class Turn:
    """One generated turn, as the episode sees it."""

    text: str
    """The generated text (decoded from the ids the engine produced; the ids are what
    trains, never a re-encoding of this text)."""
    token_ids: np.ndarray
    """int32, read-only: exactly what the engine generated."""
    finish_reason: str
    """``"stop"`` (an end-of-turn or stop token), ``"length"`` (cut at the turn's token
    limit), or ``"abort"``."""
    version: int
    """The weight version the engine served when the turn started."""
    calls: tuple[ToolCall, ...] = ()
    """The tool calls the run's tool-call parser found in ``text`` (valid ones)."""
    errors: tuple[ToolCallError, ...] = ()
    """Tool-call attempts that are not valid calls (:meth:`Episode.call_tools` answers them
    with what is wrong, so the model can correct itself)."""


@dataclass(frozen=True)
class Limits:
    """One episode's limits (from ``[episode]``)."""

    max_turns: int
    max_context_tokens: int
    """Tokens in the whole conversation (prompt, turns, observations)."""
    max_turn_tokens: int
    """Tokens one turn may generate."""


@dataclass
class EpisodeStats:
    """The run's episode counters since the last
    :meth:`~asyncrl.run.episodes.EpisodeRunner.take_stats` (a step's record)."""

    episodes: int = 0
    """Episodes that ended with a score (training episodes; evaluation ones not counted)."""
    turns: int = 0
    tool_calls: int = 0
    splits: int = 0
    """Times a chat template's re-render split an episode into one more sample."""
    failed: int = 0
    truncated: dict[str, int] = field(default_factory=dict)
    """Truncated episodes by reason (``turns``, ``context``, ``deadline``)."""

    def metrics(self) -> dict[str, float]:
        """The step record's ``episode_*`` values."""
        n = max(self.episodes, 1)
        out = {
            "episodes": float(self.episodes),
            "episode_turns_mean": self.turns / n,
            "episode_tool_calls_mean": self.tool_calls / n,
            "episode_splits": float(self.splits),
            "episode_failed": float(self.failed),
        }
        out.update({f"episode_truncated_{k}": float(v) for k, v in sorted(self.truncated.items())})
        return out


@dataclass(frozen=True)
class Generated:
    """What the engine answered for one turn request."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    version: int
    """The weight version the generators served when the request was sent."""
    versions: np.ndarray | None = None
    """int32, one per token: the version that generated it (a turn in flight during a refit
    continues on the new weights); ``None``: all ``version``."""


class TurnSource(Protocol):
    """Where an episode's turns are generated (the controller's episode runner)."""

    async def __call__(self, prompt_ids: list[int], max_tokens: int) -> Generated: ...


class Record(Protocol):
    """The episode's token-exact record (:class:`asyncrl.env.trajectory.Trajectory`)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def splits(self) -> int: ...

    @property
    def messages(self) -> list[dict[str, Any]]: ...

    def add_turn(
        self, token_ids: np.ndarray, logprobs: np.ndarray, version: int | np.ndarray,
        finish_reason: str,
    ) -> str: ...

    def turn_text(self, token_ids: np.ndarray) -> str: ...

    def restart(
        self, messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None: ...

    def restart_text(self, prompt: str | Sequence[int]) -> None: ...

    @property
    def recorded(self) -> tuple[str, list[int]]: ...

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> None: ...

    def add_tokens(self, token_ids: Sequence[int]) -> None: ...

    def samples(self) -> list[TrajectorySample]: ...


class Episode:
    """The handle ``run_episode`` gets: one episode's conversation and what it may do.

    Built by the controller; an environment only calls its methods. Not thread-safe: use it
    from the episode's own task.
    """

    def __init__(
        self,
        *,
        episode_id: str,
        prompt: Prompt,
        record: Record,
        source: TurnSource,
        limits: Limits,
        tools: ToolBox | None = None,
        parser: ToolCallParser | None = None,
        evaluation: bool = False,
    ) -> None:
        self.id = episode_id
        """``<group>/<index>``: unique in the run (logs, the timeline)."""
        self.prompt = prompt
        self.evaluation = evaluation
        """An evaluation episode (greedy, scored, never trained)."""
        self._record, self._source, self._limits = record, source, limits
        self._tools, self._parser = tools, parser
        self._turns = 0
        self.tool_calls = 0
        """Tool calls answered so far (valid or not)."""

    # ----------------------------------------------------------------- views
    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far as chat messages (a copy)."""
        return [dict(m) for m in self._record.messages]

    @property
    def turns(self) -> int:
        """Turns generated so far."""
        return self._turns

    @property
    def prompt_ids(self) -> list[int]:
        """The token ids the next turn is sampled after (the conversation so far, as the
        engine gets it)."""
        return self._record.prompt_ids

    @property
    def context_tokens(self) -> int:
        """Tokens in the conversation so far."""
        return self._record.num_tokens

    @property
    def tool_definitions(self) -> list[dict[str, Any]]:
        """The run's tools as OpenAI-style definitions (what the chat template shows)."""
        return self._tools.definitions() if self._tools is not None else []

    # ----------------------------------------------------------------- actions
    async def generate(self, *, max_tokens: int | None = None) -> Turn:
        """Generate the next assistant turn from the conversation so far.

        ``max_tokens``: at most this many tokens (default and upper bound:
        ``episode.max_turn_tokens``; also cut to what the context has left).

        Raises:
            EpisodeLimit: ``episode.max_turns`` turns were taken, or the context is full.
            ValueError: ``max_tokens`` is not a positive number.

        Cancellation: the turn's engine request is aborted.
        """
        (out,) = await self.sample(1, max_tokens=max_tokens)
        return self.keep(out)

    async def sample(self, n: int = 1, *, max_tokens: int | None = None) -> list[Generated]:
        """Sample ``n`` candidates for the next turn from the conversation so far, at once
        (one engine request each; their prompt is shared, so the engine's prefix cache serves
        it once), and record none of them: :meth:`keep` the one the conversation goes on
        with. Counts as one turn against ``episode.max_turns``; ``max_tokens`` as in
        :meth:`generate`.

        Raises:
            EpisodeLimit, ValueError: as :meth:`generate`; ``n`` below 1.

        Cancellation: every candidate's engine request is aborted.
        """
        if n < 1:
            raise ValueError(f"sample(n={n!r}): give n >= 1")
        budget = self._budget(max_tokens)
        prompt_ids = self._record.prompt_ids
        if n == 1:
            outs = [await self._source(prompt_ids, budget)]
        else:
            outs = [None] * n

            async def one(i: int) -> None:
                outs[i] = await self._source(prompt_ids, budget)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
        self._turns += 1
        return outs  # type: ignore[return-value]

    def preview(self, candidate: Generated) -> str:
        """The text ``candidate`` would add to the conversation if kept (see :meth:`keep`)."""
        return self._record.turn_text(candidate.token_ids)

    def keep(self, candidate: Generated) -> Turn:
        """Record ``candidate`` (one of :meth:`sample`'s, possibly cut short: a prefix of its
        ids, logprobs and versions) as the next turn and return it, tool calls parsed.

        Raises:
            TrajectoryError: an observation is due, or the candidate's arrays disagree.
        """
        out = candidate
        versions = out.version if out.versions is None else out.versions
        text = self._record.add_turn(out.token_ids, out.logprobs, versions, out.finish_reason)
        ids = np.asarray(out.token_ids, dtype=np.int32)
        ids.flags.writeable = False
        if self._parser is None:
            return Turn(text, ids, out.finish_reason, out.version)
        parsed = self._parser.parse(text)
        return Turn(text, ids, out.finish_reason, out.version, parsed.calls, parsed.errors)

    def restart(
        self, messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Go on from ``messages`` (and ``tools``, OpenAI-style definitions) instead of the
        conversation so far: what was generated before trains as a sample of its own, and
        the next turn's prompt is the chat template's render of ``messages``. For an agent
        that rewrites its context (a summary, dropped turns, another system prompt); before
        the first turn it replaces the prompt. Turns already taken still count.

        Raises:
            TrajectoryError: the template rejects ``messages`` (nothing changes).
        """
        self._record.restart(messages, tools)

    def restart_text(self, prompt: str | Sequence[int]) -> None:
        """As :meth:`restart`, from a prompt already written: text (encoded as it is, no
        template) or token ids."""
        self._record.restart_text(prompt)

    @property
    def recorded(self) -> tuple[str, list[int]]:
        """The current segment's text and token ids (what was sent to the engine and what it
        generated; a pending observation left out)."""
        return self._record.recorded

    def _budget(self, max_tokens: int | None) -> int:
        """The next turn's token budget (raises as :meth:`generate`)."""
        limits = self._limits
        if self._turns >= limits.max_turns:
            raise EpisodeLimit("turns", f"episode {self.id}: {self._turns} turns taken "
                               f"(episode.max_turns = {limits.max_turns})")  # fmt: skip
        room = limits.max_context_tokens - self._record.num_tokens
        if room <= 0:
            raise EpisodeLimit("context", f"episode {self.id}: the conversation holds "
                               f"{self._record.num_tokens} tokens (episode.max_context_tokens"
                               f" = {limits.max_context_tokens})")  # fmt: skip
        if max_tokens is not None and not max_tokens > 0:
            raise ValueError(f"generate(max_tokens={max_tokens!r}): give a positive number")
        return min(limits.max_turn_tokens, room, max_tokens or limits.max_turn_tokens)

    def add_messages(self, *messages: Mapping[str, Any]) -> None:
        """Add observations as chat messages (``{"role": "user" | "tool" | ..., "content":
        ...}``): rendered once with the chat template and appended as token ids, which do not
        train. The next :meth:`generate` continues after them."""
        self._record.add_messages(messages)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Add an observation as token ids, appended as they are (they do not train)."""
        self._record.add_tokens(token_ids)

    async def call_tools(self, turn: Turn) -> list[ToolResult]:
        """Run ``turn``'s tool calls with the run's tools (at once, each under its deadline
        and the run's concurrency limit), answer its malformed calls with what is wrong, and
        add every result as a tool message. A failing tool is an observation, never an
        error of the episode. Returns the results in the order the model wrote the calls.

        Raises:
            RuntimeError: the environment has no tools.

        Cancellation: the running tools are cancelled; nothing is added.
        """
        if self._tools is None:
            raise RuntimeError(
                f"episode {self.id}: call_tools() needs tools; give the environment a `tools` "
                "attribute (a list of asyncrl.env.tools.tool functions)"
            )
        results = await self._tools.answer(turn)
        if results:
            self._record.add_messages([r.message() for r in results])
        self.tool_calls += len(results)
        return results


@runtime_checkable
class EpisodeEnvironment(Protocol):
    """A multi-turn environment (see the module docstring). It may also have a ``tools``
    attribute: the tools its episodes call (:func:`asyncrl.env.tools.tool`;
    :class:`~asyncrl.environment.HasTools`, checked once by
    :func:`~asyncrl.env.capabilities.check_environment`)."""

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split`` (as :class:`asyncrl.environment.Environment`)."""

    async def run_episode(self, prompt: Prompt, episode: Episode) -> Score:
        """Run one episode of ``prompt`` and score it. Runs on the controller's event loop:
        never block it (run blocking code in a thread, e.g. with
        :func:`asyncrl.data.deadlines.in_thread`)."""
