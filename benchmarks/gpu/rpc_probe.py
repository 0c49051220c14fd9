"""Latency of one call into a running vLLM engine (collective_rpc, pause/resume, prefix-cache
reset) on this host: the fixed cost each refit step pays per engine round trip."""
import asyncio, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from refit import engine_ctx, write_model  # noqa: E402
from asyncrl import plugins  # noqa: E402


async def main() -> None:
    work = Path("/tmp/asyncrl-refit-bench")
    b = plugins.load("asyncrl.generation_backends", "vllm")(engine_ctx(write_model("0.5b", work), 0, work))
    await b.start()
    llm = b._llm
    try:
        for name, make in [
            ("collective_rpc(asyncrl_info)", lambda: llm.collective_rpc("asyncrl_info")),
            ("pause_scheduler(keep)", lambda: llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)),
            ("resume_generation", lambda: llm.resume_generation()),
            ("reset_prefix_cache", lambda: llm.reset_prefix_cache(reset_running_requests=True)),
        ]:
            ts = []
            for _ in range(8):
                t0 = time.perf_counter(); await make(); ts.append(time.perf_counter() - t0)
            ts.sort()
            print(f"{name:32s} median {ts[4]*1e3:6.2f} ms  min {ts[0]*1e3:6.2f} ms", flush=True)
    finally:
        await b.close()

if __name__ == "__main__":
    asyncio.run(main())
