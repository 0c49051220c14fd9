"""The tiny model's chat template and its tool-call syntax (``name(argument)``).

The character vocabulary (:data:`asyncrl_arith.model.CHARS`) has no ``<``, ``>``, ``{``, ``"``
or newline, so neither a ChatML-style template nor Hermes' ``<tool_call>{json}</tool_call>``
can be written with it. The template here uses the vocabulary's characters and the two special
tokens ``<bos>``/``<eos>`` only::

    <bos>12+345+67=calc(12+345+67)<eos>r:424=424<eos>wrong, try again=
         └ user ─┘└──── assistant ────┘└ t ┘└ asst ─┘└──── user ────┘  (t: tool)

A user (or system) message is its content; an assistant message is ``=``, its content, then
``<eos>`` (the model's end of turn); a tool message is ``r:`` and its content; the generation
prompt is ``=``. A conversation that opens with one user message is therefore the single-turn
demo's prompt (``<bos>38+45=``), so the demo's warm start reads it. Each message's text is
copied verbatim and the ``=`` that opens an assistant turn is the generation prompt before it:
re-rendering a longer conversation always starts with the text of a shorter one (the prefix
property of docs/environments.md, "Trajectories"; tested over random conversations).

Tool calls are written ``calc(12+345+67)``: :class:`CompactParser`, registered as ``compact``
in ``asyncrl.tool_parsers``, reads them (``[episode] tool_parser = "compact"``).
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.plugin.environment import ParsedTurn, ToolCall, ToolCallError, make_call_id

__all__ = ["PARSER", "TEMPLATE", "TEMPLATE_FILE", "CompactParser", "write_chat_template"]

TEMPLATE = (
    "<bos>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}={{ m.content }}<eos>"
    "{%- elif m.role == 'tool' -%}r:{{ m.content }}"
    "{%- elif m.role == 'user' or m.role == 'system' -%}{{ m.content }}"
    "{%- else -%}{{ raise_exception('the tiny model knows the roles user, assistant, tool and "
    "system, not ' ~ m.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}={%- endif -%}"
)
"""The template (``chat_template.jinja`` in a model directory with episodes); see the module
docstring. ``tools`` are not shown: the tiny model learns its one tool from its warm start."""

TEMPLATE_FILE = "chat_template.jinja"


def write_chat_template(model_dir: str | Path) -> Path:
    """Write :data:`TEMPLATE` as ``model_dir/chat_template.jinja`` (where
    :meth:`asyncrl.plugin.environment.ChatTemplate.from_model` looks first); returns its path."""
    path = Path(model_dir) / TEMPLATE_FILE
    path.write_text(TEMPLATE)
    return path


_NAME = re.compile(r"[a-z][a-z0-9_]*\(")


class CompactParser:
    """Tool calls written ``name(argument)`` anywhere in a turn (the tiny model's syntax).

    A call is a lower-case name (``[a-z][a-z0-9_]*``, not preceded by a letter or ``_``)
    right before ``(``; its argument is the text up to the matching ``)``
    (parentheses nest: ``calc((1+2)*3)``) and becomes ``{argument: text}``, so each tool it
    calls takes one string parameter of that name (``expression`` by default). The text
    outside the calls is the turn's content; a ``(`` after no name is content too.

    Malformed attempts are errors the model reads: a call never closed (``calc(12+3``), or
    one with an empty argument (``calc()``). The messages use the vocabulary's characters only
    (no ``#``, unlike the built-in parsers' ``error: your tool call #n``): what the model
    cannot read it cannot learn from. ``parse`` never raises.
    """

    name = "compact"

    def __init__(self, argument: str = "expression", example: str = "calc(12+345+67)") -> None:
        self.argument = argument
        self.example = example

    def parse(self, text: str) -> ParsedTurn:
        """The calls and malformed call attempts in ``text``, numbered from 1 in order."""
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        content: list[str] = []
        pos = 0
        while (m := self._next_name(text, pos)) is not None:
            start, open_at = m.start(), m.end() - 1
            close = _matching(text, open_at)
            content.append(text[pos:start])
            n = len(calls) + len(errors) + 1
            call_id = make_call_id(text, n)
            if close is None:
                errors.append(self._error(n, call_id, "is not closed with )"))
                pos = len(text)
                break
            argument = text[open_at + 1 : close]
            if not argument.strip():
                errors.append(self._error(n, call_id, "is empty"))
            else:
                name = text[start:open_at]
                calls.append(ToolCall(name=name, arguments={self.argument: argument},
                                      id=call_id, index=n))  # fmt: skip
            pos = close + 1
        content.append(text[pos:])
        return ParsedTurn(content="".join(content).strip(), calls=tuple(calls),
                          errors=tuple(errors))  # fmt: skip

    @staticmethod
    def _next_name(text: str, pos: int) -> re.Match[str] | None:
        """The next ``name(`` at or after ``pos`` not inside a longer name (a digit before
        it is fine: ``1368calc(...)`` is an answer, then a call)."""
        while (m := _NAME.search(text, pos)) is not None:
            before = text[m.start() - 1] if m.start() > 0 else ""
            if not (before.isalpha() or before == "_"):
                return m
            pos = m.start() + 1
        return None

    def _error(self, n: int, call_id: str, problem: str) -> ToolCallError:
        message = f"error: tool call {n} {problem}, write a call as {self.example}"
        return ToolCallError(index=n, id=call_id, message=message)


def _matching(text: str, open_at: int) -> int | None:
    """The index of the ``)`` closing the ``(`` at ``open_at``, or ``None``."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return None


PARSER = CompactParser()
"""Entry point ``asyncrl.tool_parsers:compact``."""
