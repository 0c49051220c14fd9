"""The engine core's held logprob rows (asyncrl_vllm.logprob_rows), driven through random
steps against numpy slicing of the same arrays, and the backend's rule for samples cut
short (asyncrl_vllm.engine_io.sample_of)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl_vllm.engine_io import sample_of
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
    s = sample_of(completion([5, 6, 7], [], "abort"))
    assert s.finish_reason == "abort" and len(s.token_ids) == len(s.logprobs) == 0
    s = sample_of(completion([5, 6, 7], [-0.5, -1.0], "error"))
    assert s.token_ids.tolist() == [5, 6] and s.logprobs.tolist() == [-0.5, -1.0]
    s = sample_of(completion([5, 6], [-0.5, -1.0], "stop"))
    assert s.token_ids.tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="2 logprobs for 3 tokens"):
        sample_of(completion([5, 6, 7], [-0.5, -1.0], "length"))


# --------------------------------------------------------------------------- the scheduler
class FakeVLLMScheduler:
    """A test double of vLLM's ``Scheduler``: the three methods the held-logprobs mix-in
    overrides, with vLLM's rules (a request that wants logprobs gets ``len(new_token_ids)``
    rows of the step's ``LogprobsLists`` from its index; finished requests leave
    ``requests``). ``scheduler_output`` is the script of a step: request id -> (tokens,
    finishes)."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}

    def add_request(self, request) -> None:
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids, finished_status) -> list:
        return [self.requests.pop(r) for r in request_ids if r in self.requests]

    def update_from_output(self, scheduler_output, model_runner_output) -> dict:
        from vllm.v1.engine import EngineCoreOutput

        lists, outs = model_runner_output.logprobs, []
        for rid, (n, finishes) in scheduler_output.items():
            request = self.requests.get(rid)
            if request is None or (n == 0 and not finishes):
                continue  # gone, or a partial prefill: no output
            i = model_runner_output.req_id_to_index[rid]
            wants = request.sampling_params.num_logprobs is not None and lists is not None
            outs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=list(range(n)),
                new_logprobs=lists.slice_request(i, n) if wants else None,
                finish_reason=1 if finishes else None,
            ))  # fmt: skip
            if finishes:
                del self.requests[rid]
        return {0: SimpleNamespace(outputs=outs)}


def script(seed: int):
    """40 steps of requests of every shape (held: final-only with 0-2 top logprobs; streamed:
    DELTA, more than 20 top logprobs, or asked for; none), each scheduled now and then for 0-2 tokens,
    ending or aborted at random; a step's logprobs as wide as its widest request."""
    from vllm.sampling_params import RequestOutputKind as Kind
    from vllm.v1.outputs import LogprobsLists

    rng = np.random.default_rng(seed)
    from asyncrl_vllm.engine_io import STREAM_LOGPROBS

    stream = {STREAM_LOGPROBS: True}  # a final-only request that asks for its rows every step
    shapes = [(Kind.FINAL_ONLY, 0, None), (Kind.FINAL_ONLY, 2, None), (Kind.DELTA, 0, None),
              (Kind.DELTA, 1, None), (Kind.FINAL_ONLY, None, None), (Kind.FINAL_ONLY, 30, None),
              (Kind.FINAL_ONLY, 0, stream)]  # fmt: skip
    live: dict[str, int | None] = {}
    for step in range(40):
        added = []
        for _ in range(rng.integers(0, 3)):
            kind, k, extra = shapes[int(rng.integers(len(shapes)))]
            rid = f"r{step}-{len(added)}"
            live[rid] = k
            added.append(SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace(
                num_logprobs=k, output_kind=kind, extra_args=extra)))  # fmt: skip
        plan = {rid: (int(rng.integers(0, 3)), bool(rng.random() < 0.15))
                for rid in live if rng.random() < 0.8}  # fmt: skip
        abort = [rid for rid in live if rid not in plan and rng.random() < 0.05]
        rows = sum(n for n, _ in plan.values())
        width = 1 + max([k for k in (live[r] for r in plan) if k is not None], default=0)
        ids, lps, ranks = step_arrays(rng, rows, width)
        cu = np.cumsum([0] + [n for n, _ in plan.values()])[:-1].tolist()
        mro = SimpleNamespace(
            logprobs=LogprobsLists(ids, lps, ranks, cu) if rows else None,
            req_id_to_index={rid: i for i, rid in enumerate(plan)},
        )  # fmt: skip
        for rid, (_, finishes) in plan.items():
            if finishes:
                del live[rid]
        for rid in abort:
            del live[rid]
        yield added, plan, mro, abort


