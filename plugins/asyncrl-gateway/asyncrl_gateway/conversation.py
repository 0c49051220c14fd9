"""One session's conversation as the agent sees it, against what the episode recorded (pure).

An OpenAI client sends the whole conversation with every call. The episode (its
:class:`~asyncrl.plugin.environment.Trajectory`) records tokens: the prompt rendered once, each
turn's ids exactly as the engine generated them, each observation rendered once and appended.
:class:`ChatLog` holds the same conversation message by message, in the agent's terms (the
replies as the gateway returned them: tool calls parsed, stop sequences cut), and tells for
each call what it adds (:class:`Continue`: the messages after what is recorded, an
observation) or that the agent rewrote what came before (:class:`Restart`: it dropped or
edited a message, changed its tools, or asked again at the same place), so the episode goes on
from the agent's messages in a new training segment (``Episode.restart``).

Messages are compared on what changes what the model reads: role, text, tool calls (name,
arguments as parsed JSON, id) and ``tool_call_id``; ``None`` and ``""`` contents are the same,
text parts are joined, and whatever else a client adds when it echoes a message back
(``refusal``, ``annotations``, ``name`` on an assistant message) is ignored.

:func:`reply_of` turns a turn's text into what the agent gets: the text up to a stop sequence,
then tool calls read by the run's parser (a turn with a malformed call attempt is returned as
text, as vLLM's parsers do). :func:`cut_at_stop` finds how many of the turn's tokens that text
takes: only those are recorded, and they train.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.plugin.environment import ToolCallParser
from asyncrl_gateway.schema import Message, ToolDef

__all__ = [
    "ChatLog",
    "Continue",
    "ModelReply",
    "Restart",
    "cut_at_stop",
    "reply_of",
    "template_message",
    "tool_definitions",
]

Key = tuple[Any, ...]


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content)


def _arguments(text: str) -> Any:
    """A call's arguments for comparison and for the template: parsed JSON, or the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def message_key(m: Message) -> Key:
    calls = tuple(
        (c.id, c.function.name, _canonical(_arguments(c.function.arguments)))
        for c in m.tool_calls or ()
    )
    return (m.role, _text(m.content), calls, m.tool_call_id or "")


