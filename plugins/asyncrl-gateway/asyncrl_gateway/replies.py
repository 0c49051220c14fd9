"""A served call as OpenAI response bodies: one JSON object, or server-sent events (pure).

Every response also says which weights produced it: ``weight_version`` in the body (the
version the generators served when the call started) and the headers
``x-asyncrl-weight-version`` and ``x-asyncrl-weight-versions`` (``first-last`` over the
generated tokens: a call in flight during a refit goes on over the new weights).

Streams: the role chunk is sent as soon as the call is taken, then each choice's text and tool
calls in one chunk each once the turn is generated (the engine returns a turn whole), its
finish reason, the usage when ``stream_options.include_usage`` asks for it, and ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from asyncrl_gateway.conversation import ModelReply

__all__ = ["CallResult", "Choice", "chat_chunks", "chat_response", "completion_chunks",
           "completion_response", "headers", "role_chunk", "sse"]  # fmt: skip

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Choice:
    """One choice of a call: what the agent reads, and the tokens recorded for it."""

    reply: ModelReply
    """The text (a completion's is ``reply.content``) and tool calls."""
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    """The weight version of each token."""


@dataclass(frozen=True)
class CallResult:
    """A served call."""

    id: str
    created: int
    model: str
    choices: Sequence[Choice]
    prompt_tokens: int
    version: int
    """The weight version the generators served when the call started."""
    prompt_ids: Sequence[int] = ()
    """The tokens the call's choices were sampled after (``return_token_ids``)."""
    generate_s: float = 0.0
    """Seconds the call's engine requests took (placing them included), for
    ``Server-Timing``."""

    @property
    def completion_tokens(self) -> int:
        return sum(int(c.token_ids.size) for c in self.choices)

    def usage(self) -> dict[str, int]:
        n = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}  # fmt: skip

    def version_span(self) -> tuple[int, int]:
        spans = [c.versions for c in self.choices if c.versions.size]
        if not spans:
            return self.version, self.version
        return min(int(v.min()) for v in spans), max(int(v.max()) for v in spans)


def headers(result: CallResult, total_s: float) -> dict[str, str]:
    """The weight versions, and ``Server-Timing``: ``generate`` (the engine's part) and
    ``total`` (from the request's arrival to its answer, less any wait for the client to
    send its body), in milliseconds."""
    lo, hi = result.version_span()
    timing = f"generate;dur={result.generate_s * 1e3:.3f}, total;dur={total_s * 1e3:.3f}"
    return {"x-asyncrl-weight-version": str(result.version),
            "x-asyncrl-weight-versions": f"{lo}-{hi}", "server-timing": timing}  # fmt: skip


TokenText = Callable[[int], str]


def _chat_logprobs(c: Choice, token_text: TokenText) -> dict[str, Any]:
    out = []
    for t, lp in zip(c.token_ids.tolist(), c.logprobs.tolist()):
        text = token_text(t)
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
                    "top_logprobs": []})  # fmt: skip
    return {"content": out, "refusal": None}


def _with_ids(body: dict[str, Any], result: CallResult, token_ids: bool) -> dict[str, Any]:
    """``body`` with vLLM's ``prompt_token_ids`` and each choice's ``token_ids``."""
    if token_ids:
        body["prompt_token_ids"] = list(result.prompt_ids)
        for choice, c in zip(body["choices"], result.choices):
            choice["token_ids"] = c.token_ids.tolist()
    return body


def chat_response(
    result: CallResult, *, logprobs: bool, token_text: TokenText, token_ids: bool = False
) -> bytes:
    choices = []
    for i, c in enumerate(result.choices):
        choices.append({
            "index": i, "message": c.reply.message(), "finish_reason": c.reply.finish_reason,
            "logprobs": _chat_logprobs(c, token_text) if logprobs else None,
        })  # fmt: skip
    return _encode(_with_ids({
        "id": result.id, "object": "chat.completion", "created": result.created,
        "model": result.model, "choices": choices, "usage": result.usage(),
        "weight_version": result.version,
    }, result, token_ids))  # fmt: skip


def _chunk(result_id: str, created: int, model: str, choices: list[dict[str, Any]],
           **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"id": result_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": choices, **extra}  # fmt: skip


def role_chunk(result_id: str, created: int, model: str, n: int) -> bytes:
    """The first event of a chat stream: each choice's role."""
    return sse(_chunk(result_id, created, model, [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None} for i in range(n)
    ]))  # fmt: skip


def chat_chunks(
    result: CallResult, *, logprobs: bool, usage: bool, token_text: TokenText
) -> Iterator[bytes]:
    """The events after the role chunk, ``[DONE]`` last."""
    rid, created, model = result.id, result.created, result.model
    for i, c in enumerate(result.choices):
        reply = c.reply
        if reply.content:
            yield sse(_chunk(rid, created, model, [{
                "index": i, "delta": {"content": reply.content}, "finish_reason": None,
                "logprobs": _chat_logprobs(c, token_text) if logprobs else None,
            }]))  # fmt: skip
        if reply.tool_calls:
            calls = [{"index": k, "id": cid, "type": "function",
                      "function": {"name": name, "arguments": args}}
                     for k, (cid, name, args) in enumerate(reply.tool_calls)]  # fmt: skip
            yield sse(_chunk(rid, created, model, [{
                "index": i, "delta": {"tool_calls": calls}, "finish_reason": None,
                "logprobs": None,
            }]))  # fmt: skip
        yield sse(_chunk(rid, created, model, [
            {"index": i, "delta": {}, "finish_reason": reply.finish_reason, "logprobs": None}
        ], weight_version=result.version))  # fmt: skip
    if usage:
        yield sse(_chunk(rid, created, model, [], usage=result.usage()))
    yield b"data: [DONE]\n\n"


def _completion_logprobs(c: Choice, token_text: TokenText) -> dict[str, Any]:
    tokens = [token_text(t) for t in c.token_ids.tolist()]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": c.logprobs.tolist(),
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, c.logprobs.tolist())],
            "text_offset": offsets}  # fmt: skip


def _completion_choices(
    result: CallResult, logprobs: bool, token_text: TokenText
) -> list[dict[str, Any]]:
    return [{"index": i, "text": c.reply.content or "", "finish_reason": c.reply.finish_reason,
             "logprobs": _completion_logprobs(c, token_text) if logprobs else None}
            for i, c in enumerate(result.choices)]  # fmt: skip


def completion_response(
    result: CallResult, *, logprobs: bool, token_text: TokenText, token_ids: bool = False
) -> bytes:
    return _encode(_with_ids({
        "id": result.id, "object": "text_completion", "created": result.created,
        "model": result.model, "choices": _completion_choices(result, logprobs, token_text),
        "usage": result.usage(), "weight_version": result.version,
    }, result, token_ids))  # fmt: skip


def completion_chunks(
    result: CallResult, *, logprobs: bool, usage: bool, token_text: TokenText
) -> Iterator[bytes]:
    for choice in _completion_choices(result, logprobs, token_text):
        yield sse({"id": result.id, "object": "text_completion", "created": result.created,
                   "model": result.model, "choices": [choice],
                   "weight_version": result.version})  # fmt: skip
    if usage:
        yield sse({"id": result.id, "object": "text_completion", "created": result.created,
                   "model": result.model, "choices": [], "usage": result.usage()})  # fmt: skip
    yield b"data: [DONE]\n\n"


def sse(event: Any) -> bytes:
    """One server-sent event of JSON data."""
    return b"data: " + _encode(event) + b"\n\n"
