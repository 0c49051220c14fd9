"""The table of live groups, its two phases and each sampler on hand-made schedules (the
random ones are in test_schedule_properties.py)."""

from __future__ import annotations

import pytest

from asyncrl.policy.samplers import (
    GatedConfig,
    GatedSampler,
    InOrderConfig,
    InOrderSampler,
    OversampledConfig,
    OversampledSampler,
    ReadyFirstConfig,
    ReadyFirstSampler,
    Sampler,
    slack,
)
from asyncrl.policy.counts import Counts, StepStats
from asyncrl.policy.live import LiveGroups, SchedulerError, Wait
from schedule_support import Dispatch, Phases, phases


def make(sampler: Sampler, P: int = 2, N: int = 2, steps: int = 4, **caps: int) -> Phases:
    """A scheduler with this file's defaults (two prompts of two samples, four steps)."""
    return phases(sampler, P=P, N=N, steps=steps, **caps)


def dispatch_all(s: Phases) -> tuple[list[Dispatch], Wait]:
    out = []
    while isinstance(d := s.dispatch(), Dispatch):
        out.append(d)
    return out, d


def complete(s: Phases, gid: str) -> None:
    slot = s.slot(gid)
    for _ in range(slot.n - slot.finished):
        outcome = s.sample_finished(gid)
    assert outcome == "commit"
    s.committed(gid, [1.0] * slot.n)


def train_step(s: Phases, gids: list[str]) -> list[str]:
    """Train exactly ``gids`` as the open step (asserting the scheduler picks them), refit."""
    chunk = s.next_chunk()
    assert sorted(chunk.groups) == sorted(gids), chunk
    s.finish_step()
    aborted = s.begin_refit()
    s.end_refit()
    return aborted


def in_order(L: int) -> InOrderSampler:
    return InOrderSampler(InOrderConfig(max_lookahead_versions=L))


def test_every_sampler_satisfies_the_protocol() -> None:
    for s in (
        in_order(1),
        GatedSampler(GatedConfig()),
        OversampledSampler(OversampledConfig()),
        ReadyFirstSampler(ReadyFirstConfig()),
    ):
        assert isinstance(s, Sampler)


def test_in_order_admits_batches_up_to_the_lookahead() -> None:
    s = make(in_order(1), P=2, steps=5)
    first, wait = dispatch_all(s)
    assert [(d.index, d.target_step) for d in first] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert wait.reason == "buffer"  # P * (L + 1) live groups
    for d in first[:2]:
        complete(s, d.group_id)
    train_step(s, ["g0", "g1"])
    more, wait = dispatch_all(s)
    assert [(d.index, d.target_step, d.start_version) for d in more] == [(4, 2, 1), (5, 2, 1)]


def test_sync_mode_dispatches_the_next_batch_only_after_the_refit() -> None:
    s = make(in_order(0), P=2, steps=3)
    batch, wait = dispatch_all(s)
    assert len(batch) == 2 and wait.reason == "buffer"
    for d in batch:
        complete(s, d.group_id)
    assert s.next_chunk().groups == ["g0", "g1"]
    s.finish_step()
    assert s.dispatch() == Wait("gate")  # the refit is going on
    s.begin_refit()
    s.end_refit()
    assert isinstance(s.dispatch(), Dispatch)


def test_a_long_sample_holds_one_slot_not_its_group() -> None:
    """Sample-level backpressure: with room for N + 1 samples, a group whose N - 1 short
    samples finished lets the next group start although its long sample still runs."""
    N = 4
    s = make(
        OversampledSampler(OversampledConfig(over_sampling_ratio=2.0)), P=2, N=N, inflight=N + 1
    )
    (a,), wait = dispatch_all(s)
    assert wait.reason == "samples"
    for _ in range(N - 1):
        assert s.sample_finished(a.group_id) is None
    b = s.dispatch()
    assert isinstance(b, Dispatch) and s.inflight_samples == N + 1


