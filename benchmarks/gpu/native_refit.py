"""Whole-refit time through vLLM 0.26's own weight-transfer API, next to the copy floor.

The counterpart of ``benchmarks/refit.py`` (asyncrl's path): same models and floor. Trainer
tensors in this process on ``cuda:0`` (``same``) or ``cuda:1`` (``other``), an ``AsyncLLM`` with
``weight_transfer_config`` on GPU 0. A refit is timed whole: pause_generation (abort, prefix cache
cleared), start_weight_update, update_weights (trainer send + engine load), finish_weight_update,
resume_generation. IPC ``other``: vLLM's helper names only the trainer GPU's UUID, so the handles
are re-keyed to the engine GPU's too ("uuid-remap", peer-mapped; not a path vLLM supports).

    python benchmarks/gpu/native_refit.py --sizes 0.5b,7b --placements same,other
    python benchmarks/gpu/native_refit.py --backend nccl --placements other --packed-mb 0,1024
"""

# Facts relied on, from the vllm-0.26.0 wheel (commit ffd46bfab); paths under vllm/:
# - config/weight_transfer.py WeightTransferConfig(backend "nccl"|"ipc"|"sparse_nccl"), engine arg
#   weight_transfer_config; Worker.load_model (v1/worker/gpu_worker.py) then builds
#   Worker.weight_transfer_engine (distributed/weight_transfer/factory.py).
# - v1/engine/async_llm.py AsyncLLM.init_weight_transfer_engine(WeightTransferInitRequest),
#   start_weight_update(), update_weights(WeightTransferUpdateRequest), finish_weight_update():
#   each a collective_rpc to the Worker method of the same name (requests: weight_transfer/base.py).
# - weight_transfer/ipc_engine.py (imports ray at module level): the static
#   IPCWeightTransferEngine.trainer_send_weights(iterator, IPCTrainerSendWeightsArgs(send_mode=
#   "ray"|"http"|callable, packed, packed_buffer_size_bytes)) makes reduce_tensor handles keyed by
#   the current GPU's UUID (packed: packed_tensor.packed_ipc_producer, one reused buffer, a call per
#   chunk) and hands each IPCWeightTransferUpdateInfo to send_mode. The worker picks its own GPU's
#   UUID, rebuild_cuda_tensor()s (device arg replaced; packed chunks cloned), model.load_weights;
#   start/finish = initialize_/finalize_layerwise_reload (model_executor/model_loader/reload/).
# - Through AsyncLLM, update_info is msgpack'd (v1/serial_utils.py): the handle tuples' classes and
#   dtype go as pickles, only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 ("http" pickles all).
# - weight_transfer/nccl_engine.py + nccl_common.py: NCCLWeightTransferEngine.trainer_init(dict(
#   master_address, master_port, world_size)) is rank 0 on the current GPU, the worker's init_info
#   adds rank_offset; trainer_send_weights(iterator, NCCLTrainerSendWeightsArgs(group, packed))
#   runs while the engine's update_weights (NCCLWeightTransferUpdateInfo fields) receives.
# 0.30+ replaces the static trainer_send_weights by WeightTransferTrainerFactory.trainer_init(...)
# .send_weights() (and ipc_engine drops ray); this script targets 0.26.

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from refit import SHAPES, copy_floor, load_state, median, write_model  # noqa: E402

PARTS = ("pause_s", "start_s", "update_s", "finish_s", "resume_s")


def start_engine(model_dir: Path, backend: str):  # noqa: ANN201 - an AsyncLLM
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=512,
        gpu_memory_utilization=0.35, skip_tokenizer_init=True, disable_log_stats=True,
        weight_transfer_config=WeightTransferConfig(backend=backend)))


