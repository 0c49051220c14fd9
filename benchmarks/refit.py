"""Whole-refit time on GPUs, next to the device-to-device copy floor measured in the same run.

A refit here is what a run does after each optimizer step, over the real protocol
(:mod:`asyncrl.worker.weights`) and a real weight transfer: the trainer's tensors are staged into its
buffers, every bucket is announced, the vLLM engine (a real ``AsyncLLM``, its own processes)
maps it and writes it into its parameters, and the engine resumes. Timed from the pull to the
resume ("whole refit"); the first refit of an engine (handle opening, plan compilation) is
reported apart.

Models are random-initialized Qwen2 shapes (Qwen2.5-0.5B, -1.5B, -7B), bf16, written once to
``--work``. Trainers:

- ``1gpu``: the trainer's tensors live on ``cuda:<trainer GPU>`` (what
  ``FSDPBackend.iter_weights`` yields with one rank: full tensors on its GPU), in a trainer
  process of its own that runs the sender, as trainer rank 0 does in a run (``--sender
  inline``: in this process, next to the engine's client, competing with it for the GIL);
- ``fsdp2``: run under ``torchrun --nproc-per-node 2``; both ranks run the real
  ``FSDPBackend`` (``fully_shard`` over 2 GPUs), rank 0 also hosts the engine and sends,
  gathering one FSDP unit at a time.

Placements: ``same`` (engine on the trainer rank 0's GPU) and ``other`` (engine on GPU 1,
trainer rank 0 on GPU 0): the floor is one ``copy_`` of the refit's bytes from the trainer's
GPU to the engine's (same GPU: a device-local copy), timed here. ``host`` (with ``--transport
nccl``): the trainer's tensors in host memory, so the transfer is a gloo broadcast over TCP
into the engine's host buffers, which it copies to GPU 0, the path of a refit to another node
without NCCL; the floor is one send of the bytes through a loopback TCP connection.

    python benchmarks/refit.py --sizes 0.5b,7b --placements same,other
    python benchmarks/refit.py --sizes 0.5b --placements host --transport nccl
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/refit.py --trainer fsdp2
    python benchmarks/refit.py --device cpu --sizes tiny --bucket-mb 1    # no GPU: checks
        the script itself on the CPU build (shm, or --transport nccl over gloo)

Prints one line per case and writes ``--out`` (JSON lines).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab, tied
    "tiny": (128, 2, 4, 2, 256, 512, True),  # --device cpu: checks the script itself
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "7b": (3584, 28, 28, 4, 18944, 152064, False),
    "8b": (4096, 36, 32, 8, 12288, 151936, False),  # Qwen3-8B's shapes (Qwen2 layers)
}


def model_config(size: str):  # noqa: ANN201 - a transformers config
    import transformers

    h, n, heads, kv, inter, vocab, tied = SHAPES[size]
    return transformers.Qwen2Config(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    )


def write_model(size: str, work: Path, device: str = "cuda:0") -> Path:
    """A random bf16 checkpoint of ``size`` (kept across runs)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out = work / f"qwen2-{size}"
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(size)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.Qwen2ForCausalLM(config).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        state[name] = t.cpu()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(
        str(out / "tokenizer.json")
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return out


def load_state(weights: Path, device: str) -> dict:
    """The tensors of a safetensors file (or of a model directory's ``model.safetensors``)."""
    from safetensors.torch import load_file

    path = weights / "model.safetensors" if weights.is_dir() else weights
    return {n: t.to(device) for n, t in load_file(str(path)).items()}


def copy_floor(nbytes: int, src: str, dst: str, repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` copies of ``nbytes`` from ``src`` to ``dst``."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    cuda = [d for d in {src, dst} if d.startswith("cuda")]
    best = float("inf")
    for _ in range(repeats + 1):
        for d in cuda:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        b.copy_(a)
        for d in cuda:
            torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - t0)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return best


def tcp_floor(nbytes: int, repeats: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` sends of ``nbytes`` from host memory to host
    memory through one loopback TCP connection: the floor of a gloo broadcast to one reader
    on this host (gloo moves every byte over TCP), before the engine's copy to its GPU."""
    import socket
    import threading

    src, dst = bytearray(nbytes), bytearray(nbytes)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    best = float("inf")
    with sender, receiver:
        for _ in range(repeats):
            thread = threading.Thread(target=sender.sendall, args=(memoryview(src),))
            t0 = time.perf_counter()
            thread.start()
            view, got = memoryview(dst), 0
            while got < nbytes:
                got += receiver.recv_into(view[got:], min(nbytes - got, 1 << 24))
            thread.join()
            best = min(best, time.perf_counter() - t0)
    return best


def engine_ctx(model_dir: Path, gpu: int | None, run_dir: Path, transport: str,  # noqa: ANN201
               mirror: str = "auto"):
    from asyncrl.backend import WorkerContext
    from asyncrl.config import from_dict

    if gpu is None:  # the CPU build
        options = {"enforce_eager": True, "max_model_len": 512, "cpu_kvcache_space_gib": 1}
        trainer = {}
    else:
        options = {"enforce_eager": True, "max_model_len": 512, "gpu_memory_utilization": 0.35,
                   "refit_mirror": mirror}
        trainer = {"mixed_precision": "bf16"}
    config = from_dict({
        "model": {"path": str(model_dir)},
        "environment": {"name": "arithmetic"},
        "refit": {"transport": transport},
        "trainer": {"backend": "fsdp2", "options": trainer},
        "generator": {"backend": "vllm", "options": options},
    })
    return WorkerContext("rollout", 0, 1, 0, config, str(run_dir), gpu=gpu)


def _trainer_process(conn, transport: str, device: str, bucket_size: int, weights: str,  # noqa: ANN001
                     address: str, run_id: str, buffers: int) -> None:
    """Trainer rank 0 in a process of its own, as in a run: holds ``weights``' tensors on
    ``device`` and sends the version the parent names, until it names none. The pipe carries
    msgpack (versions down, ``WeightsResult`` up), nothing pickled."""
    import anyio

    from asyncrl.backend import WeightTensor
    from asyncrl.worker.weights import WeightSender
    from asyncrl.transfers import StagingSpec, load_transfer
    from asyncrl.wire.transport import Context
    from refit_support import dtype_name

    state = load_state(Path(weights), device)
    specs = [WeightTensor(n, dtype_name(t), tuple(t.shape)) for n, t in state.items()]

    def tensors():  # noqa: ANN202
        for n, t in state.items():
            yield WeightTensor(n, dtype_name(t), tuple(t.shape), t, stable=True)

    async def serve() -> None:
        ctx = Context()
        sender = WeightSender(ctx, address, load_transfer(transport),
                              StagingSpec(run_id, 0, device, buffers=buffers))
        try:
            conn.send_bytes(msgspec.msgpack.encode("ready"))
            while (version := msgspec.msgpack.decode(
                await anyio.to_thread.run_sync(conn.recv_bytes)
            )) is not None:
                result = await sender.send(version, ["rollout:0"], specs, tensors(),
                                           bucket_size=bucket_size, timeout_s=300)
                conn.send_bytes(msgspec.msgpack.encode(result))
        finally:
            sender.close()
            ctx.close()

    anyio.run(serve)


class ProcessRefit:
    """The sender in a trainer process of its own (``_trainer_process``), the receiver here
    next to the engine's client: the processes of a run. (``refit_support.LocalRefit`` keeps
    both ends in this process, where packing competes with the engine's client for the GIL.)"""

    def __init__(self, transport: str, device: str, *, bucket_size: int, weights: Path,
                 buffers: int = 2) -> None:
        import multiprocessing
        import tempfile
        import uuid

        from asyncrl.worker.weights import WeightReceiver
        from asyncrl.wire.transport import Context, ipc_address

        self._dir = tempfile.mkdtemp(prefix="asyncrl-pr-")
        os.chmod(self._dir, 0o700)
        self.run_id = uuid.uuid4().hex[:8]
        self.transport = transport
        address = ipc_address(self._dir, "w")
        mp = multiprocessing.get_context("spawn")
        self._conn, child = mp.Pipe()
        self._proc = mp.Process(
            target=_trainer_process,
            args=(child, transport, device, bucket_size, str(weights), address, self.run_id,
                  buffers),
            daemon=True,
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(600):
            self.close()
            raise RuntimeError("the trainer process did not start within 600 s")
        msgspec.msgpack.decode(self._conn.recv_bytes())
        self.ctx = Context()
        self.receiver = WeightReceiver(self.ctx, address, "rollout:0")

    async def push(  # noqa: ANN001, ANN201
        self, backend, version: int, *_: object, job: str = "", **__: object
    ):
        """Send ``version`` (as ``job``'s adapter with ``job``: docs/jobs.md) and load it."""
        import anyio

        from asyncrl.wire.messages import WeightsResult

        self._conn.send_bytes(msgspec.msgpack.encode(version))
        received = await self.receiver.receive(
            version, backend, transport=self.transport, reset_prefix_cache=True,
            kv_scales=None, timeout_s=300, job=job,
        )
        raw = await anyio.to_thread.run_sync(self._conn.recv_bytes)
        return msgspec.msgpack.decode(raw, type=WeightsResult), received

    def close(self) -> None:
        import shutil

        from asyncrl.procs.space import shm_dir

        try:
            self._conn.send_bytes(msgspec.msgpack.encode(None))
        except OSError:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()
        if hasattr(self, "receiver"):
            self.receiver.close()
            self.ctx.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        shutil.rmtree(shm_dir(self.run_id), ignore_errors=True)


async def timed_refits(backend, pair, version: int, make, specs, repeats: int, barrier=None):  # noqa: ANN001, ANN201
    """The first refit apart, then ``repeats`` timed ones: [(whole s, engine's account, sent)]
    (the engine's account: ``last_refit``, with its pause/loads/worker/resume split)."""
    out = []
    for i in range(repeats + 1):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        sent, _ = await pair.push(backend, version + i, make, specs=specs)
        out.append((time.perf_counter() - t0, dict(backend.last_refit), sent))
    return out


PARTS = ("pause_s", "loads_s", "worker_s", "resume_s")


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def report(case: dict, results, floor_s: float, out_path: Path | None) -> None:
    first, rest = results[0], results[1:]
    whole = sorted(r[0] for r in rest)
    nbytes = first[2].num_bytes
    med = median(whole)
    # where a median refit's time went (medians of each part; they need not add up)
    parts = {k: round(median([r[1].get(k, 0.0) for r in rest]), 5) for k in PARTS}
    parts["pack_s"] = round(median([r[2].pack_s for r in rest]), 5)
    row = {
        **case,
        "bytes": nbytes,
        "tensors": first[2].num_tensors,
        "buckets": first[2].num_buckets,
        "first_refit_s": round(first[0], 4),
        "refit_s_median": round(med, 5),
        "refit_s_min": round(whole[0], 5),
        "engine_s_median": round(median([r[1]["seconds"] for r in rest]), 5),
        "mirrored": rest[-1][1].get("mirrored", 0),
        **parts,
        "gb_per_s": round(nbytes / med / 1e9, 1),
        "floor_s": round(floor_s, 5),
        "floor_gb_per_s": round(nbytes / floor_s / 1e9, 1),
        "x_floor": round(med / floor_s, 2),
    }
    print(
        f"{case['size']:>5} {case['trainer']:>5} {case['placement']:>5} "
        f"{case.get('mirror', 'auto'):>6} {case.get('sender', 'inline'):>7} "
        f"{case.get('staging_buffers', 2)} buffers "
        f"{nbytes / 1e9:6.2f} GB {row['buckets']:3d} buckets | refit {med * 1e3:7.1f} ms "
        f"({row['gb_per_s']:6.1f} GB/s; first {first[0] * 1e3:7.1f} ms) | floor "
        f"{floor_s * 1e3:6.1f} ms ({row['floor_gb_per_s']:6.1f} GB/s) | {row['x_floor']:.2f}x"
        f" | {case['bucket_mb']} MiB buckets: pack {parts['pack_s'] * 1e3:.1f}, pause "
        f"{parts['pause_s'] * 1e3:.1f}, loads {parts['loads_s'] * 1e3:.1f} (worker "
        f"{parts['worker_s'] * 1e3:.1f}), resume {parts['resume_s'] * 1e3:.1f} ms; "
        f"{row['mirrored']} mirrored",
        flush=True,
    )
    if out_path is not None:
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")


async def one_gpu(args: argparse.Namespace) -> None:
    import torch

    from asyncrl import registry
    from refit_support import LocalRefit

    cpu = args.device == "cpu"
    for size in args.sizes:
        model_dir = write_model(size, args.work, "cpu" if cpu else "cuda:0")
        backend = registry.load("asyncrl.generation_backends", "vllm")(
            engine_ctx(model_dir, None if cpu else 0, args.work, args.transport, args.mirror[0])
        )
        t0 = time.perf_counter()
        await backend.start()
        print(f"{size}: engine started in {time.perf_counter() - t0:.0f} s", flush=True)
        version = 1
        try:
            for placement in ["same"] if cpu else args.placements:
                trainer_gpu = 1 if placement == "other" else 0
                if not cpu and trainer_gpu >= torch.cuda.device_count():
                    print(f"{size} {placement}: needs a second GPU, skipped")
                    continue
                if placement == "host" and args.transport != "nccl":
                    print(f"{size} host: the trainer on the CPU needs --transport nccl (gloo)")
                    continue
                device = "cpu" if cpu or placement == "host" else f"cuda:{trainer_gpu}"
                state = load_state(model_dir, device)
                floor = None
                cases = itertools.product(args.bucket_mb, args.mirror, args.sender,
                                          args.staging_buffers)
                for bucket_mb, mirror, sender, buffers in cases:
                    # the option is read per bucket: one engine serves every case
                    backend.options = msgspec.structs.replace(backend.options, refit_mirror=mirror)
                    if sender == "process":
                        pair = ProcessRefit(args.transport, device, bucket_size=bucket_mb << 20,
                                            weights=model_dir, buffers=buffers)
                    else:
                        pair = LocalRefit(args.transport, device, bucket_size=bucket_mb << 20,
                                          buffers=buffers)
                    try:
                        results = await timed_refits(
                            backend, pair, version, lambda: state.items(), None, args.repeats
                        )
                    finally:
                        pair.close()
                    version += args.repeats + 1
                    if floor is None and placement == "host":
                        floor = tcp_floor(results[0][2].num_bytes)
                    elif floor is None:
                        floor = copy_floor(results[0][2].num_bytes, device,
                                           "cpu" if cpu else "cuda:0")
                    case = {"size": size, "trainer": "1gpu", "placement": placement,
                            "bucket_mb": bucket_mb, "transport": args.transport,
                            "mirror": mirror, "sender": sender, "staging_buffers": buffers,
                            "device": args.device}
                    report(case, results, floor, args.out)
                state = {}
        finally:
            await backend.close()


async def fsdp2(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from asyncrl import registry
    from asyncrl.backend import WorkerContext
    from refit_support import LocalRefit

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cpu = args.device == "cpu"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", init_method="env://", rank=rank,
                            world_size=world)
    for size in args.sizes:
        model_dir = args.work / f"qwen2-{size}"
        if rank == 0:
            write_model(size, args.work, "cpu" if cpu else "cuda:0")
        dist.barrier()  # rank 0 wrote the model
        cfg = engine_ctx(model_dir, None if cpu else 0, args.work, args.transport).config
        # the trainer joins the process group this benchmark made (the embedded path)
        trainer = registry.load("asyncrl.training_backends", "fsdp2")(
            WorkerContext("trainer", rank, world, rank, cfg, str(args.work))
        )
        t0 = time.perf_counter()
        trainer.start()
        print(f"rank {rank}: FSDP2 trainer of {size} started in {time.perf_counter() - t0:.0f} s",
              flush=True)
        specs = trainer.weight_specs()
        placements = ["same"] if cpu else args.placements
        engines = {}
        try:
            if rank == 0:  # one engine per placement, started together
                for placement in placements:
                    gpu = None if cpu else 0 if placement == "same" else 1
                    engines[placement] = registry.load("asyncrl.generation_backends", "vllm")(
                        engine_ctx(model_dir, gpu, args.work, args.transport, args.mirror[0])
                    )
                t0 = time.perf_counter()
                await asyncio.gather(*(e.start() for e in engines.values()))
                print(f"{size}: {len(engines)} engine(s) started in "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
            for placement in placements:
                engine_gpu = 0 if placement == "same" else 1
                if rank != 0:
                    for _ in range((args.repeats + 1) * len(args.bucket_mb)):
                        dist.barrier()
                        for _ in trainer.iter_weights():
                            pass
                    continue
                backend = engines[placement]
                device = "cpu" if cpu else "cuda:0"
                rows = []
                version = 1
                for bucket_mb in args.bucket_mb:
                    pair = LocalRefit(args.transport, device, bucket_size=bucket_mb << 20)
                    try:
                        rows.append((bucket_mb, await timed_refits(
                            backend, pair, version, trainer.iter_weights, specs,
                            args.repeats, barrier=dist.barrier,
                        )))
                    finally:
                        pair.close()
                    version += args.repeats + 1
                nbytes = rows[0][1][0][2].num_bytes
                floor = copy_floor(nbytes, device, "cpu" if cpu else f"cuda:{engine_gpu}")
                for bucket_mb, results in rows:
                    case = {"size": size, "trainer": "fsdp2", "placement": placement,
                            "bucket_mb": bucket_mb, "transport": args.transport,
                            "mirror": args.mirror[0], "sender": "inline",
                            "device": args.device}
                    report(case, results, floor, args.out)
        finally:
            for engine in engines.values():
                await engine.close()
            trainer.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5b,1.5b,7b", type=lambda s: s.split(","))
    parser.add_argument("--placements", default="same,other", type=lambda s: s.split(","))
    parser.add_argument("--trainer", choices=["1gpu", "fsdp2"], default="1gpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", default="1024", help="bucket sizes in MiB, "
                        "comma-separated: each is a case",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncrl-refit-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the CPU build of vLLM, a gloo FSDP2 group, no GPU figures "
                             "(checks this script where no GPU is at hand)")
    parser.add_argument("--mirror", default="auto", type=lambda s: s.split(","),
                        help="the engine's refit_mirror option, comma-separated: each is a "
                             "case (always: the cross-GPU path on one GPU; fsdp2: the first)")
    parser.add_argument("--sender", default="process", type=lambda s: s.split(","),
                        help="1gpu: where trainer rank 0's sender runs, comma-separated cases: "
                             "process (a trainer process of its own, as in a run) or inline "
                             "(in this process, next to the engine's client)")
    parser.add_argument("--staging-buffers", default="2",
                        type=lambda s: [int(x) for x in s.split(",")],
                        help="1gpu: staging buffers (asyncrl.transfers.STAGING_BUFFERS), "
                        "comma-separated cases")
    parser.add_argument("--transport", default=None,
                        help="weight transfer (default: cuda_ipc on cuda, shm on cpu)")
    args = parser.parse_args()
    if bad := set(args.mirror) - {"auto", "always", "never"}:
        parser.error(f"--mirror: unknown {sorted(bad)}")
    if bad := set(args.sender) - {"process", "inline"}:
        parser.error(f"--sender: unknown {sorted(bad)}")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.transport is None:
        args.transport = "shm" if args.device == "cpu" else "cuda_ipc"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    asyncio.run(one_gpu(args) if args.trainer == "1gpu" else fsdp2(args))


if __name__ == "__main__":
    main()
