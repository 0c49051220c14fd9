"""Property test of the real :class:`asyncrl.run.book.RolloutBook` in its multi-turn mode
(``episodes=True``: a group is ``n`` episodes, each asking for one turn at a time), with the
real scheduler and the built-in samplers, driven through thousands of random schedules.

The test plays what :mod:`asyncrl.run.episodes` and the controller do around the book, calling
it as they do: it dispatches groups, starts turns for running episodes (with a random
``previous`` worker), has the engines send turn samples back in a random order (cut short once
abandoned) or fail them, abandons turns (an episode's deadline), ends episodes with a scored
sample and commits the group that completes, fails episode groups (retried or dropped), kills
and brings back workers, trains chunks, fails open steps, refits (aborted groups' episodes end
with no sample; their abandoned turns' samples still come back), runs evaluation episodes, sends
strangers' and duplicate turn samples, and closes. It keeps a ledger of its own, never a second
copy of the book's logic, and after every action checks:

* every turn request has exactly one fate: in flight, or ended once as answered (to its
  episode), failed (to its episode), lost (with its worker) or discarded (abandoned first);
* each worker's load equals the turns its engine owes (no single-turn samples here); a turn
  goes only to a serving worker, and stays on ``previous`` unless that one is more than
  ``STICKY_TURNS`` busier than the least loaded; no turn starts for a group not generating;
* each episode ends once (scored, or with no sample while its group is aborted, or
  unreported when its group failed); a committed group holds the ``n`` scored samples given;
* capacities and staleness as tests/unit/test_book.py checks them, the book's views equal the
  ledger's, and :meth:`RolloutBook.problems` is empty.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.environment import Prompt
from asyncrl.policy.groups import CompletedSample
from asyncrl.policy.schedule import Wait
from asyncrl.run import book as bk
from asyncrl.run.book import RolloutBook, Sent
from asyncrl.run.turns import turn_id
from asyncrl.wire.messages import GroupFailed, Sample, SampleDone
from schedule_support import SAMPLERS, caps, scheduler, shape_strategies

TOKENS = np.array([3, 1, 4], dtype=np.int32)
LOGPROBS = np.full(3, -0.5, dtype=np.float32)
DONE = Sample(TOKENS, LOGPROBS, "stop")
CUT = Sample(TOKENS[:1], LOGPROBS[:1], "abort")
MAX_TURNS = 3
"""Turns an episode answers at most before it must end (keeps schedules short)."""
TURN_FATES = {"answered", "failed", "lost", "discarded"}
GROUP_FATES = {"trained", "evicted", "aborted", "failed", "unused"}
RUNNING = ("idle", "waiting", "ending", "cancelled")
"""An episode's states before its end: between turns, waiting for one, past its deadline (its
turn abandoned, about to end), cancelled (its group is being aborted)."""


@dataclass(eq=False)
class Episode:
    """One episode of one dispatch of a group (or of an evaluation), as the runner's asker."""

    gid: str
    index: int
    dispatch: int = 0
    """The group's retries before this dispatch (the runner asks the book): in its turn ids."""
    state: str = "idle"
    turn: str = ""
    worker: str = ""
    """Its last turn's worker (``previous``)."""
    requests: int = 0
    answered: int = 0
    sample: CompletedSample | None = None

    def next_id(self) -> str:
        return turn_id(self.gid, self.index, self.requests, self.dispatch)


@dataclass(eq=False)
class TurnRec:
    tid: str
    episode: Episode
    worker: str
    abandoned: bool = False
    fate: str = ""


@dataclass(eq=False)
class GroupRec:
    index: int
    state: str = "flight"
    """flight, aborting, retrying, due, ready, taken."""
    attempt: int = 0
    start_version: int = 0
    episodes: list[Episode] = field(default_factory=list)


def sorted_ids(by_worker: dict[str, list[str]]) -> dict[str, list[str]]:
    return {w: sorted(ids) for w, ids in by_worker.items()}


