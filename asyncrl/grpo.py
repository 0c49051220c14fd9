"""GRPO math on the controller: group-relative advantages and packing of train batches.

Pure numpy; the loss itself lives with the trainer (:mod:`asyncrl.training.loss`, torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .buffer import Group
from .messages import TokenBatch, TrainBatch
from .packing import Layout

__all__ = [
    "group_advantages",
    "pack_groups",
    "pack_tokens",
    "shard_batch",
    "shard_tokens",
]


def group_advantages(
    rewards: Sequence[float], *, normalize: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Advantages of one group: ``r_i - mean(r)``, divided by ``std(r) + eps`` when
    ``normalize`` and the group's (population) standard deviation is positive.

    A group whose rewards are all equal gets zero advantages (it carries no signal).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size < 2:
        raise ValueError("a GRPO group needs at least 2 samples")
    centred = r - r.mean()
    std = r.std()
    if normalize and std > 0:
        centred = centred / (std + eps)
    return centred


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


def pack_groups(groups: Sequence[Group], *, normalize: bool) -> TrainBatch:
    """One :class:`TrainBatch` holding every sample of complete ``groups``."""
    tokens: list[np.ndarray] = []
    seq_lens, prompt_lens, adv = [], [], []
    behaviour: list[np.ndarray] = []
    for g in groups:
        a = group_advantages([s.reward for s in g.samples], normalize=normalize)
        prompt = np.asarray(g.prompt_ids, dtype=np.int32)
        for s, a_i in zip(g.samples, a):
            resp = np.asarray(s.token_ids, dtype=np.int32)
            tokens += [prompt, resp]
            seq_lens.append(prompt.size + resp.size)
            prompt_lens.append(prompt.size)
            behaviour.append(np.asarray(s.logprobs, dtype=np.float32))
            adv.append(a_i)
    return TrainBatch(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        prompt_lens=np.asarray(prompt_lens, dtype=np.int32),
        behaviour_logprobs=np.concatenate(behaviour) if behaviour else np.zeros(0, np.float32),
        advantages=np.asarray(adv, dtype=np.float32),
    )


def shard_batch(batch: TrainBatch, num_shards: int) -> list[TrainBatch]:
    """Split ``batch`` by sequences into ``num_shards`` parts of similar token counts.

    Greedy longest-first assignment; sequence order inside a shard follows the batch. A shard
    may be empty (its rank then only takes part in the collectives).
    """
    layout = Layout.of(batch.seq_lens, batch.prompt_lens)
    n = layout.num_sequences
    loads = [0] * num_shards
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(n), key=lambda i: -int(batch.seq_lens[i])):
        k = min(range(num_shards), key=lambda k: (loads[k], k))
        loads[k] += int(batch.seq_lens[i])
        members[k].append(i)
    shards = []
    for idx in members:
        idx.sort()
        shards.append(
            TrainBatch(
                tokens=layout.gather_tokens(batch.tokens, idx, np.int32),
                seq_lens=batch.seq_lens[idx].astype(np.int32),
                prompt_lens=batch.prompt_lens[idx].astype(np.int32),
                behaviour_logprobs=layout.gather_responses(
                    batch.behaviour_logprobs, idx, np.float32
                ),
                advantages=batch.advantages[idx].astype(np.float32),
            )
        )
    return shards


def shard_tokens(batch: TokenBatch, num_shards: int) -> list[TokenBatch]:
    """Split a :class:`TokenBatch` into ``num_shards`` contiguous runs of sequences, so that
    concatenating the shards' per-token results restores the batch's order."""
    layout = Layout.of(batch.seq_lens, batch.prompt_lens)
    bounds = np.linspace(0, batch.seq_lens.size, num_shards + 1).round().astype(int)
    shards = []
    for k in range(num_shards):
        idx = list(range(bounds[k], bounds[k + 1]))
        shards.append(
            TokenBatch(
                tokens=layout.gather_tokens(batch.tokens, idx, np.int32),
                seq_lens=batch.seq_lens[idx].astype(np.int32),
                prompt_lens=batch.prompt_lens[idx].astype(np.int32),
            )
        )
    return shards

