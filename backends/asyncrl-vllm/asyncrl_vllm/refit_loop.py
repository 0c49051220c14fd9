"""One engine call per refit: the engine's worker reads the buckets from a socket of its own.

Through ``collective_rpc`` every bucket costs an engine round trip beyond its work: the engine
core takes the call, hands it to the worker through its shared-memory queue, waits, and sends
the answer back (~1 ms on an H200 host; a 7B refit in 15 buckets spent 32 ms in bucket calls
while the worker was busy for 16.5 ms of them). So the first bucket starts one long call,
``asyncrl_load_loop``, and each bucket then travels over a ZeroMQ pair of DEALER sockets
between the backend (bound at ``ipc://<engine's private dir>/refit.sock``) and the worker
(connected once, kept for its life)::

    backend (rollout worker)                          engine worker (in asyncrl_load_loop)
        ── [v, i, transport, handle, entries, last, kv_scales] ──►  load it (the same
        ◄── {"version": v, "index": i, ...the load's answer} ──     asyncrl_load_bucket)
        ...                                                          returns after the last
        ── [v, -1, "abort"] ──►  (a failed refit: the loop ends)      bucket, or on error:
        ◄── {"version": v, "index": -1, "end": why} ──                 says so, then returns

Messages are msgpack of plain lists and dicts (nothing pickled). Every message names its
version: a message left over from a failed refit (a bucket the loop never took, an answer
nobody read) is skipped by both ends. Every wait is bounded. The engine core is busy for the
whole refit, which is paused anyway.

The backend's end is :class:`LoopClient` (anyio, in the rollout worker); the worker's end is
:func:`serve_buckets` (blocking, in vLLM's worker process, called by the extension).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import msgspec

__all__ = ["ABORT", "LoopClient", "serve_buckets"]

ABORT = "abort"
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def serve_buckets(
    sock: Any,
    version: int,
    load: Callable[..., dict[str, Any]],
    open_mode: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    """The worker's loop for the refit to ``version``: take bucket messages from ``sock`` (a
    connected blocking ZeroMQ socket), load each with ``load(transport, handle, entries,
    open_mode, last, kv_scales)`` (``open_mode`` for the first only) and answer it, until the
    last bucket. Returns the last bucket's answer, or ``{"end": why}`` when the loop stopped
    early (an abort, a failed load, nothing within ``timeout_s``), which it also sends."""
    first = True
    try:
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                why = f"no bucket of v{version} within {timeout_s:.0f} s"
                break
            msg = _decode(sock.recv())
            if msg[0] != version:
                continue  # left over from a failed refit
            if msg[2] == ABORT:
                why = f"the refit to v{version} was aborted"
                break
            _, index, transport, handle, entries, last, kv_scales = msg
            try:
                out = load(
                    transport, handle, entries, open_mode if first else None, last, kv_scales
                )
            except Exception as exc:  # noqa: BLE001 - answered, then the loop ends
                why = f"{type(exc).__name__}: {exc}"
                sock.send(_encode({"version": version, "index": index, "error": why}))
                break
            first = False
            sock.send(_encode({"version": version, "index": index, **out}))
            if last:
                return out
    except Exception as exc:  # noqa: BLE001 - a bad message: the backend must hear of it
        why = f"the loop failed: {type(exc).__name__}: {exc}"
    sock.send(_encode({"version": version, "index": -1, "end": why}))
    return {"end": why}


class LoopClient:
    """The backend's end of one engine's refit loops (see the module docstring).

    Args:
        sock: a bound DEALER (:class:`asyncrl.transport.AsyncSocket`, ``copy=True``).
        address: where the worker connects.
        timeout_s: bound on every wait (``rpc_timeout_s``).
    """

    def __init__(self, sock: Any, address: str, timeout_s: float) -> None:
        self._sock = sock
        self.address = address
        self._timeout_s = timeout_s
        self._version: int | None = None
        self._call: asyncio.Future[Any] | None = None
        self._over = anyio.Event()
        self._turn: anyio.Event | None = None
        """Set once the answer of the bucket sent last is read (answers come in order)."""
        self._ended: str | None = None

    def open(self, version: int, call: Coroutine[Any, Any, Any]) -> None:
        """A refit to ``version`` begins: ``call`` is the long engine call that runs the
        worker's loop. It runs as a task owned by this client until :meth:`finish`,
        :meth:`abort` or :meth:`close`."""
        if self._call is not None and not self._call.done():
            call.close()
            raise RuntimeError("a refit loop is still running")
        if self._call is not None and not self._call.cancelled():
            self._call.exception()  # a failed refit's call: retrieved, so asyncio keeps quiet
        self._version, self._turn, self._ended = version, None, None
        self._over = anyio.Event()
        self._call = asyncio.ensure_future(call)
        self._call.add_done_callback(lambda _: self._over.set())

    async def load(
        self,
        index: int,
        transport: str,
        handle: bytes,
        entries: list[list[Any]],
        last: bool,
        kv_scales: dict[str, float] | None,
    ) -> dict[str, Any]:
        """Send bucket ``index`` to the loop and wait for its answer (a call for the next
        bucket may run meanwhile: it sends at once and reads after this one).

        Raises:
            RuntimeError: the loop answered with an error or ended, its engine call failed, or
                it did not answer within the timeout.
        """
        version = self._version
        if version is None:
            raise RuntimeError("LoopClient.load before open")
        previous, mine = self._turn, anyio.Event()
        self._turn = mine
        try:
            await self._guarded(
                self._send, [version, index, transport, handle, entries, last, kv_scales]
            )
            if previous is not None:
                await previous.wait()
            return await self._guarded(self._answer, version, index)
        finally:
            mine.set()

    async def finish(self) -> dict[str, Any]:
        """After the last bucket's answer: the long call's answer (bounded).

        Raises:
            RuntimeError: the call failed or did not return.
        """
        call = self._call
        assert call is not None
        with anyio.move_on_after(self._timeout_s):
            await self._over.wait()
        if not call.done():
            call.cancel()
            raise RuntimeError("the engine's refit loop did not return after the last bucket")
        self._call = None
        return call.result()[0]

    async def abort(self) -> None:
        """End the running loop, if any (it answers ``end`` and returns); wait for its call,
        bounded. Errors are the refit's, already reported: only the call's end matters."""
        call, self._call = self._call, None
        if call is None:
            return
        if not call.done() and self._version is not None:
            with anyio.move_on_after(self._timeout_s):
                await self._send([self._version, -1, ABORT, b"", [], True, None])
            with anyio.move_on_after(self._timeout_s):
                await self._over.wait()
        if not call.done():
            call.cancel()
        elif not call.cancelled():
            call.exception()  # retrieved: asyncio does not warn about it

    def close(self) -> None:
        """Cancel a running loop's call (the engine is going away)."""
        if self._call is not None and not self._call.done():
            self._call.cancel()
        self._call = None

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``fn(*args)``, unless the long call fails first (then its error is raised: the
        worker's loop never ran, so no answer will come)."""
        out: dict[str, Any] = {}
        failed: list[BaseException] = []

        async def run(scope: anyio.CancelScope) -> None:
            try:
                out["value"] = await fn(*args)
            except Exception as exc:  # noqa: BLE001 - raised below, outside the group
                out["error"] = exc
            scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            await self._over.wait()
            call = self._call
            if call is not None and not call.cancelled() and call.exception() is not None:
                failed.append(call.exception())
                scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, tg.cancel_scope)
            tg.start_soon(watch, tg.cancel_scope)
        if "error" in out:
            raise out["error"]
        if failed:
            raise RuntimeError(f"the engine's refit loop failed: {failed[0]}") from failed[0]
        return out["value"]

    async def _send(self, msg: list[Any]) -> None:
        with anyio.fail_after(self._timeout_s):
            await self._sock.send([_encode(msg)])

    async def _answer(self, version: int, index: int) -> dict[str, Any]:
        if self._ended is not None:
            raise RuntimeError(
                f"the engine's refit loop ended before bucket {index}: {self._ended}"
            )
        with anyio.move_on_after(self._timeout_s):
            while True:
                msg = _decode((await self._sock.recv())[0])
                if msg.get("version") != version:
                    continue  # left over from a failed refit
                if "error" in msg or "end" in msg:
                    self._ended = msg.get("error") or msg["end"]
                    where = f"at bucket {msg['index']}" if "error" in msg else (
                        f"before bucket {index}"
                    )
                    raise RuntimeError(f"the engine's refit loop failed {where}: {self._ended}")
                if msg["index"] != index:
                    raise RuntimeError(
                        f"the engine's refit loop answered bucket {msg['index']} where bucket "
                        f"{index} was due"
                    )
                return msg
        raise RuntimeError(
            f"the engine's refit loop did not answer bucket {index} of v{version} within "
            f"{self._timeout_s:g} s (generator.options.rpc_timeout_s)"
        )
