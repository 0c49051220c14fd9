"""A trainer worker: one rank of the training group, its calls run in order on one thread.

::

    controller ROUTER ◄── DEALER ── TrainerRuntime ── queue (bounded, arrival order)
                                         │
                                    _sequential ── backend thread ── TrainingBackend (blocking)
    trainer rank 0 only: ROUTER ◄── rollout DEALERs (weight buckets, asyncrl.worker.weights)

Calls run strictly in arrival order on one dedicated thread, so torch collectives line up
across ranks and CUDA's per-thread device stays put. A running backend call cannot be
interrupted: cancellation waits for it.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from asyncrl.backend import (
    BackendPlugin,
    KVCalibration,
    ReadsLossInputs,
    ReferencePolicy,
    SentWeightsScoring,
    StateOffload,
    TrainingBackend,
    TrainsJobs,
    WorkerContext,
    drain_weights,
)
from asyncrl.config import Config
from asyncrl.errors import CollectiveTimeoutError, PluginError, ProtocolError
from asyncrl.registry import did_you_mean
from asyncrl.policy.loss_inputs import LossInputs
from asyncrl.transfers import StagingSpec, load_transfer
from asyncrl.wire.messages import (
    BeginStep,
    CalibrateKV,
    Call,
    CloseJob,
    ComputeLogprobs,
    Empty,
    ExportModel,
    FinishStep,
    Init,
    KVScalesResult,
    LoadState,
    LogprobsResult,
    MoveState,
    OpenJob,
    ReceiverGone,
    Result,
    SaveState,
    SendWeights,
    TrainChunk,
    TurnResult,
)
from asyncrl.wire.transport import toward
from asyncrl.worker.base import Handler, WorkerRuntime
from asyncrl.worker.export import export_model
from asyncrl.worker.weights import WeightSender

__all__ = ["CALL_QUEUE_SIZE", "TrainerRuntime"]

CALL_QUEUE_SIZE = 16
"""Calls received and waiting for the backend's thread (the controller sends a trainer a few
at a time; a full queue holds the receiving loop, never a ``Health`` probe)."""
T = TypeVar("T")

COLLECTIVE_TIMEOUTS = (
    "Timed out waiting",  # gloo: a send or receive of a collective outlasted the timeout
    "Application timeout caused pair closure",  # gloo: the next use of a timed-out pair
    "Watchdog caught collective operation timeout",  # NCCL, when it does not abort first
)
"""What torch says when a collective outlasted its process group's timeout (gloo raises a
plain ``RuntimeError``; NCCL's watchdog usually aborts the process, a death)."""


