"""``[trainer.options]`` of the FSDP2 backend."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncrl.config import explain
from asyncrl.errors import ConfigError

__all__ = ["FSDPOptions", "parse_options"]


class FSDPOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of the ``fsdp2`` training backend (``[trainer.options]`` in the run config)."""

    lr: float = 1e-4
    """Learning rate (constant)."""
    weight_decay: float = 0.0
    """Weight decay: decoupled for AdamW, added to the gradient (L2) for SGD."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """``sgd`` (no momentum) makes the update linear in the gradient; tests use it to check
    gradient normalization exactly."""
    max_grad_norm: float = 1.0
    """Clip the global gradient 2-norm to this value; 0 disables clipping (the norm is still
    reported)."""
    proximal_policy: Literal["behaviour", "current"] = "behaviour"
    """The PPO ratio's denominator. ``behaviour``: the generator's logprobs (``r`` is the
    trainer/generator ratio, the IS weight is 1). ``current``: the trainer's own logprobs at
    the start of the step, detached (valid because a step takes one optimizer update), with
    the generator mismatch corrected by the IS weight truncated at ``loss.is_cap``."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """Compute dtype of forward/backward. Master weights, optimizer state and gradient
    reduction stay float32."""
    reshard_after_forward: bool = True
    """Free gathered layer weights after each layer's forward (less memory, one more
    all-gather in backward)."""
    attn_implementation: str = "sdpa"
    """Passed to ``from_pretrained`` (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    num_threads: int = 1
    """torch intra-op CPU threads per rank (0 leaves torch's default)."""
    seed: int | None = None
    """torch seed on every rank; ``None`` uses ``run.seed``."""


def _fail(field: str, problem: str) -> ConfigError:
    return ConfigError(f"trainer.options.{field}: {problem}")


def parse_options(raw: dict[str, Any]) -> FSDPOptions:
    """Convert and check ``trainer.options``.

    Raises:
        ConfigError: an unknown field, a wrong type or an out-of-range value (named).
    """
    try:
        opts = msgspec.convert(raw, FSDPOptions)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            explain(exc, FSDPOptions, "trainer.options") + " (options: docs/backends/fsdp.md)"
        ) from None
    if not opts.lr > 0:
        raise _fail("lr", f"must be > 0, got {opts.lr}")
    if opts.weight_decay < 0:
        raise _fail("weight_decay", f"must be >= 0, got {opts.weight_decay}")
    if not all(0 <= b < 1 for b in opts.betas):
        raise _fail("betas", f"both must lie in [0, 1), got {list(opts.betas)}")
    if not opts.eps > 0:
        raise _fail("eps", f"must be > 0, got {opts.eps}")
    if opts.max_grad_norm < 0:
        raise _fail("max_grad_norm", f"must be >= 0 (0: no clipping), got {opts.max_grad_norm}")
    if opts.num_threads < 0:
        raise _fail("num_threads", f"must be >= 0 (0: torch's default), got {opts.num_threads}")
    return opts
