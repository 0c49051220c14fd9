"""What one HTTP connection may hold of the gateway: its request's head and body each within a
deadline, a head of bounded size, and a place among ``MAX_CONNECTIONS``
(:mod:`asyncrl_gateway.server`'s guards).

uvicorn bounds none of this with its httptools parser (the one it picks when httptools is
installed, as it is here): it arms no timer while a request's head or body arrives (its
keep-alive timer runs only between a response and the next request's first byte, and any
byte stops it), its ``h11_max_incomplete_event_size`` applies to its pure-Python h11 parser
only, and its ``limit_concurrency`` answers a plain-text 503. :class:`GuardedHttp` is its
httptools protocol with these added, per connection and on the loop's own timers (no task
per connection)::

    connection made ─► head deadline (REQUEST_HEAD_TIMEOUT_S)
    first byte of a request (or of anything) after an idle time ─► head deadline
    head complete ─► body deadline (REQUEST_BODY_TIMEOUT_S) ─► body complete: none
    response sent ─► uvicorn's keep-alive timer (KEEP_ALIVE_TIMEOUT_S)

A deadline that passes closes the connection, with a 408 when part of the request came
(nothing came: closed as an idle one is); a head over ``MAX_HEAD_BYTES`` gets 431; the first
request of a connection made beyond ``MAX_CONNECTIONS`` gets 429 with
``Retry-After``. Every answer has the OpenAI error body and ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from asyncrl_gateway.schema import error_body

__all__ = ["ConnectionLimits", "GuardedHttp", "MAX_HEAD_BYTES"]

MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line and headers)."""


@dataclass(frozen=True)
class ConnectionLimits:
    head_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_head_bytes: int = MAX_HEAD_BYTES


class _Refused(Exception):
    """Raised from a parser callback: stops the parser; the connection gets ``response``."""

    def __init__(self, response: bytes) -> None:
        super().__init__()
        self.response = response


def http_error(
    status: int, message: str, *, code: str, kind: str = "invalid_request_error",
    retry_after_s: int | None = None, extra: Sequence[tuple[bytes, bytes]] = (),
) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body, closing the connection."""
    body = error_body(message, kind=kind, code=code)
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in extra]
    lines += [b"content-type: application/json", b"content-length: %d" % len(body),
              b"connection: close"]  # fmt: skip
    if retry_after_s is not None:
        lines.append(b"retry-after: %d" % retry_after_s)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines, a head size and a connection cap (see the
    module docstring). Built per connection by uvicorn (``http=`` a partial of it)."""

    def __init__(
        self, config: Any, server_state: Any, app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits,
    ) -> None:  # fmt: skip
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        """``"head"`` or ``"body"`` while its deadline runs, ``""`` while none does."""
        self._seen = False
        """A byte of the request whose head is awaited came."""
        self._head_bytes = 0
        self._beyond_cap = False

    # ------------------------------------------------------------------ the deadlines
    def _arm(self, phase: str, after_s: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(after_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = ""

    def _expired(self) -> None:
        phase, self._timer, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if phase == "head" and not self._seen:
            self.transport.close()  # nothing came: closed as an idle connection is
        elif cycle is not None and cycle.response_started:
            self.transport.close()  # answered already (before its body came): nothing to say
        else:
            if phase == "head":
                what = f"the request's head did not arrive within {self._limits.head_timeout_s:g} s"
                key = "the gateway's REQUEST_HEAD_TIMEOUT_S"
            else:
                what = f"the request's body did not arrive within {self._limits.body_timeout_s:g} s"
                key = "the gateway's REQUEST_BODY_TIMEOUT_S"
            if cycle is not None:  # the app waits for the body: it sees a disconnect
                cycle.disconnected = True
                cycle.message_event.set()
            self._refuse(http_error(408, f"{what} ({key}); the connection is closed",
                                    code="request_timeout", extra=self._defaults()))  # fmt: skip

    def _defaults(self) -> list[tuple[bytes, bytes]]:
        return list(self.server_state.default_headers)

    def _refuse(self, response: bytes) -> None:
        self._disarm()
        self.transport.write(response)
        self.transport.close()

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._beyond_cap = len(self.connections) > self._limits.max_connections
        self._arm("head", self._limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the head deadline armed by a first byte after an idle time, and
        the refusals of the parser callbacks answered."""
        self._unset_keepalive_if_required()
        if not self._phase:
            self._arm("head", self._limits.head_timeout_s)
            self._seen = False
        if self._phase == "head":
            self._seen = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Refused):
                self._refuse(exc.__context__.response)
                return
            self._bad_request()
        except httptools.HttpParserUpgrade:
            pass  # served as plain HTTP/1.1, as uvicorn does without a WebSocket protocol
        except httptools.HttpParserError:
            self._bad_request()

    def _bad_request(self) -> None:
        self._refuse(http_error(400, "the request is not valid HTTP/1.1", code="invalid_http",
                                extra=self._defaults()))  # fmt: skip

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        if not self._phase:  # the next request began in the data that ended the last one
            self._arm("head", self._limits.head_timeout_s)
            self._seen = True
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self._limits.max_head_bytes:
            raise _Refused(http_error(
                431, f"the request's head is larger than {self._limits.max_head_bytes} bytes",
                code="request_header_fields_too_large", extra=self._defaults()))  # fmt: skip

    def on_headers_complete(self) -> None:
        if self._beyond_cap:
            limit = self._limits.max_connections
            raise _Refused(http_error(
                429, f"too many connections at once (the gateway's MAX_CONNECTIONS = {limit}); "
                "retry shortly", code="too_many_connections", kind="rate_limit_error",
                retry_after_s=1, extra=self._defaults()))  # fmt: skip
        self._arm("body", self._limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()