def template_message(m: Message) -> dict[str, Any]:
    """``m`` as a chat template reads it: text content, tool calls with their arguments as
    objects (as Hugging Face templates render them)."""
    out: dict[str, Any] = {"role": m.role, "content": _text(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def tool_definitions(tools: Sequence[ToolDef] | None) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template gets them (OpenAI-style dicts)."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


@dataclass(frozen=True)
class ModelReply:
    """One choice as the agent gets it."""

    content: str | None
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    """``(id, name, arguments as JSON text)`` per call."""
    finish_reason: str = "stop"
    """``stop``, ``length`` or ``tool_calls``."""

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in self.tool_calls
            ]  # fmt: skip
        return out

    def key(self) -> Key:
        calls = tuple((i, n, _canonical(_arguments(a))) for i, n, a in self.tool_calls)
        return ("assistant", self.content or "", calls, "")


def cut_at_stop(text_of: Callable[[int], str], n: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop sequence ends a turn of ``n`` tokens whose first ``k`` tokens read
    ``text_of(k)``: ``(k, text)`` with ``k`` the fewest tokens whose text holds the whole stop
    sequence and ``text`` what comes before it; ``None`` when no stop sequence occurs."""
    if not stops or n == 0:
        return None
    full = text_of(n)
    found = [(i, s) for s in stops if (i := full.find(s)) >= 0]
    if not found:
        return None
    at, stop = min(found)
    end = at + len(stop)
    lo, hi = 1, n  # text_of(hi) holds it; find the fewest tokens that do
    while lo < hi:
        mid = (lo + hi) // 2
        if len(text_of(mid)) >= end and text_of(mid)[at:end] == stop:
            hi = mid
        else:
            lo = mid + 1
    return lo, full[:at]


def reply_of(text: str, finish_reason: str, parser: ToolCallParser | None) -> ModelReply:
    """The agent's view of a turn's ``text`` (already cut at a stop sequence): tool calls read
    by ``parser`` when it is given (the request has tools and ``tool_choice`` is not
    ``"none"``)."""
    reason = "length" if finish_reason == "length" else "stop"
    if parser is None:
        return ModelReply(text, (), reason)
    parsed = parser.parse(text)
    if parsed.errors or not parsed.calls:
        return ModelReply(text, (), reason)
    calls = tuple((c.id, c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in parsed.calls)
    return ModelReply(parsed.content or None, calls, "tool_calls")


@dataclass(frozen=True)
class Continue:
    """The call goes on from what is recorded: ``new`` are the messages after it (an
    observation; may be empty after a call that was cancelled), ``choice`` the candidate of the
    last call the agent went on with (``None``: that call had one)."""

    new: list[Message]
    choice: int | None = None


@dataclass(frozen=True)
class Restart:
    """The agent rewrote the conversation: go on from its ``messages``. ``why`` says what
    differed (for the log)."""

    messages: list[Message]
    why: str


class ChatLog:
    """The conversation recorded, in the agent's terms (see the module docstring). One per
    chat session; :meth:`plan` reads a call, and the session reports what the episode
    recorded with :meth:`restarted`, :meth:`observed` and :meth:`replied`."""

    def __init__(self) -> None:
        self._keys: list[Key] = []
        self._tools = ""
        self._started = False
        self._awaiting = False
        """A reply was recorded and no observation yet (a call adding nothing asks again)."""
        self._choices: list[Key] = []
        """The replies of a call with ``n`` > 1 waiting for the agent to pick one."""

    @property
    def started(self) -> bool:
        """Whether a call was recorded (the next restart is a real one)."""
        return self._started

    def plan(self, messages: Sequence[Message], tools: Sequence[ToolDef] | None) -> Continue | Restart:
        keys = [message_key(m) for m in messages]
        if not self._started:
            return Restart(list(messages), "the session's first call")
        if _canonical(tool_definitions(tools)) != self._tools:
            return Restart(list(messages), "the tools changed")
        k = len(self._keys)
        if keys[:k] != self._keys:
            at = next((i for i, (a, b) in enumerate(zip(keys, self._keys)) if a != b), len(keys))
            return Restart(list(messages), f"message {at} differs from the one recorded"
                           if at < min(len(keys), k) else "the call has fewer messages than "
                           "the conversation recorded")  # fmt: skip
        if self._choices:
            if len(keys) > k + 1 and keys[k] in self._choices:
                return Continue(list(messages[k + 1 :]), self._choices.index(keys[k]))
            return Restart(list(messages), "the call goes on with none of the last call's choices")
        new = list(messages[k:])
        if not new and self._awaiting:
            return Restart(list(messages), "the call asks again where a reply was given")
        return Continue(new)

    def restarted(self, messages: Sequence[Message], tools: Sequence[ToolDef] | None) -> None:
        self._keys = [message_key(m) for m in messages]
        self._tools = _canonical(tool_definitions(tools))
        self._started, self._awaiting, self._choices = True, False, []

    def observed(self, messages: Sequence[Message]) -> None:
        """``messages`` were recorded after the last reply (the kept choice included, when a
        call had several)."""
        if messages:
            self._keys.extend(message_key(m) for m in messages)
            self._awaiting = False

    def chose(self, choice: int) -> None:
        """The agent went on with candidate ``choice`` of the last call."""
        self._keys.append(self._choices[choice])
        self._choices = []
        self._awaiting = True

    def replied(self, replies: Sequence[ModelReply]) -> None:
        """A call was answered: one reply (recorded), or several (one to be chosen)."""
        if len(replies) == 1:
            self._keys.append(replies[0].key())
            self._awaiting = True
        else:
            self._choices = [r.key() for r in replies]
