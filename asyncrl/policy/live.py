"""The run's live groups: one table, the one owner of every group's state and of the counts
every rule reads (pure: no anyio, no torch, no sockets).

:class:`LiveGroups` keeps each dispatched group's record (a :class:`~asyncrl.policy.groups.Group`:
its state and its payload) from dispatch until it is trained, evicted, aborted, failed or left
unused; the open step's groups; the versions and the rollout gate; the samples in flight; the
prompt stream's cursor and the prompts to dispatch again; the open step's counters and the
run's totals; the prompt ledger. It is what samplers see (``SchedulerView``).

Its two phases change it, each through the table's methods, which keep its counts:

* the rollout phase (:class:`~asyncrl.run.rollout_phase.RolloutPhase`): dispatch to commit,
  with admission, the engine requests, arrivals, failures, retries, a lost worker and the
  refit's aborts;
* the train phase (:class:`~asyncrl.run.train_phase.TrainPhase`): ready to trained, with
  eviction, dynamic sampling, the open step's chunks, its abort and its finish, and the end of
  its refit.

What the table guarantees (tests/unit/test_schedule_properties.py drives both phases through
random schedules against a ledger of its own):

* capacity: live groups (generating, retrying, scoring or ready; not taken, not being
  aborted) ``<= max_buffered_groups``; samples generating ``<= max_inflight_samples``;
* the rollout gate: nothing is dispatched between a finished optimizer step and the end of its
  refit, so a group's ``start_version`` is the version the generators really serve;
* the staleness bound: no group is trained more than ``sampler.max_staleness`` versions after
  the version it started on;
* accounting: every dispatched group ends exactly once as trained, evicted (ready but too
  old), filtered (dynamic sampling), aborted, failed or unused, each event counted once in the
  open step's :class:`StepStats`; the run's totals (:attr:`LiveGroups.totals`) are the sum of
  the ended steps' counts and the open step's;
* a step trains exactly ``prompts_per_step`` groups;
* the prompt ledger records each prompt-stream position once, as trained or as dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncrl.policy.counts import Counts, StepStats
from asyncrl.policy.groups import ABORTING, GENERATING, READY, RETRYING, SCORING, Group
from asyncrl.policy.ledger import PromptLedger
from asyncrl.policy.samplers import Sampler

__all__ = ["LiveGroups", "SchedulerError", "Wait"]


class SchedulerError(RuntimeError):
    """An event that the state does not allow (a bug in a pump or a sampler)."""


@dataclass(frozen=True)
class Wait:
    """Nothing to dispatch now, and why: ``gate`` (a refit is going on), ``buffer`` (live
    groups at capacity), ``samples`` (samples in flight at capacity), ``sampler`` (the sampler
    holds generation back), ``enough`` (the work in flight covers the rest of the run),
    ``finished`` (the last step is trained), ``workers`` (no rollout worker serves)."""

    reason: str


_DROPPED = {
    "failed": "failed_groups",
    "evicted": "evicted_groups",
    "zero_variance": "filtered_groups",
    "unused": "unused_groups",
}
"""Why a group leaves untrained, and the :class:`Counts` field that counts it."""
_REPLACED = frozenset({"failed", "zero_variance"})
"""Drops whose step, if the group was stamped for one, gets a fresh prompt in its place."""


def _total(counter: str, doc: str) -> Any:
    """A read-only property: the run's total of the :class:`Counts` field ``counter`` (the
    ended steps' and the open step's)."""
    return property(lambda s: getattr(s._ended, counter) + getattr(s.stats, counter), doc=doc)


class LiveGroups:
    """The run's groups from dispatch to trained, and every count the rules read.

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

    Raises:
        SchedulerError: the capacities cannot hold what the sampler or a group needs.
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
        self.inflight_share = max_inflight_samples
        """Samples a dispatch may bring in flight: the cap, or less while this table's run is
        one job of several sharing the engines (:meth:`share`)."""
        self.min_chunk_groups = min_chunk_groups
        self.filter_min_std = filter_min_std
        self.filter_max_drops = filter_max_drops

        self.trainer_version = 0
        self.generator_version = 0
        self.gate_open = True
        self.inflight_samples = 0
        self._groups: dict[str, Group] = {}
        """Every group tracked (being aborted included), by id, in dispatch order."""
        self._live_count = 0  # tracked groups not ABORTING
        self.start_version_counts: Counter[int] = Counter()
        """Live groups per start version (kept for samplers)."""
        self._ready_seq = 0
        self._next_index = 0
        self._redispatch: list[tuple[int, int | None]] = []
        """Prompt indices (and target steps) to dispatch again first (after a resume, or in
        place of a dropped group stamped for a step)."""
        self._retry: list[str] = []
        """RETRYING groups whose retry is due, in order (dispatched first)."""
        self._taken: list[Group] = []
        """The open step's groups (step ``trainer_version``), in the order they were taken."""
        self.stats = StepStats()
        """The open step's counters: where every event is counted (the train phase's
        ``refit_done`` hands them out and starts new ones)."""
        self._ended = Counts()
        """The counts of every ended step, and a resumed checkpoint's totals: the run's
        totals but the open step's (:attr:`totals`)."""
        self.ledger = PromptLedger(prompts_per_epoch)

    # ------------------------------------------------------------------ views
    @property
    def live(self) -> list[Group]:
        """Untrained groups counted against capacity, in dispatch order."""
        return [g for g in self._groups.values() if g.state != ABORTING]

    @property
    def num_live(self) -> int:
        return self._live_count

    @property
    def num_ready(self) -> int:
        return sum(1 for g in self._groups.values() if g.state == READY)

    @property
    def taken(self) -> int:
        """Groups in the open step (step ``trainer_version``)."""
        return len(self._taken)

    @property
    def in_step(self) -> list[Group]:
        """The open step's groups, in the order they were taken."""
        return list(self._taken)

    @property
    def next_index(self) -> int:
        """The next fresh position in the prompt stream."""
        return self._next_index

    @property
    def finished(self) -> bool:
        """The run's last step is trained."""
        return self.trainer_version >= self.num_steps

    @property
    def drained(self) -> bool:
        """No sample is being generated."""
        return self.inflight_samples == 0

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
    unused = _total("unused_groups", "Complete groups left untrained at the end.")
    failed_groups = _total("failed_groups", "Groups that failed for good.")
    wasted_samples = _total("wasted_samples", "Samples of the groups that left untrained.")

    def ledger_report(self) -> list[Any]:
        """The prompt ledger per epoch (:meth:`PromptLedger.report`), with the positions still
        in play as live."""
        return self.ledger.report(self._next_index, self.redispatch_indices())

    def redispatch_indices(self) -> list[int]:
        """Prompt-stream positions still in play: live groups and those waiting to be
        dispatched again."""
        return [g.index for g in self.live] + [i for i, _ in self._redispatch]

    def __iter__(self) -> Iterator[Group]:
        """Every tracked group (being aborted included), in dispatch order."""
        return iter(list(self._groups.values()))

    def get(self, group_id: str) -> Group | None:
        """``group_id``'s record (``None``: not tracked), without raising: the hot path's
        question for each sample that arrives."""
        return self._groups.get(group_id)

    def group(self, group_id: str) -> Group:
        """Raises SchedulerError: ``group_id`` is not tracked."""
        try:
            return self._groups[group_id]
        except KeyError:
            raise SchedulerError(f"unknown group {group_id!r}") from None

    def state_of(self, group_id: str) -> str | None:
        group = self._groups.get(group_id)
        return None if group is None else group.state

    def tracks(self, group_id: str) -> bool:
        return group_id in self._groups

    # ------------------------------------------------------------------ dispatch
    @property
    def retries_due(self) -> int:
        """RETRYING groups whose retry is due (dispatched before any new group)."""
        return len(self._retry)

    def pop_due_retry(self) -> Group:
        """The first RETRYING group whose retry is due, taken off the queue.

        Raises:
            SchedulerError: none is due.
        """
        if not self._retry:
            raise SchedulerError("no retry is due")
        return self.group(self._retry.pop(0))

    def next_position(self) -> tuple[int, int | None] | None:
        """Where a new group's prompt comes from: a prompt to dispatch again (one stamped for
        a step keeps it without a new admission), else a fresh position the sampler admits;
        ``(index, target step)``. ``None``: the sampler holds generation back.

        Raises:
            SchedulerError: the sampler admitted a group for a step already past.
        """
        if self._redispatch and self._redispatch[0][1] is not None:
            return self._redispatch.pop(0)
        ok, target = self.sampler.admit(self)
        if not ok:
            return None
        if target is not None and target < self.trainer_version:
            raise SchedulerError(f"{self.sampler.name} admitted a group for past step {target}")
        if self._redispatch:
            return self._redispatch.pop(0)[0], target
        self._next_index += 1
        return self._next_index - 1, target

    def add(self, group: Group) -> None:
        """``group`` (GENERATING, on :attr:`generator_version`) was dispatched."""
        if group.group_id in self._groups:
            raise SchedulerError(f"group {group.group_id} is already live")
        self._groups[group.group_id] = group
        self._live_count += 1
        self._count_start(group.start_version, +1)
        self._generating(group)
        self.stats.dispatched_groups += 1

    def restart(self, group: Group) -> None:
        """``group`` (RETRYING) is dispatched again on :attr:`generator_version`: its samples
        start afresh."""
        self._count_start(group.start_version, -1)
        group.start_version = self.generator_version
        self._count_start(group.start_version, +1)
        group.samples = [None] * group.n
        self._generating(group)

    def _generating(self, group: Group) -> None:
        group.state, group.finished = GENERATING, 0
        self.inflight_samples += group.n
        self.stats.inflight_samples_max = max(
            self.stats.inflight_samples_max, self.inflight_samples
        )

    # ------------------------------------------------------------------ arrival and failure
    def sample_back(self, group: Group) -> str:
        """One sample (episode) of ``group`` (generating or being aborted) came back. Returns
        ``"pending"`` (more to come), ``"complete"`` (its last: the group is SCORING) or
        ``"discarded"`` (the last of a group being aborted, which is now gone)."""
        if group.state not in (GENERATING, ABORTING):
            raise SchedulerError(f"group {group.group_id} got a sample in state {group.state}")
        if group.finished >= group.n:
            raise SchedulerError(f"group {group.group_id} got more than {group.n} samples")
        group.finished += 1
        self.inflight_samples -= 1
        if group.finished < group.n:
            return "pending"
        if group.state == ABORTING:
            self.remove(group)
            return "discarded"
        group.state = SCORING
        return "complete"

    def samples_lost(self, group: Group) -> None:
        """``group``'s samples (episodes) not yet back never will (a failure, a lost
        worker)."""
        self.inflight_samples -= group.n - group.finished
        group.finished = group.n

    def remove(self, group: Group) -> None:
        """``group``, being aborted (already counted), is gone."""
        if group.state != ABORTING:
            raise SchedulerError(f"group {group.group_id} removed in state {group.state}")
        del self._groups[group.group_id]

    def to_retry(self, group: Group, *, failed: bool) -> None:
        """``group`` waits as RETRYING, still live (keeping its place and its step).
        ``failed``: its generation failed (a retry counted, due at :meth:`mark_retry_due`,
        after the back-off); otherwise its worker was lost (due at once, not counted)."""
        group.state, group.finished = RETRYING, 0
        if failed:
            group.retries += 1
            self.stats.generation_retries += 1
        else:
            self._retry.append(group.group_id)

    def mark_retry_due(self, group_id: str) -> None:
        """A RETRYING group's back-off is over: it is dispatched again first (a group dropped
        meanwhile is ignored)."""
        group = self._groups.get(group_id)
        if group is not None and group.state == RETRYING and group_id not in self._retry:
            self._retry.append(group_id)

    def ready(self, group: Group) -> None:
        """``group`` (SCORING) is scored: ready to train, after those ready before it."""
        if group.state != SCORING:
            raise SchedulerError(f"group {group.group_id} committed in state {group.state}")
        group.state, group.ready_seq = READY, self._ready_seq
        self._ready_seq += 1

    # ------------------------------------------------------------------ leaving untrained
    def abort(self, group: Group) -> None:
        """``group`` (generating or retrying) can never train: counted as aborted. One
        waiting for its retry is gone at once; one on an engine is ABORTING until its samples
        are back."""
        retrying = group.state == RETRYING
        group.state = ABORTING
        self._live_count -= 1
        self._count_start(group.start_version, -1)
        if retrying:
            self.remove(group)
            if group.group_id in self._retry:
                self._retry.remove(group.group_id)
        self.ledger.record_dropped([group.index], "aborted")
        self.stats.aborted_groups += 1
        self.stats.wasted_samples += group.n

    def drop(self, group: Group, reason: str) -> None:
        """``group`` leaves untrained: forgotten, its prompt recorded as dropped for
        ``reason``, its samples wasted and the event counted:

        - ``failed`` (its generation or scoring failed for good) and ``zero_variance``
          (dynamic sampling): a group stamped for a step is replaced by a fresh prompt for
          that step, dispatched first;
        - ``evicted`` (the sampler: too old to train) and ``unused`` (the run is over).
        """
        counter = _DROPPED.get(reason)
        if counter is None:
            raise SchedulerError(f"no such reason to drop a group: {reason!r}")
        self._forget(group)
        self.ledger.record_dropped([group.index], reason)
        self.stats.wasted_samples += group.n
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if reason in _REPLACED and group.target_step is not None:
            self._redispatch.insert(0, (self._next_index, group.target_step))
            self._next_index += 1

    # ------------------------------------------------------------------ the open step
    def take(self, group: Group) -> None:
        """``group`` (READY) goes into the open step."""
        self._forget(group)
        self._taken.append(group)
        self.stats.staleness[self.trainer_version - group.start_version] += 1

    def untake(self) -> list[Group]:
        """The open step failed: its groups are ready again, in their dispatch order."""
        back, self._taken = self._taken, []
        for group in back:
            self.stats.staleness[self.trainer_version - group.start_version] -= 1
            self._groups[group.group_id] = group
            self._live_count += 1
            self._count_start(group.start_version, +1)
        self.stats.staleness = +self.stats.staleness  # drop zero counts
        self._groups = dict(sorted(self._groups.items(), key=lambda kv: kv[1].index))
        return back

    def step_taken(self) -> None:
        """The open step took its optimizer step: its groups are trained, the trainer is one
        version ahead and the gate closes until :meth:`refit_ended`."""
        self.trainer_version += 1
        self.stats.trained_groups += len(self._taken)
        self.ledger.record_trained(g.index for g in self._taken)
        self._taken = []
        self.gate_open = False

    def refit_ended(self) -> StepStats:
        """The generators serve the trainer's version: the gate reopens. Returns the ended
        step's counters (folded into the run's totals) and starts new ones."""
        self.generator_version = self.trainer_version
        self.gate_open = True
        stats, self.stats = self.stats, StepStats(inflight_samples_max=self.inflight_samples)
        self._ended += stats  # a copy of its counts: the caller's object stays its own
        return stats

    # ------------------------------------------------------------------ internals
    def _forget(self, group: Group) -> None:
        del self._groups[group.group_id]
        self._live_count -= 1
        self._count_start(group.start_version, -1)

    def _count_start(self, version: int, delta: int) -> None:
        self.start_version_counts[version] += delta
        if not self.start_version_counts[version]:
            del self.start_version_counts[version]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume at a step boundary without losing or repeating a
        prompt: versions, counters, the prompt-stream cursor, the sampler's state, the ready
        groups (kept as they are: the caller saves their samples, :meth:`ready_groups`) and
        the prompts of every other untrained group (dispatched again first on resume).

        The counters saved are the run's :attr:`totals`, the open step's included; the open
        step's own record starts again at the resume. ``unused`` is not saved: only the end
        of the run counts it, after the run's last step boundary.

        Raises:
            SchedulerError: a step is open or a refit is going on.
        """
        if self._taken or not self.gate_open:
            raise SchedulerError("state_dict() is taken between steps (no open step or refit)")
        live = self.live
        totals = self.totals
        return {
            "trainer_version": self.trainer_version,
            "next_index": self._next_index,
            # the groups dispatched again on resume are counted when they are
            "dispatched": totals.dispatched_groups - sum(1 for g in live if g.state != READY),
            "trained": totals.trained_groups,
            "evicted": totals.evicted_groups,
            "filtered": totals.filtered_groups,
            "aborted": totals.aborted_groups,
            "wasted_samples": totals.wasted_samples,
            "failed_groups": totals.failed_groups,
            "ledger": self.ledger.state_dict(),
            "ready": [
                {
                    "index": g.index,
                    "start_version": g.start_version,
                    "target_step": -1 if g.target_step is None else g.target_step,
                    "ready_seq": g.ready_seq,
                    "rewards": list(g.rewards),
                }
                for g in live
                if g.state == READY
            ],
            "redispatch": [
                [g.index, -1 if g.target_step is None else g.target_step]
                for g in live
                if g.state != READY
            ]
            + [[i, -1 if t is None else t] for i, t in self._redispatch],
            "sampler": self.sampler.state_dict(),
        }

    def share(self, samples: int) -> None:
        """Dispatch no more than ``samples`` in flight from now on (a job's share of the
        engines: docs/jobs.md), never less than one group nor more than the cap. Samples in
        flight above it are not taken back: they finish, and dispatch waits."""
        self.inflight_share = max(self.samples_per_prompt, min(samples, self.max_inflight_samples))

    def ready_groups(self) -> list[Group]:
        """The ready groups, in :meth:`state_dict`'s order."""
        return [g for g in self.live if g.state == READY]

    def load_state_dict(self, state: dict[str, Any], groups: dict[int, Group]) -> None:
        """Restore :meth:`state_dict` into this fresh table (nothing dispatched yet), with the
        ready groups' records by index (``groups``: their payloads, as saved, their ids
        whatever the run minted them as, a job's with its prefix; exactly the ready
        groups', which :func:`asyncrl.checkpoints.directory.restore` checks first).

        Their start versions and completion order (``ready_seq``) are kept, so the staleness
        bound holds for them exactly as it would have without the interruption and a state
        saved again at once equals the one restored; the prompts dispatched again start on
        the version the generators serve after the resume's refit. The saved totals count as
        ended steps'; the open step's counters start at 0.

        Raises:
            SchedulerError: the table is not fresh, or a group started after the checkpoint's
                version.
        """
        if self._groups or self.totals != Counts():
            raise SchedulerError("load_state_dict() needs a fresh table")
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
        for g in sorted(state.get("ready", []), key=lambda g: int(g["ready_seq"])):
            group = groups[int(g["index"])]
            target = int(g["target_step"])
            group.start_version = int(g["start_version"])
            group.target_step = None if target < 0 else target
            group.state, group.finished = READY, group.n
            group.ready_seq = int(g["ready_seq"])
            if group.start_version > self.trainer_version:
                raise SchedulerError(
                    f"restored group {group.group_id} started on version "
                    f"{group.start_version}, after the checkpoint's trainer version "
                    f"{self.trainer_version}"
                )
            self._ready_seq = max(self._ready_seq, group.ready_seq + 1)
            self._groups[group.group_id] = group
            self._live_count += 1
            self._count_start(group.start_version, +1)
        # dispatch order: the restored ready groups keep their places among the prompts
        self._groups = dict(sorted(self._groups.items(), key=lambda kv: kv[1].index))
        self.sampler.load_state_dict(state["sampler"])

    # ------------------------------------------------------------------ invariants
    def problems(self) -> list[str]:
        """Every broken invariant of the table's counts (none: ``[]``). O(groups): for tests
        and debugging, not the hot path."""
        out = []
        live = self.live
        if len(live) != self._live_count:
            out.append(f"{len(live)} live groups, counted {self._live_count}")
        starts = Counter(g.start_version for g in live)
        if starts != self.start_version_counts:
            out.append(f"start versions {dict(starts)}, counted {dict(self.start_version_counts)}")
        to_come = sum(g.n - g.finished for g in self._groups.values()
                      if g.state in (GENERATING, ABORTING))  # fmt: skip
        if to_come != self.inflight_samples:
            out.append(f"{to_come} samples to come, counted {self.inflight_samples} in flight")
        if self.inflight_samples > self.max_inflight_samples:
            out.append(f"{self.inflight_samples} samples in flight, above the cap")
        if any(g.state != READY for g in self._taken):
            out.append("a group of the open step is not ready")
        stray = [gid for gid in self._retry if self.state_of(gid) != RETRYING]
        if stray:
            out.append(f"groups {stray[:5]} are due to retry but not retrying")
        return out
