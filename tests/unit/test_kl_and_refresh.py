"""The plan of logprob refreshes, the mini-batches and the KL in the reward.

The KL estimators (Schulman, "Approximating KL divergence", 2020; with r = pi_ref / pi and
d = log r: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r): the numpy twin the
controller uses for a KL in the reward is checked against plain Python float64 written here
from those formulas. The torch term of the loss, against the same formulas and their
derivatives, is asyncrl_torch's (backends/asyncrl-torch/tests/test_kl_term.py).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from asyncrl.config import from_dict
from asyncrl.errors import ConfigError
from asyncrl.policy.grpo import (
    concat_batches,
    mini_batches,
    pack_groups,
    per_sample,
    per_sequence,
    shard_batch,
)
from asyncrl.policy.loss_inputs import LossInputs, kl_estimate, sequence_sums
from asyncrl.wire.messages import TrainBatch


def kl_python(lp: float, ref: float, estimator: str) -> float:
    log_r = ref - lp
    return {"k1": -log_r, "k2": log_r * log_r / 2, "k3": math.exp(log_r) - 1 - log_r}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_numpy_kl_estimate_against_the_formulas(estimator: str) -> None:
    rng = random.Random(3)
    lp = [rng.uniform(-4, -0.01) for _ in range(40)]
    ref = [x + rng.gauss(0, 0.5) for x in lp]
    np.testing.assert_allclose(kl_estimate(np.array(lp), np.array(ref), estimator),
                               [kl_python(a, b, estimator) for a, b in zip(lp, ref)], rtol=1e-12)
    assert (kl_estimate(np.array(lp), np.array(ref), "k3") >= 0).all()


def _config(tmp_path, **sections):
    (tmp_path / "config.json").write_text('{"vocab_size": 8}')
    (tmp_path / "tokenizer.json").write_text("{}")
    return from_dict({"model": {"path": str(tmp_path)}, "environment": {"name": "repeat-digit"},
                      **sections})  # fmt: skip


def test_the_loss_asks_for_exactly_the_refreshes_it_reads(tmp_path) -> None:
    def inputs(**sections) -> LossInputs:
        return LossInputs.of(_config(tmp_path, **sections))

    assert inputs() == LossInputs(proximal=False, reference=False, reference_in_reward=False)
    assert inputs().names == frozenset()
    # one optimizer step: the loss's own forward is the pre-step policy (no refresh)
    assert not inputs(loss={"proximal_policy": "current"}).proximal
    # several: the weights move between them, so the pre-step logprobs are refreshed
    several = inputs(loss={"proximal_policy": "current"}, grpo={"mini_steps": 2})
    assert several.proximal and several.names == {"proximal_logprobs"}
    assert inputs(loss={"proximal_policy": "current"}, grpo={"update_epochs": 2}).proximal
    assert not inputs(grpo={"mini_steps": 2}).proximal  # behaviour as proximal: nothing to do
    kl = inputs(loss={"kl_coef": 0.01})
    assert kl.reference and kl.names == {"reference_logprobs"}
    in_reward = inputs(loss={"kl_coef": 0.01, "kl_in": "reward"})
    assert in_reward.reference_in_reward and in_reward.names == frozenset()


def test_contradictions_are_refused_before_anything_starts(tmp_path) -> None:
    with pytest.raises(ConfigError, match="loss.reference_path.*kl_coef"):
        _config(tmp_path, loss={"reference_path": "/somewhere"})
    with pytest.raises(ConfigError, match="loss.kl_coef"):
        _config(tmp_path, loss={"kl_coef": -1.0})
    with pytest.raises(ConfigError, match="grpo.mini_steps"):
        _config(tmp_path, grpo={"mini_steps": 0})
    with pytest.raises(ConfigError, match="grpo.mini_steps.*empty"):
        _config(tmp_path, grpo={"prompts_per_step": 2, "samples_per_prompt": 2, "mini_steps": 5})


def _batch(rng: np.random.Generator, n: int, *, refreshed: bool) -> TrainBatch:
    seq = rng.integers(3, 9, n).astype(np.int32)
    prompt = rng.integers(1, 3, n).astype(np.int32)
    responses = int((seq - prompt).sum())
    return TrainBatch(
        tokens=rng.integers(0, 50, int(seq.sum())).astype(np.int32), seq_lens=seq,
        prompt_lens=prompt, behaviour_logprobs=-rng.random(responses).astype(np.float32),
        advantages=rng.normal(size=n).astype(np.float32),
        loss_mask=(rng.random(responses) < 0.8).astype(np.uint8),
        proximal_logprobs=-rng.random(responses).astype(np.float32) if refreshed else None,
        reference_logprobs=-rng.random(responses).astype(np.float32) if refreshed else None,
    )  # fmt: skip


def _sequences(batch: TrainBatch) -> list[tuple]:
    """Each sequence's tokens and per-token values, as plain lists (the independent view)."""
    out, t, r = [], 0, 0
    for n, p, a in zip(batch.seq_lens, batch.prompt_lens, batch.advantages):
        k = n - p
        per_token = tuple(None if (v := getattr(batch, f)) is None else v[r:r + k].tolist()
                          for f in ("behaviour_logprobs", "loss_mask", "proximal_logprobs",
                                    "reference_logprobs"))  # fmt: skip
        out.append((batch.tokens[t:t + n].tolist(), int(p), float(a), *per_token))
        t, r = t + n, r + k
    return out


