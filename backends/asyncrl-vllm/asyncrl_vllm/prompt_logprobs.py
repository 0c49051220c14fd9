"""Turning vLLM prompt logprobs into response-token logprobs (pure numpy, no vLLM).

``score`` sends each sequence as a prompt with ``prompt_logprobs`` set. vLLM returns, per
prompt position ``p >= 1``, the log-softmax of the *raw* logits at ``p - 1`` for the token at
``p`` first, followed by the requested top-k entries. Prompt logprobs never see temperature,
whatever ``logprobs_mode`` says (prompt tokens skip the sampler's processors; vLLM 0.26 and
0.32 both say so in their model runners, and this backend's e2e test checks it). For
``temperature != 1`` the backend therefore asks for the full vocabulary (``prompt_logprobs=-1``)
and renormalises here::

    log softmax(z / T)[x] = lp[x] / T - logsumexp(lp / T)      with lp = log softmax(z)

which is exact because ``lp`` and ``z`` differ by a constant per position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncrl.plugin.backend import Layout, TokenBatch, check_packed

__all__ = ["response_logprobs", "split_batch"]


def split_batch(batch: TokenBatch) -> list[tuple[list[int], int]]:
    """``[(token_ids, prompt_len), ...]`` for each sequence of ``batch``, validated.

    Raises:
        ValueError: inconsistent lengths, or a prompt shorter than one token (the first token
            has no context to be scored in).
    """
    problem = check_packed(batch.tokens, batch.seq_lens, batch.prompt_lens)
    if problem is not None:
        raise ValueError(f"TokenBatch: {problem}")
    layout = Layout.of(batch.seq_lens, batch.prompt_lens)
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    return [
        (tokens[layout.sequence(i)].tolist(), int(layout.prompt_lens[i]))
        for i in range(layout.num_sequences)
    ]


def response_logprobs(
    start_indices: Sequence[int],
    end_indices: Sequence[int],
    logprobs: Sequence[float],
    prompt_len: int,
    seq_len: int,
    temperature: float,
    vocab_size: int | None = None,
) -> np.ndarray:
    """Logprobs (float32) of positions ``prompt_len .. seq_len-1`` from one request's flat
    prompt logprobs (vLLM's ``FlatLogprobs`` fields).

    Args:
        start_indices, end_indices, logprobs: the flat prompt logprobs of the whole sequence.
        prompt_len, seq_len: the response is ``[prompt_len, seq_len)``.
        temperature: 1.0 uses the first entry of each position as is; any other value needs
            the full vocabulary after it (``prompt_logprobs=-1``) and renormalises.
        vocab_size: when given, the width the full-vocabulary rows must have.

    Raises:
        ValueError: positions missing, or rows narrower than the vocabulary when rescaling.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if len(start_indices) < seq_len:
        raise ValueError(f"prompt logprobs cover {len(start_indices)} positions, need {seq_len}")
    starts = np.asarray(start_indices[prompt_len:seq_len], dtype=np.int64)
    ends = np.asarray(end_indices[prompt_len:seq_len], dtype=np.int64)
    if np.any(ends <= starts):
        raise ValueError("prompt logprobs are missing for some response positions")
    flat = np.asarray(logprobs, dtype=np.float64)
    target = flat[starts]
    if temperature == 1.0:
        return target.astype(np.float32)
    widths = ends - starts - 1
    if len(widths) == 0:
        return np.zeros(0, np.float32)
    width = int(widths[0])
    if np.any(widths != width) or (vocab_size is not None and width != vocab_size):
        raise ValueError(
            f"rescaling to temperature {temperature} needs full-vocabulary rows "
            f"({vocab_size}), got widths {sorted(set(widths.tolist()))[:4]}"
        )
    rows = flat[(starts + 1)[:, None] + np.arange(width)[None, :]] / temperature
    peak = rows.max(axis=1)
    lse = peak + np.log(np.exp(rows - peak[:, None]).sum(axis=1))
    return (target / temperature - lse).astype(np.float32)
