"""Worker runtime: one per rank. Connects to the controller, loads the backend, serves calls.

::

    controller ROUTER ◄──── DEALER (identity "group:rank") ─── this runtime ─── backend plugin
    controller PULL   ◄──── PUSH (rollout ranks: finished groups)
    trainer rank 0 ROUTER ◄─ DEALER (rollout ranks: weight buckets, see asyncrl.worker.weights)

Handshake: ``Hello`` → ``Init`` (the run config) → backend ``start()`` → ``Ready``.
Rollout ranks run every call as its own task (generation is concurrent); trainer ranks run
calls strictly in arrival order on one dedicated thread, so torch collectives line up across
ranks and CUDA's per-thread device stays put. A backend failure during a call is reported as
a ``Failure`` and the worker keeps serving; a failure outside a call (start-up, a dead engine)
is reported as ``Dead`` and the process exits non-zero.

While it serves, two watchers run beside the calls::

    controller watch   pidfd of Init.controller_pid → ControllerLostError: stop the engine,
                       remove the run's socket and shm directories, exit non-zero
    engine watch       backend.watch() (if the backend has one) → EngineDeadError → Dead

After ``Shutdown`` the worker ignores SIGTERM: it is already leaving, and a SIGTERM that lands
while a slow engine shuts down must not turn a clean exit into a failure (SIGKILL still works).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import structlog

from asyncrl import plugins
from asyncrl.backend import (
    BackendPlugin,
    GenerationBackend,
    TrainingBackend,
    WorkerContext,
    drain_weights,
)
from asyncrl.wire.codec import Codec
from asyncrl.config import Config
from asyncrl.errors import (
    ControllerLostError,
    ProtocolError,
    RequestError,
    WorkerError,
    flatten,
)
from asyncrl.worker.export import export_model
from asyncrl.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    BeginStep,
    CalibrateKV,
    Call,
    ChunkResult,
    ComputeLogprobs,
    DataBatch,
    DataMessage,
    Dead,
    Empty,
    ExportModel,
    Failure,
    FinishStep,
    FromWorker,
    Generate,
    GenRequest,
    GroupFailed,
    Health,
    HealthResult,
    Hello,
    Init,
    KVScalesResult,
    LoadState,
    LogprobsResult,
    Ready,
    ReceiveWeights,
    Reply,
    Request,
    ResetPrefixCache,
    Result,
    Sample,
    SampleDone,
    SaveState,
    Score,
    SendWeights,
    Shutdown,
    ToWorker,
    TrainChunk,
)
from asyncrl.procs.process import has_exited, wait_pid_exit
from asyncrl.worker.weights import WeightReceiver, WeightSender, shm_dir
from asyncrl.transfers import StagingSpec, load_transfer
from asyncrl.wire.transport import DEALER, PUSH, Context

__all__ = ["serve"]

log = structlog.get_logger("asyncrl.worker.runtime")

DATA_BATCH = 16
"""At most this many samples in one :class:`DataBatch`: the controller takes a batch in one
go, and 16 samples (~0.5 ms of its loop) keep that slice short."""
OUTBOX_SIZE = 1024
"""Finished samples waiting for the data socket before generations wait for it."""
ENGINE_GONE_GRACE_S = 1.0
"""After a rollout call or a generation raised: how long to wait for the engine watch to say
the engine died (a dying engine fails requests a moment before its processes are seen gone).
If it does, the worker's ``Dead`` speaks for the failure; a ``Failure`` reply or a
``GroupFailed`` would be taken for an error of that call or group, not of the engine."""
T = TypeVar("T")


class _Thread:
    """One dedicated thread; ``run`` awaits a blocking call made on it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-backend")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        done = anyio.Event()
        token = anyio.lowlevel.current_token()
        loop_thread = threading.get_ident()

        def notify(_: object) -> None:
            # A future that is already done runs its callback right here, on the loop thread,
            # where from_thread.run_sync would block the loop forever.
            if threading.get_ident() == loop_thread:
                done.set()
            else:
                anyio.from_thread.run_sync(done.set, token=token)

        future = self._pool.submit(fn, *args)
        future.add_done_callback(notify)
        with anyio.CancelScope(shield=True):  # a running torch call cannot be interrupted
            await done.wait()
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Busy:
    """Wall time during which at least one generation is running (reported per refit)."""

    def __init__(self) -> None:
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._total += time.perf_counter() - self._since

    def take(self) -> float:
        """Busy seconds since the last take (an ongoing stretch counts up to now)."""
        now = time.perf_counter()
        total = self._total + (now - self._since if self._active else 0.0)
        self._total = 0.0
        if self._active:
            self._since = now
        return total


