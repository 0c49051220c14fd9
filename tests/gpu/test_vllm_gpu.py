"""The vLLM generation backend on CUDA (vLLM 0.26 on the GPU image), against transformers.

Skipped without CUDA. The model is built here (head_dim 64, which FlashAttention's FP8 path
accepts) with the arithmetic plugin's tokenizer. One bf16 engine serves most tests, through
the ``engine`` fixture: a test that refits it puts the checkpoint's weights back after it and
proves it (scores against transformers), so every test sees the same engine whatever ran
before (the suite passes in reverse order: ``pytest --reverse``). Two more engines, an FP8 KV
cache one and one on a checking scheduler, are their tests' own, and each checks that its
close leaves no engine process.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
import pytest_asyncio

from asyncrl import registry
from asyncrl.backend import WorkerContext
from asyncrl.config import from_dict
from asyncrl.backend import generate_all
from asyncrl.wire.messages import GenRequest, TokenBatch

sys.path.insert(0, str(Path(__file__).parent))
# the held-logprob checks (and held_check, imported by the engine core, which inherits sys.path)
sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
from asyncrl_arith.model import BOS_ID, EOS_ID, PAD_ID, VOCAB, build_tokenizer  # noqa: E402
from refit_support import LocalRefit  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
]
module_loop = pytest.mark.asyncio(loop_scope="module")
TOL = 0.05
OPTIONS = {"enforce_eager": True, "max_model_len": 512, "gpu_memory_utilization": 0.3}


def build(out: Path, seed: int = 3, init: float = 0.02) -> Path:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
        initializer_range=init,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    return out


def ctx_for(model_dir: Path, run_dir: Path, **options: object) -> WorkerContext:
    config = from_dict(
        {
            "model": {"path": str(model_dir)},
            "environment": {"name": "arithmetic"},
            "generator": {"options": {**OPTIONS, **options}},
        }
    )
    return WorkerContext("rollout", 0, 1, 0, config, str(run_dir))


def reference(model_dir: Path, state: dict[str, torch.Tensor] | None = None):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    source = state if state is not None else dict(model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(source[name].to(torch.bfloat16).float())
    return model.eval()


def ref_logprobs(model, tokens: list[int], prompt_len: int, temperature: float = 1.0):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, -1)
    target = torch.tensor(tokens[prompt_len:])
    return lp[prompt_len - 1 : -1].gather(1, target[:, None])[:, 0].numpy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("gpu-model"))


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    return [([1] + rng.integers(4, len(VOCAB), n - 1).tolist(), p) for p, n in [(8, 40), (20, 90)]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(model_dir, tmp_path_factory):
    b = registry.load("asyncrl.generation_backends", "vllm")(
        ctx_for(model_dir, tmp_path_factory.mktemp("run"))
    )
    b.capabilities = await b.start()
    yield b
    await closed_leaving_nothing(b)


@pytest_asyncio.fixture(loop_scope="module")
async def engine(backend, model_dir, sequences):
    """The module's engine, serving the checkpoint's weights; after a test that refitted it,
    those weights go back in (one more refit) and its scores are checked against
    transformers', so that no test depends on what another did."""
    version = backend.version
    yield backend
    if backend.version == version:
        return
    base = checkpoint_state(model_dir, "cuda:0")
    pair = LocalRefit("cuda_ipc", "cuda:0", bucket_size=64 << 10)
    try:
        await pair.push(backend, backend.version + 1, lambda: base.items())
    finally:
        pair.close()
    got = await backend.score(batch_of(sequences), 1.0)
    expected = np.concatenate([ref_logprobs(reference(model_dir), s, p) for s, p in sequences])
    np.testing.assert_allclose(got, expected, atol=TOL)


async def closed_leaving_nothing(b) -> None:
    """Close ``b`` and check that none of its engine's processes is left (a zombie is gone)."""
    pids = b.engine_pids()
    assert pids
    await b.close()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def batch_of(seqs) -> TokenBatch:
    return TokenBatch(
        np.array([t for s, _ in seqs for t in s], np.int32),
        np.array([len(s) for s, _ in seqs], np.int32),
        np.array([p for _, p in seqs], np.int32),
    )


