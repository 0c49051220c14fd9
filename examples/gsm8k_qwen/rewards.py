"""Rewards for the GSM8K recipe (``run.toml``: ``rewards:correct`` and ``rewards:formatted``).

The system prompt asks for the final answer on a last line ``#### <number>``.
"""

from __future__ import annotations

import re

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract(completion: str) -> str | None:
    """The number after the last ``####`` (commas dropped), or None."""
    found = _FINAL.findall(completion)
    return found[-1].replace(",", "") if found else None


def _same(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b


def correct(completion: str, answer: dict) -> float:
    """1 when the final number equals the reference answer (``3.0`` equals ``3``)."""
    got = extract(completion)
    return float(got is not None and _same(got, str(answer["answer"])))


def formatted(completion: str) -> float:
    """1 when the completion ends with a ``#### <number>`` line (a small shaping term)."""
    lines = completion.strip().splitlines()
    return float(bool(lines) and _FINAL.fullmatch(lines[-1].strip()) is not None)
