"""Train-step throughput of each training backend through asyncrl against its bare loop.

For every case, ``torchrun --nproc-per-node N`` runs one of:

- ``asyncrl``: the backend as a trainer worker drives it (its entry point, a
  :class:`~asyncrl.backend.WorkerContext`, ``begin_step -> train_chunk -> finish_step`` on a
  packed :class:`~asyncrl.wire.messages.TrainBatch`): lockstep micro-batches, the PPO loss as
  a token sum, the step ledger, exact normalization at the end of the step;
- ``bare``: the same engine written as a plain loop on the same model and batch: FSDP2
  ``fully_shard`` per decoder layer + root (bf16 compute, float32 reduction), or
  ``deepspeed.initialize`` with the same ZeRO stage; per micro-batch a forward, the next-token
  logprobs of the response positions in float32, ``-(A * logprob).sum() / tokens``, backward;
  then clipping and AdamW.

Both use the same model (a Qwen2.5 architecture, ``--shape``, 0.5B by default; random
weights, built once under ``--model``), the same batch (``--seqs`` sequences of ``--seq-len``
tokens per GPU, prompt ``--prompt-len``), micro-batch size, bf16 compute with float32 master
weights, sdpa attention and ``torch.optim.AdamW``; ``--lora R`` trains a rank-R adapter in the
asyncrl cases instead. ``--response-mean M`` gives the asyncrl cases long-tailed lengths
instead (responses log-normal with mean M and sigma 1, cut at ``--seq-len``, like RL samples),
and ``--plans`` how they are cut into micro-batches: ``seqs`` (``--micro-batch-size``
sequences, padded), ``budget:N`` (sorted by length, ``count x longest <= N``) or ``pack:N``
(end to end in rows of at most N tokens: ``trainer.pack_sequences``). A step's time is taken
between CUDA synchronizations on rank 0; tokens/s counts every token of every rank. Prints a
table and appends JSON lines to ``--out``.

    python benchmarks/trainer.py --gpus 1 --cases fsdp2,fsdp2-bare,ds2,ds2-bare,ds3,ds3-bare
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    # name: (engine, zero stage, asyncrl?)
    "fsdp2": ("fsdp2", 0, True),
    "fsdp2-bare": ("fsdp2", 0, False),
    "ds2": ("deepspeed", 2, True),
    "ds2-bare": ("deepspeed", 2, False),
    "ds3": ("deepspeed", 3, True),
    "ds3-bare": ("deepspeed", 3, False),
}
LR = 1e-5


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


SHAPES = {
    # Qwen2.5's published shapes: hidden, intermediate, layers, heads, kv heads, vocab, tied
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (2048, 11008, 36, 16, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "14b": (5120, 13824, 48, 40, 8, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def build_model(path: Path, shape: str, layers: int | None) -> None:
    """A Qwen2.5 architecture of ``shape`` (``layers``: fewer decoder layers) with random
    weights (no download), made on the GPU where there is one (a 7B model's CPU init takes
    minutes)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hidden, inter, depth, heads, kv, vocab, tied = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers or depth, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=tied,
        torch_dtype="bfloat16",
    )  # fmt: skip
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")).save(str(path / "tokenizer.json"))


# --------------------------------------------------------------------------- one rank
def make_batch(args: argparse.Namespace, rank: int):
    import numpy as np

    from asyncrl.wire.messages import TrainBatch

    rng = np.random.default_rng(rank)
    n, length, prompt = args.seqs, args.seq_len, args.prompt_len
    seq_lens = np.full(n, length, np.int32)
    if args.response_mean > 0:  # log-normal, sigma 1: mean = exp(mu + 1/2)
        drawn = rng.lognormal(np.log(args.response_mean) - 0.5, 1.0, size=n)
        seq_lens = prompt + np.clip(np.rint(drawn), 1, length - prompt).astype(np.int32)
    tokens = rng.integers(0, 151936, size=int(seq_lens.sum())).astype(np.int32)  # < every vocab
    response = int((seq_lens - prompt).sum())
    return TrainBatch(
        tokens=tokens,
        seq_lens=seq_lens,
        prompt_lens=np.full(n, prompt, np.int32),
        behaviour_logprobs=rng.normal(-2.0, 0.5, size=response).astype(np.float32),
        advantages=rng.normal(size=n).astype(np.float32),
        loss_mask=np.ones(response, np.uint8),
    )


