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
going through ``load_weights``. Parameters keep their storage across refits in ``direct`` mode
(it never reprocesses layers), so the recorded views stay valid; the plan is dropped with the
worker.

A trainer sends the same buckets every refit (same tensors, same offsets, in the same mapped
staging buffers), so a bucket is also compiled, under a key the caller gives (its handle and
entries): its source views and their destinations are kept as two lists, and a replay is a
single ``torch._foreach_copy_`` for the whole bucket, without building one view per tensor in
Python (about 20 µs per tensor on a GPU host, the largest fixed cost of a small refit once
``load_weights`` is out of the way). Bucket programs not replayed during one refit are dropped
at the start of the next (:meth:`CopyPlan.next_refit`), so a buffer the sender replaced is not
kept mapped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CopyPlan"]

Step = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], int]
"""(destination view, source size, source stride, source offset from the tensor's start)."""


@dataclass
class _Bucket:
    """One bucket's copies, ready to replay: ``dsts[i].copy_(srcs[i])`` for every i, then
    ``fallback`` (names without a plan) through ``load_weights``."""

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    fallback: list[tuple[str, torch.Tensor]]
    direct: int


class CopyPlan:
    """Per-name copy plans for one model, and per-bucket programs built from them (see the
    module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._plans: dict[str, list[Step] | None] = {}
        self._storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._buckets: dict[Hashable, _Bucket] = {}
        self._replayed: set[Hashable] = set()

    @property
    def planned(self) -> int:
        """Names that replay copies."""
        return sum(1 for p in self._plans.values() if p is not None)

    @property
    def buckets(self) -> int:
        """Bucket programs kept."""
        return len(self._buckets)

    def next_refit(self) -> None:
        """A refit begins: drop the bucket programs the previous refit did not replay."""
        self._buckets = {k: b for k, b in self._buckets.items() if k in self._replayed}
        self._replayed = set()

    def replay(self, key: Hashable) -> int | None:
        """Replay the bucket compiled under ``key``; how many tensors went through a plan, or
        ``None`` if no bucket has that key (then build the views and :meth:`load` them)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return None
        self._replayed.add(key)
        return self._run(bucket)

    def _run(self, bucket: _Bucket) -> int:
        if bucket.dsts:
            torch._foreach_copy_(bucket.dsts, bucket.srcs, non_blocking=True)
        if bucket.fallback:
            self._model.load_weights(iter(bucket.fallback))  # type: ignore[operator]
        return bucket.direct

    def forget_buckets(self, where: Callable[[Hashable], bool] | None = None) -> None:
        """Drop the kept buckets whose key satisfies ``where`` (every one without it): the
        memory they read from is gone."""
        if where is None:
            self._buckets, self._replayed = {}, set()
            return
        self._buckets = {k: b for k, b in self._buckets.items() if not where(k)}
        self._replayed = {k for k in self._replayed if not where(k)}

    def load(
        self, weights: Iterable[tuple[str, torch.Tensor]], key: Hashable | None = None
    ) -> int:
        """Write ``weights`` into the model. Returns how many went through a compiled plan
        (a name seen for the first time is compiled, through ``load_weights``, and does not
        count).

        With ``key``, the sources are views of memory that holds the same tensors at the same
        places on every later refit (a mapped staging buffer): the bucket is kept under
        ``key`` for :meth:`replay`."""
        weights = list(weights)
        fresh = {name for name, _ in weights if name not in self._plans}
        for name, tensor in weights:
            if name in fresh:
                self._plans[name] = self._compile(name, tensor)  # loads it, watching
        known = self._bucket([(n, t) for n, t in weights if n not in fresh])
        direct = self._run(known)
        if key is not None:
            self._buckets[key] = self._bucket(weights) if fresh else known
            self._replayed.add(key)
        return direct

    def _bucket(self, weights: list[tuple[str, torch.Tensor]]) -> _Bucket:
        bucket = _Bucket([], [], [], 0)
        for name, tensor in weights:
            steps = self._plans[name]
            if steps is None:
                bucket.fallback.append((name, tensor))
                continue
            base = tensor.storage_offset()
            for dst, size, stride, offset in steps:
                bucket.dsts.append(dst)
                bucket.srcs.append(tensor.as_strided(size, stride, base + offset))
            bucket.direct += 1
        return bucket

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
