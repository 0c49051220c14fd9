"""The gateway's HTTP side: a Starlette app served by uvicorn as a task of the controller.

Routes (every one needs ``Authorization: Bearer <key>``)::

    GET    /v1/models                          admin key
    POST   /rl/sessions                        admin key   take the next episode: id, key, prompt
    GET    /rl/sessions                        admin key   sessions waiting and active
    POST   /rl/sessions/<id>/reward            admin key   end it with its reward
    DELETE /rl/sessions/<id>                   admin key   give it back (its group runs again)
    GET    /s/<id>/v1/models                   its key
    POST   /s/<id>/v1/chat/completions         its key     streamed (SSE) or not
    POST   /s/<id>/v1/completions              its key

No key: 401. A session's key anywhere but its own session, or the admin key on a session's
model routes: 403. Bodies over :data:`MAX_BODY_BYTES`, or holding more than
:data:`MAX_JSON_VALUES` JSON values: 413; a chat request over :data:`MAX_MESSAGES` or
:data:`MAX_TOOLS`: 400; more than :data:`MAX_CONCURRENT_REQUESTS` requests at once: 429 with
``Retry-After``. What a connection may hold (the deadlines of a request's head and body, its
head's size, :data:`MAX_CONNECTIONS`) is :mod:`asyncrl_gateway.connections`'s. These guards
(:class:`Guards`) are defences against broken or hostile clients, not decisions of a run: they
were ``[gateway]`` keys until issue 50, and a test passes :class:`Guards` of its own.
Every error has an OpenAI-style body (``{"error": {"message", "type", "param", "code"}}``).

uvicorn runs on the controller's event loop, inside its task group: :meth:`GatewayServer.serve`
binds the socket itself (the port read back from it), starts uvicorn on it with uvicorn's
signal handlers left out (the controller owns SIGINT and SIGTERM), and on cancellation closes
the listener, lets calls in progress end for a short grace and cancels what is left, before it
returns. The admin key is made per run and written to ``<run.output_dir>/gateway.key`` (mode
0600), beside ``gateway.json`` (the URL); both are removed when the run ends. Keys are never
logged.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from asyncrl_gateway import replies
from asyncrl_gateway.config import GatewayConfig, gateway_config
from asyncrl_gateway.connections import ConnectionLimits, GuardedHttp
from asyncrl_gateway.gateway import Gateway, check_gateway
from asyncrl_gateway.schema import (
    ChatRequest,
    CompletionRequest,
    GatewayError,
    RewardRequest,
    SessionRequest,
    check_lengths,
    decode,
    error_body,
    json_values,
    now_s,
)
from asyncrl_gateway.sessions import HttpCall, Finish, Session, digest, make_key

__all__ = [
    "GUARDS", "KEEP_ALIVE_TIMEOUT_S", "MAX_BODY_BYTES", "MAX_CONCURRENT_REQUESTS",
    "MAX_CONNECTIONS", "MAX_JSON_VALUES", "MAX_MESSAGES", "MAX_TOOLS", "REQUEST_BODY_TIMEOUT_S",
    "REQUEST_HEAD_TIMEOUT_S", "GatewayServer", "Guards",
]  # fmt: skip

log = structlog.get_logger("asyncrl_gateway.server")

GRACE_S = 2
"""Calls in progress when the run ends get this long to finish before they are cancelled."""
STOP_S = 10.0
"""Bound on uvicorn's shutdown after the grace (then its connections are dropped)."""

_JSON = "application/json"
_SSE = "text/event-stream; charset=utf-8"

