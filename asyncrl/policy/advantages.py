"""Advantage estimators: a sequence's advantage from the rewards of its group (and chunk).

Pure numpy, float64 inside. ``grpo.advantage_estimator`` picks one; every sample of a group
trains with its own advantage, repeated over its tokens by the trainer. With ``N`` samples of
one prompt, rewards ``r_1..r_N``, ``mean`` and ``std`` (population) over the group:

``grpo`` (DeepSeekMath, Shao et al. 2024, eq. 3 with outcome rewards)::

    A_i = (r_i - mean(r)) / (std(r) + eps)      grpo.normalize_advantages = true
    A_i =  r_i - mean(r)                        false (Dr. GRPO, Liu et al. 2025: no std)

``rloo`` (REINFORCE leave-one-out, Ahmadian et al. 2024, eq. 5): each sample's baseline is
the mean of the *other* samples' rewards::

    A_i = r_i - 1/(N-1) * sum_{j != i} r_j  =  N/(N-1) * (r_i - mean(r))

``reinforce_pp`` (REINFORCE++ with a baseline, Hu et al. 2025, sec. 3.2): the group mean is
subtracted, then the advantages are normalized over the batch::

    A'_i = r_i - mean(r);   A_i = (A'_i - mean_B(A')) / (std_B(A') + eps)

where ``B`` is every sample of the chunk the controller packs for the trainer: the whole step
when ``pipeline.min_groups_for_streaming_train`` is 0 (or ``prompts_per_step``), a part of it
when chunks stream into the step (their statistics then differ a little from the step's).

With ``grpo.reward_weights`` the reward ``r_i`` is made from the score's named components
``c_{i,k}`` (:func:`combined_rewards`)::

    r_i = sum_k w_k * c_{i,k}                                    reward_normalization = "none"
    r_i = sum_k w_k * (c_{i,k} - mean_k) / (std_k + eps)         "group" (GDPO)

(GDPO: group reward-decoupled normalization, NeMo-RL's multi-reward estimator), where
``mean_k``, ``std_k`` are component ``k``'s over the group (a component equal across
the group adds 0): each component counts by its weight, not by its scale. The estimator then
runs on ``r``.

A group whose rewards are all equal carries no signal: ``grpo`` and ``rloo`` give it zero
advantages, and ``reinforce_pp`` gives it ``-mean_B(A')/(std_B(A') + eps)``, which is 0 too
since ``mean_B(A')`` is 0 (each group's ``A'`` sums to 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

__all__ = [
    "ESTIMATORS", "Estimator", "FLOAT32_MAX", "batch_normalized", "combined_rewards",
    "group_advantages",
]

Estimator = Literal["grpo", "rloo", "reinforce_pp"]
ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp")

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest advantage a :class:`~asyncrl.wire.messages.TrainBatch` can carry (float32)."""

EPS = 1e-6
"""Added to a standard deviation before dividing by it."""


def group_advantages(
    rewards: Sequence[float],
    *,
    normalize: bool = True,
    eps: float = EPS,
    estimator: Estimator = "grpo",
) -> np.ndarray:
    """One group's advantages by ``estimator`` (``reinforce_pp``: its group stage only,
    ``r_i - mean(r)``; :func:`batch_normalized` normalizes over the chunk, as
    :func:`asyncrl.policy.grpo.advantages_of` does). ``normalize``
    applies to ``grpo`` alone: divide by the group's standard deviation when it is positive.

    Raises:
        ValueError: fewer than 2 rewards, or an unknown estimator.
        OverflowError: the rewards are too large for this math: their mean or their spread
            overflows float64 (the variance squares them: a reward of 1e155 or more, like
            1e308, makes it infinite, and the advantages would silently be 0 or NaN), or an
            advantage does not fit the float32 the trainer gets.
    """
    r = np.asarray(rewards, dtype=np.float64)
    n = r.size
    if n < 2:
        raise ValueError("a GRPO group needs at least 2 samples")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}: one of {ESTIMATORS}")
    with np.errstate(over="ignore", invalid="ignore"):
        mean = r.mean()
        centred = r - mean
        divide = normalize and estimator == "grpo"
        std = r.std() if divide else 0.0
        if divide and std > 0:
            centred = centred / (std + eps)
        elif estimator == "rloo":
            centred = centred * (n / (n - 1))
    if not np.isfinite(mean):
        raise OverflowError("their mean overflows float64")
    if divide and not np.isfinite(std):
        raise OverflowError("their standard deviation overflows float64 (their squares do)")
    _fits_float32(centred, "r - mean")
    return centred


def batch_normalized(advantages: Sequence[np.ndarray], *, eps: float = EPS) -> list[np.ndarray]:
    """``reinforce_pp``'s batch stage: ``(A - mean_B(A)) / (std_B(A) + eps)`` over every
    sample of ``advantages`` (the groups of one chunk), each group's array in order.

    Raises:
        OverflowError: the spread overflows float64, or a result does not fit float32.
    """
    if not advantages:
        return []
    flat = np.concatenate(advantages)
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = flat.mean(), flat.std()
    if not (np.isfinite(mean) and np.isfinite(std)):
        raise OverflowError("the chunk's standard deviation overflows float64 (their squares do)")
    out = [(a - mean) / (std + eps) for a in advantages]
    for a in out:
        _fits_float32(a, "(A - mean) / std")
    return out


def combined_rewards(
    components: Sequence[Mapping[str, float]],
    weights: Mapping[str, float],
    *,
    normalization: Literal["none", "group"] = "none",
    eps: float = EPS,
) -> np.ndarray:
    """One group's rewards from its samples' named ``components`` (see the module).

    Raises:
        KeyError: a sample lacks a weighted component (its name).
    """
    names = sorted(weights)
    c = np.array([[float(comp[n]) for n in names] for comp in components], dtype=np.float64)
    c = c.reshape(len(components), len(names))
    if normalization == "group":
        mean, std = c.mean(axis=0), c.std(axis=0)
        c = np.where(std > 0, (c - mean) / (std + eps), 0.0)
    return c @ np.array([float(weights[n]) for n in names], dtype=np.float64)


def _fits_float32(a: np.ndarray, what: str) -> None:
    if not np.all(np.abs(a) <= FLOAT32_MAX):
        raise OverflowError(f"an advantage ({what}) exceeds float32's {FLOAT32_MAX:.3g}")
