"""Grouping parameters for a sharded exporter: consecutive runs under a byte budget."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["byte_groups"]


def byte_groups(nbytes: Sequence[int], budget: int) -> list[range]:
    """Split ``range(len(nbytes))`` into consecutive runs whose sizes add up to at most
    ``budget`` bytes each; a single item larger than the budget is a run of its own.

    A sharded trainer gathers one run at a time (one collective per run instead of one per
    tensor) and keeps at most one run's full tensors alive.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 byte, got {budget}")
    groups: list[range] = []
    start, used = 0, 0
    for i, size in enumerate(nbytes):
        if i > start and used + size > budget:
            groups.append(range(start, i))
            start, used = i, 0
        used += size
    if start < len(nbytes):
        groups.append(range(start, len(nbytes)))
    return groups
