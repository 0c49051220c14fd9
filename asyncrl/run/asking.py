"""Where a coroutine asks an engine for one sample and waits for it: an episode's turn, an
evaluation's prompt.

::

    Asker.ask() ──rollout.start_turn()──► a worker ──Cast(Generate([1 request]))──► engine
    Feeder ◄──SampleDone── worker; rollout.sample_arrived(): ANSWER ──answered()──► the asker

The rollout phase (:mod:`asyncrl.run.rollout_phase`) owns the requests in flight; the
:class:`Asker` owns what waits: the slot each request's answer is delivered into. Every answered
request ends exactly one way: its sample comes back (``ANSWER``), its worker reports it failed
(``ANSWER_FAILED``), its worker is lost (:meth:`Asker.lost`), or whoever asked is cancelled (the
rollout phase abandons the request and the worker is told to abort it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from asyncrl.data.prompts import sample_seed
from asyncrl.policy.live import LiveGroups
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.requests import Request, request_id
from asyncrl.run.wake import Signal
from asyncrl.wire.messages import GenRequest, Sample

if TYPE_CHECKING:
    from asyncrl.run.context import RunContext

__all__ = ["ABORT_TIMEOUT_S", "ASK_ATTEMPTS", "Asker", "Question", "RequestFailed", "build_asker"]

log = structlog.get_logger("asyncrl.run.asking")

ASK_ATTEMPTS = 3
"""Requests one question may take when its worker reports a (retryable) failure; a worker lost
does not count (the question goes to another worker at once)."""

ABORT_TIMEOUT_S = 10.0
"""Bound on telling a worker to abort the request of a cancelled asker (shielded)."""


class RequestFailed(Exception):
    """A question got no answer: its requests failed :data:`ASK_ATTEMPTS` times, or for good."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class _Lost(Exception):
    """Why one request ended without a sample."""

    def __init__(self, message: str, *, retryable: bool, counts: bool) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.counts = counts
        """Whether it counts against :data:`ASK_ATTEMPTS` (a lost worker does not)."""


@dataclass
class _Slot:
    """Where one request's answer is delivered."""

    done: anyio.Event = field(default_factory=anyio.Event)
    sample: Sample | None = None
    lost: _Lost | None = None

    def answer(self, sample: Sample | None, lost: _Lost | None = None) -> None:
        self.sample, self.lost = sample, lost
        self.done.set()


@dataclass
class Question:
    """Who asks: episode ``index`` of group ``group_id`` (an evaluation's prompt: group
    ``eval-<label>-<i>``, index 0, ``evaluation``), its requests so far and the worker of the
    last one (the next goes there too while it is not much busier: its prefix cache)."""

    group_id: str
    index: int
    evaluation: bool = False
    worker: str = ""
    requests: int = 0
    dispatch: int = 0
    """The group's dispatches before this one (its retries): part of each request id."""

    @property
    def episode(self) -> str:
        return f"{self.group_id}/{self.index}"

    def next_id(self) -> str:
        self.requests += 1
        return request_id(self.group_id, self.index, self.requests - 1, self.dispatch)


