"""The run's scheduling state and every rule about it, in one pure class.

:class:`Scheduler` is synchronous and does no I/O (no anyio, no torch, no sockets): the
controller's pumps feed it events and carry out its decisions. A sampler
(:mod:`asyncrl.policy.samplers`) chooses; the scheduler owns the state and checks each invariant, once,
here:

* capacity: live groups (generating or ready, not yet trained) ``<= max_buffered_groups``;
  samples generating ``<= max_inflight_samples``;
* the rollout gate: nothing is dispatched between a finished optimizer step and the end of its
  refit, so a group's ``start_version`` is the version the generators really serve;
* the staleness bound: no group is trained more than ``sampler.max_staleness`` versions after
  the version it started on;
* accounting: every dispatched group ends exactly once as trained, evicted (ready but too
  old), aborted (generating and hopeless, or still generating at the end) or unused (complete
  but untrained at the end), and its samples are counted: each event once, in the open
  step's :class:`StepStats` (handed out by :meth:`Scheduler.end_refit`); the run's totals
  (:attr:`Scheduler.totals`) are the sum of the ended steps' counts and the open step's;
* a step trains exactly ``prompts_per_step`` groups;
* dynamic sampling (optional): a ready group whose rewards' spread is at most
  ``filter_min_std`` is dropped instead of trained (the step's quota keeps filling), at most
  ``filter_max_drops`` a step;
* the prompt ledger (:class:`~asyncrl.policy.ledger.PromptLedger`) records each prompt-stream
  position once, as trained or as dropped with its reason.

Life of a group::

    dispatch() ──► GENERATING ──sample_finished() × n──► SCORING ──committed()──► READY
       ▲             │      │ begin_refit(): hopeless                           │
       │ retry()     │      ▼                                                   │
    RETRYING ◄──failed()  ABORTING ──sample_finished() × rest──► gone (aborted) │
                     │                                                          │
                     └─ failed(retry=False): gone (failed; a stamped step       │
                        gets a fresh prompt)                                    │
    next_chunk(): taken → trained at finish_step() (abort_step(): READY again) ◄┤
    next_chunk(): evicted → gone ◄──────────────────────────────────────────────┘

A group whose worker died goes from GENERATING back to RETRYING by :meth:`requeue`, due at
once: not a failure of its own (no retry counted).

Events: :meth:`dispatch` (ask to dispatch one group), :meth:`sample_finished`,
:meth:`committed`, :meth:`failed`, :meth:`retry`, :meth:`requeue`, :meth:`next_chunk`
(evictions + a chunk for the open step), :meth:`abort_step`, :meth:`finish_step`,
:meth:`begin_refit`, :meth:`end_refit`, :meth:`close`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from asyncrl.policy.ledger import PromptLedger
from asyncrl.policy.samplers import Sampler
from asyncrl.policy.slots import (
    ABORTING,
    GENERATING,
    READY,
    RETRYING,
    SCORING,
    Chunk,
    Counts,
    Dispatch,
    SchedulerError,
    Slot,
    StepStats,
    Wait,
)

__all__ = [
    "Chunk",
    "Counts",
    "Dispatch",
    "SchedulerError",
    "Scheduler",
    "Slot",
    "StepStats",
    "Wait",
]


def _total(counter: str, doc: str) -> Any:
    """A read-only property: the run's total of the :class:`Counts` field ``counter`` (the
    ended steps' and the open step's), under the name callers have always read."""
    return property(lambda s: getattr(s._ended, counter) + getattr(s.stats, counter), doc=doc)


class Scheduler:
    """Versions, gate, capacity, step assembly, aborts and accounting for one run.

    Args:
        sampler: the staleness policy.
        prompts_per_step: P, groups per optimizer step.
        samples_per_prompt: N, samples per group.
        num_steps: optimizer steps in the run.
        max_buffered_groups: live groups allowed (``>= sampler.required_buffer_capacity(P)``).
        max_inflight_samples: samples generating at once (``>= N``).
        min_chunk_groups: ready groups needed before a chunk goes to the trainer (``1..P``).
        prompts_per_epoch: positions of the prompt stream per epoch (for the ledger's report).
        filter_min_std: dynamic sampling: drop a ready group whose rewards' population std
            is at most this (``None``: off).
        filter_max_drops: dynamic sampling's cap on the groups one step drops.
    """

    def __init__(
        self,
        sampler: Sampler,
        *,
        prompts_per_step: int,
        samples_per_prompt: int,
        num_steps: int,
        max_buffered_groups: int,
        max_inflight_samples: int,
        min_chunk_groups: int,
        prompts_per_epoch: int = 1,
        filter_min_std: float | None = None,
        filter_max_drops: int = 0,
    ) -> None:
        need = sampler.required_buffer_capacity(prompts_per_step)
        if max_buffered_groups < need:
            raise SchedulerError(
                f"max_buffered_groups={max_buffered_groups} is below the {sampler.name} "
                f"sampler's required capacity {need}"
            )
        if max_inflight_samples < samples_per_prompt:
            raise SchedulerError(
                f"max_inflight_samples={max_inflight_samples} cannot hold one group "
                f"({samples_per_prompt} samples)"
            )
        if not 1 <= min_chunk_groups <= prompts_per_step:
            raise SchedulerError(f"min_chunk_groups must be in 1..{prompts_per_step}")
        self.sampler = sampler
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.num_steps = num_steps
        self.max_buffered_groups = max_buffered_groups
        self.max_inflight_samples = max_inflight_samples
        self.min_chunk_groups = min_chunk_groups
        self.filter_min_std = filter_min_std
        self.filter_max_drops = filter_max_drops

        self.trainer_version = 0
        self.generator_version = 0
        self.gate_open = True
        self.taken = 0
        """Groups in the open step (step ``trainer_version``)."""
        self.inflight_samples = 0
        self._slots: dict[str, Slot] = {}  # dispatch order
        self._live_count = 0  # slots not ABORTING
        self.start_version_counts: Counter[int] = Counter()
        """Live groups per start version (kept for samplers)."""
        self._ready_seq = 0
        self._next_index = 0
        self._redispatch: list[tuple[int, int | None]] = []
        """Prompt indices (and target steps) to dispatch again first (after a resume)."""
        self.stats = StepStats()
        """The open step's counters: where every event is counted (:meth:`end_refit` hands
        them out and starts new ones)."""
        self._ended = Counts()
        """The counts of every step :meth:`end_refit` ended, and a resumed checkpoint's
        totals: the run's totals but the open step's (:attr:`totals`)."""
        self.ledger = PromptLedger(prompts_per_epoch)
        self._taken: list[Slot] = []
        """The open step's groups (given back to READY by :meth:`abort_step`)."""
        self._retry: list[str] = []
        """RETRYING groups whose retry is due, in order (served first by :meth:`dispatch`)."""
    # ------------------------------------------------------------------ views
    @property
    def live(self) -> list[Slot]:
        """Untrained groups counted against capacity, in dispatch order."""
        return [s for s in self._slots.values() if s.state != ABORTING]

    @property
    def num_live(self) -> int:
        return self._live_count

    @property
    def num_ready(self) -> int:
        return sum(1 for s in self._slots.values() if s.state == READY)

    @property
    def next_index(self) -> int:
        """The next fresh position in the prompt stream."""
        return self._next_index

    @property
    def finished(self) -> bool:
        return self.trainer_version >= self.num_steps

    @property
    def drained(self) -> bool:
        """No sample is being generated."""
        return self.inflight_samples == 0

    # the run's totals: the ended steps' counts and the open step's, never counted apart
    @property
    def totals(self) -> Counts:
        """The run's counts so far: every ended step's (and a resumed checkpoint's) plus the
        open step's."""
        return self._ended + self.stats

    dispatched = _total("dispatched_groups", "Groups dispatched (a retry is not counted again).")
    trained = _total("trained_groups", "Groups trained.")
    evicted = _total("evicted_groups", "Ready groups the sampler dropped as too old.")
    filtered = _total("filtered_groups", "Ready groups dynamic sampling dropped.")
    aborted = _total("aborted_groups", "Generating groups aborted.")
    unused = _total("unused_groups", "Complete groups left untrained at the end (close()).")
    failed_groups = _total("failed_groups", "Groups that failed for good.")
    wasted_samples = _total("wasted_samples", "Samples of the groups that left untrained.")

    def ledger_report(self) -> list[Any]:
        """The prompt ledger per epoch (:meth:`PromptLedger.report`), with the positions still
        in play as live."""
        return self.ledger.report(self._next_index, self.redispatch_indices())

    def redispatch_indices(self) -> list[int]:
        """Prompt-stream positions still in play: live groups and those waiting to be
        dispatched again after a resume."""
        return [s.index for s in self.live] + [i for i, _ in self._redispatch]

    def slot(self, group_id: str) -> Slot:
        try:
            return self._slots[group_id]
        except KeyError:
            raise SchedulerError(f"unknown group {group_id!r}") from None

    def state_of(self, group_id: str) -> str | None:
        """``group_id``'s state (``None``: not tracked), without raising: the hot path's
        question for each sample that arrives."""
        slot = self._slots.get(group_id)
        return None if slot is None else slot.state

    def states(self) -> dict[str, str]:
        """Every tracked group's state, by id in dispatch order (for consistency checks)."""
        return {gid: s.state for gid, s in self._slots.items()}

    def aborting(self, group_id: str) -> bool:
        """Whether ``group_id`` is being aborted (already counted; its samples still come)."""
        return self.slot(group_id).state == ABORTING

    def tracks(self, group_id: str) -> bool:
        return group_id in self._slots

    # ------------------------------------------------------------------ rollout side
    def dispatch(self) -> Dispatch | Wait:
        """Dispatch one more group if every rule allows it now (and record it)."""
        if self.finished:
            return Wait("finished")
        if not self.gate_open:
            return Wait("gate")
        if self._retry:
            # already live and admitted: only the samples in flight may hold it back
            if self.inflight_samples + self.samples_per_prompt > self.max_inflight_samples:
                return Wait("samples")
            return self._redispatch_retry(self.slot(self._retry.pop(0)))
        need = self.num_steps * self.prompts_per_step - self.trained - self.taken
        if self._live_count >= math.ceil(self.sampler.over_dispatch * need):
            return Wait("enough")
        if self._live_count >= self.max_buffered_groups:
            return Wait("buffer")
        n = self.samples_per_prompt
        if self.inflight_samples + n > self.max_inflight_samples:
            return Wait("samples")
        if self._redispatch and self._redispatch[0][1] is not None:
            # a stamped group admitted before the resume keeps its step (no new admission)
            index, target = self._redispatch.pop(0)
        else:
            ok, target = self.sampler.admit(self)
            if not ok:
                return Wait("sampler")
            if self._redispatch:
                index, _ = self._redispatch.pop(0)
            else:
                index = self._next_index
                self._next_index += 1
        if target is not None and target < self.trainer_version:
            raise SchedulerError(f"{self.sampler.name} admitted a group for past step {target}")
        slot = Slot(f"g{index}", index, self.generator_version, target, n)
        if slot.group_id in self._slots:
            raise SchedulerError(f"group {slot.group_id} is already live")
        self._slots[slot.group_id] = slot
        self._live_count += 1
        self.start_version_counts[slot.start_version] += 1
        self.inflight_samples += n
        self.stats.inflight_samples_max = max(
            self.stats.inflight_samples_max, self.inflight_samples
        )
        self.stats.dispatched_groups += 1
        return Dispatch(slot.group_id, index, slot.start_version, target, n)

    def sample_finished(self, group_id: str) -> str | None:
        """One sample of ``group_id`` came back (complete, or cut short by an abort).

        Returns ``"commit"`` when it was the group's last sample (score it, then
        :meth:`committed`), ``"discard"`` when the group was being aborted and is now gone,
        else ``None``.
        """
        slot = self.slot(group_id)
        if slot.state not in (GENERATING, ABORTING):
            raise SchedulerError(f"group {group_id} got a sample in state {slot.state}")
        if slot.finished >= slot.n:
            raise SchedulerError(f"group {group_id} got more than {slot.n} samples")
        slot.finished += 1
        self.inflight_samples -= 1
        if slot.finished < slot.n:
            return None
        if slot.state == ABORTING:
            del self._slots[group_id]
            return "discard"
        slot.state = SCORING
        return "commit"

    def failed(self, group_id: str, *, retry: bool) -> None:
        """Generation (or scoring) of ``group_id`` failed; its samples not yet back never
        come. ``retry``: the group waits as RETRYING (still live, keeping its place and
        its step) until :meth:`retry`; otherwise it is dropped and counted (``failed``), and
        a group stamped for a step is replaced by a fresh prompt for that step, dispatched
        first. A group being aborted is simply gone (already counted as aborted)."""
        slot = self.slot(group_id)
        if slot.state not in (GENERATING, SCORING, ABORTING):
            raise SchedulerError(f"group {group_id} failed in state {slot.state}")
        if slot.state != SCORING:
            self.inflight_samples -= slot.n - slot.finished
        if slot.state == ABORTING:
            del self._slots[group_id]
            return
        if retry and slot.state == GENERATING:
            slot.state, slot.finished = RETRYING, 0
            slot.retries += 1
            self.stats.generation_retries += 1
            return
        self._drop(slot, "failed")
        self.stats.failed_groups += 1
        self._replace_stamped(slot)

    def retry(self, group_id: str) -> None:
        """A RETRYING group's back-off is over: :meth:`dispatch` sends it again first (a
        group dropped meanwhile, e.g. at the end of the run, is ignored)."""
        if self.tracks(group_id) and self.slot(group_id).state == RETRYING:
            self._retry.append(group_id)

    def requeue(self, group_id: str) -> None:
        """``group_id`` (generating) was lost with its worker: its samples not yet back never
        come, and :meth:`dispatch` sends it again first (same prompt, same step). Not a
        failure of the group: no retry is counted (``StepStats.generation_retries``)."""
        slot = self.slot(group_id)
        if slot.state != GENERATING:
            raise SchedulerError(f"group {group_id} requeued in state {slot.state}")
        self.inflight_samples -= slot.n - slot.finished
        slot.state, slot.finished = RETRYING, 0
        self._retry.append(group_id)

    def _redispatch_retry(self, slot: Slot) -> Dispatch:
        self._count_start(slot.start_version, -1)
        slot.start_version = self.generator_version
        self._count_start(slot.start_version, +1)
        slot.state = GENERATING
        self.inflight_samples += slot.n
        self.stats.inflight_samples_max = max(
            self.stats.inflight_samples_max, self.inflight_samples
        )
        return Dispatch(slot.group_id, slot.index, slot.start_version, slot.target_step, slot.n)

    def committed(self, group_id: str, rewards: Sequence[float] = ()) -> None:
        """The group's samples are scored: it is ready to train. ``rewards`` is kept as given,
        not copied (the rollout book hands a view of the scored samples' rewards)."""
        slot = self.slot(group_id)
        if slot.state != SCORING:
            raise SchedulerError(f"group {group_id} committed in state {slot.state}")
        slot.state = READY
        slot.ready_seq = self._ready_seq
        slot.rewards = rewards
        self._ready_seq += 1

    # ------------------------------------------------------------------ train side
    def next_chunk(self) -> Chunk:
        """Evict what can never train, then choose the open step's next chunk (may be
        empty: wait for a commit and ask again)."""
        if self.finished:
            raise SchedulerError("the run is finished; there is no step to assemble")
        if not self.gate_open:
            raise SchedulerError("a step is assembled only once the previous refit is done")
        evicted = self._filter_uniform()
        for g in self.sampler.evict(self):
            slot = self.slot(g.group_id)
            if slot.state != READY:
                raise SchedulerError(f"{self.sampler.name} evicted {slot.group_id} ({slot.state})")
            self._drop(slot, "evicted")
            self.stats.evicted_groups += 1
            evicted.append(slot.group_id)
        remaining = self.prompts_per_step - self.taken
        chosen = self.sampler.select(self, min(self.min_chunk_groups, remaining), remaining)
        if chosen and not min(self.min_chunk_groups, remaining) <= len(chosen) <= remaining:
            raise SchedulerError(
                f"{self.sampler.name} selected {len(chosen)} groups; the step needs "
                f"{min(self.min_chunk_groups, remaining)}..{remaining}"
            )
        ids = []
        for g in chosen:
            slot = self.slot(g.group_id)
            if slot.state != READY:
                raise SchedulerError(f"{self.sampler.name} selected {slot.group_id} ({slot.state})")
            staleness = self.trainer_version - slot.start_version
            if staleness > self.sampler.max_staleness:
                raise SchedulerError(
                    f"{self.sampler.name} selected {slot.group_id} at staleness {staleness}, "
                    f"above its bound {self.sampler.max_staleness}"
                )
            if slot.target_step is not None and slot.target_step != self.trainer_version:
                raise SchedulerError(
                    f"{slot.group_id} is stamped for step {slot.target_step}, not "
                    f"{self.trainer_version}"
                )
            self._forget(slot)
            self._taken.append(slot)
            self.taken += 1
            self.stats.staleness[staleness] += 1
            ids.append(slot.group_id)
        return Chunk(self.trainer_version, ids, evicted)

    def _filter_uniform(self) -> list[str]:
        """Dynamic sampling: drop the ready groups whose rewards are all (nearly) equal, up
        to the step's cap; a group stamped for a step is replaced by a fresh prompt for it."""
        if self.filter_min_std is None:
            return []
        dropped = []
        for slot in [s for s in self._slots.values() if s.state == READY and not s.informative]:
            if len(slot.rewards) > 1 and statistics.pstdev(slot.rewards) > self.filter_min_std:
                slot.informative = True  # never looked at again
                continue
            if self.stats.filtered_groups >= self.filter_max_drops:
                # past this step's cap it may train now; a later step judges it afresh
                self.stats.filter_cap_reached = True
                continue
            self._drop(slot, "zero_variance")
            self.stats.filtered_groups += 1
            self._replace_stamped(slot)
            dropped.append(slot.group_id)
        return dropped

    def finish_step(self) -> None:
        """The open step has all its groups and took its optimizer step: the trainer is one
        version ahead and the gate closes until :meth:`end_refit`."""
        if self.taken != self.prompts_per_step:
            raise SchedulerError(
                f"step {self.trainer_version} has {self.taken} of {self.prompts_per_step} groups"
            )
        self.trainer_version += 1
        self.stats.trained_groups += self.taken
        self.ledger.record_trained(s.index for s in self._taken)
        self._taken = []
        self.taken = 0
        self.gate_open = False

    def abort_step(self) -> list[str]:
        """The open step failed on the trainer (which dropped its gradients): its groups are
        ready again, in their order, and the step is assembled anew. Returns their ids."""
        if not self.gate_open:
            raise SchedulerError("abort_step() during a refit: the step was already taken")
        for slot in self._taken:
            self.stats.staleness[self.trainer_version - slot.start_version] -= 1
            slot.state = READY
            self._slots[slot.group_id] = slot
            self._live_count += 1
            self._count_start(slot.start_version, +1)
        self.stats.staleness = +self.stats.staleness  # drop zero counts
        self._slots = dict(sorted(self._slots.items(), key=lambda kv: kv[1].index))
        back, self._taken, self.taken = [s.group_id for s in self._taken], [], 0
        return back

    def begin_refit(self) -> list[str]:
        """Generating groups that can never be trained at the new trainer version: they are
        aborted (the caller tells the engines); their samples still come back and free their
        slots, and the group is then gone."""
        if self.gate_open:
            raise SchedulerError("begin_refit() without finish_step()")
        hopeless = [
            s
            for s in self._slots.values()
            if s.state in (GENERATING, RETRYING)
            and self.sampler.should_abort_inflight(s, self.trainer_version)
        ]
        return [self._abort(s) for s in hopeless]

    def end_refit(self) -> StepStats:
        """The generators serve the trainer's version: the gate reopens. Returns the finished
        step's counters (folded into the run's totals) and starts new ones."""
        if self.gate_open:
            raise SchedulerError("end_refit() without a refit")
        self.generator_version = self.trainer_version
        self.gate_open = True
        stats, self.stats = self.stats, StepStats(inflight_samples_max=self.inflight_samples)
        self._ended += stats  # a copy of its counts: the caller's object stays its own
        return stats

    def close(self) -> list[str]:
        """The run is over: every generating group is aborted (returned: tell the engines)
        and every complete but untrained one is counted as ``unused``."""
        for slot in [s for s in self._slots.values() if s.state in (SCORING, READY)]:
            self._forget(slot)
            self.ledger.record_dropped([slot.index], "unused")
            self.stats.unused_groups += 1
            self.stats.wasted_samples += slot.n
        return [
            self._abort(s) for s in list(self._slots.values()) if s.state in (GENERATING, RETRYING)
        ]

    # ------------------------------------------------------------------ internals
    def _abort(self, slot: Slot) -> str:
        retrying = slot.state == RETRYING
        slot.state = ABORTING
        self._live_count -= 1
        self._count_start(slot.start_version, -1)
        if retrying:  # nothing of it is on an engine: gone at once
            del self._slots[slot.group_id]
            if slot.group_id in self._retry:
                self._retry.remove(slot.group_id)
        self.ledger.record_dropped([slot.index], "aborted")
        self.stats.aborted_groups += 1
        self.stats.wasted_samples += slot.n
        return slot.group_id

    def _drop(self, slot: Slot, reason: str) -> None:
        """``slot`` leaves untrained: forgotten, its prompt recorded as dropped for
        ``reason``, its samples wasted."""
        self._forget(slot)
        self.ledger.record_dropped([slot.index], reason)
        self.stats.wasted_samples += slot.n

    def _replace_stamped(self, slot: Slot) -> None:
        """A dropped group stamped for a step: a fresh prompt for that step goes first."""
        if slot.target_step is not None:
            self._redispatch.insert(0, (self._next_index, slot.target_step))
            self._next_index += 1

    def _forget(self, slot: Slot) -> None:
        del self._slots[slot.group_id]
        self._live_count -= 1
        self._count_start(slot.start_version, -1)

    def _count_start(self, version: int, delta: int) -> None:
        self.start_version_counts[version] += delta
        if not self.start_version_counts[version]:
            del self.start_version_counts[version]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume at a step boundary without losing or repeating a
        prompt: versions, counters, the prompt-stream cursor, the sampler's state, the ready
        groups (kept as they are: the caller saves their samples) and the prompts of every
        other untrained group (generating or being scored: dispatched again first on
        resume).

        The counters saved are the run's :attr:`totals`, the open step's included (what it
        counted since the last :meth:`end_refit`: dispatches, failures, drops); the open
        step's own record starts again at the resume. ``unused`` is not saved: only
        :meth:`close` counts it, after the run's last step boundary.
        """
        if self.taken or not self.gate_open:
            raise SchedulerError("state_dict() is taken between steps (no open step or refit)")
        live = self.live
        totals = self.totals
        return {
            "trainer_version": self.trainer_version,
            "next_index": self._next_index,
            # the groups dispatched again on resume are counted when they are
            "dispatched": totals.dispatched_groups - sum(1 for s in live if s.state != READY),
            "trained": totals.trained_groups,
            "evicted": totals.evicted_groups,
            "filtered": totals.filtered_groups,
            "aborted": totals.aborted_groups,
            "wasted_samples": totals.wasted_samples,
            "failed_groups": totals.failed_groups,
            "ledger": self.ledger.state_dict(),
            "ready": [
                {
                    "index": s.index,
                    "start_version": s.start_version,
                    "target_step": -1 if s.target_step is None else s.target_step,
                    "ready_seq": s.ready_seq,
                    "rewards": list(s.rewards),
                }
                for s in live
                if s.state == READY
            ],
            "redispatch": [
                [s.index, -1 if s.target_step is None else s.target_step]
                for s in live
                if s.state != READY
            ]
            + [[i, -1 if t is None else t] for i, t in self._redispatch],
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Restore :meth:`state_dict` into a fresh scheduler (nothing dispatched yet).

        Returns the ids of the restored ready groups (the caller restores their samples).
        Their start versions and completion order (``ready_seq``) are kept, so the staleness
        bound holds for them exactly as it would have without the interruption and a state
        saved again at once equals the one restored; the redispatched prompts start on the
        version the generators serve after the resume's refit. The saved totals count as
        ended steps' (:attr:`totals`); the open step's counters start at 0.
        """
        if self._slots or self.totals != Counts():
            raise SchedulerError("load_state_dict() needs a fresh scheduler")
        self.trainer_version = self.generator_version = int(state["trainer_version"])
        self._next_index = int(state["next_index"])
        self._ended = Counts(
            dispatched_groups=int(state["dispatched"]),
            trained_groups=int(state["trained"]),
            evicted_groups=int(state["evicted"]),
            filtered_groups=int(state.get("filtered", 0)),  # absent before dynamic sampling
            aborted_groups=int(state["aborted"]),
            failed_groups=int(state["failed_groups"]),
            wasted_samples=int(state["wasted_samples"]),
        )
        self.ledger = PromptLedger.from_state_dict(state["ledger"])
        self._redispatch = [
            (int(i), None if int(t) < 0 else int(t)) for i, t in state["redispatch"]
        ]
        restored = []
        for g in sorted(state.get("ready", []), key=lambda g: int(g["ready_seq"])):
            target = int(g["target_step"])
            slot = Slot(
                f"g{int(g['index'])}",
                int(g["index"]),
                int(g["start_version"]),
                None if target < 0 else target,
                self.samples_per_prompt,
                state=READY,
                finished=self.samples_per_prompt,
                ready_seq=int(g["ready_seq"]),
                rewards=tuple(float(r) for r in g["rewards"]),
            )
            if slot.start_version > self.trainer_version:
                raise SchedulerError(
                    f"restored group {slot.group_id} started on version {slot.start_version}, "
                    f"after the checkpoint's trainer version {self.trainer_version}"
                )
            self._ready_seq = max(self._ready_seq, slot.ready_seq + 1)
            self._slots[slot.group_id] = slot
            self._live_count += 1
            self.start_version_counts[slot.start_version] += 1
            restored.append(slot.group_id)
        # dispatch order: the restored ready groups keep their places among the prompts
        self._slots = dict(sorted(self._slots.items(), key=lambda kv: kv[1].index))
        self.sampler.load_state_dict(state["sampler"])
        return restored
