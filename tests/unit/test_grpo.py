"""GRPO advantages and batch packing against hand computations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from asyncrl.policy.groups import CompletedSample, Group, Part
from asyncrl.errors import NonFiniteError
from asyncrl.policy.grpo import group_advantages, nonfinite_cause, pack_groups, pack_tokens, shard_batch


def test_advantages_hand_computed() -> None:
    # rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> +-1 (minus eps effect)
    a = group_advantages([1.0, 0.0, 0.0, 1.0], normalize=True, eps=0.0)
    assert a.tolist() == [1.0, -1.0, -1.0, 1.0]
    # 3 samples: rewards 2, 0, 1 -> mean 1, std sqrt(2/3)
    b = group_advantages([2.0, 0.0, 1.0], normalize=True, eps=0.0)
    s = math.sqrt(2 / 3)
    assert b == pytest.approx([1 / s, -1 / s, 0.0])
    c = group_advantages([2.0, 0.0, 1.0], normalize=False)
    assert c.tolist() == [1.0, -1.0, 0.0]


def test_constant_rewards_give_zero_advantage() -> None:
    assert group_advantages([1.0, 1.0, 1.0]).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        group_advantages([1.0])


def group(
    gid: str, prompt: list[int], rewards: list[float], lens: list[int], masks: list | None = None
) -> Group:
    g = Group(gid, gid, prompt, 0, 0, 0.0, index=0)
    g.samples = [
        CompletedSample(
            np.arange(10, 10 + n, dtype=np.int32),
            -np.arange(1, n + 1, dtype=np.float32) / 10,
            "stop",
            r,
            r > 0,
            loss_mask=None if masks is None or masks[i] is None else np.array(masks[i], np.uint8),
        )
        for i, (r, n) in enumerate(zip(rewards, lens))
    ]
    g.end_version = 0
    return g


def test_pack_groups_layout() -> None:
    b = pack_groups([group("a", [1, 2], [1.0, 0.0], [2, 3]), group("b", [1], [0.0, 0.0], [1, 1])], normalize=True)
    assert b.seq_lens.tolist() == [4, 5, 2, 2]
    assert b.prompt_lens.tolist() == [2, 2, 1, 1]
    assert b.tokens.tolist() == [1, 2, 10, 11, 1, 2, 10, 11, 12, 1, 10, 1, 10]
    assert b.behaviour_logprobs.size == 2 + 3 + 1 + 1
    assert b.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert b.loss_mask.dtype == np.uint8 and b.loss_mask.tolist() == [1] * 7  # no masks: all train


def test_pack_groups_concatenates_loss_masks_in_sample_order() -> None:
    """A multi-turn sample's mask (0 at inserted observation tokens) lands beside its own
    behaviour logprobs; a sample without one trains every token."""
    masks = [[1, 0], [1, 0, 1]]
    b = pack_groups(
        [group("a", [1, 2], [1.0, 0.0], [2, 3], masks), group("b", [1], [0.0, 0.0], [1, 1])],
        normalize=True,
    )
    assert b.loss_mask.dtype == np.uint8
    assert b.loss_mask.tolist() == [1, 0, 1, 0, 1, 1, 1]
    assert b.loss_mask.size == b.behaviour_logprobs.size


def test_pack_groups_trains_an_episodes_parts_after_their_own_prompts() -> None:
    """A sample with its own prompt (an episode's render) and a sequence its template split
    off before: both sequences, in order, each after its own prompt, with its mask and the
    sample's advantage."""
    g = group("a", [1, 2], [1.0, 0.0], [2, 1])
    first = Part(np.array([7, 7, 7], np.int32), np.array([20, 21], np.int32),
                 np.array([-0.5, 0.0], np.float32), np.array([1, 0], np.uint8), "stop")
    g.samples[0] = dataclasses.replace(
        g.samples[0], prompt_ids=np.array([5, 6, 7, 8], np.int32), earlier=(first,),
        loss_mask=np.array([0, 1], np.uint8),
    )  # fmt: skip
    b = pack_groups([g], normalize=True)
    assert b.seq_lens.tolist() == [5, 6, 3] and b.prompt_lens.tolist() == [3, 4, 2]
    assert b.tokens.tolist() == [7, 7, 7, 20, 21, 5, 6, 7, 8, 10, 11, 1, 2, 10]
    assert b.behaviour_logprobs.tolist() == pytest.approx([-0.5, 0.0, -0.1, -0.2, -0.1])
    assert b.loss_mask.tolist() == [1, 0, 0, 1, 1]
    assert b.advantages.tolist() == pytest.approx([1.0, 1.0, -1.0], abs=1e-5)


@pytest.mark.parametrize(
    "mask, problem",
    [([1, 0, 1], "shape (3,)"), ([1, 2], "values [1, 2]"), ([[1, 1]], "shape (1, 2)")],
)
def test_pack_groups_refuses_a_misaligned_loss_mask(mask, problem) -> None:
    with pytest.raises(ValueError, match=r"one 0 or 1 per token \(2 tokens\)") as err:
        pack_groups([group("a", [1], [1.0, 0.0], [2, 2], [mask, None])], normalize=True)
    assert problem in str(err.value) and "CompletedSample" in str(err.value)


def test_shard_batch_partitions_sequences_exactly() -> None:
    masks = [[1, 0, 0, 1, 1], [0], [1, 1, 0]]  # each sequence's own pattern
    b = pack_groups(
        [group("a", [1, 2], [1.0, 0.0, 0.0], [5, 1, 3], masks),
         group("b", [3], [1.0, 0.0], [2, 4], [[0, 1], None])],
        normalize=False,
    )  # fmt: skip
    for k in (1, 2, 3, 7):
        shards = shard_batch(b, k)
        assert len(shards) == k
        assert all(s.loss_mask.dtype == np.uint8 for s in shards)
        assert sum(int(s.loss_mask.sum()) for s in shards) == int(b.loss_mask.sum()) == 10
        assert sum(s.seq_lens.size for s in shards) == b.seq_lens.size
        # every sequence appears exactly once with its own tokens/logprobs/advantage
        seen = []
        for s in shards:
            off = roff = 0
            for i in range(s.seq_lens.size):
                n, p = int(s.seq_lens[i]), int(s.prompt_lens[i])
                seen.append((tuple(s.tokens[off : off + n]), tuple(s.behaviour_logprobs[roff : roff + n - p]), float(s.advantages[i]), tuple(s.loss_mask[roff : roff + n - p])))
                off, roff = off + n, roff + n - p
        orig = []
        off = roff = 0
        for i in range(b.seq_lens.size):
            n, p = int(b.seq_lens[i]), int(b.prompt_lens[i])
            orig.append((tuple(b.tokens[off : off + n]), tuple(b.behaviour_logprobs[roff : roff + n - p]), float(b.advantages[i]), tuple(b.loss_mask[roff : roff + n - p])))
            off, roff = off + n, roff + n - p
        assert sorted(seen) == sorted(orig)
    loads = [int(s.seq_lens.sum()) for s in shard_batch(b, 2)]
    assert max(loads) - min(loads) <= 3  # greedy balance: 7,6,5,3,3 tokens -> 11 / 13


def test_pack_tokens() -> None:
    t = pack_tokens([[1, 2], [3]], [[4], [5, 6]])
    assert t.tokens.tolist() == [1, 2, 4, 3, 5, 6]
    assert t.seq_lens.tolist() == [3, 3] and t.prompt_lens.tolist() == [2, 1]


def test_shard_tokens_are_contiguous_runs_in_order() -> None:
    from asyncrl.policy.grpo import shard_tokens

    t = pack_tokens([[1, 2], [3], [4, 5, 6], [7]], [[8], [9, 10], [11], [12, 13]])
    for k in (1, 2, 3, 5):
        shards = shard_tokens(t, k)
        assert len(shards) == k
        assert np.concatenate([s.tokens for s in shards]).tolist() == t.tokens.tolist()
        assert np.concatenate([s.seq_lens for s in shards]).tolist() == [3, 3, 4, 3]
        assert np.concatenate([s.prompt_lens for s in shards]).tolist() == [2, 1, 3, 1]
        assert sum(s.seq_lens.size == 0 for s in shards) == max(0, k - 4)


# --------------------------------------------------------------------------- overflow
def test_rewards_that_overflow_the_advantage_math_are_refused() -> None:
    # 1e150 still works, and gives the advantages of [1, 0, 0, 0] (the math scales):
    # mean 1/4, std sqrt(3)/4, so (1 - 1/4) / (sqrt(3)/4) = sqrt(3) and -1/sqrt(3)
    big = group_advantages([1e150, 0.0, 0.0, 0.0], eps=0.0)
    assert big == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3),
                                 -1 / math.sqrt(3)], rel=1e-12)  # fmt: skip
    # 1e308 squared overflows float64: the std is inf and the advantages would be all 0
    with pytest.raises(OverflowError, match="standard deviation overflows float64"):
        group_advantages([1e308, 0.0, 0.0, 0.0])
    with pytest.raises(OverflowError, match="mean overflows float64"):  # 2e308 / 4
        group_advantages([1e308, 1e308, 0.0, 0.0])
    # unnormalized, 1e39 - mean does not fit the trainer's float32
    assert group_advantages([1e38, 0.0], normalize=False).tolist() == [5e37, -5e37]
    with pytest.raises(OverflowError, match="exceeds float32"):
        group_advantages([1e39, 0.0], normalize=False)


