"""What comes in on the data socket, before the scheduler sees it (pure helpers of the
pipeline): a group's samples as they arrive, the checks every sample passes, scoring, and the
wake-up signal the pumps wait on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from .buffer import CompletedSample
from .environment import Environment, Prompt
from .errors import RunError
from .messages import Sample
from .prompts import Tokenizer

__all__ = ["Generating", "Signal", "malformed", "score_samples"]


class Signal:
    """Wake every waiter on the next :meth:`notify` (an event re-armed after each use; a
    notify with nobody waiting costs nothing, which matters at thousands of samples a
    second)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


@dataclass
class Generating:
    """A group whose samples are coming back: its prompt, where it runs, what arrived."""

    prompt: Prompt
    prompt_ids: list[int]
    worker: str
    n: int
    start_version: int
    target_step: int | None
    dispatched_at: float
    samples: list[Sample | None] = field(default_factory=list)
    eval_done: anyio.Event | None = None
    """Set for evaluation groups (the scheduler does not track them)."""

    def __post_init__(self) -> None:
        self.samples = [None] * self.n


def malformed(sample: Sample) -> str:
    """What is wrong with one sample ("" when nothing): the arrays' shapes, dtypes and
    alignment, the logprobs' values."""
    tokens, lps = sample.token_ids, sample.logprobs
    if not isinstance(tokens, np.ndarray) or not isinstance(lps, np.ndarray):
        return "token ids and logprobs must be arrays"
    if tokens.ndim != 1 or lps.ndim != 1 or tokens.size != lps.size:
        return f"{tokens.shape} tokens but {lps.shape} logprobs"
    if tokens.dtype.kind not in "iu" or lps.dtype.kind != "f":
        return f"token dtype {tokens.dtype}, logprob dtype {lps.dtype}"
    # a NaN or an infinity anywhere makes the sum non-finite
    if tokens.size and (
        tokens.min() < 0 or not math.isfinite(float(lps.sum())) or lps.max() > 1e-3
    ):
        return "negative token ids, or logprobs that are not finite and <= 0"
    return ""


def score_samples(
    env: Environment, tok: Tokenizer, env_name: str, prompt: Prompt, samples: list[Any]
) -> list[CompletedSample]:
    """Decode and score each sample (runs in a worker thread).

    Raises:
        RunError: ``score()`` raised or returned a non-finite reward (naming the environment,
            the prompt and the completion).
    """
    out = []
    for s in samples:
        completion = tok.decode(s.token_ids)
        try:
            score = env.score(prompt, completion)
            reward = float(score.reward)
        except Exception as exc:
            raise RunError(
                f"environment {env_name!r} (environment.name): score() raised "
                f"{type(exc).__name__}: {exc} for prompt {prompt.id!r} and completion "
                f"{completion[:80]!r}"
            ) from exc
        if not math.isfinite(reward):
            raise RunError(
                f"environment {env_name!r} (environment.name): score() returned a non-finite "
                f"reward ({reward}) for prompt {prompt.id!r} and completion "
                f"{completion[:80]!r}; rewards must be finite numbers"
            )
        out.append(
            CompletedSample(s.token_ids, s.logprobs, s.finish_reason, reward, bool(score.correct))
        )
    return out
