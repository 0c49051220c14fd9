"""``[grpo]``, ``[loss]`` and ``[pipeline]``: the algorithm and the staleness policy.

``[pipeline.sampler]`` stays an opaque table here: its ``name`` picks a sampler plugin, which
converts the rest to its own struct (:mod:`asyncrl.policy.sampler_choice`) and answers for its
capacities. Each section's checks sit with it; :func:`asyncrl.config.problems` gathers them.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from asyncrl.config.section import Section, at_least_one, fail, not_negative
from asyncrl.errors import ConfigError
from asyncrl.policy.sampler_choice import default_table


__all__ = ["GRPOConfig", "LossConfig", "PipelineConfig"]


class GRPOConfig(Section):
    prompts_per_step: int = 16
    """P: prompt groups trained in one optimizer step. Raise it for larger, less noisy steps
    (more generation per step)."""
    samples_per_prompt: int = 8
    """N: completions generated per prompt (the GRPO group size). Raise it for a better baseline
    per prompt (more generation per prompt)."""
    max_new_tokens: int = 16
    """Generation length limit per completion. Set it to the longest answer the task needs (the
    default suits the toy tasks only)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by the same value. Lower it for less
    random samples (less exploration)."""
    mini_steps: int = 1
    """Optimizer steps per RL step: the step's sequences are split into this many mini-batches,
    each one optimizer step (docs/losses.md). The refit and the staleness accounting stay per
    RL step. With ``loss.proximal_policy = "current"`` every mini-step's ratio is taken
    against the logprobs of the weights before the first one (a refresh forward). Raise it to
    take several smaller optimizer steps per batch of rollouts (PPO-style)."""
    update_epochs: int = 1
    """Passes over the same step's rollouts (each pass ``mini_steps`` optimizer steps). Raise it
    to reuse each batch of rollouts (more off-policy, less generation per update)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a ready group whose rewards are all equal (its advantages
    would all be 0) is dropped instead of trained, and the step's quota keeps filling with
    fresh prompts, with any sampler; at most 4 x ``prompts_per_step`` drops a step, past which
    the step trains what it gets and its record says ``filter_cap_reached`` (docs/losses.md).
    Turn it on when many groups are solved or hopeless (accuracy near 1 or 0) and steps train
    on little signal; it costs the generation of every dropped group."""
    normalize_advantages: bool = True
    """``grpo`` estimator: divide group-centred rewards by the group's standard deviation
    (when > 0); false is Dr. GRPO's advantage (the mean subtracted only). Set false for Dr.
    GRPO's unnormalized advantages."""
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    """How a sample's advantage is made from its group's rewards (docs/losses.md):
    ``grpo`` (minus the group mean, over its std with ``normalize_advantages``), ``rloo``
    (minus the mean of the group's other samples), ``reinforce_pp`` (minus the group mean,
    then normalized over the chunk sent to the trainer: the step, unless chunks stream). Change
    it to compare estimators; ``grpo`` is the common choice."""
    reward_weights: dict[str, float] = msgspec.field(default_factory=dict)
    """Train on a weighted sum of the score's named components (``Score.components``, e.g.
    ``{correct = 1.0, format = 0.2}``) instead of its ``reward``; empty: the ``reward``. Set it
    when the environment scores several components that should count differently."""
    reward_normalization: Literal["none", "group"] = "none"
    """With ``reward_weights``: ``group`` normalizes each component within its group (minus
    its mean, over its std) before weighting (GDPO), so a component counts by its weight and
    not by its scale; ``none`` weights them as they are. Set ``group`` when the components have
    very different scales."""

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per RL step (``mini_steps`` x ``update_epochs``)."""
        return self.mini_steps * self.update_epochs

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[grpo]``."""
        out = at_least_one({
            "grpo.prompts_per_step": self.prompts_per_step,
            "grpo.max_new_tokens": self.max_new_tokens,
        })  # fmt: skip
        if self.samples_per_prompt < 2:
            out.append(
                fail(
                    "grpo.samples_per_prompt",
                    f"GRPO needs at least 2 samples per prompt to form a baseline, got "
                    f"{self.samples_per_prompt}",
                    "set grpo.samples_per_prompt >= 2",
                )
            )
        bad = [k for k, w in self.reward_weights.items() if not math.isfinite(w)]
        if bad:
            out.append(fail("grpo.reward_weights", f"{bad[0]!r} has a weight that is not finite",
                            "give every component a finite weight"))  # fmt: skip
        if self.reward_normalization != "none" and not self.reward_weights:
            out.append(fail("grpo.reward_normalization", "normalizes the reward's components, "
                            "but grpo.reward_weights names none",
                            "name the components and their weights in grpo.reward_weights "
                            "(e.g. {correct = 1.0, format = 0.2}), or remove it"))  # fmt: skip
        if self.mini_steps < 1 or self.update_epochs < 1:
            out.append(fail("grpo.mini_steps", f"mini_steps and update_epochs must be >= 1, got "
                            f"{self.mini_steps} and {self.update_epochs}",
                            "use 1 for one optimizer step per RL step"))  # fmt: skip
        elif self.mini_steps > self.prompts_per_step * self.samples_per_prompt:
            out.append(fail("grpo.mini_steps", f"{self.mini_steps} mini-batches of a step of "
                            f"{self.prompts_per_step * self.samples_per_prompt} samples would "
                            "leave some empty", "use at most prompts_per_step x "
                            "samples_per_prompt (a divisor of it splits evenly)"))  # fmt: skip
        if not self.temperature > 0:
            out.append(
                fail("grpo.temperature", f"must be > 0, got {self.temperature}", "use e.g. 1.0")
            )
        return out


