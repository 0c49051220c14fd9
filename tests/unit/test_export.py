"""The safetensors writer (:mod:`asyncrl.worker.export`) against the ``safetensors`` library's own
reader, and the directory it produces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

from asyncrl.backend import WeightTensor
from asyncrl.errors import NonFiniteError
from asyncrl.worker.export import copy_model_dir, plan_shards, write_hf_model


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "source"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "x", "torch_dtype": "float32"}))
    (src / "tokenizer.json").write_text("{}")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "model.safetensors").write_bytes(b"old weights")
    (src / "pytorch_model.bin.index.json").write_text("{}")
    return src


def _specs_and_tensors(dtype: torch.dtype) -> tuple[list[WeightTensor], list[WeightTensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (7, 5), "b.bias": (3,), "c.scalar": (), "d.big": (64, 33)}
    tensors = [
        WeightTensor(name, str(dtype).removeprefix("torch."), shape,
                     torch.randn(shape, generator=gen).to(dtype))  # fmt: skip
        for name, shape in shapes.items()
    ]
    specs = [WeightTensor(t.name, t.dtype, t.shape) for t in tensors]
    return specs, tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_file_reads_back_bit_for_bit(tmp_path: Path, source: Path, dtype) -> None:
    specs, tensors = _specs_and_tensors(dtype)
    out = write_hf_model(tmp_path / "out", specs, tensors, source_dir=source)
    loaded = load_torch(str(out / "model.safetensors"))
    assert list(loaded) == [t.name for t in tensors]  # header order = data order
    for t in tensors:
        assert loaded[t.name].dtype == dtype and torch.equal(loaded[t.name], t.data)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_shards_and_index(tmp_path: Path, source: Path) -> None:
    specs, tensors = _specs_and_tensors(torch.float32)
    out = write_hf_model(tmp_path / "out", specs, tensors, source_dir=source, shard_bytes=256)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # a: 140 B, b: 12 B, c: 4 B fill the first shard; d (8448 B) gets one of its own
    assert index["weight_map"] == {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.bias": "model-00001-of-00002.safetensors",
        "c.scalar": "model-00001-of-00002.safetensors",
        "d.big": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 4 * (35 + 3 + 1 + 64 * 33)
    for t in tensors:
        got = load_numpy(str(out / index["weight_map"][t.name]))[t.name]
        np.testing.assert_array_equal(got, t.data.numpy())


def test_numpy_bytes_are_accepted(tmp_path: Path, source: Path) -> None:
    table = np.arange(12, dtype=np.float32).reshape(3, 4)
    spec = WeightTensor("table", "float32", (3, 4))
    data = WeightTensor("table", "float32", (3, 4), table.reshape(-1).view(np.uint8))
    out = write_hf_model(tmp_path / "out", [spec], [data], source_dir=source)
    np.testing.assert_array_equal(load_numpy(str(out / "model.safetensors"))["table"], table)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ts: ts[:2], "expected tensor c.scalar, got the end"),
        (lambda ts: ts + ts[:1], "more tensors than weight_specs listed"),
        (lambda ts: [ts[1], *ts[1:]], "expected tensor a.weight, got b.bias"),
        (lambda ts: [WeightTensor("a.weight", "float32", (7, 5), torch.zeros(7, 4)), *ts[1:]],
         "a.weight has 112 bytes of float32, the manifest says 140"),
    ],
    ids=["too-few", "too-many", "out-of-order", "wrong-size"],
)
def test_a_stream_that_breaks_the_manifest_leaves_nothing(
    tmp_path: Path, source: Path, mutate, message: str
) -> None:
    specs, tensors = _specs_and_tensors(torch.float32)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        write_hf_model(out, specs, mutate(tensors), source_dir=source)
    assert list(tmp_path.iterdir()) == [source]


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2,
     torch.float8_e4m3fn],
    ids=str,
)
def test_nonfinite_values_are_counted_from_the_bits(dtype) -> None:
    """Against torch's own isfinite, over every bit pattern of the small dtypes."""
    from asyncrl.worker.export import SAFETENSORS_DTYPES, count_nonfinite

    if dtype.itemsize <= 2:  # every pattern: NaNs of every payload, both infinities
        bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
        values = bits.to(torch.int16 if dtype.itemsize == 2 else torch.uint8).view(dtype)
    else:
        values = torch.tensor([1.0, -0.0, float("nan"), float("inf"), -float("inf"), 3e38,
                               -1e-45, float("nan")]).to(dtype)  # fmt: skip
    want = int((~torch.isfinite(values.to(torch.float64))).sum())
    assert want > 0
    data = memoryview(values.contiguous().view(torch.uint8).numpy()).cast("B")
    name = SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")]
    assert count_nonfinite(data, name) == want
    assert count_nonfinite(memoryview(np.arange(256, dtype=np.uint8)), "U8") == 0


def test_a_nonfinite_tensor_stops_the_export_and_leaves_nothing(
    tmp_path: Path, source: Path
) -> None:
    specs, tensors = _specs_and_tensors(torch.bfloat16)
    tensors[3].data[5, 7] = float("nan")
    tensors[3].data[0, 0] = -float("inf")
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError, match=r"export to .*out: d.big holds 2 NaN or infinite "
                       r"values, so nothing was exported.*Fix: resume or export from an older"):
        write_hf_model(out, specs, tensors, source_dir=source)
    assert list(tmp_path.iterdir()) == [source]


def test_an_existing_export_is_replaced_whole(tmp_path: Path, source: Path) -> None:
    specs, tensors = _specs_and_tensors(torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"x")
    write_hf_model(out, specs, tensors, source_dir=source)
    assert not (out / "stale.safetensors").exists()


def test_plan_shards_refuses_an_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="complex64 has no safetensors name"):
        plan_shards([WeightTensor("x", "complex64", (2,))], 1 << 20)


def test_copy_model_dir_leaves_config_alone_without_a_dtype(tmp_path: Path, source: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    copy_model_dir(source, dest, torch_dtype=None)
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] == "float32"
