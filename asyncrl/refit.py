"""Weight refit over ZeroMQ ipc:// with shared-memory buckets (the ``shm`` transport).

Weights go from trainer rank 0 straight to every generator; the controller only says
"version v" to both sides and waits for both to answer::

    trainer rank 0 (ROUTER, bound)                rollout rank r (DEALER, connected)
        ◄──────────── WeightsPull(v) ─────────────  begin_weight_update(v)
    fill bucket file A
        ───────────── Bucket(v, 0, A) ───────────►  load_weight_bucket(A)
    fill bucket file B (overlaps the load of A)
        ◄──────────── BucketAck(v, 0) ────────────
        ───────────── Bucket(v, 1, B, last) ─────►  load_weight_bucket(B)
        ◄──────────── BucketAck(v, 1) ────────────  finish_weight_update(v)

Two bucket files are used in turn, so the trainer packs bucket k+1 while generators load
bucket k; a file is rewritten only after every receiver acknowledged it. The sender's socket
accepts only the receivers named for the refit: an undecodable frame, a frame from another
peer, or a message of another version is rejected and counted (socket ``weights``, reported in
``WeightsResult.rejected_frames``), never fatal. The files live in
``/dev/shm/asyncrl-<run_id>`` (mode 0700), removed by the sender's ``close`` and by the
controller at exit. CUDA IPC (GPU) will be another transport with the same messages, its
``Bucket.handle`` carrying the IPC handle instead of a path.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import AsyncIterator

import anyio
import numpy as np
import structlog

from .backend import GenerationBackend, WeightBucketView, WeightTensor
from .codec import Codec
from .errors import ProtocolError, RefitError
from .messages import Bucket, BucketAck, TensorEntry, WeightMessage, WeightsPull, WeightsResult
from .transport import DEALER, ROUTER, AsyncSocket, Context, Rejections, make_private_dir, peer_name

__all__ = ["ShmWeightReceiver", "ShmWeightSender", "shm_dir"]

log = structlog.get_logger("asyncrl.refit")
ALIGN = 256


def shm_dir(run_id: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return os.path.join(base, f"asyncrl-{run_id}")


class _BucketFile:
    """A file in shared memory, mapped read-write by the sender."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._map: mmap.mmap | None = None
        self.array = np.empty(0, np.uint8)

    def ensure(self, size: int) -> None:
        if size <= self.size:
            return
        self.array = np.empty(0, np.uint8)
        if self._map is not None:
            self._map.close()
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _copy_into(dst: np.ndarray, items: list[tuple[int, np.ndarray]]) -> None:
    for offset, data in items:
        dst[offset : offset + data.nbytes] = data.reshape(-1)


