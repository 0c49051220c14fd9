"""The ``cuda_ipc`` weight transfer without a GPU: its refusal of a trainer on the CPU, and the
reader's mappings of the senders' buffers (torch's rebuild of a CUDA tensor stood in for)."""

from __future__ import annotations

import pytest

from asyncrl.transfers import StagingSpec, load_transfer

pytestmark = pytest.mark.timeout(60)


def test_cuda_ipc_needs_a_trainer_on_a_gpu() -> None:
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="needs a trainer on a GPU .* use 'shm' on CPU"):
        load_transfer("cuda_ipc").stager(StagingSpec("x", 0, "cpu"))


def test_cuda_ipc_reader_keeps_one_mapping_per_sender_buffer(monkeypatch) -> None:
    """A buffer that grew is announced with a new handle: the reader drops the old mapping (so
    the sender's old allocation can be freed) and keeps the other buffer's."""
    torch = pytest.importorskip("torch")
    import msgspec

    from asyncrl_torch.transfers import cuda_ipc

    rebuilt: list[int] = []

    def fake_rebuild(*args: object) -> object:
        rebuilt.append(args[1][0])  # the buffer size
        return object()

    monkeypatch.setattr(cuda_ipc, "device_index_by_uuid", lambda uuid: 0)
    monkeypatch.setattr(torch.multiprocessing.reductions, "rebuild_cuda_tensor", fake_rebuild)

    def handle(slot: int, nbytes: int, stager: str = "run/0/a") -> bytes:
        return msgspec.msgpack.encode(cuda_ipc.CudaIpcHandle(
            stager=stager, slot=slot, gpu_uuid="GPU-x", nbytes=nbytes,
            storage_handle=bytes([slot, nbytes % 256]), storage_size_bytes=nbytes,
            storage_offset_bytes=0, ref_counter_handle=b"r", ref_counter_offset=0,
            event_handle=b"", event_sync_required=False,
        ))

    opener = cuda_ipc.CudaIpcOpener()
    a0, b0 = opener.open(handle(0, 100)), opener.open(handle(1, 100))
    assert opener.open(handle(0, 100)) is a0 and rebuilt == [100, 100]  # mapped once
    a1 = opener.open(handle(0, 300))  # buffer 0 grew
    assert a1 is not a0 and rebuilt == [100, 100, 300]
    assert opener.open(handle(1, 100)) is b0
    assert len(opener._open) == 2  # the old buffer 0 mapping is gone
    opener.open(handle(0, 100, stager="run/0/b"))  # another sender's buffer: kept apart
    assert len(opener._open) == 3
    opener.close()
    assert opener._open == {}
