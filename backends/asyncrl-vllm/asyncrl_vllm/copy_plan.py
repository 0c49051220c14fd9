"""A refit without ``load_weights``' fixed cost: copies compiled once, replayed every refit.

``model.load_weights`` maps each Hugging Face tensor onto the engine's parameters (q/k/v into
slices of ``qkv_proj``, gate/up into ``gate_up_proj``, a tied ``lm_head``...) through per-name
Python loaders: 13-26 ms for a 0.5B model on an H200 whatever the bytes, the largest part of a
small refit. A :class:`CopyPlan` runs that general path once per name, *watching* it: every
``Tensor.copy_`` it performs from the incoming tensor into a parameter is recorded as
(destination view, source size, stride, offset). Later refits replay those copies directly,
one ``copy_`` per slice, with no Python loader in between.

A name is planned only if its load was nothing but such copies, out of the incoming tensor
(no dtype conversion, no temporary), into parameter storage, covering every element exactly
once, and if each recorded destination holds exactly its source afterwards (checked once,
when the plan is compiled); anything else (a quantized layer, a loader that computes) keeps
going through ``load_weights``. Parameters keep their storage across refits in ``direct`` mode (it never
reprocesses layers), so the recorded views stay valid; the plan is dropped with the worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["CopyPlan"]

Step = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], int]
"""(destination view, source size, source stride, source offset from the tensor's start)."""


class CopyPlan:
    """Per-name copy plans for one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._plans: dict[str, list[Step] | None] = {}
        self._storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}

    @property
    def planned(self) -> int:
        """Names that replay copies."""
        return sum(1 for p in self._plans.values() if p is not None)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write ``weights`` into the model. Returns how many went through a compiled plan."""
        direct = 0
        fallback: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name not in self._plans:
                self._plans[name] = self._compile(name, tensor)  # loads it, watching
                continue
            steps = self._plans[name]
            if steps is None:
                fallback.append((name, tensor))
                continue
            base = tensor.storage_offset()
            for dst, size, stride, offset in steps:
                dst.copy_(tensor.as_strided(size, stride, base + offset), non_blocking=True)
            direct += 1
        if fallback:
            self._model.load_weights(iter(fallback))  # type: ignore[operator]
        return direct

    def _compile(self, name: str, tensor: torch.Tensor) -> list[Step] | None:
        steps: list[Step | None] = []
        source = tensor.untyped_storage().data_ptr()
        original = torch.Tensor.copy_

        def watched(dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
            if (
                isinstance(src, torch.Tensor)
                and src.untyped_storage().data_ptr() == source
                and src.dtype == tensor.dtype
                and dst.dtype == tensor.dtype
                and dst.untyped_storage().data_ptr() in self._storages
            ):
                offset = src.storage_offset() - tensor.storage_offset()
                steps.append((dst, tuple(src.size()), tuple(src.stride()), offset))
            else:
                steps.append(None)
            return original(dst, src, non_blocking)

        torch.Tensor.copy_ = watched  # type: ignore[method-assign]
        try:
            self._model.load_weights(iter([(name, tensor)]))  # type: ignore[operator]
        finally:
            torch.Tensor.copy_ = original  # type: ignore[method-assign]
        if not steps or any(s is None for s in steps):
            return None
        planned = [s for s in steps if s is not None]
        if sum(math.prod(size) for _, size, _, _ in planned) != tensor.numel():
            return None
        # the loader just wrote these slices: each must now hold exactly its source (a loader
        # that transformed the data after copying, or wrote the slice twice, fails this)
        base = tensor.storage_offset()
        for dst, size, stride, offset in planned:
            if not torch.equal(dst, tensor.as_strided(size, stride, base + offset).to(dst.device)):
                return None
        return planned
