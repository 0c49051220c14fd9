"""Where a trainer's optimizer state waits between steps while an engine has the GPU
(``cluster.placement = "take_turns"``; :class:`~asyncrl.plugin.backend.StateOffload`).

:class:`HostCopies` moves each CUDA tensor of a ``torch.optim`` optimizer's ``state`` (AdamW's
moments, a fused AdamW's step count) to pinned host memory and puts it back into the same place:
the optimizer keeps its state dict, so a checkpoint saved meanwhile writes the host copies, and
a DTensor stays a DTensor with its shard on the host (as under FSDP2's own CPU offload).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["HostCopies", "local_nbytes"]


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` on this rank (a DTensor's local shard)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class HostCopies:
    """The optimizer state tensors moved to host memory, and where each goes back."""

    def __init__(self) -> None:
        self._moved: list[tuple[dict[str, Any], str]] = []
        """``(optimizer.state[p], key)`` of each tensor :meth:`to_host` moved."""

    def to_host(self, optimizer: torch.optim.Optimizer | None) -> int:
        """Replace each CUDA tensor of ``optimizer.state`` by a copy in pinned host memory
        (``.to("cpu", non_blocking=True)``, queued on the current stream); the bytes moved.
        Host tensors (a plain AdamW's step count) stay as they are."""
        if optimizer is None:
            return 0
        moved = 0
        for state in optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    state[key] = value.to("cpu", non_blocking=True)
                    self._moved.append((state, key))
                    moved += local_nbytes(value)
        return moved

    def to_device(self, device: torch.device) -> int:
        """Put each tensor :meth:`to_host` moved back on ``device``, into the same place
        (queued); the bytes moved."""
        moved = 0
        for state, key in self._moved:
            value = state[key]
            state[key] = value.to(device, non_blocking=True)
            moved += local_nbytes(value)
        self._moved.clear()
        return moved
