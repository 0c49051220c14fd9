"""Weight refit: trainer rank 0 streams a weight version to every generator over ZeroMQ
ipc://, in buckets staged by a weight transfer plugin (:mod:`asyncrl.transfers`).

The controller only says "version v" to both sides and waits for both to answer::

    trainer rank 0 (ROUTER, bound)                rollout rank r (DEALER, connected)
        ◄──────────── WeightsPull(v) ─────────────
        ───────────── Manifest(v, entries) ──────►  backend.begin_weight_update(v, manifest, kv)
        ◄──────────── BucketAck(v, -1) ───────────  (checked against the model: nothing
    pack staging buffer A                             is touched if it does not match)
        ───────────── Bucket(v, 0, handle A) ────►  backend.load_weight_bucket(A)
    pack buffer B (overlaps the load of A)
        ◄──────────── BucketAck(v, 0) ────────────
        ───────────── Bucket(v, 1, B, last) ─────►  backend.load_weight_bucket(B)
        ◄──────────── BucketAck(v, 1) ────────────  backend.finish_weight_update(v)

The staging buffers (:data:`asyncrl.transfers.STAGING_BUFFERS`, two) are used in turn, so the
trainer packs bucket k+1 while generators load bucket k; a buffer is rewritten only after
every receiver acknowledged its bucket, so n buffers let the trainer run up to n - 1 buckets
ahead of the slowest generator. Each bucket's entries
must be the next ones of the manifest (same names, dtypes and shapes, inside the bucket) or the
receiver refuses it before loading (the layout and its checks, pure, are
:mod:`asyncrl.worker.buckets`). Every wait is bounded by ``refit.timeout_s``.

On a failure the receiver acknowledges with the error and calls
``backend.abort_weight_update``: a generator that has not loaded any bucket resumes on its
previous weights; one that has stays paused (its weights are mixed). The sender raises
:class:`~asyncrl.errors.RefitError` with the receiver's reason, and the run stops with it.
A receiver whose engine died (the backend raised a :class:`~asyncrl.errors.WorkerError`)
refuses nothing: its worker exits, and the sender, watching the receivers' processes, leaves
it out (it is restarted and refitted on its own under ``failures.rollout_restarts``).

The sender's socket accepts only the receivers named for the refit: an undecodable frame, a
frame from another peer, or a message of another version is rejected and counted (socket
``weights``, reported in ``WeightsResult.rejected_frames``), never fatal.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import anyio
import structlog

from asyncrl.backend import GenerationBackend, WeightBucketView, WeightTensor
from asyncrl.wire.codec import Codec
from asyncrl.errors import ProtocolError, RefitError, WorkerError
from asyncrl.wire.messages import (
    Bucket,
    BucketAck,
    Manifest,
    TensorEntry,
    WeightMessage,
    WeightsPull,
    WeightsResult,
)
from asyncrl.procs.process import host_id, wait_pid_exit
from asyncrl.transfers import Receiver, StagingSpec, WeightTransfer
from asyncrl.wire.transport import (
    DEALER,
    ROUTER,
    AsyncSocket,
    Context,
    PeerGone,
    Rejections,
    peer_name,
)
from asyncrl.worker.buckets import DTYPE_SIZES, BucketArrivals, Packer, check_bucket, manifest_of

# DTYPE_SIZES and check_bucket live in asyncrl.worker.buckets; they stay importable from here
__all__ = ["DTYPE_SIZES", "WeightReceiver", "WeightSender", "check_bucket"]

log = structlog.get_logger("asyncrl.worker.weights")


class _Owed:
    """Who still owes which answer in one refit (trainer side), and the bounded wait for it.
    Keys: ``"pull"``, then -1 (the manifest), then each bucket's index. ``recv`` is the
    sender's ``_recv``, ``reject`` its ``Rejections.reject``, ``gone`` its stager's
    ``leave`` (told of each receiver left out)."""

    def __init__(
        self, recv: Callable[[set[str], int], Awaitable[tuple[str, Any]]],
        reject: Callable[[str, str, str], None], version: int, receivers: Sequence[str],
        timeout_s: float, gone: Callable[[str], None] = lambda who: None,
    ) -> None:
        self._recv, self._reject, self._timeout_s = recv, reject, timeout_s
        self._gone = gone
        self.version = version
        self._expected = set(receivers)
        self._live = list(receivers)  # those still running: shrinks when one exits
        self._outstanding: dict[str | int, set[str]] = {"pull": set(receivers)}
        self._waiting: list[anyio.CancelScope] = []

    def live(self) -> list[str]:
        """The receivers still running, now (a copy: a watcher may leave one out later)."""
        return list(self._live)

    def is_live(self, who: str) -> bool:
        """Whether receiver ``who`` is still running (not left out by its watcher)."""
        return who in self._live

    def expect(self, key: int) -> None:
        """Note that every live receiver owes an answer to ``key`` (about to be sent)."""
        self._outstanding[key] = set(self._live)

    async def watch(self, who: str, pid: int) -> None:
        """Once receiver ``who``'s process ``pid`` exits, leave it out: it owes nothing more.
        Cancellation: stops watching."""
        await wait_pid_exit(pid)
        self.leave(who, f"its process {pid} exited")

    def leave(self, who: str, why: str) -> None:
        """Leave receiver ``who`` out (it is gone: ``why``); it owes nothing more. Idempotent."""
        if who not in self._live:
            return
        log.warning("receiver_gone", receiver=who, why=why, version=self.version)
        self._live.remove(who)
        self._gone(who)
        for owed in self._outstanding.values():
            owed.discard(who)
        for scope in self._waiting:
            scope.cancel()  # settle() looks again at what is still owed

    async def settle(self, key: str | int, what: str) -> None:
        """Wait (bounded) until every live receiver has answered ``key`` (``what`` in errors).
        Raises RefitError if one refused something or did not answer in time. Cancellation:
        stops waiting; the answers still owed are left unread."""
        version = self.version
        with anyio.move_on_after(self._timeout_s) as scope:
            while self._outstanding.get(key):
                with anyio.CancelScope() as wait:
                    self._waiting.append(wait)
                    try:
                        who, msg = await self._recv(self._expected, version)
                    finally:
                        self._waiting.remove(wait)
                if wait.cancelled_caught:
                    continue
                got = "pull" if isinstance(msg, WeightsPull) else getattr(msg, "index", None)
                if who not in self._outstanding.get(got, ()):
                    self._reject("weights", who, f"unexpected {type(msg).__name__}")
                    continue
                if getattr(msg, "error", None):
                    name = "the manifest" if got == -1 else f"bucket {got}"
                    raise RefitError(f"{who} refused {name} of v{version}: {msg.error}")
                self._outstanding[got].discard(who)
        if scope.cancelled_caught:
            late = ", ".join(sorted(self._outstanding[key]))
            raise RefitError(
                f"{late} did not answer {what} of v{version} within {self._timeout_s:.0f} s "
                "(refit.timeout_s)"
            )
        del self._outstanding[key]


class WeightSender:
    """Trainer rank 0's end: a bound ROUTER plus the transfer's staging buffers
    (``spec.buffers``, filled in turn).

    Args:
        ctx: the worker's ZeroMQ context.
        address: where to bind (``ipc://…``, or ``tcp://host:*``: then :attr:`endpoint`
            says the port), announced to the controller.
        transfer: the weight transfer plugin (``refit.transport``).
        spec: where to stage (run id, rank, the trainer's device).
    """

    def __init__(
        self, ctx: Context, address: str, transfer: WeightTransfer, spec: StagingSpec
    ) -> None:
        self.transfer = transfer
        self._buffers = spec.buffers
        self._sock: AsyncSocket = ctx.socket(ROUTER, bind=address, router_mandatory=True)
        self._codec = Codec(WeightMessage)
        self.rejections = Rejections()
        self._owed: _Owed | None = None
        """The refit under way (:meth:`send`), while it is."""
        try:
            self._stager = transfer.stager(spec)
        except BaseException:
            self._sock.close()
            raise

    @property
    def endpoint(self) -> str:
        """The address the weights socket is bound to."""
        return self._sock.last_endpoint

    async def _recv(self, receivers: set[str], version: int) -> tuple[str, Any]:
        """The next message of this refit from one of ``receivers``; anything else is
        rejected and counted."""
        while True:
            frames = await self._sock.recv()
            who = peer_name(frames[0].buffer)
            try:
                msg = self._codec.decode(frames[1:])
            except ProtocolError as exc:
                self.rejections.reject("weights", who, str(exc))
                continue
            if who not in receivers:
                self.rejections.reject("weights", who, f"{type(msg).__name__} from a non-receiver")
            elif getattr(msg, "version", None) != version or isinstance(msg, (Bucket, Manifest)):
                self.rejections.reject(
                    "weights", who, f"{type(msg).__name__} of v{getattr(msg, 'version', '?')} "
                    f"during the refit to v{version}"
                )
            else:
                return who, msg

    async def _send_all(self, owed: _Owed, msg: Any) -> None:
        """Send ``msg`` to every receiver still live when its turn comes."""
        frames = self._codec.encode(msg)
        # Over a copy, each checked again just before its send: a watcher may leave a
        # receiver out while a send awaits. Walking the live list itself would then skip the
        # receiver after a removed one (never sent this message, it would be waited for until
        # refit.timeout_s); and one already left out is sent nothing more (its peer is gone).
        # A receiver whose socket closed before its process exit was seen (SIGKILL, or its
        # teardown) is gone too: the send says so at once.
        for r in owed.live():
            if owed.is_live(r):
                try:
                    await self._sock.send([r.encode(), *frames])
                except PeerGone:
                    owed.leave(r, "its socket is closed")

    async def send(
        self,
        version: int,
        receivers: list[str],
        specs: Sequence[WeightTensor],
        tensors: Iterable[WeightTensor],
        *,
        bucket_size: int,
        timeout_s: float,
        run: Callable[..., Awaitable[Any]] = anyio.to_thread.run_sync,
        pids: Sequence[int] = (),
        hosts: Sequence[str] = (),
    ) -> WeightsResult:
        """Publish ``tensors`` (exactly ``specs``, in order) to all ``receivers``.

        ``pids``: the receivers' processes (same order), each on its host of ``hosts``
        (:func:`~asyncrl.procs.process.host_id`; none given or ``""``: this one). One on this host
        that exits is left out from then on (its acknowledgements are owed no more): a
        rollout worker that died mid-refit is restarted and refitted on its own, the others
        get the version. Another host's pid names nothing here: not watched.

        ``run(fn, *args)`` runs blocking work where ``tensors`` may be advanced: the trainer's
        own thread (a training backend is called from one thread only). Each call fills one
        bucket: the trainer's tensors are packed the moment they are yielded, so a sharded
        trainer may free a gathered tensor as soon as it moves on.

        Raises:
            RefitError: a receiver refused the manifest or a bucket, failed to load, or did not
                answer within ``timeout_s``; or the trainer yielded other tensors than
                ``specs`` promised.

        Cancellation: abandons the transfer; receivers time out on their side.
        """
        start = time.perf_counter()
        owed = _Owed(self._recv, self.rejections.reject, version, receivers, timeout_s,
                     gone=self._stager.leave)  # fmt: skip
        self._owed = owed
        own = host_id()
        hosts = list(hosts) or [own] * len(receivers)
        pids = list(pids) or [0] * len(receivers)
        where = {who: Receiver(who, host, pid) for who, host, pid in zip(receivers, hosts, pids)}
        try:
            async with anyio.create_task_group() as watchers:
                for who, host, pid in zip(receivers, hosts, pids):
                    if pid and host in (own, ""):  # "": not known, taken as this host
                        watchers.start_soon(owed.watch, who, pid)
                result = await self._publish(
                    owed, specs, tensors, bucket_size=bucket_size, run=run, where=where
                )
                watchers.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _first_refit_error(group) from None
        finally:
            self._owed = None
        result.seconds = time.perf_counter() - start
        return result

    def leave(self, who: str, why: str) -> None:
        """Receiver ``who`` is gone (``why``): the refit under way, if any, leaves it out
        (its acknowledgements are owed no more; a collective transfer fails what it has under
        way, :meth:`~asyncrl.transfers.Stager.leave`). Nothing under way: nothing to do."""
        if self._owed is not None:
            self._owed.leave(who, why)

    async def _publish(
        self, owed: _Owed, specs: Sequence[WeightTensor], tensors: Iterable[WeightTensor],
        *, bucket_size: int, run: Callable[..., Awaitable[Any]], where: dict[str, Receiver],
    ) -> WeightsResult:
        """The transfer itself, to the live receivers (``owed.live()``: one that exits is
        left out) once they pulled: the manifest, then the buckets through the staging
        buffers in turn, each refilled only once every receiver acknowledged its bucket.
        ``where``: each receiver's host and process (the transfer may route by them)."""
        await owed.settle("pull", "the pull")
        version, n = owed.version, self._buffers
        manifest = manifest_of(specs)
        owed.expect(-1)
        await self._send_all(owed, Manifest(version, self.transfer.name, manifest))
        live = owed.live()
        self._stager.begin([where[r] for r in live])
        packer = Packer(iter(tensors), manifest, self._stager, bucket_size, n)
        first = await self._pack_first(owed, packer, run)
        index = 0
        while True:
            cur = index % n
            if index >= n:  # buffer `cur` held bucket index-n: free before we refill it
                await owed.settle(index - n, f"bucket {index - n}")
            entries, used, last = first if index == 0 else await run(packer.fill, cur)
            handle = self._stager.handle(cur)
            owed.expect(index)
            await self._send_all(owed, Bucket(version, index, handle, used, entries, last))
            index += 1
            if last:
                break
        for i in range(max(0, index - n), index):
            await owed.settle(i, f"bucket {i}")
        return WeightsResult(
            version=version, num_tensors=packer.count, num_bytes=packer.nbytes,
            num_buckets=index, seconds=0.0, rejected_frames=self.rejections.total,
            pack_s=packer.seconds,
        )

    async def _pack_first(
        self, owed: _Owed, packer: Packer, run: Callable[..., Awaitable[Any]]
    ) -> tuple[list[TensorEntry], int, bool]:
        """Pack the first bucket (buffer 0) while the receivers check the manifest and pause;
        it is sent only once all accepted it. Returns its entries, bytes used, and last."""
        first: list[tuple[list[TensorEntry], int, bool]] = []

        async def pack() -> None:
            first.append(await run(packer.fill, 0))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pack)
                await owed.settle(-1, "the manifest")
        except BaseExceptionGroup as group:
            raise _first_refit_error(group) from None
        return first[0]

    def close(self) -> None:
        self._stager.close()
        self._sock.close()