def test_pack_groups_names_the_reward_that_overflows() -> None:
    ok = group("g1", [1], [1.0, 0.0], [1, 1])
    bad = group("g7", [1], [0.0, 1e308, 0.0, 1.0], [1, 1, 1, 1])
    bad.prompt_id = "train-12"
    bad.samples[1] = dataclasses.replace(bad.samples[1], components={"exact": 1.0, "judge": 1e308})
    with pytest.raises(NonFiniteError) as err:
        pack_groups([ok, bad], normalize=True, environment="dataset")
    msg = str(err.value)
    assert "group g7 (prompt 'train-12')" in msg
    assert "the largest is 1e+308, given by environment 'dataset' (environment.name), " \
           "reward function 'judge' (which returned 1e+308)" in msg
    assert "No step was trained on them. Fix: make the reward return values" in msg
    # an environment's own score(): no components
    bad.samples[1] = dataclasses.replace(bad.samples[1], components={})
    with pytest.raises(NonFiniteError, match=r"given by environment 'repeat-digit' "
                       r"\(environment.name\)\. No step"):  # fmt: skip
        pack_groups([bad], normalize=False, environment="repeat-digit")


def test_nonfinite_cause_blames_the_rewards_or_the_weights() -> None:
    sane = [group("g1", [1], [1.0, 0.0, 0.0, 1.0], [1] * 4)]
    huge = [group("g2", [1], [3e30, 0.0, 1.0, 0.0], [1] * 4)]
    nan = float("nan")
    # unnormalized, the reward of 3e30 gives an advantage of 3e30 - 7.5e29 = 2.25e30
    msg = nonfinite_cause(4, nan, nan, huge, normalize=False, budget="; 1 such steps")
    assert msg.startswith("step 4: the trainer's loss is nan and its gradient norm nan; the "
                          "update was not applied (the weights are unchanged); 1 such steps. ")
    assert "rewards' magnitude: the step's advantages reach 2.25e+30, from a reward of 3e+30 " \
           "in group g2, prompt 'g2': enough to overflow" in msg
    # normalized, the same rewards give advantages of at most sqrt(3): not the rewards
    for groups, normalize in ((huge, True), (sane, False)):
        msg = nonfinite_cause(4, 1.0, math.inf, groups, normalize=normalize)
        assert "likely cause is the model's state" in msg
        assert "Fix: resume from an older checkpoint" in msg


