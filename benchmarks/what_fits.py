"""What the memory plan says trains on one GPU: Qwen2.5's shapes by context length, full
weights and ``[lora]``, resident beside the engine and taking turns with it. These are the
plan's verdicts (``asyncrl check-config``'s, on model directories of each shape's size), not
measurements; ``benchmarks/memory_fit.py`` sets the plan beside measured peaks.

Each case is the plan of a run on one GPU of ``--gpu-gib``:

- the trainer: FSDP2, bf16 compute, AdamW; ``[lora]`` rank 32 on every projection of a bf16
  base; activation checkpointing on; one sequence of the context a micro-batch
  (``trainer.max_tokens_per_micro_batch`` = the context);
- the engine: the smallest share of the GPU (``gpu_memory_utilization``, in hundredths) that
  holds its weights and the KV cache of ``--sequences`` sequences of the context;
- resident: both at once; taking turns: the engines' turn (the trainer's weights beside the
  engine, its optimizer state in host memory where ``auto`` decides so) and the trainer's.

    python benchmarks/what_fits.py --gpu-gib 80
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_fit import model_dir, parameters  # noqa: E402
from trainer import SHAPES  # noqa: E402

GiB = 1 << 30


def kv_bytes(shape: str, tokens: int) -> int:
    """The bf16 KV cache of ``tokens`` tokens: keys and values of every layer's KV heads."""
    h, _, layers, heads, kv, _, _ = SHAPES[shape]
    return 2 * layers * kv * (h // heads) * 2 * tokens


def verdict(shape: str, context: int, lora: bool, turns: bool, args: argparse.Namespace,
            root: Path) -> str:  # fmt: skip
    from asyncrl.config import from_dict
    from asyncrl.run.preflight import memory_plan

    path = model_dir(root, shape)
    engine = 2 * parameters(shape) + kv_bytes(shape, args.sequences * context)
    util = math.ceil(100 * (engine + GiB) / (args.gpu_gib * GiB)) / 100  # + vLLM's buffers
    if util >= 0.95:
        return "no (engine)"
    config = from_dict({
        "model": {"path": str(path), "dtype": "bfloat16"},
        "environment": {"name": "arithmetic"},
        "lora": {"rank": 32 if lora else 0},
        "cluster": {"placement": "take_turns" if turns else "resident"},
        "trainer": {"backend": "fsdp2", "max_tokens_per_micro_batch": context,
                    "options": {"mixed_precision": "bf16", "activation_checkpointing": True}},
        "generator": {"backend": "vllm", "options": {"gpu_memory_utilization": util}},
    })  # fmt: skip
    plan = memory_plan(config, [int(args.gpu_gib * GiB)], longest_sequence=context)
    if plan.problems():
        return "no"
    return f"{plan.need(0) / GiB:.0f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--sequences", type=int, default=16,
                        help="sequences of the context the engine's KV cache holds at once")
    parser.add_argument("--shapes", default="0.5b,1.5b,3b,7b,14b,32b")
    parser.add_argument("--contexts", default="2048,8192,32768")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="asyncrl-what-fits-"))
    columns = [("full", False, False), ("full", False, True), ("lora", True, False),
               ("lora", True, True)]  # fmt: skip
    print(f"| model | context | full, resident | full, taking turns | LoRA, resident "
          f"| LoRA, taking turns |\n|---|---|---|---|---|---|")  # fmt: skip
    for shape in args.shapes.split(","):
        for context in map(int, args.contexts.split(",")):
            cells = [verdict(shape, context, lora, turns, args, root)
                     for _, lora, turns in columns]  # fmt: skip
            print(f"| {shape.upper()} | {context:,} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
