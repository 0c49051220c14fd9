"""The rollout phase: a group from dispatch until it is committed (pure: no anyio, no sockets).

:class:`RolloutPhase` holds the rules from admission to a scored group, on the run's one table
of live groups (:class:`~asyncrl.policy.live.LiveGroups`), and owns the engine requests in
flight (:class:`~asyncrl.run.requests.RequestTable`), which give each rollout worker's load.
The rollout pump, the feeder, the asker, the episodes and the redispatcher call it; the loops
carry out what it says. Every group is ``n`` episodes, and one path takes each from dispatch
to commit::

    dispatch() ──► GENERATING ──each episode's sample: sample_arrived() / episode_ended()──►
       ▲              │  │ begin_refit()/close(): ABORTING ──its samples back──► gone
       │ retry()      │  │ worker_lost(): dispatched again at once (same prompt)
    RETRYING ◄──failed(retry=True)    failed(retry=False) / score_failed(): dropped
                      └── the last episode: COMPLETE ──► SCORING ──commit()──► READY

READY groups are the train phase's (:mod:`asyncrl.run.train_phase`).

A single-turn environment's episodes are one turn each, so the group is sent as one request
of ``n`` seeded samples on the least loaded worker (the engine shares their prompt's prefix),
and each sample that comes back fills its episode's slot (``PENDING``, then ``COMPLETE``:
score the group and :meth:`commit` it). A multi-turn environment's episodes
(:mod:`asyncrl.run.episodes`) ask for one turn at a time (:meth:`start_turn`): an answered
request on the least loaded worker, or on the one of the episode's last turn while not much
busier (its prefix cache), whose sample goes back to the episode (``ANSWER``); an ended
episode's scored sample goes to :meth:`episode_ended`, and its group's ``COMPLETE`` is
committed as it is. An evaluation's prompts (:mod:`asyncrl.run.evaluation`) are answered
requests that belong to no group: nothing trains on them. Aborting a group lists its requests
under their workers, and a group of episodes under ``Aborts.episodes`` (its episodes are
cancelled).

Invariants, written once in :meth:`problems` with the table's (tests/unit/test_phases.py and
test_phases_episodes.py drive the real classes through random schedules and check them after
every action, against a ledger of their own): a single-turn group in flight has its request,
owing the samples still to come; an episode's request belongs to an episode still running in
a group in flight; each worker's load is what its requests owe; a scored or ready group has
all its samples.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.policy.groups import ABORTING, GENERATING, READY, RETRYING, SCORING, Group
from asyncrl.policy.live import LiveGroups, SchedulerError, Wait
from asyncrl.run.arrivals import (
    ENDED,
    STICKY_TURNS,
    Aborts,
    Arrival,
    ArrivalKind,
    RolloutError,
    Lost,
    Sent,
    malformed,
    stamped,
    store,
    stranger,
)
from asyncrl.run.requests import RequestTable
from asyncrl.wire.messages import GroupFailed, SampleDone

if TYPE_CHECKING:
    from asyncrl.environment import Prompt
    from asyncrl.policy.groups import CompletedSample

__all__ = ["RolloutPhase"]

_IN_FLIGHT = (GENERATING, ABORTING)
_PENDING = Arrival(ArrivalKind.PENDING)
_DISCARDED = Arrival(ArrivalKind.DISCARDED)


class RolloutPhase:
    """Admission, the requests in flight, arrivals, failures, retries, a lost worker, and the
    aborts of a refit and of the run's end.

    Args:
        table: the run's live groups (shared with the train phase).
        workers: the rollout workers' identities (their load starts at 0).
        episodes: the run's groups are groups of multi-turn episodes.
    """

    def __init__(
        self, table: LiveGroups, workers: Sequence[str], *, episodes: bool = False,
        id_prefix: str = "",
    ) -> None:
        self._table = table
        self._prefix = id_prefix
        """Before each group id minted here: a job's name and ``:`` (docs/jobs.md), else none."""
        self._episodes = episodes
        self._requests = RequestTable()
        """The engine requests in flight: groups', episodes' turns, evaluations' prompts."""
        self._workers = tuple(workers)

    # ------------------------------------------------------------------ views
    def load(self, worker: str) -> int:
        """Samples still to come from ``worker`` (of groups, turns and evaluations)."""
        return self._requests.owed(worker)

    @property
    def requests_in_flight(self) -> int:
        """Engine requests in flight (groups', episodes' turns, evaluations' prompts)."""
        return len(self._requests)

    def generating(self, group_id: str) -> bool:
        """Whether ``group_id`` is generating (not being aborted, failed or done)."""
        return self._table.state_of(group_id) == GENERATING

    def retries(self, group_id: str) -> int:
        """Times ``group_id``'s generation failed and was retried (its worker's death is not
        one): what the failure budget decides on."""
        return self._table.group(group_id).retries

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        serving: Sequence[str],
        prompt_of: Callable[[int], tuple[Prompt, list[int]]],
        now: float,
    ) -> Sent | Wait:
        """Dispatch one more group if every rule allows it now: a group whose retry is due
        first (same prompt, same step), else a new one for prompt-stream position ``index``
        (``prompt_of(index)``) if the buffer, the samples in flight, the work the run still
        needs and the sampler allow it. A group of single-turn episodes goes as one request to
        the least loaded of ``serving``, a group of multi-turn episodes to no worker (each
        turn picks its own). ``Wait("workers")``: none serves."""
        t = self._table
        if t.finished:
            return Wait("finished")
        if not serving:
            return Wait("workers")
        if not t.gate_open:
            return Wait("gate")
        n = t.samples_per_prompt
        if t.retries_due:  # live and admitted already: only the samples in flight hold it
            if t.inflight_samples + n > t.inflight_share:
                return Wait("samples")
            group = t.pop_due_retry()
            t.restart(group)
        else:
            need = t.num_steps * t.prompts_per_step - t.trained - t.taken
            if t.num_live >= math.ceil(t.sampler.over_dispatch * need):
                return Wait("enough")
            if t.num_live >= t.max_buffered_groups:
                return Wait("buffer")
            if t.inflight_samples + n > t.inflight_share:
                return Wait("samples")
            position = t.next_position()
            if position is None:
                return Wait("sampler")
            index, target = position
            prompt, prompt_ids = prompt_of(index)
            group = Group(
                f"{self._prefix}g{index}", prompt.id, prompt_ids, t.generator_version, target, now,
                [None] * n, index=index, prompt_text=prompt.display, prompt=prompt,
            )  # fmt: skip
            t.add(group)
        group.dispatched_at, group.worker = now, ""
        if not self._episodes:  # a group of multi-turn episodes: each turn picks its worker
            group.worker = self._least_loaded(serving)
            self._requests.start(group.group_id, group.group_id, 0, group.n, group.worker,
                                 version=group.start_version, answered=False)  # fmt: skip
        assert group.prompt is not None  # a new group's, or one that was generating
        return Sent(group.group_id, group.worker, group.prompt_ids, group.n, group.prompt)

    def start_turn(
        self, request: str, serving: Sequence[str], previous: str = "", *, group_id: str = "",
        index: int = 0,
    ) -> str | None:
        """Place an answered request (id ``request``): a turn of episode ``index`` of
        ``group_id``, or, with no ``group_id``, an evaluation's prompt (no group waits for it).
        Returns the worker to send it to, charged with it; ``None`` when no worker serves (ask
        again once one does) or the group is no longer generating (being aborted: the episode
        stops). ``previous``: the worker of the episode's last turn, kept while it is at most
        ``STICKY_TURNS`` busier than the least loaded.

        Raises:
            RolloutError: episode ``index`` of ``group_id`` is not running.
        """
        if group_id:
            group = self._table.get(group_id)
            if group is None or group.state != GENERATING:
                return None
            if not 0 <= index < group.n or group.samples[index] is not None:
                raise RolloutError(f"episode {index} of {group_id} is not running")
        if not serving:
            return None
        worker = self._least_loaded(serving)
        if previous in serving and self.load(previous) <= self.load(worker) + STICKY_TURNS:
            worker = previous
        self._requests.start(request, group_id, index, 1, worker,
                             version=self._table.generator_version, answered=True)  # fmt: skip
        return worker

    def _least_loaded(self, serving: Sequence[str]) -> str:
        return min(serving, key=self._requests.owed)

    def abandon_turn(self, request: str) -> str | None:
        """Whoever waits for answered request ``request`` stopped (cancelled): its sample is
        discarded when it comes. Returns the worker to tell to abort it, ``None`` when it is
        not in flight or abandoned already (an abort of its group told the worker)."""
        entry = self._requests.get(request)
        if entry is None or not entry.answered or not self._requests.abandon(request):
            return None
        return entry.worker

    # ------------------------------------------------------------------ arrivals
    def episode_ended(self, group_id: str, index: int, sample: CompletedSample | None) -> Arrival:
        """Multi-turn episode ``index`` of ``group_id`` ended: with its scored ``sample``, or
        with none (cancelled because its group is being aborted). ``COMPLETE`` with the
        group's last: :meth:`commit` it (its samples are scored already); ``DISCARDED`` with
        the last of a group being aborted; else ``PENDING``.

        Raises:
            RolloutError: no such episode running, or no sample from a group still generating.
        """
        group = self._in_flight(group_id)
        if not 0 <= index < group.n or group.samples[index] is not None:
            raise RolloutError(f"episode {index} of {group_id} is not running")
        if sample is None and group.state != ABORTING:
            raise RolloutError(f"episode {index} of {group_id} ended without a sample")
        group.samples[index] = sample if sample is not None else ENDED
        return self._finished_one(group)

    def sample_arrived(self, msg: SampleDone) -> Arrival:
        """Take one sample (complete, or cut short by an abort) from a rollout worker: only
        a sample of a request in flight on that worker, at an index not yet received, and
        well formed is taken; anything else changes nothing. An answered request's sample
        is an ``ANSWER`` (``DISCARDED`` when abandoned); a group's fills its episode's slot."""
        entry = self._requests.get(msg.group_id)
        if entry is None or entry.worker != msg.worker:
            return stranger(msg, on_worker=entry is not None)
        if not entry.answered:
            group = self._table.group(entry.group_id)
            refused = store(group, msg)
            if refused is not None:
                return refused
            self._requests.received(entry)
            return self._finished_one(group)
        if msg.index != 0:
            return stranger(msg, on_worker=True)
        problem = malformed(msg.sample, entry.version)
        if problem:
            return Arrival(ArrivalKind.MALFORMED, detail=problem)
        self._requests.end(entry.request_id)
        if entry.abandoned:
            return _DISCARDED
        return Arrival(ArrivalKind.ANSWER, request=entry, sample=stamped(msg.sample, entry.version))

    def _finished_one(self, group: Group) -> Arrival:
        """One more episode of ``group`` is back: ``PENDING``, ``DISCARDED`` (the last of a
        group being aborted: it is gone) or ``COMPLETE`` (score it)."""
        outcome = self._table.sample_back(group)
        if outcome == "complete":
            return Arrival(ArrivalKind.COMPLETE, group)
        return _PENDING if outcome == "pending" else _DISCARDED

    def check_failure(self, msg: GroupFailed) -> Arrival:
        """Which request a ``GroupFailed`` is about: ``REJECTED`` (a stranger's), or a
        group's ``IN_FLIGHT`` (then call :meth:`failed`); these change nothing. For an answered
        request: ``ANSWER_FAILED`` (tell whoever waits), or ``DISCARDED`` (abandoned); the
        request is gone."""
        entry = self._requests.get(msg.group_id)
        if entry is None or entry.worker != msg.worker:
            return stranger(msg, on_worker=entry is not None)
        if entry.answered:
            self._requests.end(entry.request_id)
            if entry.abandoned:
                return _DISCARDED
            return Arrival(ArrivalKind.ANSWER_FAILED, request=entry)
        group = self._table.group(entry.group_id)
        return Arrival(ArrivalKind.IN_FLIGHT, group, aborting=group.state == ABORTING)

    # ------------------------------------------------------------------ failures
    def failed(self, group_id: str, *, retry: bool) -> dict[str, list[str]]:
        """Generation of ``group_id`` (in flight) failed; its samples still to come never
        will. ``retry``: it waits as RETRYING (still live, keeping its prompt, its place and
        its step) until :meth:`retry`; otherwise it is dropped and counted (a group stamped
        for a step is replaced by a fresh prompt for that step). A group being aborted is
        simply gone. A group of episodes: the turns its episodes still wait for are abandoned
        and returned by worker (tell each to abort them); the caller cancels the episodes,
        which then end unreported."""
        group = self._in_flight(group_id)
        turns: dict[str, list[str]] = {}
        for entry in self._requests.of_group(group_id):
            if not entry.answered:  # the group's own request: gone with what it owed
                self._requests.end(entry.request_id)
            elif self._requests.abandon(entry.request_id):
                turns.setdefault(entry.worker, []).append(entry.request_id)
        t = self._table
        t.samples_lost(group)
        if group.state == ABORTING:
            t.remove(group)
        elif retry:
            t.to_retry(group, failed=True)
        else:
            t.drop(group, "failed")
        return turns

    def retry(self, group_id: str) -> None:
        """A failed group's back-off is over: :meth:`dispatch` sends it again first (one
        aborted or dropped meanwhile is ignored)."""
        self._table.mark_retry_due(group_id)

    def score_failed(self, group_id: str) -> bool:
        """Scoring ``group_id`` failed: drop it (counted as failed). False: the run ended
        while it was scored (it was counted as unused)."""
        group = self._table.get(group_id)
        if group is None or group.state != SCORING:
            return False
        self._table.drop(group, "failed")
        return True

    def worker_lost(self, worker: str) -> Lost:
        """``worker`` died: its groups in flight are dispatched again first (same prompt, same
        step, no back-off, no retry counted: not the group's failure; those being aborted are
        simply gone), and its answered requests are gone (returned: whoever waits asks
        another worker; abandoned ones are simply forgotten)."""
        again, answered = 0, []
        t = self._table
        for entry in self._requests.lose(worker):
            if entry.answered:
                if not entry.abandoned:
                    answered.append(entry)
                continue
            group = t.group(entry.group_id)
            t.samples_lost(group)
            if group.state == ABORTING:
                t.remove(group)  # counted as aborted already
            else:
                t.to_retry(group, failed=False)
                again += 1
        return Lost(again, answered)

    # ------------------------------------------------------------------ commit
    def commit(self, group_id: str, samples: list[Any], now: float) -> bool:
        """``group_id`` is scored (``samples``: its scored samples, in order): it is ready to
        train. False: the run ended while it was scored (counted as unused)."""
        group = self._table.get(group_id)
        if group is None or group.state != SCORING:
            return False
        if len(samples) != group.n:
            raise RolloutError(f"{group_id}: {len(samples)} scored samples for {group.n}")
        group.samples = samples
        group.end_version = self._table.generator_version
        group.committed_at = now
        self._table.ready(group)
        return True

    # ------------------------------------------------------------------ aborts
    def begin_refit(self) -> Aborts:
        """The trainer took a step: the groups in flight that can never be trained at its
        version are aborted; each worker must abort its own (their samples still come back,
        cut short).

        Raises:
            SchedulerError: no step was finished (the gate is open).
        """
        t = self._table
        if t.gate_open:
            raise SchedulerError("begin_refit() without finish_step()")
        hopeless = [
            g for g in t
            if g.state in (GENERATING, RETRYING)
            and t.sampler.should_abort_inflight(g, t.trainer_version)
        ]  # fmt: skip
        return self._abort(hopeless)

    def close(self) -> Aborts:
        """The run is over: every complete but untrained group is counted as unused and
        forgotten, and every group in flight is aborted (returned: tell the workers)."""
        t = self._table
        for group in [g for g in t if g.state in (SCORING, READY)]:
            t.drop(group, "unused")
        return self._abort([g for g in t if g.state in (GENERATING, RETRYING)])

    def _abort(self, groups: list[Group]) -> Aborts:
        by_worker: dict[str, list[str]] = {}
        gone, episodes, turns = [], [], 0
        for group in groups:
            gid = group.group_id
            self._table.abort(group)
            if not self._table.tracks(gid):  # it was waiting for its retry: gone at once
                gone.append(gid)
                continue
            if self._episodes:  # cancel them; their turns' samples still come back
                episodes.append(gid)
            for entry in self._requests.of_group(gid):
                if not entry.answered:  # on an engine: its samples still come back
                    by_worker.setdefault(entry.worker, []).append(gid)
                elif self._requests.abandon(entry.request_id):
                    by_worker.setdefault(entry.worker, []).append(entry.request_id)
                    turns += 1
        return Aborts(by_worker, gone, episodes, turns)

    def _in_flight(self, group_id: str) -> Group:
        group = self._table.get(group_id)
        if group is None or group.state not in _IN_FLIGHT:
            raise RolloutError(f"group {group_id!r} is not in flight")
        return group

    # ------------------------------------------------------------------ invariants
    def problems(self) -> list[str]:
        """Every broken invariant of the rollout phase and of the table (none: ``[]``).
        O(groups): for tests and debugging, not the hot path."""
        t = self._table
        out = t.problems()
        running = set()
        for group in t:
            missing = sum(1 for s in group.samples if s is None)
            if group.state in _IN_FLIGHT:
                if missing != group.n - group.finished:
                    out.append(f"{group.group_id} has {missing} samples missing, "
                               f"{group.n - group.finished} to come")  # fmt: skip
                if self._episodes:
                    running |= {(group.group_id, i)
                                for i, s in enumerate(group.samples) if s is None}  # fmt: skip
                    continue
                entry = self._requests.get(group.group_id)
                if entry is None or entry.to_come != missing:
                    owed = "none" if entry is None else entry.to_come
                    out.append(f"{group.group_id} is in flight with {missing} samples to "
                               f"come; its request owes {owed}")  # fmt: skip
            elif group.state in (SCORING, READY) and missing:
                out.append(f"{group.group_id} is {group.state} with {missing} samples missing")
        owed: Counter[str] = Counter()
        out += self._requests.problems()
        for entry in self._requests:
            if entry.worker not in self._workers:
                out.append(f"request {entry.request_id} is in flight on unknown worker "
                           f"{entry.worker!r}")  # fmt: skip
            owed[entry.worker] += entry.to_come
            if entry.answered and not entry.evaluation and not entry.abandoned:
                if (entry.group_id, entry.index) not in running:
                    out.append(f"request {entry.request_id} belongs to no running episode")
            elif not entry.answered and t.state_of(entry.group_id) not in _IN_FLIGHT:
                out.append(f"request {entry.request_id} is of a group not in flight")
        loads = {w: self.load(w) for w in self._workers}
        if loads != {w: owed[w] for w in self._workers}:
            out.append(f"load per worker {loads}, samples owed {dict(owed)}")
        return out