def test_a_bad_loss_mask_is_refused_when_its_sample_is_built() -> None:
    """Masks are checked once, where a sample or a split-off part is made (packing, sharding
    and the step metrics then read them as they are); a good one is kept as uint8."""
    ids, lps = np.array([5, 6], np.int32), np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r"one 0 or 1 per token \(2 tokens\)"):
        CompletedSample(ids, lps, "stop", 1.0, True, loss_mask=[1, 2])
    with pytest.raises(ValueError, match=r"one 0 or 1 per token \(2 tokens\)"):
        Part(np.array([1], np.int32), ids, lps, [1, 0, 1], "stop")
    good = CompletedSample(ids, lps, "stop", 1.0, True, loss_mask=[True, False])
    assert good.loss_mask.dtype == np.uint8 and good.trained_mask().tolist() == [1, 0]


def test_trained_tokens_per_sequence_and_the_aggregation_normalizer(tmp_path) -> None:
    from asyncrl.config import from_dict
    from asyncrl.policy.grpo import per_sequence_mean, trained_per_sequence
    from asyncrl.run.train_step import normalizer
    from asyncrl.wire.messages import TrainBatch

    tb = pack_tokens([[5], [6, 7], [8]], [[1, 2, 3], [], [4, 4]])
    batch = TrainBatch(tb.tokens, tb.seq_lens, tb.prompt_lens, np.zeros(5, np.float32),
                       np.array([2.0, -1.0, 3.0], np.float32), np.array([1, 0, 1, 0, 1], np.uint8))  # fmt: skip
    assert trained_per_sequence(batch).tolist() == [2, 0, 1]
    trained = trained_per_sequence(batch)
    assert per_sequence_mean(batch, trained).advantages.tolist() == [1.0, -1.0, 3.0]  # / 2, / 1 (none), / 1
    (tmp_path / "config.json").write_text('{"vocab_size": 8}')
    (tmp_path / "tokenizer.json").write_text("{}")
    base = {"model": {"path": str(tmp_path)}, "environment": {"name": "repeat-digit"},
            "grpo": {"max_new_tokens": 32}}  # fmt: skip
    assert normalizer(from_dict(base), 5) == 0.0  # token-mean: the trained tokens
    assert normalizer(from_dict(base | {"loss": {"aggregation": "sequence_mean"}}), 5) == 5.0
    assert normalizer(from_dict(base | {"loss": {"aggregation": "constant"}}), 5) == 160.0
    cfg = from_dict(base | {"loss": {"aggregation": "constant", "aggregation_constant": 10}})
    assert normalizer(cfg, 5) == 50.0
