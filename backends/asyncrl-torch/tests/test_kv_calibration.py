"""asyncrl_torch.kv_calibration against float64 hand computations on a tiny random Qwen2."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from asyncrl_torch.kv_calibration import (
    all_reduce_max,
    calibrate_kv_scales,
    combine_amax,
    record_qkv_amax,
    scale_names,
    scales_from_amax,
    valid_positions,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from asyncrl_torch.batches import dummy_micro_batch, make_micro_batch

pytestmark = pytest.mark.timeout(120)

F64 = torch.float64
CPU = torch.device("cpu")
NUM_LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB, THETA = 2, 4, 2, 64, 128, 10000.0
HEAD_DIM = HIDDEN // HEADS

# Recorded float32 amax vs the float64 reference below, relative: measured max 2.5e-7 (about
# 2 float32 ulps) over q/k/v of both layers, seeds 0-2, sdpa and eager, 3 sequences of 30,
# 200 and 500 positions, weights of std 0.3 (amaxes 8..11). Bound: 3x that.
REL_TOL = 7.5e-7


def tiny_qwen2(seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_theta=THETA,
        attn_implementation=attn,
    )
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init, so amaxes are O(1..10)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def reference_amax(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """``[3 (k, v, q), layers]`` amax in float64 over all positions of ``ids`` (unpadded).

    The float32 model supplies only each layer's attention input (captured by a pre-hook);
    projections, head split and RoPE (own inv_freq, positions, rotate_half) run in float64.
    """
    inputs: dict[int, torch.Tensor] = {}

    def grab(i: int):
        def hook(module, args, kwargs):
            inputs[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return hook

    layers = model.model.layers
    handles = [
        layer.self_attn.register_forward_pre_hook(grab(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()

    b, length = ids.shape
    inv_freq = THETA ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    angles = np.outer(np.arange(length, dtype=np.float64), inv_freq)  # [L, d/2]
    cos = torch.from_numpy(np.cos(np.concatenate([angles, angles], axis=1)))
    sin = torch.from_numpy(np.sin(np.concatenate([angles, angles], axis=1)))

    def rope(x: torch.Tensor) -> torch.Tensor:  # [b, heads, L, d]
        half = HEAD_DIM // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    out = np.zeros((3, len(layers)))
    for i, layer in enumerate(layers):
        attn, h = layer.self_attn, inputs[i].to(F64)

        def proj(lin: torch.nn.Linear, heads: int, h: torch.Tensor = h) -> torch.Tensor:
            y = h @ lin.weight.detach().to(F64).T + lin.bias.detach().to(F64)
            return y.reshape(b, length, heads, HEAD_DIM).permute(0, 2, 1, 3)

        k = rope(proj(attn.k_proj, KV_HEADS))
        v = proj(attn.v_proj, KV_HEADS)
        q = rope(proj(attn.q_proj, HEADS))
        out[:, i] = [float(t.abs().max()) for t in (k, v, q)]
    return out


def record(model, ids, valid=None, include_q=True) -> np.ndarray:
    with torch.no_grad(), record_qkv_amax(model, include_q) as rec, rec.sample(valid):
        model(input_ids=ids, use_cache=False)
    samples = rec.samples()
    assert samples.shape == (1, 3 if include_q else 2, NUM_LAYERS)
    return samples[0]


# ---------------------------------------------------------------------- 1. pure math
def hand_percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between the closest ranks, written out."""
    s = sorted(values)
    pos = pct / 100.0 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


@pytest.mark.parametrize("pct", [0.0, 37.5, 50.0, 99.9, 100.0])
def test_combine_and_scales_match_hand_computation(pct: float) -> None:
    rng = np.random.default_rng(1)
    samples = rng.lognormal(size=(7, 5))  # [micro-batches, layers]
    combined = combine_amax(samples.tolist(), pct)
    hand = [hand_percentile(samples[:, j].tolist(), pct) for j in range(5)]
    np.testing.assert_allclose(combined, hand, rtol=1e-13, atol=0)
    scales = scales_from_amax(combined, margin=1.05)
    np.testing.assert_allclose(scales, [a * 1.05 / 448.0 for a in hand], rtol=1e-13, atol=0)
    assert scales_from_amax([448.0], margin=1.0, fp8_max=448.0).tolist() == [1.0]


