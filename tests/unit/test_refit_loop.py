"""The vLLM engine's refit loop (asyncrl_vllm.refit_loop) without an engine: the backend's
``LoopClient`` and the worker's ``serve_buckets`` over a real ipc:// DEALER pair, the worker
loop in a thread standing in for the long engine call. The engine's own path is covered by
tests/e2e/test_vllm_backend.py and tests/gpu."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest
import zmq

from asyncrl.transport import DEALER, Context, ipc_address
from asyncrl_vllm.refit_loop import LoopClient, serve_buckets

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Worker:
    """The engine worker's side: a DEALER connected once and kept, and a record of the loads."""

    def __init__(self, address: str, fail_at: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.fail_at = fail_at
        self.loads: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()

    def load(self, transport: str, handle: bytes, entries: list, opening: str | None,
             last: bool, kv_scales: dict | None) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        index = len(self.loads)
        self.loads.append((transport, handle, entries, opening, last, kv_scales))
        if index == self.fail_at:
            raise ValueError("bucket entries do not fit")
        time.sleep(0.02)  # the copies
        return {"direct": len(entries), "seconds": 0.02}

    async def call(self, version: int, opening: str | None, timeout_s: float = 10.0) -> list:
        """What ``collective_rpc("asyncrl_load_loop", ...)`` does: one answer per worker."""
        out = await anyio.to_thread.run_sync(
            serve_buckets, self.sock, version, self.load, opening, timeout_s
        )
        return [out]

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def pair(run_dir: str):  # noqa: ANN201
    ctx = Context()
    address = ipc_address(run_dir, "refit")
    client = LoopClient(ctx.socket(DEALER, bind=address, copy=True), address, timeout_s=5.0)
    yield client, address
    client.close()
    ctx.close()


async def load_all(client: LoopClient, n: int, version: int) -> list[Any]:
    """Bucket loads called as the receiver calls them: the next starts while one runs."""
    results: list[Any] = [None] * n

    async def one(i: int) -> None:
        try:
            results[i] = await client.load(
                i, "shm", f"h{i}".encode(), [["w", "float32", [2], 0, 8]], i == n - 1,
                {"k": 0.5} if i == n - 1 else None,
            )
        except RuntimeError as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
            await anyio.sleep(0.001)
    return results


async def test_a_refit_is_one_call_and_the_buckets_are_answered_in_order(pair) -> None:
    client, address = pair
    worker = Worker(address)
    try:
        for version in (1, 2):  # the worker's socket is kept across refits
            client.open(version, worker.call(version, "direct"))
            answers = await load_all(client, 3, version)
            assert [a["index"] for a in answers] == [0, 1, 2]
            assert all(a["version"] == version and a["direct"] == 1 for a in answers)
            assert (await client.finish())["direct"] == 1  # the last bucket's answer
            loads = worker.loads[-3:]
            assert [h for _, h, *_ in loads] == [b"h0", b"h1", b"h2"]
            assert [o for _, _, _, o, _, _ in loads] == ["direct", None, None]  # opens once
            assert [k for *_, k in loads] == [None, None, {"k": 0.5}]
        assert len(worker.threads) == 1  # one engine call per refit, loading in turn
    finally:
        worker.close()


async def test_a_failed_load_fails_its_bucket_and_the_next_and_ends_the_call(pair) -> None:
    client, address = pair
    worker = Worker(address, fail_at=1)
    try:
        client.open(1, worker.call(1, "direct"))
        answers = await load_all(client, 3, 1)
        assert answers[0]["index"] == 0
        assert "failed at bucket 1: ValueError: bucket entries do not fit" in str(answers[1])
        assert "ended before bucket 2" in str(answers[2])
        start = time.perf_counter()
        await client.abort()  # the loop has already returned
        assert time.perf_counter() - start < 1.0
        # what the failed refit left in the sockets (bucket 2, the loop's "end") is skipped
        worker.fail_at = None
        client.open(2, worker.call(2, "direct"))
        answers = await load_all(client, 2, 2)
        assert [a["index"] for a in answers] == [0, 1]
        await client.finish()
    finally:
        worker.close()


async def test_abort_ends_a_running_loop(pair) -> None:
    client, address = pair
    worker = Worker(address)
    try:
        client.open(1, worker.call(1, "direct"))
        first = await client.load(0, "shm", b"h0", [], False, None)
        assert first["index"] == 0
        start = time.perf_counter()
        await client.abort()  # e.g. the sender failed: no more buckets are coming
        assert time.perf_counter() - start < 2.0
        assert len(worker.loads) == 1
    finally:
        worker.close()


async def test_an_engine_call_that_fails_before_serving_fails_the_bucket_at_once(pair) -> None:
    """No worker ever reads the socket (the call failed in the engine): the bucket's load
    raises the call's error now, not after the timeout."""
    client, _ = pair

    async def broken() -> list:
        raise RuntimeError("Method asyncrl_load_loop not found")

    client.open(1, broken())
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="refit loop failed: Method asyncrl_load_loop"):
        await client.load(0, "shm", b"h0", [], True, None)
    assert time.perf_counter() - start < 1.0
    await client.abort()


async def test_a_silent_loop_times_out_with_the_option_named(run_dir: str) -> None:
    ctx = Context()
    address = ipc_address(run_dir, "refit")
    client = LoopClient(ctx.socket(DEALER, bind=address, copy=True), address, timeout_s=0.3)
    worker = Worker(address)  # connected, but nothing serves the socket

    async def hung() -> list:
        await anyio.sleep(30)
        return [{}]

    try:
        client.open(1, hung())
        with pytest.raises(RuntimeError, match=r"did not answer bucket 0 of v1 within 0.3 s "
                                               r"\(generator.options.rpc_timeout_s\)"):
            await client.load(0, "shm", b"h0", [], True, None)
        await client.abort()
    finally:
        client.close()
        worker.close()
        ctx.close()
