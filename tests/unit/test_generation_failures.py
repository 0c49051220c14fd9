"""Worker calls seen from the backend side.

How a failed generation is reported: a group's own error becomes ``GroupFailed`` naming the
first real error (not "unhandled errors in a TaskGroup"); an engine death is fatal for the
worker, also when vLLM's front end fails the requests before the engine watch has seen the
process exit (the race that once turned an engine SIGKILL into a "group failed" line). And
``CalibrateKV`` reaches a trainer backend that can calibrate, and is refused by one that
cannot."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from asyncrl.errors import EngineDeadError
from asyncrl.wire.messages import GenRequest, GroupFailed
from asyncrl.worker.runtime import _Busy, _Runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Backend:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def generate(self, request: GenRequest, emit: object) -> None:
        raise self.exc


def _runtime(backend: object) -> _Runtime:
    rt = _Runtime.__new__(_Runtime)
    rt.backend, rt.identity, rt.busy = backend, "rollout:0", _Busy()
    rt.engine_gone = None
    return rt


REQ = GenRequest(group_id="g7", prompt_ids=[1, 2], n=2, max_tokens=4)


async def test_group_error_names_the_first_leaf() -> None:
    rt = _runtime(_Backend(ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("bad")])))
    send, recv = anyio.create_memory_object_stream[object](4)
    with send, recv:
        await rt._generate_one(REQ, send)
        msg = recv.receive_nowait()
    assert isinstance(msg, GroupFailed)
    assert (msg.group_id, msg.error_type, msg.message) == ("g7", "ValueError", "bad")


async def test_engine_death_is_fatal_not_a_group_failure() -> None:
    rt = _runtime(_Backend(EngineDeadError("vLLM engine process VLLM::EngineCore exited")))
    send, recv = anyio.create_memory_object_stream[object](4)
    with send, recv, pytest.raises(EngineDeadError):
        await rt._generate_one(REQ, send)
    assert recv.statistics().current_buffer_used == 0


async def test_a_failure_while_the_engine_dies_is_left_to_the_dead_message() -> None:
    """A dying engine fails a generation and a call (a refit's ReceiveWeights) a moment
    before the engine watch sees its process exit: neither becomes a GroupFailed or a
    Failure reply (the controller would retry the group against its budget, or stop the
    run on the refit's error); the worker's Dead says why, and the worker is restarted."""
    from asyncrl.wire.messages import Call, Health

    rt = _runtime(_Backend(RuntimeError("EngineCore encountered an issue")))
    rt.engine_gone = anyio.Event()
    sent: list[object] = []

    async def send(msg: object) -> None:
        sent.append(msg)

    async def failing_call(req: object, tg: object) -> object:
        raise RuntimeError("EngineCore encountered an issue")

    rt.send, rt.rollout_call = send, failing_call  # type: ignore[method-assign]
    rt.wctx = type("W", (), {"group": "rollout"})()
    out, inbox = anyio.create_memory_object_stream[object](4)
    with out, inbox:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rt._generate_one, REQ, out)
            tg.start_soon(rt.answer, Call(call_id=3, request=Health()), tg)
            await anyio.sleep(0.1)
            rt.engine_gone.set()  # the watch names the dead process
        assert inbox.statistics().current_buffer_used == 0
    assert sent == []

    # the same failures with a live engine (the watch never fires): reported after the grace
    rt.engine_gone = anyio.Event()
    out, inbox = anyio.create_memory_object_stream[object](4)
    with out, inbox:
        await rt._generate_one(REQ, out)
        assert isinstance(inbox.receive_nowait(), GroupFailed)


class _Reaper:
    def __init__(self, lost: bool) -> None:
        self._lost = lost

    def lost(self) -> bool:
        return self._lost


def _vllm_backend(lost: bool) -> object:
    from asyncrl_vllm.backend import VLLMBackend

    b = VLLMBackend.__new__(VLLMBackend)
    b._dead, b._reaper = None, _Reaper(lost)
    return b


async def test_vllm_request_error_with_a_live_engine_passes_as_is() -> None:
    b = _vllm_backend(lost=False)
    with pytest.raises(RuntimeError, match="no output"):
        async with b._engine_errors():
            raise RuntimeError("no output")


async def test_vllm_request_error_waits_for_the_watch_to_name_the_process() -> None:
    b = _vllm_backend(lost=True)

    async def watch_names_it() -> None:
        await anyio.sleep(0.05)
        b._dead = "VLLM::EngineCore (pid 42) exited with code -9"

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_names_it)
        with pytest.raises(EngineDeadError, match=r"VLLM::EngineCore \(pid 42\)"):
            async with b._engine_errors():
                raise RuntimeError("engine core connection lost")


async def test_vllm_engine_dead_error_without_a_watch_still_fatal() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

    b = _vllm_backend(lost=False)
    with pytest.raises(EngineDeadError, match="has not named it"):
        async with b._engine_errors():
            raise ExceptionGroup("x", [VLLMEngineDead()])


class _Calibrating:
    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def calibrate_kv_scales(self, batch, *, percentile, margin, include_q):  # noqa: ANN001, ANN201
        self.seen = {"n": int(batch.seq_lens.size), "p": percentile, "m": margin, "q": include_q}
        return {"model.layers.0.self_attn.k_scale": np.float32(0.25)}


async def test_calibrate_kv_reaches_the_trainer_backend_and_refuses_one_without_it() -> None:
    from asyncrl.errors import ProtocolError
    from asyncrl.wire.messages import CalibrateKV, KVScalesResult, TokenBatch
    from asyncrl.worker.runtime import _Thread

    batch = TokenBatch(np.array([1, 2, 3], np.int32), np.array([3], np.int32),
                       np.array([1], np.int32))
    rt = _Runtime.__new__(_Runtime)
    rt.thread = _Thread()
    try:
        rt.backend = _Calibrating()
        result = await rt.trainer_call(CalibrateKV(batch=batch, percentile=99.0, margin=1.1,
                                                   include_q=True))
        assert isinstance(result, KVScalesResult)
        assert result.scales == {"model.layers.0.self_attn.k_scale": 0.25}
        assert type(result.scales["model.layers.0.self_attn.k_scale"]) is float  # msgpack-able
        assert rt.backend.seen == {"n": 1, "p": 99.0, "m": 1.1, "q": True}
        rt.backend = object()
        with pytest.raises(ProtocolError, match="cannot calibrate FP8 KV-cache scales"):
            await rt.trainer_call(CalibrateKV(batch=batch))
    finally:
        rt.thread.close()


class _Gathering:
    """A trainer rank 0 whose iter_weights stands for FSDP's: every item is a collective the
    other ranks take part in, so a send that fails must still run it to its end."""

    def __init__(self) -> None:
        self.pulled = 0

    def iter_weights(self):  # noqa: ANN201
        from asyncrl.backend import WeightTensor

        for i in range(5):
            self.pulled += 1
            yield WeightTensor(f"w{i}", "float32", (2,), np.zeros(2, np.float32).view(np.uint8))

    def weight_specs(self):  # noqa: ANN201
        from asyncrl.backend import WeightTensor

        return [WeightTensor(f"w{i}", "float32", (2,)) for i in range(5)]


async def test_a_failed_send_still_runs_the_gathers_to_their_end() -> None:
    """Rank 0 refusing to send (here: a transport mismatch, before any tensor is packed) must
    not leave the other trainer ranks waiting in an all-gather: it drains iter_weights, then
    reports the error."""
    from types import SimpleNamespace

    from asyncrl.errors import ProtocolError
    from asyncrl.wire.messages import SendWeights
    from asyncrl.worker.runtime import _Thread

    rt = _Runtime.__new__(_Runtime)
    rt.thread = _Thread()
    rt.wctx = SimpleNamespace(rank=0)
    rt.sender = SimpleNamespace(transfer=SimpleNamespace(name="shm"))
    rt.backend = _Gathering()
    try:
        with pytest.raises(ProtocolError, match="SendWeights over 'cuda_ipc'"):
            await rt.trainer_call(SendWeights(version=1, receivers=["rollout:0"],
                                              transport="cuda_ipc", bucket_size_bytes=1 << 20,
                                              timeout_s=5.0))
        assert rt.backend.pulled == 5
    finally:
        rt.thread.close()
