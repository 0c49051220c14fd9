"""Tool calls in generated text, per model family: the ``asyncrl.tool_parsers`` plugin group.

A parser turns an assistant turn's text into :class:`~asyncrl.env.tools.ToolCall` s and
reports each malformed call attempt as a :class:`~asyncrl.env.tools.ToolCallError`, whose
message is the observation the model reads (``error: your tool call #2 is not valid JSON:
...``). It never raises on any text. The built-ins::

    hermes       Qwen2.5, Qwen3, Hermes: any number of
                 <tool_call>\\n{"name": "calc", "arguments": {"expression": "1+2"}}\\n</tool_call>
                 (Qwen3's reasoning, up to its </think>, is not read)
    llama3_json  Llama 3.1-3.3: the whole turn is {"name": "calc", "parameters": {...}},
                 optionally after <|python_tag|>; several are separated by ";"
    mistral      Mistral: [TOOL_CALLS] followed by a JSON list of
                 {"name": ..., "arguments": {...}, "id": ...} (the id is optional)

A plugin registers an object with a ``name`` and a ``parse(text) -> ParsedTurn`` method (or a
class that makes one with no arguments)::

    [project.entry-points."asyncrl.tool_parsers"]
    my_family = "my_plugin.parsing:PARSER"

and :func:`load_tool_parser` finds it. A call without an id of its own gets
:func:`make_call_id` (nine hex digits, as Mistral's templates want; the same text gives the
same ids).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol, runtime_checkable

import msgspec

from asyncrl import registry
from asyncrl.env.tools import ToolCall, ToolCallError
from asyncrl.errors import PluginError

__all__ = [
    "GROUP",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedTurn",
    "ToolCallParser",
    "load_tool_parser",
    "make_call_id",
]

GROUP = "asyncrl.tool_parsers"
_SNIPPET = 80


class ParsedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """An assistant turn read for tool calls: ``content`` is its text outside the calls
    (stripped), ``calls`` the valid calls and ``errors`` the malformed ones, each numbered
    by its place among the turn's attempts (``index``, from 1)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ToolCallError, ...] = ()

    @property
    def attempted(self) -> bool:
        """The model tried to call a tool (validly or not)."""
        return bool(self.calls or self.errors)

    def assistant_message(self) -> dict[str, Any]:
        """The turn as an OpenAI-style chat message (``tool_calls`` with dict arguments, as
        Hugging Face chat templates render them); malformed calls are left out."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]  # fmt: skip
        return message


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads one model family's tool calls. ``parse`` must not raise on any text."""

    name: str

    def parse(self, text: str) -> ParsedTurn: ...


def make_call_id(text: str, index: int) -> str:
    """A call id for the ``index``-th attempt of the turn ``text``: nine hex digits (Mistral's
    templates refuse any other shape), the same for the same turn."""
    data = f"{index}\0{text}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=8).hexdigest()[:9]


def load_tool_parser(name: str, field: str | None = None) -> ToolCallParser:
    """The parser registered as ``name`` in ``asyncrl.tool_parsers``.

    Raises:
        PluginError: not installed (naming ``field`` and what is installed), registered
            twice, failing to import, or not a parser (no ``parse`` method).
    """
    found = registry.load(GROUP, name, field)
    parser = found() if isinstance(found, type) else found
    if not callable(getattr(parser, "parse", None)):
        where = f"{field}: " if field else ""
        raise PluginError(
            f"{where}tool-call parser {name!r} is a {type(parser).__name__}, not a parser: "
            "register an object with a parse(text) -> ParsedTurn method"
        )
    return parser


