"""The environment contract (single-turn, verifiable reward).

An environment distribution registers a factory under ``asyncrl.environments``::

    [project.entry-points."asyncrl.environments"]
    arithmetic = "asyncrl_arith.env:make_environment"

The factory is called as ``factory(options: dict, seed: int)`` in the controller process and
returns an object implementing :class:`Environment`. Reward functions are plain blocking
callables; the controller runs them off its event loop.

Multi-turn environments will get their own protocol next to this one; a single-turn
environment will keep working unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["Environment", "Prompt", "Score"]


@dataclass(frozen=True)
class Prompt:
    """One task instance."""

    id: str
    """Stable across runs with the same seed and options (used for resume and logs)."""
    text: str
    """The prompt text, tokenized by the controller with the model's tokenizer."""
    answer: Any = None
    """Whatever the reward needs (JSON-like)."""


@dataclass(frozen=True)
class Score:
    reward: float
    """The scalar reward used for advantages."""
    correct: bool = False
    """Whether the completion solved the task (for accuracy metrics)."""


@runtime_checkable
class Environment(Protocol):
    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split``; deterministic for a given seed and options. The eval
        split must be disjoint from the train split."""

    def score(self, prompt: Prompt, completion: str) -> Score:
        """Score one completion (blocking is fine: it runs in a worker thread, up to four at
        once, so keep it thread-safe).

        ``completion`` is the generated token ids decoded with the model's tokenizer, EOS
        tokens dropped and special tokens skipped; nothing else is stripped. An exception here,
        or a reward that is not a finite number, ends the run with a ``RunError`` naming the
        environment, the prompt id and the completion."""
