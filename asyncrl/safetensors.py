"""A safetensors file's header, read with the standard library alone (no ``safetensors``
package, no torch): the space checks size a model with it, the export checks what it wrote,
and the vLLM backend checks refits against the checkpoint it started from.

The layout: 8 bytes, the header's length as a little-endian u64; the header, JSON (``{name:
{"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``); then the tensors' bytes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

__all__ = ["MAX_HEADER_BYTES", "read_safetensors_header"]

MAX_HEADER_BYTES = 100 << 20
"""No real header is this large: a file that says so is not safetensors."""


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset of its data section.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not safetensors (shorter than the length field, a header
            length no real file has, a header cut short, or no JSON object).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {len(head)} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a {length}-byte header (not a safetensors file)")
        raw = f.read(length)
    if len(raw) < length:
        raise ValueError(f"{path}: the header says {length} bytes, the file has {len(raw)}")
    header = json.loads(raw)  # a JSONDecodeError is a ValueError
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    return header, 8 + length
