"""Tools an agent may call: an async Python function with an OpenAI-style JSON-schema definition.

::

    @tool
    async def calc(expression: str, digits: int = 6) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12 + 7 * 3".
            digits: Significant digits of the answer.
        '''

    calc.definition  # {"type": "function", "function": {"name": "calc", "description": ...,
                     #   "parameters": {"type": "object", "properties": {...}, ...}}}

The definition is built from the signature (``str``, ``int``, ``float``, ``bool``,
``list[...]``, ``dict[str, ...]``, ``Literal[...]``, ``X | None``, ``Annotated[X, "doc"]``,
``Any`` for any JSON;
a parameter with a default is optional) and the Google-style docstring (its summary is the
tool's description, its ``Args:`` the parameters'), or given whole with ``parameters=``.
Arguments are checked against it with ``jsonschema`` (:meth:`Tool.check`) before the function
runs; a refusal is a message the model can read, naming the argument.

The calls themselves run in a :class:`~asyncrl.env.toolbox.ToolBox` (deadline, concurrency
limit, errors as observations); generated text becomes :class:`ToolCall` s through a parser of
:mod:`asyncrl.env.tool_parsers`; :func:`tool_message` renders a result as the chat message the
templates expect.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import jsonschema
import msgspec

__all__ = [
    "ERROR_KINDS",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolResult",
    "schema_from_signature",
    "tool",
    "tool_message",
]

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "bad_result")
"""Why a tool call failed: the model's text was not a valid call (``malformed``), named no
tool of the box (``unknown_tool``), broke the tool's schema (``bad_arguments``); the tool
raised (``raised``), ran past its deadline (``timeout``), or returned something that is not
text or JSON (``bad_result``)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI API accepts as a function name
_SECTIONS = re.compile(
    r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?|Cancellation)"
    r":\s*$"
)
_ENTRY = re.compile(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*?)\s*$")
_MAX_ERRORS_SHOWN = 5


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call the model made: the tool's ``name``, its ``arguments`` (a JSON object) and an
    ``id`` that the result's chat message repeats."""

    name: str
    arguments: dict[str, Any]
    id: str
    index: int = 0
    """Its position among the turn's call attempts, from 1 (0: not from a parsed turn)."""


class ToolCallError(msgspec.Struct, frozen=True, kw_only=True):
    """A call attempt in the model's text that is not a valid call (see
    :mod:`asyncrl.env.tool_parsers`): ``message`` is the observation the model reads."""

    index: int
    """Its position among the turn's call attempts, from 1."""
    id: str
    message: str


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to one call: ``content`` is what the model reads next (the tool's output,
    or what went wrong); ``error`` is one of :data:`ERROR_KINDS`, or None."""

    id: str
    name: str
    content: str
    error: str | None = None
    seconds: float = 0.0
    """How long the tool ran (0 when it never started)."""
    waited_s: float = 0.0
    """How long the call waited for the box's concurrency limit."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def message(self) -> dict[str, Any]:
        """The chat message carrying it (:func:`tool_message`)."""
        return tool_message(self.content, call_id=self.id, name=self.name or None)