def test_combine_amax_single_sample_extra_axes_and_bad_input() -> None:
    a = np.array([[[1.0, 2.0], [3.0, 4.0]]])
    np.testing.assert_array_equal(combine_amax(a, 99.9), a[0])
    with pytest.raises(ValueError, match="at least one"):
        combine_amax(np.zeros((0, 3)), 50)
    with pytest.raises(ValueError, match="percentile"):
        combine_amax([[1.0]], 100.5)


def test_scale_names() -> None:
    assert scale_names(2, ("k", "v")) == [
        "model.layers.0.self_attn.k_scale",
        "model.layers.1.self_attn.k_scale",
        "model.layers.0.self_attn.v_scale",
        "model.layers.1.self_attn.v_scale",
    ]
    assert scale_names(1, ("q",)) == ["model.layers.0.self_attn.q_scale"]
    with pytest.raises(ValueError, match="unknown scale kind"):
        scale_names(1, ("o",))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_scales_reject_zero_and_non_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="finite and > 0"):
        scales_from_amax([1.0, bad, 2.0])


def test_all_reduce_max_without_process_group_is_identity() -> None:
    t = torch.tensor([1.0, 3.0], dtype=F64)
    assert all_reduce_max(t) is t and t.tolist() == [1.0, 3.0]


# ---------------------------------------------------------------------- 2. recorder
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_recorder_matches_float64_reference(attn: str) -> None:
    model = tiny_qwen2(attn=attn)
    assert model.config._attn_implementation == attn
    ids = torch.randint(0, VOCAB, (3, 200), generator=torch.Generator().manual_seed(2))
    got = record(model, ids)  # rows k, v, q
    ref = reference_amax(model, ids)
    assert (ref > 1.0).all()  # non-trivial magnitudes
    np.testing.assert_allclose(got, ref, rtol=REL_TOL, atol=0)
    # layers differ, so a layer mix-up would fail
    assert not np.allclose(got[:, 0], got[:, 1], rtol=1e-3)


def test_recorder_one_sample_per_block_and_k_v_only() -> None:
    model = tiny_qwen2()
    g = torch.Generator().manual_seed(3)
    a, b = (
        torch.randint(0, VOCAB, (2, 30), generator=g),
        torch.randint(0, VOCAB, (1, 50), generator=g),
    )
    with torch.no_grad(), record_qkv_amax(model, include_q=False) as rec:
        assert rec.kinds == ("k", "v")
        for ids in (a, b):
            with rec.sample():
                model(input_ids=ids, use_cache=False)
        with rec.sample():  # two forwards in one sample: the max of both
            model(input_ids=a, use_cache=False)
            model(input_ids=b, use_cache=False)
    s = rec.samples()
    assert s.shape == (3, 2, NUM_LAYERS)
    np.testing.assert_allclose(s[0], reference_amax(model, a)[:2], rtol=REL_TOL)
    np.testing.assert_allclose(s[1], reference_amax(model, b)[:2], rtol=REL_TOL)
    assert not (s[0] >= s[1]).all() and not (s[1] >= s[0]).all()
    np.testing.assert_array_equal(s[2], np.maximum(s[0], s[1]))


# ---------------------------------------------------------------------- 3. padding
PAD = 5


