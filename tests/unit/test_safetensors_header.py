"""``asyncrl.safetensors.read_safetensors_header``: a real file's header and data offset, and
every way a file is not safetensors as the one documented ``ValueError`` (the vLLM backend's
refit check reads its checkpoint through it too)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from asyncrl.safetensors import read_safetensors_header


def test_a_file_safetensors_wrote_is_read(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    save_file({"w": np.zeros((3, 2), np.float32)}, str(path), metadata={"format": "pt"})
    header, start = read_safetensors_header(path)
    assert header["w"]["shape"] == [3, 2] and header["w"]["dtype"] == "F32"
    assert header["__metadata__"] == {"format": "pt"}
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])  # by hand: 8 + the length field
    assert start == 8 + length and path.stat().st_size - start == 3 * 2 * 4


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"", "0 bytes, shorter than a safetensors header"),
        (b"\x01\x02\x03", "3 bytes, shorter than a safetensors header"),
        (struct.pack("<Q", 1 << 40), "not a safetensors file"),
        (struct.pack("<Q", 50) + b"{}", "the header says 50 bytes, the file has 2"),
        (struct.pack("<Q", 5) + b"[1,2]", "not a JSON object"),
        (struct.pack("<Q", 3) + b"{x}", "Expecting property name"),
    ],
)
def test_what_is_not_safetensors_is_a_value_error(tmp_path: Path, raw: bytes, says: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=says):
        read_safetensors_header(path)


def test_the_vllm_checkpoint_check_says_which_file_is_short(tmp_path: Path) -> None:
    """A truncated checkpoint file used to raise ``struct.error`` out of the refit check."""
    from asyncrl_vllm.manifest import checkpoint_shapes

    raw = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (tmp_path / "b.safetensors").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="b.safetensors: 2 bytes, shorter"):
        checkpoint_shapes(tmp_path)
    (tmp_path / "b.safetensors").unlink()
    assert checkpoint_shapes(tmp_path) == {"w": [2]}