@pytest.mark.parametrize("refreshed", [False, True])
def test_mini_batches_and_shards_keep_every_sequence_with_its_values(refreshed: bool) -> None:
    rng = np.random.default_rng(7)
    chunks = [_batch(rng, 5, refreshed=refreshed), _batch(rng, 6, refreshed=refreshed)]
    whole = concat_batches(chunks)
    assert _sequences(whole) == _sequences(chunks[0]) + _sequences(chunks[1])
    parts = mini_batches(whole, 3)
    assert [len(p.seq_lens) for p in parts] == [3, 4, 4]
    assert sum((_sequences(p) for p in parts), []) == _sequences(whole)
    shards = shard_batch(parts[2], 2)
    assert sorted(sum((_sequences(s) for s in shards), [])) == sorted(_sequences(parts[2]))
    with pytest.raises(ValueError, match="12 mini-batches"):
        mini_batches(whole, 12)
    with pytest.raises(ValueError, match="only some"):
        concat_batches([_batch(rng, 2, refreshed=True), _batch(rng, 2, refreshed=False)])


def test_kl_in_the_reward_penalizes_each_sample_by_its_sampled_tokens() -> None:
    """Sequence sums skip untrained tokens; an episode's sequences add up to its sample."""
    from asyncrl.policy.groups import CompletedSample, Group, Part

    def sample(reward: float, tokens: list[int], earlier: tuple = ()) -> CompletedSample:
        return CompletedSample(token_ids=tokens, logprobs=[-0.5] * len(tokens),
                               finish_reason="stop", reward=reward, correct=False,
                               earlier=earlier)  # fmt: skip

    def group(gid: str, prompt_ids: list[int], samples: list) -> Group:
        return Group(gid, gid, prompt_ids, 0, None, 0.0, samples, index=0)

    part = Part(prompt_ids=[1], token_ids=[5, 6], logprobs=[-0.1, -0.2],
                loss_mask=np.array([1, 0], np.uint8), finish_reason="stop")  # fmt: skip
    groups = [group("a", [1, 2], [sample(1.0, [3, 4], (part,)), sample(0.0, [3])]),
              group("b", [2], [sample(0.5, [4]), sample(0.5, [5, 5])])]
    batch = pack_groups(groups, normalize=False)
    assert list(batch.seq_lens) == [3, 4, 3, 2, 3]  # the split-off part, then its own sequence
    per_token = np.arange(1, 9, dtype=np.float64)  # one value per response token
    by_sequence = sequence_sums(batch, per_token)
    np.testing.assert_array_equal(by_sequence, [1, 3 + 4, 5, 6, 7 + 8])  # token 2 is masked
    sums = per_sample(groups, by_sequence)
    np.testing.assert_array_equal(sums[0], [1 + 7, 5])
    np.testing.assert_array_equal(sums[1], [6, 15])
    assert per_sequence(groups, [np.array([1.0, 2.0]), np.array([3.0, 4.0])]).tolist() == [
        1, 1, 2, 3, 4]


def test_max_num_epochs_bounds_the_runs_steps(tmp_path) -> None:
    from asyncrl.config.modes import make_groups, run_steps

    cfg = _config(tmp_path, run={"num_steps": 100, "max_num_epochs": 3}, grpo={"prompts_per_step": 8})
    assert run_steps(cfg, 50) == 3 * (50 // 8) == 18  # each pass drops its remainder
    assert run_steps(cfg, 1000) == 100  # num_steps comes first
    assert make_groups(cfg, 50).num_steps == 18
    assert run_steps(_config(tmp_path, run={"num_steps": 7}), 10) == 7  # 0: no bound
    with pytest.raises(ConfigError, match="run.max_num_epochs"):
        _config(tmp_path, run={"max_num_epochs": -1})