class _Runtime:
    def __init__(
        self, ctx: Context, control: Any, init: Init, wctx: WorkerContext, identity: str
    ) -> None:
        self.ctx = ctx
        self.control = control
        self.init = init
        self.wctx = wctx
        self.identity = identity
        self.tx = Codec(FromWorker)
        self.thread = _Thread()
        self.backend: Any = None
        self.data = None
        self.receiver: WeightReceiver | None = None
        self.sender: WeightSender | None = None
        self.running: dict[str, anyio.CancelScope] = {}
        self._outbox: Any = None
        """Rollout workers: where generations put their samples for :meth:`push_data`."""
        self.engine_gone: anyio.Event | None = None
        """Set when the backend's engine watch raised (``None``: the backend has none)."""
        self.busy = _Busy()

    async def send(self, msg: Any) -> None:
        await self.control.send(self.tx.encode(msg))

    # ----------------------------------------------------------------- rollout side
    async def _generate_one(self, req: GenRequest, outbox: Any) -> None:
        async def emit(index: int, sample: Sample) -> None:
            await outbox.send(SampleDone(req.group_id, self.identity, index, sample))

        self.busy.enter()
        try:
            await self.backend.generate(req, emit)
        except WorkerError:
            raise  # the engine is gone: fatal for this worker, not a failure of this group
        except Exception as exc:
            if await self._engine_died():
                return  # the worker's Dead says why; the controller sends the group elsewhere
            log.exception("generation_failed", group_id=req.group_id)
            first = flatten(exc)[0]  # a task group's error says only "unhandled errors"
            await outbox.send(
                GroupFailed(
                    req.group_id,
                    self.identity,
                    type(first).__name__,
                    str(first),
                    retryable=not isinstance(first, RequestError),
                )
            )
        finally:
            self.busy.leave()

    async def push_data(self, items: Any) -> None:
        """Send what the generations emit to the controller's data socket, in order. What is
        ready together (samples finishing in the same engine step) goes as one
        :class:`DataBatch` of at most ``DATA_BATCH`` items, so the controller's loop receives
        and decodes one message, not one per sample; nothing waits to fill a batch."""
        data = self.data
        assert data is not None
        tx = Codec(DataMessage)
        async with items:
            async for first in items:
                batch = [first]
                while len(batch) < DATA_BATCH:
                    try:
                        batch.append(items.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await data.send(tx.encode(batch[0] if len(batch) == 1 else DataBatch(batch)))

    async def rollout_call(self, req: Request, tg: anyio.abc.TaskGroup) -> Result:
        backend: GenerationBackend = self.backend
        if isinstance(req, Generate):
            for r in req.requests:
                tg.start_soon(self._generate_one, r, self._outbox, name=f"gen-{r.group_id}")
            return Empty()
        if isinstance(req, Abort):
            await backend.abort(list(req.group_ids))
            return Empty()
        if isinstance(req, Score):
            return LogprobsResult(logprobs=await backend.score(req.batch, req.temperature))
        if isinstance(req, ReceiveWeights):
            if self.receiver is None or self.receiver.address != req.address:
                if self.receiver is not None:
                    self.receiver.close()
                self.receiver = WeightReceiver(self.ctx, req.address, self.identity)
            received = await self.receiver.receive(
                req.version,
                backend,
                transport=req.transport,
                reset_prefix_cache=req.reset_prefix_cache,
                kv_scales=req.kv_scales,
                timeout_s=req.timeout_s,
            )
            return msgspec.structs.replace(received, busy_s=self.busy.take())
        if isinstance(req, ResetPrefixCache):
            await backend.reset_prefix_cache()
            return Empty()
        if isinstance(req, Health):
            return HealthResult(pid=os.getpid())
        raise ProtocolError(f"a rollout worker cannot serve {type(req).__name__}")

    # ----------------------------------------------------------------- trainer side
    async def _send_weights(self, req: SendWeights, it: Iterator[Any]) -> Result:
        assert self.sender is not None
        if req.transport != self.sender.transfer.name:
            raise ProtocolError(
                f"SendWeights over {req.transport!r}, but this trainer stages for "
                f"{self.sender.transfer.name!r}"
            )
        specs = await self.thread.run(self.backend.weight_specs)
        return await self.sender.send(
            req.version,
            list(req.receivers),
            specs,
            it,
            bucket_size=req.bucket_size_bytes,
            timeout_s=req.timeout_s,
            run=self.thread.run,
            pids=req.receiver_pids,
        )

    async def trainer_call(self, req: Request) -> Result:
        backend: TrainingBackend = self.backend
        if isinstance(req, ComputeLogprobs):
            lp = await self.thread.run(backend.compute_logprobs, req.batch, req.temperature)
            return LogprobsResult(logprobs=lp)
        if isinstance(req, BeginStep):
            await self.thread.run(backend.begin_step, req.step)
            return Empty()
        if isinstance(req, TrainChunk):
            result: ChunkResult = await self.thread.run(backend.train_chunk, req.step, req.batch)
            return result
        if isinstance(req, FinishStep):
            return await self.thread.run(backend.finish_step, req.step, req.num_loss_tokens)
        if isinstance(req, CalibrateKV):
            calibrate = getattr(backend, "calibrate_kv_scales", None)
            if calibrate is None:
                raise ProtocolError(
                    f"training backend {type(backend).__name__} cannot calibrate FP8 KV-cache "
                    "scales (it has no calibrate_kv_scales)"
                )
            scales = await self.thread.run(
                functools.partial(
                    calibrate,
                    req.batch,
                    percentile=req.percentile,
                    margin=req.margin,
                    include_q=req.include_q,
                )
            )
            return KVScalesResult(scales={k: float(v) for k, v in scales.items()})
        if isinstance(req, SendWeights):
            it = await self.thread.run(backend.iter_weights)
            if self.wctx.rank != 0:  # take part in the gathers, send nothing
                await self.thread.run(drain_weights, it)
                return Empty()
            try:
                return await self._send_weights(req, it)
            except Exception:
                # the other ranks gather with this one (an FSDP unit's all-gather): finish the
                # iteration, or they wait in a collective until its timeout
                await self.thread.run(functools.partial(drain_weights, it, after_failure=True))
                raise
        if isinstance(req, SaveState):
            await self.thread.run(backend.save_state, req.path)
            return Empty()
        if isinstance(req, LoadState):
            await self.thread.run(backend.load_state, req.path)
            return Empty()
        if isinstance(req, ExportModel):
            await self.thread.run(
                functools.partial(
                    export_model,
                    backend,
                    self.wctx.rank,
                    req.path,
                    source_dir=req.source_dir,
                    shard_bytes=req.shard_bytes,
                )
            )
            return Empty()
        if isinstance(req, Health):
            return HealthResult(pid=os.getpid())
        raise ProtocolError(f"a trainer worker cannot serve {type(req).__name__}")

    # ----------------------------------------------------------------- dispatch
    async def answer(self, call: Call, tg: anyio.abc.TaskGroup) -> None:
        try:
            start = time.perf_counter()
            if self.wctx.group == "rollout":
                result = await self.rollout_call(call.request, tg)
            else:
                result = await self.trainer_call(call.request)
            seconds = time.perf_counter() - start
            await self.send(Reply(call_id=call.call_id, result=result, seconds=seconds))
        except WorkerError:
            raise  # its engine is gone: this worker is dying, its Dead message says why
        except Exception as exc:
            if await self._engine_died():
                return
            log.exception("call_failed", method=type(call.request).__name__)
            await self.send(
                Failure(
                    call_id=call.call_id,
                    error_type=type(exc).__name__,
                    message=str(exc),
                    traceback=traceback.format_exc(),
                )
            )

    async def serve_calls(self) -> None:
        rx = Codec(ToWorker)
        rollout = self.wctx.group == "rollout"
        # rollout workers run calls concurrently, and their generations put samples into a
        # bounded outbox (a full one holds the generations back); trainers run calls in order
        send, recv = anyio.create_memory_object_stream[Any](OUTBOX_SIZE if rollout else 16)
        with send:
            async with anyio.create_task_group() as tg:
                if rollout:
                    self._outbox = send
                    tg.start_soon(self.push_data, recv, name="data-push")
                else:
                    tg.start_soon(self._sequential, recv, tg)
                while True:
                    msg = rx.decode(await self.control.recv())
                    if isinstance(msg, Shutdown):
                        log.info("worker_stopping", worker=self.identity)
                        if self.init.controller_pid != os.getpid():  # not the controller's rank
                            _ignore_sigterm()
                        tg.cancel_scope.cancel()
                        return
                    if not isinstance(msg, Call):
                        raise ProtocolError(f"unexpected {type(msg).__name__} after Init")
                    if rollout:
                        tg.start_soon(self.answer, msg, tg)
                    else:
                        await send.send(msg)

    async def run(self) -> None:
        """Serve calls until ``Shutdown``, with the controller and engine watchers beside.

        Raises:
            ControllerLostError: the controller's process exited.
            EngineDeadError: the backend's ``watch()`` saw its engine die.
        """
        try:
            async with anyio.create_task_group() as tg:
                pid = self.init.controller_pid
                if pid and pid != os.getpid():
                    tg.start_soon(self._watch_controller, pid, name="controller-watch")
                watch = getattr(self.backend, "watch", None)
                if watch is not None:
                    self.engine_gone = anyio.Event()
                    tg.start_soon(self._watch_engine, watch, name="engine-watch")
                await self.serve_calls()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # one watcher (or the call loop) failed and the rest were cancelled: report that
            # one error itself, so the Dead message says what happened
            cancelled = anyio.get_cancelled_exc_class()
            leaves = [e for e in flatten(group) if not isinstance(e, cancelled)]
            if len(leaves) == 1 and isinstance(leaves[0], Exception):
                raise leaves[0] from None
            # a dying engine can fail a generation and the engine watch at once: same cause
            fatal = [e for e in leaves if isinstance(e, WorkerError)]
            if fatal and len({str(e) for e in fatal}) == 1:
                raise fatal[0] from None
            raise

    async def _watch_engine(self, watch: Callable[[], Any]) -> None:
        try:
            await watch()
        except Exception:
            assert self.engine_gone is not None
            self.engine_gone.set()
            raise

    async def _engine_died(self) -> bool:
        """Whether the engine watch reports the engine dead within ``ENGINE_GONE_GRACE_S``
        (at once ``False`` without a watch). The watch's error cancels the caller anyway."""
        if self.engine_gone is None:
            return False
        with anyio.move_on_after(ENGINE_GONE_GRACE_S):
            await self.engine_gone.wait()
        return self.engine_gone.is_set()

    async def _watch_controller(self, pid: int) -> None:
        await wait_pid_exit(pid)
        raise ControllerLostError(
            f"the controller (pid {pid}) exited without telling worker {self.identity} to stop"
        )

    async def _sequential(self, calls: Any, tg: anyio.abc.TaskGroup) -> None:
        async with calls:
            async for call in calls:
                await self.answer(call, tg)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.backend is not None:
                try:
                    if self.wctx.group == "rollout":
                        with anyio.move_on_after(30):
                            await self.backend.close()
                    else:
                        await self.thread.run(self.backend.close)
                except Exception:
                    log.exception("backend_close_failed")
            for part in (self.receiver, self.sender):
                if part is not None:
                    part.close()
            self.thread.close()


async def serve(
    *,
    control_address: str,
    group: str,
    rank: int,
    world_size: int,
    local_rank: int,
    log_path: str = "",
    extra: dict[str, Any] | None = None,
    startup_timeout_s: float = 600.0,
) -> None:
    """Run one worker until the controller says ``Shutdown``.

    Raises whatever made the worker unable to serve, after telling the controller (``Dead``).

    Cancellation: the backend is closed (shielded) and the cancellation propagates.
    """
    identity = f"{group}:{rank}"
    ctx = Context()
    runtime: _Runtime | None = None
    lost = False
    control = ctx.socket(DEALER, connect=control_address, identity=identity)
    tx = Codec(FromWorker)
    try:
        await control.send(
            tx.encode(
                Hello(
                    protocol_version=PROTOCOL_VERSION,
                    group=group,
                    rank=rank,
                    world_size=world_size,
                    pid=os.getpid(),
                    log_path=log_path,
                )
            )
        )
        with anyio.fail_after(startup_timeout_s):
            init = Codec(ToWorker).decode(await control.recv())
        if not isinstance(init, Init):
            raise ProtocolError(f"expected Init, got {type(init).__name__}")
        config = msgspec.convert(init.config, Config)
        wctx = WorkerContext(
            group=group,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            config=config,
            run_dir=os.path.dirname(control_address.removeprefix("ipc://")),
            extra=dict(extra or {}, run_id=init.run_id),
            gpu=_placement(config, group, rank),
        )
        runtime = _Runtime(ctx, control, init, wctx, identity)
        structlog.contextvars.bind_contextvars(worker=identity)
        if group == "rollout":
            runtime.data = ctx.socket(PUSH, connect=init.data_address, hwm=256)
            plugin = plugins.load("asyncrl.generation_backends", config.generator.backend)
            runtime.backend = BackendPlugin.of(plugin).create(wctx)
            caps = await runtime.backend.start()
        else:
            plugin = plugins.load("asyncrl.training_backends", config.trainer.backend)
            runtime.backend = await runtime.thread.run(BackendPlugin.of(plugin).create, wctx)
            caps = await runtime.thread.run(runtime.backend.start)
            if rank == 0 and init.transfer_address:
                transfer = load_transfer(config.refit.transport)
                spec = StagingSpec(
                    init.run_id, rank, str(caps.get("device", "cpu")),
                    buffers=config.refit.staging_buffers,
                )
                runtime.sender = WeightSender(ctx, init.transfer_address, transfer, spec)
        # backends report whatever they like (e.g. torch's TorchVersion, a str subclass):
        # keep only plain JSON values on the wire
        caps = json.loads(json.dumps(caps, default=str))
        backend_name = config.generator.backend if group == "rollout" else config.trainer.backend
        await control.send(
            tx.encode(
                Ready(
                    backend=backend_name,
                    backend_version=str(caps.get("backend_version", "")),
                    capabilities=caps,
                )
            )
        )
        log.info("worker_ready", backend=backend_name)
        await runtime.run()
    except ControllerLostError:
        log.error("controller_lost", worker=identity)
        lost = True
        raise
    except Exception as exc:
        with anyio.CancelScope(shield=True):
            dead = Dead(reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            try:
                control.send_nowait(tx.encode(dead))
            except Exception:  # noqa: BLE001 - the controller may be gone already
                pass
        raise
    finally:
        if runtime is not None:
            await runtime.close()
        if runtime is not None and not lost:
            lost = _controller_gone(runtime.init.controller_pid)
        control.close(linger_ms=0 if lost else 2000)
        ctx.close()
        if lost and runtime is not None:
            _remove_run_files(runtime.wctx.run_dir, runtime.init.run_id)


def _placement(config: Config, group: str, rank: int) -> int | None:
    gpus = config.cluster.trainer_gpus if group == "trainer" else config.cluster.rollout_gpus
    return gpus[rank] if gpus else None


def _ignore_sigterm() -> None:
    """From now on SIGTERM cannot kill this process (it is leaving in order already)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _controller_gone(pid: int) -> bool:
    """Whether the controller's process (another process than this one) has exited."""
    return bool(pid) and pid != os.getpid() and has_exited(pid)


def _remove_run_files(run_dir: str, run_id: str) -> None:
    """What a dead controller would have removed: the run's ipc socket directory and the
    shared-memory bucket directory (whoever removes them first wins; both may be gone)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(shm_dir(run_id), ignore_errors=True)
    log.info("run_files_removed", run_dir=run_dir)
