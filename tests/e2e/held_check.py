"""A scheduler for tests (imported by vLLM's engine-core process, by qualname): vLLM's own
per-step logprobs go to the front end as usual, and asyncrl's held rows are built beside
them from the same steps and compared with them, request by request, when each request
ends. The tally goes to the JSON file ``$ASYNCRL_HELD_CHECK``."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from asyncrl_vllm.scheduler import HeldLogprobsScheduler, _HeldAsync, _HeldSync, _HoldsLogprobs


class _Checks(_HoldsLogprobs):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent: dict[str, list[Any]] = {}  # vLLM's slices of each held request
        self._width: dict[str, int] = {}
        self._request: dict[str, Any] = {}
        self._tally = {"equal": 0, "different": 0, "rows": 0, "preempted": 0, "problems": []}

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        if request.request_id in self._held:
            self._width[request.request_id] = request.sampling_params.num_logprobs + 1
            self._request[request.request_id] = request

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
        lists = model_runner_output.logprobs
        # vLLM's own update: every request gets its slice, as without asyncrl's scheduler
        outputs = super(_HoldsLogprobs, self).update_from_output(
            scheduler_output, model_runner_output
        )
        finals = {}
        for batch in outputs.values():
            for out in batch.outputs:
                if out.request_id in self._held and out.new_logprobs is not None:
                    self._sent.setdefault(out.request_id, []).append(out.new_logprobs)
                if out.finish_reason is not None:
                    finals[out.request_id] = (out, out.new_logprobs)
        self._route(outputs, lists, model_runner_output.req_id_to_index)  # the held rows
        for rid, (out, vllms) in finals.items():
            if rid in self._width:
                self._compare(rid, out.new_logprobs)
            out.new_logprobs = vllms  # the front end gets vLLM's own, as always
        self._tally["held_now"] = len(self._held)
        self._tally["streamed_now"] = len(self._streamed)
        path = os.environ["ASYNCRL_HELD_CHECK"]
        with open(path + ".tmp", "w") as f:
            json.dump(self._tally, f)
        os.replace(path + ".tmp", path)  # the test reads it while the engine runs
        return outputs

    def _compare(self, rid: str, held: Any) -> None:
        width = self._width.pop(rid)
        sent = self._sent.pop(rid, [])
        self._tally["preempted"] += int(self._request.pop(rid).num_preemptions > 0)
        ref = (
            np.concatenate([s.logprob_token_ids[:, :width] for s in sent]) if sent else None,
            np.concatenate([s.logprobs[:, :width] for s in sent]) if sent else None,
            np.concatenate([s.sampled_token_ranks for s in sent]) if sent else None,
        )
        got = (None, None, None) if held is None else held[:3]
        same = all(
            (a is None and (b is None or len(b) == 0)) or (a is not None and b is not None
             and a.dtype == b.dtype and np.array_equal(a, b))
            for a, b in zip(got, ref)
        )  # fmt: skip
        self._tally["equal" if same else "different"] += 1
        self._tally["rows"] += 0 if ref[2] is None else len(ref[2])
        if not same and len(self._tally["problems"]) < 5:
            self._tally["problems"].append(rid)


class _CheckSync(_Checks, _HeldSync):
    pass


class _CheckAsync(_Checks, _HeldAsync):
    pass


class CheckingScheduler(HeldLogprobsScheduler):
    """``scheduler_cls``: the checking scheduler on vLLM's sync or async base."""

    sync = _CheckSync
    asynchronous = _CheckAsync
