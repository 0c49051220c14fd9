"""The bucket layout of a refit: how a weight version's tensors are cut into buckets, and the
checks both ends run on it.

A version travels as a manifest (every tensor's name, dtype and shape, in the trainer's
``weight_specs()`` order) and then buckets. A bucket holds the manifest's next tensors side by
side, each starting on an ``ALIGN``-byte boundary; it closes before the tensor that would take
it past the bucket size, and a tensor larger than that travels alone in a bucket of its size.
:func:`bucket_layout` computes that layout from the sizes alone, the one place of the rule:
:class:`Packer` sizes its staging buffers with it before the first tensor exists and puts in
each bucket exactly the tensors it says; :func:`check_manifest`, :func:`check_bucket` and
:class:`BucketArrivals` check what a receiver is sent against it.

Pure: no sockets, no event loop, no threads, no torch (a stager is whatever the transfer
plugin gave; a tensor's data is only asked for its size and dtype), so every rule here is
tested directly. The protocol that moves these buckets, with its waits and timeouts, is
:mod:`asyncrl.worker.weights`, the only user.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

from asyncrl.backend import WeightBucketView, WeightTensor
from asyncrl.errors import RefitError
from asyncrl.wire.messages import Bucket, Manifest, TensorEntry

__all__ = [
    "ALIGN",
    "DTYPE_SIZES",
    "BucketArrivals",
    "Packer",
    "align",
    "bucket_layout",
    "check_bucket",
    "check_manifest",
    "manifest_of",
]

ALIGN = 256
"""Every tensor of a bucket starts on a multiple of this many bytes."""

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
"""Bytes per element of the dtypes a weight may have (torch names without ``torch.``)."""


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``: where the next tensor of a bucket starts."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(entry: TensorEntry) -> int:
    return math.prod(entry.shape) * DTYPE_SIZES[entry.dtype]


def check_manifest(entries: Sequence[TensorEntry]) -> None:
    """Raise ``ValueError`` for a manifest no model could accept (a duplicate name, an unknown
    dtype, a negative dimension): the wire check; the backend checks names and shapes."""
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ValueError(f"the manifest names {e.name!r} twice")
        seen.add(e.name)
        if e.dtype not in DTYPE_SIZES:
            raise ValueError(f"{e.name}: unknown dtype {e.dtype!r}")
        if any(d < 0 for d in e.shape):
            raise ValueError(f"{e.name}: negative dimension in {e.shape}")


def check_bucket(bucket: Bucket, manifest: Sequence[TensorEntry], start: int) -> None:
    """Raise ``ValueError`` unless ``bucket.entries`` are ``manifest[start:]``'s next entries
    (same names, dtypes, shapes), each of its exact size, inside the bucket, not overlapping."""
    end = 0
    for i, e in enumerate(bucket.entries):
        if start + i >= len(manifest):
            raise ValueError(f"bucket {bucket.index}: {e.name} is beyond the manifest's end")
        want = manifest[start + i]
        if (e.name, e.dtype, list(e.shape)) != (want.name, want.dtype, list(want.shape)):
            raise ValueError(
                f"bucket {bucket.index}: got {e.name} {e.dtype}{list(e.shape)} where the manifest "
                f"has {want.name} {want.dtype}{list(want.shape)}"
            )
        if e.nbytes != _nbytes(want):
            raise ValueError(
                f"bucket {bucket.index}: {e.name} has {e.nbytes} bytes, not {_nbytes(want)}"
            )
        if e.offset < end or e.offset + e.nbytes > bucket.nbytes:
            raise ValueError(
                f"bucket {bucket.index}: {e.name} at {e.offset}+{e.nbytes} overlaps another "
                f"tensor or lies outside the {bucket.nbytes}-byte bucket"
            )
        end = e.offset + e.nbytes


def manifest_of(specs: Sequence[WeightTensor]) -> list[TensorEntry]:
    """The manifest of a version whose tensors are ``specs`` (offsets and sizes are zero: they
    belong to a bucket's entries, not to the manifest's)."""
    return [TensorEntry(t.name, t.dtype, list(t.shape), 0, 0) for t in specs]


def bucket_layout(sizes: Sequence[int], bucket_size: int) -> list[tuple[int, int]]:
    """Each bucket of a refit as ``(tensors, bytes used)`` (the bytes are what its
    ``Bucket.nbytes`` says), for tensors of ``sizes`` (in order) packed ``ALIGN``-aligned: a
    bucket closes before the tensor that would take it past ``bucket_size``; a larger tensor
    travels alone in a bucket of its size. No tensors: one empty bucket (the version still
    ends with a ``last`` one)."""
    layout: list[tuple[int, int]] = []
    used = count = 0
    for size in sizes:
        if count and used + size > bucket_size:
            layout.append((count, used))
            used = count = 0
        used += align(size)
        count += 1
    layout.append((count, used))
    return layout


class Packer:
    """Fills staging buffers from the trainer's iterator (runs in the trainer's thread).

    Args:
        tensors: the trainer's ``iter_weights()``; advanced only as far as the bucket being
            filled needs (a sharded trainer may free a gathered tensor once it moves on).
        manifest: what the trainer promised (:func:`manifest_of` its ``weight_specs()``).
        stager: the transfer's stager (``reserve``, ``pack``, ``seal``).
        bucket_size: bytes per bucket (``refit.bucket_size_mb``).
        buffers: how many staging buffers are filled in turn.
    """

    def __init__(
        self,
        tensors: Iterator[WeightTensor],
        manifest: list[TensorEntry],
        stager: Any,
        bucket_size: int,
        buffers: int = 2,
    ) -> None:
        self._it = tensors
        self._manifest = manifest
        self._stager = stager
        self.count = 0
        self.nbytes = 0
        self.seconds = 0.0
        self._sizes = [_nbytes(e) for e in manifest]
        self._layout = bucket_layout(self._sizes, bucket_size)
        self._bucket = 0
        """The next bucket to fill."""
        # each buffer is sized once, for the largest bucket it will hold in this version (a
        # small model gets small buffers; the sizes, hence the handles, stay the same from one
        # refit to the next, so a reader's per-bucket plans stay valid)
        used = [n for _, n in self._layout]
        self._buffer_sizes = [max(used[k::buffers], default=0) for k in range(buffers)]

    def _next(self) -> WeightTensor | None:
        """The trainer's next tensor, checked against the manifest (``None``: it has no more).

        Raises:
            RefitError: another tensor than the manifest's next, or data of another size or
                dtype.
        """
        t = next(self._it, None)
        if t is None:
            return None
        i = self.count
        want = self._manifest[i] if i < len(self._manifest) else None
        if want is None or (t.name, t.dtype, list(t.shape)) != (
            want.name, want.dtype, list(want.shape)
        ):
            raise RefitError(
                f"the trainer yielded {t.name} {t.dtype}{list(t.shape)} as tensor {i}, but its "
                "weight_specs() promised "
                + (f"{want.name} {want.dtype}{list(want.shape)}" if want else "no more")
            )
        if t.data is None:
            raise RefitError(f"trainer rank 0 got no data for {t.name}")
        got_bytes = int(getattr(t.data, "nbytes", -1))
        is_torch = hasattr(t.data, "element_size")  # numpy data is raw uint8 bytes
        torch_dtype = str(getattr(t.data, "dtype", "")).removeprefix("torch.")
        if got_bytes != self._sizes[i] or (is_torch and torch_dtype != t.dtype):
            raise RefitError(
                f"the trainer yielded {t.name} as {t.dtype}{list(t.shape)} "
                f"({self._sizes[i]} bytes) with data of {got_bytes} bytes"
                + (f" in {torch_dtype}" if is_torch else "")
            )
        return t

    def fill(self, k: int) -> tuple[list[TensorEntry], int, bool]:
        """Pack the next bucket into buffer ``k``: exactly the tensors :func:`bucket_layout`
        gives it (the iterator is advanced no further: a sharded trainer may still hold the
        next tensor). Returns its entries, bytes used, and whether it is the last bucket.

        Raises:
            RefitError: the trainer yielded another tensor than its manifest promised, data of
                another size or dtype, fewer tensors, or more.
        """
        start = time.perf_counter()
        entries: list[TensorEntry] = []
        used = 0
        self._stager.reserve(k, self._buffer_sizes[k])
        count, _ = self._layout[self._bucket]
        for _ in range(count):
            t = self._next()
            if t is None:
                raise RefitError(
                    f"the trainer yielded {self.count} tensors; weight_specs() promised "
                    f"{len(self._manifest)}"
                )
            size = self._sizes[self.count]  # checked against the data in _next
            self._stager.pack(k, used, t.data, t.stable)
            entries.append(TensorEntry(t.name, t.dtype, list(t.shape), used, size))
            used += align(size)
            self.count += 1
            self.nbytes += size
        self._stager.seal(k)
        self._bucket += 1
        last = self._bucket == len(self._layout)
        if last:
            self._next()  # raises if the trainer yields more than it promised
        self.seconds += time.perf_counter() - start
        return entries, used, last


class BucketArrivals:
    """What one refit has received (receiver side), checked against its manifest: each
    bucket must be the next one and fit it. No I/O.

    Raises:
        ValueError: the manifest is of another transport than this run's (``transport``) or
            one no model could accept.
    """

    def __init__(self, manifest: Manifest, transport: str) -> None:
        if manifest.transport != transport:
            raise ValueError(
                f"the trainer sends over {manifest.transport!r}, this run's refit.transport "
                f"is {transport!r}"
            )
        check_manifest(manifest.entries)
        self._manifest, self._transport = manifest, transport
        self.buckets = self.tensors = self.nbytes = 0

    def take(self, msg: Any) -> WeightBucketView:
        """Count bucket ``msg`` and return the view a backend loads. Raises RefitError if it
        is not the next bucket (off protocol), ValueError if it does not fit the manifest."""
        if not isinstance(msg, Bucket) or msg.index != self.buckets:
            raise RefitError(
                f"expected bucket {self.buckets} of v{self._manifest.version}, got "
                f"{type(msg).__name__}"
            )
        check_bucket(msg, self._manifest.entries, self.tensors)
        self.buckets += 1
        self.tensors += len(msg.entries)
        self.nbytes += sum(e.nbytes for e in msg.entries)
        return WeightBucketView(
            msg.version, msg.index, self._transport, msg.handle, msg.nbytes,
            list(msg.entries), msg.last,
        )

    def check_complete(self) -> None:
        """Raise RefitError unless the buckets so far hold the whole manifest."""
        if self.tensors != (n := len(self._manifest.entries)):
            raise RefitError(
                f"v{self._manifest.version} ended after {self.tensors} of the manifest's {n} "
                "tensors"
            )