@module_loop
async def test_generate_and_score_match_transformers(engine, model_dir, sequences) -> None:
    backend = engine
    assert backend.capabilities["platform"] == "cuda"
    print("capabilities:", backend.capabilities)
    ref = reference(model_dir)
    prompt = [1, 14, 5, 15]
    samples = await generate_all(backend, 
        GenRequest(group_id="g", prompt_ids=prompt, n=4, max_tokens=32, temperature=0.7, seed=1)
    )
    assert len(samples) == 4
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) >= 1
        expected = ref_logprobs(ref, prompt + s.token_ids.tolist(), len(prompt), 0.7)
        np.testing.assert_allclose(s.logprobs, expected, atol=TOL)
    for temperature in (1.0, 0.7):
        got = await backend.score(batch_of(sequences), temperature)
        expected = np.concatenate([ref_logprobs(ref, s, p, temperature) for s, p in sequences])
        print(f"score T={temperature}: max err {np.abs(got - expected).max():.4f}")
        np.testing.assert_allclose(got, expected, atol=TOL)


def checkpoint_state(model_dir: Path, device: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in bf16 on ``device``: what the engine started with."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: p.detach().to(device, torch.bfloat16) for n, p in base.named_parameters()}


def perturbed(
    model_dir: Path, seed: int, device: str, scale: float = 0.05
) -> dict[str, torch.Tensor]:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach() + scale * torch.randn(p.shape, generator=gen)).to(device, torch.bfloat16)
        for n, p in base.named_parameters()
    }


@module_loop
@pytest.mark.parametrize(
    ("transport", "trainer_gpu", "mirror", "buffers"),
    [("cuda_ipc", 0, "auto", 2), ("cuda_ipc", 0, "always", 3), ("cuda_ipc", 1, "auto", 2),
     ("shm", 0, "auto", 2)],
    ids=["cuda_ipc-same-gpu", "cuda_ipc-same-gpu-mirrored-3-buffers", "cuda_ipc-other-gpu",
         "shm-from-gpu"],
)
async def test_refit_while_generating(
    engine, model_dir, sequences, transport, trainer_gpu, mirror, buffers
) -> None:
    """Refits over the real protocol in several buckets, from trainer tensors on the engine's
    GPU, on the other GPU (CUDA IPC across GPUs), or through host shared memory; a request in
    flight is frozen, not lost; the first refit compiles the copy plan, the next replay it.
    Buckets from the other GPU go through the engine's two mirror buffers, the scatter of one
    overlapping the copy of the next; ``refit_mirror = "always"`` runs that path on one GPU
    (with three staging buffers, so three mirror buffers)."""
    if trainer_gpu >= torch.cuda.device_count():
        pytest.skip("needs a second GPU")
    backend = engine
    device = f"cuda:{trainer_gpu}"
    pair = LocalRefit(transport, device, bucket_size=64 << 10, buffers=buffers)
    options = backend.options
    backend.options = msgspec.structs.replace(options, refit_mirror=mirror)  # read per bucket
    try:
        for seed in (1, 2, 3):
            state = perturbed(model_dir, seed, device)
            before = await backend.score(batch_of(sequences), 1.0)
            inflight = asyncio.create_task(
                generate_all(backend, GenRequest(group_id=f"x{seed}", prompt_ids=[1, 8], n=4,
                                                 max_tokens=400))
            )
            await asyncio.sleep(0.05)
            version = backend.version + 1
            sent, received = await pair.push(backend, version, lambda: state.items())
            assert sent.num_buckets >= 3 and received.num_tensors == len(state)
            stats = backend.last_refit
            print(f"{transport} from {device}: {sent.num_buckets} buckets, "
                  f"{stats['direct']}/{stats['tensors']} direct, {stats['batched']} batched, "
                  f"{stats['mirrored']} mirrored, "
                  f"{stats['seconds'] * 1e3:.1f} ms")
            assert stats["mode"] == "direct"
            after = await backend.score(batch_of(sequences), 1.0)
            ref = reference(model_dir, {k: v.float().cpu() for k, v in state.items()})
            expected = np.concatenate([ref_logprobs(ref, s, p) for s, p in sequences])
            np.testing.assert_allclose(after, expected, atol=TOL)
            assert np.abs(after - before).mean() > 4 * TOL
            assert all(s.finish_reason != "abort" for s in await asyncio.wait_for(inflight, 60))
        assert backend.last_refit["direct"] == len(state)  # the plan replays on later refits
        # a GPU bucket seen before in the same mapped buffer is one batched copy
        batched = sent.num_buckets if transport == "cuda_ipc" else 0
        assert backend.last_refit["batched"] == batched, backend.last_refit
        crossing = transport == "cuda_ipc" and (trainer_gpu != 0 or mirror == "always")
        assert backend.last_refit["mirrored"] == (sent.num_buckets if crossing else 0)
    finally:
        backend.options = options
        pair.close()