class ShmWeightSender:
    """Trainer rank 0's end: a bound ROUTER plus two bucket files.

    Args:
        ctx: the worker's ZeroMQ context.
        address: where to bind (``ipc://…``), announced to the controller.
        run_id: names the shared-memory directory.
        rank: the trainer rank (names the bucket files).
    """

    def __init__(self, ctx: Context, address: str, run_id: str, rank: int = 0) -> None:
        self._sock: AsyncSocket = ctx.socket(ROUTER, bind=address, router_mandatory=True)
        self._codec = Codec(WeightMessage)
        self.rejections = Rejections()
        directory = make_private_dir(shm_dir(run_id))
        self._files = [_BucketFile(os.path.join(directory, f"w{rank}-{k}.bin")) for k in (0, 1)]

    async def _recv(self, receivers: set[str], version: int) -> tuple[str, object]:
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
            elif getattr(msg, "version", None) != version or isinstance(msg, Bucket):
                self.rejections.reject(
                    "weights", who, f"{type(msg).__name__} of v{getattr(msg, 'version', '?')} "
                    f"during the refit to v{version}"
                )
            else:
                return who, msg

    async def send(
        self,
        version: int,
        receivers: list[str],
        tensors: AsyncIterator[WeightTensor],
        *,
        bucket_size: int,
        timeout_s: float,
    ) -> WeightsResult:
        """Publish every tensor of ``tensors`` to all ``receivers``.

        Raises:
            RefitError: a receiver reported a load error, or did not answer in time.

        Cancellation: abandons the transfer; receivers time out on their side.
        """
        start = time.perf_counter()
        waiting = set(receivers)
        expected = set(receivers)
        with anyio.fail_after(timeout_s):
            while waiting:
                who, msg = await self._recv(expected, version)
                if isinstance(msg, WeightsPull):
                    waiting.discard(who)
                else:
                    self.rejections.reject("weights", who, f"{type(msg).__name__} before pull")
        # acks outstanding per bucket file, and per-bucket bookkeeping
        unacked: list[set[str]] = [set(), set()]
        index, cur = 0, 0
        entries: list[TensorEntry] = []
        pending_copy: list[tuple[int, np.ndarray]] = []
        used = 0
        n_tensors = n_bytes = 0

        async def wait_acks(k: int) -> None:
            with anyio.fail_after(timeout_s):
                while unacked[k]:
                    who, msg = await self._recv(expected, version)
                    if not isinstance(msg, BucketAck) or msg.index >= index or msg.index < 0:
                        self.rejections.reject("weights", who, f"unexpected {type(msg).__name__}")
                        continue
                    if msg.error:
                        raise RefitError(f"{who} failed to load bucket {msg.index}: {msg.error}")
                    unacked[msg.index % 2].discard(who)

        async def flush(last: bool) -> None:
            nonlocal index, cur, entries, pending_copy, used
            f = self._files[cur]
            await anyio.to_thread.run_sync(_copy_into, f.array, pending_copy)
            bucket = Bucket(version, index, f.path, used, entries, last)
            for r in receivers:
                await self._sock.send([r.encode(), *self._codec.encode(bucket)])
            unacked[cur] = set(receivers)
            index, cur = index + 1, 1 - cur
            entries, pending_copy, used = [], [], 0
            await wait_acks(cur)  # the other file must be free before we refill it

        async for t in tensors:
            if t.data is None:
                raise RefitError(f"trainer rank 0 got no data for {t.name}")
            size = _align(t.data.nbytes)
            if entries and used + size > bucket_size:
                await flush(last=False)
            self._files[cur].ensure(max(bucket_size, used + size))
            entries.append(TensorEntry(t.name, t.dtype, list(t.shape), used, t.data.nbytes))
            pending_copy.append((used, t.data))
            used += size
            n_tensors += 1
            n_bytes += t.data.nbytes
        await flush(last=True)
        await wait_acks(1 - cur)  # the last bucket's file
        return WeightsResult(
            version=version,
            num_tensors=n_tensors,
            num_bytes=n_bytes,
            num_buckets=index,
            seconds=time.perf_counter() - start,
            rejected_frames=self.rejections.total,
        )

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._sock.close()


class ShmWeightReceiver:
    """A rollout worker's end: one DEALER connected to the trainer's transfer socket."""

    def __init__(self, ctx: Context, address: str, identity: str) -> None:
        self._identity = identity
        self._sock = ctx.socket(DEALER, connect=address, identity=identity)
        self._codec = Codec(WeightMessage)
        self.address = address

    async def receive(
        self,
        version: int,
        backend: GenerationBackend,
        *,
        reset_prefix_cache: bool,
        kv_scales: dict[str, float] | None,
        timeout_s: float,
    ) -> WeightsResult:
        """Pull version ``version`` and load it into ``backend``; publish nothing.

        Raises:
            RefitError: the sender went silent, or loading failed (the sender is told).

        Cancellation: the engine may hold a partial load; the run is expected to stop.
        """
        start = time.perf_counter()
        await self._sock.send(self._codec.encode(WeightsPull(version, self._identity)))
        await backend.begin_weight_update(version)
        n_tensors = n_bytes = n_buckets = 0
        while True:
            with anyio.move_on_after(timeout_s) as scope:
                frames = await self._sock.recv()
            if scope.cancelled_caught:
                raise RefitError(
                    f"no weight bucket from {self.address} within {timeout_s:.0f} s "
                    "(refit.timeout_s); is the trainer alive?"
                )
            msg = self._codec.decode(frames)
            if not isinstance(msg, Bucket) or msg.version != version:
                raise RefitError(f"unexpected {type(msg).__name__} during refit to v{version}")
            view = WeightBucketView(
                msg.version, msg.index, msg.handle, msg.nbytes, list(msg.entries), msg.last
            )
            try:
                await backend.load_weight_bucket(view)
            except Exception as exc:
                ack = BucketAck(version, msg.index, self._identity, f"{type(exc).__name__}: {exc}")
                await self._sock.send(self._codec.encode(ack))
                raise RefitError(f"loading bucket {msg.index} of v{version} failed") from exc
            await self._sock.send(self._codec.encode(BucketAck(version, msg.index, self._identity)))
            n_buckets += 1
            n_tensors += len(msg.entries)
            n_bytes += sum(e.nbytes for e in msg.entries)
            if msg.last:
                break
        await backend.finish_weight_update(
            version, reset_prefix_cache=reset_prefix_cache, kv_scales=kv_scales
        )
        return WeightsResult(
            version=version,
            num_tensors=n_tensors,
            num_bytes=n_bytes,
            num_buckets=n_buckets,
            seconds=time.perf_counter() - start,
        )

    def close(self) -> None:
        self._sock.close()
