"""GRPO math on the controller: group-relative advantages and packing of train batches.

Pure numpy; the loss itself lives with the trainer (:mod:`asyncrl_torch.loss`, torch).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Literal, TypeVar

import msgspec
import numpy as np

from asyncrl.policy.advantages import (
    FLOAT32_MAX,
    Estimator,
    batch_normalized,
    combined_rewards,
    group_advantages,
)
from asyncrl.policy.groups import Group
from asyncrl.errors import ConfigError, NonFiniteError
from asyncrl.wire.messages import TokenBatch, TrainBatch
from asyncrl.policy.packing import Layout

AnyBatch = TypeVar("AnyBatch", TokenBatch, TrainBatch)

__all__ = [
    "AnyBatch",
    "FLOAT32_MAX",
    "advantages_of",
    "concat_batches",
    "group_advantages",
    "mini_batches",
    "nonfinite_cause",
    "pack_groups",
    "pack_tokens",
    "per_sample",
    "per_sequence",
    "per_sequence_mean",
    "reward_overflow",
    "shard_batch",
    "shard_tokens",
    "take_sequences",
    "trained_per_sequence",
]


def pack_tokens(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> TokenBatch:
    """Pack prompt+response pairs into a :class:`TokenBatch`."""
    if len(prompts) != len(responses):
        raise ValueError("prompts and responses differ in length")
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    return TokenBatch(
        tokens=np.asarray([t for s in seqs for t in s], dtype=np.int32),
        seq_lens=np.asarray([len(s) for s in seqs], dtype=np.int32),
        prompt_lens=np.asarray([len(p) for p in prompts], dtype=np.int32),
    )


def advantages_of(
    groups: Sequence[Group], *, normalize: bool, estimator: Estimator = "grpo",
    environment: str = "?", weights: Mapping[str, float] | None = None,
    normalization: Literal["none", "group"] = "none",
    reward_offsets: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Each group's advantages by ``estimator`` (:mod:`asyncrl.policy.advantages`), the
    groups being one chunk (``reinforce_pp`` normalizes over all of them), from each sample's
    ``reward``, or from its components by ``weights`` (``grpo.reward_weights``, with
    ``normalization``), plus each group's ``reward_offsets`` (one per sample: a KL penalty).

    Raises:
        NonFiniteError: a group's rewards are too large for the advantage math; the message
            names the group, its prompt, the largest reward and who gave it.
        ConfigError: a sample lacks a component ``weights`` names.
    """
    out = []
    for i, g in enumerate(groups):
        rewards = (_rewards(g, weights, normalization, environment) if weights
                   else [s.reward for s in g.samples])  # fmt: skip
        if reward_offsets is not None:
            rewards = np.asarray(rewards, np.float64) + reward_offsets[i]
        try:
            out.append(group_advantages(rewards, normalize=normalize, estimator=estimator))
        except OverflowError as exc:
            raise NonFiniteError(reward_overflow(g, str(exc), environment)) from None
    if estimator != "reinforce_pp":
        return out
    try:
        return batch_normalized(out)
    except OverflowError as exc:
        raise NonFiniteError(reward_overflow(groups[0], str(exc), environment)) from None


def _rewards(
    group: Group, weights: Mapping[str, float], normalization: Literal["none", "group"],
    environment: str,
) -> np.ndarray:
    try:
        return combined_rewards([s.components for s in group.samples], weights,
                                normalization=normalization)  # fmt: skip
    except KeyError as exc:
        name = exc.args[0]
        have = sorted({k for s in group.samples for k in s.components})
        raise ConfigError(
            f"grpo.reward_weights names the reward component {name!r}, but environment "
            f"{environment!r} (environment.name) scored a sample of prompt {group.prompt_id!r} "
            f"without it (the group's components: {have or 'none'}). Fix: return it in every "
            "Score's components, or weigh only components the environment gives"
        ) from None


