"""Property test of the real rollout and train phases
(:class:`asyncrl.run.rollout_phase.RolloutPhase`, :class:`asyncrl.run.train_phase.TrainPhase`)
on the real table of live groups (:class:`asyncrl.policy.live.LiveGroups`) with the built-in
samplers, driven through thousands of random schedules.

The test plays the rollout workers' engines, the trainer and the controller's failures: it
dispatches, returns samples one at a time in a random order (cut short once their group is
aborted), sends strangers' and duplicate samples, commits or fails scoring, fails
generations (retried or dropped), kills and brings back workers, trains chunks, fails open
steps, refits, runs evaluations, checkpoints and restores, and crashes the controller (a
fresh table and phases restored from the last step boundary). It keeps a ledger of its own
(what it sent, what each engine still owes, what became of each sample), never a second copy
of the phases' logic, and after every action checks:

* every dispatched sample has exactly one fate: still in flight (owed by an engine, or back
  and waiting for the rest of its group), or ended once as trained, evicted, aborted,
  failed (its generation or scoring failed), lost (its worker died: the group is sent
  again), crashed (the controller died) or unused (the run ended first);
* capacities: samples in flight within ``max_inflight_samples``; live groups within
  ``max_buffered_groups`` (a failed step giving its groups back may exceed it until they
  train; a new group never does); each worker's load equals the samples its engine owes;
  dispatch goes to the least loaded worker that serves;
* the table's views (ready, taken, in flight) equal the ledger's, and the invariants of the
  rollout phase and the table (:meth:`RolloutPhase.problems`) hold;
* a checkpoint taken at any step boundary restores an equal table (the same snapshot, the
  same views) and a prompt is never trained twice, across crashes too.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.checkpoints import directory as ckpt
from asyncrl.checkpoints.directory import ControllerState
from asyncrl.environment import Prompt
from asyncrl.policy.groups import CompletedSample
from asyncrl.policy.live import LiveGroups, SchedulerError, Wait
from asyncrl.run import arrivals
from asyncrl.run.arrivals import ArrivalKind
from asyncrl.run.arrivals import Sent
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.train_phase import TrainPhase
from asyncrl.wire.messages import GroupFailed, Sample, SampleDone
from schedule_support import SAMPLERS, caps, live_groups, shape_strategies

TOKENS = np.array([3, 1, 4], dtype=np.int32)
LOGPROBS = np.full(3, -0.5, dtype=np.float32)
DONE = Sample(TOKENS, LOGPROBS, "stop")
CUT = Sample(TOKENS[:1], LOGPROBS[:1], "abort")
IN_FLIGHT = ("flight", "back")
"""A sample's fates before its end: owed by an engine, or back and waiting for its group."""
ENDS = {"trained", "evicted", "aborted", "failed", "lost", "crashed", "unused"}


def canonical(state: ControllerState) -> Any:
    """A snapshot as plain data, its ready groups by prompt position (a restored table keeps
    them in that order; the one that saved them, in dispatch order)."""
    out = msgspec.to_builtins(state)
    out["scheduler"]["ready"].sort(key=lambda g: g["index"])
    out["groups"].sort(key=lambda g: g[1])  # SavedGroup is array-like: [group_id, index, ...]
    return out


