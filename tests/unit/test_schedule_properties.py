"""Property tests of the real table of live groups (:class:`asyncrl.policy.live.LiveGroups`) and
its two real phases (:mod:`asyncrl.run.rollout_phase`, :mod:`asyncrl.run.train_phase`) with
every built-in sampler, driven one group-level event at a time (``schedule_support.Phases``).

Each example is one random run: random capacities, window, chunk size, completion order of
individual samples (a long sample holds its slot, not its group's admission), refit timing
(the refit may take a while, during which samples keep finishing) and aborts. The test keeps
its own ledger of what happened and checks it against the rules the modes promise (docs/modes.md)
— not against the scheduler's own counters alone:

* no group is trained more than W (or L) versions after the version it started on;
* no group is trained twice, and only once all its samples came back and were committed;
* every step trains exactly P groups; ``in_order`` trains group k at step k // P;
* nothing is dispatched while a refit is going on;
* live groups and samples in flight stay within their caps;
* every dispatched group ends exactly once as trained, evicted, aborted or unused, and the
  scheduler's counters (and wasted samples = N per wasted group) agree with the ledger;
* each event is counted once, in the open step's counters: after every action those equal
  what the ledger saw since the last refit's end (and each step's counters handed out by
  ``end_refit`` equal what it saw in that step), and the run's totals equal the sum of the
  steps' handed out plus the open step's (a resume starting from the totals it saved);
* ``gated`` and ``in_order`` waste nothing; the run never deadlocks;
* with ``crashes``, the controller dies at random step boundaries: a fresh scheduler restores
  the saved state, the samples in flight are lost, the ready groups survive, and every rule
  above still holds for the whole run (each prompt trained once, none lost);
* with ``faults``, generations fail (retried after a while, or dropped; a group stamped for a
  step then gets a fresh prompt), scoring fails, and open steps fail on the trainer (their
  groups go back to ready): the rules still hold, and the scheduler's prompt ledger agrees
  with the test's own, position by position.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from asyncrl_sampler_dapo import DynamicConfig, DynamicSampler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.policy.samplers import OversampledConfig, OversampledSampler
from asyncrl.policy.counts import Counts, StepStats
from asyncrl.policy.live import SchedulerError
from schedule_support import SAMPLERS as BUILT_IN
from schedule_support import Dispatch, Phases, caps, phases, shape_strategies

SAMPLERS = {
    **BUILT_IN,
    # the example plugin (plugins/asyncrl-sampler-dapo): drops groups without reward variance
    "dynamic": lambda w, r: DynamicSampler(
        DynamicConfig(max_staleness_versions=max(1, w), over_sampling_ratio=r, window_groups=8)
    ),
}
WASTE_FREE = {"in_order", "gated"}


def step_counts(stats: StepStats) -> Counter[str]:
    """A step's counters as the ledger below sees its events (an eviction and a drop of
    dynamic sampling are both a ready group leaving: told apart only at the run's end)."""
    return +Counter(
        dispatched=stats.dispatched_groups,
        trained=stats.trained_groups,
        dropped=stats.evicted_groups + stats.filtered_groups,
        aborted=stats.aborted_groups,
        failed=stats.failed_groups,
        unused=stats.unused_groups,
        wasted=stats.wasted_samples,
    )


def check_totals(s: Phases, base: Counts, handed: Counts, seen: Counter[str]) -> None:
    """Each event counted once: the open step's counters are what the ledger ``seen`` since
    the last refit's end, and the run's totals are the fold of ``base`` (a resume's saved
    totals), the steps' counters ``handed`` out by ``end_refit`` since, and the open
    step's; each run-wide count reads that fold."""
    assert step_counts(s.stats) == +seen, (step_counts(s.stats), seen)
    t = s.totals
    assert t == base + handed + s.stats, (t, base, handed, s.stats)
    assert (s.dispatched, s.trained, s.evicted, s.filtered, s.aborted, s.unused,
            s.failed_groups, s.wasted_samples) == (
        t.dispatched_groups, t.trained_groups, t.evicted_groups, t.filtered_groups,
        t.aborted_groups, t.unused_groups, t.failed_groups, t.wasted_samples,
    )  # fmt: skip