def pack_groups(
    groups: Sequence[Group], *, normalize: bool, environment: str = "?",
    estimator: Estimator = "grpo", weights: Mapping[str, float] | None = None,
    normalization: Literal["none", "group"] = "none",
) -> TrainBatch:
    """One :class:`TrainBatch` holding every sample of complete ``groups``: each sequence a
    sample trains (:meth:`CompletedSample.sequences`: an episode's split-off sequences, then its
    own, each after its own prompt) with the sample's advantage, and its loss mask (all ones
    for a single-turn sample) as its part of the batch's ``loss_mask``.

    Raises:
        NonFiniteError: a group's rewards are too large for the advantage math
            (:func:`group_advantages`); the message names the group, its prompt, the largest
            reward and the reward function that gave it (``environment``'s, when the score
            has no components).
    """
    tokens: list[np.ndarray] = []
    seq_lens, prompt_lens, adv = [], [], []
    behaviour: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    advantages = advantages_of(groups, normalize=normalize, estimator=estimator,
                               environment=environment, weights=weights,
                               normalization=normalization)  # fmt: skip
    for g, a in zip(groups, advantages):
        group_prompt = np.asarray(g.prompt_ids, dtype=np.int32)
        for s, a_i in zip(g.samples, a):
            for prompt_ids, token_ids, logprobs, mask in s.sequences(group_prompt):
                prompt = np.asarray(prompt_ids, dtype=np.int32)
                resp = np.asarray(token_ids, dtype=np.int32)
                tokens += [prompt, resp]
                seq_lens.append(prompt.size + resp.size)
                prompt_lens.append(prompt.size)
                behaviour.append(np.asarray(logprobs, dtype=np.float32))
                masks.append(mask)
                adv.append(a_i)
    return TrainBatch(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        prompt_lens=np.asarray(prompt_lens, dtype=np.int32),
        behaviour_logprobs=np.concatenate(behaviour) if behaviour else np.zeros(0, np.float32),
        advantages=np.asarray(adv, dtype=np.float32),
        loss_mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
    )


def _sequences_per_sample(groups: Sequence[Group]) -> list[int]:
    """How many sequences each sample of ``groups`` trains (its split-off ones and its own),
    in :func:`pack_groups`' order."""
    return [len(s.earlier) + 1 for g in groups for s in g.samples]


def per_sample(groups: Sequence[Group], per_sequence: np.ndarray) -> list[np.ndarray]:
    """Each group's per-sample sums of ``per_sequence``, one value for each sequence of
    :func:`pack_groups`' batch of ``groups`` (a sample's sequences are consecutive there)."""
    counts = _sequences_per_sample(groups)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    sums = np.add.reduceat(np.asarray(per_sequence, np.float64), starts) if counts else []
    bounds = np.cumsum([0] + [len(g.samples) for g in groups])
    return [np.asarray(sums[a:b]) for a, b in zip(bounds, bounds[1:])]


def per_sequence(groups: Sequence[Group], per_sample_values: Sequence[np.ndarray]) -> np.ndarray:
    """``per_sample_values`` (one array per group, one value per sample) repeated for each
    sequence the sample trains, in :func:`pack_groups`' order; float32."""
    flat = np.concatenate(per_sample_values) if per_sample_values else np.zeros(0)
    return np.repeat(flat, _sequences_per_sample(groups)).astype(np.float32)


def trained_per_sequence(batch: TrainBatch) -> np.ndarray:
    """How many tokens of each sequence of ``batch`` train (its ``loss_mask`` ones), int64."""
    return Layout.of(batch.seq_lens, batch.prompt_lens).response_sums(batch.loss_mask, np.int64)


def per_sequence_mean(batch: TrainBatch, trained: np.ndarray) -> TrainBatch:
    """``batch`` for ``loss.aggregation = "sequence_mean"``: each sequence's advantage divided
    by its ``trained`` tokens (:func:`trained_per_sequence`), so that the trainer's token sum
    is the sum of each sequence's token-mean (the loss is linear in the advantage: the clip,
    the importance weights and the masks are unchanged by a positive factor); the step then
    divides by its sequences."""
    scaled = (batch.advantages / np.maximum(trained, 1)).astype(np.float32)
    return msgspec.structs.replace(batch, advantages=scaled)


