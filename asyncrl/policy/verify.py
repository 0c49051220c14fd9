"""Refit verification: does the generator serve the trainer's weights? (pure logic, no I/O)

Right after a refit the generators and the trainer hold the same weights, so their logprobs of
the same fixed token sequences differ only by numerics (bf16 engine vs float32 trainer). A
refit that leaves part of the engine on old weights (a stale kernel cache, a tensor that was
never sent, a wrong dtype) shows up as a disagreement far above that noise, long before the
run's reward curve would reveal it. The pipeline scores a fixed *probe batch* on both sides
after the refits :func:`verification_due` picks and hands the two arrays to :func:`compare`;
:meth:`Agreement.check` raises when they disagree beyond ``refit.verify_tolerance``.

The probe batch is frozen from the first trained step's own samples (:func:`probe_sequences`):
real prompts and completions of the task, so the check measures the tokens training uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.errors import RefitError

__all__ = ["Agreement", "compare", "make_probe", "probe_sequences", "verification_due"]


def verification_due(version: int, first: int, every: int) -> bool:
    """Whether the refit that installs weight version ``version`` (1, 2, ...) is verified.

    Args:
        version: the version just installed on the generators.
        first: the first ``first`` refits are always verified.
        every: afterwards every ``every``-th version is (0: never).
    """
    if version < 1:
        return False
    return version <= first or (every > 0 and version % every == 0)


@dataclass(frozen=True)
class Agreement:
    """How closely one generator's logprobs follow the trainer's on the probe batch."""

    worker: str
    version: int
    num_tokens: int
    mean_abs: float
    """Mean over tokens of |generator - trainer| (nats). The quantity checked."""
    max_abs: float
    mult_prob_error: float
    """Mean over tokens of exp(|generator - trainer|), NeMo-RL's ``token_mult_prob_error``
    (1.0 = identical)."""

    def metrics(self) -> dict[str, float | int | str]:
        return {
            "worker": self.worker,
            "version": self.version,
            "num_tokens": self.num_tokens,
            "mean_abs": self.mean_abs,
            "max_abs": self.max_abs,
            "mult_prob_error": self.mult_prob_error,
        }

    def check(self, tolerance: float, key: str = "refit.verify_tolerance") -> None:
        """Raise :class:`RefitError` when ``mean_abs`` exceeds ``tolerance`` (the setting
        ``key``, named in the message)."""
        if self.mean_abs <= tolerance:
            return
        raise RefitError(
            f"refit verification failed at weight version {self.version}: generator "
            f"{self.worker} and the trainer disagree on the probe batch ({self.num_tokens} "
            f"tokens): mean |logprob difference| = {self.mean_abs:.4f} (max {self.max_abs:.3f}) "
            f"> {key} = {tolerance:g}. The generator is not serving the "
            "trainer's weights (part of the engine kept old weights, a tensor was not sent, or "
            "the two sides use different models or dtypes), so training would go off-policy "
            "without notice. Fix: find the cause in the generator's log (docs/architecture.md, "
            "'Refit verification'); only if this is plain numerical noise of your model and "
            f"dtypes, raise {key} (refit.verify_every_steps = 0 and "
            "refit.verify_first_steps = 0 turn the check off)"
        )


def compare(worker: str, version: int, generator: np.ndarray, trainer: np.ndarray) -> Agreement:
    """Summarize the token-wise disagreement of two logprob arrays of the same tokens.

    Raises:
        RefitError: the arrays differ in length or hold non-finite values (a broken side).
    """
    gen = np.asarray(generator, np.float64)
    trn = np.asarray(trainer, np.float64)
    if gen.shape != trn.shape or gen.ndim != 1:
        raise RefitError(
            f"refit verification at v{version}: {worker} returned {gen.shape} logprobs, the "
            f"trainer {trn.shape}, for the same probe batch"
        )
    if gen.size == 0:
        raise RefitError(f"refit verification at v{version}: the probe batch has no tokens")
    if not (np.isfinite(gen).all() and np.isfinite(trn).all()):
        side = worker if not np.isfinite(gen).all() else "the trainer"
        raise RefitError(
            f"refit verification at v{version}: {side} returned non-finite logprobs for the "
            "probe batch (diverged or corrupted weights)"
        )
    diff = np.abs(gen - trn)
    return Agreement(
        worker=worker,
        version=version,
        num_tokens=int(diff.size),
        mean_abs=float(diff.mean()),
        max_abs=float(diff.max()),
        mult_prob_error=float(np.exp(diff).mean()),
    )


def probe_sequences(
    groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], limit: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Pick up to ``limit`` (prompt, response) pairs with non-empty responses, one per group
    first (round-robin over groups), so the probe covers as many prompts as possible.

    Args:
        groups: ``[(prompt_ids, [response_ids, ...]), ...]`` in a deterministic order.
        limit: the most sequences to take.

    Returns:
        ``(prompts, responses)`` of equal length (possibly empty).
    """
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    depth = 0
    while len(prompts) < limit:
        took = False
        for prompt, samples in groups:
            if depth < len(samples):
                took = True
                if len(samples[depth]) > 0 and len(prompt) > 0:
                    prompts.append([int(t) for t in prompt])
                    responses.append([int(t) for t in samples[depth]])
                    if len(prompts) == limit:
                        break
        if not took:
            break
        depth += 1
    return prompts, responses


def make_probe(groups: Sequence[Any], num_sequences: int) -> Any:
    """Freeze the verification probe (a :class:`~asyncrl.wire.messages.TokenBatch`) from a
    trained step's groups, in group-id order; ``None`` when they hold no tokens."""
    from asyncrl.policy.grpo import pack_tokens

    ordered = sorted(groups, key=lambda g: g.group_id)
    prompts, responses = probe_sequences(
        [(g.prompt_ids, [s.token_ids for s in g.samples]) for g in ordered], num_sequences
    )
    return pack_tokens(prompts, responses) if prompts else None
