"""asyncrl.policy.packing.Layout against sequences cut out by hand, token-budget cuts and a
batch reordered by sequence. (The trainer's side: micro-batch plans, byte groups and the step
ledger, is asyncrl_torch's: backends/asyncrl-torch/tests/test_batches.py.)"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.policy.packing import Layout, check_packed, length_order, token_budget_bounds
from asyncrl.policy.grpo import take_sequences
from asyncrl.wire.messages import TrainBatch


@st.composite
def packed(draw) -> tuple[list[list[int]], list[int]]:
    """Sequences as plain lists, and their prompt lengths."""
    n = draw(st.integers(0, 6))
    seqs, prompts = [], []
    for _ in range(n):
        prompt = draw(st.integers(1, 5))
        response = draw(st.integers(0, 5))
        seqs.append(draw(st.lists(st.integers(0, 99), min_size=prompt + response,
                                  max_size=prompt + response)))  # fmt: skip
        prompts.append(prompt)
    return seqs, prompts


@given(packed())
def test_layout_matches_sequences_cut_by_hand(case) -> None:
    seqs, prompts = case
    tokens = np.array([t for s in seqs for t in s], dtype=np.int32)
    layout = Layout.of(np.array([len(s) for s in seqs]), np.array(prompts))
    # the per-response-token array a generator would send: (sequence, position) pairs
    flat = [(i, p) for i, s in enumerate(seqs) for p in range(prompts[i], len(s))]
    assert layout.num_sequences == len(seqs)
    assert layout.num_response_tokens == len(flat)
    for i, s in enumerate(seqs):
        assert tokens[layout.sequence(i)].tolist() == s
        assert [flat[k] for k in range(*layout.response(i).indices(len(flat)))] == [
            (i, p) for p in range(prompts[i], len(s))
        ]
    positions = layout.response_positions()
    starts = np.cumsum([0] + [len(s) for s in seqs])
    assert positions.tolist() == [int(starts[i]) + p for i, p in flat]
    idx = list(range(len(seqs)))[::-1]
    assert layout.gather_tokens(tokens, idx, np.int32).tolist() == [t for i in idx for t in seqs[i]]
    values = np.arange(len(flat), dtype=np.float32)
    assert layout.gather_responses(values, idx, np.float32).tolist() == [
        float(k) for i in idx for k, (j, _) in enumerate(flat) if j == i
    ]
    assert check_packed(tokens, layout.seq_lens, layout.prompt_lens, vocab_size=100) is None


@given(
    st.lists(st.integers(1, 40), max_size=30), st.integers(1, 120), st.booleans(), st.booleans()
)
def test_token_budget_bounds_cut_greedily_within_the_budget(lens, budget, sort, packed) -> None:
    """The ranges tile the batch in order; each fits the budget (``count x longest``, or the
    sum of lengths when ``packed``) or is one sequence; and none could have taken the next
    sequence (greedy)."""
    lens_np = np.array(lens, dtype=np.int64)
    if sort:
        lens_np = lens_np[length_order(lens_np)]

    def size(a: int, b: int) -> int:
        part = lens_np[a:b].tolist()
        return sum(part) if packed else (b - a) * max(part)

    bounds = token_budget_bounds(lens_np, budget, packed=packed)
    assert [i for a, b in bounds for i in range(a, b)] == list(range(len(lens)))
    for k, (a, b) in enumerate(bounds):
        assert b > a
        assert b - a == 1 or size(a, b) <= budget, (a, b, size(a, b))
        if k + 1 < len(bounds):
            assert size(a, b + 1) > budget


def test_token_budget_bounds_by_hand() -> None:
    assert token_budget_bounds(np.array([2, 3, 3, 5, 9, 20]), 10) == [(0, 3), (3, 4), (4, 5),
                                                                      (5, 6)]  # fmt: skip
    # end to end: 2+3+3 = 8 fits, + 5 does not; 5 alone; 9 alone; 20 over the budget, alone
    assert token_budget_bounds(np.array([2, 3, 3, 5, 9, 20]), 10, packed=True) == [
        (0, 3), (3, 4), (4, 5), (5, 6)
    ]  # fmt: skip
    assert token_budget_bounds(np.array([4, 1, 5, 2, 2]), 6, packed=True) == [(0, 2), (2, 3),
                                                                              (3, 5)]  # fmt: skip
    assert token_budget_bounds(np.array([], dtype=np.int64), 10) == []
    assert length_order(np.array([5, 2, 5, 1])).tolist() == [3, 1, 0, 2]  # stable among equals


@given(packed(), st.randoms(use_true_random=False))
def test_reordered_batch_moves_every_array_with_its_sequence(case, rnd) -> None:
    """A :class:`TrainBatch` reordered by ``take_sequences`` holds, at place k, sequence
    ``order[k]``'s tokens, its per-token values and its advantage (checked against the
    sequences cut by hand). (:func:`restore_order` bringing per-token values back is
    asyncrl_torch's: backends/asyncrl-torch/tests/test_batches.py.)"""
    seqs, prompts = case
    order = list(range(len(seqs)))
    rnd.shuffle(order)
    resp = [len(s) - p for s, p in zip(seqs, prompts)]
    per_token = [[1000.0 * i + j for j in range(r)] for i, r in enumerate(resp)]
    batch = TrainBatch(
        tokens=np.array([t for s in seqs for t in s], dtype=np.int32),
        seq_lens=np.array([len(s) for s in seqs], dtype=np.int32),
        prompt_lens=np.array(prompts, dtype=np.int32),
        behaviour_logprobs=np.array([v for vs in per_token for v in vs], dtype=np.float32),
        advantages=np.arange(len(seqs), dtype=np.float32),
        loss_mask=np.array([(i + j) % 2 for i, r in enumerate(resp) for j in range(r)],
                           dtype=np.uint8),  # fmt: skip
        reference_logprobs=-np.array([v for vs in per_token for v in vs], dtype=np.float32),
    )
    out = take_sequences(batch, order)
    assert out.tokens.tolist() == [t for i in order for t in seqs[i]]
    assert out.prompt_lens.tolist() == [prompts[i] for i in order]
    assert out.advantages.tolist() == [float(i) for i in order]
    assert out.behaviour_logprobs.tolist() == [v for i in order for v in per_token[i]]
    assert out.reference_logprobs.tolist() == [-v for i in order for v in per_token[i]]
    assert out.loss_mask.tolist() == [(i + j) % 2 for i in order for j in range(resp[i])]
    assert out.proximal_logprobs is None
