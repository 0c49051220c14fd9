"""Generation throughput of one vLLM engine serving the adapters of several jobs at once
(docs/jobs.md), beside the same engine serving one.

Jobs share an engine only if a batch that mixes their adapters costs about what a batch of one
adapter costs: that is what makes N jobs on one base cheaper than N runs one after another.
For each N in ``--jobs``, N jobs each install their own random adapter (over the real refit
protocol, from a trainer process: ``benchmarks/refit.py``'s), then the engine generates
``--requests`` requests of ``--tokens`` tokens each, dealt round-robin over the N jobs, all in
flight together; the row is the output tokens per second (median of ``--repeats`` rounds) and
its ratio to one job's. ``N = 0`` is the bare base (no adapter in the batch). Each sample is
checked to carry its job's adapter version (``versions``), and the jobs are closed after.

    python benchmarks/jobs_engine.py --sizes 1.5b --jobs 0,1,2,4,8 --rank 32
    python benchmarks/jobs_engine.py --device cpu --sizes tiny --jobs 0,1,4 --requests 32 \\
        --tokens 16 --repeats 2   # no GPU: checks the script on the CPU build
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refit as full  # noqa: E402 - benchmarks/refit.py
from lora_refit import TARGETS, append_rows, run_with_engine_args, write_adapter  # noqa: E402


def engine(model_dir: Path, gpu: int | None, work: Path, transport: str, rank: int,
           slots: int):  # noqa: ANN201  # fmt: skip
    from asyncrl import registry
    from asyncrl.backend import WorkerContext
    from asyncrl.config import from_dict

    options = dict(full.engine_ctx(model_dir, gpu, work, transport).config.generator.options)
    options["lora_slots"] = slots
    config = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "arithmetic"},
        "refit": {"transport": transport}, "generator": {"backend": "vllm", "options": options},
        "lora": {"rank": rank, "target_modules": list(TARGETS)},
    })  # fmt: skip
    ctx = WorkerContext("rollout", 0, 1, 0, config, str(work), gpu=gpu)
    return registry.load("asyncrl.generation_backends", "vllm")(ctx)


async def round_of(  # noqa: ANN001
    backend, jobs: list[str], args: argparse.Namespace, versions: dict[str, int]
) -> float:
    """One round: every request in flight at once; returns output tokens per second."""
    from asyncrl.backend import generate_all
    from asyncrl.wire.messages import GenRequest

    async def one(i: int) -> int:
        job = jobs[i % len(jobs)] if jobs else ""
        request = GenRequest(group_id=f"r{i}", prompt_ids=[1, 5 + i % 20, 9, 3], n=1,
                             max_tokens=args.tokens, temperature=1.0, seed=i, job=job)  # fmt: skip
        (sample,) = await generate_all(backend, request)
        want = versions.get(job, 0)
        if sample.versions.size and set(sample.versions.tolist()) != {want}:
            raise RuntimeError(f"request {i} of job {job!r} carries versions "
                               f"{sorted(set(sample.versions.tolist()))}, not {want}")  # fmt: skip
        return len(sample.token_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(args.requests))))
    return tokens / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> None:
    cpu = args.device == "cpu"
    device, gpu = ("cpu", None) if cpu else ("cuda:0", 0)
    for size in args.sizes:
        model_dir = full.write_model(size, args.work, device)
        out = args.work / f"{model_dir.name}-r{args.rank}.safetensors"
        weights = write_adapter(model_dir, args.rank, out, device)
        backend = engine(model_dir, gpu, args.work, args.transport, args.rank,
                         max(args.jobs) + 2)  # fmt: skip
        await backend.start()
        pair = full.ProcessRefit(args.transport, device, bucket_size=1 << 30, weights=weights)
        rows, one_job = [], None
        try:
            for n in args.jobs:
                jobs = [f"n{n}-job{k}" for k in range(n)]  # a closed job's name is never reused
                versions = {}
                for k, job in enumerate(jobs):  # each job its adapter (the same tensors)
                    await pair.push(backend, 1, job=job)
                    versions[job] = 1
                await round_of(backend, jobs, args, versions)  # warm-up
                rates = [await round_of(backend, jobs, args, versions)
                         for _ in range(args.repeats)]  # fmt: skip
                rate = sorted(rates)[len(rates) // 2]
                if n == 1:
                    one_job = rate
                for job in jobs:
                    await backend.close_job(job)
                row = {"size": size, "jobs": n, "rank": args.rank, "requests": args.requests,
                       "tokens": args.tokens, "tokens_per_s": round(rate, 1),
                       "vs_one_job": round(rate / one_job, 3) if one_job else None,
                       "device": args.device}  # fmt: skip
                rows.append(row)
                print(f"{size:>6} {n} jobs: {rate:9.0f} tokens/s"
                      + (f" ({row['vs_one_job']:.2f}x one job's)" if one_job else ""),
                      flush=True)  # fmt: skip
        finally:
            pair.close()
            await backend.close()
        append_rows(args.out, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1.5b", type=lambda s: s.split(","))
    parser.add_argument("--jobs", default="0,1,2,4,8",
                        type=lambda s: [int(x) for x in s.split(",")])  # fmt: skip
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    run_with_engine_args(parser, main_async)


if __name__ == "__main__":
    main()