class World:
    """The engines, the trainer and the controller around one table of live groups and its
    two phases, and the test's ledger."""

    def __init__(self, rng: random.Random, cfg: dict[str, Any]) -> None:
        self.rng, self.cfg = rng, cfg
        self.workers = [f"rollout:{i}" for i in range(cfg["workers"])]
        self.serving = list(self.workers)
        self.table, self.rollout, self.training = self.fresh()
        self.fate: dict[tuple[str, int, int], str] = {}
        """Every sample dispatched: (group, attempt, index) -> fate."""
        self.fates: Counter[str] = Counter()
        """Samples per fate."""
        self.attempt: Counter[str] = Counter()
        self.state: dict[str, str] = {}
        """Each group the ledger knows alive: flight, aborting, retrying, due, scoring,
        ready, taken."""
        self.worker_of: dict[str, str] = {}
        self.index_of: dict[str, int] = {}
        self.owed: dict[str, list[tuple[str, int, int]]] = {w: [] for w in self.workers}
        """What each engine still has to send back."""
        self.trained_indices: set[int] = set()
        self.refit_pending = False
        self.given_back = False
        self.evals: dict[str, str] = {}
        """Evaluation prompts: waiting, or the worker their request is on."""
        self.eval_asks: Counter[str] = Counter()
        """Requests each evaluation prompt made (its request ids count them, as the asker's)."""
        self.abandoned: set[str] = set()
        """Evaluation requests given up on (still owed: discarded when they come)."""
        self.eval_label = 0
        self.counts: Counter[str] = Counter()
        self.retries = 0
        """Generation failures retried since the last refit's end (a worker's death is
        not one): the step stats' ``generation_retries``."""

    def fresh(self) -> tuple[LiveGroups, RolloutPhase, TrainPhase]:
        """A fresh table of live groups and its two phases."""
        c = self.cfg
        table = live_groups(SAMPLERS[c["sampler"]](c["W"], c["ratio"]), P=c["P"], N=c["N"],
                            steps=c["steps"], cap=c["cap"], inflight=c["max_inflight"],
                            min_chunk=c["min_chunk"])  # fmt: skip
        return table, RolloutPhase(table, self.workers), TrainPhase(table)

    # ------------------------------------------------------------------ ledger helpers
    def samples_of(self, gid: str) -> list[tuple[str, int, int]]:
        a = self.attempt[gid]
        return [(gid, a, i) for i in range(self.cfg["N"])]

    def end(self, gid: str, fate: str, *, group_too: bool = True) -> None:
        """Each sample of ``gid``'s current attempt ends once, as ``fate``."""
        for key in self.samples_of(gid):
            assert self.fate[key] in IN_FLIGHT, f"{key} ended twice: {self.fate[key]}, {fate}"
            self.set_fate(key, fate)
        if group_too:
            del self.state[gid]

    def set_fate(self, key: tuple[str, int, int], fate: str) -> None:
        old = self.fate.get(key)
        if old is not None:
            self.fates[old] -= 1
        self.fate[key] = fate
        self.fates[fate] += 1

    def owed_by(self, worker: str) -> int:
        return len(self.owed[worker])

    def forget_owed(self, gid: str) -> None:
        w = self.worker_of.get(gid)
        if w is not None:
            self.owed[w] = [k for k in self.owed[w] if k[0] != gid]

    # ------------------------------------------------------------------ rollout side
    def dispatch(self) -> bool:
        """Up to 4 groups, as a dispatch round would; whether any went."""
        for k in range(self.rng.randint(1, 4)):
            loads = {w: self.owed_by(w) for w in self.serving}
            sent = self.rollout.dispatch(self.serving, self.prompt_of, time.perf_counter())
            if not isinstance(sent, Sent):
                assert isinstance(sent, Wait)
                assert (sent.reason == "workers") == (not self.serving and not self.table.finished)
                return k > 0
            gid = sent.group_id
            assert sent.worker in self.serving and loads[sent.worker] == min(loads.values())
            assert sent.n == self.cfg["N"] and not self.refit_pending
            if gid in self.state:  # dispatched again: a failed or lost group keeps its prompt
                assert self.state[gid] == "due", (gid, self.state[gid])
                assert sent.prompt_ids == [self.index_of[gid]]
            else:
                (index,) = sent.prompt_ids  # prompt_of() gives position i the ids [i]
                assert index not in self.trained_indices, f"prompt {index} dispatched again"
                assert self.table.num_live <= self.cfg["cap"], "a new group went past the cap"
                self.index_of[gid] = index
            self.attempt[gid] += 1
            self.state[gid], self.worker_of[gid] = "flight", sent.worker
            for key in self.samples_of(gid):
                self.set_fate(key, "flight")
                self.owed[sent.worker].append(key)
            self.counts["dispatched"] += 1
        return True

    @staticmethod
    def prompt_of(index: int) -> tuple[Prompt, list[int]]:
        return Prompt(id=f"p{index}", text=f"prompt {index}"), [index]

    def sample_back(self) -> None:
        workers = [w for w in self.workers if self.owed[w]]
        w = self.rng.choice(workers)
        queue = self.owed[w]
        key = queue.pop(self.rng.randrange(len(queue)) if self.rng.random() < 0.8 else 0)
        gid, _, i = key
        if gid.startswith("eval"):
            return self.eval_back(w, gid)
        aborting = self.state[gid] == "aborting"
        arrival = self.rollout.sample_arrived(SampleDone(gid, w, i, CUT if aborting else DONE))
        self.set_fate(key, "back")
        last = all(self.fate[k] == "back" for k in self.samples_of(gid))
        expected = ArrivalKind.PENDING if not last else ArrivalKind.DISCARDED if aborting else ArrivalKind.COMPLETE
        assert arrival.kind == expected, (arrival, expected)
        if expected == ArrivalKind.DISCARDED:
            self.end(gid, "aborted")
        elif expected == ArrivalKind.COMPLETE:
            assert arrival.group is not None and arrival.group.group_id == gid
            assert all(s is not None for s in arrival.group.samples)
            self.state[gid] = "scoring"
        self.counts["samples"] += 1

    def stranger(self) -> None:
        """A sample nobody asked for, one of the wrong worker, or a duplicate: refused, and
        nothing changes."""
        before = self.views()
        choices: list[tuple[str, str, int]] = [("g999999", self.rng.choice(self.workers), 0)]
        for gid, state in self.state.items():
            if state == "flight":
                others = [w for w in self.workers if w != self.worker_of[gid]]
                if others:
                    choices.append((gid, self.rng.choice(others), 0))
                backs = [k[2] for k in self.samples_of(gid) if self.fate[k] == "back"]
                if backs:
                    choices.append((gid, self.worker_of[gid], self.rng.choice(backs)))
                choices.append((gid, self.worker_of[gid], self.cfg["N"]))  # out of range
        gid, w, i = self.rng.choice(choices)
        assert self.rollout.sample_arrived(SampleDone(gid, w, i, DONE)).kind == ArrivalKind.REJECTED
        if gid not in self.state or w != self.worker_of[gid]:
            failed = GroupFailed(gid, w, "E", "x")
            assert self.rollout.check_failure(failed).kind == ArrivalKind.REJECTED
        assert self.views() == before
        self.counts["rejected"] += 1

    def commit(self) -> None:
        gid = self.rng.choice([g for g, s in self.state.items() if s == "scoring"])
        rewards = [float(self.rng.random() < 0.5) for _ in range(self.cfg["N"])]
        scored = [CompletedSample(TOKENS, LOGPROBS, "stop", r, r > 0) for r in rewards]
        assert self.rollout.commit(gid, scored, time.perf_counter())
        self.state[gid] = "ready"

    def score_fail(self) -> None:
        gid = self.rng.choice([g for g, s in self.state.items() if s == "scoring"])
        assert self.rollout.score_failed(gid)
        self.end(gid, "failed")

    def generation_fail(self) -> None:
        gids = sorted({k[0] for w in self.workers for k in self.owed[w]} & set(self.state))
        gid = self.rng.choice(gids)
        arrival = self.rollout.check_failure(GroupFailed(gid, self.worker_of[gid], "E", "boom"))
        aborting = self.state[gid] == "aborting"
        assert arrival.kind == ArrivalKind.IN_FLIGHT and arrival.aborting == aborting
        retry = self.rng.random() < 0.6
        self.rollout.failed(gid, retry=retry)
        self.forget_owed(gid)
        if aborting:
            self.end(gid, "aborted")
            return
        self.end(gid, "failed", group_too=not retry)
        if retry:
            self.state[gid] = "retrying"
            self.retries += 1

    def retry(self) -> None:
        gid = self.rng.choice(sorted(g for g, s in self.state.items() if s == "retrying"))
        self.rollout.retry(gid)
        self.state[gid] = "due"

    def worker_dies(self) -> None:
        w = self.rng.choice(self.serving)
        lost = self.rollout.worker_lost(w)
        again = lost.again
        expect_again = 0
        for gid in [g for g, s in self.state.items() if s in ("flight", "aborting")]:
            if self.worker_of[gid] != w:
                continue
            if self.state[gid] == "aborting":
                self.end(gid, "aborted")
            else:
                self.end(gid, "lost", group_too=False)
                self.state[gid] = "due"
                expect_again += 1
        lost_evals = [g for g, s in self.evals.items() if s == w]
        assert again == expect_again
        assert sorted(r.request_id for r in lost.answered) == sorted(map(self.eval_id, lost_evals))
        for gid in lost_evals:  # their askers ask again, on a worker that serves
            self.evals[gid] = "waiting"
        self.abandoned -= {k[0] for k in self.owed[w]}
        self.owed[w] = []
        self.serving.remove(w)
        self.counts["deaths"] += 1

    def worker_back(self) -> None:
        w = self.rng.choice([w for w in self.workers if w not in self.serving])
        self.serving = [x for x in self.workers if x in self.serving or x == w]
        self.place_evals()

    # ------------------------------------------------------------------ evaluations
    def eval_id(self, gid: str) -> str:
        """The id of evaluation prompt ``gid``'s latest request."""
        return f"{gid}/0#{self.eval_asks[gid] - 1}"

    def start_eval(self) -> None:
        self.eval_label += 1
        for i in range(self.rng.randint(0, 3)):
            self.evals[f"eval-e{self.eval_label}-{i}"] = "waiting"
        self.place_evals()

    def place_evals(self) -> None:
        """Each waiting evaluation prompt asks for its sample (an answered request of no
        group), on the least loaded worker that serves; none serving: it waits."""
        for gid in [g for g, s in self.evals.items() if s == "waiting"]:
            loads = {w: self.owed_by(w) for w in self.serving}
            self.eval_asks[gid] += 1
            w = self.rollout.start_turn(self.eval_id(gid), self.serving)
            if not self.serving:
                assert w is None
                self.eval_asks[gid] -= 1
                continue
            assert w in self.serving and loads[w] == min(loads.values()), (w, loads)
            self.evals[gid] = w
            self.owed[w].append((self.eval_id(gid), 0, 0))

    def eval_back(self, w: str, tid: str) -> None:
        arrival = self.rollout.sample_arrived(SampleDone(tid, w, 0, DONE))
        if tid in self.abandoned:
            self.abandoned.remove(tid)
            assert arrival.kind == ArrivalKind.DISCARDED, arrival
            return
        assert arrival.kind == ArrivalKind.ANSWER and arrival.request is not None
        assert arrival.request.request_id == tid and arrival.request.evaluation
        del self.evals[tid.split("/")[0]]
        self.counts["evaluation_samples"] += 1

    def drop_evals(self) -> None:
        """The evaluation is given up (cancelled): its requests in flight are abandoned (the
        worker to tell named once); their samples are discarded when they come."""
        for gid, w in list(self.evals.items()):
            if w != "waiting":
                tid = self.eval_id(gid)
                assert self.rollout.abandon_turn(tid) == w
                assert self.rollout.abandon_turn(tid) is None
                self.abandoned.add(tid)
            del self.evals[gid]

    # ------------------------------------------------------------------ train side
    def train(self) -> bool:
        """One chunk (and the step's end when it is full); whether anything happened."""
        chunk = self.training.next_chunk()
        for gid in chunk.evicted:
            assert self.state[gid] == "ready", (gid, self.state[gid])
            self.end(gid, "evicted")
        for group in chunk.groups:
            assert self.state[group.group_id] == "ready"
            assert len(group.samples) == self.cfg["N"]
            assert list(group.rewards) == [s.reward for s in group.samples]
            self.state[group.group_id] = "taken"
        taken = [g for g, s in self.state.items() if s == "taken"]
        assert self.table.taken == len(taken)
        if len(taken) == self.cfg["P"]:
            self.training.finish_step()
            for gid in taken:
                assert self.index_of[gid] not in self.trained_indices, "a prompt trained twice"
                self.trained_indices.add(self.index_of[gid])
                self.end(gid, "trained")
            self.aborted(self.rollout.begin_refit())
            self.refit_pending = True
        return bool(chunk.groups or chunk.evicted)

    def aborted(self, aborts: arrivals.Aborts) -> None:
        for gid in aborts.gone:  # nothing of it on an engine: gone at once
            assert self.state.pop(gid) in ("retrying", "due"), gid
        for w, gids in aborts.by_worker.items():
            for gid in gids:
                assert self.state[gid] == "flight" and self.worker_of[gid] == w
                self.state[gid] = "aborting"
        assert aborts.count == len(aborts.gone) + sum(map(len, aborts.by_worker.values()))

    def end_refit(self) -> None:
        assert self.training.end_refit().generation_retries == self.retries
        self.refit_pending, self.retries = False, 0

    def abort_step(self) -> None:
        back = self.training.abort_step()
        taken = [g for g, s in self.state.items() if s == "taken"]
        assert back == len(taken)
        for gid in taken:
            self.state[gid] = "ready"
        self.given_back = True
        self.counts["steps_given_back"] += 1

    # ------------------------------------------------------------------ persistence
    def checkpoint(self) -> tuple[LiveGroups, RolloutPhase, TrainPhase]:
        """Snapshot at this step boundary and restore into a fresh table: an equal table."""
        snap = ckpt.snapshot(self.table)
        fresh = self.fresh()
        table, rollout, _ = fresh
        start, skip = ckpt.restore(table, snap)
        assert canonical(ckpt.snapshot(table)) == canonical(snap)
        for view in ("trainer_version", "generator_version", "num_ready", "next_index",
                     "failed_groups"):  # fmt: skip
            assert getattr(table, view) == getattr(self.table, view), view
        # the rest of the live groups are in its prompts to dispatch again (the ledger's live)
        assert table.num_live == table.num_ready and table.inflight_samples == 0
        assert table.ledger_report() == self.table.ledger_report()
        assert start <= table.next_index and all(start <= i < table.next_index for i in skip)
        assert rollout.problems() == []
        self.counts["checkpoints"] += 1
        return fresh

    def crash(self) -> None:
        """The controller dies at this step boundary and a new one resumes from its last
        checkpoint: whatever was in flight or being scored dies with it."""
        fresh = self.checkpoint()
        for gid, state in list(self.state.items()):
            if state in ("flight", "aborting", "scoring"):
                self.end(gid, "crashed")
            elif state in ("retrying", "due"):
                del self.state[gid]  # its last attempt ended already (failed or lost)
        self.table, self.rollout, self.training = fresh
        self.serving, self.retries = list(self.workers), 0
        self.owed = {w: [] for w in self.workers}
        self.evals.clear()
        self.abandoned.clear()
        self.counts["crashes"] += 1

    # ------------------------------------------------------------------ checks
    def views(self) -> tuple[Any, ...]:
        t, ro = self.table, self.rollout
        return (t.inflight_samples, t.num_live, t.num_ready, t.taken,
                tuple(ro.load(w) for w in self.workers), tuple(ro.problems()))  # fmt: skip

    def check(self) -> None:
        """The ledger against the table and the phases, after every action."""
        t, ro, states = self.table, self.rollout, Counter(self.state.values())
        for w in self.workers:
            assert ro.load(w) == self.owed_by(w), f"{w}: load {ro.load(w)}, owes {self.owed_by(w)}"
        owed = self.fates["flight"]
        assert t.inflight_samples == owed, f"{t.inflight_samples} in flight, engines owe {owed}"
        assert t.inflight_samples <= t.max_inflight_samples
        assert t.num_ready == states["ready"] and t.taken == states["taken"]
        live = sum(states[s] for s in ("flight", "retrying", "due", "scoring", "ready"))
        assert t.num_live == live, (t.num_live, states)
        self.given_back = self.given_back and t.num_live > self.cfg["cap"]
        assert t.num_live <= self.cfg["cap"] or self.given_back
        assert ro.problems() == [], ro.problems()

    def check_end(self) -> None:
        assert self.table.drained and not self.state and not any(self.owed.values())
        fates = Counter(self.fate.values())
        assert fates == +self.fates and set(fates) <= ENDS, fates  # each ended once: see end()
        assert fates["trained"] == self.cfg["steps"] * self.cfg["P"] * self.cfg["N"]
        report = self.table.ledger_report()
        assert sum(e.trained for e in report) == len(self.trained_indices)
        assert all(e.lost == 0 and e.repeated == 0 for e in report)
        self.counts.update(fates)