class World:
    """The episodes, engines, trainer and controller around one book, and the ledger."""

    def __init__(self, rng: random.Random, cfg: dict[str, Any]) -> None:
        self.rng, self.cfg = rng, cfg
        self.workers = [f"rollout:{i}" for i in range(cfg["workers"])]
        self.serving = list(self.workers)
        sampler = SAMPLERS[cfg["sampler"]](cfg["W"], cfg["ratio"])
        self.max_staleness = sampler.max_staleness
        sched = scheduler(sampler, P=cfg["P"], N=cfg["N"], steps=cfg["steps"], cap=cfg["cap"],
                          inflight=cfg["max_inflight"], min_chunk=cfg["min_chunk"])  # fmt: skip
        self.book = RolloutBook(sched, self.workers, episodes=True)
        self.groups: dict[str, GroupRec] = {}
        self.inflight: dict[str, TurnRec] = {}
        """Turns in flight by id (abandoned ones too, until their engine answers)."""
        self.owed: dict[str, list[TurnRec]] = {w: [] for w in self.workers}
        self.ended_turns: list[TurnRec] = []
        self.turn_fates: Counter[str] = Counter()
        self.group_fates: Counter[str] = Counter()
        self.evals: list[Episode] = []
        self.eval_label = 0
        self.trained_indices: set[int] = set()
        self.refit_pending = self.given_back = False
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ ledger helpers
    def episodes(self, *states: str, evaluation: bool = False) -> list[Episode]:
        eps = self.evals if evaluation else [e for g in self.groups.values() for e in g.episodes]
        return [e for e in eps if e.state in states]

    def enders(self) -> list[Episode]:
        """Training episodes that may end now (one between turns has answered one)."""
        eps = self.episodes("idle", "ending", "cancelled")
        return [e for e in eps if e.answered or e.state != "idle"]

    def end_turn(self, rec: TurnRec, fate: str) -> None:
        assert rec.fate == "", f"turn {rec.tid} ended twice: {rec.fate}, {fate}"
        rec.fate = fate
        self.turn_fates[fate] += 1
        del self.inflight[rec.tid]
        self.ended_turns.append(rec)
        if fate in ("answered", "failed", "lost"):  # its episode waited for it
            assert rec.episode.state == "waiting" and rec.episode.turn == rec.tid
            rec.episode.state, rec.episode.turn = "idle", ""
            rec.episode.answered += fate == "answered"

    def end_group(self, gid: str, fate: str) -> None:
        assert all(e.state in ("ended", "unreported") for e in self.groups[gid].episodes)
        del self.groups[gid]
        self.group_fates[fate] += 1

    def live_turns(self, gids: set[str]) -> dict[str, list[str]]:
        """Turns in flight and not abandoned of these groups' episodes, by worker."""
        out: dict[str, list[str]] = {}
        for rec in self.inflight.values():
            if rec.episode.gid in gids and not rec.abandoned:
                out.setdefault(rec.worker, []).append(rec.tid)
        return out

    def abandon(self, tids: dict[str, list[str]]) -> None:
        """The book abandoned these turns (listed by worker): the runner cancels their
        episodes, whose own abandon_turn() then finds nothing to tell."""
        for ids in tids.values():
            for tid in ids:
                self.inflight[tid].abandoned = True
                assert self.book.abandon_turn(tid) is None

    @staticmethod
    def prompt_of(index: int) -> tuple[Prompt, list[int]]:
        return Prompt(id=f"p{index}", text=f"prompt {index}"), [index]

    # ------------------------------------------------------------------ rollout side
    def dispatch(self) -> bool:
        """Up to 4 groups, as a dispatch round would; whether any went."""
        for k in range(self.rng.randint(1, 4)):
            loads = [self.book.load(w) for w in self.workers]
            sent = self.book.dispatch(self.serving, self.prompt_of, time.perf_counter())
            assert [self.book.load(w) for w in self.workers] == loads, "a group charged a worker"
            if not isinstance(sent, Sent):
                assert isinstance(sent, Wait)
                assert (sent.reason == "workers") == (not self.serving and not self.book.finished)
                assert not self.refit_pending or sent.reason in ("workers", "gate"), sent
                return k > 0
            gid, rec = sent.group_id, self.groups.get(sent.group_id)
            assert sent.worker == "" and sent.n == self.cfg["N"] and not self.refit_pending
            assert sent.prompt is not None and sent.prompt.id == f"p{sent.prompt_ids[0]}"
            if rec is not None:  # dispatched again after a failure: the same prompt
                assert rec.state == "due" and sent.prompt_ids == [rec.index], (gid, rec.state)
            else:
                (index,) = sent.prompt_ids
                assert index not in self.trained_indices, f"prompt {index} dispatched again"
                assert self.book.num_live <= self.cfg["cap"], "a new group went past the cap"
                rec = self.groups[gid] = GroupRec(index)
            rec.state, rec.attempt = "flight", rec.attempt + 1
            rec.start_version = self.book.generator_version
            again = self.book.retries(gid)  # as EpisodeRunner.start() numbers a dispatch
            rec.episodes = [Episode(gid, i, again) for i in range(sent.n)]
            self.counts["dispatched"] += 1
        return True

    def start_turn(self, evaluation: bool = False) -> None:
        """An episode asks for its next turn (one of a group not generating: refused)."""
        ep = self.rng.choice([e for e in self.episodes("idle", "cancelled", evaluation=evaluation)
                              if e.answered < MAX_TURNS])  # fmt: skip
        loads = {w: len(self.owed[w]) for w in self.serving}
        previous = self.rng.choice([ep.worker] * 3 + self.workers + [""])
        if loads and self.rng.random() < 0.2:  # its last turn was on the busiest worker
            previous = max(loads, key=loads.__getitem__)
        tid = ep.next_id()
        if evaluation:
            w = self.book.start_eval_turn(tid, ep.gid, self.serving, previous)
        else:
            w = self.book.start_turn(tid, ep.gid, ep.index, self.serving, previous)
        if (not evaluation and self.groups[ep.gid].state != "flight") or not self.serving:
            assert w is None, f"turn {tid} placed for a group not generating, or on no worker"
            self.counts["turns_refused"] += 1
            return
        assert w in self.serving, f"turn {tid} placed on {w!r}, which does not serve"
        least = min(loads.values())
        if previous in loads and loads[previous] <= least + bk.STICKY_TURNS:
            assert w == previous, (tid, w, previous, loads)
            self.counts["turns_kept_on_previous"] += loads[previous] > least
        else:
            assert loads[w] == least, (tid, w, loads)
            self.counts["turns_moved_off_previous"] += previous in loads
        assert tid not in self.inflight, f"turn id {tid} reused while in flight"
        rec = self.inflight[tid] = TurnRec(tid, ep, w)
        self.owed[w].append(rec)
        ep.state, ep.turn, ep.worker, ep.requests = "waiting", tid, w, ep.requests + 1
        self.counts["turns"] += 1
        self.counts["evaluation_turns"] += evaluation

    def eval_turn(self) -> None:
        self.start_turn(evaluation=True)

    def engine_answers(self) -> None:
        """An engine sends one turn's sample back (cut short once abandoned), or fails it;
        the first engine is slow (its load grows: turns move off it)."""
        busy = [w for w in self.workers if self.owed[w]]
        if len(busy) > 1 and self.rng.random() < 0.8:
            busy = busy[1:] if busy[0] == self.workers[0] else busy
        w = self.rng.choice(busy)
        queue = self.owed[w]
        rec = queue.pop(self.rng.randrange(len(queue)) if self.rng.random() < 0.8 else 0)
        if self.fails_now():
            arrival = self.book.check_failure(GroupFailed(rec.tid, w, "E", "boom"))
            fate = "discarded" if rec.abandoned else "failed"
            assert arrival.kind == (bk.DISCARDED if rec.abandoned else bk.TURN_FAILED), arrival
        else:
            sample = CUT if rec.abandoned else DONE
            arrival = self.book.sample_arrived(SampleDone(rec.tid, w, 0, sample))
            fate = "discarded" if rec.abandoned else "answered"
            assert arrival.kind == (bk.DISCARDED if rec.abandoned else bk.TURN), arrival
            assert rec.abandoned or arrival.sample is sample
        assert rec.abandoned or (arrival.turn is not None and arrival.turn.turn_id == rec.tid)
        self.end_turn(rec, fate)

    def fails_now(self) -> bool:
        return self.cfg["faults"] and self.rng.random() < 0.2

    def deadline(self) -> None:
        """An episode's deadline passes while it waits: its turn is abandoned (the worker told
        to abort it), and the episode then ends (an evaluation one at once)."""
        ep = self.rng.choice(self.episodes("waiting") + self.episodes("waiting", evaluation=True))
        rec = self.inflight[ep.turn]
        assert self.book.abandon_turn(rec.tid) == rec.worker
        assert self.book.abandon_turn(rec.tid) is None  # told once
        rec.abandoned, ep.turn = True, ""
        ep.state = "ending"
        if ep in self.evals:
            self.evals.remove(ep)

    def end_episode(self) -> None:
        """An episode ends: scored (it answered a turn), with no sample (cancelled), or it
        fails its group (its deadline passed before its first turn ended: worth a retry)."""
        ep = self.rng.choice(self.enders())
        group = self.groups[ep.gid]
        if ep.state == "cancelled" and (not ep.answered or self.rng.random() < 0.8):
            sample = None
        elif ep.answered:
            reward = float(self.rng.randint(0, 4))
            sample = CompletedSample(TOKENS, LOGPROBS, "stop", reward, reward > 0)
        else:
            return self.fail_group(ep, retryable=True)
        if group.state == "flight" and self.rng.random() < 0.05:  # only an abort ends one so
            with pytest.raises(bk.BookError, match="without a sample"):
                self.book.episode_ended(ep.gid, ep.index, None)
        assert ep.state in RUNNING, f"episode {ep.gid}/{ep.index} ended twice"
        arrival = self.book.episode_ended(ep.gid, ep.index, sample)
        ep.state, ep.sample = "ended", sample
        last = all(e.state == "ended" for e in group.episodes)
        aborting = group.state == "aborting"
        expected = bk.PENDING if not last else bk.DISCARDED if aborting else bk.COMPLETE
        assert arrival.kind == expected, (arrival, expected)
        if expected == bk.DISCARDED:
            self.end_group(ep.gid, "aborted")
        elif expected == bk.COMPLETE:  # scored already: the runner commits at once
            assert arrival.group is not None and arrival.group.group_id == ep.gid
            got = list(arrival.group.samples)
            assert all(a is e.sample for a, e in zip(got, group.episodes, strict=True))
            assert self.book.commit(ep.gid, got, time.perf_counter())
            group.state = "ready"
        self.counts["episodes"] += 1

    def fail(self) -> None:
        """An episode fails (its environment raised, or a turn failed for good), perhaps as
        its group is aborted."""
        ep = self.rng.choice(self.episodes("idle", "cancelled"))
        self.fail_group(ep, retryable=self.rng.random() < 0.8)

    def fail_group(self, ep: Episode, *, retryable: bool) -> None:
        """As ``Redispatcher.episode_failed`` does: its group fails (retried or dropped, as
        the failure budget says; one being aborted is gone); its other episodes end
        unreported, and the turns they wait for are abandoned."""
        group = self.groups[ep.gid]
        aborting = not self.book.generating(ep.gid)
        assert aborting == (group.state == "aborting")
        retry = not aborting and retryable and self.rng.random() < 0.6
        expected = self.live_turns({ep.gid})
        turns = self.book.failed(ep.gid, retry=retry)
        assert sorted_ids(turns) == sorted_ids(expected), (turns, expected)
        self.abandon(turns)
        for e in group.episodes:
            if e.state != "ended":
                e.state = "unreported"
        if retry:
            group.state = "retrying"
        else:
            self.end_group(ep.gid, "aborted" if aborting else "failed")
        self.counts["group_failures"] += 1
        self.counts["group_failures_while_aborted"] += aborting

    def retry(self) -> None:
        gid = self.rng.choice(sorted(g for g, r in self.groups.items() if r.state == "retrying"))
        self.book.retry(gid)
        self.groups[gid].state = "due"

    def worker_dies(self) -> None:
        w = self.rng.choice(self.serving)
        expected = {rec.tid for rec in self.owed[w] if not rec.abandoned}
        lost = self.book.worker_lost(w)
        assert (lost.again, lost.evals) == (0, 0)  # groups of episodes are on no worker
        assert sorted(t.turn_id for t in lost.turns) == sorted(expected)
        for rec in self.owed[w]:
            self.end_turn(rec, "discarded" if rec.abandoned else "lost")
        self.owed[w] = []
        self.serving.remove(w)
        self.counts["deaths"] += 1

    def worker_back(self) -> None:
        w = self.rng.choice([w for w in self.workers if w not in self.serving])
        self.serving = [x for x in self.workers if x in self.serving or x == w]

    # ------------------------------------------------------------------ evaluation
    def start_eval(self) -> None:
        self.eval_label += 1
        for i in range(self.rng.randint(1, 3)):
            self.evals.append(Episode(f"eval-e{self.eval_label}-{i}", 0))

    def eval_ends(self) -> None:
        ep = self.rng.choice([e for e in self.evals if e.state == "idle" and e.answered])
        self.evals.remove(ep)
        ep.state = "ended"

    def cancel_evals(self) -> None:
        """The evaluation is cancelled: each episode's turn is abandoned."""
        for ep in self.evals:
            if ep.state == "waiting":
                rec = self.inflight[ep.turn]
                assert self.book.abandon_turn(rec.tid) == rec.worker
                rec.abandoned = True
            ep.state = "ended"
        self.evals = []

    # ------------------------------------------------------------------ strangers
    def stranger(self) -> None:
        """A turn sample or failure nobody waits for (unknown, from the wrong worker, a second
        sample, a duplicate, one for a group of episodes itself), or a malformed one: refused,
        and nothing changes."""
        before = self.views()
        anyone = self.rng.choice(self.workers)
        choices = [("g999999/0#0", anyone, 0)]
        for rec in self.inflight.values():
            choices += [(rec.tid, w, 0) for w in self.workers if w != rec.worker]
            choices.append((rec.tid, rec.worker, 1))  # a turn has one sample
        ended = [r for r in self.ended_turns[-4:] if r.tid not in self.inflight]  # duplicates
        choices += [(r.tid, r.worker, 0) for r in ended]
        flying = [g for g, r in self.groups.items() if r.state in ("flight", "aborting")]
        choices += [(g, anyone, 0) for g in flying]
        tid, w, i = self.rng.choice(choices)
        assert self.book.sample_arrived(SampleDone(tid, w, i, DONE)).kind == bk.REJECTED
        if i == 0:
            assert self.book.check_failure(GroupFailed(tid, w, "E", "x")).kind == bk.REJECTED
            assert tid in self.inflight or self.book.abandon_turn(tid) is None
        if self.inflight and self.rng.random() < 0.3:
            rec = self.rng.choice(list(self.inflight.values()))
            bad = SampleDone(rec.tid, rec.worker, 0, Sample(TOKENS, LOGPROBS[:2], "stop"))
            assert self.book.sample_arrived(bad).kind == bk.MALFORMED
        assert self.views() == before
        self.counts["rejected"] += 1

    # ------------------------------------------------------------------ train side
    def train(self) -> bool:
        """One chunk (and the step's end and refit when it is full); whether anything
        happened."""
        chunk = self.book.next_chunk()
        for gid in chunk.evicted:
            assert self.groups[gid].state == "ready", (gid, self.groups[gid].state)
            self.end_group(gid, "evicted")
        for group in chunk.groups:
            rec = self.groups[group.group_id]
            assert rec.state == "ready" and len(group.samples) == self.cfg["N"]
            assert all(s is e.sample for s, e in zip(group.samples, rec.episodes, strict=True))
            assert list(group.rewards) == [e.sample.reward for e in rec.episodes if e.sample]
            staleness = self.book.trainer_version - rec.start_version
            assert group.start_version == rec.start_version
            assert 0 <= staleness <= self.max_staleness, (group.group_id, staleness)
            rec.state = "taken"
        taken = [g for g, r in self.groups.items() if r.state == "taken"]
        assert self.book.taken == len(taken)
        if len(taken) == self.cfg["P"]:
            self.book.finish_step()
            for gid in taken:
                assert self.groups[gid].index not in self.trained_indices, "a prompt trained twice"
                self.trained_indices.add(self.groups[gid].index)
                self.end_group(gid, "trained")
            self.aborted(self.book.begin_refit())
            self.refit_pending = True
        return bool(chunk.groups or chunk.evicted)

    def aborted(self, aborts: bk.Aborts) -> None:
        """Groups aborted at a refit or at close: those waiting for their retry are gone; the
        turns of the others' episodes are listed under their workers (abandoned: their samples
        still come back), and their episodes are cancelled."""
        for gid in aborts.gone:
            assert self.groups[gid].state in ("retrying", "due"), gid
            self.end_group(gid, "aborted")
        gids = set(aborts.episodes)
        assert len(gids) == len(aborts.episodes)
        assert all(self.groups[g].state == "flight" for g in gids), aborts.episodes
        expected = self.live_turns(gids)
        assert sorted_ids(aborts.by_worker) == sorted_ids(expected), (aborts, expected)
        assert aborts.turns == sum(map(len, expected.values()))
        assert aborts.count == len(aborts.gone) + len(gids)
        self.abandon(aborts.by_worker)
        for gid in gids:
            self.groups[gid].state = "aborting"
            for ep in self.groups[gid].episodes:
                if ep.state in RUNNING:
                    ep.state, ep.turn = "cancelled", ""

    def end_refit(self) -> None:
        self.book.end_refit()
        self.refit_pending = False

    def abort_step(self) -> None:
        taken = [g for g, r in self.groups.items() if r.state == "taken"]
        assert self.book.abort_step() == len(taken)
        for gid in taken:
            self.groups[gid].state = "ready"
        self.given_back = True
        self.counts["steps_given_back"] += 1

    # ------------------------------------------------------------------ checks
    def views(self) -> tuple[Any, ...]:
        b = self.book
        return (b.inflight_samples, b.num_live, b.num_ready, b.taken, b.turns_in_flight,
                tuple(b.load(w) for w in self.workers), tuple(b.problems()))  # fmt: skip

    def check(self) -> None:
        """The ledger against the book, after every action."""
        b = self.book
        for w in self.workers:
            assert b.load(w) == len(self.owed[w]), f"{w}: load {b.load(w)}, owes {self.owed[w]}"
        assert b.turns_in_flight == len(self.inflight) == sum(map(len, self.owed.values()))
        running = sum(1 for r in self.groups.values() if r.state in ("flight", "aborting")
                      for e in r.episodes if e.state in RUNNING)  # fmt: skip
        assert b.inflight_samples == running, f"{b.inflight_samples} in flight, {running} running"
        assert b.inflight_samples <= b.max_inflight_samples
        states = Counter(r.state for r in self.groups.values())
        assert b.num_ready == states["ready"] and b.taken == states["taken"]
        live = sum(states[s] for s in ("flight", "retrying", "due", "ready"))
        assert b.num_live == live, (b.num_live, states)
        self.given_back = self.given_back and b.num_live > self.cfg["cap"]
        assert b.num_live <= self.cfg["cap"] or self.given_back
        assert b.problems() == [], b.problems()

    def close(self) -> None:
        """The run's end: every group in flight is aborted, its episodes end (with no sample,
        mostly), and the engines send back what they still owe (all of it discarded)."""
        if self.refit_pending:
            self.end_refit()
        self.cancel_evals()
        flying = {g for g, r in self.groups.items() if r.state == "flight"}
        aborts = self.book.close()
        assert set(aborts.episodes) == flying
        self.aborted(aborts)
        for gid, rec in list(self.groups.items()):
            assert rec.state in ("aborting", "ready"), (gid, rec.state)
            if rec.state == "ready":
                self.end_group(gid, "unused")
        while self.episodes("cancelled"):  # one may fail as it is cancelled: its group is gone
            self.fail() if self.fails_now() else self.end_episode()
            self.check()
        while any(self.owed.values()):
            self.engine_answers()
            self.check()

    def check_end(self) -> None:
        b = self.book
        assert b.drained and not self.groups and not self.inflight and b.turns_in_flight == 0
        assert all(b.load(w) == 0 for w in self.workers)
        assert set(self.turn_fates) <= TURN_FATES and set(self.group_fates) <= GROUP_FATES
        assert self.turn_fates.total() == len(self.ended_turns) == self.counts["turns"]
        assert self.group_fates["trained"] == self.cfg["steps"] * self.cfg["P"]
        report = b.ledger_report()
        assert sum(e.trained for e in report) == len(self.trained_indices)
        assert all(e.lost == 0 and e.repeated == 0 for e in report)
        assert b.problems() == []
        self.counts.update({f"turn_{k}": v for k, v in self.turn_fates.items()})
        self.counts.update({f"group_{k}": v for k, v in self.group_fates.items()})


