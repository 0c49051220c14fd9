"""Packed batches to padded micro-batches, and response-token logprobs (torch).

Shared by the training backends; not imported by ``import asyncrl``.

A packed batch holds B sequences back to back: sequence i is
``tokens[off_i : off_i + seq_lens[i]]``; its first ``prompt_lens[i]`` tokens are the prompt.
The logprob of the response token at position p is read from the logits at p - 1, divided by
the temperature before the log-softmax. Flat per-token arrays (behaviour logprobs, results)
list the response tokens sequence by sequence, in position order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "MicroBatch",
    "check_packed",
    "dummy_micro_batch",
    "make_micro_batch",
    "micro_batch_bounds",
    "response_logprobs",
]


def check_packed(
    tokens: np.ndarray,
    seq_lens: np.ndarray,
    prompt_lens: np.ndarray,
    *,
    vocab_size: int,
    per_token: dict[str, np.ndarray] | None = None,
    per_sequence: dict[str, np.ndarray] | None = None,
) -> str | None:
    """Describe what is wrong with a packed batch, or return ``None`` if it is well formed.

    ``per_token`` arrays must hold one finite value per response token, ``per_sequence``
    arrays one finite value per sequence. A problem is returned rather than raised so that a
    distributed caller can first agree with its peers that some rank's batch is bad.
    """
    n = len(seq_lens)
    if tokens.ndim != 1 or seq_lens.ndim != 1 or prompt_lens.shape != (n,):
        return f"expected 1-d arrays with len(prompt_lens) == len(seq_lens) == {n}"
    if int(seq_lens.sum()) != len(tokens):
        return f"sum(seq_lens) = {int(seq_lens.sum())} but there are {len(tokens)} tokens"
    if n and (prompt_lens.min() < 1 or (prompt_lens > seq_lens).any()):
        return "every sequence needs 1 <= prompt_len <= seq_len"
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        return f"token ids must lie in [0, {vocab_size})"
    num_response = int((seq_lens - prompt_lens).sum())
    for name, expected, arrays in (
        ("response token", num_response, per_token or {}),
        ("sequence", n, per_sequence or {}),
    ):
        for key, values in arrays.items():
            if values.shape != (expected,):
                return f"{key} has shape {values.shape}; expected one value per {name} ({expected})"
            if not np.isfinite(values).all():
                return f"{key} holds non-finite values"
    return None


def micro_batch_bounds(num_sequences: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` sequence ranges of at most ``micro_batch_size`` sequences."""
    return [
        (start, min(start + micro_batch_size, num_sequences))
        for start in range(0, num_sequences, micro_batch_size)
    ]


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded sequences and where their response tokens are.

    Right padding needs no attention mask: under causal attention a real token only attends
    to earlier positions, which are all real.
    """

    input_ids: torch.Tensor
    """int64 ``[b, L]``, right-padded."""
    rows: torch.Tensor
    """int64 ``[n]``: the sequence of each response token."""
    cols: torch.Tensor
    """int64 ``[n]``: the position whose logits predict it (its own position - 1)."""
    targets: torch.Tensor
    """int64 ``[n]``: the response token ids."""
    response_slice: slice
    """Where this micro-batch's response tokens lie in the batch's flat per-token arrays."""
    response_lens: torch.Tensor
    """int64 ``[b]``: response tokens per sequence (to repeat per-sequence values)."""


def make_micro_batch(
    tokens: np.ndarray,
    seq_lens: np.ndarray,
    prompt_lens: np.ndarray,
    start: int,
    stop: int,
    *,
    device: torch.device,
    pad_id: int = 0,
) -> MicroBatch:
    """Sequences ``start:stop`` of a packed batch as a :class:`MicroBatch` on ``device``."""
    seq_lens = seq_lens.astype(np.int64)
    prompt_lens = prompt_lens.astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(seq_lens)])
    resp_lens = seq_lens - prompt_lens
    resp_offsets = np.concatenate([[0], np.cumsum(resp_lens)])
    lens = seq_lens[start:stop]
    ids = np.full((stop - start, int(lens.max())), pad_id, dtype=np.int64)
    rows, cols = [], []
    for row, i in enumerate(range(start, stop)):
        ids[row, : lens[row]] = tokens[offsets[i] : offsets[i + 1]]
        positions = np.arange(prompt_lens[i], seq_lens[i], dtype=np.int64)
        rows.append(np.full(len(positions), row, dtype=np.int64))
        cols.append(positions - 1)
    rows_np, cols_np = np.concatenate(rows), np.concatenate(cols)
    targets = ids[rows_np, cols_np + 1]

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return MicroBatch(
        input_ids=put(ids),
        rows=put(rows_np),
        cols=put(cols_np),
        targets=put(targets),
        response_slice=slice(int(resp_offsets[start]), int(resp_offsets[stop])),
        response_lens=put(resp_lens[start:stop]),
    )


def dummy_micro_batch(*, device: torch.device, pad_id: int = 0) -> MicroBatch:
    """One two-token sequence with one response token, for ranks that ran out of data but
    must still join the collectives of a forward/backward. Its loss is to be fully masked."""
    one = np.ones(1, dtype=np.int32)
    mb = make_micro_batch(
        np.full(2, pad_id, dtype=np.int32), one * 2, one, 0, 1, device=device, pad_id=pad_id
    )
    return MicroBatch(
        input_ids=mb.input_ids,
        rows=mb.rows,
        cols=mb.cols,
        targets=mb.targets,
        response_slice=slice(0, 0),
        response_lens=mb.response_lens,
    )


def response_logprobs(
    logits: torch.Tensor, mb: MicroBatch, temperature: float
) -> torch.Tensor:
    """``[n]`` logprobs of ``mb``'s response tokens under ``logits`` (``[b, L, V]``).

    The log-softmax runs in float32 (float64 if the logits are float64). Only the response
    positions are gathered first, so memory is ``n x V`` rather than ``b x L x V``.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    picked = logits[mb.rows, mb.cols].to(dtype) / temperature
    logp = torch.log_softmax(picked, dim=-1)
    return logp.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
