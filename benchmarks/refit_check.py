"""Refit verification on evidence: how far the generators and the trainer disagree when they
hold the same weights, how far after real steps, and whether a generator left on the previous
version's weights would be caught.

    .venv/bin/python benchmarks/refit_check.py                  # CPU: the demo model and a
                                                                # Llama-shaped one, bf16 and
                                                                # float32 (~10 min on 2 cores)
    .venv/bin/python benchmarks/refit_check.py --sizes 0.5b,1.5b,7b-4l --dtypes bfloat16 \\
        --steps 30 --machine h100                                # one GPU

Each run is the real controller with a vLLM rank and an FSDP2 rank (on one GPU where there is
one), every refit verified (``refit.verify_every_steps = 1``), twice: at ``--lr`` (real
steps) and at a learning rate of 1e-12 (the weights never move: every refit is one of equal weights,
whatever the gradient). Models: ``demo`` is the CPU demo's warm-started tiny Qwen2 on its
arithmetic task; ``demo-llama`` a Llama-3-shaped model of the same size (random weights);
``0.5b``, ``1.5b`` the Qwen2.5 shapes and ``7b-4l`` Qwen2.5-7B's width with 4 of its 28 layers
(random weights, ``random_workload.py``'s word-level tokenizer and ``dataset`` task).

For each run: the baseline (the disagreement before the first update), each judged refit's
mean |generator - trainer| against its bound (``ratio``: the largest; above 1 is a stop, a
false alarm on equal weights or on a correct refit), and how many of the refits would have
caught a generator stuck on the previous version (``stale caught``): by the triangle inequality
its disagreement is at least ``moved_abs`` (how far the trainer's logprobs moved) less the
previous refit's own, so where that exceeds the bound it is certainly caught.

Results are printed as markdown and written where ``results_file.py`` says (``--machine``:
``benchmarks/results/refit-check-<machine>.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

import asyncrl
from asyncrl.config import from_dict

sys.path.insert(0, str(Path(__file__).parent))
from random_workload import (  # noqa: E402
    SHAPES,
    cuda,
    engine_options,
    make_prompts,
    run_sections,
    write_dataset,
    write_model,
)
from results_file import write_results  # noqa: E402

EQUAL_LR = 1e-12
"""The runs of equal weights: the trainer refuses a learning rate of 0, and AdamW's steps of
1e-12 change no float32 weight of these models (their ulp is >= 1e-9)."""

SHAPES.setdefault("1.5b", (1536, 28, 12, 2, 8960, 151936, True))
SHAPES.setdefault("7b-4l", (3584, 4, 28, 4, 18944, 152064, False))
SHAPES.setdefault("tiny-untied", (128, 2, 4, 2, 256, 512, False))


def demo_model(out: Path, llama: bool) -> Path:
    """The CPU demo's model (warm-started, shipped weights), or a random Llama-shaped one of
    the same size and tokenizer."""
    if not llama:
        import subprocess

        subprocess.run([sys.executable, "-m", "asyncrl_arith.make_model", str(out)],
                       check=True, capture_output=True)  # fmt: skip
        return out
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers
    from asyncrl_arith.model import BOS_ID, EOS_ID, PAD_ID, TINY, VOCAB, build_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB), bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=500000.0, **TINY,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def run_config(size: str, dtype: str, lr: float, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"{size}-{dtype}-{lr:g}"
    if size.startswith("demo"):
        model = demo_model(work / f"model-{size}", llama=size == "demo-llama")
        sections: dict[str, Any] = {
            "model": {"path": str(model)},
            "cluster": {"trainer_ranks": 1, "rollout_ranks": 1}
            | ({"trainer_gpus": [0], "rollout_gpus": [0]} if cuda() else {}),
            "environment": {"name": "arithmetic"},
            "eval": {"num_prompts": 0},
        }
        tokens = 8
    else:
        model = write_model(size, work / f"model-{size}")
        data, rewards = write_dataset(make_prompts(256, 32, SHAPES[size][5]), work)
        sections = run_sections(model, data, rewards)
        tokens = args.max_tokens
    sections["model"]["dtype"] = dtype
    # probes of asyncrl.policy.verify.PROBE_SEQUENCES (16) sequences
    sections["refit"] = {**sections.get("refit", {}), "verify_every_steps": 1}
    return {
        **sections,
        "run": {"output_dir": str(out), "num_steps": args.steps, "seed": 0},
        "checkpoint": {"at_end": False},
        "grpo": {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": tokens},
        "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 1}},
        "trainer": {"backend": "fsdp2", "micro_batch_size": args.micro_batch,
                    "options": {"lr": lr}},
        "generator": {"backend": "vllm",
                      "options": {**engine_options(args.gpu_memory_utilization),
                                  "max_model_len": 256 if size.startswith("demo") else 1024}},
    }  # fmt: skip


async def one_run(data: dict) -> dict[str, Any]:
    config = from_dict(data)
    alarm = None
    try:
        async with asyncrl.Controller(config) as ctl:
            await ctl.train()
    except asyncrl.RefitError as exc:
        alarm = str(exc)
    lines = (Path(config.run.output_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.endswith("}")]
    shutil.rmtree(config.run.output_dir, ignore_errors=True)  # 7B-shaped: GBs of logs and state
    baseline = [r for r in records if r["kind"] == "refit_baseline"]
    judged = [r for r in records if r["kind"] == "refit_verify"]
    steps = [r for r in records if r["kind"] == "train"]
    by_version = {r["version"]: r for r in judged}
    stale_caught = [
        r["moved_abs"] - by_version.get(r["previous"], {"mean_abs": baseline[0]["mean_abs"]})[
            "mean_abs"] > r["bound"]
        for r in judged if "moved_abs" in r
    ]  # fmt: skip
    return {
        "baseline": max((r["mean_abs"] for r in baseline), default=None),
        "baseline_max_abs": max((r["max_abs"] for r in baseline), default=None),
        "judged": [{k: r.get(k) for k in ("version", "mean_abs", "max_abs", "bound",
                                          "previous_abs", "moved_abs")} for r in judged],
        "ratio_max": max((r["mean_abs"] / r["bound"] for r in judged), default=None),
        "moved_abs_median": sorted(r.get("moved_abs", 0.0) for r in judged)[len(judged) // 2]
        if judged else None,
        "stale_caught": f"{sum(stale_caught)}/{len(stale_caught)}",
        "grad_norm_median": sorted(r["grad_norm"] for r in steps)[len(steps) // 2]
        if steps else None,
        "false_alarm": alarm,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,demo-llama")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="the real steps' learning rate (the demo's: 1e-4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="random models' samples")
    parser.add_argument("--micro-batch", type=int, default=64,
                        help="sequences per trainer micro-batch (8 for the 1.5B shapes on 80 GB)")
    parser.add_argument("--lrs", default="equal,real",
                        help="which runs: equal (lr 1e-12), real (--lr), or both")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--machine", default="")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="refit-check-"))
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    print("| model | dtype | lr | baseline | judged mean (min-max) | bound | ratio max | "
          "moved (median) | stale caught | false alarm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        for dtype in args.dtypes.split(","):
            chosen = args.lrs.split(",")
            for lr in [v for k, v in (("equal", EQUAL_LR), ("real", args.lr)) if k in chosen]:
                run = anyio.run(one_run, run_config(size, dtype, lr, args, work))
                run.update(model=size, dtype=dtype, lr=lr)
                results["runs"].append(run)
                means = [j["mean_abs"] for j in run["judged"]]
                span = f"{min(means):.2g}-{max(means):.2g}" if means else "-"
                bound = run["judged"][0]["bound"] if run["judged"] else float("nan")
                base = float("nan") if run["baseline"] is None else run["baseline"]
                alarm = "none" if run["false_alarm"] is None else (
                    f"**{run['false_alarm'][:60]}...**")  # fmt: skip
                print(f"| {size} | {dtype} | {lr:g} | {base:.2g} | {span} | "
                      f"{bound:.2g} | {run['ratio_max'] or 0:.2f} | "
                      f"{run['moved_abs_median'] or 0:.2g} | {run['stale_caught']} | {alarm} |",
                      flush=True)  # fmt: skip
    write_results(results, "refit-check", args.out, args.machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
