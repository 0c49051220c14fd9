"""What the loss needs besides the generator's logprobs, and the numpy parts of getting it
(pure; no torch, no I/O).

A step's loss reads the behaviour logprobs (the generator's, in every sample). It may also need

* **proximal** logprobs, the trainer's own on the weights before the RL step's first optimizer
  step (``loss.proximal_policy = "current"``). With one optimizer step per RL step the loss's
  own forward computes them (its detached logprobs); with several (``grpo.mini_steps``,
  ``grpo.update_epochs``) the weights change between them, so the train loop asks the trainer
  for them once, while each chunk streams in (before any optimizer step of the RL step);
* **reference** logprobs, for a KL term (``loss.kl_coef > 0``): one reference forward per
  chunk. With ``loss.kl_in = "reward"`` they are needed before the advantages are made.

:class:`LossInputs` says which; nothing that no one reads is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncrl.policy.packing import Layout
from asyncrl.wire.messages import TrainBatch

__all__ = ["LossInputs", "kl_estimate", "sequence_sums"]

KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True)
class LossInputs:
    """The refresh forwards a step needs (``LossInputs.of(config)``)."""

    proximal: bool
    """Recompute the trainer's logprobs on the pre-step weights for every chunk."""
    reference: bool
    """Compute the reference policy's logprobs for every chunk."""
    reference_in_reward: bool
    """The KL term is subtracted from the rewards (else it is in the loss)."""
    because: str = ""
    """The options that ask for them, for messages."""

    @classmethod
    def of(cls, config: Any) -> LossInputs:
        g, loss = config.grpo, config.loss
        proximal = loss.proximal_policy == "current" and g.updates_per_step > 1
        reference = loss.kl_coef > 0
        reasons = []
        if reference:
            reasons.append(f"loss.kl_coef = {loss.kl_coef:g}, loss.kl_in = {loss.kl_in!r}")
        if proximal:
            reasons.append(f"loss.proximal_policy = \"current\" with grpo.mini_steps = "
                           f"{g.mini_steps}, grpo.update_epochs = {g.update_epochs}")  # fmt: skip
        return cls(
            proximal=proximal,
            reference=reference,
            reference_in_reward=reference and loss.kl_in == "reward",
            because="; ".join(reasons),
        )

    @property
    def names(self) -> frozenset[str]:
        """The :class:`~asyncrl.wire.messages.TrainBatch` fields these fill (what a training
        backend must read: its ``loss_inputs``)."""
        out = set()
        if self.proximal:
            out.add("proximal_logprobs")
        if self.reference and not self.reference_in_reward:
            out.add("reference_logprobs")
        return frozenset(out)


def kl_estimate(logprobs: np.ndarray, reference: np.ndarray, estimator: KLEstimator) -> np.ndarray:
    """Per-token estimate of KL(policy || reference) from the policy's samples, with
    ``d = reference - logprobs``: ``k1 = -d``, ``k2 = d**2 / 2``, ``k3 = exp(d) - 1 - d``
    (Schulman, "Approximating KL divergence", 2020). float64."""
    d = np.asarray(reference, np.float64) - np.asarray(logprobs, np.float64)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return np.expm1(d) - d


def sequence_sums(batch: TrainBatch, per_token: np.ndarray) -> np.ndarray:
    """Each sequence's sum of ``per_token`` (one value per response token) over the tokens
    that train (``loss_mask``); float64 ``[B]``. A token that does not train adds nothing,
    whatever it holds (placeholders of inserted tokens may be anything)."""
    values = np.where(batch.loss_mask.astype(bool), per_token, 0.0)
    return Layout.of(batch.seq_lens, batch.prompt_lens).response_sums(values, np.float64)
