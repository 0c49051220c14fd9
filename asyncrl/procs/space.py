"""Room on the file systems a run writes to: checked before any process starts, and named
when a write finds none (ENOSPC).

Before spawning, :func:`check_space` (run by :func:`asyncrl.run.preflight.check_before_spawn`,
hence by ``asyncrl check-config`` too) compares the bytes free on each file system with what
the run will put there, and raises a :class:`~asyncrl.errors.ConfigError` naming both and
the fixes:

* shared memory (``/dev/shm``) with ``refit.transport = "shm"``: trainer rank 0 stages the
  refit buckets in ``asyncrl.transfers.STAGING_BUFFERS`` (2) files there, each as large as the
  largest bucket it holds: ``min(refit.bucket_size_mb, the model)`` unless one tensor is
  larger (it travels alone). The model's size is read from its safetensors headers. Plus what a
  backend's engine needs there (``BackendPlugin.shm_bytes``: vLLM's message queues).
* ``run.output_dir`` (logs, ``metrics.jsonl``): :data:`OUTPUT_FLOOR_BYTES`; the checkpoint
  directory: one checkpoint at the least (the trainer's float32 weights, plus the
  ``model.dtype`` copy of ``checkpoint.save_model``); the export directory: one export.
  Directories on one file system add up.

During the run, a write that finds no room raises :class:`~asyncrl.errors.NoSpaceError`
(:func:`no_space`): the path, the bytes free, the bytes needed and the fix, in one line.
"""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError, NoSpaceError, RemoteCallError, flatten
from asyncrl.safetensors import read_safetensors_header

__all__ = [
    "OUTPUT_FLOOR_BYTES",
    "ModelSize",
    "check_space",
    "checkpoint_need",
    "failed_path",
    "free_bytes",
    "full_leaf",
    "is_no_space",
    "model_size",
    "no_space",
    "no_space_in",
    "shm_base",
    "trained_size",
    "shm_dir",
    "shm_fix",
    "shm_need",
    "size_text",
    "tree_bytes",
]

OUTPUT_FLOOR_BYTES = 16 << 20
"""Room ``run.output_dir`` must have at the start, for the logs and ``metrics.jsonl`` (a
step's records take 1-3 KB; the workers' logs a few KB a step)."""

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]")
_NUMBERS = re.compile(
    r" (/[^:]*): (\d+) bytes(?: \([^)]*\))? free(?:, (?:at least )?(\d+) bytes)?"
)
"""The path, free and needed bytes in the text of :func:`no_space`."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per element of ``model.dtype``."""
_SAFETENSORS_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_PAGE = 4096
_ALIGN = 256  # asyncrl.worker.buckets.ALIGN: every tensor of a bucket starts on this boundary


def shm_base() -> str:
    """Where the run's shared-memory directory goes: ``/dev/shm``, else ``/tmp``."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def shm_dir(run_id: str) -> str:
    """The run's shared-memory directory (staged weights; removed when the run ends)."""
    return os.path.join(shm_base(), f"asyncrl-{run_id}")


def size_text(n: int) -> str:
    """``4128768 bytes (3.9 MiB)``; ``512 bytes``."""
    if n < 1024:
        return f"{n} bytes"
    value, unit = float(n), ""
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{n} bytes ({value:.1f} {unit})"


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor (a directory the run has not made yet)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (or of its
    nearest existing ancestor); ``None`` if it cannot be read."""
    try:
        st = os.statvfs(_existing(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path`` (a file: its size; missing: 0)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    if not total and os.path.isfile(path):
        total = os.path.getsize(path)
    return total


def _device(path: str) -> int:
    try:
        return os.stat(_existing(path)).st_dev
    except OSError:
        return -1


def is_no_space(exc: BaseException) -> bool:
    """``exc`` (or one inside it, an exception group) is a full file system: ENOSPC (or
    EDQUOT) as an ``OSError``, a ``NoSpaceError``, or a worker's failure whose text says so."""
    return full_leaf(exc) is not None


def full_leaf(exc: BaseException) -> BaseException | None:
    """The first exception in ``exc`` (groups flattened) that :func:`is_no_space` means."""
    for leaf in flatten(exc):
        if isinstance(leaf, NoSpaceError):
            return leaf
        if isinstance(leaf, OSError) and leaf.errno in _NO_SPACE_ERRNOS:
            return leaf
        if isinstance(leaf, RemoteCallError) and (
            leaf.remote_type == "NoSpaceError"
            or _NO_SPACE_TEXT.search(f"{leaf.remote_message}\n{leaf.remote_traceback}")
        ):
            return leaf
    return None


