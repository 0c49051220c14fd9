"""The ``shm`` weight transfer: buckets staged in files under ``/dev/shm``.

The sender keeps two files in ``/dev/shm/asyncrl-<run_id>`` (mode 0700), mapped read-write;
a reader maps a file copy-on-write and copies each tensor out before acknowledging (the
sender rewrites the file for the bucket after next). Works for any trainer device: device
tensors are copied to the host while packing. Removed by the sender's ``close`` and by the
controller at exit.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import msgspec
import numpy as np

from asyncrl.procs.space import is_no_space, no_space, shm_dir, shm_fix
from asyncrl.wire.transport import make_private_dir
from asyncrl.transfers import Receiver, StagingSpec, WeightTransfer

__all__ = ["SHM", "ShmHandle", "read_bytes"]


class ShmHandle(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    path: str
    size: int
    """The file's size when the bucket was announced."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ShmHandle).decode


class _File:
    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._map: mmap.mmap | None = None
        self.array = np.empty(0, np.uint8)

    def reserve(self, size: int) -> None:
        """Grow the file to ``size`` bytes, every page allocated now: a tmpfs page first
        touched through the mapping when the file system is full kills the process with
        SIGBUS, where ``posix_fallocate`` fails with ENOSPC (raised as a ``NoSpaceError``;
        the file and its mapping stay as they were)."""
        if size <= self.size:
            return
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if not is_no_space(exc):
                raise
            raise no_space(
                self.path, size - self.size, "a refit staging buffer in",
                shm_fix(os.path.dirname(os.path.dirname(self.path))),
            ) from None
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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _host_bytes(data: Any) -> np.ndarray:
    """``data`` (uint8 numpy, or a torch tensor on any device) as host ``uint8`` numpy."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    import torch

    t = data.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.view(torch.uint8).numpy()


class ShmStager:
    def __init__(self, spec: StagingSpec) -> None:
        directory = make_private_dir(shm_dir(spec.run_id))
        self._files = [
            _File(os.path.join(directory, f"w{spec.rank}-{k}.bin")) for k in range(spec.buffers)
        ]

    def begin(self, receivers: list[Receiver]) -> None:
        """Readers map the buffers themselves: nothing to connect."""

    def leave(self, receiver: str) -> None:
        """Each reader maps the buffers alone: the others do not wait for it."""

    def reserve(self, k: int, nbytes: int) -> None:
        self._files[k].reserve(nbytes)

    def pack(self, k: int, offset: int, data: Any, stable: bool = False) -> None:
        """A host copy, done when this returns (``stable`` changes nothing here)."""
        src = _host_bytes(data)
        self._files[k].array[offset : offset + src.nbytes] = src

    def seal(self, k: int) -> None:
        """Host copies are done when :meth:`pack` returns."""

    def handle(self, k: int) -> bytes:
        f = self._files[k]
        return _encode(ShmHandle(f.path, f.size))

    def close(self) -> None:
        for f in self._files:
            f.close()


class ShmOpener:
    """Maps bucket files shared (it never writes to them; the same mapping serves the bucket
    after next, which the sender writes into the same file). A reader copies each tensor out
    before it acknowledges its bucket."""

    def __init__(self) -> None:
        self._maps: dict[bytes, tuple[mmap.mmap, Any]] = {}

    def open(self, handle: bytes, device: Any = None) -> Any:
        import torch

        if handle in self._maps:
            return self._maps[handle][1]
        h = _decode(handle)
        with open(h.path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size < h.size:
                raise ValueError(f"bucket file {h.path} holds {size} bytes, {h.size} announced")
            mm = mmap.mmap(f.fileno(), h.size, access=mmap.ACCESS_WRITE)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        # a grown file gets a new handle (new size): drop older mappings of the same path
        for key in [k for k in self._maps if _decode(k).path == h.path]:
            self._drop(key)
        self._maps[handle] = (mm, tensor)
        return tensor

    def _drop(self, key: bytes) -> None:
        mm, tensor = self._maps.pop(key)
        del tensor
        try:
            mm.close()
        except BufferError:  # a caller still holds a view; the map closes with it
            pass

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)


def read_bytes(handle: bytes, offset: int, nbytes: int) -> np.ndarray:
    """A copy of ``nbytes`` at ``offset`` of the bucket behind ``handle``, as ``uint8`` numpy
    (for readers without torch)."""
    h = _decode(handle)
    if offset < 0 or offset + nbytes > h.size:
        raise ValueError(f"{nbytes} bytes at {offset} are outside the {h.size}-byte bucket")
    return np.fromfile(h.path, np.uint8, count=nbytes, offset=offset)


SHM = WeightTransfer(name="shm", stager=ShmStager, opener=ShmOpener, stable_handles=True)
"""Entry point ``shm``."""
