"""The rollout book: the one owner of the run's groups between dispatch and the trainer.

:class:`RolloutBook` is pure (no anyio, no sockets): the loops ask it and carry out what it
says. It wraps the :class:`~asyncrl.policy.schedule.Scheduler`, which keeps each group's
state and every scheduling rule (gate, capacities, staleness, accounting), and keeps what the
scheduler does not: each group's payload (a :class:`~asyncrl.policy.groups.Group`: prompt,
samples) and the engine requests in flight (:class:`~asyncrl.run.requests.RequestTable`),
which give each rollout worker's load. Nothing else holds a reference to its tables.

Every group is ``n`` episodes, and one path takes each from dispatch to commit::

    dispatch() ──► GENERATING ──each episode's sample: sample_arrived() / episode_ended()──►
       ▲              │  │ begin_refit()/close(): ABORTING ──its samples back──► gone
       │ retry()      │  │ worker_lost(): dispatched again at once (same prompt)
    RETRYING ◄──failed(retry=True)    failed(retry=False) / score_failed(): dropped
                      └── the last episode: COMPLETE ──► SCORING ──commit()──► READY

    next_chunk(): evicted ──► gone;  taken ──finish_step()──► trained (the trainer's)
                              abort_step(): READY again

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

Invariants, written once in :meth:`problems` (tests/unit/test_book.py and
test_book_episodes.py drive the real class through random schedules and check them after every
action, against a ledger of their own): a payload for exactly the groups the scheduler tracks
(and for the open step's); a single-turn group in flight has its request, owing the samples
still to come; the samples (episodes) still to come add up to the scheduler's samples in
flight, which stay within ``max_inflight_samples``; an episode's request belongs to an episode
still running in a group in flight; each worker's load is what its requests owe; a scored or
ready group has all its samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.policy.groups import CompletedSample, Group
from asyncrl.policy.schedule import Scheduler, StepStats, Wait
from asyncrl.policy.slots import ABORTING, GENERATING, READY, SCORING
from asyncrl.checkpoints import directory as ckpt
from asyncrl.run.arrivals import (
    ENDED,
    STICKY_TURNS,
    Aborts,
    Arrival,
    ArrivalKind,
    BookError,
    Lost,
    Sent,
    Taken,
    malformed,
    stamped,
    store,
    stranger,
)
from asyncrl.run.requests import RequestTable
from asyncrl.wire.messages import GroupFailed, SampleDone

if TYPE_CHECKING:
    from asyncrl.environment import Prompt

__all__ = ["RolloutBook"]

_IN_FLIGHT = (GENERATING, ABORTING)
_PENDING = Arrival(ArrivalKind.PENDING)
_DISCARDED = Arrival(ArrivalKind.DISCARDED)


def _view(name: str, doc: str) -> Any:
    """A read-only property showing the book's scheduler's attribute ``name``."""
    return property(lambda book: getattr(book._sched, name), doc=doc)


class RolloutBook:
    """What is in flight, scored, ready and taken; the load per worker; evaluation requests.

    Args:
        scheduler: a fresh scheduler (the book's from now on: nothing else calls it).
        workers: the rollout workers' identities (their load starts at 0).
        episodes: the run's groups are groups of multi-turn episodes.
    """

    def __init__(
        self, scheduler: Scheduler, workers: Sequence[str], *, episodes: bool = False
    ) -> None:
        self._sched = scheduler
        self._episodes = episodes
        """Whether the run's groups are groups of episodes (a multi-turn environment)."""
        self._requests = RequestTable()
        """The engine requests in flight: groups', episodes' turns, evaluations' prompts."""
        self._workers = tuple(workers)
        self._groups: dict[str, Group] = {}
        """The payload of every group the scheduler tracks, by id, in dispatch order."""
        self._taken: list[Group] = []
        """The open step's groups (the scheduler no longer tracks them; a failed step gives
        them back)."""

    # ------------------------------------------------------------------ views
    # the scheduler's counters, read-only (the book is the scheduler's only caller)
    trainer_version = _view("trainer_version", "Optimizer steps taken.")
    generator_version = _view("generator_version", "The weights' version the generators serve.")
    finished = _view("finished", "The run's last step is trained.")
    drained = _view("drained", "No training sample is being generated.")
    inflight_samples = _view("inflight_samples", "Training samples being generated.")
    max_inflight_samples = _view("max_inflight_samples", "pipeline.max_inflight_samples.")
    max_buffered_groups = _view("max_buffered_groups", "pipeline.max_buffered_groups.")
    num_ready = _view("num_ready", "Groups scored and not yet taken.")
    num_live = _view("num_live", "Groups counted against max_buffered_groups.")
    taken = _view("taken", "Groups in the open step.")
    next_index = _view("next_index", "The next fresh position in the prompt stream.")
    failed_groups = _view("failed_groups", "Groups dropped because they failed for good.")

    def ledger_report(self) -> list[Any]:
        """The prompt ledger per epoch (:meth:`~asyncrl.policy.schedule.Scheduler.ledger_report`)."""
        return self._sched.ledger_report()

    def load(self, worker: str) -> int:
        """Samples still to come from ``worker`` (of groups, turns and evaluations)."""
        return self._requests.owed(worker)

    @property
    def requests_in_flight(self) -> int:
        """Engine requests in flight (groups', episodes' turns, evaluations' prompts)."""
        return len(self._requests)

    # ------------------------------------------------------------------ rollout side
    def dispatch(
        self,
        serving: Sequence[str],
        prompt_of: Callable[[int], tuple[Prompt, list[int]]],
        now: float,
    ) -> Sent | Wait:
        """Dispatch one more group if the scheduler allows it now: a group of single-turn
        episodes as one request to the least loaded of ``serving``, a group of multi-turn
        episodes to no worker (each turn picks its own). A group dispatched again keeps its
        prompt, a new one takes prompt-stream position ``index`` from ``prompt_of(index)``.
        ``Wait("workers")``: none serves."""
        if not serving:
            return Wait("finished" if self._sched.finished else "workers")
        d = self._sched.dispatch()
        if isinstance(d, Wait):
            return d
        before = self._groups.pop(d.group_id, None)  # popped: in flight in dispatch order
        if before is not None:
            assert before.prompt is not None  # only a group that was generating retries
            prompt, prompt_ids = before.prompt, before.prompt_ids
        else:
            prompt, prompt_ids = prompt_of(d.index)
        worker = ""  # a group of multi-turn episodes: each turn picks its worker
        if not self._episodes:
            worker = self._least_loaded(serving)
            self._requests.start(d.group_id, d.group_id, 0, d.n, worker,
                                 version=d.start_version, answered=False)  # fmt: skip
        self._groups[d.group_id] = Group(
            d.group_id, prompt.id, prompt_ids, d.start_version, d.target_step, now, [None] * d.n,
            index=d.index, worker=worker, prompt_text=prompt.display, prompt=prompt,
        )  # fmt: skip
        return Sent(d.group_id, worker, prompt_ids, d.n, prompt)

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
            BookError: episode ``index`` of ``group_id`` is not running.
        """
        if group_id:
            group = self._groups.get(group_id)
            if group is None or self._sched.state_of(group_id) != GENERATING:
                return None
            if not 0 <= index < len(group.samples) or group.samples[index] is not None:
                raise BookError(f"episode {index} of {group_id} is not running")
        if not serving:
            return None
        worker = self._least_loaded(serving)
        if previous in serving and self.load(previous) <= self.load(worker) + STICKY_TURNS:
            worker = previous
        self._requests.start(request, group_id, index, 1, worker,
                             version=self._sched.generator_version, answered=True)  # fmt: skip
        return worker

    def _least_loaded(self, serving: Sequence[str]) -> str:
        return min(serving, key=self._requests.owed)

    def generating(self, group_id: str) -> bool:
        """Whether ``group_id`` is generating (not being aborted, failed or done)."""
        return self._sched.state_of(group_id) == GENERATING

    def abandon_turn(self, request: str) -> str | None:
        """Whoever waits for answered request ``request`` stopped (cancelled): its sample is
        discarded when it comes. Returns the worker to tell to abort it, ``None`` when it is
        not in flight or abandoned already (an abort of its group told the worker)."""
        entry = self._requests.get(request)
        if entry is None or not entry.answered or not self._requests.abandon(request):
            return None
        return entry.worker

    def episode_ended(self, group_id: str, index: int, sample: CompletedSample | None) -> Arrival:
        """Multi-turn episode ``index`` of ``group_id`` ended: with its scored ``sample``, or
        with none (cancelled because its group is being aborted). ``COMPLETE`` with the
        group's last: :meth:`commit` it (its samples are scored already); ``DISCARDED`` with
        the last of a group being aborted; else ``PENDING``.

        Raises:
            BookError: no such episode running, or no sample from a group still generating.
        """
        group = self._in_flight(group_id)
        if not 0 <= index < len(group.samples) or group.samples[index] is not None:
            raise BookError(f"episode {index} of {group_id} is not running")
        if sample is None and self._sched.state_of(group_id) != ABORTING:
            raise BookError(f"episode {index} of {group_id} ended without a sample")
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
            group = self._groups[entry.group_id]
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
        group being aborted: it is gone) or ``COMPLETE``."""
        outcome = self._sched.sample_finished(group.group_id)
        if outcome is None:
            return _PENDING
        if outcome == "discard":
            del self._groups[group.group_id]
            return _DISCARDED
        return Arrival(ArrivalKind.COMPLETE, group)

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
        group = self._groups[entry.group_id]
        aborting = self._sched.state_of(entry.group_id) == ABORTING
        return Arrival(ArrivalKind.IN_FLIGHT, group, aborting=aborting)

    def failed(self, group_id: str, *, retry: bool) -> dict[str, list[str]]:
        """Generation of ``group_id`` (in flight) failed; its samples still to come never
        will. ``retry``: it waits (keeping its prompt) until :meth:`retry`; otherwise it is
        dropped and counted. A group being aborted is simply gone. A group of episodes: the
        turns its episodes still wait for are abandoned and returned by worker (tell each to
        abort them); the caller cancels the episodes, which then end unreported."""
        self._in_flight(group_id)
        turns: dict[str, list[str]] = {}
        for entry in self._requests.of_group(group_id):
            if not entry.answered:  # the group's own request: gone with what it owed
                self._requests.end(entry.request_id)
            elif self._requests.abandon(entry.request_id):
                turns.setdefault(entry.worker, []).append(entry.request_id)
        self._sched.failed(group_id, retry=retry)
        if not self._sched.tracks(group_id):
            del self._groups[group_id]
        return turns

    def retry(self, group_id: str) -> None:
        """A failed group's back-off is over: :meth:`dispatch` sends it again first (one
        aborted or dropped meanwhile is ignored)."""
        self._sched.retry(group_id)

    def retries(self, group_id: str) -> int:
        """Times ``group_id``'s generation failed and was retried (its worker's death is not
        one): what the failure budget decides on."""
        return self._sched.slot(group_id).retries

    def score_failed(self, group_id: str) -> bool:
        """Scoring ``group_id`` failed: drop it (counted as failed). False: the run ended
        while it was scored (it was counted as unused)."""
        if self._sched.state_of(group_id) != SCORING:
            return False
        self._sched.failed(group_id, retry=False)
        del self._groups[group_id]
        return True

    def commit(self, group_id: str, samples: list[Any], now: float) -> bool:
        """``group_id`` is scored (``samples``: its scored samples, in order): it is ready to
        train. False: the run ended while it was scored (counted as unused)."""
        group = self._groups.get(group_id)
        if group is None or self._sched.state_of(group_id) != SCORING:
            return False
        if len(samples) != len(group.samples):
            raise BookError(f"{group_id}: {len(samples)} scored samples for {len(group.samples)}")
        group.samples = samples
        group.end_version = self._sched.generator_version
        group.committed_at = now
        self._sched.committed(group_id, group.rewards)
        return True

    def worker_lost(self, worker: str) -> Lost:
        """``worker`` died: its groups in flight are dispatched again first (same prompt, same
        step, no back-off; those being aborted are simply gone), and its answered requests
        are gone (returned: whoever waits asks another worker; abandoned ones are simply
        forgotten)."""
        again, answered = 0, []
        for entry in self._requests.lose(worker):
            if entry.answered:
                if not entry.abandoned:
                    answered.append(entry)
            elif self._sched.state_of(entry.group_id) == ABORTING:
                self._sched.failed(entry.group_id, retry=False)  # counted as aborted: gone
                del self._groups[entry.group_id]
            else:
                self._sched.requeue(entry.group_id)  # not the group's failure: no retry counted
                again += 1
        return Lost(again, answered)

    # ------------------------------------------------------------------ train side
    def next_chunk(self) -> Taken:
        """Evict what can never train, then hand out the open step's next chunk (may be
        empty: wait for a commit and ask again)."""
        chunk = self._sched.next_chunk()
        for gid in chunk.evicted:
            del self._groups[gid]
        groups = [self._groups.pop(gid) for gid in chunk.groups]
        self._taken += groups
        return Taken(groups, chunk.evicted)

    def abort_step(self) -> int:
        """The open step failed on the trainer (which dropped its gradients): its groups are
        ready again and the step is assembled anew. Returns how many went back."""
        taken = {g.group_id: g for g in self._taken}
        back = self._sched.abort_step()
        for gid in back:
            self._groups[gid] = taken[gid]
        self._taken = []
        return len(back)

    def finish_step(self) -> None:
        """The open step took its optimizer step: its groups are the trainer's, the trainer
        is one version ahead, and nothing is dispatched until :meth:`end_refit`."""
        self._sched.finish_step()
        self._taken = []

    def begin_refit(self) -> Aborts:
        """The groups in flight that can never be trained at the new version: each worker
        must abort its own (their samples still come back, cut short)."""
        return self._aborted(self._sched.begin_refit())

    def end_refit(self) -> StepStats:
        """The generators serve the trainer's version: dispatch goes on. Returns the
        finished step's counters."""
        return self._sched.end_refit()

    def close(self) -> Aborts:
        """The run is over: every group in flight is aborted (returned: tell the workers) and
        every scored or ready one is counted as unused and forgotten."""
        aborts = self._aborted(self._sched.close())
        for gid in [gid for gid in self._groups if not self._sched.tracks(gid)]:
            del self._groups[gid]
        return aborts

    def _aborted(self, group_ids: list[str]) -> Aborts:
        by_worker: dict[str, list[str]] = {}
        gone, episodes, turns = [], [], 0
        for gid in group_ids:
            if not self._sched.tracks(gid):  # it was waiting for its retry: gone at once
                del self._groups[gid]
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
        group = self._groups.get(group_id)
        if group is None or self._sched.state_of(group_id) not in _IN_FLIGHT:
            raise BookError(f"group {group_id!r} is not in flight")
        return group

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> ckpt.ControllerState:
        """The book at a step boundary (no open step, no refit): the scheduler's state (with
        the prompt ledger) and the ready groups' samples, in the scheduler's order."""
        scheduler = self._sched.state_dict()
        return ckpt.ControllerState(
            step=self._sched.trainer_version,
            finished=self._sched.finished,
            scheduler=scheduler,
            groups=[ckpt.SavedGroup.of(self._groups[f"g{g['index']}"]) for g in scheduler["ready"]],
        )

    def restore(self, state: ckpt.ControllerState) -> tuple[int, set[int]]:
        """Load a :meth:`snapshot` into this fresh book (nothing dispatched yet). Returns
        where the prompt stream goes on: the first position to read, and the positions
        before the old frontier to skip (those not dispatched again).

        Raises:
            CheckpointError: the state lists ready groups without their samples.
        """
        if self._groups or self._taken or len(self._requests):
            raise BookError("restore() needs a fresh book")
        payloads = {g.group_id: g for g in state.groups}
        restored = self._sched.load_state_dict(state.scheduler)
        missing = [gid for gid in restored if gid not in payloads]
        if missing or len(payloads) != len(restored):
            raise ckpt.CheckpointError(
                f"the checkpoint of step {state.step} lists ready groups {missing[:5]} without "
                "their samples. Fix: resume from an older checkpoint"
            )
        for gid in restored:
            self._groups[gid] = payloads[gid].group()
        again = {int(i) for i, _ in state.scheduler["redispatch"]}
        frontier = self._sched.next_index
        start = min(again | {frontier})
        return start, set(range(start, frontier)) - again

    # ------------------------------------------------------------------ invariants
    def problems(self) -> list[str]:
        """Every broken invariant of the book (none: ``[]``). O(groups): for tests and
        debugging, not the hot path."""
        states = self._sched.states()
        out = []
        if states.keys() != self._groups.keys():
            odd = sorted(states.keys() ^ self._groups.keys())[:5]
            out.append(f"groups {odd} have a payload without a state, or the reverse")
        if len(self._taken) != self._sched.taken:
            out.append(f"{len(self._taken)} payloads for the {self._sched.taken} groups taken")
        to_come, running = 0, set()
        for gid, group in self._groups.items():
            state, missing = states.get(gid), sum(1 for s in group.samples if s is None)
            if state in _IN_FLIGHT:
                to_come += missing
                if self._episodes:
                    running |= {(gid, i) for i, s in enumerate(group.samples) if s is None}
                    continue
                entry = self._requests.get(gid)
                if entry is None or entry.to_come != missing:
                    owed = "none" if entry is None else entry.to_come
                    out.append(f"{gid} is in flight with {missing} samples to come; its "
                               f"request owes {owed}")  # fmt: skip
            elif state in (SCORING, READY) and missing:
                out.append(f"{gid} is {state} with {missing} samples missing")
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
            elif not entry.answered and states.get(entry.group_id) not in _IN_FLIGHT:
                out.append(f"request {entry.request_id} is of a group not in flight")
        loads = {w: self.load(w) for w in self._workers}
        if loads != {w: owed[w] for w in self._workers}:
            out.append(f"load per worker {loads}, samples owed {dict(owed)}")
        if to_come != self._sched.inflight_samples:
            out.append(f"{to_come} samples to come, the scheduler has "
                       f"{self._sched.inflight_samples} samples in flight")  # fmt: skip
        if self._sched.inflight_samples > self._sched.max_inflight_samples:
            out.append(f"{self._sched.inflight_samples} samples in flight, above the cap")
        return out