def reward_overflow(group: Group, problem: str, environment: str) -> str:
    """The error message of a group whose rewards overflow the advantage math: the largest
    reward, who gave it (the reward function with the largest component, else the
    environment's ``score()``), and the fix."""
    sample = max(group.samples, key=lambda s: abs(s.reward) if math.isfinite(s.reward) else 0.0)
    by = f"environment {environment!r} (environment.name)"
    if sample.components:
        name, value = max(sample.components.items(), key=lambda kv: abs(kv[1]))
        by += f", reward function {name!r} (which returned {value:.6g})"
    return (
        f"the rewards of group {group.group_id} (prompt {group.prompt_id!r}) are too large "
        f"for GRPO's advantages: {problem}; the largest is {sample.reward:.6g}, given by {by}. "
        "No step was trained on them. Fix: make the reward return values of a moderate size "
        "(scale or clip it; rewards within +-1e6 are safe)"
    )


SANE_ADVANTAGE = 1e6
"""Advantages beyond this size make a float32 loss or gradient overflow plausible (with
``grpo.normalize_advantages`` they are at most sqrt(samples per prompt))."""


def nonfinite_cause(
    step: int,
    loss: float,
    grad_norm: float,
    groups: Sequence[Group],
    *,
    normalize: bool,
    estimator: Estimator = "grpo",
    budget: str = "",
    weights: Mapping[str, float] | None = None,
    normalization: Literal["none", "group"] = "none",
    environment: str = "?",
) -> str:
    """Why step ``step``'s loss or gradient norm is likely not finite, for the error that
    stops the run: the rewards' magnitude when the step's advantages are huge, else the
    model's state (corrupted or diverging weights). ``budget`` (the skip budget, spent) goes
    after the facts; the message ends with the fix."""
    worst: tuple[float, float, Group | None] = (0.0, 0.0, None)  # |advantage|, reward, group
    advantages = advantages_of(groups, normalize=normalize, estimator=estimator,
                               weights=weights, normalization=normalization,
                               environment=environment)  # fmt: skip
    for g, a in zip(groups, advantages):
        i = int(np.argmax(np.abs(a)))
        if abs(a[i]) >= worst[0]:
            worst = (float(abs(a[i])), g.samples[i].reward, g)
    top, reward, group = worst
    where = f" in group {group.group_id}, prompt {group.prompt_id!r}" if group else ""
    head = (
        f"step {step}: the trainer's loss is {loss:.6g} and its gradient norm "
        f"{grad_norm:.6g}; the update was not applied (the weights are unchanged){budget}. "
    )
    if top > SANE_ADVANTAGE:
        return head + (
            f"The likely cause is the rewards' magnitude: the step's advantages reach {top:.3g}"
            f", from a reward of {reward:.6g}{where}: enough to overflow the trainer's "
            "float32 loss or gradient. Fix: "
            "make the reward return values of a moderate size (scale or clip it; within "
            "+-1e6 is safe), or set grpo.normalize_advantages = true"
        )
    return head + (
        f"The step's advantages are of a sane size (at most {top:.3g}{where}), so the likely "
        "cause is the model's state: weights that are corrupted (a damaged checkpoint) or "
        "diverging (a learning rate too high). Fix: resume from an older checkpoint "
        "(--resume <checkpoint.dir>/step-N), or lower the learning rate "
        "(trainer.options.lr); failures.max_nonfinite_steps > 0 skips such steps"
    )