class _Calls:
    """The calls and errors of one turn, numbered in the order they are met."""

    def __init__(self, text: str, example: str) -> None:
        self.text = text
        self.example = example
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallError] = []
        self._decoder = json.JSONDecoder(parse_constant=_no_constant)

    def _next(self) -> int:
        return len(self.calls) + len(self.errors) + 1

    def error(self, problem: str) -> None:
        """The next attempt is malformed: ``problem`` completes "your tool call #n ..."."""
        n = self._next()
        message = f"error: your tool call #{n} {problem}. Write a call as: {self.example}"
        self.errors.append(ToolCallError(index=n, id=make_call_id(self.text, n), message=message))

    def decode(self, body: str, pos: int = 0, lead: str = "is") -> tuple[Any, int] | None:
        """The JSON value at ``body[pos:]`` (leading blanks skipped) and where it ends, or
        None after recording why it is not valid JSON ("your tool call #n {lead} not valid
        JSON: ...")."""
        while pos < len(body) and body[pos].isspace():
            pos += 1
        try:
            value, end = self._decoder.raw_decode(body, pos)
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            self.error(f"{lead} not valid JSON: it is nested too deeply")
            return None
        except UnicodeEncodeError:
            self.error(f"{lead} not valid JSON: it holds a lone surrogate escape (\\udXXX)")
            return None
        except ValueError as exc:
            self.error(f"{lead} not valid JSON: {_cut(str(exc))}")
            return None
        return value, end

    def try_decode(self, text: str, pos: int) -> tuple[Any, int] | None:
        """The JSON value at ``text[pos:]`` (leading blanks skipped) and where it ends, or
        None (nothing recorded) when there is none, or none that is plain unicode."""
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, end = self._decoder.raw_decode(text, pos)
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            return None
        return value, end

    def add(self, value: Any, arguments_key: str, also: str | None = None) -> None:
        """One decoded call object: ``{"name": str, arguments_key: object}`` (``also`` is
        accepted for the arguments too; no arguments means ``{}``)."""
        if not isinstance(value, dict):
            return self.error(f"is not a JSON object (it is {_json_type(value)})")
        if "name" not in value:
            return self.error('has no "name"')
        name = value["name"]
        if not isinstance(name, str) or not name:
            return self.error(f'has a "name" that is not a non-empty string ({_cut(repr(name))})')
        key = arguments_key if arguments_key in value or also not in value else also
        arguments = value.get(key, {})
        if not isinstance(arguments, dict):
            hint = " (write the object itself, not a string holding it)" if isinstance(
                arguments, str) else ""  # fmt: skip
            return self.error(
                f'has "{key}" that is not a JSON object (it is {_json_type(arguments)}){hint}'
            )
        n = self._next()
        given = value.get("id")
        call_id = given if isinstance(given, str) and given else make_call_id(self.text, n)
        self.calls.append(ToolCall(name=name, arguments=arguments, id=call_id, index=n))
        return None

    def turn(self, content: str) -> ParsedTurn:
        return ParsedTurn(content=content.strip(), calls=tuple(self.calls),
                          errors=tuple(self.errors))  # fmt: skip


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks anywhere in the turn (Qwen2.5, Qwen3,
    Hermes). A JSON string may hold ``</tool_call>``. A last block left open (the turn ended
    at a stop string or the token limit) is a call when it holds a whole call; a block
    holding another ``<tool_call>`` is malformed and the inner one is read on its own. Qwen3's
    reasoning is not read (see :func:`_after_reasoning`)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    EXAMPLE = '<tool_call>\n{"name": "<tool>", "arguments": {<arguments>}}\n</tool_call>'

    def parse(self, text: str) -> ParsedTurn:
        calls = _Calls(text, self.EXAMPLE)
        start = _after_reasoning(text, self.OPEN)
        content, pos = [text[:start]], start
        while (i := text.find(self.OPEN, pos)) >= 0:
            content.append(text[pos:i])
            pos = self._block(calls, text, i + len(self.OPEN))
        content.append(text[pos:])
        return calls.turn("".join(content))

    def _block(self, calls: _Calls, text: str, body_at: int) -> int:
        """Read the block whose JSON starts at ``body_at``; where reading goes on."""
        whole = calls.try_decode(text, body_at)  # a JSON string may hold the closing tag
        if whole is not None:
            value, end = whole
            rest = text[end:].lstrip()
            if rest.startswith(self.CLOSE) or (not rest and isinstance(value, dict)):
                calls.add(value, "arguments")
                return len(text) - len(rest) + (len(self.CLOSE) if rest else 0)
        j = text.find(self.CLOSE, body_at)
        body = text[body_at:] if j < 0 else text[body_at:j]
        nested = body.find(self.OPEN)
        if nested >= 0:
            calls.error(f"holds another {self.OPEN} before its {self.CLOSE}")
            return body_at + nested
        lead = "is" if j >= 0 else f"is not closed with {self.CLOSE} and is"
        decoded = calls.decode(body, lead=lead)
        if decoded is not None:
            value, end = decoded
            if body[end:].strip():
                calls.error(f"has text after its JSON: {_cut(body[end:].strip())!r}")
            elif j < 0:
                calls.error(f"is not closed with {self.CLOSE}")
            else:
                calls.add(value, "arguments")
        return len(text) if j < 0 else j + len(self.CLOSE)


