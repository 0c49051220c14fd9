"""Refit verification: does the generator serve the trainer's weights? (pure logic, no I/O)

Right after a refit the generators and the trainer hold the same weights, so their logprobs of
the same fixed token sequences differ only by numerics: two kernels, two dtypes, a quantized KV
cache. How much depends on the model, its dtype and the tokens (bf16 on unlikely tokens of a
small model: 0.1 nats on average; float32: 1e-5), so no fixed tolerance fits every run.
:class:`RefitCheck` measures it instead: before the first update, when both sides hold the
weights loaded from the same files, it scores the *probe batch* on both (the *baseline*); a
verified refit fails when the disagreement rises far beyond the noise measured so far
(:data:`NOISE_FACTOR` times it, or it plus :data:`NOISE_FLOOR`): the
baseline, or the largest disagreement of a refit that passed since, because the rounding
grows as the policy sharpens (the CPU demo: 2.5x over 30 steps) while a stale engine's jumps.
A refit that leaves part of the engine on old weights (a tensor or a bucket not loaded, an
engine that kept its weights) or serves another model shows up as such a rise once the
weights moved; while they have not moved, nothing is stale (docs/refit.md has the rule and the
margins measured).

Each judged refit also says how far the generator sits from the trainer's logprobs at the last
version judged (:attr:`Agreement.previous_abs`): within the bound of those, and not of the new
ones, it still serves older weights, which the error says.

The probe batch is frozen from the first trained step's own samples (:func:`probe_sequences`):
real prompts and completions of the task, so the check measures the tokens training uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from asyncrl.errors import RefitError

__all__ = [
    "MAX_NOISE", "NOISE_FACTOR", "NOISE_FLOOR", "PROBE_SEQUENCES", "TOLERANCE",
    "VERIFY_FIRST_STEPS", "Agreement", "RefitCheck", "compare", "make_probe", "probe_sequences",
    "verification_due",
]  # fmt: skip

# The margins of the check: config keys ``refit.verify_noise_factor``, ``verify_noise_floor``,
# ``verify_max_noise``, ``verify_tolerance`` and ``verify_num_sequences`` until issue 50
# (measured once, never needed changing), and which refits are checked first
# (``refit.verify_first_steps``); whether and how often to verify stays a key:
# ``refit.verify_every_steps``.
NOISE_FACTOR = 3.0
"""A verified refit fails when a generator's mean |logprob - trainer's logprob| on the probe
exceeds this many times the noise measured so far (the baseline: both sides on the same weights
before the first update; then the largest disagreement of a refit that passed). On the CPU demo
the baseline was 0.0044 (bfloat16) and 2.7e-7 (float32), correct refits after it stayed within
1.5x, and a refit that left the engine on old weights measured 40-150x (docs/refit.md)."""
NOISE_FLOOR = 0.001
"""The bound is at least the noise plus this (nats), for sides that agree to float32 rounding
(2.7e-7 on the CPU demo, at most 3.8e-7 after real steps), where 3x the noise is no margin."""
MAX_NOISE = 0.5
"""The most the baseline itself may be (nats): beyond it the two sides do not run the same
model (another path or revision, another tokenizer, a far dtype), and the run stops at its
first step. bfloat16 rounding of small models measured up to ~0.1."""
VERIFY_FIRST_STEPS = 3
"""The refits to weight versions 1 to this are verified whatever ``refit.verify_every_steps``
says (unless it is 0: no verification). A refit path that does not work (a tensor or a bucket
not loaded, an engine that keeps its weights: the vLLM CPU build's tied ``lm_head`` kept them
on one kernel path) fails from the first refit on, so the first refits are where it shows;
and several in a row, because a generator left behind moves further from the trainer with each
version: on the CPU demo one step moves the probe by 0.015 against a bf16 bound of 0.013
(docs/refit.md), so the first judged refit alone may miss a generator that did not load
it, while by the third refit such a generator is three versions behind. Costs three probe
scorings at the start of a run. The config key ``refit.verify_first_steps`` until issue 50."""
TOLERANCE: float | None = None
"""A fixed bound on the mean |logprob difference| (nats) instead of the measured one
(``None``: measured); the baseline is then held to it too."""
PROBE_SEQUENCES = 16
"""Sequences in the probe batch (one per prompt group first): enough tokens that a stale
bucket shows in the mean, few enough that scoring them on both sides costs a fraction of a
step."""


def verification_due(version: int, every: int) -> bool:
    """Whether the refit that installs weight version ``version`` (1, 2, ...) is verified:
    the first :data:`VERIFY_FIRST_STEPS` (read when called), then every ``every``-th.

    Args:
        version: the version just installed on the generators.
        every: ``refit.verify_every_steps`` (0: none is, the first ones neither).
    """
    if version < 1 or every <= 0:
        return False
    return version <= VERIFY_FIRST_STEPS or version % every == 0


FIXED = "asyncrl.policy.verify.TOLERANCE"
"""The setting of a fixed bound (:attr:`Agreement.setting`)."""

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
    bound: float = float("inf")
    """The largest ``mean_abs`` this refit may show (:meth:`RefitCheck.bound`)."""
    setting: str = ""
    """What sets :attr:`bound`, as the error names it."""
    baseline: float | None = None
    """The noise :attr:`bound` was set from: the disagreement measured before any update
    (both sides on the same weights), or a larger one of a refit that passed since."""
    previous: int | None = None
    """The last version judged before this one (or the baseline's)."""
    previous_abs: float | None = None
    """Mean |generator - trainer's logprobs at :attr:`previous`|."""
    moved_abs: float | None = None
    """Mean |trainer now - trainer at :attr:`previous`|: how far the weights moved on the
    probe since."""

    def metrics(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "worker": self.worker,
            "version": self.version,
            "num_tokens": self.num_tokens,
            "mean_abs": self.mean_abs,
            "max_abs": self.max_abs,
            "mult_prob_error": self.mult_prob_error,
        }
        if self.bound != float("inf"):
            out["bound"] = self.bound
        if self.baseline is not None:
            out["baseline"] = self.baseline
        if self.previous is not None and self.previous_abs is not None:
            out.update(previous=self.previous, previous_abs=self.previous_abs,
                       moved_abs=self.moved_abs or 0.0)  # fmt: skip
        return out

    def check(self) -> None:
        """Raise :class:`RefitError` when ``mean_abs`` exceeds :attr:`bound`, saying whether
        the generator still serves older weights (it is within the bound of the trainer's
        logprobs at :attr:`previous`) or other ones."""
        if self.mean_abs <= self.bound:
            return
        if self.setting == FIXED:
            measured = f"> {FIXED} = {self.bound:g}, a fixed bound"
            if self.baseline is not None:
                measured += f" (their rounding measured before any update: {self.baseline:.4f})"
        elif self.baseline is not None:
            measured = (f"their rounding measured so far (before any update, on the same "
                        f"weights, and on the refits that passed) is {self.baseline:.4f}, so a "
                        f"refit may reach {self.bound:.4f} ({self.setting})")  # fmt: skip
        else:
            measured = f"> {self.setting} = {self.bound:g}"
        if self.previous_abs is not None and self.previous_abs <= self.bound:
            why = (f"Its logprobs sit closer to the trainer's at version {self.previous} "
                   f"({self.previous_abs:.4f}) than at {self.version}: the generator still "
                   "serves older weights (a tensor or a bucket was not loaded, or the engine "
                   "kept its weights), so training would go off-policy without notice.")
        else:
            why = ("The generator is not serving the trainer's weights (a tensor was not "
                   "loaded, or the two sides run different models or dtypes), so training "
                   "would go off-policy without notice.")
        raise RefitError(
            f"refit verification failed at weight version {self.version}: generator "
            f"{self.worker} and the trainer disagree on the probe batch ({self.num_tokens} "
            f"tokens) by a mean |logprob difference| of {self.mean_abs:.4f} (max "
            f"{self.max_abs:.3f}); {measured}. {why} Fix: find the cause in the generator's "
            "log (docs/refit.md, 'Refit verification'); refit.verify_every_steps = 0 turns "
            "the check off"
        )


class RefitCheck:
    """Decides verified refits on evidence (the module docstring): the baseline measured
    before any update, then each verified refit against a bound set by it. Pure state: the
    caller scores the probe (``generators``: worker -> its logprobs; ``trainer``: the
    trainer's, of the same tokens) and raises what :meth:`Agreement.check` raises.

    Args:
        factor: :data:`NOISE_FACTOR`.
        floor: :data:`NOISE_FLOOR` (nats).
        max_noise: :data:`MAX_NOISE`: the most the baseline may be.
        fixed: :data:`TOLERANCE`: a fixed bound instead of the measured one.
    """

    def __init__(
        self, *, factor: float, floor: float, max_noise: float, fixed: float | None = None
    ) -> None:
        self.factor, self.floor, self.max_noise, self.fixed = factor, floor, max_noise, fixed
        self.noise: float | None = None
        """The noise bounds are set from: the baseline (largest over the generators), then
        the largest disagreement of a judged refit within its bound."""
        self._last: tuple[int, np.ndarray] | None = None
        """The trainer's probe logprobs at the last version judged (or the baseline's)."""

    @classmethod
    def measured(cls) -> RefitCheck:
        """With the module's margins (:data:`NOISE_FACTOR`, :data:`NOISE_FLOOR`,
        :data:`MAX_NOISE`, :data:`TOLERANCE`), read when called."""
        return cls(factor=NOISE_FACTOR, floor=NOISE_FLOOR, max_noise=MAX_NOISE,
                   fixed=TOLERANCE)  # fmt: skip

    @property
    def started(self) -> bool:
        """Whether the baseline was measured (refits are judged only after it)."""
        return self.noise is not None

    def bound(self) -> tuple[float, str]:
        """The largest mean disagreement a verified refit may show, and the settings that
        set it."""
        if self.fixed is not None:
            return self.fixed, FIXED
        assert self.noise is not None, "judged before the baseline"
        return max(self.factor * self.noise, self.noise + self.floor), (
            "asyncrl.policy.verify.NOISE_FACTOR x that, at least that + NOISE_FLOOR"
        )

    def baseline(
        self, version: int, generators: Mapping[str, np.ndarray], trainer: np.ndarray
    ) -> list[Agreement]:
        """Both sides hold weight ``version``, loaded from the same files (before the first
        update of a run or a resume): their disagreement is the noise later refits are judged
        by.

        Raises:
            RefitError: a generator disagrees beyond ``max_noise`` (or the fixed bound)
                already: the two sides do not run the same model.
        """
        agreements = [compare(w, version, g, trainer) for w, g in generators.items()]
        if not agreements:
            return []
        self.noise = max(a.mean_abs for a in agreements)
        self._last = (version, np.asarray(trainer, np.float64))
        limit, key = (self.fixed, FIXED) if self.fixed is not None else (
            self.max_noise, "asyncrl.policy.verify.MAX_NOISE")  # fmt: skip
        for a in agreements:
            if a.mean_abs > limit:
                raise RefitError(
                    f"refit verification: before any update, generator {a.worker} and the "
                    f"trainer, both on weight version {version}, disagree on the probe batch "
                    f"({a.num_tokens} tokens) by a mean |logprob difference| of "
                    f"{a.mean_abs:.4f} (max {a.max_abs:.3f}) > {key} = {limit:g}: they do not "
                    "run the same model (another model path or revision, another tokenizer, "
                    "a dtype far from the other side's). Fix: load the same model.path on "
                    "both sides; only if this is your model's rounding, turn the check off "
                    "(refit.verify_every_steps = 0)"
                )
        return [replace(a, baseline=self.noise) for a in agreements]

    def judge(
        self, version: int, generators: Mapping[str, np.ndarray], trainer: np.ndarray
    ) -> list[Agreement]:
        """The refit to ``version`` that both sides should now hold: each generator's
        agreement with its bound (check each with :meth:`Agreement.check`)."""
        bound, setting = self.bound()
        trn = np.asarray(trainer, np.float64)
        previous = moved = None
        if self._last is not None and self._last[1].shape == trn.shape:
            previous, before = self._last
            moved = float(np.abs(trn - before).mean()) if trn.size else 0.0
        out = []
        for worker, gen in generators.items():
            a = compare(worker, version, gen, trn)
            previous_abs = None
            if previous is not None:
                previous_abs = float(np.abs(np.asarray(gen, np.float64) - before).mean())
            out.append(replace(a, bound=bound, setting=setting, baseline=self.noise,
                               previous=previous, previous_abs=previous_abs,
                               moved_abs=moved))  # fmt: skip
        self._last = (version, trn)
        passed = [a.mean_abs for a in out if a.mean_abs <= bound]
        if passed and self.noise is not None and self.fixed is None:
            self.noise = max(self.noise, *passed)
        return out


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