def delivered(scheduler, seed: int) -> tuple[dict, dict]:
    """Run ``script(seed)`` through ``scheduler``: per request, the rows the front end gets
    (token ids, logprobs cut to its width, ranks; as vLLM's front end cuts them) and at which
    steps they came."""
    got: dict[str, list] = {}
    when: dict[str, list[int]] = {}
    width: dict[str, int] = {}
    for step, (added, plan, mro, abort) in enumerate(script(seed)):
        for request in added:
            scheduler.add_request(request)
            if request.sampling_params.num_logprobs is not None:
                width[request.request_id] = request.sampling_params.num_logprobs + 1
        outputs = scheduler.update_from_output(plan, mro)
        scheduler.finish_requests(abort, "aborted")
        for out in outputs[0].outputs:
            lists = out.new_logprobs
            if lists is not None and len(lists.sampled_token_ranks):
                w = width[out.request_id]
                got.setdefault(out.request_id, []).append(
                    (lists.logprob_token_ids[:, :w], lists.logprobs[:, :w],
                     lists.sampled_token_ranks))  # fmt: skip
                when.setdefault(out.request_id, []).append(step)
        held = getattr(scheduler, "_held", None)
        if held is not None:  # after every step: exactly the running requests that want logprobs
            assert len(held) + len(scheduler._streamed) <= len(scheduler.requests)
            running = [r for r in scheduler.requests.values()
                       if r.sampling_params.num_logprobs is not None]  # fmt: skip
            held_ids = [r.request_id for r in running if r.request_id in held]
            assert len(held_ids) == len(held)
            assert scheduler._streamed == {r.request_id for r in running} - set(held_ids)
    flat = {rid: tuple(np.concatenate([p[k] for p in parts]) for k in range(3))
            for rid, parts in got.items()}  # fmt: skip
    return flat, when


def held_shape(params, most: int) -> bool:
    """Whether the scheduler should hold this request's rows to its end (written out here, not
    taken from the scheduler)."""
    asked = bool((params.extra_args or {}).get("asyncrl_stream_logprobs"))
    return params.output_kind.name == "FINAL_ONLY" and params.num_logprobs <= most and not asked


@pytest.mark.parametrize("seed", range(12))
def test_the_scheduler_delivers_what_vllm_would_only_later(seed: int) -> None:
    """The real mix-in over a test double of vLLM's scheduler, against the double alone on
    the same script: every request ends up with the same rows, bit for bit; streamed ones at
    the same steps, held ones all at once with their last output; an aborted held request
    gets none; nothing stays held."""
    from asyncrl_vllm.scheduler import MAX_HELD_LOGPROBS, _HoldsLogprobs

    class Held(_HoldsLogprobs, FakeVLLMScheduler):
        pass

    vllm_rows, vllm_when = delivered(FakeVLLMScheduler(), seed)
    held = Held()
    rows, when = delivered(held, seed)
    finals = {rid for rid, steps in when.items() if len(steps) == 1}
    requests = {r.request_id: r for added, *_ in script(seed) for r in added}
    for rid, ref in vllm_rows.items():
        params = requests[rid].sampling_params
        is_held = held_shape(params, MAX_HELD_LOGPROBS)
        if rid not in rows:  # a held request aborted before its end
            assert is_held, rid
            continue
        for k in range(3):
            np.testing.assert_array_equal(rows[rid][k], ref[k])
        if is_held:
            assert rid in finals and when[rid][0] >= vllm_when[rid][-1]
        else:
            assert when[rid] == vllm_when[rid]
    assert set(rows) <= set(vllm_rows)
    # what is still held or streamed is exactly the requests still running
    running = [requests[rid].sampling_params for rid in held.requests]
    kept = [p for p in running if p.num_logprobs is not None]
    assert len(held._held) == sum(held_shape(p, MAX_HELD_LOGPROBS) for p in kept)
    assert len(held._held) + len(held._streamed) == len(kept)