def moves(world: World) -> list[str]:
    """The actions possible now (faults among them a fraction of the time)."""
    rng, faults = world.rng, world.cfg["faults"]
    out = ["stranger", "dispatch", "end_refit" if world.refit_pending else "train"]
    if any(e.answered < MAX_TURNS for e in world.episodes("idle", "cancelled")):
        out += ["start_turn"] * 3
    if world.enders():
        out += ["end_episode"] * 2
    if any(world.owed.values()):
        out += ["engine_answers"] * 4
    if not world.evals:
        out.append("start_eval")
    if any(e.answered < MAX_TURNS for e in world.episodes("idle", evaluation=True)):
        out.append("eval_turn")
    if any(e.answered for e in world.episodes("idle", evaluation=True)):
        out.append("eval_ends")
    if not faults or rng.random() < 0.6:  # faults: rarer than the work itself
        return out
    if world.episodes("waiting") or world.episodes("waiting", evaluation=True):
        out.append("deadline")
    if world.episodes("idle", "cancelled") and rng.random() < 0.3:
        out.append("fail")
    if "retrying" in {r.state for r in world.groups.values()}:
        out.append("retry")
    if world.serving and rng.random() < 0.3:
        out.append("worker_dies")
    if len(world.serving) < len(world.workers):
        out.append("worker_back")
    if world.book.taken and not world.refit_pending:
        out.append("abort_step")
    if world.evals:
        out.append("cancel_evals")
    return out


