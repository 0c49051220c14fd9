"""The ``nccl`` weight transfer: each bucket broadcast over a collective group of its own.

For generators that cannot map the trainer's memory (other nodes, no CUDA IPC). The sender
(trainer rank 0) and one member per receiver form a standalone ``torch.distributed`` group,
built without ``init_process_group`` (the trainer and the vLLM workers already have default
groups of their own)::

    sender: rank 0                                 reader i: rank i + 1
    begin(receivers)  TCPStore server (port 0)
                      broadcast thread starts
                      ProcessGroup(store, 0, 1 + n)
    reserve/pack k    into staging buffer k
    seal(k)           queue broadcast #s of
                      buffer k[:used]  (no wait)
    handle(k)         host, port, group, size,
                      s, used, {identity: rank}
                        ── Bucket(handle) ──►      open(handle, device):
                                                     first call: join the group (TCPStore
                                                     client, same ProcessGroup kind)
                        ══ broadcast #s ══►          receive into its own buffer, wait
                                                     -> view of exactly `used` bytes
    reserve/pack k    wait for broadcast #s      ◄── BucketAck (every reader)
    (next bucket)     (done by then)

The backend follows the sender's device: NCCL when the trainer is on a GPU, gloo when it is on
the CPU (so CI, which has no GPU, runs the real protocol over gloo). With gloo a reader always
receives into host memory (the engine copies the tensors to its device); with NCCL it receives
into a buffer on its own GPU (``device``), and the sender broadcasts from its GPU.

**No blocking on the sender.** Building the group and the first NCCL collective are
rendezvous with every reader, and a reader only joins once it got a ``Bucket`` message, which
:mod:`asyncrl.worker.weights` sends after :meth:`NcclStager.seal` and :meth:`NcclStager.handle`
return. So the group lives in a sender thread: ``begin`` starts it (it builds the group,
waiting for the readers), ``seal`` queues the bucket's broadcast and returns at once, and the
thread runs the broadcasts in order. Before buffer ``k`` is refilled (the next
:meth:`NcclStager.reserve` or :meth:`NcclStager.pack` on it) the sender waits for that
buffer's broadcast; by then every reader acknowledged the bucket, so it is complete.

**Fixed group.** The group is made on the first ``begin`` for exactly those receivers (rank
``i + 1`` for ``receivers[i]``) and kept for the run; a later refit to other receivers raises.
So the transfer declares ``takes_new_readers=False``: a rollout worker that died is not
restarted in place (``failures.rollout_restarts`` counts as 0) and its death stops the run.
Every member takes part in every broadcast: each reader must open every bucket handle once,
in order. Each broadcast carries a sequence number (from 0, one per bucket, across refits); a
reader refuses a handle that skips or repeats one (opening the very same handle again returns
the same bytes). An empty bucket (0 bytes) is announced with its number but broadcasts nothing.

**Which member am I.** :meth:`NcclOpener.open` gets no identity, so the handle maps receiver
identities (``rollout:<rank>``) to ranks and the reader reads its identity from the
environment variable ``ASYNCRL_TRANSFER_IDENTITY`` (the generation backend sets it for its
engine processes). Without it, a group with exactly one reader makes the reader rank 1. One
process per receiver takes part: an engine whose weights load in several worker processes
(tensor parallelism) cannot use this transfer.

**Rendezvous and network.** The sender hosts a ``TCPStore`` on an ephemeral port (it listens
on every interface) and advertises ``ASYNCRL_NCCL_HOST`` if set, else the address of this
host's name (``socket.gethostname()``), else ``127.0.0.1``. Keys are namespaced by a fresh
group id. Gloo picks its own interface from the host name or ``GLOO_SOCKET_IFNAME``; NCCL from
``NCCL_SOCKET_IFNAME`` and its usual variables.

**Timeouts.** Every wait (store, group creation, each broadcast, each wait for a buffer) is
bounded by ``ASYNCRL_NCCL_TIMEOUT_S`` seconds (default :data:`TIMEOUT_S`, 300), read when a
stager or opener is made. :meth:`NcclStager.close` waits at most :data:`CLOSE_GRACE_S` for
the sender thread, then abandons it (a daemon thread; its broadcast ends by its timeout, or
as soon as the readers' group is gone). With NCCL, torch's watchdog also applies to a
broadcast that outlives the timeout (by default it tears the process down).
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from typing import Any

import msgspec

from asyncrl.transfers import StagingSpec, WeightTransfer
from asyncrl.transfers.collective import (
    _PREFIX,
    CLOSE_GRACE_S,
    HOST_ENV_VAR,
    IDENTITY_ENV_VAR,
    TIMEOUT_ENV_VAR,
    TIMEOUT_S,
    _advertised_host,
    _broadcast,
    _Broadcaster,
    _finish,
    _Job,
    _make_group,
    _shutdown,
    _timeout_s,
)

__all__ = [
    "CLOSE_GRACE_S",
    "HOST_ENV_VAR",
    "IDENTITY_ENV_VAR",
    "NCCL",
    "TIMEOUT_ENV_VAR",
    "TIMEOUT_S",
    "NcclHandle",
    "NcclOpener",
    "NcclStager",
]

class NcclHandle(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What a reader needs to receive one bucket."""

    backend: str
    """``nccl`` or ``gloo``: the kind of group to join."""
    host: str
    """Where the sender's TCPStore listens."""
    port: int
    group: str
    """The group's id (namespaces the store's keys)."""
    size: int
    """Members: the sender (rank 0) and one per receiver."""
    seq: int
    """This bucket's broadcast number: 0, 1, 2, … over the whole run."""
    nbytes: int
    """The broadcast's length: the bucket's bytes (up to the last one written)."""
    ranks: dict[str, int]
    """Receiver identity → its rank in the group."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(NcclHandle).decode


class NcclStager:
    """Sender side: staging buffers on the trainer's device, broadcast by a sender thread.

    Args:
        spec: the trainer's device picks the backend (``cuda…``: NCCL, ``cpu``: gloo).

    Raises:
        RuntimeError: the device is neither CPU nor CUDA, or torch lacks the backend.
    """

    def __init__(self, spec: StagingSpec) -> None:
        import torch
        import torch.distributed as dist

        device = torch.device(spec.device)
        if device.type == "cuda":
            if not torch.cuda.is_available() or not dist.is_nccl_available():
                raise RuntimeError(
                    f"refit.transport = 'nccl' from {spec.device} needs CUDA and torch's NCCL"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._backend = "nccl"
        elif device.type == "cpu":
            if not dist.is_gloo_available():
                raise RuntimeError("refit.transport = 'nccl' on the CPU needs torch's gloo")
            self._backend = "gloo"
        else:
            raise RuntimeError(
                f"refit.transport = 'nccl' supports trainers on cpu or cuda, not {spec.device}"
            )
        self._device = device
        self._timeout_s = _timeout_s()
        n = spec.buffers
        self._n = n
        self._buffers: list[Any] = [None] * n
        self._used = [0] * n
        """Bytes up to the last one written into each buffer (its broadcast's length)."""
        self._sealed = [False] * n
        """Whether each buffer's bucket is sealed (its next reserve/pack starts a new one)."""
        self._jobs: list[_Job | None] = [None] * n
        self._handles: list[bytes | None] = [None] * n
        self._seq = 0
        self._receivers: list[str] | None = None
        self._ranks: dict[str, int] = {}
        self._group_id = ""
        self._host = ""
        self._port = 0
        self._store: Any = None
        self._thread: _Broadcaster | None = None
        self._closed = False

    @property
    def backend(self) -> str:
        """``nccl`` or ``gloo``."""
        return self._backend

    def begin(self, receivers: list[str]) -> None:
        """On the first refit, host the store and start forming the group of ``1 +
        len(receivers)`` members (the sender thread waits for the readers to join); later
        refits must go to the same receivers.

        Raises:
            RuntimeError: other receivers than the group was formed for, or closed.
        """
        if self._closed:
            raise RuntimeError("the nccl weight transfer is closed")
        if self._receivers is not None:
            if sorted(receivers) != sorted(self._receivers):
                raise RuntimeError(
                    "refit.transport = 'nccl' keeps one broadcast group for the run, formed for "
                    f"{self._receivers}; this refit goes to {list(receivers)} (a generator "
                    "cannot join or leave it)"
                )
            return
        if len(set(receivers)) != len(receivers):
            raise RuntimeError(f"duplicate receivers: {list(receivers)}")
        import torch.distributed as dist

        self._host = _advertised_host()
        timeout = timedelta(seconds=self._timeout_s)
        # the server listens on every interface; connecting its own client through the
        # advertised host checks that readers can use it
        try:
            self._store = dist.TCPStore(
                self._host, 0, None, True, timeout=timeout, wait_for_workers=False
            )
        except Exception as exc:
            raise RuntimeError(
                f"could not host the weight broadcast store at {self._host} (set {HOST_ENV_VAR} "
                f"to an address of this host the generators reach): {type(exc).__name__}: {exc}"
            ) from exc
        self._port = int(self._store.port)
        self._group_id = uuid.uuid4().hex
        self._ranks = {r: i + 1 for i, r in enumerate(receivers)}
        self._receivers = list(receivers)
        store = dist.PrefixStore(f"{_PREFIX}/{self._group_id}/", self._store)
        self._thread = _Broadcaster(
            self._backend, store, 1 + len(receivers), self._device, self._timeout_s
        )
        self._thread.start()

    def _reuse(self, k: int) -> None:
        """Before buffer ``k`` takes a new bucket: wait for the broadcast of its last one."""
        if not self._sealed[k]:
            return
        job = self._jobs[k]
        if job is not None:
            if not job.done.wait(self._timeout_s):
                raise RuntimeError(
                    f"weight broadcast {job.seq} did not complete within {self._timeout_s:.0f} s "
                    f"({TIMEOUT_ENV_VAR}); is every receiver alive and in the group?"
                )
            if job.error is not None:
                raise RuntimeError(f"weight broadcast {job.seq} failed: {job.error}") from job.error
        self._jobs[k] = None
        self._sealed[k] = False
        self._used[k] = 0

    def reserve(self, k: int, nbytes: int) -> None:
        """Make buffer ``k`` hold ``nbytes`` (waiting first for its previous broadcast); a
        grown buffer keeps the bytes already packed."""
        import torch

        self._reuse(k)
        buf = self._buffers[k]
        if buf is not None and buf.numel() >= nbytes:
            return
        grown = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        if buf is not None and self._used[k]:
            grown[: self._used[k]].copy_(buf[: self._used[k]])
        self._buffers[k] = grown

    def pack(self, k: int, offset: int, data: Any, stable: bool = False) -> None:
        """Copy ``data`` into buffer ``k`` at ``offset`` (queued on the current stream for a
        GPU buffer; ``stable`` changes nothing here: one broadcast per bucket dominates)."""
        import torch

        self._reuse(k)
        if not isinstance(data, torch.Tensor):
            data = torch.from_numpy(data)
        src = data.detach().reshape(-1).view(torch.uint8)
        end = offset + src.numel()
        buf = self._buffers[k]
        if buf is None or buf.numel() < end:
            raise ValueError(
                f"buffer {k} holds {0 if buf is None else buf.numel()} bytes; reserve {end} "
                "before packing there"
            )
        buf[offset:end].copy_(src, non_blocking=buf.device.type == "cuda")
        self._used[k] = max(self._used[k], end)

    def seal(self, k: int) -> None:
        """Finish buffer ``k``'s copies and queue its broadcast (never waits for readers)."""
        if self._thread is None:
            raise RuntimeError("NcclStager.seal before begin")
        if self._thread.error is not None:
            raise RuntimeError(f"the weight broadcast group failed: {self._thread.error}")
        self._reuse(k)  # sealed again with nothing packed: an empty bucket
        if self._backend == "nccl":
            import torch

            torch.cuda.current_stream(self._device).synchronize()
        n = self._used[k]
        buf = self._buffers[k]
        job = _Job(self._seq, buf[:n] if n else None, n)
        self._seq += 1
        self._jobs[k] = job
        self._sealed[k] = True
        self._handles[k] = _encode(
            NcclHandle(
                backend=self._backend,
                host=self._host,
                port=self._port,
                group=self._group_id,
                size=1 + len(self._ranks),
                seq=job.seq,
                nbytes=n,
                ranks=dict(self._ranks),
            )
        )
        self._thread.jobs.put(job)

    def handle(self, k: int) -> bytes:
        """The handle of the bucket last sealed in buffer ``k``.

        Raises:
            RuntimeError: buffer ``k`` holds no sealed bucket.
        """
        h = self._handles[k]
        if h is None or not self._sealed[k]:
            raise RuntimeError(f"buffer {k} holds no sealed bucket")
        return h

    def close(self) -> None:
        """Stop the sender thread (waiting at most :data:`CLOSE_GRACE_S`), tear the group
        down, stop the store, free both buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.jobs.put(None)
            thread.join(min(CLOSE_GRACE_S, self._timeout_s))
            if thread.is_alive():  # a broadcast no reader takes part in: let it go
                _shutdown(thread.group, graceful=False)
                thread.join(1.0)
        self._buffers = [None] * self._n
        self._jobs = [None] * self._n
        self._handles = [None] * self._n
        self._store = None


class NcclOpener:
    """Reader side: joins the group on its first handle and receives each bucket's broadcast
    into a buffer of its own (on ``device`` with NCCL, on the host with gloo). The view
    :meth:`open` returns is valid until the next :meth:`open`."""

    def __init__(self) -> None:
        self._timeout_s = _timeout_s()
        self._store: Any = None
        self._group: Any = None
        self._key: tuple[str, str, int, str, int] | None = None
        self._rank = -1
        self._device: Any = None
        self._next = 0
        self._buffer: Any = None
        self._last: tuple[bytes, Any] | None = None
        self._broken: str | None = None

    @property
    def rank(self) -> int:
        """This reader's rank in the group (``-1`` before it joined)."""
        return self._rank

    def _own_rank(self, h: NcclHandle) -> int:
        identity = os.environ.get(IDENTITY_ENV_VAR)
        if identity:
            rank = h.ranks.get(identity)
            if rank is None:
                raise RuntimeError(
                    f"{IDENTITY_ENV_VAR}={identity!r} is not a receiver of this weight broadcast "
                    f"group ({sorted(h.ranks)})"
                )
            return rank
        if h.size == 2 and len(h.ranks) == 1:
            return 1
        raise RuntimeError(
            f"the weight broadcast group has {h.size - 1} receivers; set {IDENTITY_ENV_VAR} to "
            f"this reader's identity (one of {sorted(h.ranks)})"
        )

    def _join(self, h: NcclHandle, device: Any) -> None:
        import torch.distributed as dist

        rank = self._own_rank(h)
        if h.backend == "nccl":
            import torch

            if device is None:
                device = torch.device("cuda", torch.cuda.current_device())
            device = torch.device(device)
            if device.type != "cuda":
                raise RuntimeError(
                    f"the trainer broadcasts its weights over NCCL; this reader is on {device}, "
                    "not a GPU (a CPU trainer broadcasts over gloo)"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            self._device = device
        elif h.backend == "gloo":
            import torch

            self._device = torch.device("cpu")
        else:
            raise RuntimeError(f"unknown weight broadcast backend {h.backend!r}")
        timeout = timedelta(seconds=self._timeout_s)
        try:
            store = dist.TCPStore(h.host, h.port, None, False, timeout=timeout)
            prefixed = dist.PrefixStore(f"{_PREFIX}/{h.group}/", store)
            group = _make_group(h.backend, prefixed, rank, h.size, self._timeout_s)
        except Exception as exc:
            raise RuntimeError(
                f"could not join the weight broadcast group at {h.host}:{h.port} as rank "
                f"{rank} of {h.size} ({h.backend}): {type(exc).__name__}: {exc}"
            ) from exc
        self._store, self._group, self._rank = store, group, rank
        self._key = (h.backend, h.host, h.port, h.group, h.size)

    def open(self, handle: bytes, device: Any = None) -> Any:
        """Receive the broadcast behind ``handle``: a ``uint8`` tensor of exactly its bytes
        (on ``device`` with NCCL, on the CPU with gloo). Joins the group on first use.

        Raises:
            RuntimeError: the handle skips or repeats a broadcast, belongs to another group,
                names no rank for this reader, or the broadcast failed or timed out.
        """
        import torch

        if self._last is not None and handle == self._last[0]:
            return self._last[1]
        if self._broken is not None:
            raise RuntimeError(f"the weight broadcast group is unusable: {self._broken}")
        h = _decode(handle)
        if h.seq != self._next:
            raise RuntimeError(
                f"bucket broadcast {self._next} expected, got {h.seq} (each reader must open "
                "every bucket once, in order)"
            )
        if self._group is None:
            self._join(h, device)
        elif self._key != (h.backend, h.host, h.port, h.group, h.size):
            raise RuntimeError(
                f"handle of another weight broadcast group ({h.group} at {h.host}:{h.port}); "
                f"this reader joined {self._key[3] if self._key else '?'}"
            )
        self._last = None
        if h.nbytes:
            if self._buffer is None or self._buffer.numel() < h.nbytes:
                self._buffer = None
                self._buffer = torch.empty(h.nbytes, dtype=torch.uint8, device=self._device)
            view = self._buffer[: h.nbytes]
            try:
                work = _broadcast(self._group, view, self._timeout_s)
                _finish(work, h.backend, self._timeout_s, f"weight broadcast {h.seq}")
            except Exception as exc:
                self._broken = str(exc)
                raise RuntimeError(str(exc)) from exc
        else:
            view = torch.empty(0, dtype=torch.uint8, device=self._device)
        self._next = h.seq + 1
        self._last = (handle, view)
        return view

    def close(self) -> None:
        """Leave the group (its threads and connections end) and free the buffer.
        Idempotent."""
        group, self._group = self._group, None
        _shutdown(group, graceful=self._broken is None)
        self._store = None
        self._buffer = None
        self._last = None
        self._broken = self._broken or "closed"


NCCL = WeightTransfer(
    name="nccl",
    stager=NcclStager,
    opener=NcclOpener,
    devices=("cpu", "cuda"),
    takes_new_readers=False,  # the group is formed once, at the first refit
)
"""Entry point ``nccl``."""