def run_schedule(
    name: str,
    seed: int,
    P: int,
    N: int,
    W: int,
    steps: int,
    ratio: float,
    extra: int,
    inflight_frac: float,
    chunk_frac: float,
    crashes: int = 0,
    faults: bool = False,
    filter_drops: int = 0,
) -> dict:
    rng = random.Random(seed)
    sampler = SAMPLERS[name](W, ratio)
    bound = W if name == "in_order" else max(1, W)
    cap, max_inflight, min_chunk = caps(sampler, P, N, extra, inflight_frac, chunk_frac)

    def fresh() -> Phases:
        return phases(SAMPLERS[name](W, ratio), P=P, N=N, steps=steps, cap=cap,
                      inflight=max_inflight, min_chunk=min_chunk,
                      filter_drops=filter_drops)  # fmt: skip

    s = fresh()

    start: dict[str, int] = {}
    index: dict[str, int] = {}
    running: list[tuple[str, int]] = []  # (group, sample) generating, with a random weight
    done_samples: Counter[str] = Counter()
    rewards: dict[str, list[float]] = {}
    scoring: list[str] = []
    aborted_by_scheduler: set[str] = set()
    trained: dict[str, int] = {}
    evicted: set[str] = set()
    discarded: set[str] = set()
    per_step: Counter[int] = Counter()
    refit_pending = False
    actions = 0
    resumes = 0
    target: dict[str, int | None] = {}
    retrying: set[str] = set()  # failed, waiting for their retry
    due: set[str] = set()  # retry() called, not dispatched again yet
    failed: set[str] = set()
    given_back = False  # a failed step gave its groups back: live may exceed the cap until
    # enough of them train (dispatch waits meanwhile)
    retries = 0  # generation failures retried: counted in the step stats, unlike worker deaths
    counted = 0  # the step stats' generation_retries, summed
    seen: Counter[str] = Counter()  # events since the last refit's end, as step_counts() names them
    base = Counts()  # the totals the scheduler started from (a resume's)
    handed = Counts()  # the steps' counters end_refit handed out since

    def note_aborted(ids: list[str]) -> None:
        aborted_by_scheduler.update(ids)
        seen["aborted"] += len(ids)
        seen["wasted"] += N * len(ids)
        for gid in ids:  # a retrying group has nothing on an engine: gone at once
            if gid in retrying or gid in due:
                retrying.discard(gid)
                due.discard(gid)
                discarded.add(gid)

    def crash_and_resume() -> Phases:
        """The controller dies right after saving at this step boundary: what was generating
        or being scored is gone (its prompts are dispatched again), ready groups survive."""
        nonlocal counted, base, handed
        counted += s.stats.generation_retries  # the open step's, lost with the controller
        totals = s.totals
        state = s.state_dict()
        ready = {g for g in start if s.tracks(g) and s.slot(g).ready}
        for gid, _ in running:  # the samples of aborting groups vanish with the engines
            if gid in aborted_by_scheduler:
                discarded.add(gid)
        lost = {gid for gid, _ in running} | set(scoring) | retrying | due
        for gid in lost - aborted_by_scheduler:
            assert gid not in ready and gid not in trained
            del start[gid], index[gid]
            done_samples.pop(gid, None)
        running.clear()
        scoring.clear()
        retrying.clear()
        due.clear()
        new = fresh()
        assert set(new.load_state_dict(state)) == ready
        assert new.num_live == len(ready) and new.inflight_samples == 0
        # the totals go on, the open step's counts in them; the prompts dispatched again
        # are counted again when they are
        again = len(lost - aborted_by_scheduler)
        totals.dispatched_groups -= again
        assert new.totals == totals and new.stats == StepStats(), (new.totals, totals)
        base, handed = new.totals, Counts()
        seen.clear()
        return new

    def end_refit() -> None:
        nonlocal counted, handed
        stats = s.end_refit()
        assert step_counts(stats) == +seen, (step_counts(stats), seen)  # the step's own events
        counted += stats.generation_retries
        handed += stats
        seen.clear()

    def dispatched(d: Dispatch) -> None:
        """A dispatch the ledger takes in: a retry (same group, same prompt, same step) is
        not a new dispatch."""
        if d.group_id in due:
            due.discard(d.group_id)
            assert (index[d.group_id], target[d.group_id]) == (d.index, d.target_step)
        else:
            assert d.group_id not in start
            seen["dispatched"] += 1
        start[d.group_id], index[d.group_id] = d.start_version, d.index
        target[d.group_id] = d.target_step
        running.extend((d.group_id, k) for k in range(N))

    def finish_one(i: int) -> None:
        gid, _ = running.pop(i)
        done_samples[gid] += 1
        outcome = s.sample_finished(gid)
        if outcome == "commit":
            assert gid not in aborted_by_scheduler
            scoring.append(gid)
        elif outcome == "discard":
            assert gid in aborted_by_scheduler and done_samples[gid] == N
            discarded.add(gid)

    def record_chunk(chunk) -> bool:
        """Check a chunk against the ledger and write it in; close the step when it is full
        (returns whether a refit is now pending)."""
        for gid in chunk.evicted:
            assert gid not in trained and gid not in evicted
            evicted.add(gid)
            seen["dropped"] += 1
            seen["wasted"] += N
        for gid in chunk.groups:
            assert gid not in trained, f"{gid} trained twice"
            assert done_samples[gid] == N and gid not in scoring
            staleness = s.trainer_version - start[gid]
            assert 0 <= staleness <= bound, (gid, staleness, bound)
            if name == "in_order":
                assert s.trainer_version == target[gid]
                if not (faults or filter_drops):  # a dropped group's step gets a fresh prompt
                    assert s.trainer_version == index[gid] // P
            trained[gid] = s.trainer_version
            per_step[s.trainer_version] += 1
        if per_step[s.trainer_version] < P:
            return False
        s.finish_step()
        seen["trained"] += P
        note_aborted(s.begin_refit())
        return True

    while not s.finished:
        actions += 1
        assert actions < 200_000, "no progress"
        moves = []
        if s.gate_open:
            moves.append("dispatch")
        if running:
            moves += ["finish"] * 3
        if scoring:
            moves.append("commit")
        if refit_pending:
            moves.append("end_refit")
        elif s.gate_open:
            moves.append("train")
            if resumes < crashes and s.taken == 0:
                moves.append("crash")
            if faults and s.taken:
                moves.append("abort_step")
        if faults and running:
            moves.append("fail")
            if {g for g, _ in running} - aborted_by_scheduler:
                moves.append("lost")
        if faults and scoring:
            moves.append("score_fail")
        if retrying:
            moves.append("retry")
        move = rng.choice(moves)
        if move == "dispatch":
            for _ in range(rng.randint(1, 4)):
                d = s.dispatch()
                if not isinstance(d, Dispatch):
                    break
                assert not refit_pending
                assert d.group_id in due or s.num_live <= cap  # a new group: never past the cap
                assert (
                    d.start_version == s.trainer_version
                )  # generators serve the trainer's version
                dispatched(d)
        elif move == "finish":
            # heavy-tailed completion: mostly a random sample, sometimes the oldest one
            finish_one(rng.randrange(len(running)) if rng.random() < 0.8 else 0)
        elif move == "commit":
            gid = scoring.pop(rng.randrange(len(scoring)))
            assert done_samples[gid] == N
            rewards[gid] = [float(rng.random() < 0.5) for _ in range(N)]
            s.committed(gid, rewards[gid])
        elif move == "end_refit":
            end_refit()
            refit_pending = False
        elif move == "train":
            refit_pending = record_chunk(s.next_chunk())
        elif move == "crash":
            s = crash_and_resume()
            resumes += 1
        elif move == "fail":
            gid = rng.choice(running)[0]
            assert s.aborting(gid) == (gid in aborted_by_scheduler)
            running[:] = [(g, k) for g, k in running if g != gid]
            again = rng.random() < 0.6
            s.failed(gid, retry=again)
            if gid in aborted_by_scheduler:
                discarded.add(gid)  # it was being aborted: simply gone
            elif again:
                retrying.add(gid)
                done_samples.pop(gid, None)
                retries += 1
            else:
                failed.add(gid)
                seen["failed"] += 1
                seen["wasted"] += N
        elif move == "lost":  # its worker died: sent again first, not a retry of its own
            gid = rng.choice(sorted({g for g, _ in running} - aborted_by_scheduler))
            running[:] = [(g, k) for g, k in running if g != gid]
            s.requeue(gid)
            done_samples.pop(gid, None)
            due.add(gid)
        elif move == "score_fail":
            gid = scoring.pop(rng.randrange(len(scoring)))
            s.failed(gid, retry=True)  # nothing to retry once generated: dropped
            failed.add(gid)
            seen["failed"] += 1
            seen["wasted"] += N
        elif move == "retry":
            gid = rng.choice(sorted(retrying))
            retrying.discard(gid)
            due.add(gid)
            s.retry(gid)
        elif move == "abort_step":
            for gid in s.abort_step():
                assert trained.pop(gid) == s.trainer_version
                per_step[s.trainer_version] -= 1
            given_back = True
        given_back = given_back and s.num_live > cap
        assert s.num_live <= cap or given_back
        assert s.inflight_samples == len(running) <= max_inflight
        check_totals(s, base, handed, seen)
        if not running and not scoring and not refit_pending and s.gate_open:
            # nothing in flight: the pumps must be able to move, else it is a deadlock
            if retrying:  # a back-off still running: the pump would wait for it
                gid = retrying.pop()
                due.add(gid)
                s.retry(gid)
            probe = s.dispatch()
            if isinstance(probe, Dispatch):
                dispatched(probe)
            else:
                chunk = s.next_chunk()
                assert chunk.groups or chunk.evicted, (
                    f"deadlock: dispatch waits ({probe.reason}) and no chunk is ready"
                )
                refit_pending = record_chunk(chunk)  # into the ledger as a train move would
        check_totals(s, base, handed, seen)
    if refit_pending:
        end_refit()
    counted += s.stats.generation_retries
    assert counted == retries, (counted, retries)
    note_aborted(s.close())
    while running:
        finish_one(rng.randrange(len(running)))
    unused = set(start) - set(trained) - evicted - aborted_by_scheduler - failed
    seen["unused"] += len(unused)  # counted by close(), in the open step's counters too
    seen["wasted"] += N * len(unused)
    check_totals(s, base, handed, seen)

    assert all(per_step[k] == P for k in range(steps)), per_step
    assert len(trained) == steps * P
    assert set(trained).isdisjoint(evicted | aborted_by_scheduler)
    assert evicted.isdisjoint(aborted_by_scheduler)
    assert discarded == aborted_by_scheduler  # every aborted group's samples came back
    as_set = lambda runs: {i for a, b in runs for i in range(a, b)}  # noqa: E731
    # dynamic sampling's drops leave with the evictions; each had all its rewards equal
    filtered = as_set(s.ledger.state_dict()["dropped"].get("zero_variance", []))
    assert all(len(set(rewards[g])) == 1 for g in evicted if index[g] in filtered)
    assert filter_drops or not filtered
    assert (s.dispatched, s.trained, s.evicted + s.filtered, s.aborted, s.unused) == (
        len(start),
        len(trained),
        len(evicted),
        len(aborted_by_scheduler),
        len(unused),
    )
    assert s.failed_groups == len(failed)
    assert s.wasted_samples == N * (
        len(evicted) + len(aborted_by_scheduler) + len(unused) + len(failed)
    )
    # the scheduler's ledger, position by position, against this test's
    ledger = s.ledger.state_dict()
    positions = {
        "trained": {index[g] for g in trained},
        "evicted": {index[g] for g in evicted},
        "aborted": {index[g] for g in aborted_by_scheduler},
        "unused": {index[g] for g in unused},
        "failed": {index[g] for g in failed},
    }
    assert as_set(ledger["trained"]) == positions["trained"]
    positions["evicted"] -= filtered
    for reason in ("evicted", "aborted", "unused", "failed"):
        assert as_set(ledger["dropped"][reason]) == positions[reason], reason
    assert ledger["num_repeated"] == 0
    assert all(e.lost == 0 for e in s.ledger_report())
    assert s.num_live == 0 and s.inflight_samples == 0
    if name in WASTE_FREE:
        # aborted here can only be what close() stopped at the very end
        assert not [g for g in evicted if index[g] not in filtered]
    if name == "in_order" and not faults and not filtered:
        assert sorted(index[g] for g in trained) == list(range(steps * P))
    return {"evicted": len(evicted), "aborted": len(aborted_by_scheduler)}


