"""Advantage estimators (asyncrl.policy.advantages) against hand computations and against
float64 implementations written here, element by element in plain Python, from the formulas
the module quotes (GRPO: Shao et al. 2024; RLOO: Ahmadian et al. 2024; REINFORCE++ with a
baseline: Hu et al. 2025), and through ``pack_groups`` as the train pump uses them."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncrl.config import from_dict
from asyncrl.errors import ConfigError, NonFiniteError
from asyncrl.policy.advantages import EPS, combined_rewards, group_advantages
from asyncrl.policy.grpo import advantages_of, nonfinite_cause, pack_groups
from asyncrl.policy.groups import CompletedSample, Group


def mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def pstd(xs: list[float]) -> float:
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))


def grpo_ref(r: list[float], normalize: bool) -> list[float]:
    m, s = mean(r), pstd(r)
    return [(x - m) / (s + EPS) if normalize and s > 0 else x - m for x in r]


def rloo_ref(r: list[float]) -> list[float]:
    """Each sample minus the mean of the others, by its definition (no closed form)."""
    return [x - mean([y for j, y in enumerate(r) if j != i]) for i, x in enumerate(r)]


def reinforce_pp_ref(groups: list[list[float]]) -> list[list[float]]:
    centred = [[x - mean(r) for x in r] for r in groups]
    flat = [x for g in centred for x in g]
    m, s = mean(flat), pstd(flat)
    return [[(x - m) / (s + EPS) for x in g] for g in centred]


def chunk_advantages(groups_rewards: list[list[float]], **kw: Any) -> list[np.ndarray]:
    """The train pump's advantages (:func:`advantages_of`) of one chunk of groups with these
    rewards."""
    return advantages_of([_group(f"g{i}", r) for i, r in enumerate(groups_rewards)],
                         **{"normalize": True, **kw})  # fmt: skip


def test_hand_computed_groups() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0).tolist() == [1.0, -1.0, -1.0, 1.0]
    # leave one out: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    assert group_advantages([1.0, 0.0, 0.0], estimator="rloo").tolist() == [1.0, -0.5, -0.5]
    assert group_advantages([3.0, 1.0], estimator="rloo").tolist() == [2.0, -2.0]
    # rloo ignores normalize (it has no std); grpo without it is Dr. GRPO's r - mean
    assert group_advantages([3.0, 1.0], estimator="rloo", normalize=False).tolist() == [2.0, -2.0]
    assert group_advantages([3.0, 1.0], normalize=False).tolist() == [1.0, -1.0]
    # reinforce_pp over two groups: centred [0.5, -0.5] and [1, -1]; batch std sqrt(0.625)
    (a, b) = chunk_advantages([[1.0, 0.0], [2.0, 0.0]], estimator="reinforce_pp")
    s = math.sqrt(0.625) + EPS
    assert a.tolist() == pytest.approx([0.5 / s, -0.5 / s], rel=1e-15)
    assert b.tolist() == pytest.approx([1 / s, -1 / s], rel=1e-15)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_equal_rewards_carry_no_signal(estimator: str) -> None:
    (a,) = chunk_advantages([[0.5, 0.5, 0.5]], estimator=estimator)  # type: ignore[arg-type]
    assert a.tolist() == [0.0, 0.0, 0.0]
    # a mean that rounds leaves ~1e-16 (divided by grpo's eps: ~1e-10), never a signal
    (a,) = chunk_advantages([[0.7, 0.7, 0.7]], estimator=estimator)  # type: ignore[arg-type]
    assert np.abs(a).max() < 1e-9


def close(got: list[float], ref: list[float], tol: float) -> bool:
    """The largest difference, relative to the largest advantage of the chunk, within tol."""
    top = max(abs(y) for y in ref) or 1.0
    return max(abs(x - y) for x, y in zip(got, ref)) / top <= tol


# measured on 2,000 such chunks (differences over the chunk's largest |advantage|): grpo
# 7.1e-16, rloo 1.1e-14 (its leave-one-out sums round differently), reinforce_pp 5.0e-16
TOL = {"grpo": 2e-15, "rloo": 3e-14, "reinforce_pp": 1.5e-15}


def test_random_chunks_against_the_float64_references() -> None:
    """2,000 random chunks (1-6 groups of 2-9 samples; binary, small and large rewards):
    every estimator against the references, float64 against float64."""
    rng = random.Random(26)
    for _ in range(2000):
        scale = rng.choice([1.0, 1e-3, 1e4])
        groups = [
            [rng.choice([0.0, 1.0]) if rng.random() < 0.5 else rng.gauss(0, 1) * scale
             for _ in range(rng.randint(2, 9))]
            for _ in range(rng.randint(1, 6))
        ]  # fmt: skip
        for normalize in (True, False):
            for g, a in zip(groups, chunk_advantages(groups, normalize=normalize)):
                assert close(a.tolist(), grpo_ref(g, normalize), TOL["grpo"]), (g, normalize)
        for g, a in zip(groups, chunk_advantages(groups, estimator="rloo")):
            assert close(a.tolist(), rloo_ref(g), TOL["rloo"]), g
        got = chunk_advantages(groups, estimator="reinforce_pp")
        flat = [x for a in got for x in a.tolist()]
        ref = [x for g in reinforce_pp_ref(groups) for x in g]
        assert close(flat, ref, TOL["reinforce_pp"]), groups


def _group(gid: str, rewards: list[float]) -> Group:
    samples = [CompletedSample(np.array([1, 2], np.int32), np.zeros(2, np.float32), "stop", r,
                               r > 0) for r in rewards]  # fmt: skip
    return Group(gid, f"p-{gid}", [7], 0, None, 0.0, samples, index=0)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_pack_groups_trains_each_sample_with_its_estimators_advantage(estimator: str) -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.25, 0.5, 1.0], [2.0, 2.0]]
    groups = [_group(f"g{i}", r) for i, r in enumerate(rewards)]
    batch = pack_groups(groups, normalize=True, estimator=estimator)  # type: ignore[arg-type]
    if estimator == "grpo":
        ref = [x for r in rewards for x in grpo_ref(r, True)]
    elif estimator == "rloo":
        ref = [x for r in rewards for x in rloo_ref(r)]
    else:
        ref = [x for g in reinforce_pp_ref(rewards) for x in g]
    # float32 on the wire: 6e-8 relative is half a float32 ulp
    assert batch.advantages.tolist() == pytest.approx(ref, rel=1e-7, abs=1e-7)


def test_an_overflowing_chunk_names_a_group() -> None:
    with pytest.raises(NonFiniteError, match="group g0"):
        pack_groups([_group("g0", [1e200, -1e200])], normalize=False, estimator="reinforce_pp")


def test_nonfinite_cause_reads_the_estimators_advantages() -> None:
    big = _group("g0", [3e6, 0.0, 0.0, 0.0])
    # rloo: 3e6 - 0 = 3e6, beyond the sane size; grpo normalized: about 1.7
    assert "rewards' magnitude" in nonfinite_cause(1, float("nan"), 1.0, [big], normalize=True,
                                                   estimator="rloo")  # fmt: skip
    assert "model's state" in nonfinite_cause(1, float("nan"), 1.0, [big], normalize=True)


def test_the_config_names_a_wrong_estimator(model_dir: Path) -> None:
    base = {"model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"}}
    assert from_dict(base | {"grpo": {"advantage_estimator": "rloo"}}).grpo.advantage_estimator == "rloo"
    with pytest.raises(ConfigError, match="grpo.advantage_estimator"):
        from_dict(base | {"grpo": {"advantage_estimator": "ppo"}})


def test_combined_rewards_by_hand() -> None:
    comps = [{"correct": 1.0, "format": 0.0}, {"correct": 0.0, "format": 1.0},
             {"correct": 0.0, "format": 0.0}, {"correct": 1.0, "format": 1.0, "extra": 9.0}]  # fmt: skip
    weights = {"correct": 1.0, "format": 0.2}
    assert combined_rewards(comps, weights).tolist() == pytest.approx([1.0, 0.2, 0.0, 1.2], rel=1e-15)
    # GDPO: each component z-scored in the group (both have mean 0.5, std 0.5), then weighted
    assert combined_rewards(comps, weights, normalization="group", eps=0.0).tolist() == (
        pytest.approx([1 - 0.2, -1 + 0.2, -1 - 0.2, 1 + 0.2], rel=1e-15))
    # a component equal across the group adds nothing; one at another scale counts by weight
    flat = [{"a": 5.0, "b": 1000.0}, {"a": 5.0, "b": 0.0}]
    assert combined_rewards(flat, {"a": 1.0, "b": 1.0}, normalization="group").tolist() == (
        pytest.approx([1.0, -1.0], rel=1e-5))  # eps 1e-6 against a std of 500
    with pytest.raises(KeyError, match="format"):
        combined_rewards([{"correct": 1.0}, {"correct": 0.0}], weights)


def _scored(gid: str, comps: list[dict[str, float]]) -> Group:
    samples = [CompletedSample(np.array([1, 2], np.int32), np.zeros(2, np.float32), "stop",
                               sum(c.values()), False, dict(c)) for c in comps]  # fmt: skip
    return Group(gid, f"p-{gid}", [7], 0, None, 0.0, samples, index=0)


def test_pack_groups_trains_on_the_weighted_components() -> None:
    rng = random.Random(6)
    weights = {"a": 1.0, "b": 0.3, "c": -0.5}
    groups, refs = [], []
    for gi in range(5):
        comps = [{k: rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) for k in "abcd"} for _ in range(4)]
        groups.append(_scored(f"g{gi}", comps))
        for normalization in ("none", "group"):
            cols = {k: [c[k] for c in comps] for k in weights}
            if normalization == "group":
                cols = {k: [(x - mean(v)) / (pstd(v) + EPS) if pstd(v) > 0 else 0.0 for x in v]
                        for k, v in cols.items()}  # fmt: skip
            r = [math.fsum(weights[k] * cols[k][i] for k in weights) for i in range(4)]
            refs.append((normalization, grpo_ref(r, True)))
    for normalization in ("none", "group"):
        batch = pack_groups(groups, normalize=True, weights=weights,
                            normalization=normalization)  # type: ignore[arg-type]
        want = [x for n, ref in refs if n == normalization for x in ref]
        # float32 on the wire; measured 4.5e-8 at most (absolute, advantages of order 1)
        assert batch.advantages.tolist() == pytest.approx(want, rel=0, abs=1.3e-7)


def test_a_missing_weighted_component_names_it_the_prompt_and_the_fix() -> None:
    g = _scored("g0", [{"correct": 1.0}, {"correct": 0.0, "format": 1.0}])
    with pytest.raises(ConfigError, match="'format'.*prompt 'p-g0'.*Fix"):
        pack_groups([g], normalize=True, weights={"correct": 1.0, "format": 0.5},
                    environment="arith")  # fmt: skip


def test_the_config_checks_the_reward_weights(model_dir: Path) -> None:
    base = {"model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"}}
    with pytest.raises(ConfigError, match="grpo.reward_normalization"):
        from_dict(base | {"grpo": {"reward_normalization": "group"}})
    with pytest.raises(ConfigError, match="grpo.reward_weights"):
        from_dict(base | {"grpo": {"reward_weights": {"a": float("inf")}}})
    cfg = from_dict(base | {"grpo": {"reward_weights": {"a": 1.0}, "reward_normalization": "group"}})
    assert cfg.grpo.reward_weights == {"a": 1.0}
