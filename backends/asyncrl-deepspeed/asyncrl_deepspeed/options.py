"""``[trainer.options]`` of the DeepSpeed backend: the shared fields plus its own."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncrl_torch.options import TrainerOptions, option_error
from asyncrl_torch.options import parse_options as parse_trainer_options

__all__ = ["DeepSpeedOptions", "OWNED_ZERO_KEYS", "parse_options"]

OWNED_ZERO_KEYS = frozenset({"stage"})
"""``zero_optimization`` keys the backend sets itself (from ``zero_stage``)."""


class DeepSpeedOptions(TrainerOptions, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of the ``deepspeed`` training backend (``[trainer.options]`` in the run config)."""

    zero_stage: Literal[2, 3] = 2
    """ZeRO stage: 2 shards optimizer state and gradients (every rank keeps the whole model,
    so weight export needs no collective); 3 also shards the parameters (least memory; each
    forward and the weight export gather them)."""
    zero: dict[str, Any] = msgspec.field(default_factory=dict)
    """Further keys of DeepSpeed's ``zero_optimization`` section, passed through as given
    (e.g. ``offload_optimizer = {device = "cpu"}``, ``reduce_bucket_size``,
    ``stage3_prefetch_bucket_size``). ``stage`` is set from ``zero_stage``."""
    export_bucket_mb: int = 512
    """ZeRO-3 weight export: parameters are gathered in groups of about this many MB (at
    ``model.dtype``), one all-gather per group; each group stays gathered while it is sent."""


def parse_options(raw: dict[str, Any]) -> DeepSpeedOptions:
    """Convert and check ``trainer.options``.

    Raises:
        ConfigError: an unknown field, a wrong type or an out-of-range value (named).
    """
    opts = parse_trainer_options(raw, DeepSpeedOptions, "docs/backends/deepspeed.md")
    if opts.job_slots:
        raise option_error("job_slots", "jobs train on the fsdp2 backend only (DeepSpeed's "
                           "engine steps one optimizer); use trainer.backend = \"fsdp2\"")  # fmt: skip
    owned = sorted(OWNED_ZERO_KEYS & set(opts.zero))
    if owned:
        raise option_error(
            f"zero.{owned[0]}", "is set by the backend; use trainer.options.zero_stage instead"
        )
    if opts.export_bucket_mb < 1:
        raise option_error("export_bucket_mb", f"must be >= 1, got {opts.export_bucket_mb}")
    return opts
