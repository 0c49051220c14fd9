"""asyncrl.policy.packing.Layout against sequences cut out by hand, and the step ledger."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.policy.packing import Layout, check_packed, length_order, token_budget_bounds
from asyncrl.policy.grpo import take_sequences
from asyncrl_torch.batches import plan_micro_batches, restore_order
from asyncrl.wire.messages import TrainBatch
from asyncrl_torch.byte_groups import byte_groups
from asyncrl_torch.step_ledger import StepLedger, StepStateError


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


def test_ledger_one_step_at_a_time() -> None:
    ledger = StepLedger()
    with pytest.raises(StepStateError, match="no optimizer step is open"):
        ledger.require(0, "train_chunk")
    ledger.begin(3)
    with pytest.raises(StepStateError, match="step 3 is still open"):
        ledger.begin(4)
    with pytest.raises(StepStateError, match="the open step is 3"):
        ledger.add_chunk(4, 10, 1.0)
    ledger.add_chunk(3, 10, 1.5)
    ledger.add_chunk(3, 0, 0.0)  # an empty shard
    ledger.add_chunk(3, 5, -0.5)
    closed = ledger.close()
    assert closed is not None and (closed.loss_tokens, closed.loss_sum, closed.chunks) == (
        15,
        1.0,
        3,
    )
    assert ledger.open is None and ledger.close() is None
    ledger.begin(4)  # a new step after the close


@given(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 100))
def test_byte_groups_are_consecutive_and_within_budget(sizes, budget) -> None:
    groups = byte_groups(sizes, budget)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    for g in groups:
        total = sum(sizes[i] for i in g)
        assert total <= budget or len(g) == 1  # only a lone oversized item may exceed it
    for a, b in zip(groups, groups[1:]):  # greedy: the next item would not have fit
        assert sum(sizes[i] for i in a) + sizes[b[0]] > budget


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
    sequences cut by hand), and :func:`restore_order` brings per-token values back."""
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
    layout = Layout.of(out.seq_lens, out.prompt_lens)
    back = restore_order(out.behaviour_logprobs, layout, np.array(order, dtype=np.int64))
    assert back.tolist() == batch.behaviour_logprobs.tolist()


def test_plan_micro_batches_sorts_only_under_a_token_budget() -> None:
    """Budget 0: the batch as it came, ranges of ``micro_batch_size``; a budget: the sequences
    shortest first (lengths 6, 2, 4 -> 2, 4, 6) cut by tokens (2 x 4 = 8 fits, 3 x 6 not)."""
    batch = TrainBatch(
        tokens=np.arange(12, dtype=np.int32), seq_lens=np.array([6, 2, 4], dtype=np.int32),
        prompt_lens=np.array([1, 1, 1], dtype=np.int32),
        behaviour_logprobs=np.zeros(9, dtype=np.float32),
        advantages=np.array([0.0, 1.0, 2.0], dtype=np.float32),
        loss_mask=np.ones(9, dtype=np.uint8),
    )  # fmt: skip
    same, bounds, order = plan_micro_batches(batch, 2, 0)
    assert same is batch and bounds == [(0, 2), (2, 3)] and order is None
    planned, bounds, order = plan_micro_batches(batch, 2, 8)
    assert order.tolist() == [1, 2, 0] and bounds == [(0, 2), (2, 3)]
    assert planned.seq_lens.tolist() == [2, 4, 6] and planned.advantages.tolist() == [1, 2, 0]
    assert planned.tokens.tolist() == [6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5]
