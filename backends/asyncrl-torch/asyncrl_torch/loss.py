"""The GRPO/PPO clipped-surrogate loss with its off-policy corrections (torch).

Not imported by ``import asyncrl``: training backends import it themselves.

Per response token ``t`` of sequence ``i``, with ``prox`` the proximal policy's logprobs (by
default the behaviour policy's, i.e. the generator's; the trainer's own at the start of the
step with ``loss.proximal_policy = "current"``: decoupled PPO)::

    rho_t    = exp(prox_t - behaviour_t)                        trainer / generator (no grad)
    r_t      = exp(logprobs_t - prox_t)                         ``ratio_level = "token"``
    r_t      = sg(s_i) * exp(logprobs_t - sg(logprobs_t)),      ``"sequence"`` (GSPO-token,
               s_i = exp(mean_{t in i}(logprobs_t - prox_t))     Zheng et al. 2025, eq. 7)
    loss_t   = -w_t * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)

and the weight ``w_t`` (no gradient) by ``correction``:

    tis            w_t = min(rho_t, is_cap)                     truncated IS (the default)
    token_mask     w_t = rho_t if low <= rho_t <= high else 0   IcePop's double-sided mask
    sequence_mask  w_t = min(rho_t, is_cap), and 0 for every token of a sequence whose
                   geometric mean exp(mean_{t in i} log rho_t) is outside [low, high]
    none           w_t = 1

With the behaviour policy as proximal ``rho`` is 1, so the corrections change nothing; they
act on the trainer/generator mismatch once ``prox`` is the trainer's own.

The loss is returned as a *sum* over the tokens the mask selects (the tokens that train, a
batch's ``loss_mask``): the caller divides by the step's global count of such tokens once all
chunks of the step are in, so that streaming chunks into one optimizer step gives exactly the
gradient of one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["CORRECTIONS", "Correction", "LossStats", "RatioLevel", "kl_to_reference", "ppo_clip_loss"]

Correction = Literal["tis", "token_mask", "sequence_mask", "none"]
CORRECTIONS: tuple[str, ...] = ("tis", "token_mask", "sequence_mask", "none")
RatioLevel = Literal["token", "sequence"]


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
    abs_logprob_diff_max: torch.Tensor
    """The largest ``|logprobs - behaviour_logprobs|`` (0 when no token trains)."""
    mismatch_k3_sum: torch.Tensor
    """Sum of ``exp(d) - 1 - d`` with ``d = logprobs - behaviour_logprobs``: k3, an unbiased
    per-token estimate of KL(generator || trainer) on the generator's samples."""
    masked_tokens: torch.Tensor | None = None
    """Trained tokens whose weight the correction set to 0 (``token_mask``,
    ``sequence_mask``); ``None`` for the others."""


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
    correction: Correction = "tis",
    mismatch_low: float = 0.5,
    mismatch_high: float = 2.0,
    ratio_level: RatioLevel = "token",
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Sum of the per-token clipped surrogate loss over the tokens where ``mask`` is set.

    A token where ``mask`` is not set adds exactly nothing: no loss, a gradient of exactly
    zero, nothing to the stats or to its sequence's means; its behaviour and proximal logprobs
    and its advantage may hold anything, even infinities or NaN (placeholders of inserted
    observation tokens, or padding), and cannot leak into the result through ``0 * inf``.

    Args:
        logprobs: ``[T]`` current policy logprobs (carry the gradient).
        behaviour_logprobs: ``[T]`` logprobs of the policy that generated the tokens.
        advantages: ``[T]`` per-token advantages (a sequence's advantage repeated).
        mask: ``[T]`` bool or 0/1: 1 where the token trains.
        clip_eps_low: ``r`` is clipped below at ``1 - clip_eps_low``.
        clip_eps_high: ``r`` is clipped above at ``1 + clip_eps_high``.
        is_cap: upper bound of the importance weight (``tis``, ``sequence_mask``).
        proximal_logprobs: ``[T]`` the proximal policy; ``None`` means the behaviour policy
            (then ``rho == 1`` and ``r`` is the trainer/generator ratio).
        correction: how ``rho`` weighs each token (module docstring).
        mismatch_low, mismatch_high: the band of ``rho`` kept by the masking corrections.
        ratio_level: ``token`` (PPO) or ``sequence`` (GSPO).
        seq_ids: ``[T]`` int64, the sequence of each token (any labels, equal within a
            sequence); needed by ``sequence_mask`` and ``ratio_level = "sequence"``.

    Returns:
        ``(loss_sum, stats)``: a 0-d tensor in ``logprobs``' dtype and :class:`LossStats`.
    """
    sequence_level = correction == "sequence_mask" or ratio_level == "sequence"
    if sequence_level and seq_ids is None:
        raise ValueError(f"correction={correction!r}, ratio_level={ratio_level!r} need seq_ids")
    mask = mask.to(torch.bool)
    current = logprobs.detach()
    # Masked positions may hold anything (padding); make them finite so that neither the loss
    # nor its gradient can turn into NaN through 0 * inf.
    behaviour = torch.where(mask, behaviour_logprobs.to(logprobs.dtype), current)
    prox = behaviour if proximal_logprobs is None else proximal_logprobs.detach()
    prox = torch.where(mask, prox.to(logprobs.dtype), current)
    adv = torch.where(mask, advantages.to(logprobs.dtype), 0.0)
    maskf = mask.to(logprobs.dtype)

    ratio = _ratio(logprobs, prox, maskf, seq_ids, ratio_level)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    weight, dropped = _weights(prox - behaviour, maskf, seq_ids, correction, is_cap,
                               mismatch_low, mismatch_high)  # fmt: skip
    loss_sum = -(weight * surrogate * maskf).sum()

    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | (
            (adv < 0) & (ratio < 1.0 - clip_eps_low)
        )
        diff = current - behaviour  # 0 where no token trains (behaviour set to current)
        stats = LossStats(
            clipped_tokens=(clipped & mask).sum(),
            is_weight_sum=(weight * maskf).sum(),
            abs_logprob_diff_sum=(diff.abs() * maskf).sum(),
            abs_logprob_diff_max=diff.abs().max() if diff.numel() else diff.new_zeros(()),
            mismatch_k3_sum=((torch.expm1(diff) - diff) * maskf).sum(),
            masked_tokens=None if dropped is None else (dropped & mask).sum(),
        )
    return loss_sum, stats


def _ratio(
    logprobs: torch.Tensor, prox: torch.Tensor, maskf: torch.Tensor,
    seq_ids: torch.Tensor | None, level: RatioLevel,
) -> torch.Tensor:
    """The PPO ratio per token: ``exp(lp - prox)``, or GSPO's ``s_i`` with the gradient
    ``s_i * dlp`` (the module docstring)."""
    if level == "token":
        return torch.exp(logprobs - prox)
    assert seq_ids is not None
    current = logprobs.detach()
    seq_log_ratio = _sequence_mean(current - prox, maskf, seq_ids)
    return torch.exp(seq_log_ratio + logprobs - current)  # value s_i, gradient s_i * dlp


def _sequence_mean(values: torch.Tensor, maskf: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of ``values`` over the sequence's trained tokens (no
    gradient; 0 for a sequence with none)."""
    with torch.no_grad():
        _, index = torch.unique(seq_ids, return_inverse=True)
        n = int(index.max()) + 1 if index.numel() else 0
        sums = torch.zeros(n, dtype=values.dtype, device=values.device)
        counts = torch.zeros(n, dtype=values.dtype, device=values.device)
        sums.index_add_(0, index, values * maskf)
        counts.index_add_(0, index, maskf)
        return (sums / counts.clamp(min=1))[index]


def _weights(
    log_rho: torch.Tensor, maskf: torch.Tensor, seq_ids: torch.Tensor | None,
    correction: Correction, is_cap: float, low: float, high: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token weights ``w`` of ``correction`` (no gradient), and which tokens the
    masking corrections dropped (``None`` for the others)."""
    with torch.no_grad():
        rho = torch.exp(log_rho)
        if correction == "tis":
            return torch.clamp(rho, max=is_cap), None
        if correction == "none":
            return torch.ones_like(rho), None
        if correction == "token_mask":
            kept = (rho >= low) & (rho <= high)
            return torch.where(kept, rho, 0.0), ~kept
        if correction == "sequence_mask":
            assert seq_ids is not None
            geo = torch.exp(_sequence_mean(log_rho, maskf, seq_ids))
            kept = (geo >= low) & (geo <= high)
            return torch.where(kept, torch.clamp(rho, max=is_cap), 0.0), ~kept
        raise ValueError(f"unknown correction {correction!r}: one of {CORRECTIONS}")


def kl_to_reference(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Sum over the tokens ``mask`` selects of the per-token estimate of KL(policy ||
    reference) (Schulman, "Approximating KL divergence", 2020), with the gradient through
    ``logprobs``; ``d = reference - logprobs``::

        k1 = -d          (its gradient is the score: unbiased for the KL's value only)
        k2 = d**2 / 2    (gradient -d: the KL's gradient, to first order)
        k3 = exp(d) - 1 - d   (>= 0, unbiased for the value; gradient 1 - exp(d))

    A token outside ``mask`` adds nothing, whatever ``reference_logprobs`` holds there.
    """
    mask = mask.to(torch.bool)
    ref = torch.where(mask, reference_logprobs.to(logprobs.dtype), logprobs.detach())
    d = ref - logprobs
    if estimator == "k1":
        per_token = -d
    elif estimator == "k2":
        per_token = 0.5 * d * d
    elif estimator == "k3":
        per_token = torch.expm1(d) - d
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}: one of k1, k2, k3")
    return (per_token * mask.to(logprobs.dtype)).sum()
