"""The ``cuda_ipc`` weight transfer: buckets staged in device memory, shared by CUDA IPC.

The sender allocates its ``uint8`` staging buffers (two by default) on its GPU and exports
each once (an IPC handle plus torch's reference counter), re-exporting only when a buffer
grows. A reader opens a handle once and keeps the mapping for the rest of the run, so a refit
costs the device-to-device copies and no handle traffic. The reader may run on another GPU of
the node: the handle names the buffer's GPU by UUID, and the reader maps it through its own
index of that GPU (the reader's process must see that GPU; ``CUDA_VISIBLE_DEVICES`` order
differs between processes).

Synchronisation: :meth:`CudaIpcStager.seal` issues the copies :meth:`CudaIpcStager.pack`
deferred (small tensors the trainer called stable) and waits for every copy before the bucket
is announced; the reader must finish reading (synchronise) before acknowledging.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from asyncrl.plugin.transfer import Receiver, StagingSpec, WeightTransfer

__all__ = ["CUDA_IPC", "DEFER_BELOW_BYTES", "CudaIpcHandle", "device_index_by_uuid"]

DEFER_BELOW_BYTES = 16 << 20
"""A stable tensor smaller than this is copied at ``seal``, in one ``torch._foreach_copy_``
with the bucket's others (per dtype): each ``copy_`` costs ~10 µs of launch, as long as a
~20 MB copy takes on an H200, so small tensors pay mostly launch. Larger ones go at once
(a plain copy runs at full bandwidth)."""


class CudaIpcHandle(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """torch's CUDA IPC export of one staging buffer (the fields of ``reduce_tensor`` that
    identify the memory), as plain bytes and integers."""

    stager: str
    """Which sender (a per-stager id): with ``slot``, what a new handle replaces."""
    slot: int
    """The staging buffer (0 or 1)."""
    gpu_uuid: str
    nbytes: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(CudaIpcHandle).decode


def _uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_by_uuid(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``.

    Raises:
        RuntimeError: the GPU is not visible here (fix ``CUDA_VISIBLE_DEVICES``).
    """
    import torch

    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    raise RuntimeError(
        f"GPU {uuid} holds the trainer's weight buffers but this process does not see it "
        f"({torch.cuda.device_count()} visible); CUDA IPC needs both GPUs visible to the engine"
    )


class CudaIpcStager:
    def __init__(self, spec: StagingSpec) -> None:
        import torch

        if not spec.device.startswith("cuda") or not torch.cuda.is_available():
            raise RuntimeError(
                f"refit.transport = 'cuda_ipc' needs a trainer on a GPU (it is on {spec.device}); "
                "use 'shm' on CPU"
            )
        self._device = torch.device(spec.device)
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._id = f"{spec.run_id}/{spec.rank}/{uuid.uuid4().hex[:8]}"
        self._n = spec.buffers
        self._buffers: list[Any] = [None] * self._n
        self._handles: list[bytes | None] = [None] * self._n
        # typed views of each buffer at (offset, dtype, shape): the same tensors land at the
        # same places every refit, and one cached view saves four tensor ops per tensor (the
        # per-tensor Python cost is most of packing a small model)
        self._views: list[dict[tuple[Any, ...], Any]] = [{} for _ in range(self._n)]
        # stable tensors' small copies, per buffer and dtype, issued together at seal
        self._deferred: list[dict[Any, tuple[list[Any], list[Any]]]] = [
            {} for _ in range(self._n)
        ]

    def begin(self, receivers: list[Receiver]) -> None:
        """Readers map the buffers themselves: nothing to connect."""

    def leave(self, receiver: str) -> None:
        """Each reader maps the buffers alone: the others do not wait for it."""

    def reserve(self, k: int, nbytes: int) -> None:
        import torch

        buf = self._buffers[k]
        if buf is not None and buf.numel() >= nbytes:
            return
        self._buffers[k] = None  # a reader may still map the old one: torch keeps it alive
        self._handles[k] = None
        self._views[k] = {}
        self._deferred[k] = {}
        self._buffers[k] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def pack(self, k: int, offset: int, data: Any, stable: bool = False) -> None:
        import torch

        if not isinstance(data, torch.Tensor):
            data = torch.from_numpy(data)
        key = (offset, data.dtype, data.shape)
        dst = self._views[k].get(key)
        if dst is None:
            nbytes = data.numel() * data.element_size()
            raw = self._buffers[k][offset : offset + nbytes]
            dst = self._views[k][key] = raw.view(data.dtype).view(data.shape)
        if stable and data.device == self._device and dst.nbytes < DEFER_BELOW_BYTES:
            dsts, srcs = self._deferred[k].setdefault(data.dtype, ([], []))
            dsts.append(dst)
            srcs.append(data.detach())
        else:
            dst.copy_(data.detach(), non_blocking=True)

    def seal(self, k: int) -> None:
        import torch

        for dsts, srcs in self._deferred[k].values():
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        self._deferred[k] = {}
        torch.cuda.current_stream(self._device).synchronize()

    def handle(self, k: int) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        if self._handles[k] is None:
            buf = self._buffers[k]
            _, args = reduce_tensor(buf)  # rebuild_cuda_tensor's arguments, see its signature
            device, handle, size_bytes, offset_bytes = args[6:10]
            ref_handle, ref_offset, event_handle, event_sync = args[11:15]
            self._handles[k] = _encode(
                CudaIpcHandle(
                    stager=self._id,
                    slot=k,
                    gpu_uuid=_uuid(device),
                    nbytes=buf.numel(),
                    storage_handle=bytes(handle),
                    storage_size_bytes=int(size_bytes),
                    storage_offset_bytes=int(offset_bytes),
                    ref_counter_handle=bytes(ref_handle),
                    ref_counter_offset=int(ref_offset),
                    event_handle=bytes(event_handle) if event_handle else b"",
                    event_sync_required=bool(event_sync),
                )
            )
        return self._handles[k]

    def close(self) -> None:
        import torch

        self._buffers = [None] * self._n
        self._handles = [None] * self._n
        self._views = [{} for _ in range(self._n)]
        self._deferred = [{} for _ in range(self._n)]
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


class CudaIpcOpener:
    """Keeps one mapping per sender buffer: a new handle for a buffer (it grew) drops the old
    mapping, so the sender's old allocation can be freed."""

    def __init__(self) -> None:
        self._open: dict[bytes, Any] = {}
        self._slots: dict[tuple[str, int], bytes] = {}

    def open(self, handle: bytes, device: Any = None) -> Any:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        tensor = self._open.get(handle)
        if tensor is not None:
            return tensor
        h = _decode(handle)
        old = self._slots.pop((h.stager, h.slot), None)
        if old is not None:
            self._open.pop(old, None)
        index = device_index_by_uuid(h.gpu_uuid)
        tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([h.nbytes]),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            index,
            h.storage_handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            False,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
        self._open[handle] = tensor
        self._slots[h.stager, h.slot] = handle
        return tensor

    def close(self) -> None:
        self._open.clear()
        self._slots.clear()


CUDA_IPC = WeightTransfer(
    name="cuda_ipc", stager=CudaIpcStager, opener=CudaIpcOpener, devices=("cuda",),
    stable_handles=True,
)
"""Entry point ``cuda_ipc``."""
