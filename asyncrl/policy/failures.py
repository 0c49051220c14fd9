"""What the run does when something fails but the workers live on (pure: the pipeline acts).

=========================================  ===================================================
failure                                    decision (``[failures]``)
=========================================  ===================================================
a generation fails in the engine or its    retried after a back-off (:data:`RETRY_BACKOFF_S`,
worker (any exception from ``generate``)   doubled each time), the same prompt for the same
                                           step, up to ``generation_retries`` times; then
                                           dropped
a generation fails because of the request  dropped at once (a retry would fail the same way)
itself (the backend raises ``RequestError``)
``score()`` raises or returns a            ``on_reward_error``: stop the run, or drop the group
non-finite reward, or a reward call runs
past ``reward_timeout_s``
a train call raises on a trainer rank      the step's groups go back to the buffer and the step
(``TrainChunk`` / ``FinishStep``; the      is assembled and trained again, up to
trainer drops the step's gradients)        :data:`TRAIN_STEP_RETRIES` times; then it stops
a step's loss or gradient norm is not      the trainer did not apply it (the weights are
finite                                     unchanged); skipped, up to ``max_nonfinite_steps``
                                           times in the run; then the run stops naming the
                                           likely cause (:func:`asyncrl.policy.grpo.nonfinite_cause`)
=========================================  ===================================================

Every drop is logged with the group, its prompt id and the error, counted in the prompt ledger
(``failed``) and in the step's metrics; ``max_failed_groups`` drops are tolerated, one more
stops the run with the last error. A worker that dies is not a failure of this kind: a rollout
worker is restarted in place and its groups are sent again outside this budget
(``failures.rollout_restarts``, :mod:`asyncrl.run.restarts`); a trainer's death stops the run
(which resumes from its last checkpoint).

The budget keeps no table of groups: how many times a group's generation was retried is the
live groups' to count, with the group (:class:`~asyncrl.policy.groups.Group`), and is handed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import structlog

from asyncrl.errors import RunError

__all__ = ["RETRY_BACKOFF_S", "TRAIN_STEP_RETRIES", "FailureBudget", "FailureLimits"]

log = structlog.get_logger("asyncrl.policy.failures")

RETRY_BACKOFF_S = 1.0
"""Wait before the first retry of a group whose generation failed; doubled for each further
one (1, 2, 4 s for ``failures.generation_retries = 3``): long enough for an engine that
restarts a request queue, short against a step. Read when a retry is scheduled, so a test sets
it lower (tests/integration/test_failures.py). Once the config key ``failures.retry_backoff_s``
(issue 50)."""

TRAIN_STEP_RETRIES = 1
"""Times a step whose train call raised on a trainer rank (out of memory in one
micro-batch...; the trainer drops the step's gradients) is trained again from the same groups;
then the run stops. One: a passing failure (a fragmented allocator) is survived, a repeatable
one stops the run at the second try instead of looping. A trainer that died or hung is not
retried. Once the config key ``failures.train_step_retries`` (issue 50)."""


class FailureLimits(Protocol):
    """What the budget reads of ``[failures]`` (:class:`asyncrl.config.FailuresConfig` is one:
    the policy states what it needs rather than importing the config above it)."""

    @property
    def generation_retries(self) -> int: ...
    @property
    def max_failed_groups(self) -> int: ...
    @property
    def max_nonfinite_steps(self) -> int: ...


@dataclass
class FailureBudget:
    """Retry decisions and counts for one run."""

    config: FailureLimits
    step_failures: int = 0
    """Failures of the step being assembled now (reset when a step succeeds)."""
    nonfinite_steps: int = 0
    """Steps skipped (or about to stop the run) because their loss or grad norm was not
    finite."""

    def generation_failed(
        self,
        group_id: str,
        prompt_id: str,
        *,
        retries: int,
        retryable: bool,
        error: str,
        worker: str,
    ) -> float | None:
        """A group's generation failed, after ``retries`` earlier failures that were retried:
        seconds to wait before it is retried, or ``None`` to drop it (the caller drops it,
        and then asks :meth:`check_dropped`)."""
        attempt = retries + 1
        retry = retryable and attempt <= self.config.generation_retries
        fields = dict(group_id=group_id, prompt_id=prompt_id, worker=worker, error=error,
                      attempt=attempt)  # fmt: skip
        if not retry:
            why = "retries spent" if retryable else "the request itself is at fault"
            log.error("generation_failed", action=f"dropped ({why})", **fields)
            return None
        delay = RETRY_BACKOFF_S * 2 ** (attempt - 1)
        log.warning("generation_failed", action=f"retry in {delay:g} s", **fields)
        return delay

    def check_dropped(self, dropped: int, what: str) -> None:
        """``dropped`` groups failed for good so far, the last ``what`` (which and why):
        raise once the budget is spent."""
        limit = self.config.max_failed_groups
        if dropped > limit and "Fix:" in what:  # the cause names its fix: the one Fix here
            raise RunError(f"{dropped} groups failed for good (failures.max_failed_groups = "
                           f"{limit}; raise it to tolerate more); the last: {what}")  # fmt: skip
        if dropped > limit:
            raise RunError(
                f"{dropped} groups failed for good (failures.max_failed_groups = "
                f"{limit}); the last: {what}. Fix: see the generation_failed / reward_failed "
                "log lines for the cause; raise failures.max_failed_groups to tolerate more"
            )

    def step_failed(self, step: int, error: str) -> bool:
        """A train call of step ``step`` failed on a trainer: whether to train it again."""
        self.step_failures += 1
        retry = self.step_failures <= TRAIN_STEP_RETRIES
        action = "the step's groups go back; training it again" if retry else "stop"
        log.error(
            "train_step_failed", step=step, error=error, attempt=self.step_failures, action=action
        )
        return retry

    def step_done(self) -> None:
        self.step_failures = 0

    def nonfinite_step(self, step: int, loss: float, grad_norm: float) -> bool:
        """Step ``step``'s loss or gradient norm is not finite (the trainer did not apply the
        update): whether the run skips it (``True``) or stops."""
        self.nonfinite_steps += 1
        limit = self.config.max_nonfinite_steps
        skip = self.nonfinite_steps <= limit
        log.error(
            "step_not_finite",
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            nonfinite_steps=self.nonfinite_steps,
            max_nonfinite_steps=limit,
            action="skipped (the weights are unchanged)" if skip else "stop",
        )
        return skip