def test_padding_is_excluded() -> None:
    model = tiny_qwen2()
    for layer in model.model.layers:  # else RMSNorm would undo the pad embedding's size
        layer.input_layernorm = torch.nn.Identity()
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD] = 1e3  # pads would dominate every amax
    rng = np.random.default_rng(4)
    seq_lens = np.array([9, 20, 14])
    prompt_lens = np.array([4, 10, 14])  # the last one has no response tokens
    tokens = rng.integers(0, VOCAB, size=int(seq_lens.sum()))
    tokens[tokens == PAD] = PAD + 1
    mb = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 2, device=CPU, pad_id=PAD)
    assert mb.input_ids.shape == (2, 20) and (mb.input_ids[0, 9:] == PAD).all()

    valid = valid_positions(mb)
    assert valid.sum(dim=1).tolist() == [9, 20]
    padded = record(model, mb.input_ids, valid)
    offsets = np.concatenate([[0], np.cumsum(seq_lens)])
    seqs = [torch.from_numpy(tokens[offsets[i] : offsets[i + 1]])[None] for i in range(2)]
    unpadded = np.maximum(*(reference_amax(model, s) for s in seqs))
    np.testing.assert_allclose(padded, unpadded, rtol=REL_TOL, atol=0)
    # counting the pads would change the result
    assert (record(model, mb.input_ids, None) > 10 * unpadded).all()

    # a row without response tokens (length unknown) is counted in full
    mb2 = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 3, device=CPU, pad_id=PAD)
    assert valid_positions(mb2).sum(dim=1).tolist() == [9, 20, 20]


def test_valid_mask_shape_is_checked() -> None:
    model = tiny_qwen2()
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(ValueError, match="valid mask has shape"):
        record(model, ids, torch.ones(2, 7, dtype=torch.bool))


# ---------------------------------------------------------------------- 4. errors, restore
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_recorder_restores_attention_after_exception(attn: str) -> None:
    model = tiny_qwen2(attn=attn)
    ids = torch.randint(0, VOCAB, (1, 6))
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    original = ALL_ATTENTION_FUNCTIONS.get_interface(attn, None)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        with pytest.raises(RuntimeError, match="boom"), record_qkv_amax(model) as rec:
            assert ALL_ATTENTION_FUNCTIONS.get_interface(attn, None) is not original
            with rec.sample():
                model(input_ids=ids, use_cache=False)
            raise RuntimeError("boom")
        assert ALL_ATTENTION_FUNCTIONS._local_mapping == before
        assert ALL_ATTENTION_FUNCTIONS.get_interface(attn, None) is original
        # the wrapper would refuse a forward outside sample(); this one runs unrecorded
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, expected)


