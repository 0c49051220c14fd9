"""The prompt ledger against a plain Python set (the reference), and its per-epoch report."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.policy.ledger import PromptLedger, Runs


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=80))
def test_runs_behave_as_a_set(values: list[int]) -> None:
    runs, ref = Runs(), set()
    for v in values:
        assert runs.add(v) == (v not in ref)
        ref.add(v)
    assert len(runs) == len(ref)
    assert all((i in runs) == (i in ref) for i in range(-1, 62))
    assert runs.count_in(10, 30) == len([v for v in ref if 10 <= v < 30])
    # runs are merged: no two touch
    r = runs.runs()
    assert all(a[1] < b[0] for a, b in zip(r, r[1:]))
    assert Runs.of_runs(r).runs() == r


def test_of_runs_refuses_overlap() -> None:
    with pytest.raises(ValueError, match="disjoint"):
        Runs.of_runs([[0, 3], [2, 5]])


def test_report_accounts_every_position_per_epoch() -> None:
    ledger = PromptLedger(prompts_per_epoch=4)
    ledger.record_trained([0, 1, 3, 4, 5])
    ledger.record_dropped([2], "evicted")
    report = ledger.report(frontier=8, live=[6])
    assert [(e.epoch, e.trained, e.dropped, e.live, e.lost) for e in report] == [
        (0, 3, {"evicted": 1}, 0, 0),
        (1, 2, {}, 1, 1),  # position 7 was dispatched, then lost
    ]


def test_repeats_are_counted_not_hidden() -> None:
    ledger = PromptLedger(prompts_per_epoch=2)
    ledger.record_trained([0, 1])
    ledger.record_trained([1])
    ledger.record_dropped([0], "aborted")
    assert ledger.num_repeated == 2 and ledger.repeated == [1, 0]
    assert [e.repeated for e in ledger.report(frontier=2)] == [2]


def test_state_dict_round_trip() -> None:
    ledger = PromptLedger(prompts_per_epoch=3)
    ledger.record_trained([0, 2, 3, 4])
    ledger.record_dropped([1], "failed")
    ledger.record_trained([4])
    back = PromptLedger.from_state_dict(ledger.state_dict())
    assert back.state_dict() == ledger.state_dict()
    assert back.num_trained == 4 and back.num_dropped("failed") == 1 and back.num_repeated == 1
