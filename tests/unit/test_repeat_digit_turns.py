"""The testing environment ``repeat-digit-turns`` and its ``turns`` option, driven by a
scripted episode (no engine): the conversation it builds and the score, against hand counts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl.env.episode import Turn  # noqa: E402
from asyncrl.errors import ConfigError  # noqa: E402
from asyncrl_example_backend.testenv import make_turns_environment  # noqa: E402

class Scripted:
    """An episode whose turns are given texts; it logs what the environment does."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.log: list[Any] = []

    async def generate(self) -> Turn:
        self.log.append("generate")
        return Turn(self.texts.pop(0), np.zeros(0, np.int32), "stop", 0)

    def add_messages(self, *messages: dict[str, str]) -> None:
        self.log.extend(messages)


@pytest.mark.asyncio
async def test_two_turns_by_default() -> None:
    env = make_turns_environment({}, seed=0)
    prompt = env.dataset("train")[0]
    d = prompt.answer
    episode = Scripted([d + d, "x"])
    score = await env.run_episode(prompt, episode)
    assert episode.log == ["generate", {"role": "user", "content": d}, "generate"]
    assert score.reward == 0.5 and not score.correct
    assert score.components == {"first": 1.0, "second": 0.0}


@pytest.mark.asyncio
async def test_four_turns_a_user_turn_between_each_two() -> None:
    env = make_turns_environment({"turns": 4}, seed=0)
    prompt = env.dataset("train")[0]
    d = prompt.answer
    other = "x"
    episode = Scripted([d, other, d + d, "a" + d])
    score = await env.run_episode(prompt, episode)
    user = {"role": "user", "content": d}
    assert episode.log == ["generate", user, "generate", user, "generate", user, "generate"]
    assert score.reward == 3 / 4  # turns 1, 3, 4 contain the digit
    assert not score.correct  # turns 2 and 4 hold other characters
    assert score.components == {"first": 1.0, "second": 0.0, "third": 1.0, "fourth": 1.0}
    all_right = await env.run_episode(prompt, Scripted([d] * 4))
    assert all_right.reward == 1.0 and all_right.correct


@pytest.mark.asyncio
async def test_twelve_turns_name_the_later_ones_by_number() -> None:
    env = make_turns_environment({"turns": 12}, seed=0)
    prompt = env.dataset("train")[0]
    score = await env.run_episode(prompt, Scripted([prompt.answer] * 12))
    assert list(score.components)[9:] == ["tenth", "turn11", "turn12"]


def test_turns_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"environment.options.turns: must be >= 1, got 0"):
        make_turns_environment({"turns": 0}, seed=0)