def run_schedule(rng: random.Random, cfg: dict[str, Any], faults: bool) -> Counter[str]:
    world = World(rng, cfg)
    actions = 0
    while not world.table.finished:
        actions += 1
        assert actions < 100_000, "no progress"
        act = rng.choice(moves(world, faults))
        getattr(world, act)()
        world.check()
        if not unstick(world):
            raise AssertionError("deadlock: nothing in flight, nothing to dispatch or train")
        world.check()
    if world.refit_pending:
        world.end_refit()
    world.drop_evals()
    world.aborted(world.rollout.close())
    for gid, state in list(world.state.items()):
        assert state in ("aborting", "scoring", "ready"), (gid, state)  # all else aborted
        if state == "scoring":  # its scores come too late: counted as unused
            assert not world.rollout.commit(gid, [], time.perf_counter())
        if state != "aborting":
            world.end(gid, "unused")
    while any(world.owed.values()):
        world.sample_back()
        world.check()
    world.check_end()
    world.counts["actions"] += actions
    return world.counts


def moves(world: World, faults: bool) -> list[str]:
    t, states = world.table, set(world.state.values())
    out = []
    boundary = t.taken == 0 and not world.refit_pending
    if not world.refit_pending:
        out += ["dispatch", "train"]
    if any(world.owed.values()):
        out += ["sample_back"] * 4
    if "scoring" in states:
        out += ["commit"] * 2
    if world.refit_pending:
        out.append("end_refit")
    out.append("stranger")
    if boundary:
        out.append("checkpoint")
    out.append("drop_evals" if world.evals else "start_eval")
    if not faults or world.rng.random() < 0.6:  # faults: rarer than the work itself
        return out
    if boundary and world.counts["crashes"] < 2:
        out.append("crash")
    if t.taken and not world.refit_pending:
        out.append("abort_step")
    if {k[0] for w in world.workers for k in world.owed[w]} & set(world.state):
        out.append("generation_fail")
    if "scoring" in states:
        out.append("score_fail")
    if "retrying" in states:
        out.append("retry")
    if world.serving and world.rng.random() < 0.3:
        out.append("worker_dies")
    if len(world.serving) < len(world.workers):
        out.append("worker_back")
    return out