async def init_transfer(engine, backend: str, gpu: int):  # noqa: ANN001, ANN201
    """The engine's init_weight_transfer_engine; NCCL: with the trainer's communicator."""
    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest as Init

    if backend == "ipc":  # a no-op for IPC, but part of the protocol
        return await engine.init_weight_transfer_engine(Init(init_info={}))
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        info = {"master_address": "127.0.0.1", "master_port": s.getsockname()[1], "world_size": 2}

    def trainer():  # noqa: ANN202
        torch.cuda.set_device(gpu)
        return NCCLWeightTransferEngine.trainer_init(info)

    return (await asyncio.gather(asyncio.to_thread(trainer), engine.init_weight_transfer_engine(
        Init(init_info={**info, "rank_offset": 1}))))[0]


def send(engine, loop, backend: str, state: dict, gpu: int, packed: int, group, remap) -> None:  # noqa: ANN001
    """Runs in a thread: vLLM's trainer helper (IPC: its send_mode a blocking update_weights)."""
    import torch
    from vllm.distributed.weight_transfer import ipc_engine, nccl_engine
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    torch.cuda.set_device(gpu)  # the IPC helper keys handles by the current GPU's UUID
    extra = {"packed": bool(packed), **({"packed_buffer_size_bytes": packed} if packed else {})}
    if backend == "nccl":
        args = nccl_engine.NCCLTrainerSendWeightsArgs(group=group, **extra)
        nccl_engine.NCCLWeightTransferEngine.trainer_send_weights(iter(state.items()), args)
        return torch.cuda.synchronize(gpu)

    def push(info) -> None:  # noqa: ANN001 - an IPCWeightTransferUpdateInfo
        update = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
        handles = update["ipc_handles"]
        for h in (handles if isinstance(handles, list) else [handles]) if remap else []:
            h[remap] = next(iter(h.values()))
        request = WeightTransferUpdateRequest(update_info=update)
        asyncio.run_coroutine_threadsafe(engine.update_weights(request), loop).result()

    args = ipc_engine.IPCTrainerSendWeightsArgs(send_mode=push, **extra)
    ipc_engine.IPCWeightTransferEngine.trainer_send_weights(iter(state.items()), args)


async def refit(engine, backend: str, state: dict, gpu: int, packed: int, group, remap):  # noqa: ANN001, ANN201
    """One whole update: (seconds, {part: seconds})."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    marks, parts = [time.perf_counter()], {}

    def lap(name: str) -> None:
        marks.append(time.perf_counter())
        parts[name] = marks[-1] - marks[-2]

    await engine.pause_generation(mode="abort", clear_cache=True)
    lap("pause_s")
    await engine.start_weight_update()
    lap("start_s")
    sending = asyncio.to_thread(send, engine, asyncio.get_running_loop(), backend, state, gpu,
                                packed, group, remap)
    if backend == "ipc":
        await sending
    else:  # the engine receives while the trainer broadcasts
        info = {"names": list(state), "shapes": [list(t.shape) for t in state.values()],
                "dtype_names": [str(t.dtype).split(".")[-1] for t in state.values()],
                "packed": bool(packed), **({"packed_buffer_size_bytes": packed} if packed else {})}
        await asyncio.gather(engine.update_weights(WeightTransferUpdateRequest(info)), sending)
    lap("update_s")
    await engine.finish_weight_update()
    lap("finish_s")
    await engine.resume_generation()
    lap("resume_s")
    return marks[-1] - marks[0], parts


async def generates(engine) -> int:  # noqa: ANN001
    """Tokens of a short greedy request (the engine still serves after the refits)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    async for out in engine.generate({"prompt_token_ids": [1, 5, 7]}, params, uuid.uuid4().hex):
        pass
    return len(out.outputs[0].token_ids)


