"""What every config section shares: the struct options, and the checks many sections make.

Each section lives with its own checks (a ``problems()`` method naming its fields as
``<section>.<field>``); :func:`asyncrl.config.problems` gathers them.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from asyncrl.errors import ConfigError
from asyncrl.errors import config_error as fail

__all__ = ["Section", "at_least_one", "fail", "not_negative"]


class Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A config table: frozen, keyword-only, and an unknown key is an error that names it."""


def at_least_one(values: Mapping[str, int]) -> list[ConfigError]:
    """A problem for each ``{"section.field": value}`` below 1."""
    return [
        fail(name, f"must be >= 1, got {value}", f"set {name} to a positive integer")
        for name, value in values.items()
        if value < 1
    ]


def not_negative(
    values: Mapping[str, float], fix: str = "use 0 to turn it off"
) -> list[ConfigError]:
    """A problem for each ``{"section.field": value}`` below 0; ``fix``: what 0 means for
    these fields (by default it turns the feature off)."""
    return [
        fail(name, f"must be >= 0, got {value}", fix)
        for name, value in values.items()
        if value < 0
    ]
