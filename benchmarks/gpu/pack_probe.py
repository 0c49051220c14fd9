"""Where the trainer's side of a refit spends its time: packing a Qwen2-shaped state into the
``cuda_ipc`` staging buffers, without an engine.

    python benchmarks/gpu/pack_probe.py --size 0.5b       # on a GPU host (torch only)

Prints, per variant, the median time of filling every bucket of one refit (the sender's
``Packer``: the trainer's iterator, the checks against the specs, the staging copies and the
seal, which waits for them), next to one ``copy_`` of the same bytes; then the functions
cProfile finds most expensive in the stable variant.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from refit import model_config  # noqa: E402

from asyncrl.backend import WeightTensor  # noqa: E402
from asyncrl.worker.buckets import Packer, manifest_of  # noqa: E402
from asyncrl.transfers import StagingSpec  # noqa: E402
from asyncrl_torch.transfers.cuda_ipc import CudaIpcStager  # noqa: E402


def state_of(size: str, device: str) -> dict:
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(model_config(size))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return {n: torch.randn(s, device=device, dtype=torch.bfloat16) for n, s in shapes.items()}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = "cuda:0"
    state = state_of(args.size, device)
    specs = [WeightTensor(n, "bfloat16", tuple(t.shape)) for n, t in state.items()]
    manifest = manifest_of(specs)
    stager = CudaIpcStager(StagingSpec("probe", 0, device))
    nbytes = sum(t.numel() * 2 for t in state.values())

    def refit(stable: bool) -> float:
        def stream():
            for n, t in state.items():
                yield WeightTensor(n, "bfloat16", tuple(t.shape), t, stable=stable)

        packer = Packer(stream(), manifest, stager, args.bucket_mb << 20)
        k, last = 0, False
        start = time.perf_counter()
        while not last:
            _, _, last = packer.fill(k)
            k ^= 1
        return time.perf_counter() - start

    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = torch.empty_like(flat)
    floors = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flat.copy_(src)
        torch.cuda.synchronize()
        floors.append(time.perf_counter() - t0)
    del flat, src
    print(f"{args.size}: {len(state)} tensors, {nbytes / 1e9:.2f} GB; one copy_ "
          f"{statistics.median(floors) * 1e3:.2f} ms")
    for stable in (False, True):
        times = [refit(stable) for _ in range(args.repeats + 1)][1:]
        print(f"  stable={stable}: pack {statistics.median(times) * 1e3:.2f} ms "
              f"(min {min(times) * 1e3:.2f}; {statistics.median(times) / len(state) * 1e6:.1f} "
              "µs per tensor)", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        refit(True)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
