"""The example ``bigram`` backends in-process: their math against independent references.

The gradient is checked against torch autograd through :func:`asyncrl_torch.loss.ppo_clip_loss`
(the loss every trainer must implement), sampling against the softmax it claims to sample
from, and refit against a real bucket file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

pytest.importorskip("asyncrl_example_backend")

from asyncrl_example_backend.generation import BigramGenerator  # noqa: E402
from asyncrl_example_backend.model import (  # noqa: E402
    TENSOR_NAME,
    initial_table,
    log_softmax,
    response_tokens,
)
from asyncrl_example_backend.training import BigramTrainer, ppo_gradient  # noqa: E402

from asyncrl.backend import WeightBucketView, WorkerContext  # noqa: E402
from asyncrl.transfers.shm import ShmHandle  # noqa: E402
from asyncrl.config import Config, from_dict  # noqa: E402
from asyncrl.errors import ConfigError, NonFiniteError  # noqa: E402
from asyncrl.policy.grpo import pack_tokens  # noqa: E402
from asyncrl.wire.messages import GenRequest, TensorEntry, TrainBatch  # noqa: E402

V, EOS = 11, 2


def _config(tmp_path: Path, **over: dict) -> Config:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": V, "eos_token_id": EOS}))
    (model / "tokenizer.json").write_text("{}")
    data = {
        "model": {"path": str(model)},
        "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(tmp_path / "out"), "seed": 3},
        "grpo": {"temperature": 0.7},
        "loss": {"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        "trainer": {"backend": "bigram"},
        "generator": {"backend": "bigram"},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value}
    return from_dict(data)


def _ctx(config: Config, group: str = "trainer", world_size: int = 1) -> WorkerContext:
    return WorkerContext(group=group, rank=0, world_size=world_size, local_rank=0,
                         config=config, run_dir="/nonexistent")


def _batch(rng: np.random.Generator, n: int = 6) -> TrainBatch:
    prompts = [list(rng.integers(3, V, size=rng.integers(1, 4))) for _ in range(n)]
    responses = [list(rng.integers(0, V, size=rng.integers(0, 6))) for _ in range(n)]
    tb = pack_tokens(prompts, responses)
    n_resp = int((tb.seq_lens - tb.prompt_lens).sum())
    return TrainBatch(
        tokens=tb.tokens, seq_lens=tb.seq_lens, prompt_lens=tb.prompt_lens,
        # behaviour logprobs far enough from the current ones that both clips bind somewhere
        behaviour_logprobs=(-np.abs(rng.normal(1.5, 1.0, n_resp))).astype(np.float32),
        advantages=rng.normal(0, 1, n).astype(np.float32),
        loss_mask=np.ones(n_resp, np.uint8),
    )


def _masked(batch: TrainBatch, rng: np.random.Generator, placeholder: float) -> TrainBatch:
    """``batch`` with about a third of its response tokens masked (inserted observations),
    their behaviour logprobs set to ``placeholder``, and the advantage of a sequence whose
    tokens are all masked set to ``placeholder`` too."""
    mask = (rng.random(batch.behaviour_logprobs.size) > 0.35).astype(np.uint8)
    beh = np.where(mask == 1, batch.behaviour_logprobs, placeholder).astype(np.float32)
    seq = response_tokens(batch)[2]
    trains = np.bincount(seq, weights=mask, minlength=batch.seq_lens.size)
    adv = np.where(trains == 0, placeholder, batch.advantages).astype(np.float32)
    return TrainBatch(batch.tokens, batch.seq_lens, batch.prompt_lens, beh, adv, mask)


def _hand_gradient(table: np.ndarray, batch: TrainBatch, t: float) -> tuple[np.ndarray, float]:
    """The summed loss and its gradient over the trained tokens, one token at a time in
    float64 (the module docstring's formulas; masked tokens skipped)."""
    grad, loss = np.zeros_like(table), 0.0
    lo, hi = 1 - 0.2, 1 + 0.28
    k = 0
    for i in range(batch.seq_lens.size):
        start = int(batch.seq_lens[:i].sum())
        seq = batch.tokens[start : start + int(batch.seq_lens[i])]
        for pos in range(int(batch.prompt_lens[i]), int(batch.seq_lens[i])):
            k += 1
            if batch.loss_mask[k - 1] == 0:
                continue
            prev, tok = int(seq[pos - 1]), int(seq[pos])
            z = table[prev] / t
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            r = p[tok] / np.exp(float(batch.behaviour_logprobs[k - 1]))
            a = float(batch.advantages[i])
            loss -= min(r * a, min(max(r, lo), hi) * a)
            clipped = (a > 0 and r > hi) or (a < 0 and r < lo)
            dlp = 0.0 if clipped else -a * r
            onehot = np.eye(len(p))[tok]
            grad[prev] += dlp * (onehot - p) / t
    return grad, loss


def test_masked_tokens_leave_the_update_unaffected(tmp_path: Path) -> None:
    """A step on a batch with masked tokens is the hand-computed step over its trained tokens
    alone, normalized by their count; huge placeholders (+1e30 behaviour logprobs and
    advantages) at the masked tokens give the same weights as 0.0, bit for bit."""
    cfg = _config(tmp_path, trainer={"options": {"lr": 0.3, "max_grad_norm": 0.0}})
    base = _batch(np.random.default_rng(5), 12)
    calm = _masked(base, np.random.default_rng(6), 0.0)
    wild = _masked(base, np.random.default_rng(6), 1e30)
    trained = int(calm.loss_mask.sum())
    assert 0 < trained < calm.loss_mask.size
    results, weights = [], []
    for batch in (calm, wild):
        t = BigramTrainer(_ctx(cfg))
        t.start()
        w0 = t.weights.copy()
        t.begin_step(0)
        chunk = t.train_chunk(0, batch)
        assert chunk.num_loss_tokens == trained and chunk.is_weight_sum == trained
        results.append(t.finish_step(0, trained))
        weights.append(t.weights)
    g, loss = _hand_gradient(w0, calm, 0.7)
    np.testing.assert_allclose(weights[0], w0 - 0.3 * g / trained, rtol=0, atol=1e-14)
    assert results[0].loss == pytest.approx(loss / trained, rel=1e-12)
    assert results[0].grad_norm == pytest.approx(np.linalg.norm(g / trained), rel=1e-12)
    np.testing.assert_array_equal(weights[1], weights[0])
    assert (results[1].loss, results[1].grad_norm) == (results[0].loss, results[0].grad_norm)
    # the masked tokens did matter: training them too moves the weights elsewhere
    g_all, _ = _hand_gradient(w0, base, 0.7)
    assert np.abs(g_all / base.loss_mask.size - g / trained).max() > 1e-3


def test_a_bad_loss_mask_is_refused(tmp_path: Path) -> None:
    t = BigramTrainer(_ctx(_config(tmp_path)))
    t.start()
    b = _batch(np.random.default_rng(7), 4)
    bad = TrainBatch(b.tokens, b.seq_lens, b.prompt_lens, b.behaviour_logprobs, b.advantages,
                     b.loss_mask * 2)  # fmt: skip
    t.begin_step(0)
    with pytest.raises(ValueError, match="malformed batch: loss_mask holds 2; expected only 0"):
        t.train_chunk(0, bad)


def test_response_tokens_follow_the_packing() -> None:
    tb = pack_tokens([[5, 6], [7]], [[8, 9, 2], []])
    prev, tok, seq = response_tokens(tb)
    assert prev.tolist() == [6, 8, 9] and tok.tolist() == [8, 9, 2] and seq.tolist() == [0, 0, 0]


def test_gradient_matches_torch_autograd_of_the_core_loss(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from asyncrl_torch.loss import ppo_clip_loss

    cfg = _config(tmp_path)
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (V, V))
    batch = _batch(rng, 12)
    grad, stats = ppo_gradient(table, batch, temperature=0.7, eps_low=0.2, eps_high=0.28)

    w = torch.tensor(table, dtype=torch.float64, requires_grad=True)
    prev, tok, seq = (torch.as_tensor(a) for a in response_tokens(batch))
    lp = torch.log_softmax(w[prev] / 0.7, dim=-1)[torch.arange(tok.numel()), tok]
    loss, tstats = ppo_clip_loss(
        lp,
        torch.as_tensor(np.asarray(batch.behaviour_logprobs), dtype=torch.float64),
        torch.as_tensor(np.asarray(batch.advantages), dtype=torch.float64)[seq],
        torch.ones(tok.numel(), dtype=torch.bool),
        clip_eps_low=cfg.loss.clip_eps_low, clip_eps_high=cfg.loss.clip_eps_high,
        is_cap=cfg.loss.is_cap,
    )
    loss.backward()
    assert 0 < int(tstats.clipped_tokens) < tok.numel(), "the batch should exercise the clip"
    assert stats["clipped_tokens"] == int(tstats.clipped_tokens)
    assert stats["loss_sum"] == pytest.approx(float(loss.detach()), rel=1e-12)
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-10, atol=1e-12)
    # the mismatch the step records: the same figures the torch trainers report
    assert stats["abs_logprob_diff_max"] == pytest.approx(float(tstats.abs_logprob_diff_max), rel=1e-12)
    assert stats["mismatch_k3_sum"] == pytest.approx(float(tstats.mismatch_k3_sum), rel=1e-12)
    assert stats["mismatch_k3_sum"] > 0