def unstick(world: World) -> bool:
    """With nothing running, nothing owed and no refit going on, the pumps must still be able
    to move (as the controller's would: a back-off ends, a worker comes back)."""
    b = world.book
    if any(world.owed.values()) or world.refit_pending or b.finished:
        return True
    if world.episodes(*RUNNING):
        return True
    for gid in [g for g, r in world.groups.items() if r.state == "retrying"]:
        b.retry(gid)
        world.groups[gid].state = "due"
    if not world.serving:
        world.worker_back()
    return world.dispatch() or world.train()


def run_schedule(rng: random.Random, cfg: dict[str, Any]) -> Counter[str]:
    world = World(rng, cfg)
    actions = 0
    while not world.book.finished:
        actions += 1
        assert actions < 100_000, "no progress"
        getattr(world, rng.choice(moves(world)))()
        world.check()
        if not unstick(world):
            raise AssertionError("deadlock: nothing running, nothing to dispatch or train")
        world.check()
    world.close()
    world.check_end()
    world.counts["actions"] += actions
    return world.counts


def config(sampler: str, P: int, N: int, W: int, steps: int, ratio: float, extra: int,
           inflight_frac: float, chunk_frac: float, workers: int,
           faults: bool) -> dict[str, Any]:  # fmt: skip
    c = caps(SAMPLERS[sampler](W, ratio), P, N, extra, inflight_frac, chunk_frac)
    return dict(sampler=sampler, P=P, N=N, W=W, steps=steps, ratio=ratio, workers=workers,
                faults=faults, **c._asdict())  # fmt: skip


