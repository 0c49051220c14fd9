"""What goes to vLLM for one sample and what comes back (no vLLM import at module level):
the engine input, the checks on a request, its ``SamplingParams``, and the finished
completion as a :class:`~asyncrl.plugin.backend.Sample` with its tokens' weight versions."""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.plugin.backend import GenRequest, RequestError, Sample

__all__ = ["CUT_SHORT", "STREAM_LOGPROBS", "check_request", "engine_prompt", "sample_of",
           "sampling_params", "versions_of"]  # fmt: skip

CUT_SHORT = frozenset({"abort", "error"})
"""vLLM's finish reasons of a request that did not run to its end."""


def engine_prompt(ids: list[int]) -> dict[str, Any]:
    # An engine input ("type": "token") rather than a raw prompt: no tokenizer is loaded
    # (skip_tokenizer_init) and vLLM 0.32 deprecates raw prompts.
    return {"type": "token", "prompt_token_ids": [int(t) for t in ids]}


def sample_of(completion: Any) -> Sample:
    """A finished vLLM completion as a :class:`Sample`. A request cut short (aborted, or
    failed in the engine) keeps only the tokens that came with logprobs: the engine core
    sends a final-only request's logprobs with its last output (:mod:`asyncrl_vllm.scheduler`),
    and an abort is answered by vLLM's front end from what it has."""
    tokens = np.asarray(completion.token_ids, dtype=np.int32)
    lps = completion.logprobs
    reason = str(completion.finish_reason or "abort")
    if lps is None or len(tokens) == 0:
        values = np.zeros(0, np.float32)
    elif hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token comes first
        values = np.asarray(lps.logprobs, np.float32)[np.asarray(lps.start_indices, np.int64)]
    else:
        values = np.asarray(
            [pos[int(t)].logprob for t, pos in zip(tokens, lps, strict=False)], dtype=np.float32
        )
    versions = versions_of(getattr(completion, "weight_versions", None), len(tokens))
    if reason in CUT_SHORT and len(values) < len(tokens):
        tokens, versions = tokens[: len(values)], versions[: len(values)]
    if len(values) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(values)} logprobs for {len(tokens)} tokens")
    return Sample(tokens, values, reason, versions)


def versions_of(spans: Any, n: int) -> np.ndarray:
    """The weight version of each of ``n`` tokens from vLLM's spans (0.32+: ``[start, end)``
    sampled by weights labelled ``version``; the backend labels each refit's version, see
    ``finish_weight_update``). Empty when vLLM reports none or a label is not ours: the
    controller then counts every token at the version it sent the request at."""
    out = np.empty(n, np.int32)
    covered = 0
    for span in spans or ():
        label = str(span.version)
        if not label.isdigit() or span.start != covered or not covered <= span.end <= n:
            return np.zeros(0, np.int32)
        out[span.start : span.end] = int(label)
        covered = span.end
    return out if covered == n and n else np.zeros(0, np.int32)


def check_request(request: GenRequest, llm: Any) -> None:
    """Refuse a request the engine cannot serve as asked.

    Raises:
        RequestError: an empty prompt, ``n`` or ``max_tokens`` below 1, a prompt plus
            ``max_tokens`` longer than the engine's context, or a temperature that is not
            positive on a sampled (not greedy) request.
    """
    if not request.prompt_ids:
        raise RequestError(f"group {request.group_id}: empty prompt")
    if request.n < 1 or request.max_tokens < 1:
        raise RequestError(f"group {request.group_id}: n and max_tokens must be >= 1")
    context = int(llm.model_config.max_model_len)
    if len(request.prompt_ids) + request.max_tokens > context:
        raise RequestError(
            f"group {request.group_id}: a prompt of {len(request.prompt_ids)} tokens plus "
            f"{request.max_tokens} new ones exceeds the context of {context} tokens"
        )
    if not request.greedy and not request.temperature > 0:
        raise RequestError(
            f"group {request.group_id}: temperature must be > 0 (or set greedy), "
            f"got {request.temperature}"
        )


STREAM_LOGPROBS = "asyncrl_stream_logprobs"
"""A request's ``SamplingParams.extra_args`` key: its logprobs go to the front end every step,
not held to its end (:mod:`asyncrl_vllm.scheduler`), so that an abort keeps every token
generated so far (vLLM's front end answers an abort from what it has)."""

PART_SEED_STRIDE = 0x9E3779B1
"""Part ``k`` of a sample (``k`` moves to a newer adapter) is seeded ``seed + i + k *`` this,
so that a part does not replay the random draws its sample's first part began with."""


def sampling_params(request: GenRequest, i: int, eos: list[int], *, done: int = 0,
                    part: int = 0, stream_logprobs: bool = False) -> Any:  # fmt: skip
    """vLLM's ``SamplingParams`` for sample ``i`` of ``request``: seed ``seed + i``, the
    sampled tokens' logprobs (flat), stop at ``eos``, only the final output. ``done`` tokens
    of the sample were generated by its earlier ``part`` parts already; ``stream_logprobs``:
    see :data:`STREAM_LOGPROBS`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=0.0 if request.greedy else request.temperature,
        top_p=1.0,
        top_k=0,
        max_tokens=request.max_tokens - done,
        logprobs=0,
        seed=None if request.seed is None else (request.seed + i + part * PART_SEED_STRIDE)
        & 0x7FFFFFFF,
        detokenize=False,
        stop_token_ids=list(eos),
        flat_logprobs=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={STREAM_LOGPROBS: True} if stream_logprobs else None,
    )
