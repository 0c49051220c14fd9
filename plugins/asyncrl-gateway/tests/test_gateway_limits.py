"""The controller's loop protected from any one request or connection: the limits on a
request's JSON values, messages, tools and tokens (each refused before the work it bounds,
with an OpenAI-style 4xx naming its limit), a big call recorded off the loop, the head
and body deadlines, the idle keep-alive deadline, the head's size and the connection cap
(``plugins/asyncrl-gateway/asyncrl_gateway/connections.py``). After each, the gateway still serves a session end to
end.

Every test runs the real uvicorn server on 127.0.0.1 over a scripted engine
(``gateway_support``), with deadlines of a fraction of a second.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from asyncrl.env.episode import EpisodeLimit
import gateway_support as gs
from test_gateway_security import Run, bearer, error_of, serving

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> gs.Model:
    return gs.make_model(tmp_path_factory.mktemp("gateway-model"))


def address(run: Run) -> tuple[str, int]:
    host, port = run.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def head(run: Run, method: str, path: str, key: str, length: int | None = None) -> bytes:
    extra = ("" if length is None
             else f"content-type: application/json\r\ncontent-length: {length}\r\n")  # fmt: skip
    return (f"{method} {path} HTTP/1.1\r\nhost: {address(run)[0]}\r\n"
            f"authorization: Bearer {key}\r\n{extra}\r\n").encode()  # fmt: skip


async def read_answer(stream: anyio.abc.ByteStream) -> bytes:
    """One whole HTTP/1.1 answer (with a ``Content-Length``) read from ``stream``."""
    got = b""
    with anyio.fail_after(3):
        while b"\r\n\r\n" not in got:
            got += await stream.receive()
        head_text, _, body = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head_text.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))  # fmt: skip
        while len(body) < length:
            body += await stream.receive()
    return head_text + b"\r\n\r\n" + body


async def trickle(stream: anyio.abc.ByteStream, data: bytes) -> None:
    """``data`` a byte every 50 ms, until the server closes the connection."""
    for byte in data:
        try:
            await stream.send(bytes([byte]))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            return
        await anyio.sleep(0.05)


async def until_closed(stream: anyio.abc.ByteStream, within_s: float) -> bytes:
    """What the server sends on ``stream`` until it closes it (which it must within
    ``within_s``)."""
    got = b""
    with anyio.fail_after(within_s):
        while True:
            try:
                got += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                return got


def answer_of(raw: bytes, status: int, code: str) -> dict[str, Any]:
    """``raw`` is one HTTP/1.1 answer ``status`` with an OpenAI error body of ``code`` that
    closes the connection; its headers."""
    head_text, _, body = raw.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), raw[:200]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body), raw
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return headers


# ------------------------------------------------------------------ request limits
@pytest.mark.asyncio
async def test_request_limits_refuse_before_the_session(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path, max_messages=8, max_tools=1, max_json_values=1000) as run:
        info, played = await run.claim()
        url = f"{info['base_url']}/chat/completions"
        many = [{"role": "user", "content": "hi"}] * 9
        r = await run.client.post(url, json={"model": "x", "messages": many},
                                  headers=bearer(info["api_key"]))  # fmt: skip
        err = error_of(r, 400, param="messages", code="array_above_max_length")
        assert "maximum length 8" in err["message"] and "MAX_MESSAGES" in err["message"]
        tools = [gs.CALC_TOOL, {"type": "function", "function": {"name": "other"}}]
        r = await run.chat(info, tools=tools)
        err = error_of(r, 400, param="tools", code="array_above_max_length")
        assert "MAX_TOOLS" in err["message"]
        # a body that could hold more than 1,000 values (over 2,000 bytes) is counted first
        values = {"model": "x", "messages": info["prompt"]["messages"], "metadata": [0] * 1000}
        r = await run.chat(info, metadata=[0] * 1000)
        err = error_of(r, 413, code="request_too_large")
        assert "MAX_JSON_VALUES" in err["message"]
        assert len(json.dumps(values)) > 2000
        # the admin routes too
        rewards = {str(i): 0 for i in range(1200)}
        r = await run.client.post(f"{run.url}/rl/sessions/{info['session_id']}/reward",
                                  headers=run.admin,
                                  json={"reward": 1.0, "rewards": rewards})  # fmt: skip
        error_of(r, 413, code="request_too_large")
        # none reached the session; just under each limit is served, and the run goes on
        assert run.h.gateway.stats["calls"] == 0
        r = await run.chat(info, tools=[gs.CALC_TOOL], metadata=[0] * 900)
        assert r.status_code == 200, r.text
        await run.finish(info, played)
        await run.still_serves()


@pytest.mark.asyncio
async def test_max_request_tokens_ends_the_session_truncated(
    model: gs.Model, tmp_path: Path
) -> None:
    async with serving(model, tmp_path, max_request_tokens=100) as run:
        info, played = await run.claim()
        r = await run.chat(info)  # the prompt: ~55 tokens
        assert r.status_code == 200, r.text
        info2, played2 = await run.claim()
        long = [{"role": "user", "content": "the answer is " * 40}]
        r = await run.chat(info2, messages=long)
        err = error_of(r, 400, code="context_length_exceeded")
        assert "gateway.max_request_tokens (100)" in err["message"], err
        with anyio.fail_after(5):
            while played2.error is None:
                await anyio.sleep(0.01)
        assert isinstance(played2.error, EpisodeLimit) and played2.error.reason == "context"
        # token ids of a text completion are counted before anything is done with them
        info3, played3 = await run.claim()
        r = await run.client.post(f"{info3['base_url']}/completions",
                                  json={"model": "x", "prompt": [5] * 101},
                                  headers=bearer(info3["api_key"]))  # fmt: skip
        error_of(r, 400, code="context_length_exceeded")
        # a big call's long message is counted on a prefix, before it is templated
        info4, _ = await run.claim()
        r = await run.chat(info4, messages=[{"role": "user", "content": "lorem ipsum " * 6000}])
        err = error_of(r, 400, code="context_length_exceeded")
        assert "characters alone come to more than 100 tokens (gateway.max_request_tokens)" \
            in err["message"], err  # fmt: skip
        await run.finish(info, played)
        await run.still_serves()


def test_a_prefix_cut_where_a_word_begins_is_encoded_as_in_the_whole(model: gs.Model) -> None:
    from asyncrl_gateway.gateway import _too_long

    text = "The answer is 46, and 12+34 is 46 too.  Tabs\tand\nnewlines. " * 200
    cut = _too_long(model.tok, text, 10)
    assert 0 < cut <= 16 * 74 and text[cut] == " " and not text[cut - 1].isspace(), cut
    part = model.tok.encode_rendered(text[:cut])
    assert len(part) > 74 and model.tok.encode_rendered(text)[: len(part)] == part
    assert _too_long(model.tok, text[: 16 * 74], 10) == 0  # short enough to encode whole
    assert _too_long(model.tok, "x" * 100_000, 10) == 0  # no word begins: not tried
    assert _too_long(model.tok, " " * 100_000, 10) == 0


@pytest.mark.asyncio
async def test_a_big_call_is_recorded_off_the_loop(model: gs.Model, tmp_path: Path) -> None:
    """A 600 KB message (templated and encoded: 0.4-2 s of this tokenizer's work, most of the
    call) leaves the loop free: a 5 ms sleep on it is never late by a quarter of the call."""
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        text = "The answer is 46, " * 35_000
        lags: list[float] = []

        async def probe() -> None:
            while True:
                t = time.perf_counter()
                await anyio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            started = time.perf_counter()
            r = await run.chat(info, messages=[{"role": "user", "content": text}])
            call_s = time.perf_counter() - started
            tg.cancel_scope.cancel()
        # over the context (4,000 tokens): refused after it was recorded, the session truncated
        error_of(r, 400, code="context_length_exceeded")
        assert call_s > 0.2 and len(lags) > 10, (call_s, lags)
        assert max(lags) < call_s / 4, (max(lags), call_s)
        await run.still_serves()


# ------------------------------------------------------------------ connections
@pytest.mark.asyncio
async def test_slow_heads_and_silent_connections_are_cut(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path, request_head_timeout_s=0.4) as run:
        host, port = address(run)
        started = time.monotonic()
        async with await anyio.connect_tcp(host, port) as silent, \
                await anyio.connect_tcp(host, port) as slow:  # fmt: skip
            data = head(run, "GET", "/v1/models", run.h.server.admin_key)
            async with anyio.create_task_group() as tg:
                tg.start_soon(trickle, slow, data[:-2])  # never the blank line ending the head
                answer = await until_closed(slow, 3)
                tg.cancel_scope.cancel()
            assert await until_closed(silent, 3) == b""  # nothing came, nothing said
        assert time.monotonic() - started < 2
        answer_of(answer, 408, "request_timeout")
        assert b"REQUEST_HEAD_TIMEOUT_S" in answer
        await run.still_serves()


@pytest.mark.asyncio
async def test_slow_bodies_are_cut_and_the_call_never_starts(
    model: gs.Model, tmp_path: Path
) -> None:
    async with serving(model, tmp_path, request_body_timeout_s=0.4) as run:
        info, played = await run.claim()
        host, port = address(run)
        body = json.dumps({"model": "x", "messages": info["prompt"]["messages"]}).encode()
        path = "/" + info["base_url"].split("/", 3)[3] + "/chat/completions"
        for key, route in ((info["api_key"], path),
                           (run.h.server.admin_key, f"/rl/sessions/{info['session_id']}/reward")):
            started = time.monotonic()
            async with await anyio.connect_tcp(host, port) as slow:
                await slow.send(head(run, "POST", route, key, len(body)) + body[:5])
                async with anyio.create_task_group() as tg:
                    tg.start_soon(trickle, slow, body[5:-1])  # never the last byte
                    answer = await until_closed(slow, 3)
                    tg.cancel_scope.cancel()
            assert time.monotonic() - started < 2
            answer_of(answer, 408, "request_timeout")
            assert b"REQUEST_BODY_TIMEOUT_S" in answer
        with anyio.fail_after(3):  # the handlers saw a disconnect and ended
            while run.h.server.active_requests:
                await anyio.sleep(0.01)
        assert run.h.gateway.stats["calls"] == 0
        await run.finish(info, played)
        await run.still_serves()


@pytest.mark.asyncio
async def test_an_idle_keep_alive_connection_is_closed(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path, keep_alive_timeout_s=0.3,
                       request_head_timeout_s=0.5) as run:  # fmt: skip
        get = head(run, "GET", "/v1/models", run.h.server.admin_key)
        async with await anyio.connect_tcp(*address(run)) as conn:
            for _ in range(2):  # kept alive between calls made within the deadline
                await conn.send(get)
                got = await read_answer(conn)
                assert got.startswith(b"HTTP/1.1 200 "), got
                await anyio.sleep(0.1)
            started = time.monotonic()
            assert await until_closed(conn, 3) == b""
            assert 0.15 < time.monotonic() - started < 2
        # blank lines (which every byte of used to stop uvicorn's keep-alive timer, and which
        # begin no request) are a head that never ends
        async with await anyio.connect_tcp(*address(run)) as conn:
            await conn.send(get)
            assert (await read_answer(conn)).startswith(b"HTTP/1.1 200 ")
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(trickle, conn, b"\r\n" * 100)
                answer = await until_closed(conn, 3)
                tg.cancel_scope.cancel()
            assert time.monotonic() - started < 2
            answer_of(answer, 408, "request_timeout")
        await run.still_serves()


def test_the_limits_are_checked_in_the_config() -> None:
    """What is left of the limits in ``[gateway]`` (the others are the server's
    :class:`~asyncrl_gateway.server.Guards`, constants since issue 50) is checked there."""
    from asyncrl_gateway.config import GatewayConfig
    from asyncrl_gateway.server import GUARDS, Guards

    assert GatewayConfig().problems() == [] and GUARDS == Guards()
    bad = GatewayConfig(max_request_tokens=-1, idle_timeout_s=0)
    named = sorted(str(p).split(":")[0] for p in bad.problems())
    assert named == ["gateway.idle_timeout_s", "gateway.max_request_tokens"], named


@pytest.mark.asyncio
async def test_a_head_over_64_kib_is_431(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path) as run:
        async with await anyio.connect_tcp(*address(run)) as conn:
            # 68 KiB of headers, in one go (more, unread when the gateway closes, would make
            # its kernel reset the connection rather than deliver the answer)
            await conn.send(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"".join(
                f"x-pad-{i}: {'a' * 4096}\r\n".encode() for i in range(17)))
            answer = await until_closed(conn, 3)
        answer_of(answer, 431, "request_header_fields_too_large")
        await run.still_serves()


@pytest.mark.asyncio
async def test_connections_beyond_the_cap_get_429(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path, max_connections=3) as run:
        host, port = address(run)
        get = head(run, "GET", "/v1/models", run.h.server.admin_key)
        held = [await anyio.connect_tcp(host, port) for _ in range(3)]
        try:
            async with await anyio.connect_tcp(host, port) as extra:
                await extra.send(get)
                answer = await until_closed(extra, 3)
            headers = answer_of(answer, 429, "too_many_connections")
            assert headers["retry-after"] == "1" and b"MAX_CONNECTIONS = 3" in answer
            # the connections within the cap are served
            await held[0].send(get)
            assert (await read_answer(held[0])).startswith(b"HTTP/1.1 200 ")
        finally:
            for conn in held:
                await conn.aclose()
        with anyio.fail_after(3):  # once the gateway saw them go, new ones are served
            while True:
                async with await anyio.connect_tcp(host, port) as conn:
                    await conn.send(get)
                    if (await read_answer(conn)).startswith(b"HTTP/1.1 200 "):
                        break
                await anyio.sleep(0.01)
        await run.still_serves()
