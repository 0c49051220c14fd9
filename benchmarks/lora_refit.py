"""Adapter refit time (``[lora]``) on one GPU, beside the same model's full-weight refit.

An adapter refit is what a LoRA run does after each optimizer step: the trainer process stages
the adapter's tensors (every target of every layer: ``lora_A`` and ``lora_B``) into its
buffers and announces them over the real protocol (:mod:`asyncrl.worker.weights`, CUDA IPC);
the vLLM engine's workers copy them out, build the adapter with vLLM's own classes and register
it; then the lease table installs the version and the engine removes the one nobody holds.
The engine is never paused: generation requests run throughout (``--load``), and the script
counts the ones the refits aborted (there must be none).

Per case, the median of ``--repeats`` refits (the first apart):

- ``trainer``: the trainer process's share (staging and announcing the buckets; its training
  would wait for it);
- ``engine``: what the engine sees: the time its worker spends inside the refit's calls
  (copying the bucket out, removing old versions, building and registering the adapter), the
  only time its scheduling stops; ``adding`` is the building and registering alone, and
  ``calls`` the calls' wall time (each waits for the engine's step in progress to end first);
- ``whole``: from the trainer's first bucket to the version installed.

Requests hold the version they started on, so back-to-back refits would fill the engine's
slots: before each refit the script waits (untimed) until a slot is free, as a run's sampler
bounds the versions in flight.

Models are the random Qwen2-layer shapes of ``benchmarks/refit.py`` (``8b`` is Qwen3-8B's
shapes), written once to ``--work``; the engine serves ranks up to the largest asked for.
``--full`` also times the full-weight refit of each model (``benchmarks/refit.py``'s path, a
second engine without LoRA).

    python benchmarks/lora_refit.py --sizes 0.5b,1.5b,8b --ranks 8,32,128 --repeats 20 --full
    python benchmarks/lora_refit.py --device cpu --sizes tiny --ranks 8 --repeats 3   # no GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refit as full  # noqa: E402 - benchmarks/refit.py

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: Path, rank: int, out: Path, device: str) -> Path:
    """A random bf16 adapter of ``rank`` on every target of the model (PEFT's saved names)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    if out.is_file():
        return out
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator(device=device).manual_seed(rank)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            o, i = module.weight.shape
            for kind, shape in (("lora_A", (rank, i)), ("lora_B", (o, rank))):
                t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.01
                tensors[f"base_model.model.{name}.{kind}.weight"] = t.cpu()
    save_file(tensors, str(out))
    return out


def engine(model_dir: Path, gpu: int | None, work: Path, transport: str, rank: int):  # noqa: ANN201
    from asyncrl import registry
    from asyncrl.backend import WorkerContext

    base = full.engine_ctx(model_dir, gpu, work, transport)
    options = dict(base.config.generator.options)
    if rank:
        options["lora_slots"] = 3
    from asyncrl.config import from_dict

    config = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "arithmetic"},
        "refit": {"transport": transport}, "generator": {"backend": "vllm", "options": options},
        **({"lora": {"rank": rank, "target_modules": list(TARGETS)}} if rank else {}),
    })  # fmt: skip
    ctx = WorkerContext("rollout", 0, 1, 0, config, str(work), gpu=gpu)
    return registry.load("asyncrl.generation_backends", "vllm")(ctx)


async def with_rank(backend, rank: int) -> None:  # noqa: ANN001
    """Serve adapters of ``rank`` from now on (the engine holds ranks up to its own): the
    previous rank's versions are removed (no request is in flight) and a fresh lease table
    takes over."""
    import msgspec

    from asyncrl_vllm.adapters import EngineAdapters

    old = backend._adapters
    await backend._rpc("asyncrl_remove_adapters", [a.lora_id for a in old.leases.resident()])
    cfg = backend.ctx.config
    cfg = msgspec.structs.replace(cfg, lora=msgspec.structs.replace(cfg.lora, rank=rank))
    backend._adapters = EngineAdapters(cfg, backend.options, backend._rpc, backend._log)


class Load:
    """Generation requests back to back while refits run: how many were aborted."""

    def __init__(self, backend) -> None:  # noqa: ANN001
        self.backend, self.done, self.aborted, self.stop = backend, 0, 0, False

    async def run(self, lanes: int = 8) -> None:
        from asyncrl.backend import generate_all
        from asyncrl.wire.messages import GenRequest

        async def lane(k: int) -> None:
            i = 0
            while not self.stop:
                request = GenRequest(group_id=f"load{k}-{i}", prompt_ids=[1, 5, 9, 3], n=1,
                                     max_tokens=32, temperature=1.0, seed=i)  # fmt: skip
                for sample in await generate_all(self.backend, request):
                    self.done += 1
                    self.aborted += sample.finish_reason == "abort"
                i += 1

        await asyncio.gather(*(lane(k) for k in range(lanes)))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