class Figures(dict):
    """Prints each figure as it is recorded (a failure later still shows the earlier ones)."""

    def __setitem__(self, what: str, value: float) -> None:
        print(f"{what}: mean |engine - trainer| {value:.5f}")
        super().__setitem__(what, value)


@module_loop
async def test_the_refit_check_passes_right_refits_and_catches_planted_faults(
    engine, model_dir, sequences, tmp_path
) -> None:
    """The refit check (:class:`~asyncrl.policy.verify.RefitCheck`, the defaults) on the CUDA
    engine's numerics, refits over the real protocol (CUDA IPC), the trainer's side a float32
    transformers model of the bf16 weights sent (what ``sent_logprobs`` scores): a right refit
    within its bound, and every planted fault caught: a tensor left out of the manifest, a
    bucket the engine never loaded, one layer left on the previous version, an engine that
    kept its weights, another model (tests/e2e/test_vllm_backend.py on the CPU build)."""
    from asyncrl.errors import RefitError
    from asyncrl.policy.verify import RefitCheck
    from asyncrl.wire.messages import TensorEntry

    backend, batch = engine, batch_of(sequences)

    def trainer(state: dict[str, torch.Tensor] | None = None, model: Path = model_dir):
        ref = reference(model, None if state is None else {k: v.float().cpu()
                                                            for k, v in state.items()})
        return np.concatenate([ref_logprobs(ref, s, p) for s, p in sequences])

    async def engines() -> dict[str, np.ndarray]:
        return {"rollout:0": await backend.score(batch, 1.0)}

    check = RefitCheck.measured()
    base = backend.version
    (first,) = check.baseline(base, await engines(), trainer())
    print(f"\nbaseline {first.mean_abs:.5f} (max {first.max_abs:.4f}), bound {check.bound()[0]:.5f}")
    figures = Figures()
    pair = LocalRefit("cuda_ipc", "cuda:0", bucket_size=64 << 10)
    try:
        moved = perturbed(model_dir, 21, "cuda:0", scale=0.01)
        await pair.push(backend, base + 1, lambda: moved.items())
        (right,) = check.judge(base + 1, await engines(), trainer(moved))
        right.check()
        figures["right refit"] = right.mean_abs

        again = perturbed(model_dir, 22, "cuda:0", scale=0.01)
        short = [TensorEntry(n, "bfloat16", list(t.shape), 0, 0) for n, t in again.items()][1:]
        with pytest.raises(RefitError, match="missing from the refit"):
            await backend.begin_weight_update(base + 2, short)

        load = backend.load_weight_bucket
        calls = []

        async def skipping(view) -> None:  # the engine drops its second bucket
            calls.append(view)
            if len(calls) != 2:
                await load(view)

        backend.load_weight_bucket = skipping
        try:
            with pytest.raises(BaseException) as failed:
                await pair.push(backend, base + 2, lambda: again.items())
        finally:
            del backend.load_weight_bucket
        assert re.search(r"loaded only in part", repr(failed.value)), repr(failed.value)
        pair.close()
        pair = LocalRefit("cuda_ipc", "cuda:0", bucket_size=64 << 10)

        stale = {n: moved[n] if ".layers.1." in n else t for n, t in again.items()}
        await pair.push(backend, base + 3, lambda: stale.items())
        (part,) = check.judge(base + 3, await engines(), trainer(again))
        with pytest.raises(RefitError, match="not serving the trainer's weights"):
            part.check()
        figures["one layer of two stale"] = part.mean_abs

        await pair.push(backend, base + 4, lambda: again.items())
        (ok,) = check.judge(base + 4, await engines(), trainer(again))
        ok.check()
        figures["right refit after the faults"] = ok.mean_abs
        (kept,) = check.judge(base + 5, await engines(), trainer(moved))  # no refit reached it
        with pytest.raises(RefitError, match=f"closer to the trainer's at version {base + 4}"):
            kept.check()
        figures["engine kept its weights"] = kept.mean_abs

        # another random model (initialized 10x wider: two of the usual near-uniform ones
        # agree to 0.05 on every token, as no two trained models do)
        other = build(tmp_path / "other", seed=8, init=0.2)
        with pytest.raises(RefitError, match="do not run the same model") as refused:
            RefitCheck.measured().baseline(base + 4, await engines(), trainer(model=other))
        print(str(refused.value)[:160])
    finally:
        pair.close()


