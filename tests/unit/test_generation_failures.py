"""Worker calls seen from the backend side.

How a failed generation is reported: a group's own error becomes ``GroupFailed`` naming the
first real error (not "unhandled errors in a TaskGroup"); an engine death is fatal for the
worker, also when vLLM's front end fails the requests before the engine watch has seen the
process exit (the race that once turned an engine SIGKILL into a "group failed" line). And
``CalibrateKV`` reaches a trainer backend that can calibrate, and is refused by one that
cannot."""

from __future__ import annotations

import os
import signal

import anyio
import numpy as np
import pytest

from asyncrl.backend import WorkerContext
from asyncrl.errors import EngineDeadError, RequestError
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import FromWorker, GenRequest, GroupFailed, Init, TokenBatch
from asyncrl.worker.rollout_runtime import RolloutRuntime
from asyncrl.worker.trainer_runtime import TrainerRuntime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Backend:
    """A generation engine whose requests fail with ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def generate(self, request: GenRequest, emit: object) -> None:
        raise self.exc

    async def score(self, batch: object, temperature: float) -> object:
        raise self.exc


class _Control:
    """The worker's control socket: what the runtime sends, decoded."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self._rx = Codec(FromWorker)

    async def send(self, frames: list) -> None:
        self.sent.append(self._rx.decode(frames))


INIT = Init(run_id="r", config={}, data_address="")


def _wctx(group: str) -> WorkerContext:
    return WorkerContext(group=group, rank=0, world_size=1, local_rank=0, config=None,  # type: ignore[arg-type]
                         run_dir="")


def _runtime(backend: object) -> RolloutRuntime:
    rt = RolloutRuntime(None, _Control(), INIT, _wctx("rollout"))
    rt.backend = backend  # type: ignore[assignment]  # only what these tests call
    return rt


BATCH = TokenBatch(np.array([1, 2, 3], np.int32), np.array([3], np.int32), np.array([1], np.int32))
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


async def test_a_failure_after_the_watch_saw_the_engine_die_is_left_to_the_dead_message() -> None:
    """Once the engine watch has seen the engine die, a generation or a call that fails (a
    refit's ReceiveWeights) becomes no GroupFailed and no Failure reply (the controller would
    retry the group against its budget, or stop the run on the refit's error): the worker's
    Dead says why, and the worker is restarted."""
    from asyncrl.wire.messages import Call, ScoreTokens

    rt = _runtime(_Backend(RuntimeError("EngineCore encountered an issue")))
    rt.engine_gone = anyio.Event()
    rt.engine_gone.set()  # the watch named the dead process
    out, inbox = anyio.create_memory_object_stream[object](4)
    with out, inbox:
        await rt._generate_one(REQ, out)
        await rt.answer(Call(call_id=3, request=ScoreTokens(batch=BATCH)))
        assert inbox.statistics().current_buffer_used == 0
    assert rt.control.sent == []


@pytest.mark.parametrize(
    "exc", [RuntimeError("EngineCore encountered an issue"), RequestError("prompt too long")]
)
async def test_a_failure_with_a_live_engine_is_reported_at_once(exc: Exception) -> None:
    """A backend with an engine watch raises EngineDeadError itself for what its engine's
    death caused (the EngineWatch contract), so any other failure is the group's or the
    call's own: reported without waiting for a verdict (it once waited 1 s for every one,
    a prompt too long included)."""
    from asyncrl.wire.messages import Call, ScoreTokens

    class Alive:
        """A watch that runs, over an engine that lives: no verdict ever comes."""

        waited = 0

        def is_set(self) -> bool:
            return False

        async def wait(self) -> None:
            self.waited += 1
            await anyio.sleep_forever()

    rt = _runtime(_Backend(exc))
    rt.engine_gone = alive = Alive()  # type: ignore[assignment]
    out, inbox = anyio.create_memory_object_stream[object](4)
    with out, inbox:
        await rt._generate_one(REQ, out)
        failed = inbox.receive_nowait()
        await rt.answer(Call(call_id=4, request=ScoreTokens(batch=BATCH)))
    assert alive.waited == 0
    assert isinstance(failed, GroupFailed) and failed.error_type == type(exc).__name__
    assert failed.retryable == (not isinstance(exc, RequestError))
    (failure,) = rt.control.sent
    assert (failure.call_id, failure.error_type) == (4, type(exc).__name__)


