"""``[trainer.options]`` of the FSDP2 backend: the shared fields plus its own."""

from __future__ import annotations

from typing import Any, Literal

from asyncrl_torch.options import TrainerOptions
from asyncrl_torch.options import parse_options as parse_trainer_options

__all__ = ["FSDPOptions", "parse_options"]


class FSDPOptions(TrainerOptions, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of the ``fsdp2`` training backend (``[trainer.options]`` in the run config)."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """``sgd`` (no momentum) makes the update linear in the gradient; tests use it to check
    gradient normalization exactly."""
    reshard_after_forward: bool = True
    """Free gathered layer weights after each layer's forward (less memory, one more
    all-gather in backward)."""


def parse_options(raw: dict[str, Any]) -> FSDPOptions:
    """Convert and check ``trainer.options``.

    Raises:
        ConfigError: an unknown field, a wrong type or an out-of-range value (named).
    """
    return parse_trainer_options(raw, FSDPOptions, "docs/backends/fsdp.md")
