"""The logprob refreshes a step's loss needs, run on the trainer ranks chunk by chunk.

:class:`~asyncrl.policy.loss_inputs.LossInputs` says which (pure); :class:`Refresher` asks the
trainers for them as each chunk streams in, before any optimizer step of the RL step, and
returns what it measured (:class:`Refreshed`: what each cost, the KL, the mismatch) for the
step's assembler to record: the refresher keeps no step state. With the KL term in the reward
it also remakes the chunk's advantages from the rewards less the KL penalty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from asyncrl.config import Config
from asyncrl.obs.steps import Mismatch
from asyncrl.policy.groups import Group
from asyncrl.policy.grpo import advantages_of, per_sample, per_sequence
from asyncrl.policy.loss_inputs import LossInputs, kl_estimate, sequence_sums
from asyncrl.run.probes import Probes
from asyncrl.wire.messages import TokenBatch, TrainBatch

__all__ = ["Refreshed", "Refresher"]


@dataclass(frozen=True)
class Refreshed:
    """What one chunk's refresh measured (:meth:`Refresher.refresh`)."""

    seconds: dict[str, float] = field(default_factory=dict)
    """The trainer ranks' time on each refresh, by kind (``proximal``, ``reference``)."""
    kl_sum: float = 0.0
    """With the KL term in the reward: the sum of its estimates over the chunk's sampled
    tokens."""
    kl_tokens: int = 0
    """The tokens :attr:`kl_sum` is over (0 without the KL term in the reward)."""
    mismatch: Mismatch | None = None
    """With refreshed proximal logprobs: theirs against the generator's over the chunk's
    trained tokens."""


class Refresher:
    """Fills a chunk's :class:`TrainBatch` with the logprobs the loss needs beyond the
    generator's (nothing when it needs none)."""

    def __init__(
        self, config: Config, probes: Probes, *, advantage_options: dict[str, Any],
        now: Callable[[], float],
    ) -> None:  # fmt: skip
        self.inputs = LossInputs.of(config)
        self._loss = config.loss
        self._temperature = config.grpo.temperature
        self._probes = probes
        self._advantage_options = advantage_options
        """What :func:`advantages_of` takes besides the groups (as ``pack_groups`` got it)."""
        self._now = now

    @property
    def active(self) -> bool:
        return self.inputs.proximal or self.inputs.reference

    async def refresh(
        self, batch: TrainBatch, groups: Sequence[Group]
    ) -> tuple[TrainBatch, Refreshed]:
        """``batch`` (packed from ``groups``) with its refreshed logprobs, or with the
        advantages of the rewards less the KL penalty (``loss.kl_in = "reward"``), and what
        the refresh measured. Cancellation: the chunk is abandoned (so is its step)."""
        tokens = TokenBatch(batch.tokens, batch.seq_lens, batch.prompt_lens)
        fields: dict[str, Any] = {}
        seconds: dict[str, float] = {}
        kl_sum, kl_tokens, mismatch = 0.0, 0, None
        if self.inputs.reference:
            reference, seconds["reference"] = await self._logprobs(tokens, "reference")
            if self.inputs.reference_in_reward:
                by_sequence = self._kl_by_sequence(batch, reference)
                kl_sum = float(by_sequence.sum())
                kl_tokens = int(np.count_nonzero(batch.loss_mask))
                fields["advantages"] = self._penalized_advantages(groups, by_sequence)
            else:
                fields["reference_logprobs"] = reference
        if self.inputs.proximal:
            proximal, seconds["proximal"] = await self._logprobs(tokens, "current")
            mismatch = Mismatch.of(proximal - batch.behaviour_logprobs, batch.loss_mask)
            fields["proximal_logprobs"] = proximal
        batch = msgspec.structs.replace(batch, **fields) if fields else batch
        return batch, Refreshed(seconds, kl_sum, kl_tokens, mismatch)

    async def _logprobs(self, tokens: TokenBatch, policy: str) -> tuple[np.ndarray, float]:
        """The trainer's logprobs of ``tokens`` under ``policy``, and the seconds they took."""
        start = self._now()
        logprobs = await self._probes.trainer_logprobs(
            tokens, temperature=self._temperature, policy=policy
        )
        return logprobs, self._now() - start

    def _kl_by_sequence(self, batch: TrainBatch, reference: np.ndarray) -> np.ndarray:
        """Per sequence: the sum of the KL estimates of its sampled tokens (behaviour vs
        reference)."""
        kl = kl_estimate(batch.behaviour_logprobs, reference, self._loss.kl_estimator)
        return sequence_sums(batch, kl)

    def _penalized_advantages(
        self, groups: Sequence[Group], by_sequence: np.ndarray
    ) -> np.ndarray:
        """Per sequence: the advantages of each sample's reward less ``kl_coef`` x the sum
        of the KL estimates of its sampled tokens (``by_sequence``)."""
        offsets = [-self._loss.kl_coef * s for s in per_sample(groups, by_sequence)]
        advantages = advantages_of(groups, reward_offsets=offsets, **self._advantage_options)
        return per_sequence(groups, advantages)