async def test_an_engine_death_inside_a_group_of_errors_is_fatal() -> None:
    rt = _runtime(_Backend(ExceptionGroup("x", [EngineDeadError("EngineCore (pid 8) exited")])))
    out, inbox = anyio.create_memory_object_stream[object](4)
    with out, inbox, pytest.raises(ExceptionGroup):
        await rt._generate_one(REQ, out)
    assert rt.control.sent == [] and inbox.statistics().current_buffer_used == 0


class _Reaper:
    def __init__(self, lost: bool, pids: list[int] = ()) -> None:
        self._lost, self._pids = lost, list(pids)

    def lost(self) -> bool:
        return self._lost

    def alive(self) -> list[int]:
        return self._pids


class _WedgedLLM:
    """vLLM's front end over a dead engine: a ``collective_rpc`` never returns."""

    def __init__(self) -> None:
        self.entered = 0

    async def collective_rpc(self, method: str, timeout: float, args: tuple = ()) -> list:
        self.entered += 1
        await anyio.sleep_forever()


class _LiveLLM(_WedgedLLM):
    """vLLM's front end over a live engine: every worker answers a ``collective_rpc``."""

    async def collective_rpc(self, method: str, timeout: float, args: tuple = ()) -> list:
        self.entered += 1
        return [method]


def _vllm_backend(
    lost: bool, pids: list[int] = (), heartbeat_timeout_s: float = 0.0, llm=None
) -> object:
    """A vLLM backend around a stand-in front end (``_WedgedLLM`` by default), with the run's
    ``failures.heartbeat_timeout_s`` (0: off; the probe interval: a twelfth of it)."""
    from types import SimpleNamespace

    from asyncrl.config import FailuresConfig
    from asyncrl_vllm.backend import VLLMBackend
    from asyncrl_vllm.death import EngineDeath
    from asyncrl_vllm.options import VLLMOptions

    b = VLLMBackend.__new__(VLLMBackend)
    b._death, b._reaper = EngineDeath(), _Reaper(lost, pids)
    b.options, b._llm = VLLMOptions(rpc_timeout_s=300.0), llm or _WedgedLLM()
    failures = FailuresConfig(heartbeat_timeout_s=heartbeat_timeout_s)
    b.ctx = SimpleNamespace(config=SimpleNamespace(failures=failures))
    return b


async def test_an_engine_that_stops_answering_is_named_by_the_watch_probe() -> None:
    """The engine's processes live on, but the front end's ``collective_rpc`` never returns
    (a stopped or deadlocked engine): the watch names the hang after the heartbeat timeout,
    not never; while the engine answers, the watch keeps watching."""
    import subprocess
    import time

    engine = subprocess.Popen(["sleep", "60"])
    try:
        live = _vllm_backend(False, [engine.pid], heartbeat_timeout_s=0.3, llm=_LiveLLM())
        with anyio.move_on_after(1.0) as waited:
            await live.watch()
        assert waited.cancelled_caught  # no verdict while it answers
        # probed again and again, never sooner than an interval (0.3 s / 12 = 0.025 s) after
        # an answer: at most 1 s / 0.025 s + 1 times (how many fewer is the machine's load)
        assert live.ctx.config.failures.heartbeat_interval_s == pytest.approx(0.025)
        assert 2 <= live._llm.entered <= 41, live._llm.entered

        hung = _vllm_backend(False, [engine.pid], heartbeat_timeout_s=0.3)
        start = time.monotonic()
        with anyio.fail_after(5), pytest.raises(EngineDeadError) as caught:
            await hung.watch()
        after = time.monotonic() - start
        assert after >= 0.3, after  # the timeout, not before; fail_after(5) is the hang guard
        assert f"(pid {engine.pid}) answered no liveness probe in 0.3 s" in str(caught.value)
        assert "failures.heartbeat_timeout_s" in str(caught.value)
        assert hung._llm.entered == 1
        # the verdict stays: a later call into the engine ends at once
        with anyio.fail_after(5), pytest.raises(EngineDeadError, match="liveness probe"):
            await hung._rpc("asyncrl_finish_reload")

        off = _vllm_backend(False, [engine.pid], heartbeat_timeout_s=0.0)
        with anyio.move_on_after(0.5):
            await off.watch()
        assert off._llm.entered == 0  # heartbeat off: no probe
    finally:
        engine.kill()
        engine.wait()


async def test_vllm_request_error_with_a_live_engine_passes_as_is() -> None:
    b = _vllm_backend(lost=False)
    with pytest.raises(RuntimeError, match="no output"):
        async with b._engine_errors():
            raise RuntimeError("no output")