def all_ranks_tokens(args: argparse.Namespace, world: int, *, responses: bool) -> int:
    """Tokens (or response tokens) of every rank's batch: with ``--response-mean`` each rank
    draws its own lengths."""
    batches = [make_batch(args, r) for r in range(world)]
    return sum(int((b.seq_lens - (b.prompt_lens if responses else 0)).sum()) for b in batches)


def asyncrl_steps(args: argparse.Namespace, engine: str, stage: int) -> list[float]:
    from asyncrl.backend import WorkerContext
    from asyncrl.config import from_dict
    from asyncrl.registry import load

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = {"lr": LR, "mixed_precision": "bf16", "attn_implementation": "sdpa",
               "num_threads": 0}  # fmt: skip
    if engine == "deepspeed":
        options["zero_stage"] = stage
    if args.checkpointing:
        options["activation_checkpointing"] = True
    kind, _, budget = args.plan.partition(":")
    config = from_dict({
        "model": {"path": args.model, "dtype": "bfloat16"},
        "environment": {"name": "benchmark"},
        "lora": {"rank": args.lora},
        "trainer": {"backend": engine, "micro_batch_size": args.micro_batch_size,
                    "max_tokens_per_micro_batch": int(budget or 0),
                    "pack_sequences": kind == "pack", "options": options},
    })  # fmt: skip
    ctx = WorkerContext(group="trainer", rank=rank, world_size=world,
                        local_rank=int(os.environ["LOCAL_RANK"]), config=config,
                        run_dir=tempfile.mkdtemp())  # fmt: skip
    backend = load("asyncrl.training_backends", engine)(ctx)
    backend.start()
    batch = make_batch(args, rank)
    total = all_ranks_tokens(args, world, responses=True)  # the step's loss tokens
    times = []

    def one(step: int) -> None:
        backend.begin_step(step)
        backend.train_chunk(step, batch)
        backend.finish_step(step, total)

    try:
        for step in range(args.warmup + args.steps):
            _sync()
            t0 = time.perf_counter()
            one(step)
            _sync()
            times.append(time.perf_counter() - t0)
        if args.profile:
            _profile(lambda: one(args.warmup + args.steps))
    finally:
        backend.close()
    return times[args.warmup :]


