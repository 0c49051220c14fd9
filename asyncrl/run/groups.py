"""What a prompt group carries once its samples are back: the payload the trainer packs.

Pure data. Which groups exist, in which state, and when they may be trained is the
scheduler's business (:mod:`asyncrl.policy.schedule`); the controller keeps one :class:`Group` per
complete, untrained group, keyed by group id, and drops it when the scheduler says the group
was trained, evicted or left unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompletedSample", "Group"]


@dataclass(frozen=True)
class CompletedSample:
    token_ids: Any  # int32 array
    logprobs: Any  # float32 array, aligned with token_ids
    finish_reason: str
    reward: float
    correct: bool
    components: Mapping[str, float] = field(default_factory=dict)
    """The score's named parts (``Score.components``; empty when restored from a checkpoint)."""


@dataclass
class Group:
    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    start_version: int
    target_step: int | None
    dispatched_at: float
    samples: list[CompletedSample] = field(default_factory=list)
    end_version: int | None = None
    """The generators' version when the last sample came back."""
    committed_at: float | None = None
    index: int = field(kw_only=True)
    """The group's position in the prompt stream (what the prompt ledger records)."""
    worker: str = field(default="", kw_only=True)
    """The rollout worker that generated it ("" for a group restored from a checkpoint)."""
    prompt_text: str = field(default="", kw_only=True)
    """The prompt as one line of text, for completion tables ("" when restored)."""