class Asker:
    """Asks the engines for one sample at a time on behalf of episodes and evaluations.

    Args:
        rollout: the run's rollout phase (the owner of every request in flight).
        groups: the run's live groups (the version the generators serve).
        send: ``send(worker, request)``: ask ``worker`` for one sample (a ``GenRequest``).
        abort: ``abort(worker, request_ids)``: tell ``worker`` to abort these requests.
        serving: the rollout workers that serve now.
        changed: the live groups changed; waited on while no worker serves.
        seed: ``run.seed`` (each request's sampling seed derives from it and its id).
    """

    def __init__(
        self,
        rollout: RolloutPhase,
        groups: LiveGroups,
        *,
        send: Callable[[str, GenRequest], Awaitable[Any]],
        abort: Callable[[str, list[str]], Awaitable[Any]],
        serving: Callable[[], Sequence[str]],
        changed: Signal,
        seed: int,
    ) -> None:
        self._rollout, self._groups = rollout, groups
        self._send, self._abort = send, abort
        self._serving, self._changed, self._seed = serving, changed, seed
        self._slots: dict[str, _Slot] = {}
        """Request id → where its answer goes, for every request someone waits for."""

    # ------------------------------------------------------------------ what comes back
    def answered(self, request: Request, sample: Sample) -> None:
        """The rollout phase's ``ANSWER``: hand the sample to whoever waits for it."""
        slot = self._slots.get(request.request_id)
        if slot is not None:
            slot.answer(sample)

    def failed(self, request: Request, error: str, retryable: bool) -> None:
        """The rollout phase's ``ANSWER_FAILED``: the worker could not generate it."""
        slot = self._slots.get(request.request_id)
        if slot is not None:
            slot.answer(None, _Lost(error, retryable=retryable, counts=True))

    def lost(self, requests: Sequence[Request]) -> None:
        """Their worker died: each asker asks another worker (not counted as a failure)."""
        for request in requests:
            slot = self._slots.get(request.request_id)
            if slot is not None:
                lost = _Lost(f"worker {request.worker} died", retryable=True, counts=False)
                slot.answer(None, lost)

    # ------------------------------------------------------------------ asking
    async def ask(
        self, question: Question, prompt_ids: list[int], max_tokens: int, temperature: float
    ) -> tuple[Sample, int]:
        """One sample of ``prompt_ids`` (greedy for an evaluation) and the weight version the
        generators served when it was asked: a request on a worker the rollout phase picks, asked
        again on another when its worker is lost, and at most :data:`ASK_ATTEMPTS` times when
        its worker reports a failure.

        Raises:
            RequestFailed: it failed :data:`ASK_ATTEMPTS` times, or for good.

        Cancellation: the request is abandoned and its worker told to abort it.
        """
        failures = 0
        while True:
            rid = question.next_id()
            chosen = question.worker = await self._place(question, rid)
            version = self._groups.generator_version
            request = GenRequest(
                group_id=rid, prompt_ids=prompt_ids, n=1, max_tokens=max_tokens,
                temperature=temperature, greedy=question.evaluation,
                seed=sample_seed(self._seed, rid),
            )  # fmt: skip
            try:
                return await self._request(rid, chosen, request), version
            except _Lost as lost:
                failures += lost.counts
                if not lost.retryable or failures >= ASK_ATTEMPTS:
                    what = "evaluation prompt" if question.evaluation else "turn"
                    raise RequestFailed(f"{what} {rid} failed on {chosen}: {lost}",
                                        retryable=lost.retryable) from None  # fmt: skip

    async def _place(self, question: Question, rid: str) -> str:
        """The worker for request ``rid`` (the rollout phase charges it); waits while none
        serves."""
        rollout = self._rollout
        group_id = "" if question.evaluation else question.group_id
        while True:
            chosen = rollout.start_turn(rid, self._serving(), question.worker, group_id=group_id,
                                     index=question.index)  # fmt: skip
            if chosen is not None:
                return chosen
            if group_id and not rollout.generating(group_id):
                # its group is being aborted: the episode is cancelled at once
                await anyio.sleep_forever()
            await self._changed.wait()

    async def _request(self, rid: str, worker: str, request: GenRequest) -> Sample:
        slot = self._slots[rid] = _Slot()
        try:
            await self._send(worker, request)
            await slot.done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                to = self._rollout.abandon_turn(rid)
                if to is not None:
                    await self.abort_quietly(to, [rid])
            raise
        finally:
            del self._slots[rid]
        if slot.lost is not None:
            raise slot.lost
        assert slot.sample is not None
        return slot.sample

    async def abort_quietly(self, worker: str, request_ids: list[str]) -> None:
        """Tell ``worker`` to abort these requests, bounded; a failure is only logged (their
        samples, if any, are discarded when they come)."""
        with anyio.move_on_after(ABORT_TIMEOUT_S):
            try:
                await self._abort(worker, request_ids)
            except Exception as exc:  # noqa: BLE001 - the worker may be gone; nothing waits
                log.warning("request_abort_failed", worker=worker, requests=len(request_ids),
                            error=str(exc))  # fmt: skip


def build_asker(ctx: RunContext) -> Asker:
    """The run's asker: requests sent as one-request ``Generate`` casts (no reply: the sample
    is the answer), aborts as calls bounded by ``cluster.call_timeout_s``."""
    from asyncrl.wire.messages import Abort, Generate

    control, timeout = ctx.control, ctx.config.cluster.call_timeout_s

    async def send(worker: str, request: GenRequest) -> None:
        await control.cast_unless_restarting(worker, Generate(requests=[request]))

    async def abort(worker: str, request_ids: list[str]) -> None:
        await control.call_unless_restarting(worker, Abort(group_ids=request_ids),
                                             timeout_s=timeout)  # fmt: skip

    return Asker(ctx.rollout, ctx.groups, send=send, abort=abort, serving=ctx.serving,
                 changed=ctx.changed, seed=ctx.config.run.seed)  # fmt: skip