def tool_message(
    content: str, *, call_id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """A tool's result as the chat message the chat templates expect:
    ``{"role": "tool", "content": ..., "tool_call_id": ..., "name": ...}`` (the id and name
    only when known). Qwen's and Llama 3's templates read the content; Mistral's also the id
    (nine alphanumerics, as :func:`~asyncrl.env.tool_parsers.make_call_id` makes); some read
    the name."""
    message: dict[str, Any] = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    if name is not None:
        message["name"] = name
    return message


class Tool:
    """A tool: ``name``, ``description``, its arguments' JSON schema (``parameters``, an
    object schema) and the async function that runs it, called with the arguments as keyword
    arguments. ``timeout_s`` overrides the box's per-call deadline for this tool.

    Calling the tool (``await calc(expression="1+1")``) calls the function directly: no
    check, no deadline.

    Raises:
        TypeError: ``fn`` is not an async function, the name is not 1-64 of ``[A-Za-z0-9_-]``,
            the description is empty, ``parameters`` is not a valid object schema, or it
            names an argument ``fn`` does not take (or leaves out one ``fn`` needs).
    """

    def __init__(
        self,
        fn: Callable[..., Awaitable[Any]],
        *,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        timeout_s: float | None = None,
    ) -> None:
        _require_async(name, fn)
        if not isinstance(name, str) or not _NAME.match(name):
            raise TypeError(f"tool name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
        if not description or not description.strip():
            raise TypeError(
                f"tool {name!r} has no description: the model reads it to know what the tool "
                "does. Fix: write a docstring, or pass description="
            )
        if timeout_s is not None and not timeout_s > 0:
            raise TypeError(f"tool {name!r}: timeout_s must be > 0, got {timeout_s!r}")
        self.fn = fn
        self.name = name
        self.description = description.strip()
        self.parameters = _checked_schema(name, parameters)
        self.timeout_s = timeout_s
        _check_matches(name, fn, self.parameters)
        self._validator = jsonschema.Draft202012Validator(self.parameters)
        self._ints = frozenset(
            k
            for k, v in self.parameters.get("properties", {}).items()
            if isinstance(v, dict) and v.get("type") == "integer"
        )

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    async def __call__(self, **arguments: Any) -> Any:
        return await self.fn(**arguments)

    @property
    def definition(self) -> dict[str, Any]:
        """The OpenAI-style definition (what a chat template's ``tools=`` takes)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def check(self, arguments: Any) -> dict[str, Any]:
        """``arguments`` checked against the schema; an integer-valued float given for an
        ``integer`` argument (JSON does not tell ``3`` from ``3.0``) becomes an ``int``.

        Raises:
            ValueError: the message the model reads, naming each bad argument (at most
                five) and the parameters it should have used.
        """
        if not isinstance(arguments, dict):
            raise ValueError(
                f"invalid arguments for tool {self.name!r}: they must be a JSON object, got "
                f"{_json_type(arguments)}"
            )
        errors = sorted(
            self._validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.path]
        )
        if errors:
            shown = "; ".join(_describe(e) for e in errors[:_MAX_ERRORS_SHOWN])
            more = len(errors) - _MAX_ERRORS_SHOWN
            raise ValueError(
                f"invalid arguments for tool {self.name!r}: {shown}"
                + (f"; and {more} more" if more > 0 else "")
                + f". Its parameters: {_short_json(self.parameters)}"
            )
        return {
            k: int(v) if k in self._ints and isinstance(v, float) else v
            for k, v in arguments.items()
        }


def tool(
    fn: Callable[..., Awaitable[Any]] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Make a :class:`Tool` of an async function: ``@tool`` or ``@tool(name=..., ...)``.

    The name defaults to the function's; the description to its docstring's summary; the
    parameters to :func:`schema_from_signature`.

    Raises:
        TypeError: as :class:`Tool`, or a parameter whose annotation has no JSON schema
            (see :func:`schema_from_signature`).
    """

    def make(fn: Callable[..., Awaitable[Any]]) -> Tool:
        _require_async(name or getattr(fn, "__name__", "?"), fn)  # before its hints' faults
        summary, _ = _parse_docstring(inspect.getdoc(fn) or "")
        return Tool(
            fn,
            name=name or fn.__name__,
            description=description if description is not None else summary,
            parameters=parameters if parameters is not None else schema_from_signature(fn),
            timeout_s=timeout_s,
        )

    return make(fn) if fn is not None else make


def schema_from_signature(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s keyword arguments, from its type hints and its docstring's
    ``Args:`` section: an object schema with ``additionalProperties: false``, every
    parameter without a default ``required``, and a parameter's JSON-serializable default as
    its ``default``.

    Raises:
        TypeError: a parameter without a type hint, one whose hint has no JSON schema, or a
            ``*args``/``**kwargs``/positional-only parameter (naming it and the fix).
    """
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # a name in a string annotation that does not resolve
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!s}: its type hints do not resolve "
                        f"({type(exc).__name__}: {exc})") from exc  # fmt: skip
    _, docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        where = f"{getattr(fn, '__qualname__', fn)!s}({p.name})"
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"{where}: a tool takes named arguments only; make it a plain one")
        if p.name not in hints:
            raise TypeError(f"{where} has no type hint. Fix: annotate it (str, int, ...)")
        schema = _schema_of(hints[p.name], where)
        if p.name in docs and "description" not in schema:
            schema = {**schema, "description": docs[p.name]}
        if p.default is p.empty:
            required.append(p.name)
        elif _is_json(p.default):
            schema = {**schema, "default": p.default}
        properties[p.name] = schema
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema_of(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint is list or origin is list:
        return {"type": "array", **({"items": _schema_of(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings; use dict[str, ...]")
        extra = {"additionalProperties": _schema_of(args[1], where)} if args else {}
        return {"type": "object", **extra}
    if origin is Literal:
        kinds = {_SCALARS.get(type(a)) for a in args}
        if None in kinds:
            raise TypeError(f"{where}: Literal values must be str, int, float or bool")
        return {"type": kinds.pop(), "enum": list(args)} if len(kinds) == 1 else {
            "enum": list(args)
        }
    if origin is typing.Annotated:
        schema = _schema_of(args[0], where)
        notes = [a for a in args[1:] if isinstance(a, str)]
        return {**schema, "description": notes[0]} if notes else schema
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = [_schema_of(a, where) for a in rest]
        if len(rest) < len(args):  # X | None
            if len(inner) == 1 and set(inner[0]) == {"type"}:
                return {"type": [inner[0]["type"], "null"]}
            inner.append({"type": "null"})
        return inner[0] if len(inner) == 1 else {"anyOf": inner}
    raise TypeError(
        f"{where}: no JSON schema for the type {hint!r}. Fix: use str, int, float, bool, "
        "list[...], dict[str, ...], Literal[...] or X | None, or pass parameters= to @tool"
    )


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's summary (its paragraphs before the first section, each
    on one line) and its ``Args:`` entries (``name: text`` or ``name (type): text``,
    continued on lines indented deeper)."""
    paragraphs: list[list[str]] = [[]]
    args: dict[str, list[str]] = {}
    section: str | None = None
    current: str | None = None
    entry_indent = -1
    for line in doc.splitlines():
        header = _SECTIONS.match(line)
        if header:
            section, current, entry_indent = header.group(1), None, -1
        elif section is None:
            if line.strip():
                paragraphs[-1].append(line.strip())
            elif paragraphs[-1]:
                paragraphs.append([])
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            entry = _ENTRY.match(line)
            if entry and entry_indent in (-1, _indent(line)):
                current, entry_indent = entry.group(1), _indent(line)
                args[current] = [entry.group(2)]
            elif current is not None:
                args[current].append(line.strip())
    summary = "\n\n".join(" ".join(p) for p in paragraphs if p)
    return summary, {k: " ".join(" ".join(v).split()) for k, v in args.items()}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _require_async(name: str, fn: Callable[..., Any]) -> None:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"tool {name!r}: {fn!r} is not an async function. Fix: write it as "
            "`async def`; run blocking code inside it with "
            "`await asyncrl.env.toolbox.blocking(fn, *args)`"
        )


def _checked_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise TypeError(
            f"tool {name!r}: parameters must be a JSON object schema "
            '({"type": "object", "properties": {...}}), got ' + _short_json(parameters)
        )
    try:
        jsonschema.Draft202012Validator.check_schema(dict(parameters))
    except jsonschema.SchemaError as exc:
        raise TypeError(f"tool {name!r}: parameters is not a valid JSON schema: "
                        f"{exc.message}") from None  # fmt: skip
    if not _is_json(parameters):
        raise TypeError(f"tool {name!r}: parameters must be plain JSON (dicts, lists, ...)")
    return json.loads(json.dumps(parameters))  # a private copy: the caller's may change


def _check_matches(name: str, fn: Callable[..., Any], schema: dict[str, Any]) -> None:
    """Every argument the schema allows is one ``fn`` takes, and every one ``fn`` needs is
    required by the schema."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = set(schema.get("properties", {})) - named
    needed = {n for n in named if params[n].default is params[n].empty}
    missing = needed - set(schema.get("required", []))
    if unknown or missing:
        raise TypeError(
            f"tool {name!r}: its schema and its function disagree: "
            + (f"the schema has {sorted(unknown)} that {fn.__name__} does not take; "
               if unknown else "")
            + (f"{fn.__name__} needs {sorted(missing)} that the schema does not require"
               if missing else "")
        )  # fmt: skip


def _describe(error: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    where = f"argument {path[1:]!r}" if path else "arguments"
    if error.validator == "required":
        return error.message.replace("is a required property", "is missing (required)")
    return f"{where}: {error.message}"


def _json_type(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "an array", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _short_json(value: Any, limit: int = 600) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
