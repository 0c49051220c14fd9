"""Sleep, wake and wake + refit of a vLLM engine that takes turns with a trainer on one GPU
(``cluster.placement = "take_turns"``, docs/one-gpu.md), CUDA graphs kept.

Each cycle: the engine generates a batch (its KV cache in use), then sleeps (the backend's
``sleep``: vLLM's level 2, the weights and the KV cache released), then the refit wakes it
over the real protocol from a trainer process holding the weights on the same GPU (the
backend wakes the weights' memory, loads the version into it, wakes the KV cache and
resumes); the engine then scores a fixed batch, which must give what it gave before the
first sleep (the weights sent are the same each time: a woken engine serving stale or
garbage weights shows here), and generates again. Reported per model, medians of
``--repeats`` cycles: ``sleep_s``, ``wake_s`` (the two wake-ups inside the refit),
``wake_refit_s`` (the whole refit that woke it), the GPU memory the sleep gave back, and the
largest score difference after a wake.

Models are random-initialized Qwen2 shapes (``benchmarks/refit.py``'s), bf16, written once
to ``--work``.

    python benchmarks/sleep_wake.py --sizes 0.5b,1.5b,8b --repeats 10
    python benchmarks/sleep_wake.py --device cpu --sizes tiny --repeats 3   # no GPU: checks
        the script itself on the CPU build (its sleep pauses the scheduler only)
    python benchmarks/sleep_wake.py --sizes 1.5b,8b --lora 32   # [lora]: level 1, adapters
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_refit import TARGETS, write_adapter  # noqa: E402
from refit import SHAPES, ProcessRefit, median, write_model  # noqa: E402


def engine(  # noqa: ANN201
    model_dir: Path, cuda: bool, run_dir: Path, utilization: float, rank: int
):
    """The vLLM backend as a ``take_turns`` rollout rank starts it (sleep mode on, on CUDA);
    with ``rank``, a ``[lora]`` one (vLLM's level 1: the base kept in host memory)."""
    from asyncrl import registry
    from asyncrl.backend import WorkerContext
    from asyncrl.config import from_dict

    options = ({"enforce_eager": False, "max_model_len": 1024,
                "gpu_memory_utilization": utilization} if cuda else
               {"enforce_eager": True, "max_model_len": 512, "cpu_kvcache_space_gib": 1})  # fmt: skip
    config = from_dict({
        "model": {"path": str(model_dir)},
        "environment": {"name": "arithmetic"},
        "cluster": {"placement": "take_turns"},
        "refit": {"transport": "cuda_ipc" if cuda else "shm"},
        "generator": {"backend": "vllm", "options": options},
        **({"lora": {"rank": rank, "target_modules": list(TARGETS)}} if rank else {}),
    })  # fmt: skip
    ctx = WorkerContext("rollout", 0, 1, 0, config, str(run_dir), gpu=0 if cuda else None)
    return registry.load("asyncrl.generation_backends", "vllm")(ctx)


def free_bytes(cuda: bool) -> int:
    import torch

    return int(torch.cuda.mem_get_info(0)[0]) if cuda else 0


async def cycle_model(size: str, args: argparse.Namespace) -> dict:
    import numpy as np

    from asyncrl.backend import generate_all
    from asyncrl.wire.messages import GenRequest, TokenBatch

    cuda = args.device == "cuda"
    model_dir = write_model(size, args.work, "cuda:0" if cuda else "cpu")
    backend = engine(model_dir, cuda, args.work, args.utilization, args.lora)
    t0 = time.perf_counter()
    await backend.start()
    started = time.perf_counter() - t0
    weights = model_dir  # the refit sends the whole model, or the same adapter each time
    if args.lora:
        weights = write_adapter(model_dir, args.lora, args.work / f"{size}-r{args.lora}"
                                ".safetensors", "cuda:0" if cuda else "cpu")  # fmt: skip
    pair = ProcessRefit("cuda_ipc" if cuda else "shm", "cuda:0" if cuda else "cpu",
                        bucket_size=args.bucket_mb << 20, weights=weights)  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = SHAPES[size][5]
    prompts = [rng.integers(10, min(vocab, 5000), 64).tolist() for _ in range(args.batch)]
    k = min(8, len(prompts))  # the probe: k prompts, scored from their 33rd token
    probe = TokenBatch(np.asarray([t for p in prompts[:k] for t in p], np.int32),
                       np.full(k, 64, np.int32), np.full(k, 32, np.int32))  # fmt: skip

    async def generate(tag: str) -> int:
        groups = await asyncio.gather(*(generate_all(backend, GenRequest(
            group_id=f"{tag}-{i}", prompt_ids=p, n=1, max_tokens=args.tokens, seed=i))
            for i, p in enumerate(prompts)))  # fmt: skip
        return sum(len(s.token_ids) for g in groups for s in g)

    rows = []
    try:
        await pair.push(backend, 1)  # the first refit opens the handles, awake
        reference = await backend.score(probe, 1.0)
        for i in range(args.repeats):
            tokens = await generate(f"c{i}")
            before = free_bytes(cuda)
            t0 = time.perf_counter()
            facts = await backend.sleep()
            sleep_s = time.perf_counter() - t0
            freed = free_bytes(cuda) - before
            t0 = time.perf_counter()
            await pair.push(backend, i + 2)
            wake_refit_s = time.perf_counter() - t0
            refit = dict(backend.last_refit)
            assert refit["woke"], refit
            diff = float(np.abs(await backend.score(probe, 1.0) - reference).max())
            rows.append({"sleep_s": sleep_s, "held": facts["held"], "freed_gib": freed / 2**30,
                         "wake_s": refit["wake_s"], "wake_refit_s": wake_refit_s,
                         "refit_bytes": refit["bytes"], "score_diff": diff, "tokens": tokens})  # fmt: skip
        after = await generate("after")
    finally:
        pair.close()
        await backend.close()
    out = {"size": size, "lora_rank": args.lora, "device": args.device, "repeats": args.repeats,
           "engine_start_s": round(started, 1), "cuda_graphs": cuda,
           "utilization": args.utilization if cuda else None,
           "bytes": rows[0]["refit_bytes"], "tokens_after": after,
           "score_diff_max": max(r["score_diff"] for r in rows)}  # fmt: skip
    for key in ("sleep_s", "wake_s", "wake_refit_s", "freed_gib"):
        out[f"{key}_median"] = round(median([r[key] for r in rows]), 4)
        out[f"{key}_max"] = round(max(r[key] for r in rows), 4)
    kind = f"lora r{args.lora}" if args.lora else "full"
    print(f"{size:>5} {kind} {args.device}: sleep {out['sleep_s_median'] * 1e3:7.1f} ms (max "
          f"{out['sleep_s_max'] * 1e3:.1f}), freed {out['freed_gib_median']:5.1f} GiB | wake "
          f"{out['wake_s_median'] * 1e3:7.1f} ms | wake + refit of {out['bytes'] / 1e9:.2f} GB "
          f"{out['wake_refit_s_median'] * 1e3:7.1f} ms (max {out['wake_refit_s_max'] * 1e3:.1f})"
          f" | score diff after wake {out['score_diff_max']:.2g} | engine start "
          f"{started:.0f} s", flush=True)  # fmt: skip
    return out


async def main_async(args: argparse.Namespace) -> None:
    for size in args.sizes:
        row = await cycle_model(size, args)
        if args.out is not None:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b,8b", type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="prompts generated per cycle")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per prompt per cycle")
    parser.add_argument("--utilization", type=float, default=0.5,
                        help="the engine's gpu_memory_utilization (the trainer's weights sit "
                             "beside it)")  # fmt: skip
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="an adapter of this rank on every projection is what the refit "
                             "sends ([lora]: the engine sleeps at level 1, its base in host "
                             "memory)")  # fmt: skip
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncrl-refit-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