class LossConfig(Section):
    clip_eps_low: float = 0.2
    """PPO ratio lower clip: ratio >= 1 - clip_eps_low. Change it only to follow a recipe (PPO's
    0.2 is the usual value)."""
    clip_eps_high: float = 0.2
    """PPO ratio upper clip: ratio <= 1 + clip_eps_high (DAPO's clip-higher when larger). Raise
    it (DAPO: 0.28) to let rare tokens gain probability faster."""
    is_cap: float = 2.0
    """Truncation of the importance weight between proximal and behaviour policy (TIS). Lower it
    to bound the correction's variance; raise it to correct large mismatches more fully."""
    correction: Literal["tis", "token_mask", "sequence_mask", "none"] = "tis"
    """How the trainer/generator ratio rho = exp(prox - behaviour) weighs each token
    (docs/losses.md): ``tis`` min(rho, is_cap); ``token_mask`` rho inside
    [mismatch_low, mismatch_high], else 0 (IcePop); ``sequence_mask`` a whole sequence
    dropped when its geometric-mean rho leaves that band, else tis; ``none`` 1. The masks
    need the trainer's own logprobs as proximal (``proximal_policy = "current"``): with the
    generator's, rho is 1. Change it when the trainer/generator mismatch is large
    (``mismatch_k3`` in the step records): the masks drop the worst tokens or sequences."""
    proximal_policy: Literal["behaviour", "current"] = "behaviour"
    """The PPO ratio's denominator. ``behaviour``: the generator's logprobs (the ratio is
    trainer/generator; the correction's rho is 1). ``current``: the trainer's own logprobs
    before the step's first optimizer step (decoupled PPO), the generator mismatch then
    weighed by ``correction``. With one optimizer step per RL step they come from the same
    forward as the loss (free); with ``grpo.mini_steps`` or ``grpo.update_epochs`` above 1 a
    refresh forward computes them once per RL step. Set ``current`` with a masking
    ``correction``, or to take the ratio against the trainer's own logprobs."""
    mismatch_low: float = 0.5
    """Lower edge of the rho band the masking corrections keep. Narrow the band to mask more of
    the mismatched tokens."""
    mismatch_high: float = 2.0
    """Upper edge of the rho band the masking corrections keep. Narrow the band to mask more of
    the mismatched tokens."""
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """How the step's token losses become its loss (docs/losses.md): ``token_mean`` (sum
    over the step's trained tokens / their number), ``sequence_mean`` (each sequence's mean
    over its trained tokens, averaged over the step's sequences: GRPO's original), or
    ``constant`` (sum / (sequences x aggregation_constant): Dr. GRPO). Change it to follow a
    recipe (GRPO's ``sequence_mean``, Dr. GRPO's ``constant``)."""
    aggregation_constant: int = 0
    """``constant``'s per-sequence token budget (0: ``grpo.max_new_tokens``). Set it only to
    follow a recipe that names another budget."""
    kl_coef: float = 0.0
    """Weight of the KL divergence to the reference policy (0: no reference is loaded and
    no reference forward runs). Set it > 0 (e.g. 0.001) to keep the policy near the reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimate, with ``d = reference - logprob``: ``k1`` = -d, ``k2`` =
    d^2 / 2, ``k3`` = exp(d) - 1 - d (docs/losses.md). Change it to follow a recipe; ``k3`` is
    the usual low-variance estimate."""
    kl_in: Literal["loss", "reward"] = "loss"
    """``loss``: ``kl_coef`` x the estimate of the trained policy is added to every trained
    token's loss (it has a gradient). ``reward``: each sample's reward loses ``kl_coef`` x
    the sum of the estimates of its sampled tokens (from the generator's logprobs) before
    the advantages are made. Set ``reward`` to follow recipes that penalize the KL in the reward
    (no gradient through it)."""
    reference_path: str = ""
    """The reference policy's weights (a Hugging Face model directory); empty: the run's
    initial weights (``model.path``). Set it when the reference is not the starting model (an
    SFT checkpoint, say)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The PPO ratio: per token, or GSPO's per sequence (the geometric mean of its tokens'
    ratios, clipped as one). Set ``sequence`` for GSPO."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[loss]``."""
        out: list[ConfigError] = []
        if self.aggregation_constant < 0:
            out.append(fail("loss.aggregation_constant", "must be >= 0",
                            "use 0 (grpo.max_new_tokens) or a token budget"))  # fmt: skip
        if not 0 < self.mismatch_low <= 1 <= self.mismatch_high:
            out.append(fail("loss.mismatch_low", f"the band [{self.mismatch_low}, "
                            f"{self.mismatch_high}] must hold 1 with mismatch_low > 0",
                            "use e.g. mismatch_low = 0.5, mismatch_high = 2.0"))  # fmt: skip
        if not 0 <= self.clip_eps_low < 1:
            out.append(fail("loss.clip_eps_low", "must be in [0, 1)", "use e.g. 0.2"))
        if self.clip_eps_high < 0:
            out.append(fail("loss.clip_eps_high", "must be >= 0", "use e.g. 0.2 or 0.28"))
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            out.append(fail("loss.kl_coef", f"must be a finite number >= 0, got {self.kl_coef}",
                            "use 0 (no KL term) or e.g. 0.001"))  # fmt: skip
        if self.reference_path and not self.kl_coef:
            out.append(fail("loss.reference_path", "names a reference policy, but loss.kl_coef "
                            "is 0, so none is loaded",
                            "set loss.kl_coef > 0, or remove loss.reference_path"))  # fmt: skip
        if self.correction in ("token_mask", "sequence_mask") and self.proximal_policy != "current":
            out.append(fail("loss.correction", f"{self.correction!r} masks tokens by the "
                            "trainer/generator ratio exp(prox - behaviour), which is 1 "
                            "everywhere while the proximal policy is the generator's "
                            "(loss.proximal_policy = \"behaviour\"): it would do nothing",
                            "set loss.proximal_policy = \"current\" (decoupled PPO), or "
                            "loss.correction = \"tis\""))  # fmt: skip
        if self.is_cap < 1:
            out.append(fail("loss.is_cap", "must be >= 1", "use e.g. 2.0"))
        return out


