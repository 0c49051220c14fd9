"""RolloutPool, the pure state machine of restarts, driven by random event sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.policy.pool import RESTARTING, SERVING, SYNCING, PoolError, RolloutPool

WORKERS = ["rollout:0", "rollout:1", "rollout:2"]
EVENTS = st.lists(
    st.tuples(st.sampled_from(["lost", "returned", "synced"]), st.sampled_from(WORKERS)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, budget=st.integers(0, 4))
def test_any_event_sequence_keeps_the_budget_and_the_serving_set(
    events: list[tuple[str, str]], budget: int
) -> None:
    pool = RolloutPool(WORKERS, budget)
    allowed = {"lost": (SERVING, SYNCING), "returned": (RESTARTING,), "synced": (SYNCING,)}
    for event, worker in events:
        before, restarts = pool.state(worker), pool.restarts
        if before not in allowed[event]:
            with pytest.raises(PoolError):
                getattr(pool, event)(worker)
            assert (pool.state(worker), pool.restarts) == (before, restarts)  # untouched
            continue
        result = getattr(pool, event)(worker)
        if event == "lost":
            # granted exactly while the budget lasts; a refusal changes nothing
            assert result is (restarts < budget)
            assert pool.restarts == restarts + int(result)
            assert pool.state(worker) == (RESTARTING if result else before)
        assert pool.restarts <= budget
        # only serving workers take work, in rank order
        assert pool.serving == [w for w in WORKERS if pool.state(w) == SERVING]


def test_a_worker_goes_round_and_the_budget_counts_all_workers() -> None:
    pool = RolloutPool(WORKERS[:2], max_restarts=2)
    assert pool.lost("rollout:1") and pool.serving == ["rollout:0"]
    pool.returned("rollout:1")
    assert pool.state("rollout:1") == SYNCING and pool.serving == ["rollout:0"]
    pool.synced("rollout:1")
    assert pool.serving == ["rollout:0", "rollout:1"]
    assert pool.lost("rollout:0")  # the second restart, another worker
    assert not pool.lost("rollout:1")  # the budget is the run's, not each worker's
    assert pool.restarts == 2 and pool.state("rollout:1") == SERVING
