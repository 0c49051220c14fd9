"""Packed micro-batches (``trainer.pack_sequences``): the layout by hand, the logprobs against
each sequence run alone through a real transformers model, and the start-time check that
catches attention which ignores the boundaries."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from asyncrl_torch.batches import (  # noqa: E402
    PACKING_TOLERANCE,
    MicroBatch,
    PackingCheck,
    make_micro_batch,
    packing_check,
    plan_micro_batches,
    response_logprobs,
)
from asyncrl.wire.messages import TokenBatch  # noqa: E402

CPU = torch.device("cpu")
VOCAB = 96


def tiny_qwen2(seed: int, attn: str) -> torch.nn.Module:
    """Two layers, grouped-query attention, transformers' own random init (std 0.02, like
    the checkpoints the benchmarks build)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        attn_implementation=attn,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(cfg).to(torch.float32).eval()


def forward_of(model: torch.nn.Module, ignore_boundaries: bool = False):
    """What the trainer's ``_forward`` does; ``ignore_boundaries`` gives the model an
    all-ones attention mask, which makes transformers skip the packed-sequence detection:
    the failure the start-time check exists for."""

    def forward(mb: MicroBatch) -> torch.Tensor:
        inputs = mb.model_inputs()
        if ignore_boundaries:
            inputs["attention_mask"] = torch.ones_like(mb.input_ids)
        return model(**inputs, use_cache=False).logits

    return forward


def test_packed_row_layout_by_hand() -> None:
    seq_lens = np.array([5, 3, 4], dtype=np.int32)
    prompt_lens = np.array([2, 3, 1], dtype=np.int32)  # the second has no response token
    tokens = np.array([1, 7, 8, 9, 2, 1, 4, 5, 1, 6, 6, 2], dtype=np.int32)
    mb = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 3, device=CPU, packed=True)
    assert mb.input_ids.tolist() == [tokens.tolist()]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    # sequence 0: responses at 2, 3, 4 (predicted from 1, 2, 3); sequence 2 starts at 8,
    # responses at its positions 1, 2, 3 = row places 9, 10, 11 (predicted from 8, 9, 10)
    assert mb.rows.tolist() == [0] * 6
    assert mb.cols.tolist() == [1, 2, 3, 8, 9, 10]
    assert mb.targets.tolist() == [8, 9, 2, 6, 6, 2]
    assert mb.response_slice == slice(0, 6) and mb.window == (1, 11)
    part = make_micro_batch(tokens, seq_lens, prompt_lens, 1, 3, device=CPU, packed=True)
    assert part.input_ids.tolist() == [[1, 4, 5, 1, 6, 6, 2]]
    assert part.cols.tolist() == [3, 4, 5] and part.response_slice == slice(3, 6)
    padded = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 3, device=CPU)
    assert padded.position_ids is None and set(padded.model_inputs()) == {"input_ids"}


def test_packed_plan_keeps_the_order_and_sums_lengths() -> None:
    lens = np.array([9, 3, 4, 2, 7], dtype=np.int32)
    batch = TokenBatch(tokens=np.arange(int(lens.sum()), dtype=np.int32), seq_lens=lens,
                       prompt_lens=np.ones(5, dtype=np.int32))  # fmt: skip
    planned, bounds, order = plan_micro_batches(batch, 2, 10, packed=True)
    assert planned is batch and order is None
    assert bounds == [(0, 1), (1, 4), (4, 5)]  # 9 | 3+4+2 = 9 | 7 (9 + 3 > 10, 9 + 7 > 10)
    _, sorted_bounds, sorted_order = plan_micro_batches(batch, 2, 10)
    assert sorted_order.tolist() == [3, 1, 2, 4, 0] and sorted_bounds[0] == (0, 2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_logprobs_match_each_sequence_alone(attn: str, seed: int) -> None:
    """A row of four sequences against each one alone (independent: a batch of one needs no
    boundary). float32 on this CPU: the largest difference measured was 0 (2 seeds, sdpa and
    eager); 1e-5 allows other CPUs' kernels a few ulps of these O(1..5) values."""
    model = tiny_qwen2(seed, attn)
    rng = np.random.default_rng(seed)
    seq_lens = np.array([17, 5, 30, 11], dtype=np.int32)
    prompt_lens = np.array([4, 5, 1, 6], dtype=np.int32)  # one without a response token
    tokens = rng.integers(0, VOCAB, int(seq_lens.sum())).astype(np.int32)
    forward = forward_of(model)
    with torch.no_grad():
        mb = make_micro_batch(tokens, seq_lens, prompt_lens, 0, 4, device=CPU, packed=True)
        together = response_logprobs(forward(mb), mb, 0.7)
        apart = torch.cat([
            response_logprobs(forward(one), one, 0.7)
            for one in (make_micro_batch(tokens, seq_lens, prompt_lens, i, i + 1, device=CPU)
                        for i in range(4))
        ])  # fmt: skip
    assert together.shape == apart.shape == (int((seq_lens - prompt_lens).sum()),)
    assert (together - apart).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_start_check_tells_separated_from_leaking_attention(
    seed: int, dtype: torch.dtype
) -> None:
    """What ``DistributedTrainer._check_packing`` decides on: a packed sequence's logprobs
    do not move at all when the sequence before it is replaced, in either dtype, where
    transformers honours the boundaries (measured: exactly 0); they move by far more than
    the tolerance where a sequence sees the one before (measured 0.15-0.22 on these models).
    The comparison with each sequence alone is rounding in bf16, exact in float32."""
    model = tiny_qwen2(seed, "sdpa").to(dtype)
    with torch.no_grad():
        good = packing_check(forward_of(model), VOCAB, CPU)
        leaking = packing_check(forward_of(model, ignore_boundaries=True), VOCAB, CPU)
    assert good.swapped == 0.0 and good.separated
    assert leaking.swapped > PACKING_TOLERANCE and not leaking.separated
    if dtype == torch.float32:
        assert good.apart <= 1e-5  # the bound of the test above


def test_the_start_check_decides_on_the_swap_not_on_rounding() -> None:
    """A correct packing of a large bf16 model: the swap moves nothing, while the row against
    each sequence alone differs by rounding beyond the tolerance (0.020 on a 0.5B model on an
    H100, larger for larger models). It must pass; any movement under the swap must not."""
    assert PackingCheck(swapped=0.0, apart=3 * PACKING_TOLERANCE).separated
    assert PackingCheck(swapped=PACKING_TOLERANCE, apart=0.0).separated  # the bound itself
    assert not PackingCheck(swapped=PACKING_TOLERANCE * 1.01, apart=0.0).separated
