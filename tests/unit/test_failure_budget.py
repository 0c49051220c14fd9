"""Failed generations through the real :class:`Redispatcher`, :class:`RolloutPhase` (on the
live groups) and :class:`FailureBudget`: a group is retried after a doubling back-off until its
``generation_retries`` are spent, then dropped; a worker's death sends its groups again
without spending any; a request at fault is dropped at once; and nothing of a group outlives
it in the budget (its retries are counted with the group, in the live groups)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.environment import Prompt
from asyncrl.errors import RunError
from asyncrl.policy.failures import FailureBudget
from asyncrl.run.arrivals import Sent
from asyncrl.run.restarts import Redispatcher
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.wire.messages import GroupFailed
from schedule_support import SAMPLERS, live_groups

WORKERS = ["rollout:0", "rollout:1"]


class _TaskGroup:
    """Where the back-offs would sleep: the test ends them by hand."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def start_soon(self, fn: Any, gid: str, delay: float) -> None:
        self.delays.append(delay)


class _World:
    def __init__(self, retries: int, max_failed_groups: int = 5) -> None:
        limits = SimpleNamespace(generation_retries=retries, max_failed_groups=max_failed_groups,
                                 max_nonfinite_steps=0)  # fmt: skip
        self.budget = FailureBudget(limits)  # type: ignore[arg-type]
        self.groups = live_groups(SAMPLERS["gated"](1, 1.0), P=2, N=2, steps=2)
        self.rollout = RolloutPhase(self.groups, WORKERS)
        self.redispatch = Redispatcher(self.rollout, self.groups, failures=self.budget,
                                       wake=lambda: None)  # fmt: skip
        self.tg = _TaskGroup()

    def dispatch(self) -> Sent:
        sent = self.rollout.dispatch(WORKERS, lambda i: (Prompt(f"p{i}", "x"), [i]), time.time())
        assert isinstance(sent, Sent)
        return sent

    def fail(self, sent: Sent, retryable: bool = True) -> None:
        msg = GroupFailed(sent.group_id, sent.worker, "RuntimeError", "boom", retryable)
        arrival = self.rollout.check_failure(msg)
        assert arrival.group is not None
        self.redispatch.group_failed(arrival.group, msg, arrival.aborting, self.tg)  # type: ignore[arg-type]


def test_retries_back_off_and_a_worker_death_spends_none() -> None:
    w = _World(retries=2)
    first = w.dispatch()
    w.fail(first)
    w.rollout.retry(first.group_id)
    again = w.dispatch()
    assert again.group_id == first.group_id
    w.redispatch.worker_lost(again.worker)  # its worker died: sent again, not a retry
    for _ in range(2):
        sent = w.dispatch()
        assert sent.group_id == first.group_id
        w.fail(sent)
        w.rollout.retry(sent.group_id)
    assert w.tg.delays == [1.0, 2.0]  # RETRY_BACKOFF_S, doubled; the third failure dropped it
    assert w.groups.failed_groups == 1 and w.rollout.problems() == []


def test_a_request_at_fault_is_dropped_at_once_and_the_budget_stops_the_run() -> None:
    w = _World(retries=3, max_failed_groups=0)
    with pytest.raises(RunError, match=r"1 groups failed for good \(failures.max_failed_groups = 0\)"):
        w.fail(w.dispatch(), retryable=False)
    assert w.tg.delays == []


def test_a_retried_group_that_ends_otherwise_leaves_nothing_in_the_budget() -> None:
    """Retried, then aborted (here by the end of the run) while it waits: the group is gone
    from the live groups, and the budget keeps nothing of it."""
    w = _World(retries=2)
    sent = w.dispatch()
    w.fail(sent)
    aborts = w.rollout.close()
    assert aborts.gone == [sent.group_id] and w.rollout.problems() == []
    assert sent.group_id not in repr(vars(w.budget))


def test_a_dropped_group_whose_cause_names_its_fix_gives_one_fix() -> None:
    """The run's last words hold one Fix: the cause's when it names one (an agent that
    misused its trajectory), else where to look."""
    limits = SimpleNamespace(generation_retries=3, max_failed_groups=1,
                             max_nonfinite_steps=0)  # fmt: skip
    budget = FailureBudget(limits)  # type: ignore[arg-type]
    budget.check_dropped(1, "within the budget")
    cause = ("group g1 (prompt p1): episode g1/0: run_episode raised TrajectoryError: episode "
             "'p1': turn 2 came while turn 1 awaits an observation. Fix: add_messages() or "
             "add_tokens() between two turns.")  # fmt: skip
    with pytest.raises(RunError) as e:
        budget.check_dropped(2, cause)
    assert str(e.value) == ("2 groups failed for good (failures.max_failed_groups = 1; raise "
                            f"it to tolerate more); the last: {cause}")  # fmt: skip
    with pytest.raises(RunError) as e:
        budget.check_dropped(2, "group g1 (prompt p1): RuntimeError: boom")
    assert str(e.value).count("Fix:") == 1
    assert str(e.value).endswith("boom. Fix: see the generation_failed / reward_failed log "
                                 "lines for the cause; raise failures.max_failed_groups to "
                                 "tolerate more")  # fmt: skip
