"""What comes in on the data socket: the feeder that hands each sample to the rollout phase
(:mod:`asyncrl.run.rollout_phase`), has complete groups scored (:mod:`asyncrl.run.scoring`) and
commits them.

::

    PULL ──► Feeder ──rollout.sample_arrived()──► stored │ rejected (counted) │ complete
                          answer: to whoever asked ◄──┘                     │ score (inline or thread)
                          (asking.py: an episode's turn, an evaluation)     └──► ctx.commit()
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from asyncrl.errors import ProtocolError, RunError
from asyncrl.policy.groups import Group
from asyncrl.wire.codec import Codec
from asyncrl.run.arrivals import ArrivalKind as Kind
from asyncrl.run.asking import Asker
from asyncrl.run.context import RunContext
from asyncrl.run.scoring import ScoreError, Scorer
from asyncrl.wire.messages import DataBatch, DataMessage, GroupFailed, SampleDone
from asyncrl.wire.transport import AsyncSocket, Rejections, peer_name

if TYPE_CHECKING:
    from asyncrl.run.restarts import Redispatcher

__all__ = ["Feeder"]

FEED_SLICE_S = 0.0005
"""The feeder takes queued samples for at most this long before it gives the loop back (with
16-group dispatch rounds: loop lag p99 4.9 ms at 11,000 samples/s on a 16-core host, against
6.3 ms with 1 ms slices and 32-group rounds; benchmarks/modes.py --part lag)."""


log = structlog.get_logger("asyncrl.run.intake")


class Feeder:
    """Reads the data socket into the rollout phase; scores and commits complete groups.

    It counts the samples the engines cut short, by the step open when each arrived (a step
    record takes its count: :meth:`take_aborted`); ``changed`` wakes the rollout pump (once
    per batch of samples).
    """

    def __init__(
        self,
        ctx: RunContext,
        *,
        data: AsyncSocket,
        scorer: Scorer,
        asker: Asker,
        redispatch: Redispatcher,
        rejections: Rejections,
    ) -> None:
        self.ctx, self.config, self.rollout = ctx, ctx.config, ctx.rollout
        self.changed = ctx.changed
        self.asker = asker
        """Where an answered request's sample goes (an episode's turn, an evaluation's)."""
        self.data = data
        self.scorer = scorer
        self.redispatch = redispatch
        self.rejections = rejections
        self._aborted: dict[int, int] = {}
        """Samples cut short (finish reason ``abort``) by the trainer version they arrived at,
        until a step's record takes its count: those a step's refit aborts arrive with the
        version already bumped, so they count toward the next step."""

    async def run(self) -> None:
        """Read samples from the data socket until cancelled.

        A frame that does not decode, or a sample for a group that is not generating (a late
        duplicate, a stranger's), is rejected and counted (socket ``data``); it never ends the
        run. A malformed sample from the worker the request was sent to, or an environment
        whose ``score()`` raises or returns a non-finite reward (``failures.on_reward_error =
        "fail_run"``) ends it with a :class:`~asyncrl.errors.RunError` naming the culprit.
        Under ``"drop_group"`` such a group is dropped (within ``failures.max_failed_groups``).

        Cancellation: stops reading; scoring tasks in flight are cancelled with it.
        """
        codec = Codec(DataMessage)
        async with anyio.create_task_group() as tg:
            while True:
                frames = await self.data.recv()
                # take what else is already queued for at most FEED_SLICE_S, then wake the rollout
                # pump once for the lot (not once per sample) and give the loop back: a
                # never-empty socket must not starve the other tasks
                deadline = time.perf_counter() + FEED_SLICE_S
                while frames is not None:
                    self._take_frames(codec, frames, tg)
                    if time.perf_counter() > deadline:
                        break
                    frames = self.data.recv_nowait()
                self.changed.notify()
                await anyio.lowlevel.checkpoint()

    def take_aborted(self, step: int) -> int:
        """The samples the engines cut short while step ``step`` was open (the trainer at
        version ``step``), handed to its record once: the count is forgotten here."""
        return self._aborted.pop(step, 0)

    def _take_frames(self, codec: Codec, frames: Any, tg: anyio.abc.TaskGroup) -> None:
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            self.rejections.reject("data", "?", str(exc))
            return
        for item in msg.items if isinstance(msg, DataBatch) else (msg,):
            if isinstance(item, GroupFailed):
                self._take_failure(item, tg)
            else:
                self._take_sample(item, tg)

    def _take_failure(self, msg: GroupFailed, tg: anyio.abc.TaskGroup) -> None:
        arrival = self.rollout.check_failure(msg)
        match arrival.kind:
            case Kind.REJECTED:
                self.rejections.reject("data", peer_name(msg.worker), arrival.detail)
            case Kind.ANSWER_FAILED:
                assert arrival.request is not None
                error = f"{msg.error_type}: {msg.message}"
                self.asker.failed(arrival.request, error, msg.retryable)
            case Kind.IN_FLIGHT:
                assert arrival.group is not None
                self.redispatch.group_failed(arrival.group, msg, arrival.aborting, tg)
            case Kind.DISCARDED:  # an abandoned turn's: nobody waits for it
                pass
            case other:
                raise AssertionError(f"check_failure answered {other}")

    def _take_sample(self, msg: SampleDone, tg: anyio.abc.TaskGroup) -> None:
        arrival = self.rollout.sample_arrived(msg)
        match arrival.kind:
            case Kind.REJECTED:
                self.rejections.reject("data", peer_name(msg.worker), arrival.detail)
            case Kind.MALFORMED:
                raise RunError(
                    f"{msg.worker} returned a malformed sample {msg.index} for group "
                    f"{msg.group_id}: {arrival.detail}; the generation backend "
                    f"{self.config.generator.backend!r} broke its contract"
                )
            case Kind.ANSWER:
                assert arrival.request is not None and arrival.sample is not None
                self.asker.answered(arrival.request, arrival.sample)  # as the rollout phase took it
            case Kind.PENDING | Kind.DISCARDED | Kind.COMPLETE as kind:
                if msg.sample.finish_reason == "abort":
                    version = self.ctx.groups.trainer_version
                    self._aborted[version] = self._aborted.get(version, 0) + 1
                if kind is Kind.COMPLETE:
                    assert arrival.group is not None
                    self._complete(arrival.group, tg)
            case other:
                raise AssertionError(f"sample_arrived answered {other}")

    def _complete(self, group: Group, tg: anyio.abc.TaskGroup) -> None:
        """A group's last sample arrived: score it now (a cheap environment) or in a task
        (scoring in a thread), then commit it."""
        if not self.scorer.cheap:
            tg.start_soon(self._score_threaded, group)
            return
        try:
            samples = self.scorer.inline(group)
        except ScoreError as exc:
            self._score_failed(group, exc)
        else:
            self.ctx.commit(group.group_id, samples)

    async def _score_threaded(self, group: Group) -> None:
        try:
            samples = await self.scorer.threaded(group)
        except ScoreError as exc:
            self._score_failed(group, exc)
        else:
            self.ctx.commit(group.group_id, samples)

    def _score_failed(self, group: Group, exc: ScoreError) -> None:
        """``failures.on_reward_error``: stop the run, or drop the group."""
        if self.config.failures.on_reward_error == "fail_run":
            raise exc
        gid = group.group_id
        log.error("reward_failed", group_id=gid, error=str(exc), action="group dropped")
        self.redispatch.score_failed(gid, f"group {gid}: {exc}")