def unstick(world: World) -> bool:
    """With nothing in flight, nothing being scored and no refit going on, the pumps must
    still be able to move (as the controller's would: a back-off ends, a worker comes back)."""
    if any(world.owed.values()) or world.refit_pending or world.table.finished:
        return True
    if "scoring" in world.state.values():
        return True
    for gid in [g for g, s in world.state.items() if s == "retrying"]:
        world.rollout.retry(gid)
        world.state[gid] = "due"
    if not world.serving:
        world.worker_back()
    return world.dispatch() or world.train()


def config(sampler: str, P: int, N: int, W: int, steps: int, ratio: float,
           extra: int, inflight_frac: float, chunk_frac: float, workers: int) -> dict[str, Any]:  # fmt: skip
    c = caps(SAMPLERS[sampler](W, ratio), P, N, extra, inflight_frac, chunk_frac)
    return dict(sampler=sampler, P=P, N=N, W=W, steps=steps, ratio=ratio, workers=workers,
                **c._asdict())  # fmt: skip


PARAMS = dict(
    sampler=st.sampled_from(sorted(SAMPLERS)),
    workers=st.integers(1, 3),
    **shape_strategies(max_W=2, max_steps=5, max_ratio=2.0, max_extra=2),
)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(faults=st.booleans(), **PARAMS)
def test_random_schedules_keep_every_invariant(seed: int, faults: bool, **params: Any) -> None:
    run_schedule(random.Random(seed), config(**params), faults)