async def lora_case(backend, model_dir: Path, rank: int, args, device: str) -> dict:  # noqa: ANN001
    await with_rank(backend, rank)
    weights = write_adapter(model_dir, rank, args.work / f"{model_dir.name}-r{rank}.safetensors",
                            device)  # fmt: skip
    pair = full.ProcessRefit(args.transport, device, bucket_size=1 << 30, weights=weights)
    load = Load(backend)
    runner = asyncio.ensure_future(load.run())
    rows = []
    try:
        await asyncio.sleep(0.5)  # the load is running
        leases = backend._adapters.leases
        for _ in range(args.repeats + 1):
            while sum(1 for a in leases.resident() if leases.holders(a)) >= leases.slots - 1:
                await asyncio.sleep(0.002)
            backend.next_version = getattr(backend, "next_version", 0) + 1  # never reused
            t0 = time.perf_counter()
            sent, _ = await pair.push(backend, backend.next_version)
            rows.append((time.perf_counter() - t0, dict(backend.last_refit), sent))
    finally:
        load.stop = True
        await runner
        pair.close()
    rest = rows[1:]
    nbytes = rows[0][2].num_bytes
    row = {
        "size": model_dir.name, "rank": rank, "bytes": nbytes, "tensors": rows[0][2].num_tensors,
        "first_s": round(rows[0][0], 4),
        "whole_s": round(median([r[0] for r in rest]), 5),
        "trainer_s": round(median([r[2].pack_s for r in rest]), 5),
        "engine_s": round(median([r[1]["worker_s"] for r in rest]), 5),
        "worker_add_s": round(median([r[1]["worker_add_s"] for r in rest]), 5),
        "calls_s": round(median([r[1]["loads_s"] for r in rest]), 5),
        "requests": load.done, "aborted": load.aborted, "device": args.device,
    }  # fmt: skip
    print(f"{row['size']:>11} lora r{rank:<4} {nbytes / 1e6:8.1f} MB {row['tensors']:4d} tensors"
          f" | whole {row['whole_s'] * 1e3:6.1f} ms, trainer {row['trainer_s'] * 1e3:6.1f} ms, "
          f"engine {row['engine_s'] * 1e3:6.1f} ms (adding {row['worker_add_s'] * 1e3:5.1f}; "
          f"calls {row['calls_s'] * 1e3:6.1f}) | "
          f"first {row['first_s'] * 1e3:6.1f} ms | {load.done} requests beside, "
          f"{load.aborted} aborted", flush=True)  # fmt: skip
    return row


async def full_case(model_dir: Path, args, gpu: int | None, device: str) -> dict:
    backend = engine(model_dir, gpu, args.work, args.transport, 0)
    await backend.start()
    try:
        pair = full.ProcessRefit(args.transport, device, bucket_size=1 << 30, weights=model_dir)
        try:
            results = await full.timed_refits(backend, pair, 1, None, None, args.repeats)
        finally:
            pair.close()
    finally:
        await backend.close()
    rest = results[1:]
    row = {
        "size": model_dir.name, "rank": 0, "bytes": results[0][2].num_bytes,
        "whole_s": round(median([r[0] for r in rest]), 5),
        "trainer_s": round(median([r[2].pack_s for r in rest]), 5),
        "engine_s": round(median([r[1]["seconds"] for r in rest]), 5),
        "pause_s": round(median([r[1]["seconds"] for r in rest]), 5), "device": args.device,
    }  # fmt: skip
    print(f"{row['size']:>11} full     {row['bytes'] / 1e9:8.2f} GB            | whole "
          f"{row['whole_s'] * 1e3:6.1f} ms, engine paused {row['pause_s'] * 1e3:6.1f} ms",
          flush=True)  # fmt: skip
    return row


async def main_async(args: argparse.Namespace) -> None:
    cpu = args.device == "cpu"
    device, gpu = ("cpu", None) if cpu else ("cuda:0", 0)
    for size in args.sizes:
        model_dir = full.write_model(size, args.work, device)
        rows = []
        backend = engine(model_dir, gpu, args.work, args.transport, max(args.ranks))
        t0 = time.perf_counter()
        await backend.start()
        print(f"{size}: LoRA engine (max rank {max(args.ranks)}) started in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        try:
            for rank in args.ranks:
                rows.append(await lora_case(backend, model_dir, rank, args, device))
        finally:
            await backend.close()
        if args.full:
            rows.append(await full_case(model_dir, args, gpu, device))
        append_rows(args.out, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5b,1.5b,8b", type=lambda s: s.split(","))
    parser.add_argument("--ranks", default="8,32,128",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--full", action="store_true", help="also the full-weight refit")
    run_with_engine_args(parser, main_async)


def append_rows(path: Path | None, rows: list[dict]) -> None:
    """Append ``rows`` to the JSON-lines file ``path`` (``None``: nowhere)."""
    if path is not None:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def run_with_engine_args(parser: argparse.ArgumentParser, main_async) -> None:  # noqa: ANN001
    """Add the options every engine benchmark here takes (``--work``, ``--out``,
    ``--device``, ``--transport``), parse, and run ``main_async(args)``."""
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncrl-refit-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--transport", default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.transport is None:
        args.transport = "shm" if args.device == "cpu" else "cuda_ipc"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
