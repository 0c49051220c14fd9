"""What the sampled tokens' logprobs cost between vLLM's engine core and its front end, per
decode step, on this host's CPU (no model, no GPU): vLLM's own message types and msgpack
codec, for a step of B running requests each adding one token.

- ``none``: the step's outputs without logprobs (what ``logprobs=None`` costs).
- ``per step``: vLLM's path. Each request's slice of the step's logprobs (three numpy
  arrays) is cut, encoded into the step's message and decoded by the front end.
- ``held``: asyncrl's scheduler (``logprobs_at_end``). The step's logprobs go into
  :class:`asyncrl_vllm.logprob_rows.HeldRows`, and each request's rows travel once, with its
  last output; here a request's final message is charged 1/L to each of its L steps.

Usage: ``python benchmarks/logprob_wire.py [--batch 128,256] [--length 256] [--steps 400]``.
This is the engine core's and the front end's CPU time only; what it is worth end to end is in
``benchmarks/generation.py --parts options`` (the "logprobs at the end" row).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from asyncrl_vllm.logprob_rows import HeldRows, StepColumns
from results_file import write_results  # benchmarks/, beside this script


def step_lists(rng: np.random.Generator, batch: int) -> LogprobsLists:
    return LogprobsLists(
        rng.integers(0, 150_000, (batch, 1)), -rng.exponential(2.0, (batch, 1)).astype(np.float32),
        rng.integers(1, 50, batch), None,
    )  # fmt: skip


def measure(mode: str, batch: int, length: int, steps: int) -> float:
    """Seconds per step: build the step's outputs, encode, decode."""
    rng = np.random.default_rng(0)
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    held = HeldRows()
    ids = [f"req-{i}-0123abcd" for i in range(batch)]
    for rid in ids:
        held.hold(rid, 0)
    start = time.perf_counter()
    for s in range(steps):
        lists = step_lists(rng, batch)
        if mode == "held":
            cols = StepColumns.of(lists[0], lists[1], lists[2])
            for i, rid in enumerate(ids):
                held.add(rid, cols, i, 1)
        outs = [
            EngineCoreOutput(request_id=rid, new_token_ids=[int(i)],
                             new_logprobs=lists.slice_request(i, 1) if mode == "per step" else None)
            for i, rid in enumerate(ids)
        ]  # fmt: skip
        if mode == "held" and s % length == length - 1:  # every request ends once in L steps
            for out in outs:
                rows = held.take(out.request_id)
                out.new_logprobs = LogprobsLists(*rows.arrays(), None)  # type: ignore[union-attr]
                held.hold(out.request_id, 0)
        dec.decode(enc.encode(EngineCoreOutputs(outputs=outs)))
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256])
    parser.add_argument("--length", type=int, default=256, help="tokens per request")
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default="", help="keep the figures as results/<...>-MACHINE")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(f"{'batch':>6} {'mode':>9} {'ms/step':>8} {'us/token':>9}  (best of {args.repeats})")
    rows = []
    for batch in args.batch:
        for mode in ("none", "per step", "held"):
            best = min(measure(mode, batch, args.length, args.steps) for _ in range(args.repeats))
            rows.append({"batch": batch, "mode": mode, "ms_per_step": best * 1e3,
                         "us_per_token": best / batch * 1e6})  # fmt: skip
            print(f"{batch:>6} {mode:>9} {best * 1e3:>8.3f} {best / batch * 1e6:>9.2f}", flush=True)
    import vllm

    write_results({"rows": rows, "length": args.length, "steps": args.steps,
                   "repeats": args.repeats, "vllm": vllm.__version__,
                   "cpu": platform.processor() or platform.machine(),
                   "date": time.strftime("%Y-%m-%d")}, "logprob-wire", args.out,
                  args.machine)  # fmt: skip


if __name__ == "__main__":
    main()