class WeightReceiver:
    """A rollout worker's end: one DEALER connected to the trainer's transfer socket."""

    def __init__(self, ctx: Context, address: str, identity: str) -> None:
        self._identity = identity
        self._sock = ctx.socket(DEALER, connect=address, identity=identity)
        self._codec = Codec(WeightMessage)
        self.address = address

    async def _next(self, version: int, timeout_s: float) -> Any:
        with anyio.move_on_after(timeout_s) as scope:
            frames = await self._sock.recv()
        if scope.cancelled_caught:
            raise RefitError(
                f"nothing from the trainer at {self.address} within {timeout_s:.0f} s "
                "(refit.timeout_s); is the trainer alive?"
            )
        msg = self._codec.decode(frames)
        if getattr(msg, "version", None) != version:
            raise RefitError(f"unexpected {type(msg).__name__} during the refit to v{version}")
        return msg

    async def _ack(self, version: int, index: int, error: str | None = None) -> None:
        await self._sock.send(self._codec.encode(BucketAck(version, index, self._identity, error)))

    async def receive(
        self,
        version: int,
        backend: GenerationBackend,
        *,
        transport: str,
        reset_prefix_cache: bool,
        kv_scales: dict[str, float] | None,
        timeout_s: float,
        reprefill: Callable[[], Awaitable[None]] | None = None,
        job: str = "",
    ) -> WeightsResult:
        """Pull version ``version`` and load it into ``backend``; with ``reprefill`` (the
        backend's ``reprefill_in_flight``), make the requests in flight recompute their KV
        cache with the new weights before generation resumes. With ``job`` the version is that
        job's adapter (the backend :class:`~asyncrl.backend.ServesJobs`).

        Raises:
            RefitError: the sender went silent, sent something else than the protocol says,
                or the manifest, a bucket or a load failed (the sender is told why).

        Cancellation: the engine may hold a partial load; the run is expected to stop.
        """
        start = time.perf_counter()
        of_job = {"job": job} if job else {}
        arrivals = await self._begin(version, backend, transport, kv_scales, timeout_s, of_job)
        try:
            await self._stream(backend, arrivals, version, timeout_s)
        except BaseException:
            # the error that stopped the refit is what the worker reports, not the abort's
            with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
                try:
                    await backend.abort_weight_update(
                        version, loaded_any=arrivals.buckets > 0, **of_job
                    )
                except Exception as exc:  # noqa: BLE001 - e.g. the engine died meanwhile
                    log.warning("weight_update_abort_failed", version=version, error=str(exc))
            raise
        if reprefill is not None:
            await reprefill()
        await backend.finish_weight_update(
            version, reset_prefix_cache=reset_prefix_cache, **of_job
        )
        return WeightsResult(
            version=version, num_tensors=arrivals.tensors, num_bytes=arrivals.nbytes,
            num_buckets=arrivals.buckets, seconds=time.perf_counter() - start,
        )

    async def _begin(
        self, version: int, backend: GenerationBackend, transport: str,
        kv_scales: dict[str, float] | None, timeout_s: float, of_job: dict[str, str],
    ) -> BucketArrivals:
        """Pull ``version``, check its manifest, have ``backend`` begin the update, and
        acknowledge the manifest (with the reason if it does not fit). Raises as
        :meth:`receive` says; a WorkerError (the engine died) goes unrefused."""
        await self._sock.send(self._codec.encode(WeightsPull(version, self._identity)))
        manifest = await self._next(version, timeout_s)
        if not isinstance(manifest, Manifest):
            raise RefitError(f"expected the manifest of v{version}, got {type(manifest).__name__}")
        try:
            arrivals = BucketArrivals(manifest, transport)
            await backend.begin_weight_update(
                version, list(manifest.entries), kv_scales=kv_scales, **of_job
            )
        except WorkerError:
            raise  # the engine died: no refusal, this worker exits and the sender leaves it out
        except Exception as exc:
            await self._ack(version, -1, f"{type(exc).__name__}: {exc}")
            raise RefitError(f"the weights of v{version} do not fit this generator: {exc}") from exc
        await self._ack(version, -1)
        return arrivals

    async def _stream(
        self, backend: GenerationBackend, arrivals: BucketArrivals, version: int, timeout_s: float
    ) -> None:
        """Take the buckets of ``version`` in order until the last, each checked by
        ``arrivals`` and loaded by its own task (loads overlap, acknowledgements go in order:
        see :meth:`_load`). Raises as :meth:`receive` says (a WorkerError goes unrefused).
        Cancellation: cancels the loads under way."""
        try:
            async with anyio.create_task_group() as loads:
                previous: anyio.Event | None = None
                while True:
                    msg = await self._next(version, timeout_s)
                    try:
                        view = arrivals.take(msg)
                    except ValueError as exc:
                        if previous is not None:
                            await previous.wait()  # acknowledgements go in order
                        await self._ack(version, msg.index, f"{type(exc).__name__}: {exc}")
                        raise RefitError(f"bucket {msg.index} of v{version}: {exc}") from exc
                    finished = anyio.Event()
                    loads.start_soon(self._load, backend, view, previous, finished)
                    previous = finished
                    if view.last:
                        break
        except BaseExceptionGroup as group:
            raise _first_refit_error(group) from None
        arrivals.check_complete()

    async def _load(
        self,
        backend: GenerationBackend,
        view: WeightBucketView,
        previous: anyio.Event | None,
        finished: anyio.Event,
    ) -> None:
        """Load one bucket, then acknowledge it once the bucket before it was (loads may
        overlap: the next bucket's load is queued in the engine while this one runs, which hides
        one engine round trip per bucket; the sender's staging buffers bound how many are in
        flight)."""
        error: Exception | None = None
        try:
            await backend.load_weight_bucket(view)
        except WorkerError:
            raise  # the engine died: no refusal (see receive)
        except Exception as exc:
            error = exc
        if previous is not None:
            await previous.wait()
        if error is not None:
            await self._ack(view.version, view.index, f"{type(error).__name__}: {error}")
            raise RefitError(f"bucket {view.index} of v{view.version}: {error}") from error
        await self._ack(view.version, view.index)
        finished.set()

    def close(self) -> None:
        self._sock.close()


def _first_refit_error(group: BaseExceptionGroup) -> BaseException:
    """The error a failed set of bucket loads stands for: the first RefitError in it."""
    from asyncrl.errors import flatten

    leaves = flatten(group)
    for leaf in leaves:
        if isinstance(leaf, RefitError):
            return leaf
    return leaves[0]
