"""What the rollout phase answers and decides (pure data): the kind of each message from a
rollout worker (:class:`Arrival`), a group dispatched (:class:`Sent`), what a lost worker left
(:class:`Lost`), what an abort must reach (:class:`Aborts`), and the checks of one sample
(:mod:`asyncrl.run.rollout_phase`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.policy.groups import Group
from asyncrl.run.requests import Request
from asyncrl.wire.messages import GroupFailed, Sample, SampleDone

if TYPE_CHECKING:
    from asyncrl.environment import Prompt

__all__ = [
    "ENDED",
    "STICKY_TURNS",
    "Aborts",
    "Arrival",
    "ArrivalKind",
    "Lost",
    "RolloutError",
    "Sent",
    "malformed",
    "store",
    "stranger",
]

class ArrivalKind(enum.Enum):
    """What a message from a rollout worker turned out to be (:attr:`Arrival.kind`).

    For a sample (:meth:`RolloutPhase.sample_arrived`):

    - ``REJECTED``: a stranger's (no such request in flight on that worker) or a duplicate:
      nothing changed;
    - ``MALFORMED``: a sample from the right worker that breaks the contract: nothing changed;
      stop the run;
    - ``PENDING``: stored; more episodes of its group are to come;
    - ``DISCARDED``: the last sample of a group being aborted (the group is gone), or an
      abandoned request's;
    - ``COMPLETE``: the last episode of its group: score the group, then
      :meth:`RolloutPhase.commit` it (or :meth:`RolloutPhase.score_failed`);
    - ``ANSWER``: the sample of an answered request (an episode's turn, an evaluation's
      prompt): hand it to whoever waits for it.

    For a ``GroupFailed`` (:meth:`RolloutPhase.check_failure`): ``REJECTED``; ``IN_FLIGHT`` (a
    group in flight: decide, then :meth:`RolloutPhase.failed`); ``ANSWER_FAILED`` (an answered
    request, gone: tell whoever waits); ``DISCARDED`` (an abandoned request's).

    A multi-turn episode's end (:meth:`RolloutPhase.episode_ended`) is ``PENDING``,
    ``DISCARDED`` or ``COMPLETE``, as a sample is.
    """

    REJECTED = "rejected"
    MALFORMED = "malformed"
    PENDING = "pending"
    DISCARDED = "discarded"
    COMPLETE = "complete"
    ANSWER = "answer"
    IN_FLIGHT = "in_flight"
    ANSWER_FAILED = "answer_failed"


STICKY_TURNS = 4
"""An episode's next turn stays on the worker that served its last one (whose prefix cache
holds the conversation) while that worker has at most this many more requests in flight than
the least loaded one."""

ENDED = "ended"
"""The sample slot of an episode that ended without a sample (cancelled by an abort)."""


class RolloutError(RuntimeError):
    """An event the rollout phase's state does not allow (a bug in a caller)."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """What :meth:`RolloutPhase.sample_arrived` or :meth:`RolloutPhase.check_failure` found."""

    kind: ArrivalKind
    group: Group | None = None
    """``COMPLETE``: the group to score (read it; the rollout phase changes it only at
    :meth:`RolloutPhase.commit`). ``IN_FLIGHT``: the group that failed."""
    detail: str = ""
    """``REJECTED`` / ``MALFORMED``: what is wrong."""
    aborting: bool = False
    """``IN_FLIGHT``: the group is being aborted (already counted; nothing to retry)."""
    request: Request | None = None
    """``ANSWER`` / ``ANSWER_FAILED``: the answered request (no longer in flight)."""
    sample: Sample | None = None
    """``ANSWER``: its sample."""


@dataclass(frozen=True, slots=True)
class Sent:
    """A group to request from ``worker``: ``n`` samples of ``prompt_ids``."""

    group_id: str
    worker: str
    """``""`` for a group of episodes (each turn picks its worker)."""
    prompt_ids: list[int]
    n: int
    prompt: Prompt | None = None
    """The prompt itself (what an episode starts from)."""