def shard_batch(batch: TrainBatch, num_shards: int) -> list[TrainBatch]:
    """Split ``batch`` by sequences into ``num_shards`` parts of similar token counts.

    Greedy longest-first assignment (by tokens, masked or not: every token costs a forward);
    sequence order inside a shard follows the batch, and each sequence's per-token values
    (behaviour logprobs, loss mask) go with it. A shard may be empty (its rank then only takes
    part in the collectives), and a shard's mask may train no token.
    """
    if num_shards == 1:
        return [batch]
    layout = Layout.of(batch.seq_lens, batch.prompt_lens)
    lens = batch.seq_lens.tolist()
    members: list[list[int]] = [[] for _ in range(num_shards)]
    loads = [(0, k) for k in range(num_shards)]  # a heap: the least loaded (then lowest) first
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        load, k = heapq.heappop(loads)
        members[k].append(i)
        heapq.heappush(loads, (load + lens[i], k))
    for idx in members:
        idx.sort()
    return [take_sequences(batch, idx, layout) for idx in members]


_PER_TOKEN = ("behaviour_logprobs", "loss_mask", "proximal_logprobs", "reference_logprobs")
"""The :class:`TrainBatch` fields with one value per response token (the last two optional)."""


def take_sequences(batch: AnyBatch, idx: list[int], layout: Layout | None = None) -> AnyBatch:
    """The sequences ``idx`` of ``batch`` (in that order), each with its per-token values
    (a :class:`TrainBatch`'s also with its advantage)."""
    layout = layout or Layout.of(batch.seq_lens, batch.prompt_lens)
    tokens = TokenBatch(
        tokens=layout.gather_tokens(batch.tokens, idx, np.int32),
        seq_lens=batch.seq_lens[idx].astype(np.int32),
        prompt_lens=batch.prompt_lens[idx].astype(np.int32),
    )
    if isinstance(batch, TokenBatch):
        return tokens
    per_token = {
        name: layout.gather_responses(values, idx, values.dtype)
        for name in _PER_TOKEN
        if (values := getattr(batch, name)) is not None
    }
    return TrainBatch(
        tokens=tokens.tokens,
        seq_lens=tokens.seq_lens,
        prompt_lens=tokens.prompt_lens,
        advantages=batch.advantages[idx].astype(np.float32),
        **per_token,
    )


def concat_batches(batches: Sequence[TrainBatch]) -> TrainBatch:
    """One :class:`TrainBatch` holding ``batches``' sequences in order.

    Raises:
        ValueError: some batches carry an optional per-token field and others do not.
    """
    if len(batches) == 1:
        return batches[0]
    fields: dict[str, np.ndarray] = {}
    for name in ("tokens", "seq_lens", "prompt_lens", "advantages", *_PER_TOKEN):
        parts = [getattr(b, name) for b in batches]
        if all(p is not None for p in parts):
            fields[name] = np.concatenate(parts)
        elif any(p is not None for p in parts):
            raise ValueError(f"concat_batches: only some batches carry {name}")
    return TrainBatch(**fields)


def mini_batches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """``batch`` split into ``count`` runs of consecutive sequences, as even in sequences as
    possible; each sequence's per-token values go with it.

    Raises:
        ValueError: fewer sequences than ``count`` (a mini-batch would be empty).
    """
    n = len(batch.seq_lens)
    if not 1 <= count <= max(n, 1):
        raise ValueError(f"cannot split {n} sequences into {count} mini-batches")
    if count == 1:
        return [batch]
    layout = Layout.of(batch.seq_lens, batch.prompt_lens)
    bounds = [n * k // count for k in range(count + 1)]
    return [take_sequences(batch, list(range(lo, hi)), layout) for lo, hi in zip(bounds, bounds[1:])]


def shard_tokens(batch: TokenBatch, num_shards: int) -> list[TokenBatch]:
    """Split a :class:`TokenBatch` into ``num_shards`` contiguous runs of sequences, so that
    concatenating the shards' per-token results restores the batch's order."""
    layout = Layout.of(batch.seq_lens, batch.prompt_lens)
    bounds = np.linspace(0, batch.seq_lens.size, num_shards + 1).round().astype(int)
    return [
        take_sequences(batch, list(range(bounds[k], bounds[k + 1])), layout)
        for k in range(num_shards)
    ]