@module_loop
async def test_held_logprobs_match_transformers(engine, model_dir) -> None:
    """The default engine (asyncrl's scheduler over vLLM's AsyncScheduler, which the CPU build
    never runs): final-only and streamed requests with 0-3 top logprobs in one batch, every
    entry against transformers (tests/e2e/test_vllm_held_logprobs.py on the CPU build)."""
    from test_vllm_held_logprobs import prompts, run_batch, worst_entry_error

    results = await run_batch(engine._llm, prompts(32), "held")
    worst = worst_entry_error(results, reference(model_dir))
    print(f"held logprobs, max |engine - reference| over every entry: {worst:.4f}")
    assert worst < TOL


@pytest.mark.asyncio
async def test_fp8_kv_scales_reach_the_kernels(model_dir, tmp_path) -> None:
    b = registry.load("asyncrl.generation_backends", "vllm")(
        ctx_for(model_dir, tmp_path, kv_cache_dtype="fp8")
    )
    try:
        caps = await b.start()
        assert caps["kv_cache_dtype"].startswith("fp8")
        # FlashAttention 3 (Hopper) quantizes the query with its static scale: the controller
        # must then calibrate q scales too, and learns it from this capability
        print(f"fp8 KV: kv_quantized_query={caps['kv_quantized_query']}")
        if torch.cuda.get_device_capability(0) == (9, 0):
            assert caps["kv_quantized_query"] is True
        state = {
            n: p.detach().to("cuda:0", torch.bfloat16)
            for n, p in transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32
            ).named_parameters()
        }
        req = GenRequest(
            group_id="f", prompt_ids=[1, 9, 9, 4, 5, 6], n=1, max_tokens=24, greedy=True
        )
        logprobs = {}
        pair = LocalRefit("cuda_ipc", "cuda:0")
        for version, scale in ((1, 1.0), (2, 50.0), (3, 1.0)):
            scales = {
                f"model.layers.{i}.self_attn.{k}_scale": scale for i in range(2) for k in "kv"
            }
            await pair.push(b, version, lambda: state.items(), kv_scales=scales)
            (read,) = await b._rpc("asyncrl_get_kv_scales")
            assert all(v[:2] == [scale, scale] for v in read.values())
            (sample,) = await generate_all(b, req)
            logprobs[scale, version] = sample.logprobs
        np.testing.assert_array_equal(logprobs[1.0, 1], logprobs[1.0, 3])
        assert not np.array_equal(logprobs[1.0, 1], logprobs[50.0, 2])
        pair.close()
    finally:
        await closed_leaving_nothing(b)


@module_loop
async def test_held_rows_are_vllms_own_on_the_async_scheduler(model_dir, tmp_path, monkeypatch):
    """The rows asyncrl's scheduler holds equal, bit for bit, vLLM's per-step slices of the
    same steps (tests/e2e/held_check.py) on vLLM's AsyncScheduler and the GPU model runner, with
    a KV cache of 64 blocks of 16 tokens so that requests are preempted and recomputed."""
    from test_vllm_held_logprobs import prompts, run_batch

    tally = tmp_path / "tally.json"
    monkeypatch.setenv("ASYNCRL_HELD_CHECK", str(tally))
    extra = {"scheduler_cls": "held_check.CheckingScheduler", "num_gpu_blocks_override": 64}
    b = registry.load("asyncrl.generation_backends", "vllm")(
        ctx_for(model_dir, tmp_path, extra_engine_args=extra)
    )
    await b.start()
    try:
        results = await run_batch(b._llm, prompts(48), "check")
        counts = json.loads(tally.read_text())
        print("checking scheduler on CUDA:", {k: v for k, v in counts.items() if k != "problems"})
        assert counts["different"] == 0, counts["problems"]
        assert counts["equal"] == 30
        assert counts["rows"] == sum(len(r["tokens"]) for r in results
                                     if r["kind"] == "FINAL_ONLY" and r["k"] is not None)
        assert counts["preempted"] > 0
    finally:
        await closed_leaving_nothing(b)


def turns_ctx(model_dir: Path, run_dir: Path, **options: object) -> WorkerContext:
    """A rollout rank that takes turns with a trainer (sleep mode on), CUDA graphs kept."""
    config = from_dict({
        "model": {"path": str(model_dir)},
        "environment": {"name": "arithmetic"},
        "cluster": {"placement": "take_turns"},
        "generator": {"options": {**OPTIONS, "enforce_eager": False, **options}},
    })  # fmt: skip
    return WorkerContext("rollout", 0, 1, 0, config, str(run_dir))


