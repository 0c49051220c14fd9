"""A refit bucket's bytes as named tensors, inside an engine worker: what the full-weight reload
(:mod:`asyncrl_vllm.ext`) and the adapter staging (:mod:`asyncrl_vllm.adapter_ext`) both read a
bucket with."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["bucket_weights"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype



def bucket_weights(
    entries: list[list[Any]],
    memory: torch.Tensor,
    source: torch.Tensor,
    device: torch.device,
    mode: str,
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each of ``entries`` (``[name, dtype, shape, offset, nbytes]``):
    a view of ``source`` (the bucket's ``memory``, its mirror, or with ``mode`` ``view`` a
    private copy of it), or a private copy on ``device`` where the bucket is on another device
    type or the loader keeps references (``layerwise``).

    Raises:
        ValueError: an entry's byte count does not match its dtype and shape, or its bytes
            lie outside the bucket.
    """
    weights: list[tuple[str, torch.Tensor]] = []
    for name, dtype_name, shape, offset, nbytes in entries:
        dtype = _dtype(dtype_name)
        if nbytes != math.prod(shape) * dtype.itemsize or offset < 0:
            raise ValueError(f"{name}: {nbytes} bytes do not hold {dtype_name}{list(shape)}")
        if offset + nbytes > memory.numel():
            raise ValueError(f"{name}: bytes {offset}+{nbytes} outside the bucket")
        tensor = source[offset : offset + nbytes].view(dtype).view(shape)
        if mode != "view" and (source.device.type != device.type or mode == "layerwise"):
            tensor = tensor.to(device, copy=True)
        weights.append((name, tensor))
    return weights