def test_recorder_restores_a_previous_local_override_and_ignores_other_models() -> None:
    model, other = tiny_qwen2(seed=0), tiny_qwen2(seed=1)
    calls: list[int] = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def custom(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = custom
    try:
        ids = torch.randint(0, VOCAB, (1, 6))
        with torch.no_grad(), record_qkv_amax(model) as rec:
            other(input_ids=ids, use_cache=False)  # not recorded: no sample() needed
            with rec.sample():
                model(input_ids=ids, use_cache=False)
        assert calls == [0, 1, 0, 1]  # the previous override still ran inside
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is custom
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert rec.samples().shape == (1, 2, NUM_LAYERS)


def test_attention_outside_sample_raises() -> None:
    model = tiny_qwen2()
    with (
        torch.no_grad(),
        record_qkv_amax(model),
        pytest.raises(RuntimeError, match="outside QKVAmaxRecorder.sample"),
    ):
        model(input_ids=torch.zeros(1, 3, dtype=torch.int64), use_cache=False)


def test_unseen_layer_gives_an_error_not_a_zero_scale() -> None:
    model = tiny_qwen2()
    with torch.no_grad(), record_qkv_amax(model, num_layers=NUM_LAYERS + 1) as rec, rec.sample():
        model(input_ids=torch.ones(1, 4, dtype=torch.int64), use_cache=False)
    amax = combine_amax(rec.samples(), 99.9)
    assert amax[:, NUM_LAYERS].tolist() == [0.0, 0.0] and (amax[:, :NUM_LAYERS] > 0).all()
    with pytest.raises(ValueError, match="finite and > 0"):
        scales_from_amax(amax)
    # only dummy (response-free) micro-batches: nothing sampled, so no scales either
    with pytest.raises(ValueError, match="finite and > 0"):
        calibrate_kv_scales(
            model,
            [dummy_micro_batch(device=CPU)],
            lambda mb: model(input_ids=mb.input_ids, use_cache=False),
        )


def test_non_finite_activations_are_rejected() -> None:
    model = tiny_qwen2()
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.bias[0] = math.inf
    mb = make_micro_batch(np.arange(6), np.array([6]), np.array([3]), 0, 1, device=CPU)
    with pytest.raises(ValueError, match="finite and > 0"):
        calibrate_kv_scales(
            model,
            [mb],
            lambda m: model(input_ids=m.input_ids, use_cache=False),
            reduce_max=lambda t: t,
        )


# ---------------------------------------------------------------------- 5. end to end
def test_calibrate_kv_scales_end_to_end() -> None:
    model = tiny_qwen2().train()
    model.lm_head.eval()  # a mixed pattern, to see every flag restored
    rng = np.random.default_rng(5)
    seq_lens, prompt_lens = np.array([40, 64]), np.array([10, 30])
    tokens = rng.integers(0, VOCAB, size=int(seq_lens.sum()))
    mbs = [make_micro_batch(tokens, seq_lens, prompt_lens, i, i + 1, device=CPU) for i in range(2)]
    mbs.append(dummy_micro_batch(device=CPU))  # lockstep padding: forwarded, not sampled
    forwards: list[int] = []
    reduced: list[torch.Tensor] = []

    def forward(mb):
        assert not model.training and not torch.is_grad_enabled()
        forwards.append(mb.input_ids.shape[1])
        return model(input_ids=mb.input_ids, use_cache=False)

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        reduced.append(t.clone())
        return t

    scales = calibrate_kv_scales(model, mbs, forward, include_q=True, reduce_max=reduce_max)
    assert forwards == [40, 64, 2]
    assert model.training and not model.lm_head.training and model.model.training

    offsets = np.concatenate([[0], np.cumsum(seq_lens)])
    per_mb = [
        reference_amax(model, torch.from_numpy(tokens[offsets[i] : offsets[i + 1]])[None])
        for i in range(2)
    ]  # each [k/v/q, layers]
    assert len(reduced) == 1 and reduced[0].shape == (3, NUM_LAYERS)
    expected_names = [
        f"model.layers.{i}.self_attn.{kind}_scale" for kind in "kvq" for i in range(NUM_LAYERS)
    ]
    assert list(scales) == expected_names
    for j, kind in enumerate("kvq"):
        for i in range(NUM_LAYERS):
            lo, hi = sorted(float(a[j, i]) for a in per_mb)
            assert lo < hi * (1 - 1e-3)  # the percentile is not just the max
            expected = (lo + 0.999 * (hi - lo)) * 1.05 / 448.0
            got = scales[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert got == pytest.approx(expected, rel=REL_TOL, abs=0)

    kv_only = calibrate_kv_scales(model, mbs[:2], forward, percentile=0.0, margin=1.0)
    assert list(kv_only) == expected_names[: 2 * NUM_LAYERS]
    lo = min(float(a[0, 0]) for a in per_mb)
    assert kv_only["model.layers.0.self_attn.k_scale"] == pytest.approx(lo / 448, rel=REL_TOL)


def test_calibrate_under_fsdp2_matches_unsharded(tmp_path) -> None:
    """fully_shard (single-process gloo group, CPU), attention modules sharded too, so their
    classes are FSDP's dynamic subclasses; the eager path must find its function anyway."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group yet")
    model = tiny_qwen2(attn="eager")
    rng = np.random.default_rng(6)
    seq_lens, prompt_lens = np.array([40, 64, 25]), np.array([10, 30, 5])
    tokens = rng.integers(0, VOCAB, size=int(seq_lens.sum()))
    mbs = [make_micro_batch(tokens, seq_lens, prompt_lens, 0, 2, device=CPU)]
    mbs.append(make_micro_batch(tokens, seq_lens, prompt_lens, 2, 3, device=CPU))

    def forward(mb):
        return model(input_ids=mb.input_ids, use_cache=False)

    unsharded = calibrate_kv_scales(model, mbs, forward, include_q=True)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer.self_attn, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.model.layers[0].self_attn).__name__ == "FSDPQwen2Attention"
        sharded = calibrate_kv_scales(
            model, mbs, forward, include_q=True, reduce_max=all_reduce_max
        )
    finally:
        dist.destroy_process_group()
    assert list(sharded) == list(unsharded)
    np.testing.assert_allclose(
        list(sharded.values()), list(unsharded.values()), rtol=REL_TOL, atol=0
    )