# What one request or connection may hold of the controller's loop (docs/gateway.md, "One
# request, one connection"; measured with benchmarks/hostile_client.py and
# benchmarks/gateway.py --hostile). Each was a ``gateway.*`` key of the same name until issue 50.
MAX_CONCURRENT_REQUESTS = 4096
"""HTTP requests served at once; more get 429 (with ``Retry-After``) before their body is read.
1,000 agents at once got no 429 at half this (benchmarks/gateway.py ran with 2,048); 2,000
concurrent connections on a server limited to 32 were each answered 200 or 429, the run going
on (tests/test_gateway_security.py)."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body; a larger one gets 413, on ``Content-Length`` before it is read and
while a chunked one is. 4 MiB holds a conversation of about a million tokens of text."""
MAX_JSON_VALUES = 131072
"""Most JSON values in a request body, counted before it is decoded; more get 413. Counted as
its commas, brackets and braces, those inside strings too (an upper bound; in a worker thread,
about 1 ms a 4 MiB body; skipped for bodies of at most twice this many bytes, which cannot hold
more). Decoding takes the loop up to ~55 ns a value and cannot be moved off it (the decoder
holds the GIL): a 4 MiB body of empty objects took 77 ms; this bounds it to ~7 ms. A request
needs a few values a message, a few dozen a tool, one a token id of a text completion's
prompt; prose has about a comma every 60 characters."""
MAX_MESSAGES = 2048
"""Most messages in a chat request; more get 400 (``array_above_max_length``) before anything
else is done with them. Each costs the loop a few microseconds to compare with the record and
template (100,000 in a 4 MB body held it about a second); an agent that keeps a long history
stays far below (a hundred tool calls are ~200 messages)."""
MAX_TOOLS = 128
"""Most tool definitions in a chat request (OpenAI's own limit); more get 400."""
REQUEST_HEAD_TIMEOUT_S = 10.0
"""Longest wait for a request's head (its request line and headers), from the connection's
start or the request's first byte: past it the connection is closed, with 408 when part of a
head came. A client writes a head in one go; this cuts connections that send nothing, or a
byte at a time (each one held a socket for as long as it liked)."""
REQUEST_BODY_TIMEOUT_S = 30.0
"""Longest wait for a request's whole body, from the end of its head: past it the request gets
408 and its connection is closed. 30 s lets a 4 MiB body come at 140 KB/s."""
KEEP_ALIVE_TIMEOUT_S = 30.0
"""An idle keep-alive connection (its last response sent, no next request begun) is closed
after this long: longer than the clients' own pool expiry (httpx's 5 s, aiohttp's 15 s), so a
client does not reuse a connection the gateway is closing."""
MAX_CONNECTIONS = 8192
"""Connections open at once; a connection beyond it gets 429 (with ``Retry-After``) for its
first request, and is closed. Each one is a file descriptor of the controller's process;
past the process's own limit (``ulimit -n``) new connections are not even accepted (asyncio
stops accepting for a second at a time), so on a host with a lower limit that one binds
first."""


@dataclass(frozen=True)
class Guards:
    """The guards one server applies (defaults: the module's constants above)."""

    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_values: int = MAX_JSON_VALUES
    max_messages: int = MAX_MESSAGES
    max_tools: int = MAX_TOOLS
    request_head_timeout_s: float = REQUEST_HEAD_TIMEOUT_S
    request_body_timeout_s: float = REQUEST_BODY_TIMEOUT_S
    keep_alive_timeout_s: float = KEEP_ALIVE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


GUARDS = Guards()
"""What a run's gateway serves with."""


def _json(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type=_JSON, headers=headers)


def _error(exc: GatewayError) -> Response:
    headers = dict(exc.headers)
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _json(exc.body(), exc.status, headers)