async def test_vllm_request_error_waits_for_the_watch_to_name_the_process() -> None:
    b = _vllm_backend(lost=True)

    async def watch_names_it() -> None:
        await anyio.sleep(0.05)
        b._death.declare("VLLM::EngineCore (pid 42) exited with code -9")

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
    # the verdict stays: a later call (a refit's abort) never reaches the dead engine
    with anyio.fail_after(5), pytest.raises(EngineDeadError, match="has not named it"):
        await b._rpc("asyncrl_finish_reload")
    assert b._llm.entered == 0


def test_the_first_death_is_the_one_the_others_followed() -> None:
    """Deaths seen together (the first seen first): a signal's victim before a process that
    exited by itself, then the highest in the tree, then the first seen."""
    from asyncrl_vllm.death import first_death

    parents = {20: 10, 10: 1, 21: 10}  # core 10 (our child), its workers 20 and 21
    # the core killed: its worker dies with it and may be seen first
    assert first_death({20: -9, 10: -9}, parents) == 10
    assert first_death({20: None, 10: -9}, parents) == 10
    # a worker killed: the core exits by itself after it, seen at the same time or not
    assert first_death({20: -9, 10: 1}, parents) == 20
    assert first_death({10: 1, 20: -9}, parents) == 20
    assert first_death({10: 0, 20: -9, 21: 0}, parents) == 20
    # nothing to tell them apart: the one seen first
    assert first_death({21: -9, 20: -9}, parents) == 21
    assert first_death({21: None, 20: None}, parents) == 21
    assert first_death({20: 1}, parents) == 20
    # parents that are no tree (a pid reused since) do not loop
    assert first_death({5: -9, 6: -9}, {5: 6, 6: 5}) == 5


@pytest.mark.parametrize("victim", ["core", "worker"])
async def test_the_watch_names_the_process_killed_with_its_exit_code(victim: str) -> None:
    """A "core" whose "worker" is SIGKILLed when it dies (``PR_SET_PDEATHSIG``) and reaped by
    it at once, as vLLM's engine core reaps its workers. The loop is blocked from the kill
    until every death is over, as on a busy host (the worker first in the watch's list):

    * the core killed: both are dead when the watch looks; it names the core, not the worker
      that died with it;
    * the worker killed: the core has reaped it before the watch looks, so ``/proc`` has no
      status; the pidfd the watch opened while it lived has (-9, not "unknown")."""
    import subprocess
    import sys
    import time

    from asyncrl_vllm.death import EngineDeath

    worker = (
        "import ctypes, signal, time; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
        "print(flush=True); time.sleep(60)"
    )
    core = (
        "import subprocess, sys, time; "
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE); "
        "w.stdout.readline(); print(w.pid, flush=True); w.wait(); time.sleep(60)"
    )
    with subprocess.Popen([sys.executable, "-c", core], stdout=subprocess.PIPE) as proc:
        worker_pid = int(proc.stdout.readline())
        target = proc.pid if victim == "core" else worker_pid
        caught: list[EngineDeadError] = []

        async def watch() -> None:
            with pytest.raises(EngineDeadError) as raised:
                await EngineDeath().watch([worker_pid, proc.pid])
            caught.append(raised.value)

        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    await anyio.sleep(0.1)
                    os.kill(target, signal.SIGKILL)
                    time.sleep(0.5)  # the loop is blocked: the deaths, and the reap, go first
                    if victim == "worker":
                        assert not os.path.exists(f"/proc/{worker_pid}")  # the core reaped it
        finally:
            proc.kill()
    assert f"(pid {target}) exited with code -9" in str(caught[0]), caught


async def test_a_call_into_the_engine_ends_when_the_watch_sees_it_die() -> None:
    """The engine core is SIGKILLed during a refit: the watch cancels the worker, and the
    refit's abort, shielded, calls into the dead engine, which never answers. That call ends
    at once with the watch's verdict, not after rpc_timeout_s (300 s here): a worker held
    that long answers no heartbeat and is killed as hung, its Dead never sent (CI, once).
    A call made after the death never reaches the engine."""
    import subprocess

    engine = subprocess.Popen(["sleep", "60"])
    b = _vllm_backend(lost=False, pids=[engine.pid])
    # named "sleep", or "python" when read before the child's exec
    verdict = rf"\(pid {engine.pid}\) exited with code -9"
    try:
        with anyio.fail_after(10):  # the watch answered within 0.11 s of a SIGKILL (2 cores)
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    with pytest.raises(EngineDeadError, match=verdict):
                        await b.watch()

                tg.start_soon(watch)
                await anyio.sleep(0.05)
                engine.kill()
                with anyio.CancelScope(shield=True), pytest.raises(EngineDeadError, match=verdict):
                    await b._rpc("asyncrl_finish_reload")
            with pytest.raises(EngineDeadError, match=verdict):
                await b._rpc("asyncrl_finish_reload")
    finally:
        engine.kill()
        engine.wait()
    assert b._llm.entered == 1