def failed_path(exc: BaseException, default: str) -> str:
    """The file a no-space failure names: the ``OSError``'s file name, the path quoted in a
    worker's message (``[Errno 28] No space left on device: '/...'``), else ``default``."""
    if isinstance(exc, NoSpaceError) and exc.path:
        return exc.path
    if isinstance(exc, OSError) and exc.filename:
        return os.fsdecode(exc.filename)
    if isinstance(exc, RemoteCallError):
        quoted = re.search(r"'(/[^']+)'", exc.remote_message)
        if quoted:
            return quoted.group(1)
    return default


def no_space(
    path: str, needed: int | None, what: str, fix: str, *, at_least: bool = False
) -> NoSpaceError:
    """The error for a write of ``needed`` bytes (``None``: unknown; ``at_least``: a lower
    bound) into ``path`` that found its file system full: ``no space left on device (ENOSPC)
    for <what> <path>: <free> free, <needed> needed. Fix: <fix>.``"""
    free = free_bytes(path)
    if needed is not None and free is not None and needed <= free:
        needed, at_least = free + 1, True  # an estimate the failure proves too small
    free_text = size_text(free) if free is not None else "an unknown number of bytes"
    bound = "at least " if at_least else ""
    need_text = f", {bound}{size_text(needed)} needed" if needed is not None else ""
    return NoSpaceError(
        f"no space left on device (ENOSPC) for {what} {path}: {free_text} free{need_text}. "
        f"Fix: {fix}",
        path=path, free_bytes=free, needed_bytes=needed,
    )


def no_space_in(errors: Iterable[BaseException]) -> NoSpaceError | None:
    """The first full file system among ``errors`` (exception groups flattened) as a
    :class:`~asyncrl.errors.NoSpaceError`: one raised here as it is; one a worker raised
    (a ``RemoteCallError`` whose remote type is ``NoSpaceError``) as its own, naming the
    worker; else a bare ENOSPC ``OSError`` (a write that did not say what it needed). ``None``
    if there is none."""
    leaves = [leaf for e in errors for leaf in flatten(e)]
    for exc in leaves:
        if isinstance(exc, NoSpaceError):
            return exc
        if isinstance(exc, RemoteCallError) and exc.remote_type == "NoSpaceError":
            text, _, fix = exc.remote_message.partition(" Fix: ")
            found = _NUMBERS.search(text)
            path, free, needed = found.groups() if found else ("", None, None)
            where = f"{text.rstrip('.')} (on worker {exc.worker})."
            err = NoSpaceError(
                f"{where} Fix: {fix}" if fix else where,
                path=path, free_bytes=None if free is None else int(free),
                needed_bytes=None if needed is None else int(needed),
            )  # fmt: skip
            err.__cause__ = exc
            return err
    for exc in leaves:  # a write that did not say it (a bare OSError): what it knows
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE_ERRNOS:
            fix = "free space on that file system, then resume"
            if exc.filename:
                err = no_space(os.fsdecode(exc.filename), None, "a write in", fix)
            else:
                err = NoSpaceError(f"no space left on device (ENOSPC) for a write that named no "
                                   f"file ({exc}). Fix: {fix} (the run's directories: "
                                   "run.output_dir, checkpoint.dir)")
            err.__cause__ = exc
            return err
    return None


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelSize:
    """What the weight files of a model directory hold."""

    elements: int
    """Elements of every tensor (0: unknown, only the files' sizes were read)."""
    largest: int
    """Elements of the largest tensor (0: unknown)."""
    stored_bytes: int
    """Bytes of the weight files as stored."""
    tensors: int = 0
    """How many tensors (0: unknown)."""

    def served_bytes(self, dtype: str) -> int:
        """Bytes of all the weights in ``dtype`` (``model.dtype``). Only file sizes known
        (no safetensors): the stored bytes, as if stored in 2-byte elements."""
        if self.elements:
            return self.elements * _DTYPE_BYTES[dtype]
        return self.stored_bytes * _DTYPE_BYTES[dtype] // 2


