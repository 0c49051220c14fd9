"""Weight transfers: how a refit's bytes get from trainer rank 0 to the generators.

A transfer is a plugin in the entry-point group ``asyncrl.weight_transfers``, chosen by
``refit.transport``; each entry point names a :class:`WeightTransfer`. The protocol around it
(pull, manifest, buckets, acknowledgements, timeouts, rejection of foreign frames) is the same
for every transfer and lives in :mod:`asyncrl.worker.weights`; a transfer only says where a bucket's
bytes are staged and how a reader maps them::

    sender (trainer rank 0)                       reader (the generator's engine process)
    stager = transfer.stager(StagingSpec)          opener = transfer.opener()
    stager.begin(receivers)     (every refit)
    stager.reserve(k, nbytes)                      memory = opener.open(handle, device)
    stager.pack(k, offset, tensor) ...             memory[offset:offset + nbytes] -> a weight
    stager.seal(k)
    handle = stager.handle(k)   ── Bucket(handle) ──►
    (buffer k reused once every reader acked)      opener.close()

Two staging buffers (``k`` = 0, 1) are used in turn, so packing bucket i+1 overlaps the load of
bucket i. A handle is the transfer's own msgspec struct, encoded to bytes (never pickled); a
reader decodes it with the same struct.

Built in: ``shm`` (files in ``/dev/shm``; CPU, any tensors). The torch distribution
(``backends/asyncrl-torch``) adds ``cuda_ipc`` (device buffers exported once as CUDA IPC handles;
trainer and engine on one node, on the same GPU or on different ones) and ``nccl`` (each bucket
broadcast over a collective group of the sender and the readers: NCCL between GPUs, gloo on
the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from asyncrl.errors import ConfigError, PluginError
from asyncrl.registry import available, load

IDENTITY_ENV_VAR = "ASYNCRL_TRANSFER_IDENTITY"
"""Set by a generation backend in each engine process it starts, to ``"<group>:<rank>"``: the
reader's name in a transfer that places readers itself (``nccl``: the rank in its broadcast
group)."""

__all__ = [
    "STAGING_BUFFERS",
    "Opener",
    "Receiver",
    "Stager",
    "StagingSpec",
    "WeightTransfer",
    "load_transfer",
]

GROUP = "asyncrl.weight_transfers"

STAGING_BUFFERS = 2
"""Staging buffers the trainer fills in turn (each at most ``refit.bucket_size_mb``; an engine
mirroring buckets from another GPU keeps one buffer per staging buffer too). A buffer is
refilled only once every generator acknowledged its bucket. A third buffer took a 7B refit on
one H200 from 32.8 to 28.0 ms for 1 GiB more memory, and buys nothing with an engine on another
GPU, where the link bounds the refit (docs/refit.md;
benchmarks/results/refit-h200-1gpu-staging-buffers.jsonl). Once the config key
``refit.staging_buffers`` (issue 50)."""


class Receiver(NamedTuple):
    """A generator a refit goes to."""

    identity: str
    """Its rollout worker (``rollout:<rank>``)."""
    host: str = ""
    """Where its process runs: the worker's :func:`~asyncrl.procs.process.host_id`
    (``Hello.host``; ``""``: not known)."""
    pid: int = 0
    """Its worker's process id on that host (``0``: not known): a new one means a new
    process under the same identity (a restarted worker)."""


@dataclass(frozen=True)
class StagingSpec:
    """Where the sender stages buckets."""

    run_id: str
    """Names per-run resources (the shared-memory directory)."""
    rank: int
    """The sending trainer rank."""
    device: str
    """The trainer's device (``cpu``, ``cuda:0``); device transfers allocate their buffers
    there."""
    buffers: int = STAGING_BUFFERS
    """Staging buffers to keep, filled in turn (:data:`STAGING_BUFFERS`)."""


class Stager(Protocol):
    """Sender side: ``StagingSpec.buffers`` staging buffers, numbered from 0."""

    def begin(self, receivers: list[Receiver]) -> None:
        """A refit to ``receivers`` starts (before any :meth:`reserve`). Transfers that
        connect to their readers (e.g. a collective group) do it here, and may route by
        host; others do nothing."""

    def leave(self, receiver: str) -> None:
        """``receiver`` of this refit is gone (its process exited) before the refit ended.
        A transfer whose readers depend on each other (a collective group, where the others
        would wait for it until a timeout) fails what it has under way at once; others do
        nothing."""

    def reserve(self, k: int, nbytes: int) -> None:
        """Make buffer ``k`` hold at least ``nbytes`` (growing it invalidates its handle)."""

    def pack(self, k: int, offset: int, data: Any, stable: bool = False) -> None:
        """Copy ``data`` into buffer ``k`` at ``offset``; may return before the copy is done
        (device copies are queued on the current stream, so memory the trainer frees after
        this call is not reused before the copy ran). ``data`` is a contiguous torch tensor (any
        dtype, any device) or a ``uint8`` numpy array. Called in the trainer's thread, right
        after the trainer yielded ``data``. ``stable``: ``data`` stays valid and unchanged
        until :meth:`seal` (``WeightTensor.stable``), so the copy may wait for it and go with
        the bucket's others in one batched copy."""

    def seal(self, k: int) -> None:
        """Issue the copies :meth:`pack` deferred, then wait until every copy into buffer ``k``
        is done (before its bucket is announced)."""

    def handle(self, k: int) -> bytes:
        """Buffer ``k``'s handle, as its reader decodes it."""

    def close(self) -> None:
        """Free every buffer. Idempotent."""