def test_streamed_chunks_equal_one_big_batch_and_sgd_is_exact(tmp_path: Path) -> None:
    cfg = _config(tmp_path, trainer={"options": {"lr": 0.3, "max_grad_norm": 0.0}})
    rng = np.random.default_rng(1)
    parts = [_batch(rng, 4), _batch(rng, 5)]
    whole = TrainBatch(*(np.concatenate([getattr(p, f) for p in parts])
                         for f in list(TrainBatch.__struct_fields__)[:6]))
    tokens = int(sum((p.seq_lens - p.prompt_lens).sum() for p in parts))

    streamed, big = BigramTrainer(_ctx(cfg)), BigramTrainer(_ctx(cfg))
    for t in (streamed, big):
        t.start()
    w0 = streamed.weights.copy()
    streamed.begin_step(0)
    for p in parts:
        streamed.train_chunk(0, p)
    r1 = streamed.finish_step(0, tokens)
    big.begin_step(0)
    big.train_chunk(0, whole)
    r2 = big.finish_step(0, tokens)
    np.testing.assert_allclose(streamed.weights, big.weights, rtol=0, atol=1e-14)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-12)
    # hand computation: w1 = w0 - lr * grad_sum / tokens
    g, _ = ppo_gradient(w0, whole, temperature=0.7, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(streamed.weights, w0 - 0.3 * g / tokens, rtol=0, atol=1e-14)
    assert r1.grad_norm == pytest.approx(np.linalg.norm(g / tokens), rel=1e-12)


def test_grad_norm_clipping_and_adam(tmp_path: Path) -> None:
    cfg = _config(tmp_path, trainer={"options": {"lr": 0.1, "max_grad_norm": 1e-3,
                                                 "optimizer": "adam"}})
    t = BigramTrainer(_ctx(cfg))
    t.start()
    w0 = t.weights.copy()
    batch = _batch(np.random.default_rng(2), 6)
    t.begin_step(0)
    t.train_chunk(0, batch)
    res = t.finish_step(0, 10)
    g, _ = ppo_gradient(w0, batch, temperature=0.7, eps_low=0.2, eps_high=0.28)
    g = g / 10
    norm = np.linalg.norm(g)
    assert res.grad_norm == pytest.approx(norm, rel=1e-12) and norm > 1e-3  # before clipping
    g = g * 1e-3 / (norm + 1e-6)  # torch's clip_grad_norm_ rule
    # Adam's first bias-corrected step: m_hat = g, v_hat = g^2
    np.testing.assert_allclose(t.weights, w0 - 0.1 * g / (np.abs(g) + 1e-8), rtol=0, atol=1e-12)


def test_save_load_step_equals_step(tmp_path: Path) -> None:
    cfg = _config(tmp_path, trainer={"options": {"lr": 0.1, "optimizer": "adam"}})
    rng = np.random.default_rng(3)
    batches = [_batch(rng, 4) for _ in range(2)]

    def step(t: BigramTrainer, k: int) -> None:
        t.begin_step(k)
        t.train_chunk(k, batches[k])
        t.finish_step(k, 10)

    uninterrupted, resumed = BigramTrainer(_ctx(cfg)), BigramTrainer(_ctx(cfg))
    uninterrupted.start()
    step(uninterrupted, 0)
    uninterrupted.save_state(str(tmp_path / "state"))
    step(uninterrupted, 1)
    resumed.start()
    resumed.load_state(str(tmp_path / "state"))
    step(resumed, 1)
    # the Adam moments and step count came back too: a fresh optimizer would differ by ~lr
    np.testing.assert_array_equal(resumed.weights, uninterrupted.weights)
    resumed.begin_step(2)
    with pytest.raises(RuntimeError, match="step 2 is open"):
        resumed.save_state(str(tmp_path / "other"))


def test_a_nonfinite_step_is_not_applied(tmp_path: Path) -> None:
    """A NaN gradient (the testing knob) leaves the weights and Adam's state as they were,
    and the result says so; the next ordinary step applies. (Its float64 math cannot overflow
    on a float32 batch.)"""
    cfg = _config(tmp_path, trainer={"options": {"lr": 0.1, "optimizer": "adam",
                                                 "nan_grad_at_steps": [0]}})
    t = BigramTrainer(_ctx(cfg))
    t.start()
    w0 = t.weights.copy()
    batch = _batch(np.random.default_rng(4), 6)
    t.begin_step(0)
    t.train_chunk(0, batch)
    res = t.finish_step(0, 10)
    assert np.isnan(res.grad_norm) and np.isfinite(res.loss)
    np.testing.assert_array_equal(t.weights, w0)
    t.begin_step(1)
    t.train_chunk(1, batch)
    assert np.isfinite(t.finish_step(1, 10).grad_norm)
    # Adam's first step (bias-corrected m_hat = g, v_hat = g^2): the skipped step left no
    # trace in its moments or step count
    g, _ = ppo_gradient(w0, batch, temperature=0.7, eps_low=0.2, eps_high=0.28)
    g = g / 10
    g = g * min(1.0, 1.0 / (np.linalg.norm(g) + 1e-6))
    np.testing.assert_allclose(t.weights, w0 - 0.1 * g / (np.abs(g) + 1e-8), rtol=0, atol=1e-12)


def test_nonfinite_weights_are_never_saved_nor_loaded(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    t = BigramTrainer(_ctx(cfg))
    t.start()
    t.save_state(str(tmp_path / "good"))
    t.weights[1, 2] = np.inf
    with pytest.raises(NonFiniteError, match=r"weights to save hold NaN or infinite values "
                       r"\(1 of 121 entries.*nothing was written"):  # fmt: skip
        t.save_state(str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
    # a checkpoint whose weights are NaN (written here with numpy, as a damaged file reads)
    with np.load(tmp_path / "good" / "bigram-state.npz") as f:
        state = {k: f[k] for k in f.files}
    state["weights"][3, :] = np.nan
    (tmp_path / "nan").mkdir()
    np.savez(tmp_path / "nan" / "bigram-state.npz", **state)
    fresh = BigramTrainer(_ctx(cfg))
    fresh.start()
    before = fresh.weights.copy()
    with pytest.raises(NonFiniteError, match=r"loaded from .*nan hold NaN.*11 of 121 entries"
                       r".*Fix: resume from an older checkpoint"):  # fmt: skip
        fresh.load_state(str(tmp_path / "nan"))
    np.testing.assert_array_equal(fresh.weights, before)  # nothing taken from it
    fresh.load_state(str(tmp_path / "good"))


def test_trainer_refuses_bad_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lrr"):
        BigramTrainer(_ctx(_config(tmp_path, trainer={"options": {"lrr": 1.0}})))
    with pytest.raises(ConfigError, match=r"trainer.options.lr"):
        BigramTrainer(_ctx(_config(tmp_path, trainer={"options": {"lr": -1.0}})))
    with pytest.raises(ConfigError, match="generator.options.token_delay_s"):
        BigramGenerator(_ctx(_config(tmp_path, generator={"options": {"token_delay_s": -1}}),
                             "rollout"))


async def collect(gen: BigramGenerator, req: GenRequest, order: list[int] | None = None) -> list:
    """Run ``generate`` and gather what it emits; every index must come exactly once."""
    got: dict[int, object] = {}

    async def emit(i: int, sample: object) -> None:
        assert i not in got and 0 <= i < req.n
        got[i] = sample
        if order is not None:
            order.append(i)

    await gen.generate(req, emit)
    assert sorted(got) == list(range(req.n))
    return [got[i] for i in range(req.n)]


@pytest.mark.asyncio
async def test_sampling_is_seeded_and_logprobs_are_after_temperature(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    req = GenRequest(group_id="g", prompt_ids=[1, 5], n=4, max_tokens=8, temperature=0.7, seed=42)
    a, b = await collect(gen, req), await collect(gen, req)
    for s, t in zip(a, b):
        assert s.token_ids.tolist() == t.token_ids.tolist()
    table = initial_table(cfg.model.path, cfg.run.seed)
    for s in a:
        assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
        prev = [5, *s.token_ids[:-1].tolist()]
        expected = log_softmax(table[prev] / 0.7)[np.arange(len(prev)), s.token_ids]
        np.testing.assert_allclose(s.logprobs, expected, rtol=1e-5)
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == EOS)
        assert s.finish_reason in ("stop", "length")
        assert EOS not in s.token_ids[:-1].tolist()
    # score() agrees with the sampled logprobs
    batch = pack_tokens([[1, 5]] * 4, [s.token_ids.tolist() for s in a])
    scored = await gen.score(batch, 0.7)
    np.testing.assert_allclose(scored, np.concatenate([s.logprobs for s in a]), rtol=1e-5)


@pytest.mark.asyncio
async def test_sampling_follows_the_softmax(tmp_path: Path) -> None:
    """Empirical next-token frequencies after one prompt token match softmax(row / T)."""
    cfg = _config(tmp_path)
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    req = GenRequest(group_id="g", prompt_ids=[4], n=4000, max_tokens=1, temperature=1.3, seed=0)
    firsts = np.array([s.token_ids[0] for s in await collect(gen, req)])
    p = np.exp(log_softmax(initial_table(cfg.model.path, cfg.run.seed)[4] / 1.3))
    freq = np.bincount(firsts, minlength=V) / firsts.size
    assert np.abs(freq - p).max() < 0.03


@pytest.mark.asyncio
async def test_refit_from_a_bucket_file_and_abort(tmp_path: Path) -> None:
    import anyio

    cfg = _config(tmp_path, generator={"options": {"token_delay_s": 0.01}})
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    new = np.arange(V * V, dtype=np.float32).reshape(V, V) / 7
    new[:, EOS] = -50.0  # never stop by itself: the abort below must be what stops it
    path = tmp_path / "bucket.bin"
    blob = bytearray(256) + new.tobytes()
    path.write_bytes(bytes(blob))
    entry = TensorEntry(TENSOR_NAME, "float32", [V, V], 256, new.nbytes)
    handle = msgspec.msgpack.encode(ShmHandle(str(path), len(blob)))
    with pytest.raises(ValueError, match="takes exactly bigram.logits"):  # before pausing
        await gen.begin_weight_update(1, [TensorEntry(TENSOR_NAME, "float32", [V, 3], 0, 0)])
    await gen.begin_weight_update(1, [TensorEntry(TENSOR_NAME, "float32", [V, V], 0, 0)])
    await gen.load_weight_bucket(WeightBucketView(1, 0, "shm", handle, len(blob), [entry], True))
    os.unlink(path)  # the backend must have copied the data out
    await gen.finish_weight_update(1, reset_prefix_cache=True)
    assert gen.version == 1
    np.testing.assert_array_equal(gen.table, new)
    with pytest.raises(ValueError, match="reads host memory"):
        await gen.load_weight_bucket(WeightBucketView(2, 0, "cuda_ipc", b"", 0, [entry], True))

    results = {}

    async def run() -> None:
        req = GenRequest(group_id="g1", prompt_ids=[3], n=3, max_tokens=1000, seed=1)
        results["g1"] = await collect(gen, req)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.1)
            await gen.abort(["g1"])
    samples = results["g1"]
    assert [s.finish_reason for s in samples] == ["abort"] * 3
    assert all(0 < len(s.token_ids) < 1000 for s in samples)  # they ran side by side


@pytest.mark.asyncio
async def test_samples_are_emitted_as_they_finish_within_the_engine_slots(tmp_path: Path) -> None:
    """Drawn lengths (log-normal), one engine slot: the samples run one at a time, and each is
    emitted when it finishes, so emission order is completion order, not index order."""
    cfg = _config(tmp_path, generator={"options": {
        "length_median": 4.0, "length_sigma": 1.0, "max_concurrent_samples": 2,
        "token_delay_s": 0.002}})
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    req = GenRequest(group_id="g", prompt_ids=[1], n=6, max_tokens=64, seed=3)
    order: list[int] = []
    samples = await collect(gen, req, order)
    lengths = [len(s.token_ids) for s in samples]
    rng_lengths = [
        int(min(64, max(1, round(np.random.default_rng([3, i]).lognormal(np.log(4.0), 1.0)))))
        for i in range(6)
    ]
    assert lengths == rng_lengths  # each sample's own seeded draw
    assert order != list(range(6)) or lengths == sorted(lengths)
    # with 2 slots, a sample starting third cannot finish before the shorter of the first two
    assert order[0] in (0, 1)


@pytest.mark.asyncio
async def test_a_sample_spanning_a_refit_reports_the_version_of_each_token(tmp_path: Path) -> None:
    """Generation pauses between tokens while weights load and resumes on the new ones: a
    sample in flight during the refit has tokens of both versions, in order, and says so."""
    import anyio

    # drawn lengths far above max_tokens (EOS ignored): each sample runs 60 tokens, across the refit
    options = {"token_delay_s": 0.005, "length_median": 1000.0, "length_sigma": 1e-6}
    cfg = _config(tmp_path, generator={"options": options})
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    table = np.zeros((V, V), np.float32)
    path = tmp_path / "bucket.bin"
    path.write_bytes(table.tobytes())
    entry = TensorEntry(TENSOR_NAME, "float32", [V, V], 0, table.nbytes)
    handle = msgspec.msgpack.encode(ShmHandle(str(path), table.nbytes))
    results = {}

    async def run() -> None:
        req = GenRequest(group_id="g", prompt_ids=[3], n=2, max_tokens=60, seed=1)
        results["g"] = await collect(gen, req)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.05)
            await gen.begin_weight_update(4, [TensorEntry(TENSOR_NAME, "float32", [V, V], 0, 0)])
            await gen.load_weight_bucket(WeightBucketView(4, 0, "shm", handle, table.nbytes,
                                                          [entry], True))  # fmt: skip
            await gen.finish_weight_update(4, reset_prefix_cache=True)
    for s in results["g"]:
        versions = s.versions.tolist()
        assert s.versions.dtype == np.int32 and len(versions) == len(s.token_ids) == 60
        k = versions.count(0)
        assert 0 < k < 60 and versions == [0] * k + [4] * (60 - k), versions
        # the tokens after the refit were drawn from the new, uniform table
        np.testing.assert_allclose(s.logprobs[k:], np.log(1 / V), rtol=1e-5)


@pytest.mark.asyncio
async def test_samples_share_the_engines_steps_and_a_cancelled_starter_holds_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``token_delay_s`` the engine works in steps: 16 samples of 6 tokens take 6 timers
    (one a step), not 96 (one a token); and when the sample that started a step is cancelled,
    the samples waiting on that step go on."""
    import anyio

    import asyncrl_example_backend.generation as generation

    timers: list[float] = []
    real_sleep = anyio.sleep

    async def counted(delay: float) -> None:
        timers.append(delay)
        await real_sleep(delay)

    monkeypatch.setattr(generation.anyio, "sleep", counted)
    cfg = _config(tmp_path, generator={"options": {
        "token_delay_s": 0.02, "length_median": 6.0, "length_sigma": 1e-9}})
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    samples = await collect(gen, GenRequest(group_id="g", prompt_ids=[1], n=16, max_tokens=64))
    assert [len(s.token_ids) for s in samples] == [6] * 16
    assert len(timers) == 6

    first = GenRequest(group_id="a", prompt_ids=[1], n=1, max_tokens=64)
    second = GenRequest(group_id="b", prompt_ids=[2], n=1, max_tokens=64)
    starter, done = anyio.CancelScope(), anyio.Event()

    async def run_first() -> None:
        with starter:
            await collect(gen, first)

    async def run_second() -> None:
        await collect(gen, second)
        done.set()

    async with anyio.create_task_group() as tg:
        timers.clear()
        tg.start_soon(run_first)
        while not timers:  # the first sample has started a step
            await real_sleep(0)
        tg.start_soon(run_second)
        await real_sleep(0.005)  # the second waits on that step
        starter.cancel()
        with anyio.fail_after(5):
            await done.wait()


@pytest.mark.parametrize("aggregation", ["sequence_mean", "constant"])
def test_loss_aggregation_against_the_objective_written_per_sequence(
    tmp_path: Path, aggregation: str
) -> None:
    """The packing (per_sequence_mean), the controller's normalizer and the trainer's division
    together take an SGD step down the gradient of the aggregated objective, written here per
    sequence with torch autograd in float64 (GRPO's original: mean over sequences of each
    one's token-mean; Dr. GRPO: the token sum over sequences x the constant), streamed in two
    chunks, a sequence with no trained token among them."""
    torch = pytest.importorskip("torch")
    from asyncrl.policy.grpo import per_sequence_mean, trained_per_sequence
    from asyncrl.run.train_step import normalizer
    from asyncrl_torch.loss import ppo_clip_loss

    cfg = _config(tmp_path, trainer={"options": {"lr": 0.3, "max_grad_norm": 0.0}},
                  loss={"aggregation": aggregation, "aggregation_constant": 7})  # fmt: skip
    rng = np.random.default_rng(4)
    parts = [_batch(rng, 4), _batch(rng, 5)]
    parts[1].loss_mask[: int(parts[1].seq_lens[0] - parts[1].prompt_lens[0])] = 0
    trainer = BigramTrainer(_ctx(cfg))
    trainer.start()
    w0 = trainer.weights.copy()
    trainer.begin_step(0)
    tokens = sequences = 0
    for p in parts:
        trained = trained_per_sequence(p)
        sequences += int(np.count_nonzero(trained))
        sent = per_sequence_mean(p, trained) if aggregation == "sequence_mean" else p
        tokens += trainer.train_chunk(0, sent).num_loss_tokens
    trainer.finish_step(0, tokens, normalizer=normalizer(cfg, sequences))

    w = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    per_seq = []
    for p in parts:
        prev, tok, seq = (torch.as_tensor(a) for a in response_tokens(p))
        lp = torch.log_softmax(w[prev] / 0.7, dim=-1)[torch.arange(tok.numel()), tok]
        beh = torch.as_tensor(np.asarray(p.behaviour_logprobs), dtype=torch.float64)
        adv = torch.as_tensor(np.asarray(p.advantages), dtype=torch.float64)
        mask = torch.as_tensor(p.loss_mask.astype(bool))
        for i in range(p.seq_lens.size):
            on = (seq == i) & mask
            if not bool(on.any()):
                continue  # trains nothing: not one of the step's sequences
            loss, _ = ppo_clip_loss(lp[on], beh[on], adv[i].expand(int(on.sum())), on[on],
                                    clip_eps_low=0.2, clip_eps_high=0.28, is_cap=2.0)  # fmt: skip
            per_seq.append(loss / int(on.sum()) if aggregation == "sequence_mean" else loss)
    assert len(per_seq) == sequences == 8
    objective = torch.stack(per_seq).sum() / (sequences if aggregation == "sequence_mean"
                                              else sequences * 7)  # fmt: skip
    objective.backward()
    # the scaled advantages are rounded to float32 again: measured 2.5e-10 (sequence_mean),
    # 4e-19 (constant)
    np.testing.assert_allclose(trainer.weights, w0 - 0.3 * w.grad.numpy(), rtol=0, atol=7.5e-10)


def test_the_bigram_trainer_refuses_sequence_ratios_and_the_current_proximal(tmp_path) -> None:
    """Masking and GSPO need the trainer's own proximal (fsdp2 or deepspeed): the bigram
    engine refuses them before anything starts, and takes the defaults (the config's side:
    backends/asyncrl-torch/tests/test_loss_corrections.py)."""
    from asyncrl_example_backend import training_plugin

    (tmp_path / "config.json").write_text('{"vocab_size": 8}')
    (tmp_path / "tokenizer.json").write_text("{}")

    def cfg(loss: dict) -> Config:
        return from_dict({"model": {"path": str(tmp_path)}, "environment": {"name": "repeat-digit"},
                          "loss": loss})  # fmt: skip

    with pytest.raises(ConfigError, match="need fsdp2 or deepspeed"):
        training_plugin.check_config(cfg({"ratio_level": "sequence"}), max_prompt_tokens=8)
    with pytest.raises(ConfigError, match="proximal_policy = 'current' need fsdp2"):
        training_plugin.check_config(cfg({"proximal_policy": "current"}), max_prompt_tokens=8)
    training_plugin.check_config(cfg({}), max_prompt_tokens=8)  # the defaults are its own


def test_jobs_train_tables_of_their_own_interleaved_as_each_alone(tmp_path: Path) -> None:
    """``TrainsJobs`` on the reference backend (docs/jobs.md): two jobs open beside the run's
    own table, each from the base at its own learning rate; their steps open at once and their
    chunks interleaved end exactly where each ends alone (the hand computation: plain SGD from
    the base), the run's table untouched; a job saved and loaded into a new trainer goes on."""
    cfg = _config(tmp_path, trainer={"options": {"lr": 0.3, "max_grad_norm": 0.0}})
    rng = np.random.default_rng(4)
    a1, a2, b1 = _batch(rng, 4), _batch(rng, 5), _batch(rng, 3)

    def tokens(*batches: TrainBatch) -> int:
        return int(sum((b.seq_lens - b.prompt_lens).sum() for b in batches))

    t = BigramTrainer(_ctx(cfg))
    t.start()
    base = t.weights.copy()
    t.open_job("a", seed=1, lr=0.5)
    t.open_job("b", seed=2, lr=0.05)
    with pytest.raises(RuntimeError, match="open already"):
        t.open_job("a", seed=1, lr=0.5)
    t.begin_step(1, job="a")
    t.begin_step(1, job="b")
    t.train_chunk(1, a1, job="a")
    t.train_chunk(1, b1, job="b")
    t.train_chunk(1, a2, job="a")
    rb = t.finish_step(1, tokens(b1), job="b")
    ra = t.finish_step(1, tokens(a1, a2), job="a")
    assert (ra.lr, rb.lr) == (0.5, 0.05)
    g_a = sum(ppo_gradient(base, b, temperature=0.7, eps_low=0.2, eps_high=0.28)[0]
              for b in (a1, a2))  # fmt: skip
    g_b, _ = ppo_gradient(base, b1, temperature=0.7, eps_low=0.2, eps_high=0.28)
    table = lambda job: np.frombuffer(next(t.iter_weights(job=job)).data, np.float32)  # noqa: E731
    want_a = base - 0.5 * g_a / tokens(a1, a2)
    np.testing.assert_allclose(t._job("a").weights, want_a, rtol=0, atol=1e-14)
    np.testing.assert_allclose(t._job("b").weights, base - 0.05 * g_b / tokens(b1), atol=1e-14)
    np.testing.assert_array_equal(table("a"), want_a.astype(np.float32).reshape(-1))
    np.testing.assert_array_equal(t.weights, base)  # the run's own: no step taken
    t.save_state(str(tmp_path / "a"), job="a")
    t.close_job("a")
    with pytest.raises(RuntimeError, match="not open"):
        t.begin_step(2, job="a")
    moved = BigramTrainer(_ctx(cfg))
    moved.start()
    moved.open_job("a", seed=9, lr=0.9)
    moved.load_state(str(tmp_path / "a"), job="a")
    np.testing.assert_array_equal(moved._job("a").weights, want_a)
    assert moved._job("a").lr == 0.5  # the checkpoint's


@pytest.mark.asyncio
async def test_jobs_requests_sample_from_their_own_jobs_table(tmp_path: Path) -> None:
    """``ServesJobs`` on the reference backend: a job samples from the base until its first
    refit, then from its own table (another job's refit leaves it alone); its tokens carry
    its own version; a closed job's requests are refused."""
    from asyncrl.errors import RequestError

    cfg = _config(tmp_path)
    gen = BigramGenerator(_ctx(cfg, "rollout"))
    await gen.start()
    new = np.full((V, V), -50.0, np.float32)
    new[:, 7] = 0.0  # job a's table: always token 7
    path = tmp_path / "bucket.bin"
    path.write_bytes(new.tobytes())
    entry = TensorEntry(TENSOR_NAME, "float32", [V, V], 0, new.nbytes)
    handle = msgspec.msgpack.encode(ShmHandle(str(path), new.nbytes))
    await gen.begin_weight_update(3, [TensorEntry(TENSOR_NAME, "float32", [V, V], 0, 0)], job="a")
    await gen.load_weight_bucket(WeightBucketView(3, 0, "shm", handle, new.nbytes, [entry], True))
    await gen.finish_weight_update(3, reset_prefix_cache=True, job="a")

    def request(job: str) -> GenRequest:
        return GenRequest(group_id=f"{job}:g", prompt_ids=[4], n=20, max_tokens=3, seed=5,
                          temperature=1.0, job=job)  # fmt: skip

    a = await collect(gen, request("a"))
    assert all(s.token_ids.tolist() == [7, 7, 7] and s.versions.tolist() == [3] * 3 for s in a)
    b = await collect(gen, request("b"))  # no refit of b yet: the base, version 0
    assert any(s.token_ids.tolist() != [7, 7, 7] for s in b)
    assert all(set(s.versions.tolist()) == {0} for s in b) and gen.version == 0
    await gen.close_job("a")
    with pytest.raises(RequestError, match="job 'a' was closed"):
        await collect(gen, request("a"))