def collective_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` says a torch collective outlasted its timeout, or (a
    ``DistBackendError``) that the process group failed: it cannot be used again."""
    if type(exc).__name__ == "DistBackendError":
        return True
    return any(marker in str(exc) for marker in COLLECTIVE_TIMEOUTS)


class _Thread:
    """One dedicated thread; ``run`` awaits a blocking call made on it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-backend")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, after the calls submitted before it.

        Cancellation: shielded; waits for the call to return (a running torch call cannot be
        interrupted).
        """
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


class TrainerRuntime(WorkerRuntime):
    """The runtime of a trainer rank: a :class:`~asyncrl.backend.TrainingBackend`."""

    ROLE = "trainer"
    PLUGIN_GROUP = "asyncrl.training_backends"
    PROTOCOL = TrainingBackend
    OPTIONAL = (
        KVCalibration, ReferencePolicy, SentWeightsScoring, ReadsLossInputs, StateOffload,
        TrainsJobs,
    )  # fmt: skip

    backend: TrainingBackend

    def __init__(self, ctx: Any, control: Any, init: Init, wctx: WorkerContext) -> None:
        super().__init__(ctx, control, init, wctx)
        self.thread = _Thread()
        self.sender: WeightSender | None = None
        """Rank 0 of a run with rollout workers: publishes each refit's weights."""
        self._calibrate: Callable[..., dict[str, float]] | None = None
        self._reference: Callable[..., Any] | None = None
        """The backend's ``reference_logprobs`` (``loss.kl_coef > 0``), if it has one."""
        self._sent: Callable[..., Any] | None = None
        """The backend's ``sent_logprobs`` (refit verification's trainer side), if it has one;
        without it, ``policy = "sent"`` scores with ``compute_logprobs``."""
        self._loss_inputs: Any = None
        """The backend's ``loss_inputs`` (:class:`~asyncrl.backend.ReadsLossInputs`), if it has
        them; checked by :meth:`_check_loss_inputs`."""
        self._state_moves: tuple[Callable[[], int], Callable[[], int]] | None = None
        """The backend's ``state_to_host`` and ``state_to_device``
        (:class:`~asyncrl.backend.StateOffload`), if it has them."""
        self._jobs: tuple[Callable[..., None], Callable[[str], None]] | None = None
        """The backend's ``open_job`` and ``close_job`` (:class:`~asyncrl.backend.TrainsJobs`),
        if it has them: with them it trains several jobs' adapters."""
        self._queue: Any = None
        """Calls waiting for the backend's thread, in arrival order (the send end of a stream
        of ``CALL_QUEUE_SIZE``, opened by :meth:`_start_serving`, closed when serving ends)."""

    @staticmethod
    def backend_name(config: Config) -> str:
        return config.trainer.backend

    @staticmethod
    def gpus(config: Config) -> list[int]:
        return list(config.cluster.trainer_gpus)

    def _call_table(self) -> dict[type, Handler]:
        return {
            ComputeLogprobs: self._compute_logprobs,
            BeginStep: self._begin_step,
            TrainChunk: self._train_chunk,
            FinishStep: self._finish_step,
            CalibrateKV: self._calibrate_kv,
            SendWeights: self._send_weights,
            SaveState: self._save_state,
            LoadState: self._load_state,
            ExportModel: self._export,
            ReceiverGone: self._receiver_gone,
            MoveState: self._move_state,
            OpenJob: self._open_job,
            CloseJob: self._close_job,
        }

    # ----------------------------------------------------------------- lifecycle
    async def _create(self, plugin: BackendPlugin) -> Any:
        return await self.thread.run(plugin.create, self.wctx)

    def _use_optional(self, methods: dict[str, Callable[..., Any] | None]) -> None:
        self._calibrate = methods["calibrate_kv_scales"]
        self._sent = methods["sent_logprobs"]
        self._reference = methods["reference_logprobs"]
        self._loss_inputs = methods["loss_inputs"]
        moves = (methods["state_to_host"], methods["state_to_device"])
        self._state_moves = moves if None not in moves else None
        jobs = (methods["open_job"], methods["close_job"])
        self._jobs = jobs if None not in jobs else None

    async def _start(self) -> dict[str, Any]:
        """Raises PluginError: ``loss.aggregation`` needs a ``finish_step`` keyword the
        backend lacks (before it starts)."""
        aggregation = self.wctx.config.loss.aggregation
        if aggregation != "token_mean" and not _takes(self.backend.finish_step, "normalizer"):
            raise PluginError(
                f"training backend {self.wctx.config.trainer.backend!r} "
                f"(asyncrl.training_backends): loss.aggregation = {aggregation!r} calls "
                "finish_step(step, num_loss_tokens, normalizer=...), and its finish_step takes "
                "no normalizer. Fix: set loss.aggregation = \"token_mean\", or add the keyword "
                "to the backend (docs/plugins.md)"
            )
        self._check_loss_inputs()
        cluster = self.wctx.config.cluster
        if cluster.placement == "take_turns" and cluster.trainer_offload == "always":
            if self._state_moves is None:
                raise self._cannot_offload()
        caps = await self.thread.run(self.backend.start)
        if self.wctx.rank == 0 and self.init.transfer_address:
            config = self.wctx.config
            spec = StagingSpec(self.init.run_id, self.wctx.rank, str(caps.get("device", "cpu")))
            transfer = load_transfer(config.refit.transport)
            address = self.init.transfer_address
            if address.startswith("tcp://"):  # on this node (the controller's may be another)
                address = toward(address)
            self.sender = WeightSender(self.ctx, address, transfer, spec)
            if self.sender.endpoint.startswith("tcp://"):  # its port: the controller's to hand on
                caps = {**caps, "weights_endpoint": self.sender.endpoint}
        return {**caps, "trains_jobs": self._jobs is not None}

    def _check_loss_inputs(self) -> None:
        """Raises PluginError: the backend's ``loss_inputs`` is not a collection of the
        optional fields' names, or the run's loss needs an input (proximal or reference
        logprobs) that it does not list, or a reference forward it cannot run (before it
        starts)."""
        config = self.wctx.config
        reads = _loss_inputs(self._loss_inputs, config.trainer.backend)
        needs = LossInputs.of(config)
        missing = sorted(needs.names - reads)
        if needs.reference and self._reference is None:
            missing.append("reference_logprobs (a method)")
        if missing:
            raise PluginError(
                f"training backend {config.trainer.backend!r} (asyncrl.training_backends) "
                f"does not read {', '.join(missing)}, which this run's loss needs "
                f"({needs.because}). Fix: change those options, or use a backend that reads "
                "them (fsdp2, deepspeed; docs/plugins.md)"
            )

    def _start_serving(self, tg: anyio.abc.TaskGroup) -> None:
        """Open the call queue and start :meth:`_sequential` on it."""
        self._queue, calls = anyio.create_memory_object_stream[Call](CALL_QUEUE_SIZE)
        tg.start_soon(self._sequential, self._queue, calls, name="calls-in-order")

    async def _submit(self, call: Call, tg: anyio.abc.TaskGroup) -> None:
        await self._queue.send(call)

    async def _sequential(self, queue: Any, calls: Any) -> None:
        """Answer the queued calls one at a time, in arrival order, until serving ends.

        Cancellation: the queue is closed; the calls still in it are dropped (a call already
        on the backend's thread finishes first).
        """
        with queue, calls:
            async for call in calls:
                await self.answer(call)

    async def _close_backend(self) -> None:
        """The backend's ``close`` on its thread, after the calls submitted before it: a call
        stuck there (a collective waiting for a dead rank) holds it until the call returns
        (the collective's timeout) or the controller's SIGKILL. Not bounded here: a running
        torch call cannot be interrupted."""
        await self.thread.run(self.backend.close)

    def _own_failure(self, exc: Exception) -> bool:
        """A call's failure is its own (a ``Failure``; a step may be retried), except a
        collective that timed out: the process group is broken, so the rank dies with a
        :class:`~asyncrl.errors.CollectiveTimeoutError` naming it and the run stops.

        Raises:
            CollectiveTimeoutError: ``exc`` says a collective outlasted its timeout.
            WorkerError: as :meth:`WorkerRuntime._own_failure`.
        """
        if collective_timed_out(exc):
            seconds = self.wctx.config.failures.collective_timeout()
            limit = f"{seconds:g} s" if seconds else "torch's default timeout"
            raise CollectiveTimeoutError(
                f"trainer rank {self.wctx.rank}: a torch collective waited more than {limit} "
                "(failures.collective_timeout_s) for the other ranks: one is stuck in its "
                "compute or gone, or their calls are out of step; the process group cannot be "
                f"used again ({type(exc).__name__}: {str(exc)[:300]})"
            ) from exc
        return super()._own_failure(exc)

    def _release(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.thread.close()

    # ----------------------------------------------------------------- calls
    async def _compute_logprobs(self, req: ComputeLogprobs) -> Result:
        if req.policy == "reference":
            method = self._reference
            if method is None:
                raise ProtocolError(f"training backend {type(self.backend).__name__} has no "
                                    "reference policy (no reference_logprobs)")  # fmt: skip
        elif req.policy == "current" or (req.policy == "sent" and self._sent is None):
            method = self.backend.compute_logprobs
        elif req.policy == "sent":
            method = functools.partial(self._sent, dtype=self.wctx.config.model.dtype)
        else:
            raise ProtocolError(
                f"ComputeLogprobs.policy {req.policy!r}: current, sent or reference"
            )
        if req.job and req.policy != "reference":  # the reference is the base: every job's
            method = functools.partial(method, **self._of_job(req.job, "logprobs"))
        lp = await self.thread.run(method, req.batch, req.temperature)
        return LogprobsResult(logprobs=lp)

    async def _begin_step(self, req: BeginStep) -> Result:
        begin = functools.partial(self.backend.begin_step, **self._of_job(req.job, "a step"))
        await self.thread.run(begin, req.step)
        return Empty()

    async def _train_chunk(self, req: TrainChunk) -> Result:
        chunk = functools.partial(self.backend.train_chunk, **self._of_job(req.job, "a chunk"))
        return await self.thread.run(chunk, req.step, req.batch)

    async def _finish_step(self, req: FinishStep) -> Result:
        keywords = self._of_job(req.job, "a step")
        if req.normalizer:  # else token-mean: the call every backend implements
            keywords["normalizer"] = req.normalizer
        finish = functools.partial(self.backend.finish_step, **keywords)
        return await self.thread.run(finish, req.step, req.num_loss_tokens)

    async def _open_job(self, req: OpenJob) -> Result:
        self._of_job(req.job, "OpenJob")
        assert self._jobs is not None
        opening = functools.partial(self._jobs[0], seed=req.seed, lr=req.lr)
        await self.thread.run(opening, req.job)
        return Empty()

    async def _close_job(self, req: CloseJob) -> Result:
        self._of_job(req.job, "CloseJob")
        assert self._jobs is not None
        await self.thread.run(self._jobs[1], req.job)
        return Empty()

    def _of_job(self, job: str, what: str) -> dict[str, str]:
        """The keywords that name ``job`` to the backend (none for the run's own).

        Raises:
            ProtocolError: a job, and the backend trains one policy only (no ``TrainsJobs``)."""
        if not job:
            return {}
        if self._jobs is None:
            raise ProtocolError(
                f"job {job!r} ({what}): training backend {self.wctx.config.trainer.backend!r} "
                "trains one policy only (it has no open_job: asyncrl.plugin.backend.TrainsJobs). "
                "Run jobs on a backend that trains them (fsdp2)"
            )
        return {"job": job}

    async def _calibrate_kv(self, req: CalibrateKV) -> Result:
        if self._calibrate is None:
            raise ProtocolError(
                f"training backend {type(self.backend).__name__} cannot calibrate FP8 KV-cache "
                "scales (it has no calibrate_kv_scales)"
            )
        calibrate = functools.partial(
            self._calibrate, req.batch,
            percentile=req.percentile, margin=req.margin, include_q=req.include_q,
        )
        scales = await self.thread.run(calibrate)
        return KVScalesResult(scales={k: float(v) for k, v in scales.items()})

    async def _send_weights(self, req: SendWeights) -> Result:
        of_job = self._of_job(req.job, "a refit")
        it = await self.thread.run(functools.partial(self.backend.iter_weights, **of_job))
        if self.wctx.rank != 0:  # take part in the gathers, send nothing
            await self.thread.run(drain_weights, it)
            return Empty()
        try:
            return await self._publish(req, it, of_job)
        except Exception:
            # the other ranks gather with this one (an FSDP unit's all-gather): finish the
            # iteration, or they wait in a collective until its timeout
            await self.thread.run(functools.partial(drain_weights, it, after_failure=True))
            raise

    async def _publish(
        self, req: SendWeights, it: Iterator[Any], of_job: dict[str, str]
    ) -> Result:
        """Rank 0: send the version ``it`` yields to the rollout workers.

        Raises:
            ProtocolError: the call names another transfer than this trainer stages for.
        """
        assert self.sender is not None
        if req.transport != self.sender.transfer.name:
            raise ProtocolError(
                f"SendWeights over {req.transport!r}, but this trainer stages for "
                f"{self.sender.transfer.name!r}"
            )
        specs = await self.thread.run(functools.partial(self.backend.weight_specs, **of_job))
        return await self.sender.send(
            req.version,
            list(req.receivers),
            specs,
            it,
            bucket_size=req.bucket_size_bytes,
            timeout_s=req.timeout_s,
            run=self.thread.run,
            pids=req.receiver_pids,
            hosts=req.receiver_hosts,
        )

    async def _receiver_gone(self, req: ReceiverGone) -> Result:
        """Rank 0: a refit under way leaves ``req.receiver`` out (other ranks send nothing)."""
        if self.sender is not None:
            self.sender.leave(req.receiver, "the controller found it dead")
        return Empty()

    async def _save_state(self, req: SaveState) -> Result:
        save = functools.partial(self.backend.save_state, **self._of_job(req.job, "a save"))
        await self.thread.run(save, req.path)
        return Empty()

    async def _load_state(self, req: LoadState) -> Result:
        load = functools.partial(self.backend.load_state, **self._of_job(req.job, "a load"))
        await self.thread.run(load, req.path)
        return Empty()

    async def _move_state(self, req: MoveState) -> Result:
        """The optimizer state to host memory or back (``cluster.placement = "take_turns"``).

        Raises:
            PluginError: the backend cannot (it has no :class:`~asyncrl.backend.StateOffload`).
        """
        if self._state_moves is None:
            raise self._cannot_offload()
        if req.to not in ("host", "device"):
            raise ValueError(f"MoveState.to must be 'host' or 'device', got {req.to!r}")
        start = time.perf_counter()
        moved = await self.thread.run(self._state_moves[req.to == "device"])
        return TurnResult(seconds=time.perf_counter() - start, moved_bytes=int(moved))

    def _cannot_offload(self) -> PluginError:
        return PluginError(
            f"training backend {self.wctx.config.trainer.backend!r} cannot move its state "
            "to host memory (no state_to_host / state_to_device). Fix: set "
            "cluster.trainer_offload = \"never\", or use a backend that can (fsdp2, deepspeed)"
        )

    async def _export(self, req: ExportModel) -> Result:
        config = self.wctx.config
        adapter = config.lora.peft_config(config.model.path) if config.lora.enabled else None
        export = functools.partial(
            export_model, self.backend, self.wctx.rank, req.path,
            source_dir=req.source_dir, shard_bytes=req.shard_bytes, adapter_config=adapter,
        )
        await self.thread.run(export)
        return Empty()


LOSS_INPUT_FIELDS = ("proximal_logprobs", "reference_logprobs")
"""The optional :class:`~asyncrl.wire.messages.TrainBatch` fields a backend's ``loss_inputs``
may list (:class:`~asyncrl.backend.ReadsLossInputs`)."""


def _loss_inputs(value: Any, plugin: str) -> frozenset[str]:
    """A backend's ``loss_inputs`` (``None``: it has none) as a set of field names.

    Raises:
        PluginError: not a set, frozenset, list or tuple of strings (a bare string, say), or a
            name that is none of :data:`LOSS_INPUT_FIELDS` (with a did-you-mean).
    """
    if value is None:
        return frozenset()
    where = f"training backend {plugin!r} (asyncrl.training_backends): its loss_inputs"
    fix = ("Fix: list the fields its train_chunk reads, e.g. loss_inputs = "
           f"frozenset({{{LOSS_INPUT_FIELDS[0]!r}}}) (asyncrl.backend.ReadsLossInputs)")
    if not isinstance(value, (set, frozenset, list, tuple)) or not all(
        isinstance(v, str) for v in value
    ):
        names = ", ".join(LOSS_INPUT_FIELDS)
        raise PluginError(f"{where} must be a set of field names ({names}), got {value!r} "
                          f"(a {type(value).__name__}). {fix}")  # fmt: skip
    unknown = [v for v in value if v not in LOSS_INPUT_FIELDS]
    if unknown:
        near = did_you_mean(unknown[0], LOSS_INPUT_FIELDS)
        raise PluginError(f"{where} names {unknown[0]!r}{near}, which is no optional TrainBatch "
                          f"field (those are {', '.join(LOSS_INPUT_FIELDS)}). {fix}")  # fmt: skip
    return frozenset(value)


def _takes(method: Callable[..., Any], keyword: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``keyword``."""
    params = inspect.signature(method).parameters.values()
    return any(p.name == keyword and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
               or p.kind is p.VAR_KEYWORD for p in params)  # fmt: skip
