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

**A group per set of receivers.** The group is formed on the first ``begin`` for its
receivers and kept while later refits go to the same receivers on the same hosts. A refit
to others (a rollout worker left out while it restarts, then its new process) or after a
failed broadcast forms a new group (a new id, numbered by ``epoch``) and drops the old one;
each reader leaves its group at the new one's first handle. So the transfer takes new
readers (``takes_new_readers``): a restarted rollout worker (the same identity, another
process: ``Receiver.pid``) is refitted, on any node. A
group is formed in well under a second with gloo; an NCCL communicator takes longer, once
per change. Every member takes part in every broadcast: each reader must open every bucket
handle of its group once, in order. Each broadcast carries a sequence number (from 0 in
each group, one per bucket); a reader refuses a handle that skips or repeats one (opening
the very same handle again returns the same bytes) or that belongs to an older group. An
empty bucket (0 bytes) is announced with its number but broadcasts nothing.

**A reader that dies mid-refit** breaks the broadcast for every member. The sender watches
its readers' processes (on its host) and calls :meth:`NcclStager.leave`, which aborts the
group (what ends an NCCL broadcast); with gloo a broken connection fails the broadcast at the
member next to the dead one, and that member frees its groups at once (gloo closes a group's
connections only when it is freed), so the others fail too instead of at their timeout. The
refit fails and the controller does it again without the dead reader
(:func:`asyncrl.run.refit.refit_generators`), in a new group.

