"""The fsdp2 trainer's reference policy on a GPU (one rank, NCCL), held on the device and
offloaded to host memory (``trainer.options.reference_offload``: FSDP2's CPUOffloadPolicy,
which a CPU run cannot exercise): its logprobs against a float64 forward of the initial
weights, unchanged by an optimizer step, a k3 term's value against float64, the refresh's
time, and the device memory each placement holds.

    python3 benchmarks/gpu/reference_check.py --out $OUT/reference.json   (after run_trainer.sh's setup)
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from asyncrl.backend import WorkerContext
from asyncrl.config import from_dict
from asyncrl.registry import load
from asyncrl.wire.messages import TokenBatch, TrainBatch


def sequences(vocab: int, n: int, seed: int = 5) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt, response = int(rng.integers(2, 9)), int(rng.integers(4, 17))
        out.append((rng.integers(4, vocab, prompt + response).astype(np.int32), prompt))
    return out


def float64_logprobs(model_dir: str, seqs) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    out = []
    with torch.no_grad():
        for tokens, prompt in seqs:
            logp = torch.log_softmax(model(input_ids=torch.tensor(tokens, dtype=torch.long)[None]).logits[0], -1)
            out += [float(logp[t - 1, tokens[t]]) for t in range(prompt, len(tokens))]
    return np.array(out)


def check(model_dir: str, run_dir: str, offload: bool, seqs, flat: np.ndarray) -> dict:
    config = from_dict({
        "model": {"path": model_dir}, "environment": {"name": "arithmetic"},
        "loss": {"kl_coef": 0.5, "kl_estimator": "k3", "proximal_policy": "current"},
        "trainer": {"micro_batch_size": 8, "options": {"optimizer": "sgd", "lr": 0.5,
                                                       "max_grad_norm": 0.0,
                                                       "reference_offload": offload}},
    })  # fmt: skip
    ctx = WorkerContext(group="trainer", rank=0, world_size=1, local_rank=0, config=config,
                        run_dir=run_dir, extra={"dist_store": torch.distributed.HashStore()})  # fmt: skip
    b = load("asyncrl.training_backends", "fsdp2")(ctx)
    before = torch.cuda.memory_allocated()
    b.start()
    try:
        held = torch.cuda.memory_allocated() - before
        reference_params = sum(p.numel() for p in b._reference.parameters())
        tb = TokenBatch(np.concatenate([t for t, _ in seqs]),
                        np.array([len(t) for t, _ in seqs], np.int32),
                        np.array([p for _, p in seqs], np.int32))  # fmt: skip
        b.reference_logprobs(tb, 1.0)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        ref0 = b.reference_logprobs(tb, 1.0)
        refresh_s = time.perf_counter() - start
        rng = np.random.default_rng(11)
        n = flat.size
        reference = (flat + rng.normal(0, 0.3, n)).astype(np.float32)
        batch = TrainBatch(tb.tokens, tb.seq_lens, tb.prompt_lens, flat.astype(np.float32),
                           rng.normal(size=len(seqs)).astype(np.float32), np.ones(n, np.uint8),
                           proximal_logprobs=flat.astype(np.float32),
                           reference_logprobs=reference)  # fmt: skip
        b.begin_step(0)
        chunk = b.train_chunk(0, batch)
        b.finish_step(0, n)
        kl = math.fsum(math.exp(r - lp) - 1 - (r - lp) for r, lp in zip(reference.astype(np.float64), flat))
        moved = float(np.abs(b.compute_logprobs(tb, 1.0) - flat).max())
        ref1 = b.reference_logprobs(tb, 1.0)
        return {
            "offload": offload, "device_bytes_held_after_start": held,
            "reference_parameters": reference_params,
            "reference_vs_float64_max_abs": float(np.abs(ref0 - flat).max()),
            "reference_after_step_vs_before_max_abs": float(np.abs(ref1 - ref0).max()),
            "policy_moved_max_abs": moved, "kl_sum": chunk.kl_sum, "kl_sum_float64": kl,
            "kl_rel_error": abs(chunk.kl_sum - kl) / kl, "refresh_s": refresh_s,
            "tokens": n,
        }  # fmt: skip
    finally:
        b.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    from asyncrl_arith.model import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(Path(tmp) / "model", seed=0))
        seqs = sequences(transformers.AutoConfig.from_pretrained(model_dir).vocab_size, args.sequences)
        flat = float64_logprobs(model_dir, seqs)
        results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "checks": [check(model_dir, tmp, offload, seqs, flat) for offload in (False, True)]}  # fmt: skip
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
