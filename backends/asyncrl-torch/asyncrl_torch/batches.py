"""Packed batches to padded micro-batches, and response-token logprobs (torch).

The layout of a packed batch is :class:`asyncrl.plugin.backend.Layout`'s. The logprob of the
response token at position p is read from the logits at p - 1, divided by the temperature before
the log-softmax. Flat per-token arrays (behaviour logprobs, results) list the response tokens
sequence by sequence, in position order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.plugin.backend import (
    AnyBatch,
    Layout,
    length_order,
    micro_batch_bounds,
    take_sequences,
    token_budget_bounds,
)

__all__ = [
    "MicroBatch",
    "PACKING_TOLERANCE",
    "PackingCheck",
    "dummy_micro_batch",
    "make_micro_batch",
    "packing_check",
    "plan_micro_batches",
    "response_logprobs",
    "restore_order",
    "to_device",
]


@dataclass(frozen=True)
class MicroBatch:
    """Sequences for one forward, right-padded rows or laid end to end in one row, and where
    their response tokens are.

    Right padding needs no attention mask: under causal attention a real token only attends
    to earlier positions, which are all real. A packed row carries ``position_ids`` that
    start again at 0 for each sequence; the model's attention reads the sequence boundaries
    from them (transformers: a block-diagonal causal mask for sdpa, eager and flex
    attention, variable-length kernels for flash attention), and the trainer checks at
    start that it does (:func:`packing_check`).
    """

    input_ids: torch.Tensor
    """int64 ``[b, L]``, right-padded, or ``[1, N]`` packed."""
    rows: torch.Tensor
    """int64 ``[n]``: the row of each response token."""
    cols: torch.Tensor
    """int64 ``[n]``: the place in its row of the logits that predict it (one before its
    own)."""
    targets: torch.Tensor
    """int64 ``[n]``: the response token ids."""
    response_slice: slice
    """Where this micro-batch's response tokens lie in the batch's flat per-token arrays."""
    window: tuple[int, int]
    """``[lo, hi)``: the positions whose logits predict some response token (``cols`` lie in
    it), known on the host; empty when there is no response token."""
    position_ids: torch.Tensor | None = None
    """int64 ``[1, N]`` for a packed row (each sequence's positions from 0); None: padded
    rows, whose positions are the default ``0..L-1``."""

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a transformers causal LM's forward for this batch."""
        if self.position_ids is None:
            return {"input_ids": self.input_ids}
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}


def make_micro_batch(
    tokens: np.ndarray,
    seq_lens: np.ndarray,
    prompt_lens: np.ndarray,
    start: int,
    stop: int,
    *,
    device: torch.device,
    pad_id: int = 0,
    packed: bool = False,
) -> MicroBatch:
    """Sequences ``start:stop`` of a packed batch as a :class:`MicroBatch` on ``device``:
    one right-padded row each, or with ``packed`` all in one row, end to end."""
    layout = Layout.of(seq_lens, prompt_lens)
    lens = layout.seq_lens[start:stop]
    if packed:
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        ids = tokens[layout.sequence(start).start : layout.sequence(stop - 1).stop]
        ids = ids.astype(np.int64)[None, :]
        position_ids = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])[None, :]
    else:
        offsets = np.zeros(stop - start, dtype=np.int64)
        ids = np.full((stop - start, int(lens.max())), pad_id, dtype=np.int64)
        for row, i in enumerate(range(start, stop)):
            ids[row, : lens[row]] = tokens[layout.sequence(i)]
        position_ids = None
    rows, cols = [], []
    for k, i in enumerate(range(start, stop)):
        positions = np.arange(layout.prompt_lens[i], layout.seq_lens[i], dtype=np.int64)
        rows.append(np.full(len(positions), 0 if packed else k, dtype=np.int64))
        cols.append(offsets[k] + positions - 1)
    rows_np, cols_np = np.concatenate(rows), np.concatenate(cols)
    targets = ids[rows_np, cols_np + 1]
    window = (int(cols_np.min()), int(cols_np.max()) + 1) if cols_np.size else (0, 0)

    return MicroBatch(
        input_ids=to_device(ids, device),
        rows=to_device(rows_np, device),
        cols=to_device(cols_np, device),
        targets=to_device(targets, device),
        response_slice=layout.responses(start, stop),
        window=window,
        position_ids=None if position_ids is None else to_device(position_ids, device),
    )


def plan_micro_batches(
    batch: AnyBatch, micro_batch_size: int, max_tokens: int, *, packed: bool = False
) -> tuple[AnyBatch, list[tuple[int, int]], np.ndarray | None]:
    """The batch as a rank runs it, its micro-batches (sequence ranges), and the order its
    sequences were put in (None: as they came). ``max_tokens > 0``
    (``trainer.max_tokens_per_micro_batch``): with ``packed`` (``trainer.pack_sequences``)
    ranges in the batch's order whose lengths sum to at most ``max_tokens``, else sorted by
    length and cut by :func:`~asyncrl.plugin.backend.token_budget_bounds`; ``max_tokens``
    0: ranges of ``micro_batch_size`` sequences."""
    if max_tokens <= 0:
        return batch, micro_batch_bounds(len(batch.seq_lens), micro_batch_size), None
    if packed:  # no padding to save: the order stays
        return batch, token_budget_bounds(batch.seq_lens, max_tokens, packed=True), None
    order = length_order(batch.seq_lens)
    planned = take_sequences(batch, order.tolist())
    return planned, token_budget_bounds(planned.seq_lens, max_tokens), order


