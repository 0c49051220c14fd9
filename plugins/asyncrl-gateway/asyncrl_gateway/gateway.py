"""The gateway as the run's multi-turn environment: each episode is a session whose turns
arrive as OpenAI calls (docs/gateway.md).

:class:`Gateway` wraps the run's environment (its prompts, and its ``score`` for sessions that
end without a reward) and is what the episode runner runs: ``run_episode(prompt, episode)``
opens a session, hands it to an agent (the lobby for agents that call in, or a managed agent
process), and serves the session's calls in their HTTP handlers' tasks, so they go through the
same scheduler, staleness bound and refits as any episode's turns: a call waiting for a refit
waits; a call whose episode the run cancels is answered 410. The HTTP side is
:mod:`asyncrl_gateway.server`; what is pure (request types, the conversation, replies, the
session table) lives in the modules beside it.

One call, token-exact::

    agent's messages ─ChatLog.plan()─► Continue(new messages) ─► episode.add_messages(new)
                                   └─► Restart(messages) ─► episode.restart(messages, tools)
    episode.sample(n) ─► candidates (engine ids, logprobs, versions)
        ─► cut at a stop sequence ─► tool calls parsed ─► the replies
        ─► n = 1: episode.keep(it)   n > 1: kept when the next call shows which one goes on
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import numpy as np
import structlog

from asyncrl.plugin.environment import (
    Episode,
    EpisodeLimit,
    Generated,
    Overdue,
    Prompt,
    Score,
    Tokenizer,
    ToolCallParser,
    TrajectoryError,
    check_environment,
    in_thread,
    unlocked,
)
from asyncrl_gateway.config import GatewayConfig, gateway_config
from asyncrl_gateway.conversation import (
    ChatLog,
    Continue,
    cut_at_stop,
    reply_of,
    template_message,
    tool_definitions,
)
from asyncrl_gateway.replies import CallResult, Choice
from asyncrl_gateway.schema import ChatRequest, CompletionRequest, GatewayError, now_s
from asyncrl_gateway.sessions import HttpCall, Finish, Session, SessionTable

__all__ = ["Gateway", "SessionFailed", "check_gateway"]

log = structlog.get_logger("asyncrl.gateway")

OFF_LOOP_BYTES = 64 * 1024
"""A call whose body is this big is recorded in a worker thread: its messages compared with the
record, templated and encoded (the encoding with the GIL released, see
:meth:`~asyncrl.plugin.environment.Tokenizer.encode_rendered`), one such call at a time. On the
loop, a 4 MB body of 100,000 messages held it about a second; a smaller one is recorded in less
time than the hand-over to a thread takes."""
PREFIX_CHARS_PER_TOKEN = 16
"""A message longer than this many characters a token of the limit is counted on a prefix
before it is templated (:func:`_too_long`): far more than natural text takes (3-5 for the
tokenizers of LLMs), so a message that fits is never counted twice."""
_WORD_END = re.compile(r"\S(?= )")


class SessionFailed(Exception):
    """A session cannot be trained: its agent went away, failed or gave it back (its group
    runs again under ``[failures]``)."""


@dataclass
class _Conversation:
    """What one session's calls built so far, besides the episode's record."""

    api: Literal["chat", "completion"] | None = None
    """The API the session's first answered call used (a refused call commits it to none)."""
    chat: ChatLog = field(default_factory=ChatLog)
    pending: list[Generated] = field(default_factory=list)
    """The candidates of a call with ``n`` > 1, until the next call shows which goes on."""
    awaiting: bool = False
    """A reply was recorded and nothing after it yet."""
    broken: bool = False
    """The last call left the record mid-way (its messages were refused): restart."""
    end_text: str = ""
    """The text of the end token the last kept turn ended with (a text agent never writes it:
    a completion prompt may go on without it)."""
    answer: str = ""
    """The last reply's text (what ``score`` reads when the session ends without a reward)."""


