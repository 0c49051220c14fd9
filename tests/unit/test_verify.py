"""Refit verification logic (asyncrl.policy.verify) against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncrl.errors import RefitError
from asyncrl.policy.verify import compare, probe_sequences, verification_due


def test_schedule_first_then_every() -> None:
    due = [v for v in range(0, 31) if verification_due(v, first=3, every=10)]
    assert due == [1, 2, 3, 10, 20, 30]
    assert [v for v in range(0, 12) if verification_due(v, first=0, every=0)] == []
    assert [v for v in range(0, 6) if verification_due(v, first=2, every=0)] == [1, 2]


def test_compare_against_hand_computation() -> None:
    gen = np.array([-1.0, -2.0, -0.5], np.float32)
    trn = np.array([-1.1, -2.0, -0.2], np.float32)
    a = compare("rollout:0", 4, gen, trn)
    diffs = [0.1, 0.0, 0.3]
    assert a.num_tokens == 3 and a.worker == "rollout:0" and a.version == 4
    assert a.mean_abs == pytest.approx(sum(diffs) / 3, abs=1e-6)
    assert a.max_abs == pytest.approx(0.3, abs=1e-6)
    assert a.mult_prob_error == pytest.approx(sum(math.exp(d) for d in diffs) / 3, abs=1e-6)
    a.check(0.2)  # 0.1333 <= 0.2
    with pytest.raises(RefitError, match=r"weight version 4.*rollout:0.*refit.verify_tolerance"):
        a.check(0.1)


@pytest.mark.parametrize(
    ("gen", "trn", "match"),
    [
        ([-1.0, -2.0], [-1.0], "returned"),
        ([], [], "no tokens"),
        ([-1.0, float("nan")], [-1.0, -1.0], "rollout:1 returned non-finite"),
        ([-1.0, -1.0], [float("-inf"), -1.0], "the trainer returned non-finite"),
    ],
)
def test_compare_refuses_broken_inputs(gen: list, trn: list, match: str) -> None:
    with pytest.raises(RefitError, match=match):
        compare("rollout:1", 2, np.array(gen), np.array(trn))


def test_probe_takes_one_per_group_first_and_skips_empty() -> None:
    groups = [
        ([1, 2], [[5], [6, 7]]),
        ([1, 3], [[], [8]]),  # first sample empty (stopped at once): skipped
        ([1, 4], [[9, 9]]),
    ]
    prompts, responses = probe_sequences(groups, limit=4)
    assert prompts == [[1, 2], [1, 4], [1, 2], [1, 3]]
    assert responses == [[5], [9, 9], [6, 7], [8]]
    assert probe_sequences(groups, limit=100)[1] == [[5], [9, 9], [6, 7], [8]]
    assert probe_sequences([], limit=3) == ([], [])