def test_oversampled_evicts_stale_ready_groups_and_aborts_hopeless_ones() -> None:
    s = make(OversampledSampler(OversampledConfig(max_staleness_versions=1)), P=1, N=1, steps=6)
    ds, _ = dispatch_all(s)
    # g0 (start 0) straggles; g1, g2 train steps 0 and 1
    complete(s, ds[1].group_id)
    assert train_step(s, [ds[1].group_id]) == []
    complete(s, ds[2].group_id)
    aborted = train_step(s, [ds[2].group_id])
    assert ds[0].group_id in aborted  # start 0 can never train at version >= 2
    assert s.sample_finished(ds[0].group_id) == "discard"
    # a stale *ready* group is evicted instead
    s2 = make(OversampledSampler(OversampledConfig(max_staleness_versions=1)), P=1, N=1)
    d2, _ = dispatch_all(s2)
    for d in d2[:3]:
        complete(s2, d.group_id)
    train_step(s2, ["g0"])
    train_step(s2, ["g1"])
    chunk = s2.next_chunk()  # at version 2, g2 (start 0) is 2 versions old
    assert chunk.evicted == ["g2"] and s2.evicted == 1 and s2.wasted_samples == 1


def test_gated_waits_for_a_straggler_only_once_it_is_due() -> None:
    s = make(GatedSampler(GatedConfig(max_staleness_versions=1)), P=1, N=1, steps=4)
    ds, wait = dispatch_all(s)
    assert [d.group_id for d in ds] == ["g0", "g1"] and wait.reason in ("buffer", "sampler")
    complete(s, "g1")  # g0 straggles
    train_step(s, ["g1"])  # step 0 may take g1: g0's deadline is version 1
    (g2,), _ = dispatch_all(s)
    complete(s, g2.group_id)
    assert s.next_chunk().groups == []  # step 1 must take g0 (due), not g2
    complete(s, "g0")
    assert s.next_chunk().groups == ["g0"]
    assert s.stats.staleness == {1: 1}


def test_slack_counts_deadlines_by_hand() -> None:
    # v = 3, W = 1, P = 2, nothing taken: two groups started on 2 (deadline 3), one on 3
    assert slack({2: 2, 3: 1}, 3, 0, 2, 1) == {3: 0, 4: 1}
    assert slack({2: 3}, 3, 0, 2, 1) == {3: -1, 4: 1}  # three due, two slots
    assert slack({1: 1}, 3, 0, 2, 1)[3] == -1  # missed deadline


def test_ready_first_trains_in_completion_order() -> None:
    s = make(ReadyFirstSampler(ReadyFirstConfig()), P=2, N=1, min_chunk=2)
    ds, _ = dispatch_all(s)
    for gid in ("g3", "g1"):
        complete(s, gid)
    assert s.next_chunk().groups == ["g3", "g1"]


@pytest.mark.parametrize(
    "event, match",
    [
        (lambda s: s.table.sample_back(s.table.group("nope")), "unknown group"),
        (lambda s: s.table.ready(s.table.group("g0")), "committed in state generating"),
        (lambda s: s.finish_step(), "has 0 of 2 groups"),
        (lambda s: s.end_refit(), "without a refit"),
        (lambda s: s.begin_refit(), "without finish_step"),
    ],
)
def test_impossible_events_are_refused(event, match) -> None:
    s = make(in_order(1))
    dispatch_all(s)
    with pytest.raises(SchedulerError, match=match):
        event(s)


def test_capacity_below_the_sampler_rule_is_refused() -> None:
    with pytest.raises(SchedulerError, match="required capacity 4"):
        make(in_order(1), P=2, cap=3)
    with pytest.raises(SchedulerError, match="cannot hold one group"):
        make(in_order(1), P=2, N=4, inflight=3)


