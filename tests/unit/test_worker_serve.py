"""The two worker runtimes serving calls, seen from the control socket.

A trainer runs its calls in arrival order on one thread, but answers ``Health`` at once while
a call holds that thread; a rollout worker serves calls concurrently, streams samples to the
data socket, and refuses a trainer's request with a ``Failure`` (it keeps serving). A
backend that breaks its protocol is the worker's ``Dead`` message, through the real
``serve`` over real sockets.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

from asyncrl.backend import WorkerContext
from asyncrl.errors import ProtocolError, flatten
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import (
    Abort,
    BeginStep,
    Call,
    Cast,
    DataBatch,
    DataMessage,
    Empty,
    Failure,
    FromWorker,
    Generate,
    GenRequest,
    Health,
    HealthResult,
    Init,
    LogprobsResult,
    Reply,
    Sample,
    SampleDone,
    ScoreTokens,
    Shutdown,
    TokenBatch,
    ToWorker,
)
from asyncrl.worker.rollout_runtime import RolloutRuntime
from asyncrl.worker.trainer_runtime import TrainerRuntime

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

# the controller's pid is this process's: Shutdown must not make pytest ignore SIGTERM
INIT = Init(run_id="r", config={}, data_address="", controller_pid=os.getpid())
BATCH = TokenBatch(np.array([1, 2, 3], np.int32), np.array([3], np.int32), np.array([1], np.int32))


def _wctx(group: str) -> WorkerContext:
    return WorkerContext(group=group, rank=0, world_size=1, local_rank=0,
                         config=None, run_dir="")  # type: ignore[arg-type]


class _Control:
    """The controller's end of a worker's control socket, in memory, through the real codec."""

    def __init__(self) -> None:
        self._to_send, self._to_recv = anyio.create_memory_object_stream[Any](16)
        self._from_send, self._from_recv = anyio.create_memory_object_stream[Any](16)
        self._tx, self._rx = Codec(ToWorker), Codec(FromWorker)

    def close(self) -> None:
        for end in (self._to_send, self._to_recv, self._from_send, self._from_recv):
            end.close()

    async def recv(self) -> list[Any]:  # the worker receives
        return await self._to_recv.receive()

    async def send(self, frames: list[Any]) -> None:  # the worker sends
        await self._from_send.send(self._rx.decode(frames))

    def call(self, call_id: int, request: Any) -> None:
        self._to_send.send_nowait(self._tx.encode(Call(call_id=call_id, request=request)))

    def cast(self, request: Any) -> None:
        self._to_send.send_nowait(self._tx.encode(Cast(request=request)))

    def shutdown(self) -> None:
        self._to_send.send_nowait(self._tx.encode(Shutdown()))

    async def answer(self) -> Any:
        with anyio.fail_after(10):
            return await self._from_recv.receive()


class _Trainer:
    """A training backend whose ``begin_step`` waits for the test's gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.steps: list[int] = []
        self.threads: set[int] = set()

    def begin_step(self, step: int) -> None:
        self.threads.add(threading.get_ident())
        assert self.gate.wait(10)
        self.steps.append(step)

    def start(self) -> dict[str, Any]:
        return {}

    def compute_logprobs(self, batch: Any, temperature: float) -> Any: ...
    def train_chunk(self, step: int, batch: Any) -> Any: ...
    def finish_step(self, step: int, num_loss_tokens: int) -> Any: ...
    def weight_specs(self) -> Any: ...
    def iter_weights(self) -> Any: ...
    def save_state(self, path: str) -> None: ...
    def load_state(self, path: str) -> None: ...
    def close(self) -> None: ...


async def test_trainer_calls_run_in_order_and_health_never_waits_behind_them() -> None:
    control, backend = _Control(), _Trainer()
    rt = TrainerRuntime(None, control, INIT, _wctx("trainer"))
    rt.adopt(backend, plugin="fake")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rt.serve_calls)
            control.call(1, BeginStep(step=1))
            control.call(2, BeginStep(step=2))
            control.call(3, Health())
            first = await control.answer()  # step 1 holds the backend's thread meanwhile
            assert first == Reply(call_id=3, result=HealthResult(pid=os.getpid()),
                                  seconds=first.seconds)
            assert backend.steps == []
            backend.gate.set()
            replies = [await control.answer(), await control.answer()]
            assert [(r.call_id, r.result) for r in replies] == [(1, Empty()), (2, Empty())]
            assert backend.steps == [1, 2]
            assert len(backend.threads) == 1 and threading.get_ident() not in backend.threads
            control.shutdown()  # serve_calls returns: the task group can end
    finally:
        await rt.close()
        control.close()


