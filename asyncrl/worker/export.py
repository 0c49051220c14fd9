"""The policy as a Hugging Face model directory: safetensors shards, config and tokenizer.

Trainer rank 0 streams :meth:`TrainingBackend.iter_weights` into safetensors files written
here (the other ranks only take part in the gathers), so an export needs no more host memory
than one tensor, and works for any training backend. The header of each shard is computed
from :meth:`TrainingBackend.weight_specs` before any tensor arrives.

The safetensors layout (https://huggingface.co/docs/safetensors): an 8-byte little-endian
header length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
padded with spaces to a multiple of 8, then the tensors' bytes back to back in header order.

Everything but the weights (``config.json``, ``generation_config.json``, tokenizer files, a
chat template...) is copied from the starting model directory; ``config.json`` gets the
exported dtype as ``torch_dtype``. The directory is written under a temporary name and renamed,
so a reader never sees half an export. A floating-point tensor holding a NaN or an infinity
stops the export (:class:`~asyncrl.errors.NonFiniteError`, nothing is left behind): the last
line of defence after the trainer's own checks. No torch import at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.backend import WeightTensor, drain_weights
from asyncrl.errors import NonFiniteError
from asyncrl.safetensors import read_safetensors_header

__all__ = [
    "SAFETENSORS_DTYPES",
    "copy_model_dir",
    "count_nonfinite",
    "export_model",
    "nonfinite_tensors",
    "plan_shards",
    "write_hf_model",
]

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
             "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_NONFINITE_BITS = {
    "F64": (np.uint64, 0x7FF0000000000000),
    "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),  # no infinities; NaN is S.1111.111
}
"""Per float dtype: the unsigned view and the bits that are all ones in a NaN or an infinity
(the exponent; for float8_e4m3fn the exponent and mantissa)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")
"""Files of the starting model directory that are weights, never copied into an export."""
DEFAULT_SHARD_BYTES = 5 << 30


def _nbytes(spec: WeightTensor) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * _ITEMSIZE[SAFETENSORS_DTYPES[spec.dtype]]


def plan_shards(specs: list[WeightTensor], shard_bytes: int) -> list[list[WeightTensor]]:
    """Consecutive tensors into shards of at most ``shard_bytes`` (a larger tensor alone)."""
    shards: list[list[WeightTensor]] = [[]]
    size = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} has no safetensors name")
        n = _nbytes(spec)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _header(specs: list[WeightTensor]) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        n = _nbytes(spec)
        meta[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def count_nonfinite(data: memoryview, dtype: str) -> int:
    """NaNs and infinities among the little-endian values of safetensors dtype ``dtype`` in
    ``data`` (0 for an integer dtype), read from the bits."""
    if dtype not in _NONFINITE_BITS:
        return 0
    view, mask = _NONFINITE_BITS[dtype]
    bits = np.frombuffer(data, dtype=np.dtype(view).newbyteorder("<"))
    return int(np.count_nonzero((bits & view(mask)) == view(mask)))


def nonfinite_tensors(path: str | os.PathLike[str]) -> dict[str, int]:
    """The tensors of the safetensors file at ``path`` that hold NaNs or infinities, with how
    many (read from the bits through a read-only map, so a large file costs no memory)."""
    header, start = read_safetensors_header(path)
    if os.path.getsize(path) == start:
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start)
    found = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        bad = count_nonfinite(memoryview(data[begin:end]), info["dtype"])
        if bad:
            found[name] = bad
    return found


def _host_bytes(data: Any) -> memoryview:
    """The tensor's bytes on the host (a torch tensor on any device, or a numpy array)."""
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data)).cast("B")
    import torch  # a trainer's tensor: torch is there

    # always a copy of our own: numpy must never hold a trainer's live storage (FSDP2 resizes
    # the storage of a gathered unit once the iteration moves on; .cpu() of a CPU tensor
    # would be the same storage)
    flat = data.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True)
    return memoryview(flat.numpy()).cast("B")


