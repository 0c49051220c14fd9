"""The gateway's HTTP side under hostile input: keys (401/403), malformed and unsupported
requests (400 naming the parameter), bodies too large (413), floods (429), the key files,
and the session rules (409/410/404). After each hostile input the gateway must still serve a
normal session end to end: the run goes on.

Every test runs the real uvicorn server on 127.0.0.1 over a scripted engine
(``gateway_support``).
"""

from __future__ import annotations

import json
import logging
import stat
import time
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import httpx
import pytest
import structlog

from asyncrl_gateway.config import GatewayConfig
from asyncrl_gateway.gateway import SessionFailed
from asyncrl_gateway.server import Guards
import gateway_support as gs

GUARD_FIELDS = frozenset(Guards.__dataclass_fields__)
"""``serving()`` keywords that go to the server's :class:`Guards` (once ``[gateway]`` keys)."""

pytestmark = pytest.mark.asyncio

TIMEOUT = httpx.Timeout(20.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> gs.Model:
    return gs.make_model(tmp_path_factory.mktemp("gateway-model"))


# ------------------------------------------------------------------ helpers
class Run:
    """A running gateway, an HTTP client, and the episodes started so far."""

    def __init__(self, h: gs.Harness, client: httpx.AsyncClient) -> None:
        self.h, self.client = h, client
        self._next = 0

    @property
    def url(self) -> str:
        return self.h.url

    @property
    def admin(self) -> dict[str, str]:
        return self.h.admin

    def episode(self) -> gs.Played:
        """Start one more episode (a session waiting in the lobby)."""
        i = self._next
        self._next += 1
        return self.h.start(self.h.env.prompts[i], f"g{i}/0")

    async def claim(self) -> tuple[dict[str, Any], gs.Played]:
        """Start an episode and take its session."""
        played = self.episode()
        r = await self.client.post(f"{self.url}/rl/sessions", headers=self.admin,
                                   json={"prompt_id": played.prompt.id, "wait_s": 5})  # fmt: skip
        assert r.status_code == 201, r.text
        info = r.json()
        assert info["prompt"]["id"] == played.prompt.id
        return info, played

    async def chat(
        self, info: dict[str, Any], key: str | None = None, **extra: Any
    ) -> httpx.Response:
        body = {"model": "x", "messages": info["prompt"]["messages"], **extra}
        return await self.client.post(f"{info['base_url']}/chat/completions", json=body,
                                      headers=bearer(key or info["api_key"]))  # fmt: skip

    async def reward(self, sid: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return await self.client.post(f"{self.url}/rl/sessions/{sid}/reward",
                                      headers=self.admin if headers is None else headers,
                                      json={"reward": 1.0})  # fmt: skip

    async def finish(self, info: dict[str, Any], played: gs.Played) -> None:
        """A valid call on the session, then its reward; its episode ends scored."""
        r = await self.chat(info)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        r = await self.reward(info["session_id"])
        assert r.status_code == 200, r.text
        assert r.json() == {"session_id": info["session_id"], "ended": True}
        await ended(played)
        assert played.error is None, repr(played.error)
        assert played.score is not None and played.score.reward == 1.0

    async def still_serves(self) -> None:
        """The run goes on: a fresh session, served end to end."""
        info, played = await self.claim()
        await self.finish(info, played)


async def ended(played: gs.Played) -> None:
    with anyio.fail_after(5):
        while played.score is None and played.error is None:
            await anyio.sleep(0.01)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def serving(
    model: gs.Model, out: Path, *, engine: gs.ScriptedEngine | None = None,
    limits: httpx.Limits | None = None, **config: Any,
) -> AsyncIterator[Run]:  # fmt: skip
    engine = engine or gs.ScriptedEngine(model, 0)
    guards = {k: config.pop(k) for k in list(config) if k in GUARD_FIELDS}  # the server's own
    h = gs.Harness(model, engine, GatewayConfig(enabled=True, **config), out,
                   guards=Guards(**guards))  # fmt: skip
    with anyio.fail_after(50):
        async with gs.running(h):
            limits = limits or httpx.Limits()
            async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
                yield Run(h, client)


def error_of(r: httpx.Response, status: int, *, param: Any = ..., code: Any = ...,
             kind: str | None = None) -> dict[str, Any]:  # fmt: skip
    """``r`` is a ``status`` with an OpenAI-style error body; that body's ``error``."""
    assert r.status_code == status, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    if kind is not None:
        assert err["type"] == kind, err
    return err


def routes(url: str, sid: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every route of the gateway, for session ``sid``: (method, url, json body)."""
    chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("GET", f"{url}/v1/models", None),
        ("POST", f"{url}/rl/sessions", {"wait_s": 0}),
        ("GET", f"{url}/rl/sessions", None),
        ("POST", f"{url}/rl/sessions/{sid}/reward", {"reward": 1.0}),
        ("DELETE", f"{url}/rl/sessions/{sid}", None),
        ("GET", f"{url}/s/{sid}/v1/models", None),
        ("POST", f"{url}/s/{sid}/v1/chat/completions", chat),
        ("POST", f"{url}/s/{sid}/v1/completions", {"model": "x", "prompt": "hi"}),
    ]


# ------------------------------------------------------------------ 1. no key, wrong key
async def test_every_route_needs_a_valid_bearer_key(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        sid = info["session_id"]
        wrong = "sk-arl-" + "A" * 43
        bad_headers: dict[str, dict[str, str]] = {
            "none": {},
            "empty": {"Authorization": ""},
            "bearer without key": {"Authorization": "Bearer"},
            "wrong key": bearer(wrong),
            "basic scheme, admin key": {"Authorization": f"Basic {run.h.server.admin_key}"},
            "basic scheme, session key": {"Authorization": f"Basic {info['api_key']}"},
            "key without scheme": {"Authorization": run.h.server.admin_key},
        }
        for what, headers in bad_headers.items():
            for method, url, body in routes(run.url, sid) + routes(run.url, "s99-unknown"):
                r = await run.client.request(method, url, json=body, headers=headers)
                err = error_of(r, 401, kind="authentication_error")
                assert r.headers.get("www-authenticate") == "Bearer", (what, url, r.headers)
                assert err["code"] in ("missing_api_key", "invalid_api_key"), (what, err)
                for secret in (run.h.server.admin_key, info["api_key"], wrong):
                    assert secret not in r.text, (what, url)
        # none of it touched the session: it is served, and the run goes on
        assert run.h.gateway.stats["calls"] == 0
        await run.finish(info, played)
        await run.still_serves()


# ------------------------------------------------------------------ 2. the wrong key
async def test_keys_reach_their_own_routes_only(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path) as run:
        (a, pa), (b, pb) = await run.claim(), await run.claim()
        admin_key = run.h.server.admin_key
        secrets = (admin_key, a["api_key"], b["api_key"])
        # A's key on B's session routes
        for method, url, body in routes(run.url, b["session_id"])[5:]:
            r = await run.client.request(method, url, json=body, headers=bearer(a["api_key"]))
            error_of(r, 403, kind="permission_error")
            assert not any(s in r.text for s in secrets), r.text
        # a session key (even on its own session) on the admin routes
        for method, url, body in routes(run.url, a["session_id"])[:5]:
            r = await run.client.request(method, url, json=body, headers=bearer(a["api_key"]))
            error_of(r, 403, kind="permission_error")
            assert not any(s in r.text for s in secrets), r.text
        # the admin key on a session's model routes
        for method, url, body in routes(run.url, a["session_id"])[5:]:
            r = await run.client.request(method, url, json=body, headers=bearer(admin_key))
            error_of(r, 403, kind="permission_error")
            assert not any(s in r.text for s in secrets), r.text
        assert run.h.gateway.stats["calls"] == 0
        assert run.h.gateway.sessions.counts() == {"waiting": 0, "active": 2}
        # both sessions are untouched and served; the run goes on
        r = await run.client.get(f"{a['base_url']}/models", headers=bearer(a["api_key"]))
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", r.text
        await run.finish(a, pa)
        await run.finish(b, pb)
        await run.still_serves()


# ------------------------------------------------------------------ 3. bad requests
CHAT_CASES: list[tuple[str, Any, Any]] = [
    # (what, body (bytes as sent, or a dict merged into a valid chat request), param)
    ("malformed JSON", b'{"model": "x", "messages": [', None),
    ("not JSON at all", b"\xff\xfe garbage", None),
    ("empty body", b"", None),
    ("a JSON array", b'[{"role": "user", "content": "hi"}]', None),
    ("a JSON string", b'"hello"', None),
    ("n as a string", {"n": "2"}, "n"),
    ("n too large", {"n": 1000}, "n"),
    ("temperature out of range", {"temperature": 5}, "temperature"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("no messages", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("role bot", {"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
    ("tool message without tool_call_id",
     {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "46"}]},
     "messages[1].tool_call_id"),
    ("image content part",
     {"messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content"),
    ("text part without text",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ("top_logprobs 3", {"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ("logit_bias", {"logit_bias": {"42": 100}}, "logit_bias"),
    ("tool_choice required", {"tools": [gs.CALC_TOOL], "tool_choice": "required"}, "tool_choice"),
    ("tool_choice named", {"tools": [gs.CALC_TOOL],
                           "tool_choice": {"type": "function", "function": {"name": "calc"}}},
     "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "auto"}, "tool_choice"),
    ("presence_penalty", {"presence_penalty": 1}, "presence_penalty"),
    ("frequency_penalty", {"frequency_penalty": -0.5}, "frequency_penalty"),
    ("response_format json", {"response_format": {"type": "json_object"}}, "response_format"),
    ("two tools of one name", {"tools": [gs.CALC_TOOL, gs.CALC_TOOL]}, "tools"),
    ("bad tool name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("too many stops", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
]


@pytest.mark.parametrize("what, body, param", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
async def test_bad_chat_requests_are_400_and_the_session_goes_on(
    model: gs.Model, tmp_path: Path, what: str, body: Any, param: str | None
) -> None:
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        url, headers = f"{info['base_url']}/chat/completions", bearer(info["api_key"])
        if isinstance(body, bytes):
            raw = {**headers, "content-type": "application/json"}
            r = await run.client.post(url, content=body, headers=raw)
        else:
            valid = {"model": "x", "messages": info["prompt"]["messages"]}
            r = await run.client.post(url, json={**valid, **body}, headers=headers)
        err = error_of(r, 400, param=param, kind="invalid_request_error")
        assert info["api_key"] not in r.text and run.h.server.admin_key not in r.text
        if param is not None:
            assert param.split("[")[0].split(".")[0] in err["message"], err
        # refused before it reached the episode: the session is as it was
        assert run.h.gateway.stats["calls"] == 0
        await run.finish(info, played)
        await run.still_serves()


async def test_bad_completion_and_rl_requests_are_400(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        url, key = f"{info['base_url']}/completions", bearer(info["api_key"])
        for body, param in [
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"prompt": ""}, "prompt"),
            ({"prompt": [-1, 2]}, "prompt"),
            ({"prompt": "hi", "echo": True}, "echo"),
            ({"prompt": "hi", "suffix": "x"}, "suffix"),
            ({"prompt": "hi", "best_of": 3}, "best_of"),
            ({"prompt": "hi", "logprobs": 3}, "logprobs"),
            ({"prompt": "hi", "logit_bias": {"1": 1.0}}, "logit_bias"),
            ({"prompt": {"text": "hi"}}, "prompt"),
            ({}, None),  # prompt is required: msgspec names no path for a missing field
        ]:  # fmt: skip
            r = await run.client.post(url, json={"model": "x", **body}, headers=key)
            err = error_of(r, 400, kind="invalid_request_error")
            if param is not None:
                assert err["param"] == param, (body, err)
            else:
                assert "prompt" in err["message"], err
        # /rl/sessions: unknown fields are refused, values checked
        for body, param in [({"wait_s": -1}, "wait_s"), ({"wait_s": "5"}, "wait_s"),
                            ({"bogus": 1}, None), ({"prompt_id": 7}, "prompt_id")]:  # fmt: skip
            r = await run.client.post(f"{run.url}/rl/sessions", json=body, headers=run.admin)
            error_of(r, 400, param=param)
        r = await run.client.post(f"{run.url}/rl/sessions", content=b"[1,2",
                                  headers=run.admin)  # fmt: skip
        error_of(r, 400, param=None)
        assert run.h.gateway.sessions.counts() == {"waiting": 0, "active": 1}
        # a valid call, then bad rewards: refused, the session stays open
        r = await run.chat(info)
        assert r.status_code == 200, r.text
        for body, param in [({"reward": "1"}, "reward"), ({"rewards": {"a": "x"}}, "rewards"),
                            ({"reward": 1, "bogus": 2}, None), ([1.0], None)]:  # fmt: skip
            r = await run.client.post(f"{run.url}/rl/sessions/{info['session_id']}/reward",
                                      json=body, headers=run.admin)  # fmt: skip
            err = error_of(r, 400, param=param)
            if isinstance(body, dict):  # a dict's value has no path msgspec spells: no param
                assert next(reversed(body)) in err["message"], err
        r = await run.client.post(f"{run.url}/rl/sessions/{info['session_id']}/reward",
                                  content=b"{nope", headers=run.admin)  # fmt: skip
        error_of(r, 400, param=None)
        assert played.score is None and played.error is None
        await run.finish(info, played)
        await run.still_serves()


# ------------------------------------------------------------------ 4. bodies too large
LIMIT = 4096


def big_chat(info: dict[str, Any], size: int) -> bytes:
    body = {"model": "x", "messages": [{"role": "user", "content": "x" * size}]}
    return json.dumps(body).encode()


async def test_bodies_over_the_limit_are_413(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path, max_body_bytes=LIMIT) as run:
        info, played = await run.claim()
        url = f"{info['base_url']}/chat/completions"
        headers = {**bearer(info["api_key"]), "content-type": "application/json"}

        # with a Content-Length: refused from the header (and a body far larger)
        for size in (LIMIT + 1, 1 << 20):
            r = await run.client.post(url, content=big_chat(info, size), headers=headers)
            assert r.request.headers["content-length"].isdigit()
            error_of(r, 413, code="request_too_large")
        # just under the limit is read (and served)
        fits = big_chat(info, 10)
        fits = fits.replace(b'"x"', b'"x"' + b" " * (LIMIT - len(fits)))
        assert len(fits) == LIMIT
        # chunked, no Content-Length: refused once it has read past the limit
        for chunks, size in ((4, 2048), (64, 16 * 1024)):

            async def stream() -> AsyncIterator[bytes]:
                data = big_chat(info, chunks * size)
                for i in range(0, len(data), size):
                    yield data[i : i + size]

            r = await run.client.post(url, content=stream(), headers=headers)
            assert "content-length" not in r.request.headers
            assert r.request.headers["transfer-encoding"] == "chunked"
            error_of(r, 413, code="request_too_large")
        # a Content-Length over the limit is refused from the head alone, the body never sent
        host, port = run.h.server.url.removeprefix("http://").rsplit(":", 1)
        head = (f"POST /s/{info['session_id']}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {info['api_key']}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * LIMIT}\r\n\r\n")  # fmt: skip
        with anyio.fail_after(5):
            async with await anyio.connect_tcp(host, int(port)) as sock:
                await sock.send(head.encode())
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await sock.receive()
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        # the admin routes too
        r = await run.client.post(f"{run.url}/rl/sessions", headers=run.admin,
                                  content=b'{"wait_s": 0' + b" " * LIMIT + b"}")  # fmt: skip
        error_of(r, 413, code="request_too_large")

        async def admin_stream() -> AsyncIterator[bytes]:
            yield b'{"reward": 1.0'
            for _ in range(8):
                yield b" " * 1024
            yield b"}"

        r = await run.client.post(f"{run.url}/rl/sessions/{info['session_id']}/reward",
                                  headers=run.admin, content=admin_stream())  # fmt: skip
        error_of(r, 413, code="request_too_large")
        assert run.h.gateway.stats["calls"] == 0
        # a body of exactly the limit is served; then the run goes on
        r = await run.client.post(url, content=fits, headers=headers)
        assert r.status_code == 200, r.text
        await run.finish(info, played)
        await run.still_serves()


# ------------------------------------------------------------------ 5. floods
FLOOD = 2000
SLOW = 40


async def test_a_flood_gets_200_or_429_and_the_run_goes_on(model: gs.Model, tmp_path: Path) -> None:
    engine = gs.ScriptedEngine(model, 0, delay_s=1.0)
    most = FLOOD + SLOW + 10
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    # the sessions whose calls get a 429 make their first call after the flood, which takes
    # longer than the default claim deadline on a loaded machine
    async with serving(model, tmp_path, engine=engine, limits=limits,
                       max_concurrent_requests=32, claim_timeout_s=120.0) as run:  # fmt: skip
        sessions = [await run.claim() for _ in range(SLOW)]
        results: list[tuple[str, httpx.Response]] = []
        failures: Counter[str] = Counter()

        async def send(what: str, method: str, url: str, kw: dict[str, Any]) -> None:
            try:
                results.append((what, await run.client.request(method, url, **kw)))
            except httpx.HTTPError as exc:
                failures[f"{what}: {type(exc).__name__}: {exc}"] += 1

        async with anyio.create_task_group() as tg:
            for i, (info, _) in enumerate(sessions):  # slow calls (1 s each) hold the slots ...
                tg.start_soon(send, f"session {i}", "POST", f"{info['base_url']}/chat/completions",
                              {"json": {"model": "x", "messages": info["prompt"]["messages"]},
                               "headers": bearer(info["api_key"])})  # fmt: skip
            with anyio.fail_after(5):
                while run.h.server.active_requests < 32:
                    await anyio.sleep(0.005)
            for i in range(FLOOD):  # ... while the flood comes in
                tg.start_soon(send, "models", "GET", f"{run.url}/v1/models", {"headers": run.admin})
                if i % 100 == 0:
                    await anyio.lowlevel.checkpoint()

        assert not failures, failures.most_common(5)
        assert len(results) == FLOOD + SLOW
        statuses = Counter(r.status_code for _, r in results)
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[200] > 0 and statuses[429] > 0, statuses
        for what, r in results:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1", r.headers
                error_of(r, 429, code="rate_limit_exceeded", kind="rate_limit_error")
            elif what == "models":
                assert r.json()["data"][0]["id"] == "tiny"
        assert statuses[200] + statuses[429] == FLOOD + SLOW
        # every slot is given back
        with anyio.fail_after(5):
            while run.h.server.active_requests:
                await anyio.sleep(0.01)
        by_session = {int(w.split()[1]): r.status_code for w, r in results if w != "models"}
        assert sorted(by_session) == list(range(SLOW))
        assert Counter(by_session.values())[200] >= 32 and 429 in by_session.values(), by_session
        # every session is served: those whose call got a 429 (untouched) and the others,
        # and the run goes on
        engine.delay_s = 0.0
        for info, played in sessions:
            await run.finish(info, played)
        await run.still_serves()


# ------------------------------------------------------------------ 6. the key files, the logs
async def test_key_files_and_no_key_in_the_logs(
    model: gs.Model, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "run"
    key_file, info_file = out / "gateway.key", out / "gateway.json"
    with structlog.testing.capture_logs() as events:
        async with serving(model, out) as run:
            admin_key = run.h.server.admin_key
            assert admin_key.startswith("sk-arl-") and len(admin_key) > 40
            assert key_file.is_file()
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            assert key_file.read_text().strip() == admin_key
            text = info_file.read_text()
            info = json.loads(text)
            assert info["url"] == run.url
            assert Path(info["key_file"]) == key_file.resolve()
            assert admin_key not in text and "sk-arl-" not in text
            # some traffic, hostile and not, for the logs to have something to say
            s, played = await run.claim()
            for headers in (bearer(admin_key + "x"), bearer(s["api_key"]), {}):
                await run.client.get(f"{run.url}/v1/models", headers=headers)
            leak = {"messages": [{"role": "user", "content": admin_key}]}
            await run.client.post(f"{s['base_url']}/chat/completions", headers=run.admin, json=leak)
            await run.finish(s, played)
            await run.still_serves()
            session_keys = [s["api_key"]]
    assert not key_file.exists() and not info_file.exists()
    assert not (out / "gateway.json.tmp").exists()
    logged = "\n".join([repr(events), caplog.text, *capsys.readouterr()])
    assert "gateway_listening" in logged  # the capture sees the gateway's log
    for key in (admin_key, *session_keys):
        assert key not in logged
        assert key[len("sk-arl-") :][:16] not in logged


# ------------------------------------------------------------------ 7. the session rules
async def test_one_call_at_a_time_is_409(model: gs.Model, tmp_path: Path) -> None:
    engine = gs.ScriptedEngine(model, 0, delay_s=0.5)
    async with serving(model, tmp_path, engine=engine) as run:
        info, played = await run.claim()
        first: list[httpx.Response] = []

        async def call() -> None:
            first.append(await run.chat(info))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            with anyio.fail_after(5):
                while run.h.gateway.stats["calls"] == 0:
                    await anyio.sleep(0.01)
            for kind, body in (("chat", None), ("completions", {"model": "x", "prompt": "hi"})):
                if kind == "chat":
                    r = await run.chat(info)
                else:
                    r = await run.client.post(f"{info['base_url']}/completions", json=body,
                                              headers=bearer(info["api_key"]))  # fmt: skip
                error_of(r, 409, code="session_busy")
            assert not first  # still in progress
        assert first[0].status_code == 200, first[0].text
        assert run.h.gateway.stats["calls"] == 1
        engine.delay_s = 0.0
        await run.finish(info, played)
        await run.still_serves()


async def test_a_client_that_goes_away_cancels_its_call(model: gs.Model, tmp_path: Path) -> None:
    """A client that closes its connection mid-call (a timeout, a killed agent) cancels the
    call at once: its engine request ends, and the session takes the retry (no 409)."""
    engine = gs.ScriptedEngine(model, 0, delay_s=30.0)
    async with serving(model, tmp_path, engine=engine) as run:
        info, played = await run.claim()
        body = json.dumps({"model": "x", "messages": info["prompt"]["messages"]}).encode()
        path = info["base_url"].split("/", 3)[3]
        host, port = run.url.split("//")[1].split(":")
        stream = await anyio.connect_tcp(host, int(port))
        await stream.send(f"POST /{path}/chat/completions HTTP/1.1\r\nhost: x\r\n"
                          f"authorization: Bearer {info['api_key']}\r\ncontent-type: "
                          f"application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                          + body)  # fmt: skip
        with anyio.fail_after(5):
            while run.h.gateway.stats["calls"] == 0:
                await anyio.sleep(0.01)
        await stream.aclose()  # the engine would take 30 s: gone after 0.0x s
        engine.delay_s = 0.0
        with anyio.fail_after(5):
            await run.finish(info, played)  # the retry is served (not 409), the session ends
        assert run.h.gateway.stats["calls"] == 2 and len(engine.requests) == 1
        await run.still_serves()


async def test_reward_without_an_answered_call_is_409(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        r = await run.reward(info["session_id"])
        error_of(r, 409, code="nothing_to_train")
        assert played.score is None and played.error is None
        await run.finish(info, played)  # the session goes on: a call, then its reward
        await run.still_serves()


async def test_a_refused_call_does_not_change_the_api_a_session_may_call(
    model: gs.Model, tmp_path: Path
) -> None:
    """A session commits to chat or text completions with its first answered call: a
    completions call refused by the record (an id outside the vocabulary) leaves the session
    free, and a chat call and its reward then succeed, training that chat turn only."""
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        url, key = f"{info['base_url']}/completions", bearer(info["api_key"])
        r = await run.client.post(url, json={"model": "x", "prompt": [999_999]}, headers=key)
        err = error_of(r, 400, code="conversation_rejected")
        assert "vocabulary" in err["message"], err
        await run.finish(info, played)  # chat 200, reward 200, scored 1.0
        (request,) = run.h.engine.requests  # the refused call reached no engine
        (sample,) = played.samples
        assert gs.trained_turns(sample) == [request.token_ids]
        assert sample.token_ids.tolist()[: sample.prompt_len] == request.prompt_ids
        # an answered call does commit the session: completions, then chat is refused
        info, played = await run.claim()
        r = await run.client.post(f"{info['base_url']}/completions", json={
            "model": "x", "prompt": "12+34="}, headers=bearer(info["api_key"]))  # fmt: skip
        assert r.status_code == 200, r.text
        err = error_of(await run.chat(info), 400)
        assert "this session calls /v1/completions" in err["message"], err
        r = await run.reward(info["session_id"])
        assert r.status_code == 200, r.text
        await ended(played)
        assert played.error is None and played.score is not None


async def test_a_session_taken_and_dropped_is_offered_again(
    model: gs.Model, tmp_path: Path
) -> None:
    """A client that takes a session (201) and never calls it holds the session's group for
    gateway.claim_timeout_s, not idle_timeout_s: the session is offered again under a new id
    and key, the next agent trains the same episode, and the step record counts the stall."""
    async with serving(model, tmp_path, claim_timeout_s=0.3) as run:
        lost, played = await run.claim()  # taken, then dropped
        # ...but for a call whose body is still on its way when the session is offered again
        body = json.dumps({"model": "x", "messages": lost["prompt"]["messages"]}).encode()
        host, port = run.url.split("//")[1].split(":")
        late = await anyio.connect_tcp(host, int(port))
        await late.send(f"POST /{lost['base_url'].split('/', 3)[3]}/chat/completions HTTP/1.1"
                        f"\r\nhost: x\r\nauthorization: Bearer {lost['api_key']}\r\ncontent-type: "
                        f"application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                        + body[:5])  # fmt: skip
        began = time.perf_counter()
        r = await run.client.post(f"{run.url}/rl/sessions", headers=run.admin,
                                  json={"wait_s": 5})  # fmt: skip
        waited = time.perf_counter() - began
        assert r.status_code == 201, r.text
        again = r.json()
        assert 0.25 <= waited < 2.0, waited  # the claim deadline, 0.3 s
        assert again["episode"] == lost["episode"] and again["claim_timeout_s"] == 0.3
        assert again["session_id"] != lost["session_id"] and again["api_key"] != lost["api_key"]
        await late.send(body[5:])  # its body arrives now: it does not get the session
        with anyio.fail_after(5):
            answer = await late.receive()
        await late.aclose()
        assert answer.startswith(b"HTTP/1.1 410 "), answer[:200]
        assert b"claim_timeout_s" in answer and run.h.gateway.stats["calls"] == 0
        # what the first agent was given reaches it no more: 410 naming the deadline
        err = error_of(await run.chat(lost), 410, code="session_ended")
        assert "gateway.claim_timeout_s" in err["message"], err
        error_of(await run.reward(lost["session_id"]), 410, code="session_ended")
        await run.finish(again, played)  # the same episode, scored: its group goes on
        m = run.h.gateway.take_metrics()
        assert (m["gateway_expired_unclaimed"], m["gateway_expired_idle"]) == (1, 0), m
        assert m["gateway_stall_s"] == pytest.approx(0.3) and m["gateway_sessions"] == 1, m
        await run.still_serves()


async def test_a_session_left_idle_fails_and_is_counted(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path, idle_timeout_s=0.3) as run:
        info, played = await run.claim()
        r = await run.chat(info)
        assert r.status_code == 200, r.text
        began = time.perf_counter()
        await ended(played)  # no reward
        assert 0.25 <= time.perf_counter() - began < 2.0
        assert isinstance(played.error, SessionFailed), played.error
        assert "gateway.idle_timeout_s" in str(played.error)
        m = run.h.gateway.take_metrics()
        assert (m["gateway_expired_unclaimed"], m["gateway_expired_idle"]) == (0, 1), m
        assert m["gateway_stall_s"] == pytest.approx(0.3), m
        await run.still_serves()


async def test_ended_sessions_are_410(model: gs.Model, tmp_path: Path) -> None:
    async with serving(model, tmp_path) as run:
        (a, pa), (b, pb) = await run.claim(), await run.claim()
        await run.finish(a, pa)
        sid = a["session_id"]
        # the admin routes: the reward again, a give-back
        error_of(await run.reward(sid), 410, code="session_ended")
        r = await run.client.delete(f"{run.url}/rl/sessions/{sid}", headers=run.admin)
        error_of(r, 410, code="session_ended")
        # a session given back ends too (its episode fails: its group runs again)
        r = await run.client.delete(f"{run.url}/rl/sessions/{b['session_id']}", headers=run.admin)
        assert r.status_code == 200, r.text
        await ended(pb)
        assert isinstance(pb.error, Exception) and "given back" in str(pb.error)
        error_of(await run.reward(b["session_id"]), 410, code="session_ended")
        await run.still_serves()


async def test_a_call_with_its_own_key_on_an_ended_session_is_410(
    model: gs.Model, tmp_path: Path
) -> None:
    async with serving(model, tmp_path) as run:
        info, played = await run.claim()
        await run.finish(info, played)
        r = await run.chat(info)
        try:
            error_of(r, 410, code="session_ended")
        finally:
            await run.still_serves()


async def test_unknown_and_foreign_session_ids_leak_nothing(
    model: gs.Model, tmp_path: Path
) -> None:
    async with serving(model, tmp_path) as run:
        (a, pa), (b, pb) = await run.claim(), await run.claim()
        await run.finish(b, pb)  # b ended: a tombstone
        secrets = (run.h.server.admin_key, a["api_key"], b["api_key"])
        unknown = "s999-deadbeef"
        # without a valid key, every id looks the same: 401 (no probing of which exist)
        for sid in (a["session_id"], b["session_id"], unknown):
            for method, url, body in routes(run.url, sid)[5:]:
                r = await run.client.request(method, url, json=body, headers=bearer("sk-arl-x"))
                error_of(r, 401, code="invalid_api_key")
        # what the code does with a valid key of another session: 404 for an id it never
        # had, 410 for one that ended, 403 for a live one; no body names anything but the
        # id the caller sent
        expected = {unknown: (404, "session_not_found"), b["session_id"]: (410, "session_ended")}
        for sid, (status, code) in expected.items():
            for method, url, body in routes(run.url, sid)[5:]:
                r = await run.client.request(method, url, json=body, headers=bearer(a["api_key"]))
                err = error_of(r, status, code=code)
                assert not any(s in r.text for s in secrets), r.text
                assert a["session_id"] not in r.text  # the caller's own session is not named
                for prompt in (a["prompt"], b["prompt"]):
                    assert json.dumps(prompt["messages"][0]["content"]) not in r.text
                assert err["param"] is None
        # the admin key on an unknown id's reward and give-back: 404
        r = await run.client.post(f"{run.url}/rl/sessions/{unknown}/reward", json={"reward": 1.0},
                                  headers=run.admin)  # fmt: skip
        error_of(r, 404, code="session_not_found")
        r = await run.client.delete(f"{run.url}/rl/sessions/{unknown}", headers=run.admin)
        error_of(r, 404, code="session_not_found")
        # ids with odd characters are just unknown ids
        for sid in ("..%2F..%2Fetc", "%00", "a" * 2000):
            r = await run.client.get(f"{run.url}/s/{sid}/v1/models", headers=bearer(a["api_key"]))
            assert r.status_code == 404, (sid, r.status_code, r.text)
            error_of(r, 404)
        # paths near a model call's (which skips Starlette's router) are not one
        chat = {"model": "x", "messages": a["prompt"]["messages"]}
        for path in ("/s/", "/s/x", "/s//v1/chat/completions", f"/s/{a['session_id']}/v2/chat/"
                     "completions", f"/s/{a['session_id']}/v1/chat/completions/more",
                     f"/s/{a['session_id']}/v1/chat", "/s/x/y/v1/completions"):  # fmt: skip
            r = await run.client.post(f"{run.url}{path}", json=chat, headers=bearer(a["api_key"]))
            error_of(r, 404)
        r = await run.client.put(f"{a['base_url']}/chat/completions", json=chat,
                                 headers=bearer(a["api_key"]))  # fmt: skip
        error_of(r, 405)
        await run.finish(a, pa)
        await run.still_serves()