PARAMS = dict(
    sampler=st.sampled_from(sorted(SAMPLERS)),
    workers=st.integers(1, 3),
    faults=st.booleans(),
    **shape_strategies(max_W=2, max_steps=4, max_ratio=2.0, max_extra=2),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**PARAMS)
def test_random_episode_schedules_keep_every_invariant(seed: int, **params: Any) -> None:
    run_schedule(random.Random(seed), config(**params))


def test_the_random_schedules_reach_every_event() -> None:
    """Schedules drawn as above reach every event they claim to (a test that never moved a
    turn off its previous worker would prove nothing about the sticky rule), and every fate a
    turn and a group can have."""
    rng, totals = random.Random(24), Counter[str]()
    for _ in range(300):
        params = dict(
            sampler=rng.choice(sorted(SAMPLERS)), P=rng.randint(1, 4), N=rng.randint(1, 3),
            W=rng.randint(0, 2), steps=rng.randint(1, 4), ratio=rng.uniform(1.0, 2.0),
            extra=rng.randint(0, 2), inflight_frac=rng.uniform(0.05, 1.0),
            chunk_frac=rng.uniform(0.01, 1.0), workers=rng.randint(1, 3), faults=rng.random() < 0.5,
        )  # fmt: skip
        totals.update(run_schedule(random.Random(rng.random()), config(**params)))
    events = ("turns_refused", "turns_kept_on_previous", "turns_moved_off_previous",
              "evaluation_turns", "rejected", "deaths", "steps_given_back", "group_failures",
              "group_failures_while_aborted",
              *(f"turn_{f}" for f in TURN_FATES), *(f"group_{f}" for f in GROUP_FATES))  # fmt: skip
    for event in events:
        assert totals[event] > 0, (event, totals)