class _Generator:
    """A generation backend: ``score`` waits until an ``abort`` arrives; ``generate`` emits
    ``n`` one-token samples."""

    def __init__(self) -> None:
        self.aborted = anyio.Event()

    async def score(self, batch: TokenBatch, temperature: float) -> np.ndarray:
        await self.aborted.wait()
        return np.full(2, -0.5, np.float32)

    async def abort(self, group_ids: list[str]) -> None:
        self.aborted.set()

    async def generate(self, request: GenRequest, emit: Any) -> None:
        for i in range(request.n):
            await emit(i, Sample(np.array([i], np.int32), np.array([-1.0], np.float32), "stop"))

    async def start(self) -> dict[str, Any]:
        return {}

    async def begin_weight_update(self, version: int, manifest: Any, *, kv_scales: Any = None) -> None: ...
    async def load_weight_bucket(self, bucket: Any) -> None: ...
    async def abort_weight_update(self, version: int, *, loaded_any: bool) -> None: ...
    async def finish_weight_update(self, version: int, *, reset_prefix_cache: bool) -> None: ...
    async def close(self) -> None: ...


class _Data:
    """The data PUSH socket: what the worker pushes, decoded, one item per sample."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.got = anyio.Event()
        self._rx = Codec(DataMessage)

    async def send(self, frames: list[Any]) -> None:
        msg = self._rx.decode(frames)
        self.items += msg.items if isinstance(msg, DataBatch) else [msg]
        self.got.set()


async def test_rollout_calls_overlap_and_a_trainer_request_is_a_failure() -> None:
    control, backend, data = _Control(), _Generator(), _Data()
    rt = RolloutRuntime(None, control, INIT, _wctx("rollout"))
    rt.adopt(backend, plugin="fake")
    rt.data = data
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rt.serve_calls)
            control.call(1, ScoreTokens(batch=BATCH))  # waits for the abort: served concurrently
            control.call(2, Abort(group_ids=["g0"]))
            answers = [await control.answer(), await control.answer()]
            assert [a.call_id for a in answers] == [2, 1]
            assert isinstance(answers[1].result, LogprobsResult)
            control.call(3, BeginStep(step=1))
            refused = await control.answer()
            assert isinstance(refused, Failure) and refused.call_id == 3
            assert (refused.error_type, refused.message) == (
                "ProtocolError", "a rollout worker cannot serve BeginStep")
            # a Generate is cast: served at once, answered by its samples alone (the next
            # answer is the Health call's after it)
            control.cast(Generate(requests=[GenRequest(group_id="g1", prompt_ids=[1], n=3,
                                                       max_tokens=1)]))
            control.call(4, Health())
            assert isinstance((await control.answer()).result, HealthResult)
            with anyio.fail_after(10):
                while len(data.items) < 3:
                    data.got = anyio.Event()
                    await data.got.wait()
            assert all(isinstance(m, SampleDone) for m in data.items)
            assert sorted((m.group_id, m.worker, m.index) for m in data.items) == [
                ("g1", "rollout:0", 0), ("g1", "rollout:0", 1), ("g1", "rollout:0", 2)]
            control.shutdown()
    finally:
        await rt.close()
        control.close()


@pytest.mark.parametrize("role", ["rollout", "trainer"])
async def test_a_cast_the_worker_cannot_serve_is_fatal(role: str) -> None:
    """Nobody waits for a cast's answer, so one the worker cannot serve cannot be a Failure:
    serving stops with the error (the worker's Dead). A rollout worker refuses a request that
    is never cast; a trainer has no Generate to serve."""
    control = _Control()
    if role == "rollout":
        rt: Any = RolloutRuntime(None, control, INIT, _wctx("rollout"))
        rt.adopt(_Generator(), plugin="fake")
        rt.data = _Data()
        request: Any = ScoreTokens(batch=BATCH)
        want = "a rollout worker cannot serve ScoreTokens unanswered"
    else:
        rt = TrainerRuntime(None, control, INIT, _wctx("trainer"))
        rt.adopt(_Trainer(), plugin="fake")
        request = Generate(requests=[GenRequest(group_id="g", prompt_ids=[1], n=1, max_tokens=1)])
        want = "a trainer worker cannot serve Generate unanswered"
    try:
        control.cast(request)
        with pytest.raises(ExceptionGroup) as info, anyio.fail_after(10):
            await rt.serve_calls()
        (error,) = flatten(info.value)
        assert isinstance(error, ProtocolError) and str(error) == want
    finally:
        await rt.close()
        control.close()


async def test_a_backend_that_breaks_its_protocol_is_the_workers_dead_message(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``serve`` over a real ROUTER: the worker says ``Hello``, gets ``Init``, and its
    backend (missing ``score``) is refused before it starts: ``Dead`` names the plugin, its
    group and the method, and ``serve`` raises the same ``PluginError``."""
    from asyncrl import registry
    from asyncrl.errors import PluginError
    from asyncrl.wire.messages import Dead, Hello
    from asyncrl.wire.transport import ROUTER, Context
    from asyncrl.worker.runtime import serve

    class NoScore(_Generator):
        score = None  # type: ignore[assignment]

    monkeypatch.setattr(registry, "load", lambda group, name: lambda ctx: NoScore())
    config = {"model": {"path": str(tmp_path)}, "environment": {"name": "repeat-digit"},
              "trainer": {"backend": "bigram"}, "generator": {"backend": "scoreless"}}
    ctx = Context()
    try:
        address = f"ipc://{tmp_path}/control.sock"
        router = ctx.socket(ROUTER, bind=address)
        tx, rx = Codec(ToWorker), Codec(FromWorker)
        failed: list[BaseException] = []

        async def worker() -> None:
            try:
                await serve(control_address=address, group="rollout", rank=0, world_size=1,
                            local_rank=0, startup_timeout_s=10)
            except PluginError as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)
            with anyio.fail_after(10):
                peer, *frames = await router.recv()
                assert isinstance(rx.decode(frames), Hello)
                init = Init(run_id="r", config=config, data_address=f"ipc://{tmp_path}/d.sock",
                            controller_pid=os.getpid())
                await router.send([peer, *tx.encode(init)])
                peer, *frames = await router.recv()
        dead = rx.decode(frames)
        assert isinstance(dead, Dead)
        assert dead.reason.startswith("PluginError: generation backend 'scoreless' "
                                      "(asyncrl.generation_backends: ")
        assert "no method 'score'" in dead.reason
        assert len(failed) == 1 and str(failed[0]) == dead.reason.removeprefix("PluginError: ")
    finally:
        ctx.close()


