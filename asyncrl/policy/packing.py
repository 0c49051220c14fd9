"""The packed-batch layout, in one place (numpy only; no torch).

A packed batch (:class:`~asyncrl.wire.messages.TokenBatch`, :class:`~asyncrl.wire.messages.TrainBatch`)
holds B sequences back to back: sequence i is ``tokens[offsets[i] : offsets[i + 1]]`` and its
first ``prompt_lens[i]`` tokens are the prompt. Per-token arrays (behaviour logprobs, the loss
mask, scored logprobs) hold one value per *response* token, sequence by sequence in position
order: sequence i's are ``values[response_offsets[i] : response_offsets[i + 1]]``. The response
token at position p is predicted by the logits at p - 1, so a prompt needs at least one token.
A response may mix tokens that train (generated) and tokens that do not (observations the
controller inserted): the loss mask says which.

The controller (sharding), the training backends (micro-batches) and the generation backends
(scoring) all read batches through :class:`Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Layout", "check_packed", "length_order", "micro_batch_bounds", "token_budget_bounds"]


@dataclass(frozen=True)
class Layout:
    """Where each sequence and each response lies in a packed batch."""

    seq_lens: np.ndarray
    """int64 ``[B]``."""
    prompt_lens: np.ndarray
    """int64 ``[B]``."""
    offsets: np.ndarray
    """int64 ``[B + 1]``: sequence i is ``tokens[offsets[i] : offsets[i + 1]]``."""
    response_offsets: np.ndarray
    """int64 ``[B + 1]``: sequence i's per-token values are
    ``values[response_offsets[i] : response_offsets[i + 1]]``."""

    @classmethod
    def of(cls, seq_lens: np.ndarray, prompt_lens: np.ndarray) -> Layout:
        seq = np.asarray(seq_lens, dtype=np.int64)
        prompt = np.asarray(prompt_lens, dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        return cls(
            seq_lens=seq,
            prompt_lens=prompt,
            offsets=np.concatenate([zero, np.cumsum(seq)]),
            response_offsets=np.concatenate([zero, np.cumsum(seq - prompt)]),
        )

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.size)

    @property
    def response_lens(self) -> np.ndarray:
        """int64 ``[B]``: response tokens per sequence."""
        return self.seq_lens - self.prompt_lens

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_offsets[-1])

    def sequence(self, i: int) -> slice:
        """Sequence i's tokens in the packed token array."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def response(self, i: int) -> slice:
        """Sequence i's values in a flat per-response-token array."""
        return slice(int(self.response_offsets[i]), int(self.response_offsets[i + 1]))

    def responses(self, start: int, stop: int) -> slice:
        """Sequences ``start:stop``'s values in a flat per-response-token array."""
        return slice(int(self.response_offsets[start]), int(self.response_offsets[stop]))

    def response_positions(self) -> np.ndarray:
        """int64 ``[num_response_tokens]``: each response token's index in the packed token
        array, in per-token order (the predicting logits sit one index earlier)."""
        lens = self.response_lens
        within = np.arange(self.num_response_tokens) - np.repeat(self.response_offsets[:-1], lens)
        return np.repeat(self.offsets[:-1] + self.prompt_lens, lens) + within

    def response_sums(self, values: np.ndarray, dtype: type) -> np.ndarray:
        """``[B]``: each sequence's sum of a per-response-token array, accumulated in
        ``dtype``."""
        cumulative = np.concatenate([[0], np.cumsum(values, dtype=dtype)])
        return cumulative[self.response_offsets[1:]] - cumulative[self.response_offsets[:-1]]

    def gather_tokens(self, values: np.ndarray, idx: list[int], dtype: type) -> np.ndarray:
        """The packed token arrays of sequences ``idx``, concatenated in that order."""
        return _gather(values, self.offsets, idx, dtype)

    def gather_responses(self, values: np.ndarray, idx: list[int], dtype: type) -> np.ndarray:
        """The per-response-token values of sequences ``idx``, concatenated in that order."""
        return _gather(values, self.response_offsets, idx, dtype)


def _gather(values: np.ndarray, offsets: np.ndarray, idx: list[int], dtype: type) -> np.ndarray:
    """The runs ``values[offsets[i] : offsets[i + 1]]`` of ``idx``, back to back: one index
    array and one take (a slice and a concatenation per sequence cost ~2 ms a thousand)."""
    if not idx:
        return np.zeros(0, dtype)
    seqs = np.asarray(idx, dtype=np.int64)
    starts, lens = offsets[seqs], offsets[seqs + 1] - offsets[seqs]
    # each output position's source: its run's start, plus its place within the run
    run_start_in_out = np.cumsum(lens) - lens
    positions = np.repeat(starts - run_start_in_out, lens) + np.arange(int(lens.sum()))
    return np.asarray(values)[positions].astype(dtype, copy=False)


