"""``[trainer.options]`` fields every first-party training backend shares (msgspec; no torch).

A backend subclasses :class:`TrainerOptions` with its own fields and converts the table with
:func:`parse_options`, which the backend's ``check_config`` also runs in the controller before
any worker starts.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from asyncrl.plugin.common import ConfigError, explain

__all__ = ["TrainerOptions", "option_error", "parse_options"]

OptionsT = TypeVar("OptionsT", bound="TrainerOptions")


class TrainerOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options shared by the ``fsdp2`` and ``deepspeed`` backends."""

    lr: float = 1e-4
    """Learning rate (constant)."""
    weight_decay: float = 0.0
    """Weight decay: decoupled for AdamW, added to the gradient (L2) for SGD."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient 2-norm to this value; 0 disables clipping (the norm is still
    reported)."""
    reference_offload: bool = False
    """With ``loss.kl_coef > 0``: keep the reference policy in host memory between refreshes
    (moved to the device for each reference forward: less device memory, a copy per step)."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """Compute dtype of forward/backward. Master weights and optimizer state stay float32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    from the forward: about one layer's activations held instead of every layer's, for about
    a third more compute per micro-batch. Results are unchanged. Set it when a long
    micro-batch runs out of memory (docs/one-gpu.md)."""
    attn_implementation: str = "sdpa"
    """Passed to ``from_pretrained`` (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    num_threads: int = 1
    """torch intra-op CPU threads per rank (0 leaves torch's default)."""
    seed: int | None = None
    """torch seed on every rank; ``None`` uses ``run.seed``."""
    job_slots: int = 0
    """With ``[lora]``: adapters the trainer holds for jobs beside the run's own, made at start
    (docs/jobs.md); the jobs open at once. ``fsdp2`` only."""


def option_error(field: str, problem: str) -> ConfigError:
    """A :class:`ConfigError` naming ``trainer.options.{field}``."""
    return ConfigError(f"trainer.options.{field}: {problem}")


def parse_options(raw: dict[str, Any], cls: type[OptionsT], docs: str) -> OptionsT:
    """Convert ``trainer.options`` into ``cls`` and check the shared fields.

    Args:
        raw: The table as loaded.
        cls: The backend's :class:`TrainerOptions` subclass.
        docs: Where the options are documented (named in the error).

    Raises:
        ConfigError: an unknown field, a wrong type or an out-of-range value (named).
    """
    if "proximal_policy" in raw:
        raise option_error(
            "proximal_policy",
            "moved to [loss] (the controller plans the logprob refresh it needs). Fix: "
            f"remove it here and set loss.proximal_policy = {raw['proximal_policy']!r}",
        )
    try:
        opts = msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, cls, "trainer.options") + f" (options: {docs})") from None
    if not opts.lr > 0:
        raise option_error("lr", f"must be > 0, got {opts.lr}")
    if opts.job_slots < 0:
        raise option_error("job_slots", f"must be >= 0, got {opts.job_slots}")
    if opts.weight_decay < 0:
        raise option_error("weight_decay", f"must be >= 0, got {opts.weight_decay}")
    if not all(0 <= b < 1 for b in opts.betas):
        raise option_error("betas", f"both must lie in [0, 1), got {list(opts.betas)}")
    if not opts.eps > 0:
        raise option_error("eps", f"must be > 0, got {opts.eps}")
    if opts.max_grad_norm < 0:
        raise option_error(
            "max_grad_norm", f"must be >= 0 (0: no clipping), got {opts.max_grad_norm}"
        )
    if opts.num_threads < 0:
        raise option_error(
            "num_threads", f"must be >= 0 (0: torch's default), got {opts.num_threads}"
        )
    return opts