class _StuckCollective(_Trainer):
    """A trainer whose ``begin_step`` raises what torch's gloo raises for a collective that
    outlasted its timeout when ``timed_out``, else an ordinary error."""

    def __init__(self, timed_out: bool) -> None:
        super().__init__()
        self.timed_out = timed_out

    def begin_step(self, step: int) -> None:
        if self.timed_out:  # the text of torch 2.13's gloo, seen on this host
            raise RuntimeError(
                "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "3000ms for recv operation to complete"
            )
        raise RuntimeError("CUDA out of memory in one micro-batch")


@pytest.mark.parametrize("timed_out", [True, False])
async def test_a_collective_that_timed_out_kills_the_trainer_rank_naming_it(
    timed_out: bool,
) -> None:
    """A call that raised is that call's ``Failure`` (a step may be retried), except a
    collective that outlasted ``failures.collective_timeout_s``: the process group is broken,
    so serving ends with a ``CollectiveTimeoutError`` (the rank's ``Dead``) naming the rank,
    the timeout and its setting."""
    from types import SimpleNamespace

    from asyncrl.config import FailuresConfig
    from asyncrl.errors import CollectiveTimeoutError, flatten

    config = SimpleNamespace(failures=FailuresConfig(collective_timeout_s=3))
    wctx = WorkerContext(group="trainer", rank=1, world_size=2, local_rank=1, config=config,
                         run_dir="")  # fmt: skip
    control = _Control()
    rt = TrainerRuntime(None, control, INIT, wctx)
    rt.adopt(_StuckCollective(timed_out), plugin="fake")
    try:
        if timed_out:
            with pytest.raises(BaseExceptionGroup) as caught:  # run() reports the leaf
                async with anyio.create_task_group() as tg:
                    tg.start_soon(rt.serve_calls)
                    control.call(1, BeginStep(step=1))
            (error,) = flatten(caught.value)
            assert isinstance(error, CollectiveTimeoutError)
            message = str(error)
            assert message.startswith("trainer rank 1: a torch collective waited more than 3 s "
                                      "(failures.collective_timeout_s)"), message
            assert "Timed out waiting 3000ms" in message
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(rt.serve_calls)
                control.call(1, BeginStep(step=1))
                failure = await control.answer()
                assert isinstance(failure, Failure) and "out of memory" in failure.message
                control.shutdown()
    finally:
        await rt.close()
        control.close()