def test_state_dict_resumes_without_losing_or_repeating_a_prompt() -> None:
    s = make(in_order(1), P=2, steps=4)
    ds, _ = dispatch_all(s)
    for d in ds[:2]:
        complete(s, d.group_id)
    complete(s, "g3")  # g2 still generating, g3 ready: both of step 1
    train_step(s, ["g0", "g1"])
    more, _ = dispatch_all(s)  # step 2's batch: g4, g5
    state = s.state_dict()
    resumed = make(in_order(1), P=2, steps=4)
    assert resumed.load_state_dict(state) == ["g3"]  # ready: kept, with its samples
    assert resumed.slot("g3").ready and resumed.slot("g3").start_version == 0
    again, _ = dispatch_all(resumed)  # what was generating is dispatched again, same steps
    assert [(d.index, d.target_step) for d in again] == [(2, 1), (4, 2), (5, 2)]
    assert resumed.trainer_version == 1 and resumed.trained == 2
    assert resumed.dispatched == s.dispatched  # each group counted once
    complete(resumed, "g2")
    train_step(resumed, ["g2", "g3"])
    nxt, _ = dispatch_all(resumed)
    assert [d.index for d in nxt] == [6, 7]  # the stream continues where it stopped


def test_a_checkpoint_whose_ready_groups_lack_their_samples_is_refused_untouched() -> None:
    """A snapshot lists its ready groups in the table's state and saves their samples beside
    it; restoring one without the other is refused before the table changes, naming the fix."""
    from asyncrl.checkpoints import directory as ckpt

    s = make(in_order(1), P=2, steps=4)
    dispatch_all(s)
    complete(s, "g1")  # ready: its samples go in the snapshot
    snap = ckpt.snapshot(s.table)
    assert [g.group_id for g in snap.groups] == ["g1"]
    fresh = make(in_order(1), P=2, steps=4)
    broken = ckpt.ControllerState(step=snap.step, finished=snap.finished,
                                  scheduler=snap.scheduler, groups=[])  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match=r"lists ready groups \['g1'\] without their "
                       r"samples\. Fix: resume from an older checkpoint"):  # fmt: skip
        ckpt.restore(fresh.table, broken)
    assert fresh.table.totals == Counts() and not fresh.table.live  # untouched: still fresh
    # the stream restarts at 0 and skips 1 (g1 is restored ready); g0, g2, g3 go out again
    assert ckpt.restore(fresh.table, snap) == (0, {1})
    assert [g.group_id for g in fresh.table.ready_groups()] == ["g1"]


def test_run_totals_are_the_steps_counts_and_survive_a_resume_between_steps() -> None:
    """Each event is counted once, in the open step's counters; the run's totals are the
    ended steps' plus the open step's, and a checkpoint between steps keeps what the open
    step counted since the last refit (here a group failed for good and new dispatches)."""
    s = make(in_order(1), P=2, steps=4)
    dispatch_all(s)  # g0..g3: steps 0 and 1
    for gid in ("g0", "g1"):
        complete(s, gid)
    s.next_chunk()
    s.finish_step()
    s.begin_refit()
    step0 = s.end_refit()
    assert (step0.dispatched_groups, step0.trained_groups, step0.wasted_samples) == (4, 2, 0)
    assert s.totals == Counts() + step0 and (s.dispatched, s.trained) == (4, 2)
    s.failed("g2", retry=False)  # between steps: the open step counts it
    again, _ = dispatch_all(s)  # g2's fresh prompt for step 1, then step 2's two
    assert [(d.index, d.target_step) for d in again] == [(4, 1), (5, 2), (6, 2)]
    assert (s.stats.failed_groups, s.stats.wasted_samples, s.stats.dispatched_groups) == (1, 2, 3)
    assert (s.failed_groups, s.wasted_samples, s.dispatched) == (1, 2, 7)
    assert s.totals == step0 + s.stats
    state = s.state_dict()
    # g3..g6 are generating: dispatched again (and counted again) on resume
    assert (state["failed_groups"], state["wasted_samples"], state["dispatched"]) == (1, 2, 3)
    resumed = make(in_order(1), P=2, steps=4)
    resumed.load_state_dict(state)
    assert resumed.stats == StepStats()  # the open step's record starts again
    assert (resumed.failed_groups, resumed.wasted_samples, resumed.trained) == (1, 2, 2)
    assert resumed.state_dict() == state
    dispatch_all(resumed)
    assert resumed.dispatched == s.dispatched and resumed.stats.dispatched_groups == 4