def _profile(fn) -> None:
    """One more step under torch.profiler; rank 0 prints the top operators by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])  # fmt: skip
    with profile(activities=activities) as prof:
        fn()
        _sync()
    if int(os.environ["RANK"]) == 0:
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)


def bare_steps(args: argparse.Namespace, engine: str, stage: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()  # the CPU path is for trying the script out
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        module = model

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        if not cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": max(1, args.seqs // args.micro_batch_size),
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True}, "steps_per_print": 2**62,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        }  # fmt: skip
        module, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config,
            dist_init_required=False,
        )  # fmt: skip

        def backward(loss: torch.Tensor) -> None:
            module.backward(loss)
            module.step()  # an accumulation step; the boundary one updates

        def step() -> None:
            pass

    batch = make_batch(args, rank)
    ids = torch.as_tensor(batch.tokens, dtype=torch.long, device=device).view(args.seqs, -1)
    adv = torch.as_tensor(batch.advantages, device=device)
    p = args.prompt_len
    tokens = world * args.seqs * (args.seq_len - p)
    times = []
    module.train()

    def one() -> None:
        for start in range(0, args.seqs, args.micro_batch_size):
            mb = ids[start : start + args.micro_batch_size]
            logits = module(input_ids=mb, use_cache=False).logits[:, p - 1 : -1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = logp.gather(-1, mb[:, p:, None]).squeeze(-1)
            a = adv[start : start + args.micro_batch_size, None]
            backward(-(a * picked).sum() / tokens)
        step()

    for _ in range(args.warmup + args.steps):
        _sync()
        t0 = time.perf_counter()
        one()
        _sync()
        times.append(time.perf_counter() - t0)
    if args.profile:
        _profile(one)
    dist.destroy_process_group()
    return times[args.warmup :]


def rank_main(args: argparse.Namespace) -> None:
    import torch

    engine, stage, through_asyncrl = CASES[args.case]
    run = asyncrl_steps if through_asyncrl else bare_steps
    times = run(args, engine, stage)
    if int(os.environ["RANK"]) == 0:
        world = int(os.environ["WORLD_SIZE"])
        tokens = all_ranks_tokens(args, world, responses=False)
        median = statistics.median(times)
        print("RESULT " + json.dumps({
            "case": args.case, "gpus": world, "seqs_per_gpu": args.seqs, "seq_len": args.seq_len,
            "response_mean": args.response_mean, "plan": args.plan,
            "micro_batch_size": args.micro_batch_size, "step_s": [round(t, 4) for t in times],
            "median_s": round(median, 4), "tok_per_s": round(tokens / median),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if torch.cuda.is_available() else None,
            "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)
            if torch.cuda.is_available() else None,
            "shape": args.shape, "layers": args.layers, "lora": args.lora,
            "checkpointing": args.checkpointing,
            "prompt_len": args.prompt_len,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        }), flush=True)  # fmt: skip


# --------------------------------------------------------------------------- orchestration
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--gpus", default="1", help="comma-separated GPU counts")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per GPU per step")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--response-mean", type=float, default=0.0,
                    help="long-tailed response lengths with this mean (asyncrl cases; 0: fixed)")
    ap.add_argument("--plans", default="seqs",
                    help="micro-batching of the asyncrl cases: seqs, budget:N, pack:N (comma list)")
    ap.add_argument("--plan", default="seqs", help=argparse.SUPPRESS)  # set on the ranks
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                    help="the Qwen2.5 architecture of the random model")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="asyncrl cases: trainer.options.activation_checkpointing")
    ap.add_argument("--lora", type=int, default=0,
                    help="train a LoRA adapter of this rank (asyncrl cases; 0: full weights)")
    ap.add_argument("--model", default="", help="where the model is built (default: /tmp/...)")
    ap.add_argument("--out", default="benchmarks/results/trainer.jsonl")
    ap.add_argument("--profile", action="store_true", help="print the top operators of a step")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # set on the ranks
    args = ap.parse_args()
    if args.case:
        rank_main(args)
        return
    args.model = args.model or f"/tmp/asyncrl-bench-qwen2-{args.shape}-{args.layers or 'all'}"
    if not (Path(args.model) / "config.json").exists():
        build_model(Path(args.model), args.shape, args.layers)
    if args.lora and any(not CASES[case][2] for case in args.cases.split(",")):
        raise SystemExit("--lora is for the asyncrl cases only (the bare loops train full weights)")
    rows = []
    runs = [(case, plan) for case in args.cases.split(",")
            for plan in (args.plans.split(",") if CASES[case][2] else ["seqs"])]  # fmt: skip
    if args.response_mean > 0 and any(not CASES[case][2] for case, _ in runs):
        raise SystemExit("--response-mean is for the asyncrl cases only (the bare loops take "
                         "fixed-length sequences)")  # fmt: skip
    for gpus in [int(g) for g in args.gpus.split(",")]:
        for case, plan in runs:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(gpus), __file__, "--case", case, f"--plan={plan}",
                   *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k in ("seqs", "seq_len", "prompt_len", "micro_batch_size", "steps",
                              "warmup", "model", "response_mean", "shape", "layers", "lora")],
                   *(["--profile"] if args.profile else []),
                   *(["--checkpointing"] if args.checkpointing else [])]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not found:
                print(f"{case} on {gpus} GPU(s) failed (rc {proc.returncode}):\n"
                      f"{(proc.stdout + proc.stderr)[-3000:]}", flush=True)  # fmt: skip
                continue
            if args.profile:
                print(f"--- {case}, {gpus} GPU(s)\n" + proc.stdout.split("RESULT ")[0][-6000:])
            for line in (proc.stdout + proc.stderr).splitlines():  # the start-time probe's figure
                if "packing_checked" in line:
                    print(f"{case} {plan}: {line.strip()[-200:]}", flush=True)
            row = json.loads(found[-1].removeprefix("RESULT "))
            rows.append(row)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{case:>11} {plan:>10} {gpus} GPU  {row['median_s']:.3f} s  "
                  f"{row['tok_per_s']:>7} tok/s "
                  f" peak {row['peak_gib']} GiB  steps {row['step_s']}", flush=True)  # fmt: skip
    bare = {(r["case"].removesuffix("-bare"), r["gpus"]): r for r in rows if "bare" in r["case"]}
    for r in rows:
        ref = bare.get((r["case"], r["gpus"]))
        if ref and "bare" not in r["case"]:
            print(f"{r['case']:>11} {r['gpus']} GPU  asyncrl/bare = "
                  f"{r['tok_per_s'] / ref['tok_per_s']:.3f}")


if __name__ == "__main__":
    main()