SHAPES = shape_strategies(max_W=3, max_steps=6, max_ratio=2.5, max_extra=3)


@pytest.mark.parametrize("name", list(SAMPLERS))
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SHAPES)
def test_random_schedules_keep_every_invariant(name: str, **shape: Any) -> None:
    run_schedule(name, **shape)


@pytest.mark.parametrize("name", list(SAMPLERS))
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(crashes=st.integers(0, 3), faults=st.booleans(), **SHAPES)
def test_crashes_and_failures_keep_every_invariant(name: str, **shape: Any) -> None:
    run_schedule(name, **shape)


@pytest.mark.parametrize("name", list(BUILT_IN))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filter_drops=st.integers(1, 4), faults=st.booleans(), **SHAPES)
def test_dynamic_sampling_keeps_every_invariant(name: str, **shape: Any) -> None:
    run_schedule(name, **shape)


def test_windowed_samplers_do_waste_when_stragglers_are_old() -> None:
    """The ledger above can see waste (a test that could not fail would prove nothing): over
    many seeds the windowed samplers evict or abort something, and gated never does."""
    waste = Counter()
    for name in ("oversampled", "ready_first", "gated"):
        for seed in range(200):
            out = run_schedule(name, seed, 3, 2, 1, 6, 2.0, 0, 1.0, 0.3)
            waste[name] += out["evicted"]
    assert waste["oversampled"] > 0 and waste["ready_first"] > 0
    assert waste["gated"] == 0


def test_a_sampler_breaking_the_bound_is_refused() -> None:
    """The scheduler, not the sampler, enforces the bound."""

    class Greedy(OversampledSampler):
        def select(self, view, min_groups, max_groups):  # ignores the window
            return [g for g in view.live if g.ready][:max_groups]

        def evict(self, view):
            return []

        def should_abort_inflight(self, group, trainer_version):
            return False

    s = phases(Greedy(OversampledConfig(max_staleness_versions=1)), P=1, N=1, steps=5,
               cap=4, inflight=4)  # fmt: skip
    first = s.dispatch()
    assert isinstance(first, Dispatch)
    for _ in range(2):  # two steps trained by other groups while `first` waits
        d = s.dispatch()
        assert isinstance(d, Dispatch)
        s.sample_finished(d.group_id)
        s.committed(d.group_id)
        assert s.next_chunk().groups == [d.group_id]
        s.finish_step()
        s.begin_refit()
        s.end_refit()
    s.sample_finished(first.group_id)
    s.committed(first.group_id)
    with pytest.raises(SchedulerError, match="above its bound 1"):
        s.next_chunk()
