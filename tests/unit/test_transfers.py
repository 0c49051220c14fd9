"""Weight transfer plugins and the pieces of the vLLM backend's refit that need no engine:
the registry, the ``shm`` stager/opener pair, the manifest check against a checkpoint's
safetensors headers, GPU placement, FP8 detection. (``cuda_ipc`` without a GPU is
asyncrl_torch's: backends/asyncrl-torch/tests/test_cuda_ipc.py.)"""

from __future__ import annotations

import json
import shutil
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest

from asyncrl.errors import ConfigError
from asyncrl.wire.messages import KVScalesResult, TensorEntry, TokenBatch
from asyncrl.run.refit import KVScales, fp8_kv_cache
from asyncrl.transfers import Receiver, StagingSpec, WeightTransfer, load_transfer
from asyncrl.procs.space import shm_dir
from asyncrl.transfers.shm import read_bytes

pytestmark = pytest.mark.timeout(60)


def test_installed_transfers_load_by_name() -> None:
    for name in ("shm", "cuda_ipc"):
        transfer = load_transfer(name)
        assert isinstance(transfer, WeightTransfer) and transfer.name == name
    with pytest.raises(ConfigError, match=r"refit.transport: no weight transfer named 'rdma' "
                                          r"\(installed: .*cuda_ipc.*shm"):
        load_transfer("rdma")