async def test_an_aggregation_the_backend_cannot_normalize_is_refused_before_it_starts(
    model_dir: Any,
) -> None:
    """``loss.aggregation`` other than token_mean sends ``FinishStep.normalizer``: a backend
    whose ``finish_step`` has no such keyword is named before ``start`` runs."""
    from asyncrl.config import from_dict
    from asyncrl.errors import PluginError

    config = from_dict({"model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
                        "loss": {"aggregation": "sequence_mean"}})  # fmt: skip
    started: list[bool] = []

    class Old(_Trainer):
        def start(self) -> dict[str, Any]:
            started.append(True)
            return {}

        def finish_step(self, step: int, num_loss_tokens: int) -> Any:  # no normalizer
            raise AssertionError("not reached")

    class New(Old):
        def finish_step(self, step: int, num_loss_tokens: int, *, normalizer: float | None = None) -> Any:
            raise AssertionError("not reached")

    wctx = WorkerContext(group="trainer", rank=1, world_size=1, local_rank=0, config=config,
                         run_dir="")  # fmt: skip
    for backend, refused in ((Old(), True), (New(), False)):
        control = _Control()
        rt = TrainerRuntime(None, control, INIT, wctx)
        rt.adopt(backend, plugin="fake")
        try:
            if refused:
                with pytest.raises(PluginError, match="takes no normalizer"):
                    await rt._start()
                assert not started
            else:
                await rt._start()
                assert started
        finally:
            await rt.close()
            control.close()


LIMIT_S = 0.5 / 12 + 0.5
"""The silence after which a worker takes its controller for gone, with a heartbeat timeout of
0.5 s: the probe interval derived from it (``PROBES_PER_TIMEOUT``, 12) + the timeout."""


def _silence_config(failures: Any, startup_timeout_s: float = 60.0) -> Any:
    """What the controller watch reads of a worker's config."""
    return SimpleNamespace(failures=failures,
                           cluster=SimpleNamespace(startup_timeout_s=startup_timeout_s))


async def test_a_controller_on_another_host_is_taken_for_gone_when_it_falls_silent() -> None:
    """Its pid names nothing here: the worker watches what it hears instead. Health probes
    every 0.1 s keep it serving; once they stop, it raises ControllerLostError after
    interval + timeout (0.5 / 12 + 0.5 s) of silence, naming the controller's host."""
    from asyncrl.config import FailuresConfig
    from asyncrl.errors import ControllerLostError

    failures = FailuresConfig(heartbeat_timeout_s=0.5)
    wctx = WorkerContext(group="trainer", rank=0, world_size=1, local_rank=0,
                         config=_silence_config(failures), run_dir="")  # type: ignore[arg-type]
    init = Init(run_id="r", config={}, data_address="", controller_pid=1,  # pid 1: not watched
                controller_host="node0/boot/1")  # fmt: skip
    control = _Control()
    rt = TrainerRuntime(None, control, init, wctx)
    rt.adopt(_Trainer(), plugin="fake")
    assert rt.controller_remote
    lost: list[BaseException] = []
    silent_from = [0.0]

    async def serve() -> None:
        try:
            await rt.run()
        except ControllerLostError as exc:
            lost.append(exc)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                for i in range(10):  # 1 s of probes: it keeps serving
                    control.call(i, Health())
                    await control.answer()  # it heard the probe: its silence counts from here
                    silent_from[0] = anyio.current_time()
                    await anyio.sleep(0.1)
                assert not lost  # then no more probes
        took = anyio.current_time() - silent_from[0]
    finally:
        await rt.close()
        control.close()
    (error,) = lost
    assert "the controller on host 'node0' sent worker trainer:0 nothing for" in str(error)
    assert "went away or was cut off" in str(error)
    # not before interval + timeout of silence; how much after is the event loop's (under
    # load, unbounded): fail_after(10) above is the hang guard
    assert took >= LIMIT_S, took


