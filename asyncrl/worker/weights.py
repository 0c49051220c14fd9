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

The staging buffers (``refit.staging_buffers``, two by default) are used in turn, so the
trainer packs bucket k+1 while generators load bucket k; a buffer is rewritten only after
every receiver acknowledged its bucket, so n buffers let the trainer run up to n - 1 buckets
ahead of the slowest generator. Each bucket's entries
must be the next ones of the manifest (same names, dtypes and shapes, inside the bucket) or the
receiver refuses it before loading. Every wait is bounded by ``refit.timeout_s``.

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

import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
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
from asyncrl.procs.process import wait_pid_exit
from asyncrl.transfers import StagingSpec, WeightTransfer
from asyncrl.wire.transport import DEALER, ROUTER, AsyncSocket, Context, Rejections, peer_name

__all__ = ["DTYPE_SIZES", "WeightReceiver", "WeightSender", "check_bucket"]

log = structlog.get_logger("asyncrl.worker.weights")
ALIGN = 256

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
"""Bytes per element of the dtypes a weight may have (torch names without ``torch.``)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(entry: TensorEntry) -> int:
    return math.prod(entry.shape) * DTYPE_SIZES[entry.dtype]


def check_manifest(entries: Sequence[TensorEntry]) -> None:
    """Raise ``ValueError`` for a manifest no model could accept (a duplicate name, an unknown
    dtype, a negative dimension): the wire check; the backend checks names and shapes."""
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ValueError(f"the manifest names {e.name!r} twice")
        seen.add(e.name)
        if e.dtype not in DTYPE_SIZES:
            raise ValueError(f"{e.name}: unknown dtype {e.dtype!r}")
        if any(d < 0 for d in e.shape):
            raise ValueError(f"{e.name}: negative dimension in {e.shape}")


def check_bucket(bucket: Bucket, manifest: Sequence[TensorEntry], start: int) -> None:
    """Raise ``ValueError`` unless ``bucket.entries`` are ``manifest[start:]``'s next entries
    (same names, dtypes, shapes), each of its exact size, inside the bucket, not overlapping."""
    end = 0
    for i, e in enumerate(bucket.entries):
        if start + i >= len(manifest):
            raise ValueError(f"bucket {bucket.index}: {e.name} is beyond the manifest's end")
        want = manifest[start + i]
        if (e.name, e.dtype, list(e.shape)) != (want.name, want.dtype, list(want.shape)):
            raise ValueError(
                f"bucket {bucket.index}: got {e.name} {e.dtype}{list(e.shape)} where the manifest "
                f"has {want.name} {want.dtype}{list(want.shape)}"
            )
        if e.nbytes != _nbytes(want):
            raise ValueError(
                f"bucket {bucket.index}: {e.name} has {e.nbytes} bytes, not {_nbytes(want)}"
            )
        if e.offset < end or e.offset + e.nbytes > bucket.nbytes:
            raise ValueError(
                f"bucket {bucket.index}: {e.name} at {e.offset}+{e.nbytes} overlaps another "
                f"tensor or lies outside the {bucket.nbytes}-byte bucket"
            )
        end = e.offset + e.nbytes


def _manifest(specs: Sequence[WeightTensor]) -> list[TensorEntry]:
    return [TensorEntry(t.name, t.dtype, list(t.shape), 0, 0) for t in specs]


def bucket_ends(sizes: Sequence[int], bucket_size: int) -> list[int]:
    """The bytes each bucket of a refit uses (what its ``Bucket.nbytes`` says), for tensors of
    ``sizes`` (in order) packed ``ALIGN``-aligned: a bucket closes before the tensor that would
    take it past ``bucket_size``; a larger tensor travels alone in a bucket of its size."""
    ends: list[int] = []
    used = count = 0
    for size in sizes:
        if count and used + size > bucket_size:
            ends.append(used)
            used = count = 0
        used += _align(size)
        count += 1
    if count:
        ends.append(used)
    return ends


class _Packer:
    """Fills staging buffers from the trainer's iterator (runs in the trainer's thread)."""

    def __init__(
        self,
        tensors: Iterator[WeightTensor],
        manifest: list[TensorEntry],
        stager: Any,
        bucket_size: int,
        buffers: int = 2,
    ) -> None:
        self._it = tensors
        self._manifest = manifest
        self._stager = stager
        self._bucket_size = bucket_size
        self._carry: WeightTensor | None = None
        self.count = 0
        self.nbytes = 0
        self.seconds = 0.0
        self._sizes = [_nbytes(e) for e in manifest]
        # each buffer is sized once, for the largest bucket it will hold in this version (a
        # small model gets small buffers; the sizes, hence the handles, stay the same from one
        # refit to the next, so a reader's per-bucket plans stay valid)
        ends = bucket_ends(self._sizes, bucket_size)
        self._buffer_sizes = [max(ends[k::buffers], default=0) for k in range(buffers)]

    def _next(self) -> WeightTensor | None:
        if self._carry is not None:
            t, self._carry = self._carry, None
            return t
        t = next(self._it, None)
        if t is None:
            return None
        i = self.count
        want = self._manifest[i] if i < len(self._manifest) else None
        if want is None or (t.name, t.dtype, list(t.shape)) != (
            want.name, want.dtype, list(want.shape)
        ):
            raise RefitError(
                f"the trainer yielded {t.name} {t.dtype}{list(t.shape)} as tensor {i}, but its "
                "weight_specs() promised "
                + (f"{want.name} {want.dtype}{list(want.shape)}" if want else "no more")
            )
        if t.data is None:
            raise RefitError(f"trainer rank 0 got no data for {t.name}")
        got_bytes = int(getattr(t.data, "nbytes", -1))
        is_torch = hasattr(t.data, "element_size")  # numpy data is raw uint8 bytes
        torch_dtype = str(getattr(t.data, "dtype", "")).removeprefix("torch.")
        if got_bytes != self._sizes[i] or (is_torch and torch_dtype != t.dtype):
            raise RefitError(
                f"the trainer yielded {t.name} as {t.dtype}{list(t.shape)} "
                f"({self._sizes[i]} bytes) with data of {got_bytes} bytes"
                + (f" in {torch_dtype}" if is_torch else "")
            )
        return t

    def fill(self, k: int) -> tuple[list[TensorEntry], int, bool]:
        """Pack buffer ``k`` up to the bucket size (a larger tensor travels alone in a bucket
        of its size). Returns its entries, bytes used, and whether it is the last bucket."""
        start = time.perf_counter()
        entries: list[TensorEntry] = []
        used = 0
        self._stager.reserve(k, self._buffer_sizes[k])
        while (t := self._next()) is not None:
            size = self._sizes[self.count]  # checked against the data in _next
            if entries and used + size > self._bucket_size:
                self._carry = t  # not advanced past it: a sharded trainer still holds it
                break
            self._stager.pack(k, used, t.data, t.stable)
            entries.append(TensorEntry(t.name, t.dtype, list(t.shape), used, size))
            used += _align(size)
            self.count += 1
            self.nbytes += size
        self._stager.seal(k)
        self.seconds += time.perf_counter() - start
        last = self._carry is None
        if last and self.count != len(self._manifest):
            raise RefitError(
                f"the trainer yielded {self.count} tensors; weight_specs() promised "
                f"{len(self._manifest)}"
            )
        return entries, used, last


class WeightSender:
    """Trainer rank 0's end: a bound ROUTER plus the transfer's staging buffers
    (``spec.buffers``, filled in turn).

    Args:
        ctx: the worker's ZeroMQ context.
        address: where to bind (``ipc://…``), announced to the controller.
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
        try:
            self._stager = transfer.stager(spec)
        except BaseException:
            self._sock.close()
            raise

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

    async def _send_all(self, receivers: Sequence[str], msg: Any) -> None:
        frames = self._codec.encode(msg)
        for r in receivers:
            await self._sock.send([r.encode(), *frames])

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
    ) -> WeightsResult:
        """Publish ``tensors`` (exactly ``specs``, in order) to all ``receivers``.

        ``pids``: the receivers' processes (same order, same host). One that exits is left
        out from then on (its acknowledgements are owed no more): a rollout worker that died
        mid-refit is restarted and refitted on its own, the others get the version.

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
        expected = set(receivers)
        live = list(receivers)
        # who still owes what: "pull", then -1 (the manifest), then each bucket's index
        outstanding: dict[str | int, set[str]] = {"pull": set(receivers)}
        waiting: list[anyio.CancelScope] = []

        async def watch(who: str, pid: int) -> None:
            await wait_pid_exit(pid)
            log.warning("receiver_gone", receiver=who, pid=pid, version=version)
            live.remove(who)
            for owed in outstanding.values():
                owed.discard(who)
            for scope in waiting:
                scope.cancel()  # settle() looks again at what is still owed

        async def settle(key: str | int, what: str) -> None:
            """Wait (bounded) until every receiver has answered ``key``."""
            with anyio.move_on_after(timeout_s) as scope:
                while outstanding.get(key):
                    with anyio.CancelScope() as wait:
                        waiting.append(wait)
                        try:
                            who, msg = await self._recv(expected, version)
                        finally:
                            waiting.remove(wait)
                    if wait.cancelled_caught:
                        continue
                    got = "pull" if isinstance(msg, WeightsPull) else getattr(msg, "index", None)
                    if who not in outstanding.get(got, ()):
                        self.rejections.reject("weights", who, f"unexpected {type(msg).__name__}")
                        continue
                    if getattr(msg, "error", None):
                        name = "the manifest" if got == -1 else f"bucket {got}"
                        raise RefitError(f"{who} refused {name} of v{version}: {msg.error}")
                    outstanding[got].discard(who)
            if scope.cancelled_caught:
                late = ", ".join(sorted(outstanding[key]))
                raise RefitError(
                    f"{late} did not answer {what} of v{version} within {timeout_s:.0f} s "
                    "(refit.timeout_s)"
                )
            del outstanding[key]

        try:
            async with anyio.create_task_group() as watchers:
                for who, pid in zip(receivers, pids):
                    watchers.start_soon(watch, who, pid)
                result = await self._publish(version, live, specs, tensors, settle,
                                             outstanding, bucket_size=bucket_size, run=run)
                watchers.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _first_refit_error(group) from None
        result.seconds = time.perf_counter() - start
        return result

    async def _publish(
        self,
        version: int,
        receivers: list[str],
        specs: Sequence[WeightTensor],
        tensors: Iterable[WeightTensor],
        settle: Callable[[str | int, str], Awaitable[None]],
        outstanding: dict[str | int, set[str]],
        *,
        bucket_size: int,
        run: Callable[..., Awaitable[Any]],
    ) -> WeightsResult:
        """The transfer itself, to ``receivers`` (the live ones: the list shrinks when one
        exits), once they pulled; ``settle(key, what)`` waits until each answered ``key``."""
        await settle("pull", "the pull")
        manifest = _manifest(specs)
        outstanding[-1] = set(receivers)
        await self._send_all(receivers, Manifest(version, self.transfer.name, manifest))
        self._stager.begin(list(receivers))
        n = self._buffers
        packer = _Packer(iter(tensors), manifest, self._stager, bucket_size, n)
        first: list[tuple[list[TensorEntry], int, bool]] = []

        async def pack_first() -> None:
            first.append(await run(packer.fill, 0))

        # the first bucket is packed while the receivers check the manifest and pause; it is
        # sent only once all accepted it
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pack_first)
                await settle(-1, "the manifest")
        except BaseExceptionGroup as group:
            raise _first_refit_error(group) from None
        index = 0
        while True:
            cur = index % n
            if index >= n:  # buffer `cur` held bucket index-n: free before we refill it
                await settle(index - n, f"bucket {index - n}")
            entries, used, last = first.pop() if first else await run(packer.fill, cur)
            handle = self._stager.handle(cur)
            outstanding[index] = set(receivers)
            await self._send_all(receivers, Bucket(version, index, handle, used, entries, last))
            index += 1
            if last:
                break
        for i in range(max(0, index - n), index):
            await settle(i, f"bucket {i}")
        return WeightsResult(
            version=version,
            num_tensors=packer.count,
            num_bytes=packer.nbytes,
            num_buckets=index,
            seconds=0.0,
            rejected_frames=self.rejections.total,
            pack_s=packer.seconds,
        )

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
    ) -> WeightsResult:
        """Pull version ``version`` and load it into ``backend``.

        Raises:
            RefitError: the sender went silent, sent something else than the protocol says,
                or the manifest, a bucket or a load failed (the sender is told why).

        Cancellation: the engine may hold a partial load; the run is expected to stop.
        """
        start = time.perf_counter()
        await self._sock.send(self._codec.encode(WeightsPull(version, self._identity)))
        manifest = await self._next(version, timeout_s)
        if not isinstance(manifest, Manifest):
            raise RefitError(f"expected the manifest of v{version}, got {type(manifest).__name__}")
        try:
            if manifest.transport != transport:
                raise ValueError(
                    f"the trainer sends over {manifest.transport!r}, this run's refit.transport "
                    f"is {transport!r}"
                )
            check_manifest(manifest.entries)
            await backend.begin_weight_update(
                version, list(manifest.entries), kv_scales=kv_scales
            )
        except WorkerError:
            raise  # the engine died: no refusal, this worker exits and the sender leaves it out
        except Exception as exc:
            await self._ack(version, -1, f"{type(exc).__name__}: {exc}")
            raise RefitError(f"the weights of v{version} do not fit this generator: {exc}") from exc
        await self._ack(version, -1)
        done = n_bytes = n_buckets = 0
        loaded_any = False
        try:
            try:
                async with anyio.create_task_group() as loads:
                    previous: anyio.Event | None = None
                    while True:
                        msg = await self._next(version, timeout_s)
                        if not isinstance(msg, Bucket) or msg.index != n_buckets:
                            raise RefitError(
                                f"expected bucket {n_buckets} of v{version}, got "
                                f"{type(msg).__name__}"
                            )
                        try:
                            check_bucket(msg, manifest.entries, done)
                        except ValueError as exc:
                            if previous is not None:
                                await previous.wait()  # acknowledgements go in order
                            await self._ack(version, msg.index, f"{type(exc).__name__}: {exc}")
                            raise RefitError(f"bucket {msg.index} of v{version}: {exc}") from exc
                        view = WeightBucketView(
                            msg.version, msg.index, transport, msg.handle, msg.nbytes,
                            list(msg.entries), msg.last,
                        )
                        loaded_any = True
                        finished = anyio.Event()
                        loads.start_soon(self._load, backend, view, previous, finished)
                        previous = finished
                        n_buckets += 1
                        done += len(msg.entries)
                        n_bytes += sum(e.nbytes for e in msg.entries)
                        if msg.last:
                            break
            except BaseExceptionGroup as group:
                raise _first_refit_error(group) from None
            if done != len(manifest.entries):
                raise RefitError(
                    f"v{version} ended after {done} of the manifest's {len(manifest.entries)} "
                    "tensors"
                )
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
                await backend.abort_weight_update(version, loaded_any=loaded_any)
            raise
        await backend.finish_weight_update(version, reset_prefix_cache=reset_prefix_cache)
        return WeightsResult(
            version=version,
            num_tensors=done,
            num_bytes=n_bytes,
            num_buckets=n_buckets,
            seconds=time.perf_counter() - start,
        )

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
