"""The rollout book: the one owner of the run's groups between dispatch and the trainer.

:class:`RolloutBook` is pure (no anyio, no sockets): the loops ask it and carry out what it
says. It wraps the :class:`~asyncrl.policy.schedule.Scheduler`, which keeps each group's
state and every scheduling rule (gate, capacities, staleness, accounting), and keeps what the
scheduler does not: each group's payload (a :class:`~asyncrl.policy.groups.Group`: prompt,
worker, samples), the samples in flight per rollout worker, and the evaluation requests.
Nothing else holds a reference to its tables.

Life of a group in the book (the scheduler's states in capitals)::

    dispatch() ──► GENERATING on a worker ──sample_arrived() × n──► SCORING ──commit()──► READY
       ▲              │  │ begin_refit()/close(): ABORTING ──samples back──► gone         │
       │ retry()      │  │ worker_lost(): dispatched again at once (same prompt)          │
    RETRYING ◄──failed(retry=True)    failed(retry=False) / score_failed(): dropped       │
                                                                                          │
    next_chunk(): evicted ──► gone;  taken ──finish_step()──► trained (the trainer's) ◄───┘
                              abort_step(): READY again

A multi-turn environment's group is ``n`` *episodes* (:mod:`asyncrl.run.episodes`), bound to no
worker: each turn is one request (:meth:`start_turn`) on the least loaded worker, or the one of
the episode's last turn while not much busier (its prefix cache); the turns in flight are the
book's :class:`~asyncrl.run.turns.TurnTable`. A turn's sample comes back as ``TURN``; an ended
episode's scored sample goes to :meth:`episode_ended`. Aborting such a group lists its turns
under their workers and the group under ``Aborts.episodes`` (its episodes are cancelled).

Evaluation groups (``eval-<label>-<i>``) are not the scheduler's: :meth:`add_evals` queues
them, :meth:`place_evals` spreads them over the workers that serve, their samples come back
through :meth:`sample_arrived` like any other, and a worker lost sends them back to the queue.

Invariants, written once in :meth:`problems` (tests/unit/test_book.py drives the real class
through random schedules and checks them after every action, against a ledger of its own):
a payload for exactly the groups the scheduler tracks (and for the open step's); the load of
each worker equals the samples still to come of the groups in flight on it plus its turns in
flight; the samples (episodes) still to come add up to the scheduler's samples in flight,
which stay within ``max_inflight_samples``; a turn belongs to an episode still running in a
group in flight; a scored or ready group has all its samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
from asyncrl.run.turns import TurnRequest, TurnTable
from asyncrl.wire.messages import GroupFailed, SampleDone

if TYPE_CHECKING:
    from asyncrl.environment import Prompt

__all__ = ["RolloutBook"]

_IN_FLIGHT = (GENERATING, ABORTING)
_PENDING = Arrival(ArrivalKind.PENDING)
_EVAL_PENDING = Arrival(ArrivalKind.EVAL_PENDING)
_DISCARDED = Arrival(ArrivalKind.DISCARDED)


def _view(name: str, doc: str) -> Any:
    """A read-only property showing the book's scheduler's attribute ``name``."""
    return property(lambda book: getattr(book._sched, name), doc=doc)


class RolloutBook:
    """What is in flight, scored, ready and taken; the load per worker; evaluation requests.

    Args:
        scheduler: a fresh scheduler (the book's from now on: nothing else calls it).
        workers: the rollout workers' identities (their load starts at 0).
    """

    def __init__(
        self, scheduler: Scheduler, workers: Sequence[str], *, episodes: bool = False
    ) -> None:
        self._sched = scheduler
        self._episodes = episodes
        """Whether the run's groups are groups of episodes (a multi-turn environment)."""
        self._turns = TurnTable()
        """The episodes' turns in flight (counted in ``_load`` too)."""
        self._groups: dict[str, Group] = {}
        """The payload of every group the scheduler tracks, by id, in dispatch order."""
        self._taken: list[Group] = []
        """The open step's groups (the scheduler no longer tracks them; a failed step gives
        them back)."""
        self._load = dict.fromkeys(workers, 0)
        """Samples still to come and turns in flight per rollout worker (dispatch goes to the
        least loaded)."""
        self._evals: dict[str, Group] = {}
        """Evaluation groups on a worker, by id."""
        self._evals_waiting: list[Group] = []
        """Evaluation groups waiting for a worker that serves."""

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
        """Samples still to come from ``worker``, and its turns in flight."""
        return self._load[worker]

    @property
    def turns_in_flight(self) -> int:
        """Episodes' turns being generated."""
        return len(self._turns)

    # ------------------------------------------------------------------ rollout side
    def dispatch(
        self,
        serving: Sequence[str],
        prompt_of: Callable[[int], tuple[Prompt, list[int]]],
        now: float,
    ) -> Sent | Wait:
        """Dispatch one more group if the scheduler allows it now, to the least loaded of
        ``serving``: a group dispatched again keeps its prompt, a new one takes prompt-stream
        position ``index`` from ``prompt_of(index)``. ``Wait("workers")``: none serves."""
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
        worker = ""  # a group of episodes: each turn picks its worker
        if not self._episodes:
            worker = min(serving, key=self._load.__getitem__)
            self._load[worker] += d.n
        self._groups[d.group_id] = Group(
            d.group_id, prompt.id, prompt_ids, d.start_version, d.target_step, now, [None] * d.n,
            index=d.index, worker=worker, prompt_text=prompt.display, prompt=prompt,
        )  # fmt: skip
        return Sent(d.group_id, worker, prompt_ids, d.n, prompt)

    def start_turn(
        self, turn: str, group_id: str, index: int, serving: Sequence[str], previous: str = ""
    ) -> str | None:
        """Episode ``index`` of ``group_id`` asks for a turn (request id ``turn``): the worker
        to send it to, charged with it, or ``None`` when the group is no longer generating
        (being aborted: the episode stops) or no worker serves (ask again once one does).
        ``previous``: the worker of the episode's last turn, kept while it is at most
        ``STICKY_TURNS`` busier than the least loaded."""
        group = self._groups.get(group_id)
        if group is None or self._sched.state_of(group_id) != GENERATING or not serving:
            return None
        if not 0 <= index < len(group.samples) or group.samples[index] is not None:
            raise BookError(f"episode {index} of {group_id} is not running")
        return self._place_turn(turn, group_id, index, serving, previous, evaluation=False)

    def start_eval_turn(
        self, turn: str, episode: str, serving: Sequence[str], previous: str = ""
    ) -> str | None:
        """A turn of evaluation episode ``episode`` (not the scheduler's: its evaluation
        waits for it), placed as :meth:`start_turn` places one; ``None`` while no worker
        serves."""
        if not serving:
            return None
        return self._place_turn(turn, episode, 0, serving, previous, evaluation=True)

    def _place_turn(
        self, turn: str, group_id: str, index: int, serving: Sequence[str], previous: str,
        *, evaluation: bool,
    ) -> str:
        worker = min(serving, key=self._load.__getitem__)
        if previous in serving and self._load[previous] <= self._load[worker] + STICKY_TURNS:
            worker = previous
        version = self._sched.generator_version
        self._turns.start(turn, group_id, index, worker, version=version, evaluation=evaluation)
        self._load[worker] += 1
        return worker

    def generating(self, group_id: str) -> bool:
        """Whether ``group_id`` is generating (not being aborted, failed or done)."""
        return self._sched.state_of(group_id) == GENERATING

    def abandon_turn(self, turn: str) -> str | None:
        """The episode waiting for ``turn`` stopped (cancelled): its sample is discarded when it
        comes. Returns the worker to tell to abort it, ``None`` when it is not in flight or
        abandoned already (an abort of its group told the worker)."""
        entry = self._turns.get(turn)
        if entry is None or not self._turns.abandon(turn):
            return None
        return entry.worker

    def episode_ended(self, group_id: str, index: int, sample: CompletedSample | None) -> Arrival:
        """Episode ``index`` of ``group_id`` ended: with its scored ``sample``, or with none
        (cancelled because its group is being aborted). ``COMPLETE`` with the group's last:
        :meth:`commit` it (its samples are scored already); ``DISCARDED`` with the last of a
        group being aborted; else ``PENDING``.

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
        """Take one sample (complete, or cut short by an abort) from a rollout worker. Only
        a sample of a group in flight on that worker, at an index not yet received, and well
        formed is taken; anything else changes nothing."""
        gid = msg.group_id
        if gid in self._turns:
            return self._turn_sample(msg)
        group = self._groups.get(gid)
        if group is None or self._sched.state_of(gid) not in _IN_FLIGHT:
            return self._eval_sample(msg)
        if group.worker != msg.worker:
            return stranger(msg, on_worker=True)
        refused = store(group, msg)
        if refused is not None:
            return refused
        self._load[group.worker] -= 1
        return self._finished_one(group)

    def _finished_one(self, group: Group) -> Arrival:
        """One more sample (or episode) of ``group`` is back: ``PENDING``, ``DISCARDED`` (the
        last of a group being aborted: it is gone) or ``COMPLETE``."""
        outcome = self._sched.sample_finished(group.group_id)
        if outcome is None:
            return _PENDING
        if outcome == "discard":
            del self._groups[group.group_id]
            return _DISCARDED
        return Arrival(ArrivalKind.COMPLETE, group)

    def _turn_sample(self, msg: SampleDone) -> Arrival:
        entry = self._turns.get(msg.group_id)
        assert entry is not None
        if entry.worker != msg.worker or msg.index != 0:
            return stranger(msg, on_worker=True)
        problem = malformed(msg.sample, entry.version)
        if problem:
            return Arrival(ArrivalKind.MALFORMED, detail=problem)
        self._end_turn(entry)
        if entry.abandoned:
            return _DISCARDED
        return Arrival(ArrivalKind.TURN, turn=entry, sample=stamped(msg.sample, entry.version))

    def _end_turn(self, entry: TurnRequest) -> None:
        self._turns.end(entry.turn_id)
        self._load[entry.worker] -= 1

    def _eval_sample(self, msg: SampleDone) -> Arrival:
        group = self._evals.get(msg.group_id)
        if group is None or group.worker != msg.worker:
            return stranger(msg, on_worker=group is not None)
        refused = store(group, msg)
        if refused is not None:
            return refused
        if any(s is None for s in group.samples):
            return _EVAL_PENDING
        del self._evals[msg.group_id]
        return Arrival(ArrivalKind.EVAL_COMPLETE, group)

    def check_failure(self, msg: GroupFailed) -> Arrival:
        """Which group a ``GroupFailed`` is about: ``REJECTED`` (a stranger's),
        ``EVALUATION``, or ``IN_FLIGHT`` (then call :meth:`failed`); these change nothing. For
        an episode's turn: ``TURN_FAILED`` (tell its episode), or ``DISCARDED`` (abandoned);
        the turn is gone."""
        gid = msg.group_id
        turn = self._turns.get(gid)
        if turn is not None:  # an episode's turn: it is gone
            if turn.worker != msg.worker:
                return stranger(msg, on_worker=True)
            self._end_turn(turn)
            return _DISCARDED if turn.abandoned else Arrival(ArrivalKind.TURN_FAILED, turn=turn)
        group = self._groups.get(gid)
        state = self._sched.state_of(gid)
        if group is not None and state in _IN_FLIGHT:
            if group.worker != msg.worker:
                return stranger(msg, on_worker=True)
            return Arrival(ArrivalKind.IN_FLIGHT, group, aborting=state == ABORTING)
        group = self._evals.get(gid)
        if group is None or group.worker != msg.worker:
            return stranger(msg, on_worker=group is not None)
        return Arrival(ArrivalKind.EVALUATION, group)

    def failed(self, group_id: str, *, retry: bool) -> dict[str, list[str]]:
        """Generation of ``group_id`` (in flight) failed; its samples still to come never
        will. ``retry``: it waits (keeping its prompt) until :meth:`retry`; otherwise it is
        dropped and counted. A group being aborted is simply gone. A group of episodes: the
        turns its episodes still wait for are abandoned and returned by worker (tell each to
        abort them); the caller cancels the episodes, which then end unreported."""
        group = self._in_flight(group_id)
        turns: dict[str, list[str]] = {}
        if group.worker:
            self._load[group.worker] -= sum(1 for s in group.samples if s is None)
        for turn in self._turns.of_group(group_id):
            if self._turns.abandon(turn.turn_id):
                turns.setdefault(turn.worker, []).append(turn.turn_id)
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
        """``worker`` died: its training groups are dispatched again first (same prompt, same
        step, no back-off; those being aborted are simply gone), its evaluation groups
        wait for a worker that serves, and the episodes' turns on it are gone (their
        episodes ask another worker; abandoned ones are simply forgotten)."""
        again = 0
        for gid, group in list(self._groups.items()):
            state = self._sched.state_of(gid)
            if group.worker != worker or state not in _IN_FLIGHT:
                continue
            if state == ABORTING:
                self._sched.failed(gid, retry=False)  # already counted as aborted: gone
                del self._groups[gid]
            else:
                self._sched.requeue(gid)  # not a failure of the group: no retry counted
                again += 1
        lost = [g for g in self._evals.values() if g.worker == worker]
        for group in lost:
            del self._evals[group.group_id]
            group.samples, group.worker = [None] * len(group.samples), ""
        self._evals_waiting += lost
        turns = [t for t in self._turns.lose(worker) if not t.abandoned]
        self._load[worker] = 0
        return Lost(again, len(lost), turns)

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
            elif self._groups[gid].worker:  # on an engine: its samples still come back
                by_worker.setdefault(self._groups[gid].worker, []).append(gid)
            else:  # episodes: cancel them; their turns' samples still come back
                episodes.append(gid)
                for turn in self._turns.of_group(gid):
                    if self._turns.abandon(turn.turn_id):
                        by_worker.setdefault(turn.worker, []).append(turn.turn_id)
                        turns += 1
        return Aborts(by_worker, gone, episodes, turns)

    def _in_flight(self, group_id: str) -> Group:
        group = self._groups.get(group_id)
        if group is None or self._sched.state_of(group_id) not in _IN_FLIGHT:
            raise BookError(f"group {group_id!r} is not in flight")
        return group

    # ------------------------------------------------------------------ evaluation
    def add_evals(
        self,
        label: str,
        prompts: Sequence[tuple[Prompt, list[int]]],
        version: int,
        now: float,
    ) -> list[str]:
        """Queue one greedy sample of each of ``prompts`` (group ids ``eval-<label>-<i>``)
        for :meth:`place_evals`; returns their ids."""
        groups = [
            Group(f"eval-{label}-{i}", prompt.id, ids, version, None, now, [None],
                  index=i, prompt_text=prompt.display, prompt=prompt)
            for i, (prompt, ids) in enumerate(prompts)
        ]  # fmt: skip
        queued = set(self._evals) | {g.group_id for g in self._evals_waiting}
        if groups and groups[0].group_id in queued:
            raise BookError(f"an evaluation labelled {label!r} is already running")
        self._evals_waiting += groups
        return [g.group_id for g in groups]

    def place_evals(self, serving: Sequence[str]) -> dict[str, list[Sent]]:
        """Spread the waiting evaluation groups over ``serving`` (none: they keep waiting);
        returns what to request from each worker."""
        placed: dict[str, list[Sent]] = {}
        if not serving:
            return placed
        for i, group in enumerate(self._evals_waiting):
            group.worker = serving[i % len(serving)]
            self._evals[group.group_id] = group
            sent = Sent(group.group_id, group.worker, group.prompt_ids, len(group.samples))
            placed.setdefault(group.worker, []).append(sent)
        self._evals_waiting = []
        return placed

    def drop_evals(self, group_ids: Iterable[str]) -> None:
        """Forget these evaluation groups (done, or their evaluation was abandoned): a
        sample of theirs that still comes is a stranger's."""
        ids = set(group_ids)
        for gid in ids:
            self._evals.pop(gid, None)
        self._evals_waiting = [g for g in self._evals_waiting if g.group_id not in ids]

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
        if self._groups or self._taken or self._evals or self._evals_waiting:
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
        load = dict.fromkeys(self._load, 0)
        to_come, running = 0, set()
        for gid, group in self._groups.items():
            state, missing = states.get(gid), sum(1 for s in group.samples if s is None)
            if state in _IN_FLIGHT:
                to_come += missing
                if not group.worker:  # episodes: their turns are counted below
                    running |= {(gid, i) for i, s in enumerate(group.samples) if s is None}
                elif group.worker not in load:
                    out.append(f"{gid} is in flight on unknown worker {group.worker!r}")
                else:
                    load[group.worker] += missing
            elif state in (SCORING, READY) and missing:
                out.append(f"{gid} is {state} with {missing} samples missing")
        for turn in self._turns:
            if turn.worker not in load:
                out.append(f"turn {turn.turn_id} is in flight on unknown worker {turn.worker!r}")
                continue
            load[turn.worker] += 1
            if turn.evaluation:
                continue
            if not turn.abandoned and (turn.group_id, turn.index) not in running:
                out.append(f"turn {turn.turn_id} belongs to no running episode")
        if load != self._load:
            out.append(f"load per worker {self._load}, samples and turns to come {load}")
        if to_come != self._sched.inflight_samples:
            out.append(f"{to_come} samples to come, the scheduler has "
                       f"{self._sched.inflight_samples} samples in flight")  # fmt: skip
        if self._sched.inflight_samples > self._sched.max_inflight_samples:
            out.append(f"{self._sched.inflight_samples} samples in flight, above the cap")
        strays = [g.group_id for g in self._evals.values() if g.worker not in self._load]
        if strays:
            out.append(f"evaluation groups {strays[:5]} on unknown workers")
        return out