def report(case: dict, results: list, nbytes: int, floor_s: float, out: Path | None) -> None:
    first, rest = results[0][0], results[1:]
    med = median([r[0] for r in rest])
    parts = {k: round(median([r[1][k] for r in rest]), 5) for k in PARTS}
    row = {**case, "bytes": nbytes, "first_refit_s": round(first, 4),
           "refit_s_median": round(med, 5), "refit_s_min": round(min(r[0] for r in rest), 5),
           **parts, "gb_per_s": round(nbytes / med / 1e9, 1), "floor_s": round(floor_s, 5),
           "floor_gb_per_s": round(nbytes / floor_s / 1e9, 1), "x_floor": round(med / floor_s, 2)}
    mode = f"packed {case['packed_mb']} MiB" if case["packed_mb"] else "unpacked"
    print(f"{case['size']:>5} {case['backend']:>4} {case['placement']:>5} {nbytes / 1e9:6.2f} GB"
          f" | refit {med * 1e3:7.1f} ms ({row['gb_per_s']:6.1f} GB/s; first {first * 1e3:7.1f}"
          f" ms) | floor {floor_s * 1e3:6.1f} ms ({row['floor_gb_per_s']:6.1f} GB/s) | "
          f"{row['x_floor']:.2f}x | {mode}{' uuid-remap' if case['uuid_remap'] else ''}: "
          + ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in parts.items()) + " ms", flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


async def run(args: argparse.Namespace) -> None:
    import torch
    import vllm

    for size in args.sizes:
        model_dir = write_model(size, args.work, "cuda:0")
        t0 = time.perf_counter()
        engine = start_engine(model_dir, args.backend)
        print(f"{size}: engine started in {time.perf_counter() - t0:.0f} s", flush=True)
        group = None
        try:
            if args.backend == "ipc":
                await init_transfer(engine, "ipc", 0)
            for placement in args.placements:
                gpu = 0 if placement == "same" else 1
                if gpu >= torch.cuda.device_count() or (args.backend == "nccl" and gpu == 0):
                    print(f"{size} {placement}: skipped (needs a second GPU; NCCL: two)")
                    continue
                if args.backend == "nccl" and group is None:  # once per engine
                    group = await init_transfer(engine, "nccl", gpu)
                remap = (str(torch.cuda.get_device_properties(0).uuid)
                         if args.backend == "ipc" and gpu != 0 else None)
                state = load_state(model_dir, f"cuda:{gpu}")
                sizes = [t.numel() * t.element_size() for t in state.values()]
                floor = copy_floor(sum(sizes), f"cuda:{gpu}", "cuda:0")
                for packed_mb in args.packed_mb:
                    packed = packed_mb << 20
                    if args.backend == "ipc" and 0 < packed < max(sizes):  # a chunk holds a tensor
                        packed = -(-max(sizes) >> 20) << 20
                    results = [await refit(engine, args.backend, state, gpu, packed, group, remap)
                               for _ in range(args.repeats + 1)]
                    case = {"size": size, "trainer": "1gpu", "placement": placement,
                            "backend": args.backend, "packed_mb": packed >> 20,
                            "uuid_remap": remap is not None, "tensors": len(state),
                            "vllm": vllm.__version__}
                    report(case, results, sum(sizes), floor, args.out)
                print(f"{size} {placement}: engine generates ({await generates(engine)} tokens)")
                state = {}
                torch.cuda.empty_cache()
        finally:
            group = None
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5b,7b", type=lambda s: s.split(","),
                        help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--placements", default="same,other", type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncrl-refit-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--backend", choices=["ipc", "nccl"], default="ipc")
    parser.add_argument("--packed-mb", default="0", type=lambda s: [int(x) for x in s.split(",")],
                        help="0: unpacked; else packed, buffers of that many MiB (IPC: at least "
                             "the largest tensor); comma-separated: each is a case")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # IPC handles travel as pickles
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is in use here
    if importlib.util.find_spec("ray") is None:  # 0.26's ipc_engine imports ray, never uses it
        stub = args.work / "ray-stub"
        (stub / "ray").mkdir(parents=True, exist_ok=True)
        (stub / "ray" / "__init__.py").write_text('"""Stub: vLLM 0.26 ipc_engine imports ray."""\n')
        sys.path.insert(0, str(stub))  # and the engine's processes, through PYTHONPATH
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub),
                                                                 os.environ.get("PYTHONPATH")]))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
