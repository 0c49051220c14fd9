"""Reward functions for ``examples/jsonl_arith/run.toml``, named by import path there
(``rewards:exact_match``): this file sits beside the config, which puts it on the import path.

A reward function takes any of ``completion`` (the decoded text), ``answer`` (the row's answer
fields) and ``prompt`` (the :class:`asyncrl.environment.Prompt`) by name, and returns a number
or a bool; ``async def`` works too (e.g. a call to a judge model).
"""

from __future__ import annotations


def exact_match(completion: str, answer: dict) -> float:
    """1 when the completion is the answer (trailing whitespace ignored), else 0."""
    return float(completion.rstrip() == str(answer["answer"]))


def brevity(completion: str) -> float:
    """A small shaping term: 1 for an answer of at most 4 characters, falling to 0 at 8."""
    return max(0.0, min(1.0, (8 - len(completion.strip())) / 4))
