"""Latency of one call into a running vLLM engine: ``collective_rpc``, pause, resume and a
prefix-cache reset, the fixed costs a refit pays per engine round trip.

    python benchmarks/gpu/rpc_probe.py          # on the GPU host, vLLM staged (shared/gpu)

Measured on an H200 (vLLM 0.26, 0.5B Qwen2 shape, 0.35 of the GPU's memory): see
docs/refit.md.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from refit import engine_ctx, write_model  # noqa: E402

from asyncrl import registry  # noqa: E402


async def main() -> None:
    work = Path("/tmp/asyncrl-refit-bench")
    work.mkdir(parents=True, exist_ok=True)
    ctx = engine_ctx(write_model("0.5b", work), 0, work, "cuda_ipc")
    backend = registry.load("asyncrl.generation_backends", "vllm")(ctx)
    await backend.start()
    llm = backend._llm
    calls = [
        ("collective_rpc(asyncrl_info)", lambda: llm.collective_rpc("asyncrl_info")),
        (
            "pause_scheduler(keep)",
            lambda: llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False),
        ),
        ("resume_generation", llm.resume_generation),
        ("reset_prefix_cache", lambda: llm.reset_prefix_cache(reset_running_requests=True)),
    ]
    try:
        for name, call in calls:
            seconds = []
            for _ in range(8):
                t0 = time.perf_counter()
                await call()
                seconds.append(time.perf_counter() - t0)
            seconds.sort()
            print(f"{name:32s} median {seconds[4] * 1e3:6.2f} ms  min {seconds[0] * 1e3:6.2f} ms")
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
