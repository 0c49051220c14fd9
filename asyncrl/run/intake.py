"""What comes in on the data socket: the router that reads it once and hands each sample to
its job's feeder, and the feeder that hands it to the rollout phase
(:mod:`asyncrl.run.rollout_phase`), has complete groups scored (:mod:`asyncrl.run.scoring`) and
commits them.

::

    PULL ──► DataRouter ──(the group id's job)──► Feeder ──rollout.sample_arrived()──►
             decodes; rejects (counted) a frame     stored │ rejected (counted) │ complete
             that does not decode, or an item of    answer: to whoever asked ◄─┘     │ score
             a job that is not running              (asking.py: a turn, an evaluation)  │
                                                                        ctx.commit() ◄──┘

A job's group ids start with its name and a ``:`` (docs/jobs.md); the run's own have none.
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

__all__ = ["JOB_SEPARATOR", "DataRouter", "Feeder", "Intake", "job_of"]

FEED_SLICE_S = 0.0005
"""The feeder takes queued samples for at most this long before it gives the loop back (with
16-group dispatch rounds: loop lag p99 4.9 ms at 11,000 samples/s on a 16-core host, against
6.3 ms with 1 ms slices and 32-group rounds; benchmarks/modes.py --part lag)."""


INTAKE_SIZE = 4096
"""Samples and failures waiting for one job's feeder: a full intake holds the router (and then
the data socket's high-water mark the workers), never a growing queue."""

Item = SampleDone | GroupFailed
"""What a feeder takes: one sample, or one group's failure."""

Intake = anyio.abc.ObjectReceiveStream[Item]
"""One job's items, in the order the router read them."""

log = structlog.get_logger("asyncrl.run.intake")


JOB_SEPARATOR = ":"
"""Between a job's name and the rest of its group and request ids (no id the run mints
otherwise has one: ``g12``, ``eval-start-3``, ``g12/0#1``)."""


def job_of(group_id: str) -> str:
    """The job a group (or request) id belongs to: what stands before its first
    :data:`JOB_SEPARATOR`; ``""`` (the run's own) for an id without one."""
    job, separator, _ = group_id.partition(JOB_SEPARATOR)
    return job if separator else ""


class DataRouter:
    """Reads the data socket, once for every job: decodes each message and hands each sample or
    failure to the intake of the job its group id names (:func:`job_of`). Use as a context
    manager: leaving it closes every intake.

    Args:
        data: the controller's data ``PULL`` socket.
        rejections: where a frame that does not decode, or an item of a job that is not
            running, is counted (socket ``data``); neither ends the run.
    """

    def __init__(self, data: AsyncSocket, rejections: Rejections) -> None:
        self.data = data
        self.rejections = rejections
        self._routes: dict[str, tuple[anyio.abc.ObjectSendStream[Item], Intake]] = {}
        """Each job's stream, both ends: the router owns them (a feeder that never ran leaves
        nothing open)."""

    def __enter__(self) -> DataRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        for job in list(self._routes):
            self.close(job)

    def intake(self, job: str) -> Intake:
        """``job``'s items from now on (``""``: the run's own).

        Raises:
            ValueError: ``job`` has an intake already."""
        if job in self._routes:
            raise ValueError(f"job {job!r} has an intake already")
        send, receive = anyio.create_memory_object_stream[Item](INTAKE_SIZE)
        self._routes[job] = (send, receive)
        return receive

    def close(self, job: str) -> None:
        """``job`` ended: its intake is closed (both ends), its items rejected from now on."""
        ends = self._routes.pop(job, None)
        if ends is not None:
            for end in ends:
                end.close()

    async def run(self) -> None:
        """Route until cancelled. Takes what is queued on the socket for at most
        ``FEED_SLICE_S`` before it gives the loop back (a never-empty socket must not starve
        the other tasks), as the feeders do."""
        codec = Codec(DataMessage)
        while True:
            frames = await self.data.recv()
            deadline = time.perf_counter() + FEED_SLICE_S
            while frames is not None:
                await self._route(codec, frames)
                if time.perf_counter() > deadline:
                    break
                frames = self.data.recv_nowait()
            await anyio.lowlevel.checkpoint()

    async def _route(self, codec: Codec, frames: Any) -> None:
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            self.rejections.reject("data", "?", str(exc))
            return
        for item in msg.items if isinstance(msg, DataBatch) else (msg,):
            job = job_of(item.group_id)
            route, _ = self._routes.get(job, (None, None))
            if route is None:
                why = f"group {item.group_id}: job {job!r} is not running"
                self.rejections.reject("data", peer_name(item.worker), why)
                continue
            try:
                route.send_nowait(item)
            except anyio.WouldBlock:
                await route.send(item)  # the feeder is behind: wait for it (bounded)


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
        intake: Intake,
        scorer: Scorer,
        asker: Asker,
        redispatch: Redispatcher,
        rejections: Rejections,
    ) -> None:
        self.ctx, self.config, self.rollout = ctx, ctx.config, ctx.rollout
        self.changed = ctx.changed
        self.asker = asker
        """Where an answered request's sample goes (an episode's turn, an evaluation's)."""
        self.intake = intake
        """This job's samples and failures (:class:`DataRouter`)."""
        self.scorer = scorer
        self.redispatch = redispatch
        self.rejections = rejections
        self._aborted: dict[int, int] = {}
        """Samples cut short (finish reason ``abort``) by the trainer version they arrived at,
        until a step's record takes its count: those a step's refit aborts arrive with the
        version already bumped, so they count toward the next step."""

    async def run(self) -> None:
        """Take samples from the intake until cancelled (or it is closed).

        A sample for a group that is not generating (a late duplicate, a stranger's) is
        rejected and counted (socket ``data``), as the router counts a frame that does not
        decode; neither ends the run. A malformed sample from the worker the request was sent
        to, or an environment whose ``score()`` raises or returns a non-finite reward
        (``failures.on_reward_error = "fail_run"``) ends it with a
        :class:`~asyncrl.errors.RunError` naming the culprit.
        Under ``"drop_group"`` such a group is dropped (within ``failures.max_failed_groups``).

        Cancellation: stops reading; scoring tasks in flight are cancelled with it.
        """
        async with anyio.create_task_group() as tg:
            async for item in self.intake:
                # take what else is already queued for at most FEED_SLICE_S, then wake the rollout
                # pump once for the lot (not once per sample) and give the loop back: a
                # never-empty intake must not starve the other tasks
                deadline = time.perf_counter() + FEED_SLICE_S
                while True:
                    self._take_item(item, tg)
                    if time.perf_counter() > deadline:
                        break
                    try:
                        item = self.intake.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                self.changed.notify()
                await anyio.lowlevel.checkpoint()

    def take_aborted(self, step: int) -> int:
        """The samples the engines cut short while step ``step`` was open (the trainer at
        version ``step``), handed to its record once: the count is forgotten here."""
        return self._aborted.pop(step, 0)

    def _take_item(self, item: Item, tg: anyio.abc.TaskGroup) -> None:
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
