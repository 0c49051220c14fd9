"""The engine core's held logprob rows (asyncrl_vllm.logprob_rows), driven through random
steps against numpy slicing of the same arrays, and the backend's rule for samples cut
short (asyncrl_vllm.backend._sample)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl_vllm.backend import _sample
from asyncrl_vllm.logprob_rows import HeldRows, StepColumns


def step_arrays(rng: np.random.Generator, rows: int, width: int):
    ids = rng.integers(0, 50_000, (rows, width), dtype=np.int64)
    lps = -rng.exponential(2.0, (rows, width)).astype(np.float32)
    ranks = rng.integers(1, 100, rows, dtype=np.int64)
    return ids, lps, ranks


@pytest.mark.parametrize("seed", range(20))
def test_held_rows_are_each_requests_slices_cut_to_its_width(seed: int) -> None:
    """Requests asking for 0-3 top logprobs come and go over 40 steps; each step's rows are
    as wide as its widest request, some requests take 0-3 tokens a step (chunked prefill,
    speculative tokens) at offsets like ``cu_num_generated_tokens``. What a request gets
    back is its rows, in order, cut to its own width, bit for bit."""
    rng = np.random.default_rng(seed)
    held = HeldRows()
    want: dict[str, int] = {}
    expected: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    taken = 0
    for step_no in range(40):
        for _ in range(rng.integers(0, 3)):
            rid = f"r{step_no}-{len(want)}"
            want[rid] = int(rng.integers(0, 4))
            held.hold(rid, want[rid])
            expected[rid] = []
        live = [r for r in want if r in held]
        if not live:
            continue
        counts = rng.integers(0, 4, len(live))
        width = max(want[r] for r in live) + 1 + int(rng.integers(0, 2))
        ids, lps, ranks = step_arrays(rng, int(counts.sum()), width)
        step = StepColumns.of(ids, lps, ranks)
        start = 0
        for rid, n in zip(live, counts.tolist()):
            held.add(rid, step, start, n)
            w = want[rid] + 1
            expected[rid].append((ids[start:start + n, :w], lps[start:start + n, :w],
                                  ranks[start:start + n]))  # fmt: skip
            start += n
        for rid in live:
            if rng.random() < 0.2:
                rows = held.take(rid)
                assert rows is not None and rid not in held
                got = rows.arrays()
                for k in range(3):
                    ref = np.concatenate([e[k] for e in expected[rid]])
                    assert got[k].dtype == ref.dtype
                    np.testing.assert_array_equal(got[k], ref)
                taken += 1
    assert taken > 0
    held.drop(list(want))
    assert len(held) == 0


def test_a_step_that_cannot_hold_the_rows_is_refused_loudly() -> None:
    rng = np.random.default_rng(0)
    held = HeldRows()
    held.hold("a", 2)
    narrow = StepColumns.of(*step_arrays(rng, 4, 1))
    with pytest.raises(ValueError, match="width 3 from a step of 4 rows of width 1"):
        held.add("a", narrow, 0, 1)
    wide = StepColumns.of(*step_arrays(rng, 4, 3))
    with pytest.raises(ValueError, match="rows 3..5"):
        held.add("a", wide, 3, 2)
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        held.hold("b", -1)
    held.add("not-held", wide, 0, 1)  # ignored
    assert "not-held" not in held


def test_forgetting_requests_that_left_unseen() -> None:
    held = HeldRows()
    for rid in ("a", "b", "c"):
        held.hold(rid, 0)
    assert held.keep_only({"b": object()}) == 2
    assert "b" in held and len(held) == 1
    assert held.take("a") is None


def completion(tokens: list[int], logprobs: list[float], reason: str | None):
    flat = SimpleNamespace(logprobs=logprobs, start_indices=list(range(len(logprobs))))
    return SimpleNamespace(token_ids=tokens, logprobs=flat, finish_reason=reason,
                           weight_versions=None)  # fmt: skip


def test_a_sample_cut_short_keeps_the_tokens_that_have_logprobs() -> None:
    """An abort answered by the front end before the held logprobs came: no tokens. One that
    ran to its end with logprobs missing is an engine fault, not a thing to paper over."""
    s = _sample(completion([5, 6, 7], [], "abort"))
    assert s.finish_reason == "abort" and len(s.token_ids) == len(s.logprobs) == 0
    s = _sample(completion([5, 6, 7], [-0.5, -1.0], "error"))
    assert s.token_ids.tolist() == [5, 6] and s.logprobs.tolist() == [-0.5, -1.0]
    s = _sample(completion([5, 6], [-0.5, -1.0], "stop"))
    assert s.token_ids.tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="2 logprobs for 3 tokens"):
        _sample(completion([5, 6, 7], [-0.5, -1.0], "length"))
