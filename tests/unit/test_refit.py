"""The refit protocol (asyncrl.worker.weights) end to end in one process: a real WeightSender and
WeightReceiver over ipc:// with the ``shm`` transfer and a recording generation backend.

Several buckets (with both staging buffers reused), byte-exact delivery, the manifest check
before any weight is touched, a refused bucket that leaves the previous weights serving, a
failed load that leaves the engine paused, a trainer that breaks its own manifest, a
receiver that never pulls, and receivers whose processes exit mid-refit (left out; the others
still get every message).
"""

from __future__ import annotations

import math
import os
import time
import shutil
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.backend import WeightBucketView, WeightTensor
from asyncrl.wire.codec import Codec
from asyncrl.errors import EngineDeadError, RefitError
from asyncrl.wire.messages import Bucket, Manifest, TensorEntry, WeightMessage, WeightsPull
from asyncrl.worker.buckets import Packer, bucket_layout, check_bucket, manifest_of
from asyncrl.worker.weights import WeightReceiver, WeightSender
from asyncrl.procs.process import host_id
from asyncrl.transfers import StagingSpec, load_transfer
from asyncrl.procs.space import shm_dir
from asyncrl.transfers.shm import read_bytes
from asyncrl.wire.transport import Context, ipc_address

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

RNG = np.random.default_rng(7)
# five tensors of 40/24/64/8/100 KiB with a 96 KiB bucket: [40+24] [64+8] [100, alone in a
# bucket of its size]; bucket 2 reuses staging buffer 0
SHAPES = {"a": (10, 1024), "b": (6, 1024), "c": (16, 1024), "d": (2, 1024), "e": (25, 1024)}
BUCKET = 96 << 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def weights() -> dict[str, np.ndarray]:
    return {n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def specs() -> list[WeightTensor]:
    return [WeightTensor(n, "float32", s) for n, s in SHAPES.items()]


def tensors(w: dict[str, np.ndarray]) -> Iterator[WeightTensor]:
    for n, a in w.items():
        yield WeightTensor(n, "float32", a.shape, a.reshape(-1).view(np.uint8))


class Engine:
    """A generation backend's refit side that records what it was given."""

    def __init__(
        self, fail_load_at: int | None = None, refuse: str | None = None, pause_s: float = 0.0
    ) -> None:
        self.weights: dict[str, np.ndarray] = {}
        self.staged: dict[str, np.ndarray] = {}
        self.buckets: list[list[str]] = []
        self.handles: list[tuple[bytes, int]] = []
        self.events: list[Any] = []
        self.fail_load_at = fail_load_at
        self.refuse = refuse
        self.pause_s = pause_s
        self.paused_until = 0.0  # perf_counter() when the last manifest's pause ended

    async def begin_weight_update(
        self, version: int, manifest: list[TensorEntry], *, kv_scales: Any = None
    ) -> None:
        if self.refuse:
            raise ValueError(self.refuse)
        await anyio.sleep(self.pause_s)  # an engine pausing
        self.paused_until = time.perf_counter()
        self.events.append(("begin", version, [e.name for e in manifest], kv_scales))

    async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
        if bucket.index == self.fail_load_at:
            raise RuntimeError("out of device memory")
        self.buckets.append([e.name for e in bucket.entries])
        self.handles.append((bucket.handle, bucket.nbytes))
        for e in bucket.entries:
            raw = read_bytes(bucket.handle, e.offset, e.nbytes)
            self.staged[e.name] = raw.view(np.float32).reshape(e.shape)

    async def abort_weight_update(self, version: int, *, loaded_any: bool) -> None:
        self.events.append(("abort", version, loaded_any))
        self.staged = {}

    async def finish_weight_update(self, version: int, *, reset_prefix_cache: bool) -> None:
        self.events.append(("finish", version, reset_prefix_cache))
        self.weights, self.staged = self.staged, {}

    async def reprefill_in_flight(self) -> None:
        self.events.append(("reprefill", sorted(self.staged)))


class Pair:
    def __init__(self, run_dir: str, buffers: int = 2) -> None:
        self.ctx = Context()
        self.address = ipc_address(run_dir, "weights")
        self.run_id = uuid.uuid4().hex[:8]
        spec = StagingSpec(self.run_id, 0, "cpu", buffers=buffers)
        self.sender = WeightSender(self.ctx, self.address, load_transfer("shm"), spec)
        self.receiver = WeightReceiver(self.ctx, self.address, "rollout:0")

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.ctx.close()
        shutil.rmtree(shm_dir(self.run_id), ignore_errors=True)


async def refit(pair: Pair, engine: Engine, w: dict[str, np.ndarray], version: int = 1,
                timeout_s: float = 10.0, reprefill: bool = False) -> tuple[Any, Any]:
    out: dict[str, Any] = {}

    async def send() -> None:
        try:
            out["sent"] = await pair.sender.send(
                version, ["rollout:0"], specs(), tensors(w), bucket_size=BUCKET,
                timeout_s=timeout_s,
            )
        except RefitError as exc:
            out["sent"] = exc

    async def receive() -> None:
        try:
            out["received"] = await pair.receiver.receive(
                version, engine, transport="shm", reset_prefix_cache=True,
                kv_scales={"x.k_scale": 0.5}, timeout_s=timeout_s,
                reprefill=engine.reprefill_in_flight if reprefill else None,
            )
        except RefitError as exc:
            out["received"] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        tg.start_soon(receive)
    return out["sent"], out["received"]


async def test_several_buckets_arrive_byte_exact(run_dir: str) -> None:
    pair, engine = Pair(run_dir), Engine()
    try:
        for version in (1, 2):  # the second refit reuses both staging files
            w = weights()
            sent, received = await refit(pair, engine, w, version)
            assert engine.buckets[-3:] == [["a", "b"], ["c", "d"], ["e"]]
            assert sent.num_buckets == received.num_buckets == 3
            assert sent.num_tensors == received.num_tensors == 5
            assert sent.num_bytes == sum(a.nbytes for a in w.values())
            for name, a in w.items():
                np.testing.assert_array_equal(engine.weights[name], a)
            assert engine.events[-2][::3] == ("begin", {"x.k_scale": 0.5})
            assert engine.events[-1] == ("finish", version, True)
    finally:
        pair.close()


async def test_reprefill_comes_after_every_bucket_and_before_generation_resumes(
    run_dir: str,
) -> None:
    """The sampler's ``in_flight_at_refit = "reprefill"``: the requests in flight drop their
    KV cache once every weight is loaded (so the new weights recompute it) and before the
    engine resumes; without it, nothing is dropped."""
    pair, engine = Pair(run_dir), Engine()
    try:
        w = weights()
        await refit(pair, engine, w, 1, reprefill=True)
        assert [e[0] for e in engine.events] == ["begin", "reprefill", "finish"]
        assert engine.events[1] == ("reprefill", sorted(w))  # all staged, none finished
        await refit(pair, engine, w, 2)
        assert [e[0] for e in engine.events[3:]] == ["begin", "finish"]
    finally:
        pair.close()


async def test_buffers_are_sized_once_so_handles_repeat_across_refits(run_dir: str) -> None:
    """Each staging buffer is sized for the largest bucket it holds in the version before the
    first tensor is packed (bucket 2's 100 KiB tensor, alone, in buffer 0 after bucket 0's
    64 KiB): no buffer grows halfway through, so every refit announces the same handles, which
    lets a reader keep per-bucket plans (the vLLM backend's batched copies)."""
    pair, engine = Pair(run_dir), Engine()
    try:
        await refit(pair, engine, weights(), 1)
        first = list(engine.handles)
        await refit(pair, engine, weights(), 2)
        assert engine.handles[3:] == first
        kib = 1 << 10
        assert [n for _, n in first] == [64 * kib, 72 * kib, 100 * kib]  # by hand
        sizes = [4 * math.prod(s) for s in SHAPES.values()]
        assert bucket_layout(sizes, BUCKET) == [(2, 64 * kib), (2, 72 * kib), (1, 100 * kib)]
        assert len({h for h, _ in first}) == 2  # two buffers, each announced with one handle
    finally:
        pair.close()


async def test_the_first_bucket_is_packed_while_the_engine_pauses(run_dir: str) -> None:
    """The trainer packs bucket 0 while the receivers check the manifest and pause (it is
    announced only after every receiver accepted the manifest)."""
    pair, engine = Pair(run_dir), Engine(pause_s=0.3)
    asked: list[float] = []
    w = weights()

    def timed() -> Iterator[WeightTensor]:
        for t in tensors(w):
            asked.append(time.perf_counter())
            yield t

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: pair.sender.send(
                1, ["rollout:0"], specs(), timed(), bucket_size=BUCKET, timeout_s=10,
            ))
            tg.start_soon(lambda: pair.receiver.receive(
                1, engine, transport="shm", reset_prefix_cache=True, kv_scales=None,
                timeout_s=10,
            ))
        assert asked[0] < engine.paused_until  # packing did not wait for the pause (0.3 s)
        assert engine.buckets == [["a", "b"], ["c", "d"], ["e"]]
        for name, a in w.items():
            np.testing.assert_array_equal(engine.weights[name], a)
    finally:
        pair.close()


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    bucket=st.integers(1, 12000),
    buffers=st.integers(2, 4),
)
def test_the_packer_fills_the_buckets_bucket_layout_gives(
    sizes: list[int], bucket: int, buffers: int
) -> None:
    """The real packer, fed tensors of random sizes, closes its buckets exactly where
    ``bucket_layout`` (which sizes the staging buffers before packing) says, each holding the
    tensors a hand-written packing puts there: no buffer is ever asked for more than it was
    given, with any number of buffers used in turn."""

    class Stager:
        def __init__(self) -> None:
            self.size = [0] * buffers

        def reserve(self, k: int, n: int) -> None:
            self.size[k] = max(self.size[k], n)

        def pack(self, k: int, offset: int, data: np.ndarray, stable: bool = False) -> None:
            assert offset + data.nbytes <= self.size[k], "packed past the reserved size"

        def seal(self, k: int) -> None:
            pass

    specs_ = [WeightTensor(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    data = (WeightTensor(s.name, "uint8", s.shape, np.zeros(s.shape, np.uint8)) for s in specs_)
    packer = Packer(data, manifest_of(specs_), Stager(), bucket, buffers)
    filled, k, last = [], 0, False
    while not last:
        entries, n, last = packer.fill(k % buffers)
        filled.append((len(entries), n))
        k += 1
    assert filled == bucket_layout(sizes, bucket) == _by_hand(sizes, bucket)
    assert packer.count == len(sizes)


def _by_hand(sizes: list[int], bucket: int) -> list[tuple[int, int]]:
    """The rule in words: a bucket takes the next tensors while the next one still fits (its
    unaligned size added to the aligned sizes before it); a bucket always takes one tensor."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(sizes):
        taken = [sizes[i]]
        i += 1
        while i < len(sizes) and sum(-(-s // 256) * 256 for s in taken) + sizes[i] <= bucket:
            taken.append(sizes[i])
            i += 1
        out.append((len(taken), sum(-(-s // 256) * 256 for s in taken)))
    return out


class _NullStager:
    def reserve(self, k: int, n: int) -> None:
        pass

    def pack(self, k: int, offset: int, data: Any, stable: bool = False) -> None:
        pass

    def seal(self, k: int) -> None:
        pass


def test_the_packer_takes_no_tensor_of_the_next_bucket_and_counts_what_it_gets() -> None:
    """A bucket takes exactly its tensors: the trainer is not asked for the next bucket's
    first one (a sharded trainer gathers it only when asked); a trainer that yields fewer or
    more tensors than it promised is named."""
    sizes = [100, 100, 300]  # bucket 400: [100 at 0, 100 at 256: 512 used] [300 alone]
    promised = [WeightTensor(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    asked: list[str] = []

    def tensors(n: int) -> Iterator[WeightTensor]:
        for s in (promised * 2)[:n]:
            asked.append(s.name)
            yield WeightTensor(s.name if len(asked) <= 3 else "extra", "uint8", s.shape,
                               np.zeros(s.shape, np.uint8))  # fmt: skip

    packer = Packer(tensors(3), manifest_of(promised), _NullStager(), 400, 2)
    entries, used, last = packer.fill(0)
    assert ([e.name for e in entries], used, last) == (["t0", "t1"], 512, False)
    assert asked == ["t0", "t1"]
    assert packer.fill(1)[2] is True and packer.count == 3
    asked.clear()
    with pytest.raises(RefitError, match="yielded 2 tensors; weight_specs\\(\\) promised 3"):
        packer = Packer(tensors(2), manifest_of(promised), _NullStager(), 400, 2)
        packer.fill(0)
        packer.fill(1)
    asked.clear()
    with pytest.raises(RefitError, match="yielded extra .* promised no more"):
        packer = Packer(tensors(4), manifest_of(promised), _NullStager(), 400, 2)
        packer.fill(0)
        packer.fill(1)


async def test_a_refused_manifest_touches_nothing(run_dir: str) -> None:
    pair, engine = Pair(run_dir), Engine(refuse="wrong shape: c [16, 1024] (engine: [16, 512])")
    try:
        sent, received = await refit(pair, engine, weights())
        assert isinstance(sent, RefitError) and isinstance(received, RefitError)
        assert "rollout:0 refused the manifest of v1: ValueError: wrong shape: c" in str(sent)
        assert engine.buckets == [] and engine.events == []  # no begin, so nothing to abort
    finally:
        pair.close()


async def test_a_failed_load_is_reported_and_the_engine_told(run_dir: str) -> None:
    pair, engine = Pair(run_dir), Engine(fail_load_at=1)
    try:
        sent, received = await refit(pair, engine, weights())
        assert "rollout:0 refused bucket 1 of v1: RuntimeError: out of device memory" in str(sent)
        assert "bucket 1 of v1" in str(received)
        assert engine.events[-1] == ("abort", 1, True)  # bucket 0 was loaded: mixed weights
        assert engine.weights == {}
    finally:
        pair.close()


async def test_a_failing_abort_does_not_hide_why_the_refit_stopped(run_dir: str) -> None:
    """The engine dies mid-refit: its abort fails too (a dead engine answers nothing). The
    receiver still reports the bucket's error, not the abort's."""

    class DyingEngine(Engine):
        async def abort_weight_update(self, version: int, *, loaded_any: bool) -> None:
            raise EngineDeadError("vLLM engine process EngineCore (pid 7) exited with code -9")

    pair, engine = Pair(run_dir), DyingEngine(fail_load_at=1)
    try:
        sent, received = await refit(pair, engine, weights())
        assert isinstance(received, RefitError) and "bucket 1 of v1" in str(received)
        assert "out of device memory" in str(sent)
    finally:
        pair.close()


async def test_a_bucket_that_breaks_the_manifest_is_refused_before_loading(run_dir: str) -> None:
    """A hand-driven sender announces a manifest, then a bucket whose tensor has another shape:
    the receiver refuses it without loading, and the engine goes on with its old weights."""
    ctx = Context()
    from asyncrl.wire.transport import ROUTER

    router = ctx.socket(ROUTER, bind=ipc_address(run_dir, "w"))
    receiver = WeightReceiver(ctx, ipc_address(run_dir, "w"), "rollout:0")
    codec = Codec(WeightMessage)
    engine = Engine()
    manifest = [TensorEntry("a", "float32", [10, 1024], 0, 0)]
    acks: list[Any] = []

    async def trainer() -> None:
        frames = await router.recv()
        assert isinstance(codec.decode(frames[1:]), WeightsPull)
        await router.send([b"rollout:0", *codec.encode(Manifest(1, "shm", manifest))])
        acks.append(codec.decode((await router.recv())[1:]))
        bad = Bucket(1, 0, b"", 40960, [TensorEntry("a", "float32", [10, 512], 0, 20480)], True)
        await router.send([b"rollout:0", *codec.encode(bad)])
        acks.append(codec.decode((await router.recv())[1:]))

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer)
                with pytest.raises(RefitError, match=r"bucket 0 of v1: bucket 0: got a float32"):
                    await receiver.receive(1, engine, transport="shm", reset_prefix_cache=True,
                                           kv_scales=None, timeout_s=5)
        assert [a.index for a in acks] == [-1, 0] and acks[0].error is None
        assert "where the manifest has a float32[10, 1024]" in acks[1].error
        assert engine.buckets == []
        assert engine.events[-1] == ("abort", 1, False)  # nothing loaded: old weights serve
    finally:
        router.close()
        receiver.close()
        ctx.close()


async def test_a_trainer_that_breaks_its_own_manifest_fails_the_refit(run_dir: str) -> None:
    pair, engine = Pair(run_dir), Engine()
    w = weights()
    w["c"] = w["c"][:8]  # yields c with 8 rows where weight_specs() promised 16
    try:
        sent, received = await refit(pair, engine, w, timeout_s=2)
        assert "the trainer yielded c float32[8, 1024] as tensor 2" in str(sent)
        assert isinstance(received, RefitError)  # the receiver times out, and says so
        assert engine.events[-1][0] == "abort"
    finally:
        pair.close()


async def test_a_receiver_that_never_pulls_times_out_with_its_name(run_dir: str) -> None:
    pair = Pair(run_dir)
    try:
        with pytest.raises(RefitError, match=r"rollout:1 did not answer the pull of v3 within 1 s"):
            await pair.sender.send(3, ["rollout:1"], specs(), tensors(weights()),
                                   bucket_size=BUCKET, timeout_s=1)
    finally:
        pair.close()


def test_check_bucket_refuses_overlap_and_overflow() -> None:
    manifest = [TensorEntry("a", "float32", [4], 0, 0), TensorEntry("b", "float32", [4], 0, 0)]
    ok = Bucket(1, 0, b"", 512, [TensorEntry("a", "float32", [4], 0, 16),
                                 TensorEntry("b", "float32", [4], 256, 16)], True)
    check_bucket(ok, manifest, 0)
    overlap = Bucket(1, 0, b"", 512, [TensorEntry("a", "float32", [4], 0, 16),
                                      TensorEntry("b", "float32", [4], 8, 16)], True)
    with pytest.raises(ValueError, match="overlaps"):
        check_bucket(overlap, manifest, 0)
    outside = Bucket(1, 0, b"", 20, [TensorEntry("b", "float32", [4], 8, 16)], True)
    with pytest.raises(ValueError, match="outside the 20-byte bucket"):
        check_bucket(outside, manifest, 1)
    beyond = Bucket(1, 0, b"", 512, [TensorEntry("c", "float32", [4], 0, 16)], True)
    with pytest.raises(ValueError, match="beyond the manifest's end"):
        check_bucket(beyond, manifest, 2)


async def test_a_small_version_gets_small_staging_buffers(run_dir: str) -> None:
    """Buffers are sized by what the version needs, not by refit.bucket_size_mb (a tiny model
    must not take two 256 MiB files in /dev/shm, or two GPU buffers of that size)."""
    pair, engine = Pair(run_dir), Engine()
    small = {"a": np.ones((4, 8), np.float32), "b": np.ones(3, np.float32)}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: pair.sender.send(
                1, ["rollout:0"], [WeightTensor(n, "float32", a.shape) for n, a in small.items()],
                tensors(small), bucket_size=256 << 20, timeout_s=10,
            ))
            tg.start_soon(lambda: pair.receiver.receive(
                1, engine, transport="shm", reset_prefix_cache=True, kv_scales=None, timeout_s=10,
            ))
        files = sorted(os.path.getsize(f) for f in Path(shm_dir(pair.run_id)).iterdir())
        assert files == [0, 256 + 256]  # one bucket: a (128 B) and b (12 B), each 256-aligned
        np.testing.assert_array_equal(engine.weights["a"], small["a"])
    finally:
        pair.close()


async def test_data_that_does_not_match_its_declaration_is_refused(run_dir: str) -> None:
    """A tensor whose bytes do not match the dtype and shape it names (a float64 array sent as
    float32) never reaches a staging buffer."""
    pair, engine = Pair(run_dir), Engine()
    w = weights()

    def lying() -> Iterator[WeightTensor]:
        for n, a in w.items():
            data = a.astype(np.float64) if n == "b" else a
            yield WeightTensor(n, "float32", a.shape, data.reshape(-1).view(np.uint8))

    try:
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with pytest.raises(RefitError, match=r"b as float32\[6, 1024\] \(24576 bytes\) "
                                                     r"with data of 49152 bytes"):
                    await pair.sender.send(1, ["rollout:0"], specs(), lying(),
                                           bucket_size=BUCKET, timeout_s=2)

            async def receive() -> None:
                with pytest.raises(RefitError):
                    await pair.receiver.receive(1, engine, transport="shm",
                                                reset_prefix_cache=True, kv_scales=None,
                                                timeout_s=2)

            tg.start_soon(send)
            tg.start_soon(receive)
        assert engine.weights == {}
    finally:
        pair.close()


@pytest.mark.parametrize("buffers", [2, 3])
async def test_n_staging_buffers_let_the_trainer_pack_n_minus_1_buckets_ahead(
    run_dir: str, buffers: int
) -> None:
    """The engine holds bucket 0's load and watches which buckets arrive meanwhile: with n
    staging buffers, buckets 1..n-1 (the trainer refills buffer 0 only after bucket 0 is
    acknowledged), each in a buffer of its own; the refit is still byte-exact."""
    pair = Pair(run_dir, buffers=buffers)

    class Holding(Engine):
        started: list[int] = []

        async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
            self.started.append(bucket.index)
            if bucket.index == 0:
                with anyio.move_on_after(1.0):
                    while len(self.started) < 3:
                        await anyio.sleep(0.01)
                self.seen = list(self.started)
            await super().load_weight_bucket(bucket)

    engine = Holding()
    engine.started = []
    w = weights()
    try:
        sent, _ = await refit(pair, engine, w)
        assert engine.seen == list(range(buffers))  # by hand: [a b] [c d] [e]
        assert sent.num_buckets == 3
        assert len({h for h, _ in engine.handles}) == buffers
        for name, a in w.items():
            np.testing.assert_array_equal(engine.weights[name], a)
    finally:
        pair.close()


class StuckEngine(Engine):
    """Hangs in its first bucket's load, like an engine whose process is being killed."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = anyio.Event()

    async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
        self.loading.set()
        await anyio.sleep_forever()


async def _refit_past_a_stuck_receiver(
    pair: Pair, w: dict[str, np.ndarray], meanwhile: Callable[[], Awaitable[None]],
    **where: Any,
) -> tuple[Any, float, Engine]:
    """A refit of ``w`` to rollout:0 (pair's receiver) and rollout:1, which hangs in its
    first load; ``meanwhile()`` runs once it hangs. ``where``: ``send``'s ``pids`` and
    ``hosts``. Returns the result, the seconds the send took and rollout:0's engine."""
    other = WeightReceiver(pair.ctx, pair.address, "rollout:1")
    good, stuck = Engine(), StuckEngine()
    out: dict[str, Any] = {}

    async def send() -> None:
        start = time.perf_counter()
        out["sent"] = await pair.sender.send(
            1, ["rollout:0", "rollout:1"], specs(), tensors(w), bucket_size=BUCKET,
            timeout_s=30, **where,
        )
        out["seconds"] = time.perf_counter() - start

    async def when_stuck() -> None:
        await stuck.loading.wait()
        await meanwhile()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(when_stuck)
            tg.start_soon(lambda: pair.receiver.receive(
                1, good, transport="shm", reset_prefix_cache=True, kv_scales=None, timeout_s=30))
            async with anyio.create_task_group() as hung:
                hung.start_soon(lambda: other.receive(
                    1, stuck, transport="shm", reset_prefix_cache=True, kv_scales=None,
                    timeout_s=30))
                while "sent" not in out:
                    await anyio.sleep(0.01)
                hung.cancel_scope.cancel()
    finally:
        other.close()
    return out["sent"], out["seconds"], good


async def test_a_receiver_whose_process_exits_is_left_out_and_the_others_get_the_version(
    run_dir: str,
) -> None:
    """Two receivers; rollout:1 hangs in its first load and its process (a stand-in we own)
    is killed then. The sender stops waiting for it at once and finishes the version for
    rollout:0, byte-exact, well inside refit.timeout_s. Without the receivers' pids it would
    wait for rollout:1's acknowledgement until the timeout."""
    import subprocess
    import sys

    pair = Pair(run_dir)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    w = weights()

    async def kill() -> None:
        stand_in.kill()

    try:
        sent, seconds, good = await _refit_past_a_stuck_receiver(
            pair, w, kill, pids=[os.getpid(), stand_in.pid]
        )
    finally:
        stand_in.kill()
        stand_in.wait()
        pair.close()
    assert sent.num_buckets == 3
    # measured 0.016-0.017 s (3 runs, 2 busy cores); the timeout it no longer waits for: 30 s
    assert seconds < 5
    assert set(good.weights) == set(w)
    for name, array in w.items():
        np.testing.assert_array_equal(good.weights[name], array)


async def test_a_receiver_on_another_host_is_left_out_when_the_controller_says_it_died(
    run_dir: str,
) -> None:
    """rollout:1 runs on another host (its pid names nothing here: not watched) and hangs in
    its first load; the controller's ReceiverGone (here ``sender.leave``, what the trainer
    runtime calls) leaves it out, and rollout:0 gets the version byte-exact, well inside
    refit.timeout_s. The refit's end makes ``leave`` a no-op."""
    pair = Pair(run_dir)
    w = weights()
    left: list[float] = []

    async def say_it_died() -> None:
        await anyio.sleep(0.2)  # not left out by itself meanwhile: its pid is not watched
        left.append(time.perf_counter())
        pair.sender.leave("rollout:1", "the controller found it dead")

    try:
        sent, seconds, good = await _refit_past_a_stuck_receiver(
            pair, w, say_it_died, pids=[os.getpid(), os.getpid()],
            hosts=[host_id(), "node9/b/1"],
        )
        pair.sender.leave("rollout:0", "late")  # no refit under way: nothing to do
    finally:
        pair.close()
    assert sent.num_buckets == 3 and left
    assert 0.2 <= seconds < 5  # the wait before the word; the timeout is 30 s
    for name, array in w.items():
        np.testing.assert_array_equal(good.weights[name], array)


async def test_a_send_to_a_receiver_whose_socket_is_gone_leaves_it_out(run_dir: str) -> None:
    """A receiver's socket closes before its process exit is seen (the kernel closes a
    SIGKILLed process's sockets first; a dying worker closes its own in teardown). The send to
    it fails at once (the ROUTER is router_mandatory): it is left out as gone, owing nothing,
    and the others still get the message, instead of the refit failing with a bare ZMQError.
    rollout:9 stands for it: its socket is never connected."""
    from asyncrl.worker.weights import _Owed

    pair = Pair(run_dir)
    try:
        sender, codec = pair.sender, Codec(WeightMessage)
        await pair.receiver._sock.send(codec.encode(WeightsPull(1, "rollout:0")))
        with anyio.fail_after(5):
            await sender._sock.recv()  # the ROUTER knows rollout:0 now
        owed = _Owed(sender._recv, sender.rejections.reject, 1, ["rollout:9", "rollout:0"], 5.0)
        owed.expect(-1)
        await sender._send_all(owed, Manifest(1, "shm", []))
        assert owed.live() == ["rollout:0"]
        with anyio.fail_after(5):
            got = codec.decode(await pair.receiver._sock.recv())
        assert isinstance(got, Manifest) and got.version == 1
    finally:
        pair.close()


class DeadEngine(Engine):
    """Its engine process died just before the manifest came: begin_weight_update says so."""

    def __init__(self) -> None:
        super().__init__()
        self.dying = anyio.Event()

    async def begin_weight_update(self, version: int, manifest: Any, **kw: Any) -> None:
        self.dying.set()
        raise EngineDeadError("vLLM engine process EngineCore (pid 1) exited with code -9")


async def test_a_receiver_whose_engine_died_refuses_nothing_and_is_left_out(run_dir: str) -> None:
    """CI saw a run stop when vLLM's engine was SIGKILLed during a refit: the receiver refused
    the manifest with the engine's death, and the trainer's SendWeights failed, though the
    rollout worker was about to be restarted. Now a receiver whose backend raises a
    WorkerError sends no refusal and raises it (its worker exits); the sender leaves it out
    once its process is gone and finishes the version for the other receiver."""
    import subprocess
    import sys

    pair = Pair(run_dir)
    other = WeightReceiver(pair.ctx, pair.address, "rollout:1")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    w = weights()
    good, dead = Engine(), DeadEngine()
    out: dict[str, Any] = {}
    try:
        async def send() -> None:
            out["sent"] = await pair.sender.send(
                1, ["rollout:0", "rollout:1"], specs(), tensors(w), bucket_size=BUCKET,
                timeout_s=30, pids=[os.getpid(), stand_in.pid],
            )

        async def dying_receiver() -> None:
            with pytest.raises(EngineDeadError):
                await other.receive(1, dead, transport="shm", reset_prefix_cache=True,
                                    kv_scales=None, timeout_s=30)
            stand_in.kill()  # what the worker does next: exit

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(dying_receiver)
            tg.start_soon(lambda: pair.receiver.receive(
                1, good, transport="shm", reset_prefix_cache=True, kv_scales=None, timeout_s=30))
    finally:
        stand_in.kill()
        stand_in.wait()
        other.close()
        pair.close()
    assert dead.dying.is_set()
    assert out["sent"].num_buckets == 3
    for name, array in w.items():
        np.testing.assert_array_equal(good.weights[name], array)



class ExitsDuringSend:
    """The sender's socket, counting what each receiver is sent; sending the first message to
    ``trigger`` (the manifest) is when the processes ``exits`` stands for exit, and their
    watchers have run (left those receivers out) before that send goes on."""

    def __init__(self, sock: Any, trigger: str, exits: list[anyio.Event]) -> None:
        self._sock, self._trigger, self._exits = sock, trigger, exits
        self.sent: dict[str, int] = {}

    async def recv(self) -> Any:
        return await self._sock.recv()

    async def send(self, frames: list[Any]) -> None:
        who = bytes(frames[0]).decode()
        self.sent[who] = self.sent.get(who, 0) + 1
        if who == self._trigger and self.sent[who] == 1:
            for exited in self._exits:
                exited.set()
            await anyio.wait_all_tasks_blocked()  # the watchers are done
        await self._sock.send(frames)

    def close(self) -> None:
        self._sock.close()


async def test_a_receiver_left_out_during_a_send_makes_the_sender_skip_no_other(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review found that the sender sent each message by walking the live receivers' list
    itself while a watcher may shrink it: rollout:0 and rollout:2 exit while the manifest goes
    to rollout:1, so the loop skipped rollout:3, which never got the manifest and was waited
    for until refit.timeout_s. Now every live receiver gets every message, and one left out
    gets nothing more. Process ``i + 1`` stands for rollout:i (0 is no process: a receiver on
    another host); its exit is staged (a stand-in for ``wait_pid_exit``), so the watchers run
    exactly during that send."""
    from asyncrl.worker import weights as weights_module

    names = [f"rollout:{i}" for i in range(4)]
    exits = [anyio.Event() for _ in names]

    async def staged_exit(pid: int) -> None:
        await exits[pid - 1].wait()

    pair = Pair(run_dir)
    watched = ExitsDuringSend(pair.sender._sock, "rollout:1", [exits[0], exits[2]])
    monkeypatch.setattr(weights_module, "wait_pid_exit", staged_exit)
    monkeypatch.setattr(pair.sender, "_sock", watched)
    receivers = {n: WeightReceiver(pair.ctx, pair.address, n) for n in names[1:]}
    receivers["rollout:0"] = pair.receiver
    engines = {n: Engine() for n in names}
    w = weights()

    async def receive(name: str) -> None:
        await receivers[name].receive(1, engines[name], transport="shm",
                                      reset_prefix_cache=True, kv_scales=None, timeout_s=10)

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive, "rollout:1")
                tg.start_soon(receive, "rollout:3")
                async with anyio.create_task_group() as gone:  # they wait for more, in vain
                    gone.start_soon(receive, "rollout:0")
                    gone.start_soon(receive, "rollout:2")
                    sent = await pair.sender.send(
                        1, names, specs(), tensors(w), bucket_size=BUCKET, timeout_s=3,
                        pids=list(range(1, 5)),
                    )
                    gone.cancel_scope.cancel()
    finally:
        for r in receivers.values():
            r.close()
        pair.close()
    assert sent.num_buckets == 3
    # by hand: the manifest and buckets [a b] [c d] [e] to each of the two left; rollout:0
    # had the manifest before it exited, rollout:2 nothing
    assert watched.sent == {"rollout:0": 1, "rollout:1": 4, "rollout:3": 4}
    for name in ("rollout:1", "rollout:3"):
        for tensor, array in w.items():
            np.testing.assert_array_equal(engines[name].weights[tensor], array)