class Llama3JsonParser:
    """A turn that is one or more JSON calls ``{"name": ..., "parameters": {...}}``
    (``"arguments"`` is accepted too) separated by ``;``, optionally after
    ``<|python_tag|>`` (Llama 3.1-3.3). A turn that starts with neither ``{`` nor the tag is
    plain text."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    EXAMPLE = '{"name": "<tool>", "parameters": {<arguments>}} as the whole turn'

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        if tagged:
            body = body[len(self.TAG) :]
        elif not body.startswith("{"):
            return ParsedTurn(content=body)
        calls = _Calls(text, self.EXAMPLE)
        pos = 0
        while (decoded := calls.decode(body, pos)) is not None:
            value, pos = decoded
            calls.add(value, "parameters", also="arguments")
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest:
                break
            if not rest.startswith("{"):
                calls.error(f"is text that is not a JSON call: {_cut(rest)!r}")
                break
            pos = len(body) - len(rest)
        return calls.turn("")


class MistralParser:
    """``[TOOL_CALLS]`` followed by a JSON list of calls ``{"name": ..., "arguments": {...},
    "id": ...}`` (a single object is accepted too, and several markers); the text before the
    first marker is the content."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"
    EXAMPLE = '[TOOL_CALLS][{"name": "<tool>", "arguments": {<arguments>}}]'

    def parse(self, text: str) -> ParsedTurn:
        first = text.find(self.MARK)
        if first < 0:
            return ParsedTurn(content=text.strip())
        calls = _Calls(text, self.EXAMPLE)
        pos = first + len(self.MARK)
        while pos >= 0:
            pos = self._segment(calls, text, pos)
        return calls.turn(text[:first])

    def _segment(self, calls: _Calls, text: str, pos: int) -> int:
        """Read the calls after a marker (at ``pos``); where the next marker's calls start,
        or -1 at the end. A JSON string may hold the marker."""
        whole = calls.try_decode(text, pos)
        if whole is None:  # the error, from the text up to the next marker
            after = text.find(self.MARK, pos)
            decoded = calls.decode(text[pos:] if after < 0 else text[pos:after])
            if decoded is not None:  # never: a JSON value that a prefix holds, all holds
                self._add(calls, decoded[0])
            return -1 if after < 0 else after + len(self.MARK)
        value, end = whole
        self._add(calls, value)
        rest = text[end:].lstrip()
        if not rest:
            return -1
        if rest.startswith(self.MARK):
            return len(text) - len(rest) + len(self.MARK)
        after = text.find(self.MARK, end)
        garbage = (text[end:] if after < 0 else text[end:after]).strip()
        calls.error(f"is text after the calls: {_cut(garbage)!r}")
        return -1 if after < 0 else after + len(self.MARK)

    @staticmethod
    def _add(calls: _Calls, value: Any) -> None:
        for item in value if isinstance(value, list) else [value]:
            calls.add(item, "arguments")
        if isinstance(value, list) and not value:
            calls.error("is an empty list")


HERMES = HermesParser()
LLAMA3_JSON = Llama3JsonParser()
MISTRAL = MistralParser()


def _after_reasoning(text: str, call_tag: str) -> int:
    """Where calls may start: after the reasoning, which ends at the first ``</think>`` when
    the turn opens with ``<think>`` (Qwen3) or when that comes before any call (a template
    that opens the reasoning in the prompt); a ``<think>`` never closed is all reasoning.
    So a call's arguments may hold ``</think>``."""
    close = text.find("</think>")
    opened = text.lstrip().startswith("<think>")
    if close < 0:
        return len(text) if opened else 0
    first_call = text.find(call_tag)
    if opened or first_call < 0 or close < first_call:
        return close + len("</think>")
    return 0


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_type(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "an array", dict: "an object", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _cut(text: str) -> str:
    return text if len(text) <= _SNIPPET else text[: _SNIPPET - 1] + "…"