def test_misuse_is_refused_and_a_retried_group_gets_fresh_turn_ids() -> None:
    """By hand: a turn for an episode that is not running, an episode ending twice or without
    a sample while its group generates are refused; a group retried while its failed run's
    abandoned turn is still in flight starts its turns under new ids (the runner's scheme)."""
    world = World(random.Random(0), config("gated", 1, 2, 1, 1, 1.0, 0, 1.0, 1.0, 2, True))
    assert world.dispatch()
    gid = next(iter(world.groups))
    with pytest.raises(bk.BookError, match="not running"):
        world.book.start_turn("x", gid, 2, world.serving)
    first = turn_id(gid, 0, 0)
    assert world.book.start_turn(first, gid, 0, world.serving) == "rollout:0"
    # the least loaded now is rollout:1, but rollout:0 is at most STICKY_TURNS busier
    second = turn_id(gid, 1, 0)
    assert world.book.start_turn(second, gid, 1, world.serving, "rollout:0") == "rollout:0"
    with pytest.raises(bk.BookError, match="without a sample"):
        world.book.episode_ended(gid, 0, None)
    assert world.book.failed(gid, retry=True) == {"rollout:0": [first, second]}
    world.book.retry(gid)
    sent = world.book.dispatch(world.serving, world.prompt_of, 0.0)
    assert isinstance(sent, Sent) and sent.group_id == gid and world.book.retries(gid) == 1
    again = turn_id(gid, 0, 0, world.book.retries(gid))
    assert again == f"{gid}/0@1#0" and again != first
    assert world.book.start_turn(again, gid, 0, world.serving) == "rollout:1"
    with pytest.raises(ValueError, match="in flight already"):  # what the old ids ran into
        world.book.start_turn(first, gid, 1, world.serving)
    assert world.book.sample_arrived(SampleDone(first, "rollout:0", 0, CUT)).kind == bk.DISCARDED
    arrival = world.book.sample_arrived(SampleDone(again, "rollout:1", 0, DONE))
    assert arrival.kind == bk.TURN and arrival.turn is not None and arrival.turn.index == 0
    sample = CompletedSample(TOKENS, LOGPROBS, "stop", 1.0, True)
    assert world.book.episode_ended(gid, 0, sample).kind == bk.PENDING
    with pytest.raises(bk.BookError, match="not running"):
        world.book.episode_ended(gid, 0, sample)
    assert world.book.problems() == []
