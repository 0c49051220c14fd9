"""A hostile client of the gateway, for ``benchmarks/gateway.py --hostile``: a holder of the
admin key (so of any session's) that sends the largest bodies the gateway reads and holds
slow connections, beside the benchmark's agents. Run as ``--child hostile`` (an interpreter of
its own, started by the controller's child with the agents); it stops at a line on stdin and
writes what it saw as JSON to ``--child-out``.

- ``--hostile-big`` connections (default 1), each sending, back to back, bodies of the whole
  ``MAX_BODY_BYTES`` (4 MiB, asyncrl_gateway.server) as a session's chat call, in turn:
  ``messages`` (~140,000 one-letter messages: what held the loop ~1 s a request), ``text``
  (one message of 4 MiB of text: templating and encoding) and ``values`` (one message and
  4 MiB of zeros in a field the gateway ignores: decoding). It takes a session with ``POST /rl/sessions``, makes one
  plain call on it (so that a call over the context ends it truncated, trained with reward
  0, rather than failing its group before its first turn: that would end the other sessions
  of the group, whose agents' calls would get 410, and measure the failure policy rather
  than the loop), and takes another when one ends.
- ``--hostile-slow`` connections (default 60), a third each: ``head`` (a request head a byte a
  second), ``body`` (a ``POST /rl/sessions`` head, then its body a byte a second) and
  ``silent`` (nothing at all); each reconnects when the gateway closes it, and the times it
  was cut and what it was told are counted.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

MAX_BODY_BYTES = 4 * 1024 * 1024
"""``asyncrl_gateway.server.MAX_BODY_BYTES``: the largest body the gateway reads."""


def bodies(size: int) -> dict[str, bytes]:
    """The three bodies of ``size`` bytes (see the module docstring)."""

    def fill(head: bytes, unit: bytes, tail: bytes) -> bytes:
        n = (size - len(head) - len(tail)) // len(unit)
        body = head + unit * n + tail
        return body[: len(head)] + b" " * (size - len(body)) + body[len(head) :]

    one = b'{"role":"user","content":"x"}'
    return {
        "messages": fill(b'{"model":"x","messages":[', one + b",", one + b"]}"),
        "text": fill(b'{"model":"x","messages":[{"role":"user","content":"', b"lorem ipsum ",
                     b'"}]}'),  # fmt: skip
        "values": fill(b'{"model":"x","messages":[{"role":"user","content":"hi"}],"metadata":[',
                       b"0,", b"0]}"),  # fmt: skip
    }


async def run(url: str, admin_key: str, big: int, slow: int, out: Path) -> None:
    """Until a line on stdin; then ``out`` gets the counts."""
    import httpx

    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    admin = {"Authorization": f"Bearer {admin_key}"}
    payloads = bodies(MAX_BODY_BYTES)
    sent: dict[str, dict[str, Any]] = {k: {"n": 0, "status": {}, "s": []} for k in payloads}
    claims: list[float] = []
    cuts: dict[str, dict[str, Any]] = {m: {"cut": 0, "after_s": [], "answers": {}}
                                       for m in ("head", "body", "silent")}  # fmt: skip
    errors: dict[str, int] = {}

    def error(what: str) -> None:
        errors[what] = errors.get(what, 0) + 1

    async def big_sender(client: Any) -> None:
        kinds = itertools.cycle(payloads)
        session: dict[str, Any] | None = None
        while True:
            if session is None:
                t = time.monotonic()
                r = await client.post(f"{url}/rl/sessions", headers=admin, json={"wait_s": 30})
                if r.status_code != 201:
                    error(f"claim {r.status_code}")
                    await anyio.sleep(0.5)
                    continue
                claims.append(time.monotonic() - t)
                session = r.json()
                r = await client.post(f"{session['base_url']}/chat/completions",
                                      json={"model": "x", "max_tokens": 8,
                                            "messages": session["prompt"]["messages"]},
                                      headers={"Authorization":
                                               f"Bearer {session['api_key']}"})  # fmt: skip
                if r.status_code != 200:
                    error(f"first call {r.status_code}")
                    session = None
                    continue
            kind = next(kinds)
            t = time.monotonic()
            try:
                r = await client.post(f"{session['base_url']}/chat/completions",
                                      content=payloads[kind],
                                      headers={"Authorization": f"Bearer {session['api_key']}",
                                               "content-type": "application/json"})  # fmt: skip
            except httpx.HTTPError as exc:
                error(f"{kind} {type(exc).__name__}")
                session = None
                continue
            row = sent[kind]
            row["n"] += 1
            row["s"].append(time.monotonic() - t)
            code = ""
            if r.status_code != 200:
                code = r.json().get("error", {}).get("code") or ""
            label = f"{r.status_code} {code}".strip()
            row["status"][label] = row["status"].get(label, 0) + 1
            if r.status_code in (404, 410) or code in ("context_length_exceeded",
                                                        "session_turn_limit"):  # fmt: skip
                session = None  # it ended: take another

    async def slow_one(mode: str) -> None:
        head = (f"POST /rl/sessions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer "
                f"{admin_key}\r\ncontent-type: application/json\r\n"
                "content-length: 100\r\n\r\n")  # fmt: skip
        while True:
            started = time.monotonic()
            try:
                stream = await anyio.connect_tcp(host, port)
            except OSError as exc:
                error(f"slow connect {type(exc).__name__}")
                await anyio.sleep(1)
                continue
            answer = b""
            async with stream:
                async with anyio.create_task_group() as tg:

                    async def trickle(data: bytes) -> None:
                        for i in range(len(data)):
                            try:
                                await stream.send(data[i : i + 1])
                            except (anyio.BrokenResourceError, OSError):
                                return  # closed: the reader sees it
                            await anyio.sleep(1.0)

                    if mode == "head":
                        tg.start_soon(trickle, head.encode())
                    elif mode == "body":
                        await stream.send(head.encode())
                        tg.start_soon(trickle, b"x" * 100)
                    try:
                        while True:
                            answer += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()
            row = cuts[mode]
            row["cut"] += 1
            row["after_s"].append(time.monotonic() - started)
            told = answer.startswith(b"HTTP/1.1 ")
            status = answer.split(b" ", 2)[1].decode() if told else "none"
            row["answers"][status] = row["answers"].get(status, 0) + 1

    limits = httpx.Limits(max_connections=big + 1, max_keepalive_connections=big + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async with anyio.create_task_group() as tg:
            for _ in range(big):
                tg.start_soon(big_sender, client)
            for i in range(slow):
                tg.start_soon(slow_one, ("head", "body", "silent")[i % 3])
            await anyio.to_thread.run_sync(input, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
    for row in sent.values():
        times = sorted(row.pop("s"))
        row["s_p50"] = times[len(times) // 2] if times else None
        row["s_max"] = times[-1] if times else None
    for row in cuts.values():
        after = sorted(row.pop("after_s"))
        row["after_s_p50"] = after[len(after) // 2] if after else None
    out.write_text(json.dumps({"bodies": sent, "claims": len(claims), "slow": cuts,
                               "errors": errors}))  # fmt: skip
