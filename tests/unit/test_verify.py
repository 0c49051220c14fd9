"""Refit verification logic (asyncrl.policy.verify) against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncrl.errors import RefitError
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.policy.verify import RefitCheck, compare, probe_sequences, verification_due


def test_schedule_first_then_every() -> None:
    """The first VERIFY_FIRST_STEPS (3) versions, then every ``every``-th; ``every = 0``: none,
    the first ones neither."""
    due = [v for v in range(0, 31) if verification_due(v, every=10)]
    assert due == [1, 2, 3, 10, 20, 30]
    assert [v for v in range(0, 8) if verification_due(v, every=1)] == list(range(1, 8))
    assert [v for v in range(0, 12) if verification_due(v, every=2)] == [1, 2, 3, 4, 6, 8, 10]
    assert [v for v in range(0, 31) if verification_due(v, every=0)] == []


def test_compare_against_hand_computation() -> None:
    gen = np.array([-1.0, -2.0, -0.5], np.float32)
    trn = np.array([-1.1, -2.0, -0.2], np.float32)
    a = compare("rollout:0", 4, gen, trn)
    diffs = [0.1, 0.0, 0.3]
    assert a.num_tokens == 3 and a.worker == "rollout:0" and a.version == 4
    assert a.mean_abs == pytest.approx(sum(diffs) / 3, abs=1e-6)
    assert a.max_abs == pytest.approx(0.3, abs=1e-6)
    assert a.mult_prob_error == pytest.approx(sum(math.exp(d) for d in diffs) / 3, abs=1e-6)
    a.check()  # no bound: compare alone judges nothing


def _check(**over) -> RefitCheck:
    return RefitCheck(**{"factor": 3.0, "floor": 0.01, "max_noise": 0.5, **over})


def test_the_bound_is_the_baseline_times_the_factor_or_plus_the_floor() -> None:
    """Baseline 0.1 (bf16-like): bound 0.3; baseline 0.001 (float32-like): 0.011."""
    t0 = np.array([-1.0, -2.0, -3.0, -4.0])
    check = _check()
    assert not check.started
    (base,) = check.baseline(0, {"rollout:0": t0 + [0.1, -0.1, 0.1, -0.1]}, t0)
    assert check.started and base.baseline == pytest.approx(0.1) and base.version == 0
    bound, setting = check.bound()
    assert bound == pytest.approx(0.3) and "NOISE_FACTOR" in setting
    fine = _check()
    fine.baseline(0, {"rollout:0": t0 + 0.001}, t0)
    assert fine.bound()[0] == pytest.approx(0.011)
    assert _check(fixed=0.05).bound() == (0.05, "asyncrl.policy.verify.TOLERANCE")


def test_judged_refits_by_hand() -> None:
    """Weights moved by 0.5 on every token: a generator on them with the baseline's noise
    passes; one left on version 0 fails, named closer to version 0 than to 1; one on other
    weights fails as not serving the trainer's weights."""
    t0 = np.array([-1.0, -2.0, -3.0, -4.0])
    t1 = t0 + 0.5
    noise = np.array([0.05, -0.05, 0.05, -0.05])
    check = _check()
    check.baseline(0, {"rollout:0": t0 + noise}, t0)  # baseline 0.05, bound 0.15
    right, stale, other = check.judge(1, {
        "rollout:0": t1 + noise, "rollout:1": t0 + noise, "rollout:2": t0 - 2.0,
    }, t1)  # fmt: skip
    assert (right.mean_abs, right.previous, right.previous_abs, right.moved_abs) == (
        pytest.approx(0.05), 0, pytest.approx(0.5), pytest.approx(0.5))
    assert right.bound == pytest.approx(0.15) and right.baseline == pytest.approx(0.05)
    right.check()
    assert stale.mean_abs == pytest.approx(0.5) and stale.previous_abs == pytest.approx(0.05)
    with pytest.raises(RefitError) as info:
        stale.check()
    said = str(info.value)
    assert "weight version 1" in said and "rollout:1" in said and "0.5000" in said
    assert "measured so far" in said and "is 0.0500" in said and "may reach 0.1500" in said
    assert "closer to the trainer's at version 0 (0.0500) than at 1" in said
    assert "still serves older weights" in said and said.count("Fix:") == 1
    with pytest.raises(RefitError, match="is not serving the trainer's weights"):
        other.check()
    # the next judgement compares with version 1's trainer logprobs
    (again,) = check.judge(2, {"rollout:0": t1 + noise}, t1)
    assert again.previous == 1 and again.moved_abs == 0.0
    record = again.metrics()
    assert record["bound"] == pytest.approx(0.15) and record["previous"] == 1


def test_the_noise_follows_refits_that_pass_and_not_those_that_fail() -> None:
    """The rounding grows as the policy sharpens: a refit that passes with 0.1 (bound 0.15)
    sets the next bound to 0.3; one that fails (0.5) sets nothing."""
    t = np.array([-1.0, -2.0, -3.0, -4.0])
    check = _check()
    check.baseline(0, {"rollout:0": t + 0.05}, t)
    (a,) = check.judge(1, {"rollout:0": t + 0.1}, t)
    a.check()
    assert check.noise == pytest.approx(0.1) and check.bound()[0] == pytest.approx(0.3)
    (b,) = check.judge(2, {"rollout:0": t + 0.5}, t)
    with pytest.raises(RefitError):
        b.check()
    assert check.noise == pytest.approx(0.1)
    fixed = _check(fixed=0.2)
    fixed.baseline(0, {"rollout:0": t + 0.05}, t)
    fixed.judge(1, {"rollout:0": t + 0.15}, t)
    assert fixed.bound()[0] == 0.2


