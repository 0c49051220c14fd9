"""The OpenAI-compatible wire format of the gateway: requests validated by msgspec, errors and
responses as OpenAI writes them (pure; no I/O).

Requests are decoded straight from the body's bytes into typed structs: a wrong type, a value
out of range or a missing field is a :class:`GatewayError` (status 400) whose message names the
parameter, as OpenAI's ``invalid_request_error`` does. Fields the OpenAI API has and this
gateway ignores without changing what is generated (``user``, ``metadata``, ``store``,
``service_tier``, ...) and fields clients add when they echo a message back (``refusal``,
``annotations``, ``audio``) are accepted and dropped. A parameter that would change what is
sampled, and that the gateway cannot honour without training on something other than what the
engine sampled, is refused with a 400 naming it (:func:`unsupported`): ``top_logprobs`` > 0,
``logit_bias``, non-zero penalties, a ``response_format`` other than text, and
``tool_choice`` ``"required"`` or a named function (they need constrained decoding).

Why msgspec and not the ``openai`` package's pydantic types or vLLM's protocol module: msgspec
is already what every asyncrl message is made of, it decodes and validates a request in one
pass from bytes (a few microseconds for a chat request), and it keeps torch, pydantic and vLLM
out of the controller (``import asyncrl`` never imports torch).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta, Struct

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "FunctionDef",
    "GatewayError",
    "Message",
    "RewardRequest",
    "SessionRequest",
    "ToolDef",
    "check_lengths",
    "decode",
    "error_body",
    "json_values",
    "unsupported",
]

MAX_N = 16
"""Most choices one call may ask for (``n``)."""
MAX_STOP = 4
"""Most stop sequences (OpenAI's limit)."""


class GatewayError(Exception):
    """A request the gateway refuses, as an HTTP status and an OpenAI-style error body.

    Attributes:
        status: the HTTP status (400 bad request, 401, 403, 404, 409, 410, 413, 429, 503).
        kind: the error's ``type`` (``invalid_request_error``, ``authentication_error``, ...).
        param: the request parameter at fault, if one is.
        code: a short machine-readable code (``context_length_exceeded``, ...).
    """

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(str(self), kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str, *, kind: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> bytes:
    """An OpenAI error response body."""
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


# ------------------------------------------------------------------ chat messages and tools
class FunctionCall(Struct):
    name: str
    arguments: str
    """JSON text, as OpenAI sends and expects it."""


class MessageToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(Struct):
    """One chat message as a client sends it (its extra fields are dropped)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    """Text, or a list of content parts (only ``{"type": "text", "text": ...}`` parts)."""
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(Struct):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(Struct):
    include_usage: bool = False


class ResponseFormat(Struct):
    type: str


PositiveInt = Annotated[int, Meta(ge=1)]
Stop = str | Annotated[list[str], Meta(max_length=MAX_STOP)] | None


class _Sampling(Struct, kw_only=True):
    """What chat and text completions share."""

    model: str = ""
    """Any name is accepted (an agent may hard-code one); responses name the served model."""
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stop: Stop = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    """vLLM's extension: the prompt's and each choice's token ids in the response (an agent
    that keeps its own token stream goes on from them exactly)."""

    def stops(self) -> list[str]:
        """The stop sequences, as a list (empty ones dropped)."""
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    def _refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, "penalties change the sampled distribution, and the "
                                  "trainer must see the distribution that was sampled")  # fmt: skip
        if self.logit_bias:
            raise unsupported("logit_bias", "a bias changes the sampled distribution, and the "
                              "trainer must see the distribution that was sampled")  # fmt: skip


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        """Refuse what the gateway cannot serve faithfully (see the module docstring).

        Raises:
            GatewayError: 400 naming the parameter.
        """
        self._refuse_unsupported()
        if self.top_logprobs:
            raise unsupported("top_logprobs", "the engine reports the sampled token's logprob "
                              "only; ask for logprobs=true with top_logprobs 0")  # fmt: skip
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported("response_format", f"{self.response_format.type!r} needs "
                              "constrained decoding, which would train on tokens the policy "
                              "did not sample freely; ask for it in the prompt")  # fmt: skip
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            raise unsupported("tool_choice", "forcing a tool call needs constrained decoding; "
                              'use "auto" (the model decides) or "none"')  # fmt: skip
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise GatewayError(400, "tool_choice is set but no tools are given",
                               param="tool_choice")  # fmt: skip
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise GatewayError(400, f"tools: two tools have the same name ({_dup(names)})",
                               param="tools")  # fmt: skip
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for part in m.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise GatewayError(
                            400, f"messages[{i}].content: a part of type "
                            f"{part.get('type')!r} is not supported (text parts only: the "
                            "gateway serves a text model)", param=f"messages[{i}].content",
                        )  # fmt: skip
            if m.role == "tool" and not m.tool_call_id:
                raise GatewayError(400, f"messages[{i}]: a tool message needs a tool_call_id",
                                   param=f"messages[{i}].tool_call_id")  # fmt: skip

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def parses_tools(self) -> bool:
        """Whether the reply's text is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions`` (one prompt: text, or token ids)."""

    prompt: str | list[Any]
    """Text, or token ids; a list of one of either is taken as that one."""
    max_tokens: PositiveInt | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        """Refuse what the gateway cannot serve (see the module docstring).

        Raises:
            GatewayError: 400 naming the parameter.
        """
        self._refuse_unsupported()
        if self.echo:
            raise unsupported("echo", "the prompt is not returned; keep it on your side")
        if self.suffix:
            raise unsupported("suffix", "insertion is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "use n and choose on your side")
        if self.logprobs and self.logprobs > 1:
            raise unsupported("logprobs", "the engine reports the sampled token's logprob "
                              "only; use logprobs 0 or 1")  # fmt: skip
        self.single_prompt()

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids.

        Raises:
            GatewayError: a batch of several prompts, or an empty one.
        """
        p: Any = self.prompt
        if isinstance(p, list) and p and not _is_ids(p):
            if len(p) != 1:
                raise GatewayError(400, f"prompt holds {len(p)} prompts: a session call takes "
                                   "one (its conversation is one sequence)", param="prompt")  # fmt: skip
            p = p[0]
        if isinstance(p, str) and p:
            return p
        if isinstance(p, list) and p and _is_ids(p):
            return list(p)
        raise GatewayError(400, "prompt must be a non-empty string or a non-empty list of "
                           "token ids", param="prompt")  # fmt: skip


# ------------------------------------------------------------------ the /rl/ endpoints
class SessionRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /rl/sessions``: take the next episode the scheduler admitted."""

    prompt_id: str | None = None
    """Take an episode of this dataset prompt (e.g. the other sessions of a group whose first
    one you hold); ``None``: the next one waiting."""
    wait_s: Annotated[float, Meta(ge=0.0, le=300.0)] = 30.0
    """How long to wait for an episode when none is waiting (then 503)."""


class RewardRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /rl/sessions/<id>/reward``: end the session with its reward.

    ``reward`` alone; ``rewards`` (named components) alone, their sum being the reward; both
    (the components are then only reported); or neither: the run's environment scores the
    session's last answer (its ``score(prompt, completion)``)."""

    reward: float | None = None
    rewards: dict[str, float] | None = None
    correct: bool | None = None


# ------------------------------------------------------------------ decoding
_PATH = re.compile(r"at `\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\]|\[\.\.\.\])+)`")


def decode(body: bytes, kind: type[Any]) -> Any:
    """``body`` as a ``kind`` struct.

    Raises:
        GatewayError: 400: not JSON, not an object, or a field of the wrong type or range
            (the message and ``param`` name it).
    """
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        found = _PATH.search(message)
        param = found.group(1).lstrip(".").replace("[...]", "") if found else None
        raise GatewayError(400, f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}") from None


def json_values(body: bytes) -> int:
    """An upper bound on the JSON values in ``body``, without decoding it: its commas,
    brackets and braces, plus one (a container of k values holds k - 1 commas; those inside
    strings are counted too). Numpy's comparisons: about 0.2 ms a MiB."""
    a = np.frombuffer(body, np.uint8)
    return 1 + sum(int(np.count_nonzero(a == ord(c))) for c in ",[{")


def check_lengths(req: Any, *, max_messages: int, max_tools: int) -> None:
    """A chat request holds at most ``max_messages`` messages and ``max_tools`` tools
    (:data:`asyncrl_gateway.server.MAX_MESSAGES`, ``MAX_TOOLS``); other requests pass.

    Raises:
        GatewayError: 400 (``array_above_max_length``, as OpenAI says it) naming the
            parameter and the limit.
    """
    if not isinstance(req, ChatRequest):
        return
    for param, values, limit in (("messages", req.messages, max_messages),
                                 ("tools", req.tools or (), max_tools)):  # fmt: skip
        if len(values) > limit:
            raise GatewayError(400, f"Invalid '{param}': array too long. Expected an array "
                               f"with maximum length {limit}, but got an array with length "
                               f"{len(values)} instead (the gateway's MAX_{param.upper()})",
                               param=param,
                               code="array_above_max_length")  # fmt: skip


def _is_ids(values: list[Any]) -> bool:
    return all(type(x) is int and x >= 0 for x in values)


def unsupported(param: str, why: str) -> GatewayError:
    return GatewayError(400, f"{param} is not supported by the asyncrl gateway: {why}",
                        param=param, code="unsupported_parameter")  # fmt: skip


def _dup(names: Sequence[str]) -> str:
    seen: set[str] = set()
    return next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]


def now_s() -> int:
    """``created`` of a response: seconds since the epoch."""
    return int(time.time())