def check_packed(
    tokens: np.ndarray,
    seq_lens: np.ndarray,
    prompt_lens: np.ndarray,
    *,
    vocab_size: int | None = None,
    per_token: dict[str, np.ndarray] | None = None,
    per_sequence: dict[str, np.ndarray] | None = None,
    loss_mask: np.ndarray | None = None,
) -> str | None:
    """Describe what is wrong with a packed batch, or return ``None`` if it is well formed.

    ``per_token`` arrays must hold one finite value per response token, ``per_sequence``
    arrays one finite value per sequence; token ids must lie in ``[0, vocab_size)`` when a
    vocabulary size is given; a ``loss_mask`` must be uint8, one 0 or 1 per response token. A
    mask that trains no token at all is well formed (a chunk of observations only, or a
    rank's share of one); a *step* without a trained token is refused at its end, where the
    count is known. A problem is returned rather than raised so that a distributed caller can
    first agree with its peers that some rank's batch is bad.
    """
    tokens, seq_lens, prompt_lens = (np.asarray(a) for a in (tokens, seq_lens, prompt_lens))
    n = len(seq_lens)
    if tokens.ndim != 1 or seq_lens.ndim != 1 or prompt_lens.shape != (n,):
        return f"expected 1-d arrays with len(prompt_lens) == len(seq_lens) == {n}"
    if int(seq_lens.sum()) != len(tokens):
        return f"sum(seq_lens) = {int(seq_lens.sum())} but there are {len(tokens)} tokens"
    if n and (prompt_lens.min() < 1 or (prompt_lens > seq_lens).any()):
        return "every sequence needs 1 <= prompt_len <= seq_len"
    if vocab_size is not None and len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        return f"token ids must lie in [0, {vocab_size})"
    num_response = int((seq_lens.astype(np.int64) - prompt_lens).sum())
    for name, expected, arrays in (
        ("response token", num_response, per_token or {}),
        ("sequence", n, per_sequence or {}),
    ):
        for key, values in arrays.items():
            if values.shape != (expected,):
                return f"{key} has shape {values.shape}; expected one value per {name} ({expected})"
            if not np.isfinite(values).all():
                return f"{key} holds non-finite values"
    if loss_mask is not None:
        return _check_mask(np.asarray(loss_mask), num_response)
    return None


def _check_mask(mask: np.ndarray, num_response: int) -> str | None:
    if mask.shape != (num_response,):
        return (
            f"loss_mask has shape {mask.shape}; expected one value per response token "
            f"({num_response})"
        )
    if mask.dtype != np.uint8:
        return f"loss_mask has dtype {mask.dtype}; expected uint8 (1: the token trains, 0: not)"
    if mask.size and int(mask.max()) > 1:
        return (
            f"loss_mask holds {int(mask.max())}; expected only 0 (the token does not train) "
            "and 1 (it trains)"
        )
    return None


def micro_batch_bounds(num_sequences: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` sequence ranges of at most ``micro_batch_size`` sequences."""
    return [
        (start, min(start + micro_batch_size, num_sequences))
        for start in range(0, num_sequences, micro_batch_size)
    ]


def length_order(seq_lens: np.ndarray) -> np.ndarray:
    """int64 ``[B]``: the sequences shortest first (stable: equal lengths keep their order)."""
    return np.argsort(np.asarray(seq_lens, dtype=np.int64), kind="stable")


def token_budget_bounds(
    seq_lens: np.ndarray, max_tokens: int, *, packed: bool = False
) -> list[tuple[int, int]]:
    """``[start, stop)`` sequence ranges, cut greedily in order so that each range's size is
    at most ``max_tokens``; a sequence longer than that is a range of its own. The size is
    the padded one (its sequences times its longest), or with ``packed`` the sum of its
    lengths (the sequences laid end to end in one row). On sequences sorted by length
    (:func:`length_order`) padded ranges waste almost nothing, and short sequences share one
    forward."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    bounds: list[tuple[int, int]] = []
    start, longest, total = 0, 0, 0
    for i, n in enumerate(lens.tolist()):
        grown, summed = max(longest, n), total + n
        if i > start and (summed if packed else (i + 1 - start) * grown) > max_tokens:
            bounds.append((start, i))
            start, grown, summed = i, n, n
        longest, total = grown, summed
    if start < lens.size:
        bounds.append((start, int(lens.size)))
    return bounds