def model_size(model_path: str) -> ModelSize | None:
    """The weights in ``model_path``: from the safetensors headers (elements, largest tensor)
    when there are any, else from the sizes of its other weight files; ``None`` when it holds
    no weight file (a backend that builds its model itself) or cannot be read."""
    try:
        files = sorted(p for p in Path(model_path).iterdir() if p.is_file())
    except OSError:
        return None
    elements = largest = stored = tensors = 0
    for path in (p for p in files if p.suffix == ".safetensors"):
        try:
            header, _ = read_safetensors_header(path)
            stored += path.stat().st_size
        except (OSError, ValueError):
            continue
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            n = math.prod(entry.get("shape", []))
            elements += n
            largest = max(largest, n)
            tensors += 1
    if elements:
        return ModelSize(elements, largest, stored, tensors)
    stored = sum(p.stat().st_size for p in files if p.suffix in _OTHER_WEIGHTS)
    return ModelSize(0, 0, stored) if stored else None


# --------------------------------------------------------------------------- shared memory
def shm_fix(base: str, transfer: bool = True) -> str:
    """The ways out of a full ``base`` (``/dev/shm``), for the error messages; ``transfer``:
    with those of the ``shm`` transfer's settings."""
    fix = (
        f"give {base} more room (docker run --shm-size=8g, or --ipc=host; a bare host: "
        f"mount -o remount,size=8g {base}), or free it"
    )
    if transfer:
        fix += (
            ", or lower refit.bucket_size_mb (each of the 2 staging buffers holds one "
            'bucket), or use another refit.transport ("nccl"; "cuda_ipc" on GPUs), '
            "which stages nothing there"
        )
    return fix