def _default_sampler() -> dict[str, Any]:
    return default_table()


class PipelineConfig(Section):
    sampler: Any = msgspec.field(default_factory=_default_sampler)
    """The staleness policy shared by both pumps: a table whose ``name`` picks a sampler
    (entry point group ``asyncrl.samplers``: ``in_order``, ``gated``, ``oversampled``,
    ``ready_first`` or a plugin's) and whose other keys are that sampler's knobs
    (docs/modes.md). Loading converts it to the sampler's own config struct. Change it to choose
    how asynchronous the run is: ``in_order`` with lookahead 0 is synchronous, larger bounds and
    the streaming samplers trade staleness for throughput."""
    min_groups_for_streaming_train: int = 0
    """Complete groups needed before a chunk is sent to the trainer (0 = prompts_per_step).
    Smaller values stream chunks into the open optimizer step sooner. Lower it (e.g. to a
    quarter of ``prompts_per_step``) to overlap training with the rest of the step's generation."""
    max_inflight_samples: int = 0
    """Samples generating at once, over all rollout ranks (0 = max_buffered_groups *
    samples_per_prompt: no cap beyond the buffer's). Set it to what the engines can run
    concurrently (e.g. vLLM's max_num_seqs times rollout_ranks): a long sample then holds one
    slot, not the admission of a whole group."""
    max_buffered_groups: int = 0
    """Groups generating or waiting to train (0 = the sampler's required capacity). Raise it to
    keep more groups generating than the sampler's minimum, when the engines have room."""

    def problems(self) -> list[ConfigError]:
        """The broken invariants of ``[pipeline]`` alone (a capacity below 0); what needs
        ``[grpo]`` and the sampler's rule is checked with the whole config
        (:func:`asyncrl.config.problems`)."""
        return not_negative(
            {
                "pipeline.min_groups_for_streaming_train": self.min_groups_for_streaming_train,
                "pipeline.max_inflight_samples": self.max_inflight_samples,
                "pipeline.max_buffered_groups": self.max_buffered_groups,
            },
            fix="use 0 for the default",
        )