def write_hf_model(
    out: str | os.PathLike[str],
    specs: list[WeightTensor],
    tensors: Iterable[WeightTensor],
    *,
    source_dir: str | os.PathLike[str],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    adapter_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``tensors`` (in ``specs``' order, with data) as a Hugging Face directory at
    ``out`` (replaced if it exists), with the other files of ``source_dir``. Returns ``out``.
    With ``adapter_config`` (a LoRA run: ``tensors`` are the adapter's) a PEFT adapter
    directory instead: ``adapter_model.safetensors`` (one file) and that
    ``adapter_config.json``, loadable by PEFT on the base and by vLLM as a LoRA adapter.

    Raises:
        ValueError: a tensor that is not the next one of ``specs`` (name, dtype or size).
        NonFiniteError: a tensor holds a NaN or an infinity (nothing is written at ``out``).
    """
    out = Path(out)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        shards = plan_shards(specs, shard_bytes) if adapter_config is None else [specs]
        names = (
            ["model.safetensors" if adapter_config is None else "adapter_model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        it: Iterator[WeightTensor] = iter(tensors)
        for name, shard in zip(names, shards):
            with open(tmp / name, "wb") as f:
                f.write(_header(shard))
                for spec in shard:
                    got = next(it, None)
                    if got is None or got.name != spec.name or got.data is None:
                        raise ValueError(
                            f"export: expected tensor {spec.name}, got "
                            f"{'the end' if got is None else got.name}"
                        )
                    data = _host_bytes(got.data)
                    if data.nbytes != _nbytes(spec) or got.dtype != spec.dtype:
                        raise ValueError(
                            f"export: {spec.name} has {data.nbytes} bytes of {got.dtype}, the "
                            f"manifest says {_nbytes(spec)} of {spec.dtype}"
                        )
                    _check_finite(data, spec, out)
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if next(it, None) is not None:
            raise ValueError("export: more tensors than weight_specs listed")
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(_nbytes(s) for s in specs)},
                "weight_map": {s.name: n for n, shard in zip(names, shards) for s in shard},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if adapter_config is not None:
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        else:
            dtypes = {s.dtype for s in specs}
            copy_model_dir(source_dir, tmp, torch_dtype=dtypes.pop() if len(dtypes) == 1 else None)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_finite(data: memoryview, spec: WeightTensor, out: Path) -> None:
    bad = count_nonfinite(data, SAFETENSORS_DTYPES[spec.dtype])
    if bad:
        raise NonFiniteError(
            f"export to {out}: {spec.name} holds {bad} NaN or infinite values, so nothing was "
            "exported; the trainer's weights are not finite (a corrupted checkpoint or a "
            "diverged step). Fix: resume or export from an older checkpoint"
        )


def export_model(
    backend: Any,
    rank: int,
    path: str | os.PathLike[str],
    *,
    source_dir: str | os.PathLike[str],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    adapter_config: dict[str, Any] | None = None,
) -> None:
    """One trainer rank's part of an export (blocking; on the trainer's thread): every rank
    iterates ``backend.iter_weights()`` (the gathers are collective), rank 0 writes them (a
    PEFT adapter directory with ``adapter_config``: :func:`write_hf_model`)."""
    it = backend.iter_weights()
    if rank != 0:
        drain_weights(it)
        return
    try:
        write_hf_model(
            path, backend.weight_specs(), it, source_dir=source_dir, shard_bytes=shard_bytes,
            adapter_config=adapter_config,
        )
    except BaseException:
        drain_weights(it, after_failure=True)
        raise


def copy_model_dir(
    source: str | os.PathLike[str], dest: str | os.PathLike[str], *, torch_dtype: str | None
) -> None:
    """Copy every file of ``source`` but its weights into ``dest`` (config, generation
    config, tokenizer, chat template...), setting ``torch_dtype`` in ``config.json``."""
    source, dest = Path(source), Path(dest)
    for p in source.iterdir():
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.endswith(
            (".safetensors.index.json", ".bin.index.json")
        ):
            shutil.copy2(p, dest / p.name)
    config = dest / "config.json"
    if torch_dtype is not None and config.is_file():
        data = json.loads(config.read_text())
        data["torch_dtype"] = torch_dtype
        config.write_text(json.dumps(data, indent=2) + "\n")