def _local_runtime(failures: Any) -> tuple[TrainerRuntime, _Control, int]:
    """A trainer whose controller is a live process on this host (this test's parent:
    its pid is watched, and it never exits during the test)."""
    wctx = WorkerContext(group="trainer", rank=1, world_size=2, local_rank=1,
                         config=_silence_config(failures), run_dir="")  # type: ignore[arg-type]
    from asyncrl.procs.process import host_id

    pid = os.getppid()
    init = Init(run_id="r", config={}, data_address="", controller_pid=pid,
                controller_host=host_id())  # fmt: skip
    control = _Control()
    rt = TrainerRuntime(None, control, init, wctx)
    rt.adopt(_Trainer(), plugin="fake")
    assert not rt.controller_remote
    return rt, control, pid


async def test_a_controller_on_this_host_that_falls_silent_is_named_though_it_lives() -> None:
    """Its pid is watched for its exit; a controller that lives but sends nothing (stopped,
    its loop blocked) is named on its silence too: probes every 0.1 s keep the worker
    serving; once they stop it raises ControllerLostError after interval + timeout
    (0.5 / 12 + 0.5 s) of silence, naming the controller's pid, the seconds and the settings."""
    from asyncrl.config import FailuresConfig
    from asyncrl.errors import ControllerLostError

    rt, control, pid = _local_runtime(
        FailuresConfig(heartbeat_timeout_s=0.5))
    lost: list[ControllerLostError] = []
    silent_from = 0.0

    async def serve() -> None:
        try:
            await rt.run()
        except ControllerLostError as exc:
            lost.append(exc)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                for i in range(10):  # 1 s of probes: it keeps serving
                    control.call(i, Health())
                    await control.answer()
                    silent_from = anyio.current_time()
                    await anyio.sleep(0.1)
                assert not lost  # then no more probes
        took = anyio.current_time() - silent_from
    finally:
        await rt.close()
        control.close()
    (error,) = lost
    assert error.silent_s is not None and error.silent_s > LIMIT_S
    assert str(error) == (
        f"the controller (pid {pid}) sent worker trainer:1 nothing for {error.silent_s:.1f} s "
        "(its heartbeat probes come every 0.0417 s; failures.heartbeat_timeout_s = 0.5 s), though "
        "its process lives: it is stopped (SIGSTOP, a debugger) or its event loop is blocked"
    )
    assert took >= LIMIT_S, took  # not before interval + timeout; fail_after(10): the hang guard


async def test_a_silence_the_worker_slept_through_is_not_blamed_on_the_controller() -> None:
    """The worker's own event loop does not run for 1.5 s (as when every process of the run
    is stopped), more than the 0.54 s limit; the controller, held up as long, probes again
    0.2 s after: the worker keeps serving. The time it did not run is what it forgave."""
    import time

    from asyncrl.config import FailuresConfig
    from asyncrl.errors import ControllerLostError

    rt, control, _ = _local_runtime(
        FailuresConfig(heartbeat_timeout_s=0.5))
    lost: list[ControllerLostError] = []

    async def serve() -> None:
        try:
            await rt.run()
        except ControllerLostError as exc:
            lost.append(exc)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                for i in range(5):
                    control.call(i, Health())
                    await control.answer()
                    await anyio.sleep(0.1)
                time.sleep(1.5)  # noqa: ASYNC251 - the whole loop stops, the worker's too
                await anyio.sleep(0.2)  # the worker's watch ticks before the next probe
                for i in range(5, 10):
                    control.call(i, Health())
                    await control.answer()
                    await anyio.sleep(0.1)
                assert not lost, lost
                assert rt._silence is not None and rt._silence.slept_s > 1.0
                control.shutdown()
    finally:
        await rt.close()
        control.close()
