"""The memory plan's trainer estimate beside the peaks ``benchmarks/trainer.py`` measured
(``benchmarks/gpu/run_memory.sh`` writes them): for each row, the plan of the same run (the
shape, ``[lora]``, bf16 compute, the micro-batch of ``micro_batch_size x seq_len`` tokens,
activation checkpointing or not) as ``asyncrl check-config`` computes it, and its error.

No GPU and no weights: each shape is a model directory of a ``config.json`` and a
safetensors header saying its parameter count (counted here by hand from the shape).
``--count`` instead counts, on the CPU, what one decoder layer keeps for its backward per
token (the storages autograd saves in a bf16 forward, the weights left out; two layers less
one, on two shapes), in units of hidden- and MLP-wide bf16 tensors: the figures
``asyncrl_torch.memory.LAYER_HIDDEN`` and ``LAYER_MLP`` come from.

    python benchmarks/memory_fit.py benchmarks/results/trainer-memory-h100.jsonl
    python benchmarks/memory_fit.py --count
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer import SHAPES  # noqa: E402


def parameters(shape: str) -> int:
    """Qwen2.5's parameters by hand: embeddings (and an untied head), per layer q/k/v with
    their biases, o, the MLP's three projections and two norms, and the final norm."""
    h, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    d = h // heads
    attention = h * h + 2 * h * kv * d + (h + 2 * kv * d) + h * h
    layer = attention + 3 * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + layers * layer + h


def model_dir(root: Path, shape: str) -> Path:
    h, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    d = root / shape
    if d.exists():
        return d
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": vocab, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    p = parameters(shape)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [p], "data_offsets": [0, 2 * p]}})
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    from tokenizers import Tokenizer, models  # the config asks for one

    Tokenizer(models.WordLevel({"t0": 0}, unk_token="t0")).save(str(d / "tokenizer.json"))
    return d


def plan_gib(row: dict, root: Path) -> tuple[float, float]:
    """The plan's figure for one trainer rank of ``row``'s run, and its activations, in GiB."""
    import dataclasses

    from asyncrl.config import from_dict
    from asyncrl.procs.gpu_memory import ModelShape
    from asyncrl_torch.memory import trainer_need

    path = model_dir(root, row["shape"])
    config = from_dict({
        "model": {"path": str(path), "dtype": "bfloat16"},
        "environment": {"name": "arithmetic"},
        "lora": {"rank": row["lora"]},
        "trainer": {"backend": "fsdp2", "micro_batch_size": row["micro_batch_size"]},
    })  # fmt: skip
    shape = dataclasses.replace(ModelShape.of(str(path)), longest_sequence=row["seq_len"])
    need = trainer_need(config, shape, None, backend="fsdp2", bf16=True,
                        checkpointing=bool(row.get("checkpointing")))  # fmt: skip
    return need.total / 2**30, need.transient / 2**30


def saved_per_token(shape: str, layers: int, tokens: int = 256, *, checkpointing: bool = False,
                    lora: str = "") -> float:  # fmt: skip
    """Bytes autograd keeps per token for a bf16 forward and the logprobs of ``layers``
    layers of ``shape`` (the vocabulary cut to 1,000: its share is the same in every count);
    ``lora``: a rank-32 adapter on every projection, computing in ``"float32"`` (the trainer's
    without mixed precision) or ``"bf16"``."""
    import torch
    import transformers

    h, inter, _, heads, kv, _, _ = SHAPES[shape]
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=1000, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).train()
    if lora:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=32, target_modules=targets))
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(torch.float32 if lora == "float32" else torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 1000, (1, tokens))
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
        torch.log_softmax(logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in weights) / tokens


def count() -> None:
    import numpy as np

    shapes = ("0.5b", "1.5b")
    widths = np.array([[2 * SHAPES[s][0], 2 * SHAPES[s][1]] for s in shapes])

    def layer(shape: str, **kwargs: object) -> float:
        return saved_per_token(shape, 2, **kwargs) - saved_per_token(shape, 1, **kwargs)

    full = np.array([layer(s) for s in shapes])
    for s, b in zip(shapes, full, strict=True):
        print(f"{s}: {b:,.0f} bytes a token a layer")
    hidden, mlp = np.linalg.solve(widths, full)
    print(f"a layer keeps {hidden:.2f} hidden-wide and {mlp:.2f} MLP-wide bf16 tensors a token")
    kept = layer("0.5b", checkpointing=True)
    print(f"with checkpointing: {kept / (2 * SHAPES['0.5b'][0]):.2f} hidden-wide tensors a layer")
    extra = np.array([layer(s, lora="float32") for s in shapes]) - full
    hidden, mlp = np.linalg.solve(widths, extra)
    print(f"a float32 adapter adds {hidden:.2f} hidden-wide and {mlp:.2f} MLP-wide units")
    print(f"a bf16 adapter keeps {layer('0.5b', lora='bf16') / full[0]:.2f} of the layer's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rows", type=Path, nargs="*")
    parser.add_argument("--count", action="store_true", help="count a layer's saved tensors")
    args = parser.parse_args()
    if args.count:
        count()
        return
    root = Path(tempfile.mkdtemp(prefix="asyncrl-memory-fit-"))
    worst = 0.0
    print(f"{'shape':>5} {'lora':>4} {'ckpt':>4} {'tokens':>6} | {'measured':>8} {'plan':>6} "
          f"{'error':>6} | activations planned")  # fmt: skip
    for path in args.rows:
        for line in path.read_text().splitlines():
            row = {"shape": "0.5b", "lora": 0, **json.loads(line)}  # older rows: the default
            if row.get("gpus", 1) != 1 or not row.get("peak_gib") or row["case"] != "fsdp2":
                continue
            plan, activations = plan_gib(row, root)
            error = plan / row["peak_gib"] - 1
            worst = max(worst, abs(error))
            tokens = row["micro_batch_size"] * row["seq_len"]
            ckpt = "yes" if row.get("checkpointing") else "no"
            print(f"{row['shape']:>5} {row['lora']:>4} {ckpt:>4} {tokens:>6} | "
                  f"{row['peak_gib']:>8.2f} {plan:>6.2f} {error:>+6.1%} | "
                  f"{activations:.2f} GiB", flush=True)  # fmt: skip
    print(f"largest error: {worst:.1%}")


if __name__ == "__main__":
    main()
