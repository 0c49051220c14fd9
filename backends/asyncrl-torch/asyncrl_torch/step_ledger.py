"""The open optimizer step of a training backend: a pure state machine (no torch, no I/O).

``begin -> add_chunk* -> close`` (or ``discard``), one step at a time. It holds the rank's own
count of trained tokens (those the batches' ``loss_mask`` selects) and loss sum of the step,
which the backend all-reduces at ``finish_step`` and checks against the controller's count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["OpenStep", "StepLedger", "StepStateError"]


class StepStateError(RuntimeError):
    """A call arrived out of order (no open step, a second open step, a wrong step id)."""


@dataclass
class OpenStep:
    step: int
    started: float
    loss_tokens: int = 0
    loss_sum: float = 0.0
    chunks: int = 0


class StepLedger:
    """Which step is open on this rank, and what its chunks added up to."""

    def __init__(self) -> None:
        self._open: OpenStep | None = None

    @property
    def open(self) -> OpenStep | None:
        return self._open

    def begin(self, step: int) -> OpenStep:
        """Open ``step``. Opening the step that is open restarts it (what it had is dropped:
        the controller retries a step that failed on some rank); another open step is an
        error."""
        if self._open is not None and self._open.step != step:
            raise StepStateError(
                f"begin_step({step}): step {self._open.step} is still open; finish it first"
            )
        self._open = OpenStep(step=step, started=time.monotonic())
        return self._open

    def require(self, step: int, what: str) -> OpenStep:
        """The open step, which must be ``step``."""
        if self._open is None:
            raise StepStateError(f"{what}({step}): no optimizer step is open; call begin_step")
        if self._open.step != step:
            raise StepStateError(f"{what}({step}): the open step is {self._open.step}")
        return self._open

    def add_chunk(self, step: int, loss_tokens: int, loss_sum: float) -> None:
        open_step = self.require(step, "train_chunk")
        open_step.loss_tokens += loss_tokens
        open_step.loss_sum += loss_sum
        open_step.chunks += 1

    def close(self) -> OpenStep | None:
        """End the open step (finished or discarded); returns it, or ``None`` if none was."""
        open_step, self._open = self._open, None
        return open_step
