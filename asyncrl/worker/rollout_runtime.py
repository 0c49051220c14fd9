"""A rollout worker: one generation engine, its calls served concurrently, samples streamed.

::

    controller ROUTER ◄── DEALER ── RolloutRuntime ── GenerationBackend (asyncio-native)
    controller PULL   ◄── PUSH ◄── push_data ◄── outbox (bounded) ◄── a task per group
    trainer rank 0 ROUTER ◄── DEALER (weight buckets, asyncrl.worker.weights)

Every call is a task of its own (an ``Abort`` arrives while groups generate; a refit's bucket
loads overlap). ``Generate`` starts one task per group and answers at once; each finished
sample goes through a bounded outbox (a full one holds the generations back) to the data
socket, batched with whatever else is ready. A group whose generation raised becomes a
``GroupFailed``; an engine death is fatal for the worker (its ``Dead`` says why).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from asyncrl.backend import (
    BackendPlugin,
    EngineWatch,
    GenerationBackend,
    Reprefill,
    ServesJobs,
    Sleeps,
    WorkerContext,
)
from asyncrl.config import Config
from asyncrl.errors import RequestError, config_error, flatten
from asyncrl.policy.samplers import in_flight_at_refit
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import (
    Abort,
    Call,
    CloseJob,
    DataBatch,
    DataMessage,
    Empty,
    Generate,
    GenRequest,
    GroupFailed,
    Init,
    LogprobsResult,
    ReceiveWeights,
    Result,
    Sample,
    SampleDone,
    ScoreTokens,
    Sleep,
    TurnResult,
)
from asyncrl.wire.transport import PUSH
from asyncrl.worker.base import Handler, WorkerRuntime
from asyncrl.worker.weights import WeightReceiver

__all__ = ["DATA_BATCH", "OUTBOX_SIZE", "RolloutRuntime"]

log = structlog.get_logger("asyncrl.worker.runtime")

DATA_BATCH = 16
"""At most this many samples in one :class:`DataBatch`: the controller takes a batch in one
go, and 16 samples (~0.5 ms of its loop) keep that slice short."""
OUTBOX_SIZE = 1024
"""Finished samples waiting for the data socket before generations wait for it."""
CLOSE_TIMEOUT_S = 30.0
"""How long the worker waits for a backend's ``close`` before it leaves without it. It cuts a
close only at an await the close lets be cancelled: one that shields itself or blocks the
event loop (vLLM's, which bounds its engine's shutdown by ``shutdown_timeout_s`` and reaps
what is left) runs to its end."""


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


class RolloutRuntime(WorkerRuntime):
    """The runtime of a rollout rank: a :class:`~asyncrl.backend.GenerationBackend`."""

    ROLE = "rollout"
    PLUGIN_GROUP = "asyncrl.generation_backends"
    PROTOCOL = GenerationBackend
    OPTIONAL = (EngineWatch, Reprefill, Sleeps, ServesJobs)

    backend: GenerationBackend

    def __init__(self, ctx: Any, control: Any, init: Init, wctx: WorkerContext) -> None:
        super().__init__(ctx, control, init, wctx)
        self.data: Any = None
        """The PUSH socket to the controller's data PULL (opened by :meth:`_start`)."""
        self.receiver: WeightReceiver | None = None
        self.busy = _Busy()
        self._outbox: Any = None
        """Where generations put what they emit for :meth:`push_data` (the send end of a
        stream of ``OUTBOX_SIZE``, opened by :meth:`_start_serving`, closed when serving
        ends)."""
        self._tasks: anyio.abc.TaskGroup | None = None
        """The serving task group: generations run in it (while serving)."""
        self._reprefill: Callable[[], Awaitable[None]] | None = None
        """The backend's ``reprefill_in_flight`` (:class:`~asyncrl.backend.Reprefill`)."""
        self._sleep: Callable[[], Awaitable[dict[str, Any]]] | None = None
        """The backend's ``sleep`` (:class:`~asyncrl.backend.Sleeps`)."""
        self._close_job: Callable[[str], Awaitable[None]] | None = None
        """The backend's ``close_job`` (:class:`~asyncrl.backend.ServesJobs`): with it, the
        engine serves several jobs' adapters."""

    @staticmethod
    def backend_name(config: Config) -> str:
        return config.generator.backend

    @staticmethod
    def gpus(config: Config) -> list[int]:
        return list(config.cluster.rollout_gpus)

    def _call_table(self) -> dict[type, Handler]:
        return {
            Generate: self._generate,
            Abort: self._abort,
            ScoreTokens: self._score,
            ReceiveWeights: self._receive_weights,
            Sleep: self._sleep_engine,
            CloseJob: self._end_job,
        }

    # ----------------------------------------------------------------- lifecycle
    async def _create(self, plugin: BackendPlugin) -> Any:
        return plugin.create(self.wctx)

    def _use_optional(self, methods: dict[str, Callable[..., Any] | None]) -> None:
        self._engine_watch = methods["watch"]
        self._reprefill = methods["reprefill_in_flight"]
        self._sleep = methods["sleep"]
        self._close_job = methods["close_job"]

    async def _start(self) -> dict[str, Any]:
        """Start the backend (after checking it can do what the config asks of it).

        Raises:
            ConfigError: the sampler re-prefills at refits and the backend cannot.
        """
        config = self.wctx.config
        if self._reprefill is None and in_flight_at_refit(config.sampler) == "reprefill":
            raise config_error(
                "pipeline.sampler.in_flight_at_refit",
                f"generator backend {config.generator.backend!r} cannot re-prefill the "
                "requests in flight at a refit (it has no reprefill_in_flight)",
                'set it to "continue", or use a backend that can (vllm)',
            )
        if self._sleep is None and config.cluster.placement == "take_turns":
            raise config_error(
                "cluster.placement",
                f"generator backend {config.generator.backend!r} cannot sleep while the "
                "trainer steps (it has no sleep)",
                'set it to "resident", or use a backend that can (vllm)',
            )
        self.data = self.ctx.socket(PUSH, connect=self.init.data_address, hwm=256)
        facts = await self.backend.start()
        return {**facts, "serves_jobs": self._close_job is not None}

    def _start_serving(self, tg: anyio.abc.TaskGroup) -> None:
        """Open the outbox (finished samples on their way to the data socket) and start
        :meth:`push_data` on it; generations run in ``tg``."""
        outbox, items = anyio.create_memory_object_stream[DataMessage](OUTBOX_SIZE)
        self._outbox, self._tasks = outbox, tg
        tg.start_soon(self._push_outbox, outbox, items, name="data-push")

    async def _push_outbox(self, outbox: Any, items: Any) -> None:
        """:meth:`push_data` until serving ends (cancelled), then close the outbox."""
        with outbox:
            await self.push_data(items)

    async def _submit(self, call: Call, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self.answer, call)

    async def _close_backend(self) -> None:
        """The backend's ``close``, given up after ``CLOSE_TIMEOUT_S`` where it can be cut
        (see there): a close that shields itself is bounded only by its own timeouts."""
        with anyio.move_on_after(CLOSE_TIMEOUT_S):
            await self.backend.close()

    def _release(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    # ----------------------------------------------------------------- calls
    async def _generate(self, req: Generate) -> Result:
        assert self._tasks is not None
        for r in req.requests:
            if r.job:
                self._require_jobs(f"group {r.group_id} of job {r.job!r}")
        for r in req.requests:
            self._tasks.start_soon(self._generate_one, r, self._outbox, name=f"gen-{r.group_id}")
        return Empty()

    async def _abort(self, req: Abort) -> Result:
        await self.backend.abort(list(req.group_ids))
        return Empty()

    async def _score(self, req: ScoreTokens) -> Result:
        if not req.job:
            return LogprobsResult(logprobs=await self.backend.score(req.batch, req.temperature))
        self._require_jobs(f"scoring under job {req.job!r}")
        score = self.backend.score
        scored = await score(req.batch, req.temperature, job=req.job)  # type: ignore[call-arg]
        return LogprobsResult(logprobs=scored)

    async def _end_job(self, req: CloseJob) -> Result:
        self._require_jobs(f"closing job {req.job!r}")
        assert self._close_job is not None
        await self._close_job(req.job)
        return Empty()

    def _require_jobs(self, what: str) -> None:
        """Raises: RuntimeError: the backend serves one policy only (no ``ServesJobs``)."""
        if self._close_job is None:
            raise RuntimeError(
                f"{what}: generator backend {self.wctx.config.generator.backend!r} serves one "
                "policy only (it has no close_job: asyncrl.plugin.backend.ServesJobs); it would "
                "serve another job's policy. Run jobs over a backend that serves them (vllm)"
            )

    async def _receive_weights(self, req: ReceiveWeights) -> Result:
        if req.job:
            self._require_jobs(f"installing v{req.version} of job {req.job!r}")
        if self.receiver is None or self.receiver.address != req.address:
            if self.receiver is not None:
                self.receiver.close()
            self.receiver = WeightReceiver(self.ctx, req.address, self.identity)
        received = await self.receiver.receive(
            req.version,
            self.backend,
            transport=req.transport,
            reset_prefix_cache=req.reset_prefix_cache,
            reprefill=self._reprefill if req.reprefill else None,
            kv_scales=req.kv_scales,
            timeout_s=req.timeout_s,
            job=req.job,
        )
        return msgspec.structs.replace(received, busy_s=self.busy.take())

    async def _sleep_engine(self, req: Sleep) -> Result:
        if self._sleep is None:  # the worker refused to start such a run
            raise RuntimeError("Sleep sent to an engine that cannot sleep")
        start = time.perf_counter()
        facts = await self._sleep()
        return TurnResult(seconds=time.perf_counter() - start, held=int(facts.get("held", 0)))

    # ----------------------------------------------------------------- generations
    async def _generate_one(self, req: GenRequest, outbox: Any) -> None:
        """Generate one group, its samples into ``outbox``; its failure as a ``GroupFailed``.

        Raises:
            WorkerError: the engine is gone (fatal for this worker, not a failure of the group).
        """

        async def emit(index: int, sample: Sample) -> None:
            await outbox.send(SampleDone(req.group_id, self.identity, index, sample))

        self.busy.enter()
        try:
            await self.backend.generate(req, emit)
        except Exception as exc:
            if not self._own_failure(exc):
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
        and decodes one message, not one per sample; nothing waits to fill a batch.

        Cancellation: stops; what is still in the outbox is dropped.
        """
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