async def test_engine_death_race_returns_results_and_passes_errors() -> None:
    from asyncrl_vllm.death import EngineDeath

    death = EngineDeath()

    async def answer() -> int:
        await anyio.sleep(0.01)
        return 7

    async def refuse() -> None:
        raise ValueError("bad bucket")

    assert await death.race(answer()) == 7
    with pytest.raises(ValueError, match="bad bucket"):  # the call's own error, not a group
        await death.race(refuse())
    ended: list[BaseException] = []

    async def wedged() -> None:
        try:
            await death.race(anyio.sleep_forever())
        except EngineDeadError as exc:
            ended.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wedged)
        await anyio.sleep(0.01)
        death.declare("EngineCore (pid 8) exited with code -9")
    assert "EngineCore (pid 8) exited with code -9" in str(ended[0])
    death.declare("Worker (pid 9) exited with code 1")  # the first verdict stays
    assert death.reason == "EngineCore (pid 8) exited with code -9"


class _Trainer:
    """Every method of a TrainingBackend; none of them is called here."""

    def start(self):  # noqa: ANN201
        return {}

    def compute_logprobs(self, batch, temperature):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def begin_step(self, step):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def train_chunk(self, step, batch):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def finish_step(self, step, num_loss_tokens):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def weight_specs(self):  # noqa: ANN201
        raise NotImplementedError

    def iter_weights(self):  # noqa: ANN201
        raise NotImplementedError

    def save_state(self, path):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def load_state(self, path):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def close(self):  # noqa: ANN201
        pass


class _Calibrating(_Trainer):
    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def calibrate_kv_scales(self, batch, *, percentile, margin, include_q):  # noqa: ANN001, ANN201
        self.seen = {"n": int(batch.seq_lens.size), "p": percentile, "m": margin, "q": include_q}
        return {"model.layers.0.self_attn.k_scale": np.float32(0.25)}


async def test_calibrate_kv_reaches_the_trainer_backend_and_refuses_one_without_it() -> None:
    """The optional method is found once, when the backend is adopted; a backend without it
    gets a Failure naming what it lacks, and the worker goes on."""
    from asyncrl.wire.messages import CalibrateKV, Call, Failure, KVScalesResult, Reply

    backend = _Calibrating()
    for adopted in (backend, _Trainer()):
        rt = TrainerRuntime(None, _Control(), INIT, _wctx("trainer"))
        try:
            rt.adopt(adopted, plugin="fake")
            request = CalibrateKV(batch=BATCH, percentile=99.0, margin=1.1, include_q=True)
            await rt.answer(Call(call_id=1, request=request))
        finally:
            rt.thread.close()
        (answer,) = rt.control.sent
        if adopted is backend:  # a Reply that encoded: the np.float32 became a float
            assert isinstance(answer, Reply) and isinstance(answer.result, KVScalesResult)
            assert answer.result.scales == {"model.layers.0.self_attn.k_scale": 0.25}
            assert backend.seen == {"n": 1, "p": 99.0, "m": 1.1, "q": True}
        else:
            assert isinstance(answer, Failure) and answer.error_type == "ProtocolError"
            assert "cannot calibrate FP8 KV-cache scales" in answer.message


class _Gathering(_Trainer):
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

    rt = TrainerRuntime(None, _Control(), INIT, _wctx("trainer"))
    rt.sender = SimpleNamespace(transfer=SimpleNamespace(name="shm"))  # type: ignore[assignment]
    rt.adopt(_Gathering(), plugin="fake")
    try:
        with pytest.raises(ProtocolError, match="SendWeights over 'cuda_ipc'"):
            await rt._send_weights(SendWeights(version=1, receivers=["rollout:0"],
                                               transport="cuda_ipc", bucket_size_bytes=1 << 20,
                                               timeout_s=5.0))
        assert rt.backend.pulled == 5
    finally:
        rt.thread.close()