@dataclass(frozen=True)
class Lost:
    """What :meth:`RolloutPhase.worker_lost` did."""

    again: int
    """Groups dispatched again."""
    answered: list[Request]
    """Answered requests that were on the worker (tell whoever waits for each)."""


@dataclass(frozen=True)
class Aborts:
    """Groups aborted at a refit or at the end of the run."""

    by_worker: dict[str, list[str]]
    """Requests on an engine (a group's id, an episode's turn's), by worker: each must abort
    its own (their samples still come back, cut short, and then the group is gone)."""
    gone: list[str]
    """Groups that were waiting for their retry: nothing of theirs is on an engine; gone."""
    episodes: list[str] = field(default_factory=list)
    """Groups of episodes: cancel their episodes (each ends with no sample)."""
    turns: int = 0
    """How many of the ids in ``by_worker`` are episodes' turns."""

    @property
    def count(self) -> int:
        """Groups aborted."""
        on_engines = sum(map(len, self.by_worker.values())) - self.turns
        return len(self.gone) + len(self.episodes) + on_engines


def malformed(sample: Sample, dispatched_at: int) -> str:
    """What is wrong with one sample ("" when nothing): the arrays' shapes, dtypes and
    alignment, the logprobs' values, and its tokens' versions: none may be older than
    ``dispatched_at``, the version the generators served when its request was sent (nothing
    is sent during a refit). This is what makes the staleness bound, which the scheduler
    keeps on that version, hold for every token."""
    tokens, lps, versions = sample.token_ids, sample.logprobs, sample.versions
    if not all(isinstance(a, np.ndarray) for a in (tokens, lps, versions)):
        return "token ids, logprobs and versions must be arrays"
    if tokens.ndim != 1 or lps.ndim != 1 or tokens.size != lps.size:
        return f"{tokens.shape} tokens but {lps.shape} logprobs"
    if tokens.dtype.kind not in "iu" or lps.dtype.kind != "f":
        return f"token dtype {tokens.dtype}, logprob dtype {lps.dtype}"
    # a NaN or an infinity anywhere makes the sum non-finite
    if tokens.size and (
        tokens.min() < 0 or not math.isfinite(float(lps.sum())) or lps.max() > 1e-3
    ):
        return "negative token ids, or logprobs that are not finite and <= 0"
    if versions.size == 0:
        return ""
    if versions.shape != tokens.shape or versions.dtype.kind not in "iu":
        return f"{tokens.shape} tokens but versions of shape {versions.shape} ({versions.dtype})"
    if versions.min() < dispatched_at:
        return (
            f"a token of weight version {int(versions.min())}, older than v{dispatched_at} that "
            "the generators served when the request was sent"
        )
    return ""


def stamped(sample: Sample, dispatched_at: int) -> Sample:
    """``sample`` with one version per token: as the engine reported them, or, when it could
    not tell, ``dispatched_at`` for every token (the oldest they can be)."""
    if sample.versions.size == sample.token_ids.size:
        return sample
    versions = np.full(sample.token_ids.size, dispatched_at, np.int32)
    return Sample(sample.token_ids, sample.logprobs, sample.finish_reason, versions)


def stranger(msg: SampleDone | GroupFailed, on_worker: bool) -> Arrival:
    return Arrival(
        ArrivalKind.REJECTED,
        detail=f"{type(msg).__name__} for group {msg.group_id!r}, which is not generating"
        + (f" on {msg.worker!r}" if on_worker else ""),
    )


def store(group: Group, msg: SampleDone) -> Arrival | None:
    """Put ``msg``'s sample into ``group`` (``None``), or say why not."""
    samples = group.samples
    if not 0 <= msg.index < len(samples) or samples[msg.index] is not None:
        return Arrival(
            ArrivalKind.REJECTED,
            detail=f"sample {msg.index} of group {msg.group_id!r}: out of range or already "
            "received",
        )
    problem = malformed(msg.sample, group.start_version)
    if problem:
        return Arrival(ArrivalKind.MALFORMED, detail=problem)
    samples[msg.index] = stamped(msg.sample, group.start_version)
    return None