def test_a_fixed_bound_is_named_as_fixed() -> None:
    """With a fixed bound (``asyncrl.policy.verify.TOLERANCE``), the error names that setting
    and its value, not a bound derived from measured rounding."""
    t = np.array([-1.0, -2.0, -3.0])
    check = _check(fixed=0.05)
    check.baseline(0, {"rollout:0": t + 0.01}, t)
    (a,) = check.judge(1, {"rollout:0": t + 0.3}, t - 1.0)
    with pytest.raises(RefitError) as failed:
        a.check()
    text = str(failed.value)
    assert "> asyncrl.policy.verify.TOLERANCE = 0.05, a fixed bound (their rounding measured " \
        "before any update: 0.0100)" in text
    assert "measured so far" not in text and "NOISE_FACTOR" not in text


def test_a_baseline_beyond_max_noise_is_another_model() -> None:
    t0 = np.array([-1.0, -2.0])
    with pytest.raises(RefitError, match=r"before any update.*0\.8000.*asyncrl.policy.verify."
                       r"MAX_NOISE = 0\.5.*\(refit.verify_every_steps = 0\)"):
        _check().baseline(3, {"rollout:0": t0 - 0.8}, t0)
    with pytest.raises(RefitError, match=r"asyncrl.policy.verify.TOLERANCE = 0\.01"):
        _check(fixed=0.01).baseline(3, {"rollout:0": t0 - 0.05}, t0)


def test_the_defaults_are_the_documented_ones() -> None:
    check = RefitCheck.measured()
    assert (check.factor, check.floor, check.max_noise, check.fixed) == (3.0, 0.001, 0.5, None)


_vectors = st.lists(st.floats(-20.0, -0.01), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    t0=_vectors, seed=st.integers(0, 2**32 - 1), noise=st.floats(1e-7, 0.3),
    move=st.floats(0.0, 3.0), steps=st.integers(1, 6), spread=st.floats(0.0, 1.5),
)  # fmt: skip
def test_correct_refits_pass_and_stale_ones_fail_once_the_weights_moved(
    t0: list[float], seed: int, noise: float, move: float, steps: int, spread: float
) -> None:
    """Driving the real class: each version moves the trainer's logprobs by ``move`` on
    average; a correct generator sits at the trainer's with rounding up to 1.5x the
    baseline's (``spread``) and always passes; a generator stuck on version 0 fails wherever
    the weights moved more than the bound plus its own rounding (by the triangle inequality
    on the mean absolute difference, it cannot be within the bound then), and passes
    (harmlessly) while they moved less than the bound less its rounding."""
    rng = np.random.default_rng(seed)
    trainer = np.array(t0)
    sign = rng.choice([-1.0, 1.0], size=trainer.size)
    check = _check()
    check.baseline(0, {"rollout:0": trainer + noise * sign}, trainer)
    base = trainer.copy()
    for version in range(1, steps + 1):
        bound = check.bound()[0]  # follows the refits that passed
        trainer = trainer + rng.normal(size=trainer.size) * move
        rounding = noise * spread * rng.choice([-1.0, 1.0], size=trainer.size)
        right, stale = check.judge(version, {
            "rollout:0": trainer + rounding, "rollout:1": base + noise * sign,
        }, trainer)  # fmt: skip
        right.check()
        drift = float(np.abs(trainer - base).mean())
        if drift > bound + noise:
            with pytest.raises(RefitError):
                stale.check()
        elif drift <= bound - noise:
            stale.check()


@pytest.mark.parametrize(
    ("gen", "trn", "match"),
    [
        ([-1.0, -2.0], [-1.0], "returned"),
        ([], [], "no tokens"),
        ([-1.0, float("nan")], [-1.0, -1.0], "rollout:1 returned non-finite"),
        ([-1.0, -1.0], [float("-inf"), -1.0], "the trainer returned non-finite"),
    ],
)
def test_compare_refuses_broken_inputs(gen: list, trn: list, match: str) -> None:
    with pytest.raises(RefitError, match=match):
        compare("rollout:1", 2, np.array(gen), np.array(trn))


def test_probe_takes_one_per_group_first_and_skips_empty() -> None:
    groups = [
        ([1, 2], [[5], [6, 7]]),
        ([1, 3], [[], [8]]),  # first sample empty (stopped at once): skipped
        ([1, 4], [[9, 9]]),
    ]
    prompts, responses = probe_sequences(groups, limit=4)
    assert prompts == [[1, 2], [1, 4], [1, 2], [1, 3]]
    assert responses == [[5], [9, 9], [6, 7], [8]]
    assert probe_sequences(groups, limit=100)[1] == [[5], [9, 9], [6, 7], [8]]
    assert probe_sequences([], limit=3) == ([], [])