def test_shm_stager_and_opener_round_trip_and_growth() -> None:
    torch = pytest.importorskip("torch")
    run_id = uuid.uuid4().hex[:8]
    stager = load_transfer("shm").stager(StagingSpec(run_id, 0, "cpu"))
    opener = load_transfer("shm").opener()
    try:
        stager.begin([Receiver("rollout:0")])
        a = torch.arange(10, dtype=torch.bfloat16)
        b = np.arange(6, dtype=np.float32)
        stager.reserve(0, 1024)
        stager.pack(0, 0, a)
        stager.pack(0, 256, b.view(np.uint8))
        stager.seal(0)
        handle = stager.handle(0)
        memory = opener.open(handle, None)
        assert memory.dtype == torch.uint8 and memory.numel() == 1024
        assert torch.equal(memory[:20].view(torch.bfloat16), a)
        np.testing.assert_array_equal(read_bytes(handle, 256, 24).view(np.float32), b)
        assert opener.open(handle, None) is memory  # cached
        # the same file rewritten for the bucket after next: the mapping shows the new bytes
        stager.pack(0, 0, torch.full((10,), 7.0, dtype=torch.bfloat16))
        assert float(memory[:20].view(torch.bfloat16)[3]) == 7.0
        # a larger bucket grows the file: a new handle, mapped afresh
        stager.reserve(0, 4096)
        stager.pack(0, 4000, np.full(8, 9, np.uint8))
        grown = opener.open(stager.handle(0), None)
        assert grown.numel() == 4096 and int(grown[4003]) == 9
        with pytest.raises(ValueError, match="outside the 4096-byte bucket"):
            read_bytes(stager.handle(0), 4090, 16)
    finally:
        opener.close()
        stager.close()
        stager.close()  # idempotent
        leftover = list(Path(shm_dir(run_id)).glob("*"))
        shutil.rmtree(shm_dir(run_id), ignore_errors=True)
    assert leftover == []  # the bucket files are removed by close


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header = {n: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for n, s in shapes.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_manifest_check_against_the_checkpoint(tmp_path: Path) -> None:
    from asyncrl_vllm.manifest import checkpoint_shapes, manifest_problems

    _safetensors(tmp_path / "model-1.safetensors", {"model.embed.weight": [8, 4],
                                                     "model.norm.weight": [4]})
    _safetensors(tmp_path / "model-2.safetensors", {"lm_head.weight": [8, 4],
                                                     "model.rotary_emb.inv_freq": [2]})
    shapes = checkpoint_shapes(tmp_path)
    assert shapes == {"model.embed.weight": [8, 4], "model.norm.weight": [4],
                      "lm_head.weight": [8, 4], "model.rotary_emb.inv_freq": [2]}

    def entry(name: str, shape: list[int], dtype: str = "bfloat16") -> TensorEntry:
        return TensorEntry(name, dtype, shape, 0, 0)

    good = [entry("model.embed.weight", [8, 4]), entry("model.norm.weight", [4])]
    assert manifest_problems(good, shapes, dtype="bfloat16", tied=True) == []
    assert manifest_problems(good, shapes, dtype="bfloat16", tied=False) == [
        "missing from the refit: lm_head.weight"
    ]
    bad = [entry("model.embed.weight", [8, 5]), entry("model.norm.weight", [4], "float32"),
           entry("model.extra.weight", [1])]
    problems = manifest_problems(bad, shapes, dtype="bfloat16", tied=True)
    assert problems == [
        "not in the engine's model: model.extra.weight",
        "wrong shape: model.embed.weight [8, 5] (engine: [8, 4])",
        "not bfloat16 (the engine's dtype): model.norm.weight float32",
    ]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_shapes(tmp_path / "empty")


@pytest.mark.parametrize(
    ("gpu", "visible", "count", "expected"),
    [(1, None, 2, "1,0"), (0, None, 2, "0,1"), (1, "3,5,7", 8, "5,3,7"), (0, "6", 8, "6")],
)
def test_engine_gpu_comes_first_and_the_others_stay_visible(
    gpu: int, visible: str | None, count: int, expected: str
) -> None:
    from asyncrl_vllm.processes import gpu_first

    assert gpu_first(gpu, visible, count) == expected


def test_engine_gpu_out_of_range_names_the_field() -> None:
    from asyncrl_vllm.processes import gpu_first

    with pytest.raises(ValueError, match=r"cluster.rollout_gpus asks for GPU 2, but this node "
                                         r"shows 2 \(0, 1\)"):
        gpu_first(2, None, 2)


def test_fp8_kv_cache_is_seen_in_any_generator() -> None:
    assert not fp8_kv_cache([{"kv_cache_dtype": "auto"}, {}])
    assert fp8_kv_cache([{"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8_e4m3"}])


class _Peer:
    def __init__(self, capabilities: dict) -> None:
        self.capabilities = capabilities


class _Control:
    """The two things KVScales uses of a control plane: the peers' capabilities and
    call_each (recording the requests, answering like two agreeing trainer ranks)."""

    def __init__(self, rollout_caps: list[dict]) -> None:
        self.peers = {f"rollout:{i}": _Peer(c) for i, c in enumerate(rollout_caps)}
        self.requests: list = []

    async def call_each(self, workers, requests, *, timeout_s):  # noqa: ANN001, ANN201
        self.requests.extend(requests)
        return [KVScalesResult(scales={"model.layers.0.self_attn.k_scale": 0.01})] * len(workers)


@pytest.mark.parametrize(
    ("caps", "want_q"),
    [
        ([{"kv_cache_dtype": "fp8", "kv_quantized_query": True}, {}], True),
        ([{"kv_cache_dtype": "fp8", "kv_quantized_query": False}], False),
        ([{"kv_cache_dtype": "fp8"}], False),  # not reported: not calibrated
    ],
)
@pytest.mark.anyio
async def test_query_scales_are_calibrated_when_a_generator_quantizes_the_query(
    caps: list[dict], want_q: bool
) -> None:
    """FA3 with an FP8 KV cache quantizes the query with its static q scale: a generator that
    says so gets calibrated q scales without any setting (left at 1.0 they cost the GPU demo
    9x the bf16 logprob error); one that does not say so gets none."""
    control = _Control(caps)
    kv = KVScales(control, ["trainer:0", "trainer:1"], list(control.peers), timeout_s=5)
    batch = TokenBatch(np.arange(8, dtype=np.int32), np.array([4, 4], np.int32),
                       np.array([1, 1], np.int32))
    assert kv.enabled
    assert await kv.calibrate(batch, 1) == {"model.layers.0.self_attn.k_scale": 0.01}
    assert [r.include_q for r in control.requests] == [want_q, want_q]
