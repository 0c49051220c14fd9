"""The vLLM engine's mirror buffers (asyncrl_vllm.mirror), on the CPU: one buffer per sender
buffer, kept across refits, refilled in place, dropped once a refit did not use it. The
overlap of copies and scatters (CUDA streams and events) runs in tests/gpu."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from asyncrl_vllm.mirror import Mirror  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_each_sender_buffer_gets_a_buffer_of_its_size_kept_across_refits() -> None:
    mirror = Mirror(torch.device("cpu"))
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.arange(32, dtype=torch.uint8) + 100
    buf_a, event, fresh = mirror.fetch(b"A", a, 40)
    assert event is None and fresh and buf_a.numel() == 64
    assert torch.equal(buf_a[:40], a[:40])
    buf_b, _, fresh = mirror.fetch(b"B", b, 32)
    assert fresh and buf_b.numel() == 32 and torch.equal(buf_b, b)
    a.fill_(7)  # the sender refills its buffer in place for the next refit
    again, _, fresh = mirror.fetch(b"A", a, 64)
    assert not fresh and again.data_ptr() == buf_a.data_ptr()  # same buffer: kept views hold
    assert torch.equal(again, a)
    assert mirror.nbytes == 96


def test_buffers_a_refit_did_not_use_are_dropped_at_the_next() -> None:
    """Three staging buffers: three mirror buffers. The sender's buffer B grows (a new
    handle, B2): B's mirror buffer is dropped when the refit after the one that stopped using
    it begins, and B, should it come back, gets a fresh buffer (views of the old one must not
    be replayed)."""
    mirror = Mirror(torch.device("cpu"))
    memory = torch.ones(8, dtype=torch.uint8)
    for handle in (b"A", b"B", b"C"):
        mirror.fetch(handle, memory, 8)
    assert mirror.nbytes == 3 * 8
    mirror.next_refit()
    for handle in (b"A", b"B2", b"C"):
        _, _, fresh = mirror.fetch(handle, torch.ones(16 if handle == b"B2" else 8,
                                                      dtype=torch.uint8), 8)
        assert fresh == (handle == b"B2")
    assert mirror.nbytes == 8 + 8 + 16 + 8  # B is still held during this refit
    mirror.next_refit()
    assert mirror.nbytes == 8 + 16 + 8
    _, _, fresh = mirror.fetch(b"B", memory, 8)
    assert fresh


def test_no_room_disables_the_mirror_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = Mirror(torch.device("cpu"))
    memory = torch.ones(8, dtype=torch.uint8)
    mirror.fetch(b"A", memory, 8)
    real_empty = torch.empty

    def no_room(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        mirror.fetch(b"B", memory, 8)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert mirror.disabled and mirror.nbytes == 0
