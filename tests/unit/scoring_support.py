"""Scoring set-up shared by test_dataset_env.py and test_reward_deadlines.py: a tokenizer
whose ids are digits, and a generated group ready for the scorer."""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.environment import Prompt
from asyncrl.policy.groups import Group
from asyncrl.wire.messages import Sample


class DigitsTokenizer:
    """Token ids are digits: decode([1, 2]) == "12"."""

    def decode(self, ids: Any) -> str:
        return "".join(str(int(i)) for i in ids)


def group_of(prompt: Prompt, completions: list[list[int]]) -> Group:
    """Group ``g0`` of ``prompt`` on ``rollout:0``, one finished sample per completion (its
    token ids; log-probabilities -0.5)."""
    pending = Group("g0", prompt.id, [1], 0, None, 0.0, index=0, worker="rollout:0", prompt=prompt)
    pending.samples = [
        Sample(np.array(c, dtype=np.int32), np.full(len(c), -0.5, dtype=np.float32), "stop")
        for c in completions
    ]
    return pending