class Opener(Protocol):
    """Reader side, in the process that loads the weights."""

    def open(self, handle: bytes, device: Any) -> Any:
        """The bytes behind ``handle`` as a ``uint8`` torch tensor on ``device`` (shared memory
        is read on the CPU; CUDA IPC memory on the GPU it lives on). Mappings are cached, so
        opening the same handle again is free."""

    def close(self) -> None:
        """Drop every mapping. Idempotent."""


@dataclass(frozen=True)
class WeightTransfer:
    """What an ``asyncrl.weight_transfers`` entry point names."""

    name: str
    stager: Callable[[StagingSpec], Stager]
    """Sender side factory (trainer rank 0)."""
    opener: Callable[[], Opener]
    """Reader side factory (called in the process that loads the weights)."""
    devices: tuple[str, ...] = ("cpu", "cuda")
    """Device types the sender's tensors may live on."""
    stable_handles: bool = False
    """A handle names the same memory on every refit while the reader keeps it open (the
    sender refills its buffers in place): a reader may keep views of it across refits (the
    vLLM backend compiles each bucket's copies once). ``False`` when each handle is new."""
    takes_new_readers: bool = True
    """A reader that joins in the middle of a run can be refitted: a rollout worker that died
    is then started again in place (``failures.rollout_restarts``). ``False`` for a transfer
    whose sender and readers are bound for the whole run (e.g. a collective group that
    cannot be formed again), so the first death stops the run; the config asks this
    (``Config.rollout_restarts``), never the transfer's name. Every built-in one takes new
    readers (``nccl`` forms a new group)."""


def load_transfer(name: str, field: str = "refit.transport") -> WeightTransfer:
    """The transfer plugin registered as ``name``.

    Raises:
        ConfigError: no such transfer is installed (naming ``field`` and the installed ones).
        PluginError: the entry point does not name a :class:`WeightTransfer`.
    """
    if name not in available(GROUP):
        known = ", ".join(sorted(available(GROUP))) or "none"
        raise ConfigError(f"{field}: no weight transfer named {name!r} (installed: {known})")
    obj = load(GROUP, name, field)
    if not isinstance(obj, WeightTransfer):
        raise PluginError(f"{field}: entry point {name!r} must name a WeightTransfer, got {obj!r}")
    return obj