def test_the_random_schedules_reach_every_event() -> None:
    """Schedules drawn as above reach every event they claim to (a test that never crashed a
    controller would prove nothing about restores), and every fate a sample can have."""
    rng, totals = random.Random(23), Counter[str]()
    for _ in range(300):
        params = dict(
            sampler=rng.choice(sorted(SAMPLERS)), P=rng.randint(1, 4), N=rng.randint(1, 3),
            W=rng.randint(0, 2), steps=rng.randint(1, 5), ratio=rng.uniform(1.0, 2.0),
            extra=rng.randint(0, 2), inflight_frac=rng.uniform(0.05, 1.0),
            chunk_frac=rng.uniform(0.01, 1.0), workers=rng.randint(1, 3),
        )  # fmt: skip
        totals.update(run_schedule(random.Random(rng.random()), config(**params), True))
    events = ("samples", "rejected", "checkpoints", "crashes", "deaths", "steps_given_back",
              "evaluation_samples", *ENDS)  # fmt: skip
    for event in events:
        assert totals[event] > 0, (event, totals)


def test_a_stranger_is_refused_with_its_reason_and_restore_wants_a_fresh_table() -> None:
    """Two small cases by hand: a sample from the wrong worker is refused with its reason,
    and restore() wants a fresh table."""
    world = World(random.Random(0), config("gated", 1, 2, 1, 2, 1.0, 0, 1.0, 1.0, 2))
    assert world.dispatch()
    gid, worker = next(iter(world.worker_of.items()))
    other = next(w for w in world.workers if w != worker)
    arrival = world.rollout.sample_arrived(SampleDone(gid, other, 0, DONE))
    assert arrival.kind == ArrivalKind.REJECTED
    assert arrival.detail == f"SampleDone for group {gid!r}, which is not generating on {other!r}"
    bad = Sample(TOKENS, LOGPROBS[:2], "stop")
    arrival = world.rollout.sample_arrived(SampleDone(gid, worker, 0, bad))
    assert (arrival.kind, arrival.detail) == (ArrivalKind.MALFORMED, "(3,) tokens but (2,) logprobs")
    world.check()
    with pytest.raises(SchedulerError, match="fresh table"):
        ckpt.restore(world.table, ckpt.snapshot(world.fresh()[0]))
