"""A prompt group's payload, one object from dispatch to the optimizer step.

Pure data. The :class:`~asyncrl.run.book.RolloutBook` keeps one :class:`Group` per group it
tracks (the scheduler keeps the group's state, :mod:`asyncrl.policy.schedule`); the same object
goes from generating to scored to trained, so a sample is reshaped only where it must be: the
raw sample as it arrives, then the scored sample the trainer packs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from asyncrl.environment import Prompt

__all__ = ["CompletedSample", "Group", "Rewards"]


@dataclass(frozen=True)
class CompletedSample:
    token_ids: Any  # int32 array
    logprobs: Any  # float32 array, aligned with token_ids
    finish_reason: str
    reward: float
    correct: bool
    components: Mapping[str, float] = field(default_factory=dict)
    """The score's named parts (``Score.components``; empty when restored from a checkpoint)."""


class Rewards(Sequence[float]):
    """A scored group's rewards, read through from its samples (kept once: what samplers see
    as ``GroupView.rewards`` is not a copy)."""

    __slots__ = ("_samples",)

    def __init__(self, samples: Sequence[CompletedSample]) -> None:
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> list[float]: ...
    def __getitem__(self, i: int | slice) -> float | list[float]:
        if isinstance(i, slice):
            return [s.reward for s in self._samples[i]]
        return self._samples[i].reward

    def __repr__(self) -> str:
        return f"Rewards({list(self)!r})"


@dataclass
class Group:
    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    start_version: int
    target_step: int | None
    dispatched_at: float
    samples: list[Any] = field(default_factory=list)
    """While generating: the raw samples (``asyncrl.wire.messages.Sample``) by index as they
    arrive, ``None`` for those still coming. Once scored: its :class:`CompletedSample` s."""
    end_version: int | None = None
    """The generators' version when the group was committed."""
    committed_at: float | None = None
    index: int = field(kw_only=True)
    """The group's position in the prompt stream (what the prompt ledger records)."""
    worker: str = field(default="", kw_only=True)
    """The rollout worker that generates (or generated) it ("" for a group restored from a
    checkpoint, or an evaluation group not sent yet)."""
    prompt_text: str = field(default="", kw_only=True)
    """The prompt as one line of text, for completion tables ("" when restored)."""
    prompt: Prompt | None = field(default=None, kw_only=True, repr=False)
    """The prompt itself, for scoring and for dispatching the group again (``None`` when
    restored from a checkpoint: such a group is scored already)."""

    @property
    def rewards(self) -> Rewards:
        """The scored samples' rewards (a view, not a copy)."""
        return Rewards(self.samples)