class _Limit:
    """ASGI wrapper: at most ``limit`` HTTP requests at once, 429 beyond (before the body is
    read). A session's model calls (``POST /s/<id>/v1/chat/completions`` and
    ``/completions``, by far the most requests) go straight to their endpoints, past
    Starlette's middleware and router: fewer layers on the loop per call; everything else
    (and any other method on those paths) goes through the app."""

    def __init__(self, app: Any, limit: int, calls: dict[str, _CallRoute]) -> None:
        self._app, self._limit, self._calls = app, limit, calls
        self.active = 0

    def _call_route(self, scope: Any) -> _CallRoute | None:
        """The endpoint of a model call, with its session id in ``path_params``."""
        if scope["method"] != "POST" or not scope["path"].startswith("/s/"):
            return None
        parts = scope["path"].split("/", 4)  # "", "s", <id>, "v1", <the rest>
        if len(parts) < 5 or not parts[2] or parts[3] != "v1":
            return None
        sid, route = parts[2], self._calls.get(parts[4])
        if route is not None:
            scope["path_params"] = {"sid": sid}
        return route

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        if self.active >= self._limit:
            body = error_body(f"too many requests at once (the gateway serves {self._limit}: "
                              "MAX_CONCURRENT_REQUESTS); retry shortly", kind="rate_limit_error",
                              code="rate_limit_exceeded")  # fmt: skip
            await send({"type": "http.response.start", "status": 429, "headers": [
                (b"content-type", _JSON.encode()), (b"retry-after", b"1"),
                (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return None
        self.active += 1
        try:
            route = self._call_route(scope)
            if route is None:
                await self._app(scope, receive, send)
            else:
                await route.direct(scope, receive, send)
        finally:
            self.active -= 1


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the controller's are the run's)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """Serves ``gateway`` over HTTP (see the module docstring).

    Args:
        gateway: the run's gateway (its sessions and their calls).
        config: ``[gateway]``.
        output_dir: ``run.output_dir`` (``gateway.json`` and ``gateway.key`` go there).
        guards: what a request or a connection may hold (:data:`GUARDS`; tests pass tighter
            ones).
    """

    def __init__(
        self, gateway: Gateway, config: GatewayConfig, output_dir: str,
        guards: Guards | None = None,
    ) -> None:  # fmt: skip
        self._gw, self._cfg, self._guards = gateway, config, guards or GUARDS
        self._sessions = gateway.sessions
        self._dir = Path(output_dir)
        self.admin_key = make_key()
        self._admin_digest = digest(self.admin_key)
        self.url = ""
        self._limit: _Limit | None = None

    @property
    def active_requests(self) -> int:
        return self._limit.active if self._limit is not None else 0

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> Any:
        calls = {"chat/completions": _CallRoute(self, "chat", ChatRequest),
                 "completions": _CallRoute(self, "completion", CompletionRequest)}  # fmt: skip
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/rl/sessions", self._new_session, methods=["POST"]),
            Route("/rl/sessions", self._list_sessions, methods=["GET"]),
            Route("/rl/sessions/{sid}/reward", self._reward, methods=["POST"]),
            Route("/rl/sessions/{sid}", self._give_back, methods=["DELETE"]),
            Route("/s/{sid}/v1/models", self._session_models, methods=["GET"]),
            Route("/s/{sid}/v1/chat/completions", calls["chat/completions"], methods=["POST"]),
            Route("/s/{sid}/v1/completions", calls["completions"], methods=["POST"]),
        ]

        async def http_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            return _error(GatewayError(exc.status_code, f"{request.method} {request.url.path}: "
                                       f"{exc.detail}"))  # fmt: skip

        async def gateway_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, GatewayError)
            return _error(exc)

        app = Starlette(routes=routes, exception_handlers={
            HTTPException: http_error, GatewayError: gateway_error})  # fmt: skip
        self._limit = _Limit(app, self._guards.max_concurrent_requests, calls)
        return self._limit

    async def serve(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``task_status`` gets the URL once listening.

        Raises:
            OSError: the address cannot be bound (in use, not this machine's).

        Cancellation: stops listening, gives calls in progress ``GRACE_S``, cancels the
        rest, removes ``gateway.json`` and ``gateway.key``.
        """
        cfg = self._cfg
        sock = _bind(cfg.host, cfg.port)
        port = sock.getsockname()[1]
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        self.url = f"http://{host}:{port}"
        guards = self._guards
        limits = ConnectionLimits(guards.request_head_timeout_s, guards.request_body_timeout_s,
                                  guards.max_connections)  # fmt: skip
        server = _Server(uvicorn.Config(
            self.app(), lifespan="off", log_config=None, access_log=False, server_header=False,
            timeout_graceful_shutdown=GRACE_S, ws="none", backlog=4096, proxy_headers=False,
            http=functools.partial(GuardedHttp, limits=limits),  # type: ignore[arg-type]
            timeout_keep_alive=guards.keep_alive_timeout_s,  # type: ignore[arg-type]
        ))  # fmt: skip
        done = anyio.Event()

        async def run() -> None:
            with anyio.CancelScope(shield=True):  # stopped by should_exit, never cancelled
                try:
                    await server.serve(sockets=[sock])
                finally:
                    sock.close()
                    done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, name="gateway-http")
            try:
                while not server.started and not done.is_set():
                    await anyio.sleep(0.01)
                self._write_files()
                log.info("gateway_listening", url=self.url, key_file=str(self._key_path))
                task_status.started(self.url)
                await done.wait()
            finally:
                self._sessions.shut()
                server.should_exit = True
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(GRACE_S + STOP_S):
                        await done.wait()
                    server.force_exit = True
                    self._remove_files()

    @property
    def _key_path(self) -> Path:
        return self._dir / "gateway.key"

    def _write_files(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        self._key_path.unlink(missing_ok=True)
        fd = os.open(self._key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_key + "\n")
        info = {"url": self.url, "key_file": str(self._key_path.resolve()),
                "model": self._gw.model_name, "pid": os.getpid()}  # fmt: skip
        tmp = self._dir / "gateway.json.tmp"
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        tmp.replace(self._dir / "gateway.json")

    def _remove_files(self) -> None:
        for name in ("gateway.key", "gateway.json", "gateway.json.tmp"):
            (self._dir / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ keys
    def _key(self, request: Request) -> str:
        value = request.headers.get("authorization", "")
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise GatewayError(401, "no API key: send Authorization: Bearer <key> (the session "
                               "key for /s/<id>/v1, the admin key for /rl and /v1)",
                               kind="authentication_error", code="missing_api_key")  # fmt: skip
        return key.strip()

    def _admin(self, request: Request) -> None:
        key = self._key(request)
        if hmac.compare_digest(digest(key), self._admin_digest):
            return
        if self._sessions.is_session_key(key):
            raise GatewayError(403, "a session key reaches its own session only: this route "
                               "needs the admin key", kind="permission_error")  # fmt: skip
        raise GatewayError(401, "invalid API key", kind="authentication_error",
                           code="invalid_api_key")  # fmt: skip

    def _session(self, request: Request) -> Session:
        given = digest(self._key(request))
        admin = hmac.compare_digest(given, self._admin_digest)
        if not (admin or self._sessions.knows_digest(given)):
            raise GatewayError(401, "invalid API key", kind="authentication_error",
                               code="invalid_api_key")  # fmt: skip
        session = self._sessions.get(request.path_params["sid"])
        if not hmac.compare_digest(given, session.key_digest):
            raise GatewayError(403, f"this key does not reach session {session.id} (use the "
                               "session's own key)", kind="permission_error")  # fmt: skip
        return session

    async def _body(self, request: Request) -> bytes:
        limit = self._guards.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
        except ClientDisconnect:  # it left before its body came: nobody reads the answer
            raise GatewayError(499, "the client closed the connection", code="cancelled") from None
        return b"".join(chunks)

    async def _decode(self, body: bytes, kind: type[Any]) -> Any:
        """``body`` as a ``kind`` struct (:func:`~asyncrl_gateway.schema.decode`), after the
        request limits that decoding would not respect: a body that may hold more than
        :data:`MAX_JSON_VALUES` values is not decoded (their count, an upper bound, is
        only taken for a body big enough to hold that many, in a worker thread: numpy's
        comparisons release the GIL, and on the loop they took 1-5 ms of a 4 MiB body), and
        a chat request's messages and tools are counted before anything else is done with
        them.

        Raises:
            GatewayError: 413 (too many values), 400 (too many messages or tools, or what
                :func:`~asyncrl_gateway.schema.decode` raises).
        """
        guards = self._guards
        big = len(body) > 2 * guards.max_json_values
        if big and await anyio.to_thread.run_sync(json_values, body) > guards.max_json_values:
            raise GatewayError(413, f"the request body holds more than {guards.max_json_values} "
                               "JSON values (the gateway's MAX_JSON_VALUES; counted as its "
                               "commas, brackets and braces)",
                               code="request_too_large")  # fmt: skip
        req = decode(body, kind)
        check_lengths(req, max_messages=guards.max_messages, max_tools=guards.max_tools)
        return req

    # ------------------------------------------------------------------ /rl
    async def _new_session(self, request: Request) -> Response:
        self._admin(request)
        body = await self._body(request)
        req = await self._decode(body, SessionRequest) if body.strip() else SessionRequest()
        session = await self._sessions.claim(req.prompt_id, req.wait_s)
        prompt = session.prompt
        return _json(msgspec.json.encode({
            "session_id": session.id, "api_key": session.key,
            "base_url": f"{self.url}/s/{session.id}/v1", "model": self._gw.model_name,
            "prompt": {"id": prompt.id, "messages": prompt.chat()}, "group": session.group,
            "episode": session.episode, "evaluation": session.evaluation,
            "session_timeout_s": self._cfg.session_timeout_s,
            "claim_timeout_s": self._cfg.claim_timeout_s,
            "idle_timeout_s": self._cfg.idle_timeout_s,
        }), 201)  # fmt: skip

    async def _list_sessions(self, request: Request) -> Response:
        self._admin(request)
        return _json(msgspec.json.encode(self._sessions.counts()))

    async def _reward(self, request: Request) -> Response:
        self._admin(request)
        session = self._sessions.get(request.path_params["sid"])
        req = await self._decode(await self._body(request), RewardRequest)
        _still(session, request)
        if req.reward is None and not req.rewards and not self._gw.scores:
            raise GatewayError(400, "give reward or rewards: the run's environment has no "
                               "score(prompt, completion) to score the session with",
                               param="reward")  # fmt: skip
        if not session.answered:
            raise GatewayError(409, f"session {session.id} has no answered call: nothing to "
                               "train. Give it back with DELETE /rl/sessions/<id> (its group "
                               "runs again)", code="nothing_to_train")  # fmt: skip
        session.finish(Finish(req.reward, dict(req.rewards or {}), req.correct))
        return _json(msgspec.json.encode({"session_id": session.id, "ended": True}))

    async def _give_back(self, request: Request) -> Response:
        self._admin(request)
        session = self._sessions.get(request.path_params["sid"])
        session.finish(Finish(abandon="given back with DELETE /rl/sessions/<id>"))
        return _json(msgspec.json.encode({"session_id": session.id, "ended": True}))

    # ------------------------------------------------------------------ /v1
    def _model_list(self) -> Response:
        return _json(msgspec.json.encode({"object": "list", "data": [{
            "id": self._gw.model_name, "object": "model", "created": now_s(),
            "owned_by": "asyncrl"}]}))  # fmt: skip

    async def _models(self, request: Request) -> Response:
        self._admin(request)
        return self._model_list()

    async def _session_models(self, request: Request) -> Response:
        self._session(request)
        return self._model_list()

    async def _call(self, request: Request, send: Any, kind: str, schema: type[Any]) -> None:
        """One model call, served in this task; the answer is written as soon as it is made
        (before this task's clean-up of its disconnect watch)."""
        began = time.perf_counter()
        session = self._session(request)
        checked = time.perf_counter()
        body = await self._body(request)
        # Server-Timing's total leaves out the wait for the body: a client that sends it after
        # its head (httpx does) makes the handler wait on the client's loop
        arrived = time.perf_counter() - (checked - began)
        _still(session, request)
        req = await self._decode(body, schema)
        req.check()
        call = HttpCall(kind, req, size=len(body))
        session.take(call)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch, call, request)
            await session.serve(call)
            if call.result is not None:
                await self._reply(send, req, kind, call.result, arrived)
            else:
                error = call.error or GatewayError(500, "the call ended unanswered")
                await _error(error)(request.scope, request.receive, send)
            # _watch returns once the response is complete (uvicorn's receive() says
            # http.disconnect then): no cancel() needed

    async def _reply(
        self, send: Any, req: Any, kind: str, result: replies.CallResult, arrived: float
    ) -> None:
        """Write ``result`` as the response to ``req``: one JSON body, or server-sent events."""
        head = replies.headers(result, time.perf_counter() - arrived)
        logprobs, text = bool(req.logprobs), self._gw.token_text
        if not req.stream:
            make = replies.chat_response if kind == "chat" else replies.completion_response
            body = make(result, logprobs=logprobs, token_text=text, token_ids=req.return_token_ids)
            return await _respond(send, head, [body], _JSON)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        if kind == "chat":
            events = [replies.role_chunk(result.id, result.created, result.model, len(result.choices)),
                      *replies.chat_chunks(result, logprobs=logprobs, usage=usage, token_text=text)]  # fmt: skip
        else:
            events = list(replies.completion_chunks(result, logprobs=logprobs, usage=usage,
                                                    token_text=text))  # fmt: skip
        await _respond(send, {**head, "cache-control": "no-cache"}, events, _SSE)


class _CallRoute:
    """The ASGI endpoint of a session's model calls (not a request → response function: the
    answer is written through ``send`` before the handler's clean-up, see
    :meth:`GatewayServer._call`)."""

    def __init__(self, server: GatewayServer, kind: str, schema: type[Any]) -> None:
        self._server, self._kind, self._schema = server, kind, schema

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive, send)
        await self._server._call(request, send, self._kind, self._schema)

    async def direct(self, scope: Any, receive: Any, send: Any) -> None:
        """As :meth:`__call__`, outside Starlette's exception middleware: its errors
        answered here (anything else is uvicorn's 500)."""
        try:
            await self(scope, receive, send)
        except GatewayError as exc:
            await _error(exc)(scope, receive, send)


async def _respond(send: Any, headers: dict[str, str], chunks: list[bytes], media: str) -> None:
    """A 200 response of ``chunks``: one body (``Content-Length``) or a stream of them."""
    head = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    head.append((b"content-type", media.encode()))
    if media == _JSON:
        (body,) = chunks
        head.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200, "headers": head})
    for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _watch(call: HttpCall, request: Request) -> None:
    """Cancel ``call`` if its client goes away before it is served (its engine requests are
    aborted)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not call.finished.is_set():
                call.cancel(GatewayError(499, "the client closed the connection",
                                         code="cancelled"))  # fmt: skip
            return


def _still(session: Session, request: Request) -> None:
    """``session`` is still the request's after its body came: not offered again meanwhile
    under another id (:meth:`~asyncrl_gateway.sessions.SessionTable.reoffer`).

    Raises:
        GatewayError: 410, why it was offered again.
    """
    if session.id != request.path_params["sid"]:
        raise GatewayError(410, f"session {request.path_params['sid']} has ended: no call "
                           "came within gateway.claim_timeout_s of its hand-out: it was "
                           "offered again", code="session_ended")  # fmt: skip


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body is larger than {limit} bytes "
                        "(the gateway's MAX_BODY_BYTES)", code="request_too_large")  # fmt: skip


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (``0``: a free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def build_gateway(
    config: Any, environment: Any, *, tokenizer: Any
) -> tuple[Gateway, GatewayServer]:
    """The run's gateway around ``environment`` and its server, from ``[gateway]``,
    ``[episode].tool_parser`` and ``failures.reward_timeout_s``.

    Raises:
        ConfigError, PluginError: as :func:`~asyncrl_gateway.gateway.check_gateway` (the
            controller's preflight runs it before anything starts).
    """
    from asyncrl_gateway.agents import ManagedAgents

    gw = gateway_config(config)
    parser = check_gateway(config, environment, tokenizer)
    name = Path(config.model.path).name  # what /v1/models and the responses call the model
    server: GatewayServer | None = None
    agents = None
    if gw.agent:
        log_dir = os.path.join(config.run.output_dir, "logs", "agents")
        agents = ManagedAgents(gw, log_dir,
                               base_url=lambda: server.url if server is not None else "")  # fmt: skip
    gateway = Gateway(gw, environment, tokenizer=tokenizer, parser=parser, model_name=name,
                      score_timeout_s=config.failures.reward_timeout_s, agents=agents,
                      context_tokens=config.episode.max_context_tokens,
                      env_name=config.environment.name)  # fmt: skip
    server = GatewayServer(gateway, gw, config.run.output_dir)
    return gateway, server
