"""The ``nccl`` weight transfer (asyncrl_torch.transfers.nccl) over gloo on the CPU, with real
processes: this process is the sender (trainer rank 0), spawned processes are the readers.

The sender drives the stager the way :mod:`asyncrl.worker.weights` does (begin, then per bucket
reserve/pack/seal/handle on alternating buffers, a buffer refilled only once every reader
answered the bucket that used it) and hands each handle to the readers through a pipe (bytes
only); a reader opens it and sends back the bytes it received, compared byte for byte.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncrl.procs.process import host_id
from asyncrl.transfers import Receiver, StagingSpec
from asyncrl_torch.transfers.collective import Place, fan_out, place_in
from asyncrl_torch.transfers.nccl import (
    IDENTITY_ENV_VAR,
    NCCL,
    TIMEOUT_ENV_VAR,
    NcclHandle,
    NcclOpener,
    NcclStager,
)

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch without gloo", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

REPLY_S = 30.0
ALIGN = 256
RNG = np.random.default_rng(11)


def _tasks() -> set[str]:
    """The ids of this process's threads (Python and native)."""
    return set(os.listdir("/proc/self/task"))


def _new_threads(before: set[str], wait_s: float = 5.0) -> set[str]:
    """Threads started since ``before`` that are still there after up to ``wait_s`` (a
    native thread may take a moment to end once its owner is gone)."""
    deadline = time.monotonic() + wait_s
    while (new := _tasks() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return new


# ---------------------------------------------------------------- the reader process
def _reader_main(conn: Any, identity: str | None) -> None:
    """A reader: ``("open", handle)`` → ``("ok", bytes)`` or ``("error", message)``;
    ``("close", None)`` → ``("closed", threads left over)``; ``("exit", None)``."""
    if identity is not None:
        os.environ[IDENTITY_ENV_VAR] = identity
    import torch

    torch.ones(8).add_(1)  # torch's own lazily started threads, before the baseline
    base = _tasks()
    opener = NcclOpener()
    while True:
        cmd, arg = conn.recv()
        if cmd == "open":
            try:
                view = opener.open(arg, "cpu")
                assert view.dtype == torch.uint8 and view.device.type == "cpu"
                conn.send(("ok", view.numpy().tobytes()))
            except Exception as exc:  # noqa: BLE001 - the test reads the message
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        elif cmd == "close":
            opener.close()
            opener.close()
            conn.send(("closed", sorted(_new_threads(base))))
        else:
            conn.close()
            return


class Reader:
    def __init__(self, identity: str | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_reader_main, args=(child, identity), daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def reply(self) -> tuple[Any, ...]:
        assert self.conn.poll(REPLY_S), "the reader did not answer"
        return self.conn.recv()

    def stop(self) -> int | None:
        if self.proc.is_alive():
            try:
                self.send("exit")
            except OSError:
                pass
            self.proc.join(REPLY_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        return self.proc.exitcode


@pytest.fixture
def readers() -> Iterator[list[Reader]]:
    started: list[Reader] = []
    yield started
    for r in started:
        r.stop()


@pytest.fixture
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wait bounded by 20 s (readers inherit it)."""
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "20")


# ---------------------------------------------------------------- the sender side
def _tensor(nbytes: int, kind: int) -> Any:
    """``nbytes`` of random data as a uint8 numpy array, a float32 or a bfloat16 tensor."""
    raw = RNG.integers(0, 256, nbytes, dtype=np.uint8)
    if kind % 3 == 0:
        return raw
    t = torch.from_numpy(raw.copy())
    return t.view(torch.float32) if kind % 3 == 1 else t.view(torch.bfloat16).reshape(2, -1)


def _bucket(sizes: Sequence[int]) -> list[Any]:
    return [_tensor(n, i) for i, n in enumerate(sizes)]


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, np.ndarray):
        return data.tobytes()
    return data.reshape(-1).view(torch.uint8).numpy().tobytes()


def _fill(stager: NcclStager, k: int, tensors: list[Any]) -> list[tuple[int, bytes]]:
    """Pack ``tensors`` into buffer ``k`` as the refit packer does (reserve before each, so the
    buffer grows mid-bucket), seal it. Returns each tensor's offset and bytes."""
    placed = []
    used = 0
    for t in tensors:
        data = _as_bytes(t)
        stager.reserve(k, used + len(data))
        stager.pack(k, used, t)
        placed.append((used, data))
        used += (len(data) + ALIGN - 1) // ALIGN * ALIGN
    stager.seal(k)
    return placed


def _check(received: bytes, placed: list[tuple[int, bytes]]) -> None:
    end = max((off + len(data) for off, data in placed), default=0)
    assert len(received) == end
    for off, data in placed:
        assert received[off : off + len(data)] == data


def _send_buckets(
    stager: NcclStager,
    readers: list[Reader],
    buckets: list[list[Any]],
    first_k: int = 0,
    buffers: int = 2,
) -> list[bytes]:
    """Stage ``buckets`` on ``buffers`` buffers in turn, each handle to every reader; buffer k
    is refilled only once every reader answered its previous bucket. Checks every bucket byte
    for byte; returns the handles."""
    pending: dict[int, list[tuple[int, bytes]]] = {}
    handles: list[bytes] = []

    def settle(index: int) -> None:
        for r in readers:
            status, payload = r.reply()
            assert status == "ok", payload
            _check(payload, pending[index])
        del pending[index]

    for index, tensors in enumerate(buckets):
        k = (first_k + index) % buffers
        if index >= buffers:
            settle(index - buffers)
        pending[index] = _fill(stager, k, tensors)
        handle = stager.handle(k)
        handles.append(handle)
        for r in readers:
            r.send("open", handle)
    for index in sorted(pending):
        settle(index)
    return handles


def _r(*names: str) -> list[Receiver]:
    return [Receiver(n) for n in names]


def _decode(handle: bytes) -> NcclHandle:
    return msgspec.msgpack.decode(handle, type=NcclHandle)


def _stager(buffers: int = 2) -> NcclStager:
    return NcclStager(StagingSpec(run_id="t", rank=0, device="cpu", buffers=buffers))


# ---------------------------------------------------------------- tests
def test_one_reader_receives_every_bucket_byte_for_byte(
    readers: list[Reader], short_timeout: None
) -> None:
    assert NCCL.name == "nccl" and NCCL.stager is NcclStager and NCCL.opener is NcclOpener
    readers.append(Reader())  # no identity: the only reader is rank 1
    stager = _stager()
    assert stager.backend == "gloo"
    try:
        stager.begin(_r("rollout:0"))
        # 3 KiB, 5 KiB, then 70 KiB back in buffer 0 (both sides grow their buffers)
        buckets = [_bucket([1000, 2048]), _bucket([4096, 1024]), _bucket([8192, 65536, 4])]
        handles = _send_buckets(stager, readers, buckets)
        decoded = [_decode(h) for h in handles]
        assert [h.seq for h in decoded] == [0, 1, 2]
        assert [h.nbytes for h in decoded] == [1024 + 2048, 4096 + 1024, 8192 + 65536 + 4]
        assert {h.ranks["rollout:0"] for h in decoded} == {1} and decoded[0].size == 2
        assert decoded[0].backend == "gloo" and decoded[0].port > 0
        # the next refit: same receivers, numbering goes on, buffers keep alternating
        stager.begin(_r("rollout:0"))
        handles = _send_buckets(stager, readers, [_bucket([300]), _bucket([])], first_k=1)
        assert [_decode(h).seq for h in handles] == [3, 4]
        assert _decode(handles[1]).nbytes == 0
        assert stager.groups_formed == 1 and {_decode(h).epoch for h in handles} == {0}
    finally:
        stager.close()


@pytest.mark.parametrize("buffers", [2, 3])
def test_two_readers_each_receive_every_bucket(
    readers: list[Reader], short_timeout: None, buffers: int
) -> None:
    """With three staging buffers, three broadcasts are queued before the first answer."""
    # the list order gives the ranks: rollout:1 is rank 1, rollout:0 rank 2
    readers.extend([Reader("rollout:0"), Reader("rollout:1")])
    stager = _stager(buffers)
    try:
        stager.begin(_r("rollout:1", "rollout:0"))
        buckets = [_bucket([512, 700]), _bucket([2000]), _bucket([9000, 300]), _bucket([64])]
        handles = _send_buckets(stager, readers, buckets, buffers=buffers)
        assert [_decode(h).seq for h in handles] == [0, 1, 2, 3]
        h = _decode(handles[0])
        assert h.size == 3 and h.ranks == {"rollout:1": 1, "rollout:0": 2}
    finally:
        stager.close()


def test_a_skipped_or_repeated_broadcast_is_refused_at_once(
    readers: list[Reader], short_timeout: None
) -> None:
    reader = Reader()
    readers.append(reader)
    stager = _stager()
    try:
        stager.begin(_r("rollout:0"))
        first = _fill(stager, 0, _bucket([1500]))
        h0 = stager.handle(0)
        reader.send("open", h0)
        status, payload = reader.reply()
        assert status == "ok"
        _check(payload, first)
        reader.send("open", h0)  # the very same handle again: the same bytes, no broadcast
        assert reader.reply() == ("ok", payload)

        second = _fill(stager, 1, _bucket([800]))
        reader.send("open", stager.handle(1))
        status, payload = reader.reply()
        assert status == "ok"
        _check(payload, second)

        start = time.monotonic()
        reader.send("open", h0)  # a repeat
        status, payload = reader.reply()
        assert status == "error" and "bucket broadcast 2 expected, got 0" in payload
        _fill(stager, 0, _bucket([900]))  # broadcast 2: this reader never takes it
        _fill(stager, 1, _bucket([700]))  # broadcast 3
        reader.send("open", stager.handle(1))  # a skip
        status, payload = reader.reply()
        assert status == "error" and "bucket broadcast 2 expected, got 3" in payload
        assert time.monotonic() - start < 5
        reader.send("close")
        assert reader.reply()[0] == "closed"
    finally:
        start = time.monotonic()
        stager.close()  # broadcast 1 fails once the reader left the group: no grace period
    assert time.monotonic() - start < 5


def test_a_group_without_readers_and_one_never_joined_are_dropped_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "3")
    stager = _stager()
    try:
        stager.begin(_r())  # a group of the sender alone forms at once
        _fill(stager, 0, _bucket([100, 200]))  # a broadcast to nobody completes
        stager.reserve(0, 10)  # waits for it
        stager.begin(_r())
        assert stager.groups_formed == 1
        stager.begin(_r("rollout:0"))  # its reader never comes
        start = time.monotonic()
        stager.begin(_r("rollout:1"))  # the group still forming is left to its timeout
        assert time.monotonic() - start < 2
        assert stager.groups_formed == 3
    finally:
        start = time.monotonic()
        stager.close()
    assert time.monotonic() - start < 2
    # the threads left forming their groups end at the rendezvous' timeout (3 s)
    deadline = time.monotonic() + 10
    while any(t.name == "asyncrl-nccl-sender" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a sender thread outlived its timeout"
        time.sleep(0.1)

    other = _stager()
    try:
        with pytest.raises(RuntimeError, match="duplicate receivers"):
            other.begin(_r("rollout:0", "rollout:0"))
    finally:
        other.close()


def test_reader_needs_its_identity_when_several_read(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = NcclHandle(
        backend="gloo", host="127.0.0.1", port=1, group="g", size=3, seq=0, nbytes=8,
        ranks={"rollout:0": 1, "rollout:1": 2},
    )  # fmt: skip
    encoded = msgspec.msgpack.encode(handle)
    opener = NcclOpener()
    monkeypatch.delenv(IDENTITY_ENV_VAR, raising=False)
    with pytest.raises(RuntimeError, match=f"set {IDENTITY_ENV_VAR}"):
        opener.open(encoded, "cpu")
    monkeypatch.setenv(IDENTITY_ENV_VAR, "rollout:7")
    with pytest.raises(RuntimeError, match="'rollout:7' is not a receiver"):
        opener.open(encoded, "cpu")
    with pytest.raises(RuntimeError, match="bucket broadcast 0 of a new group expected, got 4"):
        opener.open(msgspec.msgpack.encode(msgspec.structs.replace(handle, seq=4)), "cpu")
    opener.close()
    opener.close()


def test_close_leaves_nothing_behind_and_is_idempotent(
    readers: list[Reader], short_timeout: None
) -> None:
    torch.ones(8).add_(1)
    base = _tasks()
    reader = Reader()
    readers.append(reader)
    stager = _stager()
    stager.begin(_r("rollout:0"))
    _send_buckets(stager, [reader], [_bucket([100]), _bucket([200]), _bucket([300])])
    assert any(t.name == "asyncrl-nccl-sender" for t in threading.enumerate())
    reader.send("close")
    assert reader.reply() == ("closed", [])
    reader.send("open", stager.handle(0))
    status, payload = reader.reply()
    assert status == "error" and "closed" in payload
    stager.close()
    stager.close()
    assert not any(t.name == "asyncrl-nccl-sender" for t in threading.enumerate())
    assert not _new_threads(base)
    with pytest.raises(RuntimeError, match="closed"):
        stager.begin(_r("rollout:0"))
    assert reader.stop() == 0


def test_fan_out_sends_once_per_other_host() -> None:
    r = [f"rollout:{i}" for i in range(6)]
    # by hand: the sender's host and unknown hosts in its group, one leader per other host
    assert fan_out(r[:4], ["b", "b", "a", "b"], "a") == (["rollout:2", "rollout:0"],
                                                         {"rollout:0": ["rollout:1", "rollout:3"]})
    assert fan_out(r, ["c", "", "b", "c", "b", "d"], "a") == (
        ["rollout:1", "rollout:0", "rollout:2", "rollout:5"],
        {"rollout:0": ["rollout:3"], "rollout:2": ["rollout:4"]},
    )
    assert fan_out(r[:3], ["a", "a", "a"], "a") == (r[:3], {})  # all on the sender's host
    assert fan_out([], [], "a") == ([], {})
    with pytest.raises(ValueError):
        fan_out(r[:2], ["a"], "a")


def test_readers_of_another_host_get_each_bucket_from_their_leader(
    readers: list[Reader], short_timeout: None
) -> None:
    """Three readers on a host 'far' and one on the sender's: the sender's group holds the
    near one and far's leader, which passes each bucket on to the other two."""
    names = [f"rollout:{i}" for i in range(4)]
    readers.extend(Reader(n) for n in names)
    hosts = ["far", "far", host_id(), "far"]
    stager = _stager()
    try:
        stager.begin([Receiver(n, h) for n, h in zip(names, hosts)])
        buckets = [_bucket([700, 3000]), _bucket([64]), _bucket([]), _bucket([12000, 8, 4])]
        handles = _send_buckets(stager, readers, buckets)
        h = _decode(handles[0])
        assert h.size == 3 and h.ranks == {"rollout:2": 1, "rollout:0": 2}
        assert h.fans == {"rollout:0": ["rollout:1", "rollout:3"]}
        stager.begin([Receiver(n, h) for n, h in zip(names, hosts)])  # the same group
        handles = _send_buckets(stager, readers, [_bucket([333])])
        assert stager.groups_formed == 1 and _decode(handles[0]).seq == 4
        # a far reader left out (restarting): a new group, far's leader feeds one reader
        stager.begin([Receiver(n, h) for n, h in zip(names[:3], hosts[:3])])
        handles = _send_buckets(stager, readers[:3], [_bucket([900]), _bucket([10])])
        assert _decode(handles[0]).fans == {"rollout:0": ["rollout:1"]}
    finally:
        stager.close()


def test_a_new_group_when_a_reader_is_left_out_then_comes_back(
    readers: list[Reader], short_timeout: None
) -> None:
    """rollout:1 dies between refits: the next refit forms a group without it, and its new
    process joins a third one, while rollout:0 moves from group to group."""
    readers.extend([Reader("rollout:0"), Reader("rollout:1")])
    stager = _stager()
    try:
        stager.begin(_r("rollout:0", "rollout:1"))
        first = _send_buckets(stager, readers, [_bucket([1000]), _bucket([2000])])
        readers[1].proc.kill()
        readers[1].proc.join(5)
        stager.begin(_r("rollout:0"))
        alone = _send_buckets(stager, readers[:1], [_bucket([500]), _bucket([40])])
        readers[1] = Reader("rollout:1")  # its new process
        stager.begin(_r("rollout:0", "rollout:1"))
        again = _send_buckets(stager, readers, [_bucket([4000, 8]), _bucket([77])])
        epochs = [[_decode(h).epoch for h in hs] for hs in (first, alone, again)]
        assert epochs == [[0, 0], [1, 1], [2, 2]] and stager.groups_formed == 3
        assert [_decode(h).seq for h in again] == [0, 1]  # numbered afresh in each group
        # an older group's handle is refused, at once
        readers[0].send("open", alone[0])
        status, payload = readers[0].reply()
        assert status == "error" and "older weight broadcast group" in payload
        # the same names, but rollout:1 is a new process (it died and came back before the
        # sender saw it gone): a new group too, told by its pid
        procs = [Receiver(f"rollout:{i}", "", r.proc.pid) for i, r in enumerate(readers)]
        stager.begin(procs)
        _send_buckets(stager, readers, [_bucket([10])])
        stager.begin(procs)
        _send_buckets(stager, readers, [_bucket([20])])
        assert stager.groups_formed == 4
        readers[1].stop()
        readers[1] = Reader("rollout:1")
        stager.begin([procs[0], Receiver("rollout:1", "", readers[1].proc.pid)])
        _send_buckets(stager, readers, [_bucket([30, 40])])
        assert stager.groups_formed == 5
    finally:
        stager.close()


def test_each_reader_finds_its_place_from_the_handle_alone() -> None:
    ranks, fans = {"rollout:2": 1, "rollout:0": 2}, {"rollout:0": ["rollout:1", "rollout:3"]}
    assert place_in("rollout:2", ranks, fans, 3) == Place(1, "rollout:2", 0, 0)
    assert place_in("rollout:0", ranks, fans, 3) == Place(2, "rollout:0", 0, 3)  # a leader
    assert place_in("rollout:3", ranks, fans, 3) == Place(-1, "rollout:0", 2, 3)
    assert place_in(None, {"rollout:0": 1}, {}, 2) == Place(1)  # the only reader
    with pytest.raises(RuntimeError, match="set ASYNCRL_TRANSFER_IDENTITY"):
        place_in(None, {"rollout:0": 1}, {"rollout:0": ["rollout:1"]}, 2)
    with pytest.raises(RuntimeError, match=r"'rollout:9' is not a receiver .*'rollout:3'"):
        place_in("rollout:9", ranks, fans, 3)