**Once per host (gloo).** A gloo broadcast is a tree over the group's ranks, blind to hosts:
with 4 readers on another host, 3 copies of each bucket crossed the link (64 MiB broadcast
to 4 readers beyond a veth pair: 203 MB sent on it). So with gloo the sender's group holds the readers of its own host
and one reader per other host (its *leader*, the first of that host's receivers); each
leader passes every bucket on to its host's other readers over a group of their own
(:func:`~asyncrl_torch.transfers.collective.fan_out`; ``NcclHandle.fans``): one copy per host on
the link. NCCL needs none of this: its rings are laid out by node, entering each node once
and going on within it over NVLink or PCIe peer copies, so the sender's NCCL group holds
every reader (NCCL's design; not measured here, with one GPU).

**Which member am I.** :meth:`NcclOpener.open` gets no identity, so the handle maps receiver
identities (``rollout:<rank>``) to ranks and the reader reads its identity from the
environment variable ``ASYNCRL_TRANSFER_IDENTITY`` (the generation backend sets it for its
engine processes). Without it, a group with exactly one reader makes the reader rank 1. One
process per receiver takes part: an engine whose weights load in several worker processes
(tensor parallelism) cannot use this transfer. The sender learns each receiver's host and
process from ``begin`` (the ``Hello`` of each rollout worker).

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

from asyncrl.plugin.common import host_id
from asyncrl.plugin.transfer import Receiver, StagingSpec, WeightTransfer
from asyncrl_torch.transfers.collective import (
    _PREFIX,
    CLOSE_GRACE_S,
    HOST_ENV_VAR,
    IDENTITY_ENV_VAR,
    TIMEOUT_ENV_VAR,
    TIMEOUT_S,
    _advertised_host,
    _Broadcaster,
    _Job,
    _make_group,
    _run_broadcast,
    _shutdown,
    _timeout_s,
    Place,
    fan_out,
    place_in,
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
    fans: dict[str, list[str]] = {}
    """A host's leader (a receiver in ``ranks``) → the receivers of its host it passes each
    bucket on to, over a group of their own (the leader rank 0, they 1, 2, …)."""
    epoch: int = 0
    """The group's number: 0, 1, 2, … as the sender forms a new one (a reader refuses an
    older group's handle)."""


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
        self._members: list[Receiver] = []
        """The current group's receivers, sorted."""
        self._ranks: dict[str, int] = {}
        """Receiver → its rank in the sender's group."""
        self._fans: dict[str, list[str]] = {}
        """A host's leader → the receivers it passes each bucket on to (gloo)."""
        self.groups_formed = 0
        """Groups formed so far (one more for every change of receivers)."""
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

    def begin(self, receivers: list[Receiver]) -> None:
        """Have a broadcast group of the sender and ``receivers`` ready for this refit. The
        group of the last refit is kept when it had the very same receivers (identities,
        hosts and processes) and has not failed; else a new one is formed (a rollout worker
        restarted or left out, a failed broadcast) and the old one dropped: its readers leave
        it at the new group's first handle. The sender thread forms the group, waiting for
        the readers to join.

        Raises:
            RuntimeError: closed, duplicate receivers, or the store cannot be hosted.
        """
        if self._closed:
            raise RuntimeError("the nccl weight transfer is closed")
        names = [r.identity for r in receivers]
        if len(set(names)) != len(names):
            raise RuntimeError(f"duplicate receivers: {names}")
        members = sorted(Receiver(*r) for r in receivers)
        thread = self._thread
        if thread is not None and thread.error is None and members == self._members:
            return
        self._drop_group()
        if self._store is None:
            self._host_store()
        import torch.distributed as dist

        if self._backend == "gloo":  # NCCL's own rings already enter each node once
            cross, self._fans = fan_out(names, [r.host for r in receivers], host_id())
        else:
            cross, self._fans = names, {}
        self._group_id = uuid.uuid4().hex
        self._ranks = {r: i + 1 for i, r in enumerate(cross)}
        self._members = members
        self._seq = 0
        self.groups_formed += 1
        store = dist.PrefixStore(f"{_PREFIX}/{self._group_id}/", self._store)
        self._thread = _Broadcaster(
            self._backend, store, 1 + len(cross), self._device, self._timeout_s
        )
        self._thread.start()

    def leave(self, receiver: str) -> None:
        """``receiver`` died in this refit: abort the group, so every broadcast under way or
        queued fails now (its readers' too) instead of at the timeout; the next ``begin``
        forms a new group (with NCCL nothing else would end a broadcast a member left)."""
        thread = self._thread
        if thread is None or receiver not in self._ranks and not any(
            receiver in others for others in self._fans.values()
        ):
            return
        if thread.error is None:
            thread.error = RuntimeError(f"{receiver} left the weight broadcast group (it died)")
        _shutdown(thread.group, graceful=False)

    def _host_store(self) -> None:
        """Host the TCPStore every group of the run meets at (its keys namespaced by group)."""
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

    def _drop_group(self) -> None:
        """Stop the sender thread and drop its group: at once (an abort) when a broadcast is
        still under way (a refit that failed: a reader died in it), else once the thread
        ended (waiting at most :data:`CLOSE_GRACE_S`); a thread still forming its group is
        left to end at its timeout. Every buffer is free afterwards."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.group is None and thread.error is None:
            # still forming: blocked in a rendezvous a reader never came to; it ends at its
            # timeout (a daemon thread), its group never made
            thread.jobs.put(None)
        elif thread is not None:
            busy = any(job is not None and not job.done.is_set() for job in self._jobs)
            if busy:
                _shutdown(thread.group, graceful=False)
            thread.jobs.put(None)
            thread.join(1.0 if busy else min(CLOSE_GRACE_S, self._timeout_s))
            if thread.is_alive():  # a broadcast no reader takes part in: let it go
                _shutdown(thread.group, graceful=False)
                thread.join(1.0)
        self._jobs = [None] * self._n
        self._sealed = [False] * self._n
        self._used = [0] * self._n
        self._handles = [None] * self._n

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
                fans={k: list(v) for k, v in self._fans.items()},
                epoch=self.groups_formed - 1,
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
        self._drop_group()
        self._buffers = [None] * self._n
        self._store = None


class NcclOpener:
    """Reader side: joins the group on its first handle and receives each bucket's broadcast
    into a buffer of its own (on ``device`` with NCCL, on the host with gloo); a host's
    leader passes each bucket on to its host's other readers. A handle of a newer group (the
    sender formed one for other receivers) makes it leave its group and join that one. The
    view :meth:`open` returns is valid until the next :meth:`open`."""

    def __init__(self) -> None:
        self._timeout_s = _timeout_s()
        self._store: Any = None
        self._group: Any = None
        """Its member of the sender's group (``None`` for a reader fed by its leader)."""
        self._local: Any = None
        """Its member of its host's fan group, where it has one."""
        self._key: tuple[str, str, int, str, int] | None = None
        self._epoch = -1
        self._place = Place(-1)
        self._device: Any = None
        self._next = 0
        self._buffer: Any = None
        self._last: tuple[bytes, Any] | None = None
        self._broken: str | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        """This reader's rank in the sender's group (``-1`` before it joined, or when its
        host's leader passes the buckets on to it)."""
        return self._place.rank

    @property
    def place(self) -> Place:
        """Where it sits in the group it joined last."""
        return self._place

    def _join(self, h: NcclHandle, device: Any) -> None:
        import torch.distributed as dist

        place = place_in(os.environ.get(IDENTITY_ENV_VAR), h.ranks, h.fans, h.size)
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
        where = f"rank {place.rank} of {h.size}" if place.rank >= 0 else (
            f"rank {place.local_rank} of {place.local_size} under {place.leader}"
        )
        try:
            store = dist.TCPStore(h.host, h.port, None, False, timeout=timeout)
            prefix = f"{_PREFIX}/{h.group}/"
            if place.rank >= 0:
                self._group = _make_group(
                    h.backend, dist.PrefixStore(prefix, store), place.rank, h.size,
                    self._timeout_s,
                )
            if place.local_size:
                self._local = _make_group(
                    h.backend, dist.PrefixStore(f"{prefix}{place.leader}/", store),
                    place.local_rank, place.local_size, self._timeout_s,
                )
        except Exception as exc:
            self._leave(graceful=False)
            raise RuntimeError(
                f"could not join the weight broadcast group at {h.host}:{h.port} as {where} "
                f"({h.backend}): {type(exc).__name__}: {exc}"
            ) from exc
        self._store, self._place = store, place
        self._key = (h.backend, h.host, h.port, h.group, h.size)
        self._epoch = h.epoch

    def _leave(self, graceful: bool) -> None:
        group, self._group = self._group, None
        local, self._local = self._local, None
        _shutdown(local, graceful)
        _shutdown(group, graceful)
        self._store = None
        self._key = None

    def open(self, handle: bytes, device: Any = None) -> Any:
        """Receive the broadcast behind ``handle``: a ``uint8`` tensor of exactly its bytes
        (on ``device`` with NCCL, on the CPU with gloo); a host's leader passes it on to its
        host's other readers before it returns. Joins the group on first use, and a newer
        group at its first handle.

        Raises:
            RuntimeError: the handle skips or repeats a broadcast, belongs to an older group,
                names no place for this reader, or the broadcast failed or timed out.
        """
        import torch

        if self._closed:
            raise RuntimeError("the weight broadcast reader is closed")
        if self._last is not None and handle == self._last[0]:
            return self._last[1]
        h = _decode(handle)
        if self._key is None or h.group != self._key[3]:
            if h.epoch <= self._epoch:
                if self._broken is not None and h.epoch == self._epoch:
                    raise RuntimeError(f"the weight broadcast group is unusable: {self._broken}")
                raise RuntimeError(
                    f"handle of an older weight broadcast group ({h.group}, number {h.epoch}); "
                    f"this reader joined number {self._epoch}"
                )
            if h.seq != 0:
                raise RuntimeError(
                    f"bucket broadcast 0 of a new group expected, got {h.seq} (each reader must "
                    "open every bucket once, in order)"
                )
            self._leave(graceful=self._broken is None)  # the sender dropped it for this one
            self._broken, self._next, self._last = None, 0, None
            self._join(h, device)
        elif self._key != (h.backend, h.host, h.port, h.group, h.size):
            raise RuntimeError(f"handle of weight broadcast group {h.group} does not match it")
        if self._broken is not None:
            raise RuntimeError(f"the weight broadcast group is unusable: {self._broken}")
        if h.seq != self._next:
            raise RuntimeError(
                f"bucket broadcast {self._next} expected, got {h.seq} (each reader must open "
                "every bucket once, in order)"
            )
        self._last = None
        if h.nbytes:
            if self._buffer is None or self._buffer.numel() < h.nbytes:
                self._buffer = None
                self._buffer = torch.empty(h.nbytes, dtype=torch.uint8, device=self._device)
            view = self._buffer[: h.nbytes]
            for group in (self._group, self._local):  # from the sender, then to its host
                failed = group is not None and _run_broadcast(
                    group, view, h.backend, self._timeout_s, f"weight broadcast {h.seq}"
                )
                if failed:
                    # free its groups now: the readers it passes buckets on to (and any
                    # that wait for it in gloo's tree) fail at once, not at their timeout
                    group = None
                    self._broken = str(failed)
                    self._leave(graceful=False)
                    raise failed
        else:
            view = torch.empty(0, dtype=torch.uint8, device=self._device)
        self._next = h.seq + 1
        self._last = (handle, view)
        return view

    def close(self) -> None:
        """Leave the group (its threads and connections end) and free the buffer.
        Idempotent."""
        self._closed = True
        self._leave(graceful=self._broken is None)
        self._buffer = None
        self._last = None


NCCL = WeightTransfer(
    name="nccl",
    stager=NcclStager,
    opener=NcclOpener,
    devices=("cpu", "cuda"),
)
"""Entry point ``nccl``."""
