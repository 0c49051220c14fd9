"""Buckets from another GPU, copied whole onto the engine's GPU, overlapped with the scatter.

A bucket in the trainer's memory on another GPU could be read tensor by tensor, but each
cross-GPU copy costs ~25 µs of fixed time on an H200 pair (7 ms for a 0.5B model's 290
tensors). So the engine copies the whole bucket over the link into a buffer on its own GPU
(one copy at link speed) and scatters it into the parameters from there.

Done one after the other, the link idles while the engine scatters: 7B in 15 buckets of 1 GiB
took 55.8 ms of loads against a 38.8 ms link floor. A :class:`Mirror` keeps one buffer per
sender buffer (the trainer stages in ``asyncrl.transfers.STAGING_BUFFERS`` of them, two, used
in turn; a buffer not used during a refit is dropped at the next), copies on streams of its
own, and
lets the bucket be acknowledged as soon as *its copy* is done: the trainer refills its buffer
while the engine scatters out of the mirror, and the scatter of bucket i runs under the copy
of bucket i+1. A mirror buffer is refilled only after the scatter that read it ran (an event
recorded on the stream that queued the scatter). The reload's finish synchronizes the device,
so every scatter is done before the engine serves.

On a CPU device (the logic's unit tests) the copies are plain synchronous copies.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Mirror"]


class Mirror:
    """Mirror buffers on ``device``, one per sender buffer (keyed by its handle)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._slots: dict[bytes, torch.Tensor] = {}
        """handle → buffer of the mapped memory's size."""
        self._used: set[bytes] = set()
        """Handles fetched since :meth:`next_refit`."""
        self._free: dict[bytes, Any] = {}
        """handle → event after the last scatter queued out of its buffer."""
        self._streams: dict[torch.device, Any] = {}
        self.disabled = False
        """No room for a buffer on this device: buckets are read where they are."""

    @property
    def nbytes(self) -> int:
        """Bytes of mirror buffers held."""
        return sum(b.numel() for b in self._slots.values())

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def fetch(
        self, handle: bytes, memory: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, Any, bool]:
        """Start copying ``memory[:span]`` (a mapped sender buffer) into ``handle``'s buffer.
        Returns the buffer, the copy's completion event (``None`` on a CPU device: the copy
        is done) and whether the buffer is new (views of an older buffer for ``handle``, one
        that was dropped, must not be replayed). Make the stream that reads the buffer wait
        for the event, and wait for it before acknowledging the bucket (the sender may then
        refill ``memory``).

        Raises:
            torch.OutOfMemoryError: no room for the buffer (``disabled`` is then set and no
                buffer is kept).
        """
        buf = self._slots.get(handle)
        fresh = buf is None
        if buf is None:
            try:
                buf = torch.empty(memory.numel(), dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                self.disabled = True
                self._slots.clear()
                self._free.clear()
                raise
        self._slots[handle] = buf
        self._used.add(handle)
        if not self._cuda:
            buf[:span].copy_(memory[:span])
            return buf, None, fresh
        link = self._stream(self.device)
        free = self._free.pop(handle, None)
        if free is not None:
            link.wait_event(free)  # the scatter that read this buffer last time has run
        # a copy between GPUs runs on the source device's current stream, fenced with the
        # destination's current stream: both are streams of ours, so neither waits for the
        # engine's stream (where the previous bucket's scatter is queued)
        with torch.cuda.stream(link):
            if memory.device != self.device:
                with torch.cuda.stream(self._stream(memory.device)):
                    buf[:span].copy_(memory[:span], non_blocking=True)
            else:
                buf[:span].copy_(memory[:span], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(link)
        return buf, copied, fresh

    def reading(self, handle: bytes, stream: Any) -> None:
        """A scatter out of ``handle``'s buffer was queued on ``stream``: the buffer is
        refilled only after it ran."""
        if self._cuda and handle in self._slots:
            event = torch.cuda.Event()
            event.record(stream)
            self._free[handle] = event

    def next_refit(self) -> None:
        """A refit begins: drop the buffers the previous one did not use (their sender
        buffer was replaced: it grew, or the trainer restarted)."""
        for handle in set(self._slots) - self._used:
            del self._slots[handle]
            self._free.pop(handle, None)
        self._used = set()