def test_close_counts_unused_groups_in_the_open_step() -> None:
    s = make(OversampledSampler(OversampledConfig(over_sampling_ratio=2.0)), P=1, N=3, steps=1)
    ds, _ = dispatch_all(s)
    assert len(ds) == 2
    for d in ds:
        complete(s, d.group_id)
    assert len(s.next_chunk().groups) == 1
    s.finish_step()
    s.begin_refit()
    assert s.end_refit().trained_groups == 1
    assert s.close() == []  # the other group is ready: unused, not aborted
    assert (s.stats.unused_groups, s.stats.wasted_samples) == (1, 3)
    assert (s.unused, s.wasted_samples, s.trained) == (1, 3, 1)


def test_state_dict_only_between_steps() -> None:
    s = make(in_order(0), P=1, N=1)
    dispatch_all(s)
    complete(s, "g0")
    s.next_chunk()
    with pytest.raises(SchedulerError, match="between steps"):
        s.state_dict()


def finish_with(s: Phases, gid: str, rewards: list[float]) -> None:
    slot = s.slot(gid)
    for _ in range(slot.n - slot.finished):
        s.sample_finished(gid)
    s.committed(gid, rewards)


def test_dynamic_sampling_drops_uniform_groups_refills_the_step_and_stops_at_its_cap() -> None:
    """In sync mode (in_order, lookahead 0: every group is stamped for its step) a uniform
    group is dropped, and a fresh prompt for the same step is dispatched first; past the cap
    the step trains what it gets, and the next step's cap starts anew."""
    s = Phases(LiveGroups(in_order(0), prompts_per_step=2, samples_per_prompt=2, num_steps=3,
                          max_buffered_groups=2, max_inflight_samples=4, min_chunk_groups=2,
                          filter_min_std=0.0, filter_max_drops=2))  # fmt: skip
    (a, b), _ = dispatch_all(s)
    finish_with(s, a.group_id, [1.0, 1.0])  # solved: no learning signal
    finish_with(s, b.group_id, [0.0, 1.0])
    chunk = s.next_chunk()
    assert chunk.evicted == ["g0"] and chunk.groups == []  # the step waits for a new group
    assert s.stats.filtered_groups == 1 and s.filtered == 1 and s.wasted_samples == 2
    (c,), _ = dispatch_all(s)
    assert c.index == 2 and c.target_step == 0  # the dropped one's step, a fresh prompt
    finish_with(s, c.group_id, [0.0, 0.0])  # hopeless: dropped too (2 of 2)
    assert s.next_chunk().evicted == ["g2"]
    (d,), _ = dispatch_all(s)
    finish_with(s, d.group_id, [0.5, 0.5])  # past the cap: trained as it is
    chunk = s.next_chunk()
    assert chunk.evicted == [] and sorted(chunk.groups) == ["g1", "g3"]
    assert s.stats.filter_cap_reached
    s.finish_step()
    s.begin_refit()
    stats = s.end_refit()
    assert (stats.filtered_groups, stats.filter_cap_reached) == (2, True)
    assert s.ledger.num_dropped("zero_variance") == 2 and s.ledger.num_trained == 2
    assert s.state_dict()["filtered"] == 2  # kept by a checkpoint
    (e, f), _ = dispatch_all(s)
    finish_with(s, e.group_id, [1.0, 1.0])
    finish_with(s, f.group_id, [0.0, 1.0])
    assert s.next_chunk().evicted == [e.group_id]  # a new step, a new cap


def test_without_dynamic_sampling_uniform_groups_train() -> None:
    s = make(in_order(0), P=2, steps=1)
    (a, b), _ = dispatch_all(s)
    finish_with(s, a.group_id, [1.0, 1.0])
    finish_with(s, b.group_id, [1.0, 1.0])
    assert sorted(s.next_chunk().groups) == ["g0", "g1"]


def test_the_table_and_its_phases_share_no_method_name() -> None:
    """Split by phase, not by layer: no class forwards to another under the same name (each
    has its own ``problems``: the rollout phase's includes the table's)."""
    from asyncrl.run.rollout_phase import RolloutPhase
    from asyncrl.run.train_phase import TrainPhase

    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_")} - {"problems"}

    table, rollout, train = public(LiveGroups), public(RolloutPhase), public(TrainPhase)
    assert not table & rollout and not table & train and not rollout & train, (
        table & rollout, table & train, rollout & train)  # fmt: skip