class Gateway:
    """The run's environment when ``[gateway]`` is enabled (see the module docstring).

    Args:
        config: ``[gateway]``.
        environment: the run's environment (its ``dataset``; its ``score_async`` or ``score``
            for sessions that end without a reward), checked once here
            (:func:`~asyncrl.plugin.environment.check_environment`).
        tokenizer: the model's tokenizer (token texts for ``logprobs``, completion prompts).
        parser: the run's tool-call parser (``episode.tool_parser``).
        model_name: the name responses give.
        score_timeout_s: ``failures.reward_timeout_s``.
        agents: runs a managed agent for a session (``None``: agents call in themselves).
        context_tokens: ``episode.max_context_tokens`` (``0``: not known here): a big call
            whose one message certainly exceeds it is refused before it is templated.
        env_name: ``environment.name`` (in messages).

    Raises:
        PluginError: the environment does not keep its contract (a capability of the wrong
            kind), naming it and the member.
    """

    def __init__(
        self,
        config: GatewayConfig,
        environment: Any,
        *,
        tokenizer: Tokenizer,
        parser: ToolCallParser,
        model_name: str,
        score_timeout_s: float,
        agents: Any = None,
        context_tokens: int = 0,
        env_name: str = "environment",
    ) -> None:
        self.config = config
        limits = ((config.max_request_tokens, "gateway.max_request_tokens"),
                  (context_tokens, "episode.max_context_tokens"))  # fmt: skip
        self._token_limit = min(((n, key) for n, key in limits if n), default=None)
        """The fewest tokens a call's conversation may come to, and its key."""
        self._env, self._tok, self._parser = environment, tokenizer, parser
        self._parts = check_environment(environment, env_name)
        """What the environment scores with, found once (``score_async`` or ``score``)."""
        self.model_name = model_name
        self._score_timeout_s = score_timeout_s
        self._agents = agents
        self.sessions = SessionTable()
        self._token_text: dict[int, str] = {}
        self._recorder: anyio.CapacityLimiter | None = None
        """The worker thread that records big calls (made on first use: it needs the loop)."""
        self.stats: dict[str, float] = {"calls": 0, "restarts": 0, "sessions": 0,
                                        "expired_unclaimed": 0, "expired_idle": 0,
                                        "stall_s": 0.0}  # fmt: skip
        """Since the run started: calls served, segments restarted (an agent rewrote its
        history), sessions scored; sessions offered again for want of a first call
        (``gateway.claim_timeout_s``) and failed for want of a next call or a reward
        (``gateway.idle_timeout_s``), and the seconds those sessions waited for nothing."""
        self._since: dict[str, float] = dict(self.stats)

    # ------------------------------------------------------------------ the environment
    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        return self._env.dataset(split)

    @property
    def scores(self) -> bool:
        """Whether the environment can score a session's last answer."""
        return self._parts.scores

    async def run_episode(self, prompt: Prompt, episode: Episode) -> Score:
        """One session: handed to an agent, its calls served, ended by its reward (or scored
        by the environment).

        Raises:
            SessionFailed: its agent went idle, failed or gave it back.
            EpisodeLimit: the session hit ``episode.max_turns``, the context, or
                ``gateway.session_timeout_s`` (truncated).
        """
        managed = self._agents is not None
        session = self.sessions.open(prompt, episode.id, evaluation=episode.evaluation,
                                     claimed=managed)  # fmt: skip
        convo = _Conversation()
        session.serve_with(functools.partial(self._serve, session, episode, convo))
        why = "it ended"
        try:
            if managed:
                error: Exception | None = None
                async with anyio.create_task_group() as tg:
                    await tg.start(self._agents.run, session, self.sessions)
                    try:
                        finish = await self._until_finish(session)
                    except Exception as exc:  # raised as itself, not in an ExceptionGroup
                        error = exc
                    tg.cancel_scope.cancel()  # the agent's process group is killed
                if error is not None:
                    raise error
            else:
                await self._first_call(session)
                finish = await self._until_finish(session)
            score = await self._score(finish, convo, prompt, episode)
            self.stats["sessions"] += 1
            why = "it was scored"
            return score
        except EpisodeLimit as exc:
            why = f"it was truncated ({exc.reason})"
            raise
        except SessionFailed as exc:
            why = f"it failed: {exc}"
            raise
        except BaseException:
            why = "its episode was cancelled (the run is stopping, or its group was aborted)"
            raise
        finally:
            await self.sessions.close(session, why)

    async def _first_call(self, session: Session) -> None:
        """Wait until an agent takes ``session`` (from the lobby) and calls it. One that took
        it and made no call within ``gateway.claim_timeout_s`` lost it (it misread the
        answer, crashed, was cancelled): the session goes back to the lobby under a new id
        and key. Nothing was recorded, so the group's samples are as if the next agent had
        taken it first, and the group does not run again for it."""
        claim_s = self.config.claim_timeout_s
        while True:
            await session.wait_claimed()
            if await session.first_call(claim_s):
                return
            lost = session.id
            self.sessions.reoffer(session, f"no call came within gateway.claim_timeout_s "
                                  f"({claim_s:g} s) of its hand-out: offered again")  # fmt: skip
            self.stats["expired_unclaimed"] += 1
            self.stats["stall_s"] += claim_s
            log.warning("session_reoffered", session=lost, new_id=session.id,
                        episode=session.episode,
                        why=f"no call within gateway.claim_timeout_s ({claim_s:g} s)",
                        fix="an agent calls the base_url of the session it is given (POST "
                        "/rl/sessions answers 201) at once, or gives it back (DELETE "
                        "/rl/sessions/<id>)")  # fmt: skip

    async def _until_finish(self, session: Session) -> Finish:
        """Wait for ``session``'s end while its calls are served (in their handlers' tasks).

        Raises:
            SessionFailed: idle past ``gateway.idle_timeout_s``, or given back.
            EpisodeLimit: a call hit a limit, or the session ran past
                ``gateway.session_timeout_s`` from its hand-out.
        """
        cfg = self.config
        with anyio.CancelScope(deadline=session.claimed_at + cfg.session_timeout_s):
            item = await session.next(cfg.idle_timeout_s)
            if item is None:
                self.stats["expired_idle"] += 1
                self.stats["stall_s"] += cfg.idle_timeout_s
                raise SessionFailed(f"no call and no reward for {cfg.idle_timeout_s:g} s "
                                    "(gateway.idle_timeout_s): the agent went away")  # fmt: skip
            if item.abandon:
                raise SessionFailed(f"given back: {item.abandon}")
            return item
        raise EpisodeLimit("deadline", f"session {session.id} ran past gateway.session_timeout_s "  # type: ignore[arg-type]
                           f"({cfg.session_timeout_s:g} s)")  # fmt: skip

    # ------------------------------------------------------------------ one call
    async def _serve(
        self, session: Session, episode: Episode, convo: _Conversation, call: HttpCall
    ) -> None:
        """Serve one call (in its handler's task): answered or failed on every way out; what
        ends the episode goes to :attr:`HttpCall.raised` for the episode's task."""
        self.stats["calls"] += 1
        try:
            with anyio.CancelScope() as scope:
                if call.serving(scope):
                    big = call.size >= OFF_LOOP_BYTES
                    if call.kind == "chat":
                        result = await self._chat(episode, convo, call.request, big)
                    else:
                        result = await self._complete(episode, convo, call.request, big)
                    call.answer(result)
            if call.cancelled is not None:
                call.fail(call.cancelled)
        except GatewayError as exc:
            call.fail(exc)
        except TrajectoryError as exc:
            convo.broken = True
            call.fail(GatewayError(400, f"the conversation cannot be recorded: {exc}",
                                   param="messages", code="conversation_rejected"))  # fmt: skip
        except EpisodeLimit as exc:
            code = "context_length_exceeded" if exc.reason == "context" else "session_turn_limit"
            call.fail(GatewayError(400, f"{exc}; the session ends here (truncated)", code=code))
            call.raised = exc
        except Exception as exc:  # the episode fails with it (a turn lost for good, a bug)
            call.fail(GatewayError(500, f"session {session.id} failed while serving this call: "
                                   f"{type(exc).__name__}: {exc}", kind="server_error"))  # fmt: skip
            call.raised = exc
        except BaseException:  # this task was cancelled: the server is stopping
            call.fail(GatewayError(503, "the gateway is stopping", code="run_ending"))
            raise

    async def _chat(
        self, episode: Episode, convo: _Conversation, req: ChatRequest, big: bool = False
    ) -> CallResult:
        self._check_api(convo, "chat")
        req.check()
        # what a template renders whole: not an assistant's content (a reasoning trace may go)
        texts = lambda: [template_message(m)["content"] for m in req.messages  # noqa: E731
                         if m.role != "assistant"]  # fmt: skip
        await self._record(big, texts, self._record_chat, episode, convo, req)
        result = await self._generate(episode, convo, req,
                                      self._parser if req.parses_tools else None)  # fmt: skip
        convo.chat.replied([c.reply for c in result.choices])
        convo.api = "chat"
        return result

    def _record_chat(
        self, episode: Episode, convo: _Conversation, req: ChatRequest, restarts: list[bool]
    ) -> None:
        plan = convo.chat.plan(req.messages, req.tools)
        if convo.broken or not isinstance(plan, Continue):
            restarts.append(convo.chat.started)
            episode.restart([template_message(m) for m in req.messages],
                            tool_definitions(req.tools))  # fmt: skip
            convo.chat.restarted(req.messages, req.tools)
            convo.pending, convo.broken, convo.awaiting = [], False, False
        else:
            if plan.choice is not None:
                episode.keep(convo.pending[plan.choice])
                convo.chat.chose(plan.choice)
                convo.pending = []
            if plan.new:
                episode.add_messages(*[template_message(m) for m in plan.new])
                convo.chat.observed(plan.new)
                convo.awaiting = False

    async def _complete(
        self, episode: Episode, convo: _Conversation, req: CompletionRequest, big: bool = False
    ) -> CallResult:
        self._check_api(convo, "completion")
        req.check()
        prompt = req.single_prompt()
        if isinstance(prompt, list):  # token ids: counted before anything is done with them
            self._check_tokens(len(prompt))
        texts = lambda: [prompt] if isinstance(prompt, str) else []  # noqa: E731
        await self._record(big, texts, self._record_completion, episode, convo, prompt)
        result = await self._generate(episode, convo, req, None)
        convo.api = "completion"
        return result

    def _record_completion(
        self, episode: Episode, convo: _Conversation, prompt: str | list[int],
        restarts: list[bool],
    ) -> None:  # fmt: skip
        if not self._goes_on(episode, convo, prompt):
            restarts.append(bool(episode.turns))
            episode.restart_text(prompt)
            convo.pending, convo.broken, convo.awaiting = [], False, False

    async def _record(
        self, big: bool, texts: Callable[[], list[str]], record: Any, episode: Episode,
        *args: Any,
    ) -> None:  # fmt: skip
        """Record a call's messages or prompt with ``record(episode, *args, restarts)`` and
        check ``gateway.max_request_tokens``. ``big``: in the worker thread, after the
        longest of ``texts()`` (its message contents a template renders whole) is counted on a
        prefix when it is long enough to be hopeless (:func:`_too_long`), and the
        conversation is templated and encoded there too (it is read before the engine is
        asked), while the loop goes on; the episode's task waits for the call meanwhile, so
        nothing else touches its record.

        Raises:
            EpisodeLimit: the conversation comes to more than ``gateway.max_request_tokens``,
                or one message to more than that or the context (nothing recorded then).
            TrajectoryError: the template refuses the messages.

        Cancellation: a thread already started finishes first (the record stays whole).
        """
        restarts: list[bool] = []  # whether a segment restarted (counted even if it failed)

        def run() -> int | None:
            if big and self._token_limit is not None:
                longest = max(texts(), key=len, default="")
                limit, key = self._token_limit
                counted = _too_long(self._tok, longest, limit)
                if counted:
                    raise EpisodeLimit("context", f"a message's first {counted} characters "
                                       f"alone come to more than {limit} tokens ({key}): "
                                       "the conversation cannot fit")  # fmt: skip
            record(episode, *args, restarts)
            return episode.context_tokens if big or self.config.max_request_tokens else None

        try:
            if big:
                if self._recorder is None:
                    self._recorder = anyio.CapacityLimiter(1)
                tokens = await anyio.to_thread.run_sync(_unlocked, run, limiter=self._recorder)
            else:
                tokens = run()
        finally:
            self.stats["restarts"] += sum(restarts)
        if tokens is not None:
            self._check_tokens(tokens)

    def _check_tokens(self, tokens: int) -> None:
        """Raises: EpisodeLimit: ``tokens`` are more than ``gateway.max_request_tokens``."""
        limit = self.config.max_request_tokens
        if limit and tokens > limit:
            raise EpisodeLimit("context", f"the call's conversation comes to {tokens} tokens, "
                               f"more than gateway.max_request_tokens ({limit})")  # fmt: skip

    def _goes_on(self, episode: Episode, convo: _Conversation, prompt: str | list[int]) -> bool:
        """Whether a completion ``prompt`` continues what is recorded (after keeping the
        candidate it goes on with, if the last call had several); if so, its new part is
        added as tokens."""
        if convo.broken or not episode.turns:
            return False
        text, ids = episode.recorded
        recorded: Any = text if isinstance(prompt, str) else ids
        if convo.pending:
            picked = self._picked(episode, convo, prompt, recorded)
            if picked is None:
                return False
            episode.keep(convo.pending[picked])
            convo.pending, convo.awaiting = [], True
            text, ids = episode.recorded
            recorded = text if isinstance(prompt, str) else ids
        if prompt[: len(recorded)] != recorded:
            end = convo.end_text
            if not (isinstance(prompt, str) and end and recorded.endswith(end)
                    and prompt.startswith(recorded[: -len(end)])):  # fmt: skip
                return False
            recorded = recorded[: -len(end)]  # the end token stays in what the engine sees
        rest = prompt[len(recorded) :]
        if not rest:
            return not convo.awaiting
        episode.add_tokens(self._tok.encode_rendered(rest) if isinstance(rest, str) else rest)
        convo.awaiting = False
        return True

    def _picked(
        self, episode: Episode, convo: _Conversation, prompt: str | list[int], recorded: Any
    ) -> int | None:
        """Which pending candidate ``prompt`` goes on with (the longest that fits)."""
        best, best_len = None, -1
        for i, c in enumerate(convo.pending):
            if isinstance(prompt, str):
                mine: Any = recorded + episode.preview(c)
            else:
                mine = recorded + np.asarray(c.token_ids).tolist()
            if prompt[: len(mine)] == mine and len(mine) > best_len:
                best, best_len = i, len(mine)
        return best

    async def _generate(
        self, episode: Episode, convo: _Conversation, req: ChatRequest | CompletionRequest,
        parser: ToolCallParser | None,
    ) -> CallResult:
        """Sample the call's ``n`` candidates, cut each at a stop sequence, and keep the
        one (``n`` = 1) or hold them until the next call; ``parser`` reads the replies' tool
        calls (``None``: text only)."""
        limit = req.token_limit if isinstance(req, ChatRequest) else req.max_tokens
        prompt_ids = episode.prompt_ids if req.return_token_ids else []
        prompt_tokens = episode.context_tokens
        started = time.perf_counter()
        candidates = await episode.sample(req.n, max_tokens=limit)
        generate_s = time.perf_counter() - started
        stops = req.stops()
        choices, kept = [], []
        for c in candidates:
            found = self._stop(episode, c, stops)
            if found is not None:
                c = _prefix(c, found[0], "stop")
            text = found[1] if found is not None else None
            if len(candidates) == 1:  # recorded at once (keep() decodes its text)
                kept_text = episode.keep(c).text
                convo.end_text = "" if found is not None else self._end_text(c)
                text = kept_text if text is None else text
            elif text is None:
                text = episode.preview(c)
            kept.append(c)
            versions = (np.full(c.token_ids.size, c.version, np.int32) if c.versions is None
                        else np.asarray(c.versions))  # fmt: skip
            choices.append(Choice(reply_of(text, c.finish_reason, parser),
                                  np.asarray(c.token_ids), np.asarray(c.logprobs), versions))  # fmt: skip
        if len(kept) == 1:
            convo.awaiting = True
        else:
            convo.pending = kept
        convo.answer = choices[0].reply.content or ""
        return CallResult(f"{'chatcmpl' if isinstance(req, ChatRequest) else 'cmpl'}-"
                          f"{secrets.token_hex(12)}", now_s(), self.model_name, choices,
                          prompt_tokens, min(c.version for c in candidates), prompt_ids,
                          generate_s)  # fmt: skip

    def _stop(self, episode: Episode, c: Generated, stops: list[str]) -> tuple[int, str] | None:
        """Where the first stop sequence ends ``c``: the tokens to keep (those that spell
        it), and the text before it; ``None`` when none occurs."""
        n = int(np.asarray(c.token_ids).size)
        return cut_at_stop(lambda k: episode.preview(_prefix(c, k)), n, stops)

    def _end_text(self, c: Generated) -> str:
        """The text of the end token ``c`` ended with (``""``: cut at its token limit)."""
        if c.finish_reason != "stop" or not c.token_ids.size:
            return ""
        return self._tok.decode_verbatim(c.token_ids[-1:])

    def _check_api(self, convo: _Conversation, api: Literal["chat", "completion"]) -> None:
        """Refuse a call through the other API than the session's answered calls used (a
        call refused before it was answered commits the session to neither: it is set when
        one is answered)."""
        if convo.api is not None and convo.api != api:
            other = "/v1/chat/completions" if convo.api == "chat" else "/v1/completions"
            raise GatewayError(400, f"this session calls {other}: a session is one "
                               "conversation through one API; open another session")  # fmt: skip

    # ------------------------------------------------------------------ the end
    async def _score(
        self, finish: Finish, convo: _Conversation, prompt: Prompt, episode: Episode
    ) -> Score:
        if convo.pending:  # the last call had several choices and none was picked: the first
            episode.keep(convo.pending[0])
            convo.pending = []
        if finish.reward is not None or finish.rewards:
            reward = finish.reward if finish.reward is not None else sum(finish.rewards.values())
            return Score(reward=float(reward), correct=bool(finish.correct),
                         components=dict(finish.rewards))  # fmt: skip
        score = await self._scored(prompt, convo.answer)
        if not math.isfinite(float(score.reward)):
            raise SessionFailed(f"score() returned a non-finite reward ({score.reward})")
        return score

    async def _scored(self, prompt: Prompt, answer: str) -> Score:
        """The environment's score of a session's last answer: ``score_async`` awaited, or
        ``score`` on a daemon thread, under ``failures.reward_timeout_s``.

        Raises:
            SessionFailed: it raised, ran past the deadline, or the environment has neither.
        """
        timeout_s = self._score_timeout_s
        late = f"did not return within {timeout_s:g} s (failures.reward_timeout_s)"
        parts = self._parts
        if parts.score_async is not None:
            with anyio.move_on_after(timeout_s) as deadline:
                try:
                    return await parts.score_async(prompt, answer)
                except Exception as exc:
                    raise SessionFailed(f"score_async() raised {type(exc).__name__}: "
                                        f"{exc}") from exc  # fmt: skip
            assert deadline.cancelled_caught
            raise SessionFailed(f"score_async() {late}")
        if parts.score is None:
            raise SessionFailed("the session ended without a reward, and the environment has "
                                "no score(prompt, completion) to score it with")  # fmt: skip
        try:
            return await in_thread(parts.score, prompt, answer, timeout_s=timeout_s)
        except Overdue:
            raise SessionFailed(f"score() {late}") from None
        except Exception as exc:
            raise SessionFailed(f"score() raised {type(exc).__name__}: {exc}") from exc

    def take_metrics(self) -> dict[str, float]:
        """A step record's ``gateway_*`` figures: calls, restarts, sessions scored, sessions
        expired unclaimed (offered again) and idle (failed) and the seconds they waited
        (``gateway_stall_s``), since the last call; sessions waiting for an agent and handed
        out, now."""
        out = {f"gateway_{k}": float(v - self._since[k]) for k, v in self.stats.items()}
        self._since = dict(self.stats)
        counts = self.sessions.counts()
        out["gateway_waiting"] = float(counts["waiting"])
        out["gateway_active"] = float(counts["active"])
        return out

    # ------------------------------------------------------------------ for the HTTP side
    def token_text(self, token: int) -> str:
        """One token's text (``logprobs``), cached."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self._tok.decode_verbatim([token])
        return text


def check_gateway(config: Any, environment: Any, tokenizer: Tokenizer) -> ToolCallParser:
    """What ``[gateway]`` needs of the rest of the run, checked before anything starts; the
    run's tool-call parser.

    Raises:
        ConfigError: no chat template; a managed agent with an environment that has no
            ``score`` (nor ``score_async``).
        PluginError: ``episode.tool_parser`` names no installed parser; the environment does
            not keep its contract (:func:`~asyncrl.plugin.environment.check_environment`).

    The managed agent's command is checked apart, once
    (:func:`~asyncrl_gateway.agent_command.check_agent`: it runs a process).
    """
    from asyncrl.plugin.common import config_error
    from asyncrl.plugin.environment import load_tool_parser

    gw = gateway_config(config)
    if tokenizer.chat_template is None:
        raise config_error("model.chat_template", "the gateway records sessions with the "
                           "model's chat template and the model directory has none",
                           "save one with the tokenizer, or set model.chat_template")  # fmt: skip
    parts = check_environment(environment, config.environment.name)
    if gw.agent and not parts.scores:
        raise config_error("gateway.agent", f"environment {config.environment.name!r} has no "
                           "score(prompt, completion) or score_async to score a managed "
                           "agent's answer", "give the environment a score method, or run "
                           "the agents yourself and post rewards (leave gateway.agent "
                           "empty)")  # fmt: skip
    return load_tool_parser(config.episode.tool_parser, "episode.tool_parser")


def _unlocked(run: Callable[[], Any]) -> Any:
    """``run()`` in a worker thread, every text it encodes encoded with the GIL released."""
    with unlocked():
        return run()


def _too_long(tok: Tokenizer, text: str, limit: int) -> int:
    """How many characters of ``text`` were counted to show that it alone comes to more
    than ``limit`` tokens (``0``: not shown, or not tried). Tried on a text of more than
    ``PREFIX_CHARS_PER_TOKEN`` characters a token of the limit (a margin of 64 tokens
    added): its prefix of that many characters, cut where a word begins (before a space
    that follows a non-space: where the pre-tokenizers of LLM tokenizers, byte-level BPE and
    SentencePiece alike, start a piece, so the prefix is encoded as it is in the whole), is
    encoded; more than the limit there, and more in the whole. A text with no such place
    near the cut is not tried (encoded whole, in the worker thread)."""
    size = PREFIX_CHARS_PER_TOKEN * (limit + 64)
    if len(text) <= size:
        return 0
    ends = list(_WORD_END.finditer(text, max(0, size - 4096), size))
    if not ends:
        return 0
    cut = ends[-1].end()
    return cut if len(tok.encode_rendered(text[:cut])) > limit + 64 else 0


def _prefix(c: Generated, k: int, finish_reason: str | None = None) -> Generated:
    """The first ``k`` tokens of ``c``."""
    versions = None if c.versions is None else np.asarray(c.versions)[:k]
    return dataclasses.replace(
        c, token_ids=np.asarray(c.token_ids)[:k], logprobs=np.asarray(c.logprobs)[:k],
        versions=versions, finish_reason=finish_reason or c.finish_reason,
    )  # fmt: skip