def shm_need(cfg: Any, size: ModelSize | None, buffers: int) -> int:
    """Bytes the ``shm`` transfer's staging files will hold in ``/dev/shm``.

    Each of the ``buffers`` staging buffers (:data:`asyncrl.transfers.STAGING_BUFFERS`) is
    sized for the largest
    bucket it holds: at most ``bucket_size_mb`` (plus one alignment), or one tensor larger
    than that; and the buckets of all the buffers are distinct parts of the model, so together
    they hold at most the whole model. The bytes are counted in ``model.dtype``, the dtype the trainer
    sends every weight in (``TrainingBackend.weight_specs``), whatever the files store (a
    float32 checkpoint served in bfloat16 sends half its file size); counting every tensor
    of the files, buffers included, and rounding each tensor up to the alignment errs on the
    large side. Without safetensors headers the largest tensor is taken to fit a bucket.
    Without weight files (a model the backend builds itself): ``buffers`` full
    buckets, the most the transfer can stage. Each file is rounded up to whole pages.
    """
    refit = cfg.refit
    bucket = refit.bucket_size_mb << 20
    per_element = _DTYPE_BYTES[cfg.model.dtype]
    if size is None:
        per_buffer, total = bucket, buffers * bucket
    else:
        largest = size.largest * per_element
        per_buffer = max(bucket + _ALIGN, largest + _ALIGN)
        total = size.served_bytes(cfg.model.dtype) + max(size.tensors, 1) * _ALIGN
    need = min(buffers * per_buffer, total)
    pages = -(-need // _PAGE) + buffers
    return pages * _PAGE


def _check_shm(
    cfg: Any, size: ModelSize | None, engines: Mapping[str, int], buffers: int
) -> None:
    parts: list[tuple[int, str]] = []
    transfer = cfg.refit.transport == "shm"
    if transfer:
        how = (
            f"min(refit.bucket_size_mb = {cfg.refit.bucket_size_mb} MiB, the model's "
            f"{size_text(size.served_bytes(cfg.model.dtype))} in {cfg.model.dtype})"
            if size is not None
            else f"refit.bucket_size_mb = {cfg.refit.bucket_size_mb} MiB (model.path holds no "
            "weight file to size the model by)"
        )
        parts.append((shm_need(cfg, size, buffers), f"the shm weight transfer's {buffers} "
                                                    f"staging files of up to {how}"))
    engine = max(engines.items(), key=lambda item: item[1], default=("", 0))
    if engine[1] > 0:
        # engines start at once, and their queues are sparse files (pages are taken as they
        # are written): each needs its size free when it starts, not one on top of the other
        section = engine[0].partition(".")[0]
        parts.append((engine[1], f"what {engine[0]} = {getattr(cfg, section).backend!r} needs "
                                 "free when one of its ranks starts (its engine's shared-memory "
                                 "queues)"))
    base = shm_base()
    need = sum(n for n, _ in parts)
    free = free_bytes(base)
    if not parts or free is None or free >= need:
        return
    field = "refit.transport" if transfer else engine[0]
    detail = (f"for {parts[0][1]}" if len(parts) == 1 else
              "; ".join(f"{size_text(n)} for {what}" for n, what in parts))  # fmt: skip
    raise ConfigError(
        f"{field}: {base} has {size_text(free)} free, and the run needs {size_text(need)} "
        f"there ({detail}). Fix: {shm_fix(base, transfer)}"
    )


def trained_size(cfg: Any) -> ModelSize | None:
    """What a refit moves and a checkpoint or an export holds: the model's weights
    (:func:`model_size`), or with ``[lora]`` the adapter's alone (the base stays
    ``model.path``'s), unless its size cannot be read from ``config.json`` (the whole model is
    counted then)."""
    size = model_size(cfg.model.path)
    if not cfg.lora.enabled or size is None:
        return size
    try:
        n = cfg.lora.trainable_parameters(cfg.model.path)
    except ConfigError:  # no target modules known for this model
        return size
    return size if n is None else ModelSize(elements=n, largest=n, stored_bytes=0)


# --------------------------------------------------------------------------- disks
def checkpoint_need(cfg: Any, size: ModelSize | None) -> int:
    """Bytes one checkpoint takes at the least: the trainer's float32 master weights (Adam's
    two moments make its state about three times that) and, with ``checkpoint.save_model``,
    the ``model.dtype`` copy. 0 when the model's size is unknown."""
    if size is None:
        return 0
    model = size.served_bytes(cfg.model.dtype) if cfg.checkpoint.save_model else 0
    return size.served_bytes("float32") + model


def _disk_needs(cfg: Any, size: ModelSize | None) -> list[tuple[str, str, int, str]]:
    """``(field, directory, bytes, what)`` the run will write at the least."""
    needs = [("run.output_dir", cfg.run.output_dir, OUTPUT_FLOOR_BYTES, "logs and metrics")]
    if size is None:
        return needs
    served = size.served_bytes(cfg.model.dtype)
    ck, ex = cfg.checkpoint, cfg.export
    if ck.at_end or ck.every_steps > 0:
        needs.append(("checkpoint.dir", ck.dir, checkpoint_need(cfg, size), "one checkpoint"))
    if ex.at_end or ex.every_steps > 0:
        needs.append(("export.dir", ex.dir, served, "one export"))
    return needs


def _check_disks(cfg: Any, size: ModelSize | None) -> None:
    by_device: dict[int, list[tuple[str, str, int, str]]] = {}
    for need in _disk_needs(cfg, size):
        by_device.setdefault(_device(need[1]), []).append(need)
    for needs in by_device.values():
        total = sum(n[2] for n in needs)
        free = free_bytes(needs[0][1])
        if free is None or free >= total:
            continue
        fields = " and ".join(n[0] for n in needs)
        parts = ", ".join(f"{n[3]} in {n[1]} ({size_text(n[2])})" for n in needs)
        raise ConfigError(
            f"{needs[0][0]}: the file system of {_existing(needs[0][1])} has {size_text(free)} "
            f"free, and the run needs {size_text(total)} there at the least: {parts}. Fix: "
            f"free space there, or point {fields} at a file system with more room"
        )


def check_space(
    cfg: Any, engines: Mapping[str, int] | None = None, *, staging_buffers: int
) -> None:
    """Raise :class:`~asyncrl.errors.ConfigError` when ``/dev/shm`` or a directory the run
    writes to has less room than the run needs (module docstring). ``engines``: what each
    backend says one of its ranks needs free in ``/dev/shm`` at its start
    (``BackendPlugin.shm_bytes``), by its field (``generator.backend``); ``staging_buffers``:
    the buffers the ``shm`` transfer stages in turn. Blocking (reads the
    model's headers): call it off the event loop."""
    size = trained_size(cfg)
    _check_shm(cfg, size, engines or {}, staging_buffers)
    _check_disks(cfg, size)
