"""The GRPO/PPO clipped-surrogate loss with truncated importance sampling (torch).

Not imported by ``import asyncrl``: training backends import it themselves.

Per response token, with ``prox`` the proximal policy's logprobs (by default the behaviour
policy's, i.e. the generator's)::

    r        = exp(logprobs - prox)
    w        = min(exp(prox - behaviour), is_cap)          (no gradient)
    loss_tok = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

The loss is returned as a *sum* over the tokens the mask selects (the tokens that train, a
batch's ``loss_mask``): the caller divides by the step's global count of such tokens once all
chunks of the step are in, so that streaming chunks into one optimizer step gives exactly the
gradient of one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossStats", "ppo_clip_loss"]


@dataclass(frozen=True)
class LossStats:
    """Sums over the tokens the mask selects (0-d tensors, detached, so no device sync is
    forced)."""

    clipped_tokens: torch.Tensor
    """Tokens whose gradient the clip removed: ``A > 0`` with ``r > 1 + eps_high`` or
    ``A < 0`` with ``r < 1 - eps_low``."""
    is_weight_sum: torch.Tensor
    """Sum of the truncated importance weights ``w``."""
    abs_logprob_diff_sum: torch.Tensor
    """Sum of ``|logprobs - behaviour_logprobs|`` (trainer/generator mismatch)."""


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    is_cap: float,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Sum of the per-token clipped surrogate loss over the tokens where ``mask`` is set.

    A token where ``mask`` is not set adds exactly nothing: no loss, a gradient of exactly
    zero, nothing to the stats; its behaviour and proximal logprobs and its advantage may
    hold anything, even infinities or NaN (placeholders of inserted observation tokens, or
    padding), and cannot leak into the result through ``0 * inf``.

    Args:
        logprobs: ``[T]`` current policy logprobs (carry the gradient).
        behaviour_logprobs: ``[T]`` logprobs of the policy that generated the tokens.
        advantages: ``[T]`` per-token advantages (a sequence's advantage repeated).
        mask: ``[T]`` bool or 0/1: 1 where the token trains.
        clip_eps_low: ``r`` is clipped below at ``1 - clip_eps_low``.
        clip_eps_high: ``r`` is clipped above at ``1 + clip_eps_high``.
        is_cap: upper bound of the importance weight ``w``.
        proximal_logprobs: ``[T]`` the proximal policy; ``None`` means the behaviour policy
            (then ``w == 1`` and ``r`` is the trainer/generator ratio).

    Returns:
        ``(loss_sum, stats)``: a 0-d tensor in ``logprobs``' dtype and :class:`LossStats`.
    """
    mask = mask.to(torch.bool)
    current = logprobs.detach()
    # Masked positions may hold anything (padding); make them finite so that neither the loss
    # nor its gradient can turn into NaN through 0 * inf.
    behaviour = torch.where(mask, behaviour_logprobs.to(logprobs.dtype), current)
    prox = behaviour if proximal_logprobs is None else proximal_logprobs.detach()
    prox = torch.where(mask, prox.to(logprobs.dtype), current)
    adv = torch.where(mask, advantages.to(logprobs.dtype), 0.0)

    ratio = torch.exp(logprobs - prox)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    weight = torch.clamp(torch.exp(prox - behaviour), max=is_cap).detach()
    maskf = mask.to(logprobs.dtype)
    loss_sum = -(weight * surrogate * maskf).sum()

    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | (
            (adv < 0) & (ratio < 1.0 - clip_eps_low)
        )
        stats = LossStats(
            clipped_tokens=(clipped & mask).sum(),
            is_weight_sum=(weight * maskf).sum(),
            abs_logprob_diff_sum=((current - behaviour).abs() * maskf).sum(),
        )
    return loss_sum, stats
