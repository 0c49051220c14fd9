"""vLLM's scheduler, with a final-only request's sampled-token logprobs sent once, at its end
(the engine argument ``scheduler_cls``; imported in vLLM's engine-core process only).

vLLM's engine core slices each step's logprobs per request and serialises the slice into
the step's output; the front end decodes and appends it. For the request asyncrl sends
(one sample, ``logprobs=0``, ``output_kind=FINAL_ONLY``) that is three small numpy arrays
per request per step, on the engine core's critical path, for output nobody sees before the
request ends. On an H200 with a 0.5B model at 128 sequences the engine is CPU-bound and
that path costs a third of its throughput (docs/backends/vllm.md, "What the request
costs"). :class:`HeldLogprobsScheduler` keeps those rows in the engine core
(:class:`~asyncrl_vllm.logprob_rows.HeldRows`) and attaches them, all at once, to the
request's last output, so the front end's final output is the same as before.

Which requests: those with ``output_kind == FINAL_ONLY`` and 0 to :data:`MAX_HELD_LOGPROBS`
logprobs, unless their ``extra_args`` ask for them every step
(:data:`~asyncrl_vllm.engine_io.STREAM_LOGPROBS`: a request that may be ended to go on under
another adapter keeps its tokens). Every other request with logprobs (streamed output, or many
logprobs per token)
gets them per step, sliced here exactly as vLLM slices them. A held request that is
aborted (or fails) ends without logprobs: vLLM's front end answers an abort itself, from
what it has; :func:`asyncrl_vllm.engine_io.sample_of` cuts such a sample to the tokens that have
logprobs.

vLLM calls its scheduler interface not public; this subclasses ``Scheduler`` and
``AsyncScheduler`` and overrides ``add_request``, ``finish_requests`` and
``update_from_output`` only, each calling vLLM's own. Checked against vLLM 0.26 and 0.32.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

from .engine_io import STREAM_LOGPROBS
from .logprob_rows import HeldRows, Rows, StepColumns

__all__ = ["MAX_HELD_LOGPROBS", "HeldLogprobsScheduler", "unfit"]

MAX_HELD_LOGPROBS = 20
"""Held requests ask for at most this many top logprobs per token (OpenAI's ``top_logprobs``
limit); more are sent per step (a row of the whole vocabulary is no thing to keep in lists)."""


_OVERRIDDEN = {
    "add_request": ["request"],
    "finish_requests": ["request_ids", "finished_status"],
    "update_from_output": ["scheduler_output", "model_runner_output"],
}
_FIELDS = [
    (ModelRunnerOutput, "ModelRunnerOutput", ("logprobs", "req_id_to_index")),
    (EngineCoreOutput, "EngineCoreOutput", ("request_id", "new_token_ids", "new_logprobs",
                                            "finish_reason")),
    (LogprobsLists, "LogprobsLists", ("logprob_token_ids", "logprobs", "sampled_token_ranks",
                                      "cu_num_generated_tokens")),
]  # fmt: skip


def unfit() -> str | None:
    """What of vLLM's scheduler interface this vLLM lacks for the overrides here (``None``:
    nothing; checked in the front end before the engine starts, so that a vLLM that moved
    them fails with a message and not deep inside the engine core)."""
    for name, params in _OVERRIDDEN.items():
        method = getattr(Scheduler, name, None)
        if method is None:
            return f"vllm.v1.core.sched.scheduler.Scheduler has no {name}()"
        got = list(inspect.signature(method).parameters)[1 : 1 + len(params)]
        if got != params:
            return f"Scheduler.{name} takes ({', '.join(got)}), not ({', '.join(params)})"
    for cls, label, names in _FIELDS:
        have = (
            {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
            else set(getattr(cls, "__struct_fields__", ()) or getattr(cls, "_fields", ()))
        )  # fmt: skip
        missing = [n for n in names if n not in have]
        if missing:
            return f"vLLM's {label} has no {', '.join(missing)}"
    return None


def _logprobs_lists(rows: Rows | None) -> LogprobsLists | None:
    if rows is None or not rows.ranks:
        return None
    return LogprobsLists(*rows.arrays(), None)


class _HoldsLogprobs:
    """The mix-in: state and the three overrides (the base is vLLM's ``Scheduler`` or
    ``AsyncScheduler``)."""

    requests: dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = HeldRows()
        """Final-only requests' rows so far."""
        self._streamed: set[str] = set()
        """Other requests that want logprobs: sliced per step, as vLLM does."""

    def add_request(self, request: Any) -> None:
        new = request.request_id not in self.requests
        super().add_request(request)  # type: ignore[misc]
        params = request.sampling_params
        if not new or params is None or params.num_logprobs is None:
            return
        if (
            params.output_kind == RequestOutputKind.FINAL_ONLY
            and 0 <= params.num_logprobs <= MAX_HELD_LOGPROBS
            and not (params.extra_args or {}).get(STREAM_LOGPROBS)
        ):
            self._held.hold(request.request_id, params.num_logprobs)
        else:
            self._streamed.add(request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[Any]:
        finished = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        gone = [r.request_id for r in finished]
        self._held.drop(gone)
        self._streamed.difference_update(gone)
        return finished

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
        held = len(self._held) > 0
        lists = model_runner_output.logprobs
        if held:
            model_runner_output.logprobs = None  # vLLM would slice it for every request
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        finally:
            model_runner_output.logprobs = lists
        if held or self._streamed:  # nothing held: vLLM sliced them all, only forget the ended
            self._route(outputs, lists if held else None, model_runner_output.req_id_to_index)
        if len(self._held) + len(self._streamed) > len(self.requests):  # left unseen
            self._held.keep_only(self.requests)
            self._streamed.intersection_update(self.requests)
        return outputs

    def _route(self, outputs: dict, lists: LogprobsLists | None, index: dict[str, int]) -> None:
        """Each output's logprobs: a held request's rows are kept (all of them go with its
        last output); another request's are sliced from ``lists`` as vLLM slices them
        (``lists`` ``None``: vLLM did). Requests that end are forgotten."""
        step: StepColumns | None = None
        cu = lists.cu_num_generated_tokens if lists is not None else None
        for batch in outputs.values():
            for out in batch.outputs:
                rid = out.request_id
                i = index.get(rid) if lists is not None else None
                if rid in self._held:
                    if i is not None and out.new_token_ids:
                        if step is None:
                            step = StepColumns.of(lists[0], lists[1], lists[2])  # type: ignore[index]
                        start = cu[i] if cu is not None else i
                        self._held.add(rid, step, start, len(out.new_token_ids))
                    if out.finish_reason is not None:
                        out.new_logprobs = _logprobs_lists(self._held.take(rid))
                elif rid in self._streamed:
                    if i is not None:
                        out.new_logprobs = lists.slice_request(i, len(out.new_token_ids))  # type: ignore[union-attr]
                    if out.finish_reason is not None:
                        self._streamed.discard(rid)


class _HeldSync(_HoldsLogprobs, Scheduler):
    pass


class _HeldAsync(_HoldsLogprobs, AsyncScheduler):
    pass


class HeldLogprobsScheduler:
    """What ``scheduler_cls`` names: builds vLLM's ``AsyncScheduler`` or ``Scheduler`` (as
    the engine's ``async_scheduling`` says) with the held-logprobs overrides. A subclass
    that names other ``sync``/``asynchronous`` classes builds those instead."""

    sync: type = _HeldSync
    asynchronous: type = _HeldAsync

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        return (cls.asynchronous if config.scheduler_config.async_scheduling else cls.sync)(
            *args, **kwargs
        )
