"""The logprob refreshes a step's loss needs, run on the trainer ranks chunk by chunk.

:class:`~asyncrl.policy.loss_inputs.LossInputs` says which (pure); :class:`Refresher` asks the
trainers for them as each chunk streams in, before any optimizer step of the RL step, and
records what each cost. With the KL term in the reward it also remakes the chunk's advantages
from the rewards less the KL penalty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from asyncrl.config import Config
from asyncrl.obs.steps import StepRecord
from asyncrl.policy.groups import Group
from asyncrl.policy.grpo import advantages_of, per_sample, per_sequence
from asyncrl.policy.loss_inputs import LossInputs, kl_estimate, sequence_sums
from asyncrl.run.probes import Probes
from asyncrl.wire.messages import TokenBatch, TrainBatch

__all__ = ["Refresher"]


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

    async def refresh(self, batch: TrainBatch, groups: Sequence[Group], rec: StepRecord) -> TrainBatch:
        """``batch`` (packed from ``groups``) with its refreshed logprobs, or with the
        advantages of the rewards less the KL penalty (``loss.kl_in = "reward"``)."""
        tokens = TokenBatch(batch.tokens, batch.seq_lens, batch.prompt_lens)
        fields: dict[str, Any] = {}
        if self.inputs.reference:
            reference = await self._logprobs(tokens, "reference", rec)
            if self.inputs.reference_in_reward:
                fields["advantages"] = self._penalized_advantages(batch, groups, reference, rec)
            else:
                fields["reference_logprobs"] = reference
        if self.inputs.proximal:
            proximal = await self._logprobs(tokens, "current", rec)
            rec.measured_mismatch(proximal - batch.behaviour_logprobs, batch.loss_mask)
            fields["proximal_logprobs"] = proximal
        return msgspec.structs.replace(batch, **fields) if fields else batch

    async def _logprobs(self, tokens: TokenBatch, policy: str, rec: StepRecord) -> np.ndarray:
        start = self._now()
        logprobs = await self._probes.trainer_logprobs(
            tokens, temperature=self._temperature, policy=policy
        )
        rec.refreshed("reference" if policy == "reference" else "proximal", self._now() - start)
        return logprobs

    def _penalized_advantages(
        self, batch: TrainBatch, groups: Sequence[Group], reference: np.ndarray, rec: StepRecord
    ) -> np.ndarray:
        """Per sequence: the advantages of each sample's reward less ``kl_coef`` x the sum
        of the KL estimates of its sampled tokens (behaviour vs reference)."""
        kl = kl_estimate(batch.behaviour_logprobs, reference, self._loss.kl_estimator)
        by_sequence = sequence_sums(batch, kl)
        rec.kl_sum += float(by_sequence.sum())
        rec.kl_tokens += int(np.count_nonzero(batch.loss_mask))
        offsets = [-self._loss.kl_coef * s for s in per_sample(groups, by_sequence)]
        advantages = advantages_of(groups, reward_offsets=offsets, **self._advantage_options)
        return per_sequence(groups, advantages)
