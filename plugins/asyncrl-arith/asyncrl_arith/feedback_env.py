"""``arithmetic-feedback``: two-digit addition with a second try after feedback.

A prompt is one user message, ``"38+45"`` (the problems and splits of the ``arithmetic``
environment, same seed and options); the model answers; a wrong answer gets a user message,
``wrong, try again``, and the model answers once more::

    <bos>38+45=73<eos>wrong, try again=83<eos>

Rewards: 1 for the right first answer, ``retry_reward`` (0.5) for a right second one, else 0.
Half, not 1: a right answer at once must stay worth more than a wrong one fixed, or GRPO
would have no reason to get the first answer right (a policy that always errs first and
then fixes would score as well); above 0, so that a right second answer still beats a
wrong one within a group and the second turn learns. ``correct`` is the final answer right
(the accuracy evaluation reports); the components: ``first`` (first answer right),
``second`` (second answer right, 0 when there was none) and ``retried`` (feedback was given).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from asyncrl.plugin.common import ConfigError
from asyncrl.plugin.environment import Prompt, Score

from .env import ArithmeticOptions, make_environment as make_arithmetic

__all__ = ["FEEDBACK", "FeedbackEnv", "FeedbackOptions", "make_environment", "score_turns"]

FEEDBACK = "wrong, try again"
"""The feedback message (the tiny vocabulary's characters)."""


class FeedbackOptions(ArithmeticOptions, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``arithmetic``'s options and the reward of a right second answer."""

    retry_reward: float = 0.5
    """Reward of a right answer after the feedback (the module docstring says why 0.5)."""


class FeedbackEnv:
    """The environment; see the module docstring."""

    def __init__(self, options: FeedbackOptions, seed: int) -> None:
        base_options = {f: getattr(options, f) for f in ArithmeticOptions.__struct_fields__}
        base = make_arithmetic(base_options, seed)
        self.retry_reward = options.retry_reward
        self._splits = {
            split: tuple(Prompt(id=p.id, messages=[{"role": "user", "content": p.text[:-1]}],
                                answer=p.answer) for p in base.dataset(split))  # fmt: skip
            for split in ("train", "eval")
        }

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split`` (``arithmetic``'s, as a user message without ``=``)."""
        try:
            return self._splits[split]
        except KeyError:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'") from None

    async def run_episode(self, prompt: Prompt, episode: Any) -> Score:
        """One answer; after a wrong one, the feedback and a second answer.

        Raises:
            EpisodeLimit: ``episode.max_turns`` is 1 (the run scores the episode 0).

        Cancellation: the turn's request is aborted.
        """
        answers = [(await episode.generate()).text]
        if answers[0].rstrip() != prompt.answer:
            episode.add_messages({"role": "user", "content": FEEDBACK})
            answers.append((await episode.generate()).text)
        return score_turns(prompt, answers, self.retry_reward)


def score_turns(prompt: Prompt, answers: Sequence[str], retry_reward: float = 0.5) -> Score:
    """The score of an episode's answers (one or two; trailing whitespace ignored)."""
    right = [a.rstrip() == prompt.answer for a in answers]
    first = right[0]
    second = len(right) > 1 and right[1]
    reward = 1.0 if first else retry_reward if second else 0.0
    return Score(reward=reward, correct=first or second,
                 components={"first": float(first), "second": float(second),
                             "retried": float(len(right) > 1)})  # fmt: skip


def make_environment(options: dict[str, Any], seed: int) -> FeedbackEnv:
    """Entry point ``asyncrl.environments:arithmetic-feedback``.

    Raises:
        ConfigError: an option is unknown, mistyped or out of range (the message names it).
    """
    try:
        opts = msgspec.convert(dict(options), FeedbackOptions)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"environment.options: {exc}") from None
    if not 0.0 <= opts.retry_reward <= 1.0:
        raise ConfigError(f"environment.options.retry_reward: is {opts.retry_reward}. Fix: use a "
                          "value within [0, 1] (below 1 keeps a right first answer worth more)")
    return FeedbackEnv(opts, seed)