PACKING_TOLERANCE = 0.05
"""Nats, for :attr:`PackingCheck.separated`, which the trainer checks at start: how far a
packed sequence's logprobs may move when the sequence before it is replaced
(:attr:`PackingCheck.swapped`). Measured
where attention stops at the boundary: exactly 0, in any dtype (H100, Qwen2.5-0.5B shape,
FSDP2 bf16, benchmarks/results/packing-check-h100.log; 2-layer Qwen2s on the CPU, float32 and
bf16, 3 seeds); where it leaks 0.15-0.22 (those CPU models, transformers' default init,
backends/asyncrl-torch/tests/test_packed_rows.py). The bound sits between: about 3x bf16's rounding of these
logprobs (the packed row against each sequence alone: 0.0205 on that H100), in case a kernel
is not deterministic, and a third of the smallest leak."""


@dataclass(frozen=True)
class PackingCheck:
    """What :func:`packing_check` measured, in nats (largest absolute logprob difference)."""

    swapped: float
    """A packed sequence's logprobs with one sequence before it against another of the same
    length: exactly 0 where attention stops at the boundary (the same shapes run the same
    kernels, in any dtype), of the order of 0.1-1 where it leaks."""
    apart: float
    """The packed row against each sequence alone: the dtype's rounding where attention stops
    at the boundary (other shapes run other kernels), for the log only."""

    @property
    def separated(self) -> bool:
        """Whether attention stops at the boundary: :attr:`swapped` within
        :data:`PACKING_TOLERANCE`. :attr:`apart` does not count: it is rounding, larger for
        larger models in bf16."""
        return self.swapped <= PACKING_TOLERANCE


def packing_check(
    forward: Callable[[MicroBatch], torch.Tensor],
    vocab_size: int,
    device: torch.device,
    lens: tuple[int, int] = (48, 40),
) -> PackingCheck:
    """Whether ``forward`` (micro-batch -> logits) keeps packed sequences apart: random
    sequences A and B of ``lens`` laid end to end in one row, then the same row with A
    replaced by another random sequence; B's logprobs must not move."""
    rng = np.random.default_rng(0)
    first, other, second = (rng.integers(0, vocab_size, n) for n in (lens[0], lens[0], lens[1]))
    seq_lens = np.array(lens, dtype=np.int64)
    prompts = np.ones_like(seq_lens)  # every token after the first is scored

    def logprobs(tokens: np.ndarray, start: int, stop: int, packed: bool) -> torch.Tensor:
        mb = make_micro_batch(tokens, seq_lens, prompts, start, stop, device=device,
                              packed=packed)  # fmt: skip
        return response_logprobs(forward(mb), mb, 1.0).float()

    row = np.concatenate([first, second])
    together = logprobs(row, 0, 2, True)
    behind_other = logprobs(np.concatenate([other, second]), 0, 2, True)
    apart = torch.cat([logprobs(row, i, i + 1, False) for i in range(2)])
    tail = slice(lens[0] - 1, None)  # B's response tokens
    return PackingCheck(
        swapped=float((together[tail] - behind_other[tail]).abs().max()),
        apart=float((together - apart).abs().max()),
    )


def restore_order(values: np.ndarray, reordered: Layout, order: np.ndarray) -> np.ndarray:
    """Per-response-token ``values`` of a batch whose sequences were put in ``order``
    (:func:`plan_micro_batches`; ``reordered`` its layout), back in the original order."""
    where = np.empty_like(order)
    where[order] = np.arange(order.size)  # the original sequence j sits at where[j]
    return reordered.gather_responses(values, where.tolist(), values.dtype)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor on ``device``; to a GPU through pinned memory without blocking, so
    the host never waits for the GPU's queue to drain."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
        window=mb.window,
    )


def response_logprobs(
    logits: torch.Tensor, mb: MicroBatch, temperature: float
) -> torch.Tensor:
    """``[n]`` logprobs of ``mb``'s response tokens under ``logits`` (``[b, L, V]``).

    ``log_softmax(z / T)`` in float32 (float64 if the logits are float64) over the window of
    positions that predict response tokens (:attr:`MicroBatch.window`, a view of the logits),
    then the targets are picked. Gathering the response rows first (``n x V``) would use less
    memory under heavy padding, but its backward scatters whole vocabulary rows, and a
    ``logsumexp`` formulation runs several passes where ``log_softmax`` runs one: on an H200
    both made a 0.5B model's train step slower than a plain loop (benchmarks/trainer.py).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    lo, hi = mb.window
    if hi <= lo:  # no response token: an empty result that still joins the graph
        return logits[mb.rows, mb.cols, mb.targets].to(dtype)
    window = logits[:, lo:hi]
    z = window.to(dtype)
    if temperature != 1.0:
        z = z.div_(temperature) if z is not window else z / temperature
    return torch.log_softmax(z, dim=-1)[mb.rows, mb.cols - lo, mb.targets]