async def test_a_job_is_refused_by_a_backend_that_serves_one_policy() -> None:
    """A request, a refit or a score of a job (docs/jobs.md) reaching a backend without
    ``ServesJobs`` fails naming the backend and the fix: served, it would get the one policy
    the backend has, another job's."""
    from asyncrl.wire.messages import Call, CloseJob, Failure, Generate, ReceiveWeights, ScoreTokens

    rt = _runtime(_Backend(RuntimeError("never reached")))
    rt.wctx = WorkerContext("rollout", 0, 1, 0, type("C", (), {"generator": type(
        "G", (), {"backend": "plain"})})(), "")  # type: ignore[arg-type]  # fmt: skip
    rt._tasks = object()  # type: ignore[assignment]  # serving; nothing may start
    with pytest.raises(RuntimeError, match="generator backend 'plain' serves one policy only"):
        await rt._generate(Generate(requests=[REQ, GenRequest(
            group_id="g8", prompt_ids=[1], n=1, max_tokens=2, job="a")]))  # fmt: skip
    for request in (ScoreTokens(batch=BATCH, job="a"), CloseJob(job="a"),
                    ReceiveWeights(version=1, address="ipc://x", job="a")):  # fmt: skip
        await rt.answer(Call(call_id=1, request=request))
        reply = rt.control.sent.pop()
        assert isinstance(reply, Failure) and "serves one policy only" in reply.message


class _Jobs(_Trainer):
    """A trainer of jobs that records what reaches it, and how."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def open_job(self, job, *, seed, lr):  # noqa: ANN001, ANN201
        self.calls.append(("open", job, seed, lr))

    def close_job(self, job):  # noqa: ANN001, ANN201
        self.calls.append(("close", job))

    def begin_step(self, step, **job):  # noqa: ANN001, ANN201
        self.calls.append(("begin", step, job))

    def finish_step(self, step, num_loss_tokens, **keywords):  # noqa: ANN001, ANN201
        from asyncrl.wire.messages import StepResult

        self.calls.append(("finish", step, keywords))
        return StepResult(step=step, loss=0.0, grad_norm=0.0, num_loss_tokens=num_loss_tokens,
                          lr=0.1, seconds=0.0)  # fmt: skip

    def compute_logprobs(self, batch, temperature, **job):  # noqa: ANN001, ANN201
        self.calls.append(("logprobs", job))
        return np.zeros(2, np.float32)

    def save_state(self, path, **job):  # noqa: ANN001, ANN201
        self.calls.append(("save", path, job))


async def test_a_jobs_calls_reach_a_trainer_of_jobs_and_one_without_refuses_them() -> None:
    """With ``TrainsJobs`` (found once, at adoption) a job's calls reach the backend naming
    the job, the run's own calls name none (a backend's keywords stay as they were); a backend
    without it fails each job's call naming the fix, and the worker goes on."""
    from asyncrl.wire.messages import (
        BeginStep, Call, CloseJob, ComputeLogprobs, Failure, FinishStep, OpenJob, Reply,
        SaveState,
    )  # fmt: skip

    requests = [OpenJob(job="a", seed=3, lr=0.01), BeginStep(step=1, job="a"), BeginStep(step=4),
                FinishStep(step=1, num_loss_tokens=5, normalizer=2.0, job="a"),
                ComputeLogprobs(batch=BATCH, job="a"), SaveState(path="/x", job="a"),
                CloseJob(job="a")]  # fmt: skip
    backend = _Jobs()
    for adopted in (backend, _Trainer()):
        rt = TrainerRuntime(None, _Control(), INIT, _wctx("trainer"))
        rt.wctx = WorkerContext("trainer", 0, 1, 0, type("C", (), {"trainer": type(
            "T", (), {"backend": "plain"})})(), "")  # type: ignore[arg-type]  # fmt: skip
        try:
            rt.adopt(adopted, plugin="fake")
            for i, request in enumerate(requests):
                await rt.answer(Call(call_id=i, request=request))
        finally:
            rt.thread.close()
        if adopted is backend:
            assert all(isinstance(a, Reply) for a in rt.control.sent)
            assert backend.calls == [
                ("open", "a", 3, 0.01), ("begin", 1, {"job": "a"}), ("begin", 4, {}),
                ("finish", 1, {"job": "a", "normalizer": 2.0}), ("logprobs", {"job": "a"}),
                ("save", "/x", {"job": "a"}), ("close", "a"),
            ]  # fmt: skip
        else:
            assert all(isinstance(a, Failure) for a in rt.control.sent)
            refused = [a for a in rt.control.sent if "trains one policy only" in a.message]
            assert len(refused) == len(requests) - 1  # the run's own BeginStep reached it
            assert all("(fsdp2)" in a.message for a in refused)