@pytest.mark.asyncio
async def test_a_sleeping_engine_releases_its_memory_and_the_refit_wakes_it(
    model_dir, sequences, tmp_path
) -> None:
    """``cluster.placement = "take_turns"`` on CUDA: each sleep gives the engine's share of the
    GPU back (weights and KV cache, vLLM's level 2) with requests in flight, which stop and
    wait; a request arriving while asleep waits too; the refit wakes the engine with new
    weights, whose scores match transformers', and every request finishes whole, its tokens
    labelled with the versions that made them."""
    b = registry.load("asyncrl.generation_backends", "vllm")(turns_ctx(model_dir, tmp_path))
    pair = LocalRefit("cuda_ipc", "cuda:0", bucket_size=64 << 10)
    try:
        await b.start()
        share = OPTIONS["gpu_memory_utilization"] * torch.cuda.mem_get_info(0)[1]
        for seed in (1, 2, 3):
            state = perturbed(model_dir, seed, "cuda:0")
            inflight = asyncio.create_task(generate_all(b, GenRequest(
                group_id=f"t{seed}", prompt_ids=[1, 8], n=4, max_tokens=300, seed=seed)))  # fmt: skip
            await asyncio.sleep(0.05)
            free = torch.cuda.mem_get_info(0)[0]
            facts = await b.sleep()
            freed = torch.cuda.mem_get_info(0)[0] - free
            arriving = asyncio.create_task(generate_all(b, GenRequest(
                group_id=f"a{seed}", prompt_ids=[1, 9], n=2, max_tokens=40, seed=seed)))  # fmt: skip
            await asyncio.sleep(0.05)
            assert not arriving.done() and b._turn.state == "asleep"
            sent, _ = await pair.push(b, seed, lambda: state.items())
            refit = b.last_refit
            print(f"sleep {facts['sleep_s'] * 1e3:.1f} ms freed {freed / 2**30:.2f} GiB "
                  f"(share {share / 2**30:.2f}), held {facts['held']}; wake "
                  f"{refit['wake_s'] * 1e3:.1f} ms, refit {refit['seconds'] * 1e3:.1f} ms")
            assert refit["woke"] and freed > 0.5 * share, (freed, share)
            got = await b.score(batch_of(sequences), 1.0)
            ref = reference(model_dir, {k: v.float().cpu() for k, v in state.items()})
            expected = np.concatenate([ref_logprobs(ref, s, p) for s, p in sequences])
            np.testing.assert_allclose(got, expected, atol=TOL)
            for s in [*await asyncio.wait_for(inflight, 60), *await arriving]:
                versions = s.versions.tolist()
                assert s.finish_reason in ("stop", "length") and versions == sorted(versions)
    finally:
        pair.close()
        await closed_leaving_nothing(b)


@pytest.mark.asyncio
async def test_fp8_kv_scales_are_written_again_after_the_wake(model_dir, tmp_path) -> None:
    """An FP8 KV cache that sleeps: the scales the waking refit carries are the ones the
    kernels use afterwards (vLLM may reset them when it wakes the cache: the backend writes them
    again), so 50.0 changes a greedy answer and 1.0 gives the first one back."""
    b = registry.load("asyncrl.generation_backends", "vllm")(
        turns_ctx(model_dir, tmp_path, kv_cache_dtype="fp8"))  # fmt: skip
    pair = LocalRefit("cuda_ipc", "cuda:0")
    try:
        await b.start()
        state = checkpoint_state(model_dir, "cuda:0")
        req = GenRequest(group_id="f", prompt_ids=[1, 9, 9, 4, 5, 6], n=1, max_tokens=24,
                         greedy=True)  # fmt: skip
        answers = {}
        for version, scale in ((1, 1.0), (2, 50.0), (3, 1.0)):
            scales = {f"model.layers.{i}.self_attn.{k}_scale": scale
                      for i in range(2) for k in "kv"}  # fmt: skip
            if version > 1:
                await b.sleep()
            await pair.push(b, version, lambda: state.items(), kv_scales=scales)
            assert b.last_refit["woke"] == (version > 1)
            (read,) = await b._rpc("asyncrl_get_kv_scales")
            assert all(v[:2] == [scale, scale] for v in read.values()), read
            (sample,) = await generate_all(b, req)
            answers[version] = sample.logprobs
        np.testing.assert_array_equal(answers[1], answers[3])
        assert not np.array_equal(answers[1], answers[2])
    finally:
        pair.close()
        await closed_leaving_nothing(b)
