"""The trainer's side of a batch: the micro-batch plan, a reordered batch's per-token values
brought back (:func:`restore_order`), byte groups and the step ledger. (The core's packing,
``Layout`` and token-budget cuts: tests/unit/test_packing.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.policy.grpo import take_sequences
from asyncrl.policy.packing import Layout
from asyncrl.wire.messages import TrainBatch
from asyncrl_torch.batches import plan_micro_batches, restore_order
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


@given(packed(), st.randoms(use_true_random=False))
def test_restore_order_brings_a_reordered_batch_s_values_back(case, rnd) -> None:
    """A batch reordered by ``take_sequences`` (as the micro-batch plan reorders it): each
    per-token value back at its own sequence's place, checked against the batch as sent."""
    seqs, prompts = case
    order = list(range(len(seqs)))
    rnd.shuffle(order)
    resp = [len(s) - p for s, p in zip(seqs, prompts)]
    batch = TrainBatch(
        tokens=np.array([t for s in seqs for t in s], dtype=np.int32),
        seq_lens=np.array([len(s) for s in seqs], dtype=np.int32),
        prompt_lens=np.array(prompts, dtype=np.int32),
        behaviour_logprobs=np.array([1000.0 * i + j for i, r in enumerate(resp)
                                     for j in range(r)], dtype=np.float32),  # fmt: skip
        advantages=np.arange(len(seqs), dtype=np.float32),
        loss_mask=np.ones(sum(resp), dtype=np.uint8),
    )
    out = take_sequences(batch, order)
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
