"""Every asynchrony mode on one long-tail workload, and the controller's loop under load.

    .venv/bin/python benchmarks/modes.py                 # both parts, ~3 min on 2 cores
    .venv/bin/python benchmarks/modes.py --part modes --steps 16
    .venv/bin/python benchmarks/modes.py --part lag --lag-in-flight 100
    .venv/bin/python benchmarks/modes.py --part vllm     # the tiny CPU task, real engines

**modes**: the real controller and worker processes with the example (bigram) engine, which
really takes the time a sample's length implies: lengths are log-normal (median
``--median`` tokens, sigma 1.0, so the 99th percentile is about 10x the median), every token
costs ``--token-delay`` seconds, the engine runs at most ``--slots`` samples at once, and the
trainer spends ``--seq-delay`` seconds per sequence (by default about the mean time one
sample takes to generate, per step). Each mode runs the same prompts for the same number of
steps; the table gives the wall clock per step (after the first), the speedup over sync, the
trainer's idle fraction, staleness p50/max and wasted samples.

**lag**: two example engines stream two-token samples (5 ms a token) with
``--lag-in-flight`` samples in flight, about 10,000 samples/s by default; the controller's
event-loop lag is sampled every 10 ms over the steady state (after the first two steps:
p50, p99, max, and each step's p99 as the pipeline records it), with the samples
per second that really went through the data socket.

**vllm-long**: real engines (vLLM and an FSDP2 trainer on one GPU, or the vLLM CPU build) on a
long-tail workload: a random model (``--size``, Qwen2.5-0.5B-shaped by default) whose EOS
row makes samples end after about ``--mean-len`` tokens on average with a long tail (some
reach ``--max-tokens``: ``random_workload.eos_for_mean_length``), ``--prompts`` x
``--samples`` per step, scored by the ``dataset`` environment; each of ``LONG_MODES`` (or
those ``--long-modes`` names, sync always first) for ``--steps`` steps: s/step against sync,
trainer idle, staleness, wasted samples, the mean sample length (``response_len_mean``) and the
median step's time of the engine generating, the trainer computing and the refit, as the workers
account for it (``engine_s``, ``trainer_s``, ``refit_s``), of the trainer waiting for groups
(``trainer_wait_s``) and of dispatch waiting for the sampler to admit work (``dispatch_wait_s``).
The trainer computes in bf16 (``--mixed-precision``), micro-batches of ``--micro-batch``
sequences or, with ``--max-tokens-per-micro-batch``, cut by tokens after sorting by length.

**vllm**: the tiny CPU task of the demo (16 prompts x 8 samples, at most 6 new tokens, one
FSDP2 rank and one vLLM rank) in each mode, 16 steps: the median step time against the
workers' own accounts of their time (engine generating, trainer computing, refit), which the
controller receives with every reply.

Results are printed as markdown and written to ``--out`` (default
``runs/benchmarks/modes-<part>.json``, ignored by git).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import asyncrl
import asyncrl.obs.log
from asyncrl.config import from_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # random_workload.py: the random model and its data

MODES: dict[str, dict[str, Any]] = {
    "sync": {"sampler": {"name": "in_order", "max_lookahead_versions": 0}, "chunk": 0},
    "in_order L=1": {"sampler": {"name": "in_order", "max_lookahead_versions": 1}, "chunk": 4},
    "gated W=1": {"sampler": {"name": "gated", "max_staleness_versions": 1}, "chunk": 4},
    "gated W=3": {"sampler": {"name": "gated", "max_staleness_versions": 3}, "chunk": 4},
    "ready_first W=1": {
        "sampler": {"name": "ready_first", "max_staleness_versions": 1},
        "chunk": 4,
    },
    "oversampled W=1 r=1.5": {
        "sampler": {"name": "oversampled", "max_staleness_versions": 1, "over_sampling_ratio": 1.5},
        "chunk": 4,
    },
    "oversampled W=2 r=1.5": {
        "sampler": {"name": "oversampled", "max_staleness_versions": 2, "over_sampling_ratio": 1.5},
        "chunk": 4,
    },
}


def base_config(model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {"path": str(model)},
        "environment": {"name": "repeat-digit"},
        "run": {"num_steps": args.steps, "seed": 0, "output_dir": str(out)},
        "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "shutdown_grace_s": 5.0},
        "grpo": {
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "max_new_tokens": args.max_tokens,
        },
        "refit": {"bucket_size_mb": 1, "verify_every_steps": 0},
        "trainer": {
            "backend": "bigram",
            "options": {"lr": 0.5, "sequence_delay_s": args.seq_delay},
        },
        "generator": {
            "backend": "bigram",
            "options": {
                "length_median": args.median,
                "length_sigma": 1.0,
                "token_delay_s": args.token_delay,
                "max_concurrent_samples": args.slots,
            },
        },
        "eval": {"num_prompts": 0},
    }


async def run_one(data: dict[str, Any]) -> list[dict[str, Any]]:
    config = from_dict(data)
    async with asyncrl.Controller(config) as ctl:
        summary = await ctl.train()
    return summary.steps


def summarize(name: str, steps: list[dict[str, Any]], samples_per_group: int) -> dict[str, Any]:
    ends = [r["time"] for r in steps]
    per_step = (ends[-1] - ends[0]) / (len(ends) - 1)  # the first step includes start-up
    window = ends[-1] - ends[0]
    busy = sum(r["train_busy_s"] for r in steps[1:])
    stale: list[int] = []
    for r in steps:
        for k, v in r["staleness_hist"].items():
            stale += [int(k)] * v
    return {
        "mode": name,
        "s_per_step": per_step,
        "trainer_idle": max(0.0, 1 - busy / window),
        "staleness_p50": int(np.median(stale)),
        "staleness_max": max(stale),
        "wasted_samples": sum(r["wasted_samples"] for r in steps),
        "wasted_fraction": sum(r["wasted_samples"] for r in steps)
        / max(1, sum(r["wasted_samples"] + r["groups"] * samples_per_group for r in steps)),
        "aborted_samples": sum(r["aborted_samples"] for r in steps),
        "reward_last": steps[-1]["reward"],
    }


async def part_modes(args: argparse.Namespace, model: Path, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for name, mode in MODES.items():
        data = base_config(model, tmp / name.replace(" ", "_"), args)
        data["pipeline"] = {
            "sampler": mode["sampler"],
            "min_groups_for_streaming_train": mode["chunk"],
        }
        start = time.perf_counter()
        steps = await run_one(data)
        row = summarize(name, steps, args.samples)
        row["run_s"] = time.perf_counter() - start
        rows.append(row)
        print(f"  {name}: {row['s_per_step']:.3f} s/step", flush=True)
    return with_speedups(rows)


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (sync first), each given its ``speedup`` over sync."""
    sync = rows[0]["s_per_step"]
    for row in rows:
        row["speedup"] = sync / row["s_per_step"]
    return rows


async def part_lag(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    P, N = 64, 16
    data = base_config(model, tmp / "lag", args)
    # two-token samples at 5 ms a token, `in_flight` at a time over two engines: about
    # in_flight / 10 ms samples per second arrive at the controller
    data["grpo"] = {"prompts_per_step": P, "samples_per_prompt": N, "max_new_tokens": 2}
    data["cluster"]["rollout_ranks"] = args.lag_ranks
    data["run"]["num_steps"] = args.lag_steps
    data["generator"]["options"] = {"token_delay_s": 0.005}
    data["trainer"]["options"] = {"lr": 0.5}
    data["pipeline"] = {
        "sampler": {"name": "oversampled", "max_staleness_versions": 2, "over_sampling_ratio": 2.0},
        "min_groups_for_streaming_train": 16,
        "max_inflight_samples": args.lag_in_flight,
    }
    # the benchmark samples the loop itself, as the pipeline does, to pool every sample of
    # the steady state (the pipeline's records keep only each step's p99 and max)
    lags: list[tuple[float, float]] = []

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await anyio.sleep(0.01)
            lags.append((time.perf_counter(), time.perf_counter() - t - 0.01))

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        config = from_dict(data)
        async with asyncrl.Controller(config) as ctl:
            t0 = ctl.status().clock_origin
            steps = (await ctl.train()).steps
        tg.cancel_scope.cancel()
    window = steps[-1]["time"] - steps[1]["time"]
    # samples that came through the data socket after the first two steps: trained or wasted
    samples = sum(r["groups"] * N + r["wasted_samples"] for r in steps[2:])
    steady = [lag for at, lag in lags if t0 + steps[1]["time"] <= at <= t0 + steps[-1]["time"]]
    step_p99 = [r["loop_lag_p99_s"] for r in steps[2:]]
    return {
        "samples_per_s": samples / window,
        "loop_lag_p99_ms": 1e3 * float(np.quantile(steady, 0.99)),
        "loop_lag_p50_ms": 1e3 * float(np.quantile(steady, 0.5)),
        "loop_lag_p99_median_step_ms": 1e3 * statistics.median(step_p99),
        "loop_lag_p99_worst_step_ms": 1e3 * max(step_p99),
        "loop_lag_max_ms": 1e3 * max(steady),
        "lag_samples": len(steady),
        "rollout_ranks": args.lag_ranks,
        "in_flight": args.lag_in_flight,
        "steps": len(steps),
    }


VLLM_MODES: dict[str, dict[str, Any]] = {
    "sync": {
        "sampler": {"name": "in_order", "max_lookahead_versions": 0},
        "chunk": 16,
        "threads": 2,
    },
    "sync, 1 trainer thread": {
        "sampler": {"name": "in_order", "max_lookahead_versions": 0},
        "chunk": 16,
        "threads": 1,
    },
    "in_order L=1": {
        "sampler": {"name": "in_order", "max_lookahead_versions": 1},
        "chunk": 16,
        "threads": 1,
    },
    "in_order L=1, chunks of 8": {
        "sampler": {"name": "in_order", "max_lookahead_versions": 1},
        "chunk": 8,
        "threads": 1,
    },
    "gated W=1": {
        "sampler": {"name": "gated", "max_staleness_versions": 1},
        "chunk": 16,
        "threads": 1,
    },
    "oversampled W=1 r=1.5": {
        "sampler": {"name": "oversampled", "max_staleness_versions": 1, "over_sampling_ratio": 1.5},
        "chunk": 16,
        "threads": 1,
    },
}


async def part_vllm(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The tiny CPU task (16 prompts x 8 samples, <= 6 new tokens, one FSDP2 rank, one vLLM
    rank) in each mode; the step time against the workers' own accounts of their time."""
    from asyncrl.config import load_config

    model = ROOT / "runs" / "tiny-arith" / "model"
    if not (model / "config.json").exists():
        import subprocess
        import sys

        subprocess.run([sys.executable, "-m", "asyncrl_arith.make_model", str(model)], check=True)
    rows = []
    for name, mode in VLLM_MODES.items():
        config = load_config(
            ROOT / "examples" / "tiny_arith.toml",
            {
                "run.num_steps": args.vllm_steps,
                "run.output_dir": str(tmp / name.replace(" ", "_").replace(",", "")),
                "eval.num_prompts": 0,
                "grpo.max_new_tokens": 6,
                "refit.verify_every_steps": 0,
                "pipeline.sampler": mode["sampler"],
                "pipeline.min_groups_for_streaming_train": mode["chunk"],
                "trainer.options": {"lr": 1e-4, "num_threads": mode["threads"]},
            },
        )
        async with asyncrl.Controller(config) as ctl:
            steps = (await ctl.train()).steps
        steady = steps[3:]  # the first steps warm up (kernel choice, allocator)
        gaps = [b["time"] - a["time"] for a, b in zip(steady, steady[1:])]
        med = lambda key: statistics.median(r[key] for r in steady[1:])  # noqa: E731
        own = med("engine_busy_s") + med("trainer_compute_s") + med("refit_work_s")
        row = {
            "mode": name,
            "s_per_step": statistics.median(gaps),
            "engine_s": med("engine_busy_s"),
            "trainer_s": med("trainer_compute_s"),
            "refit_s": med("refit_work_s"),
            "own_s": own,
            "staleness_max": max(r["staleness_max"] for r in steps),
            "reward_last": steps[-1]["reward"],
        }
        row["step_over_own"] = row["s_per_step"] / own
        rows.append(row)
        print(
            f"  {name}: {row['s_per_step']:.3f} s/step (engine {row['engine_s']:.3f}, "
            f"trainer {row['trainer_s']:.3f}, refit {row['refit_s']:.3f})",
            flush=True,
        )
    return rows


LONG_PROMPT_LEN = 64  # tokens in each vllm-long prompt

LONG_MODES = {name: MODES[name] for name in (
    "sync", "in_order L=1", "gated W=3", "oversampled W=2 r=1.5")}  # fmt: skip


def _long_modes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LONG_MODES]
    if unknown or "sync" not in names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: name modes of {list(LONG_MODES)}, sync among them (the speedups' base)"
        )
    return ["sync"] + [n for n in names if n != "sync"]


async def part_vllm_long(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Each of :data:`LONG_MODES` with vLLM and FSDP2 on the long-tail workload."""
    import random_workload as work

    gpu = work.cuda()
    model = work.write_model(args.size, tmp / "long-model", mean_len=args.mean_len,
                             max_len=args.max_tokens, prompt_len=LONG_PROMPT_LEN)  # fmt: skip
    prompts = work.make_prompts(
        max(256, 4 * args.prompts), LONG_PROMPT_LEN, work.SHAPES[args.size][5]
    )
    data, rewards = work.write_dataset(prompts, tmp)
    engine = work.engine_options(args.gpu_memory_utilization)
    rows = []
    for name in args.long_modes:
        mode = LONG_MODES[name]
        data_cfg = work.run_sections(model, data, rewards) | {
            "run": {"num_steps": args.steps, "seed": 0, "log_format": "json",
                    "output_dir": str(tmp / name.replace(" ", "_"))},  # fmt: skip
            "grpo": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                     "max_new_tokens": args.max_tokens, "temperature": 1.0},  # fmt: skip
            "pipeline": {"sampler": mode["sampler"],
                         "min_groups_for_streaming_train": max(1, args.prompts // 4)},  # fmt: skip
            "trainer": {"backend": "fsdp2", "micro_batch_size": args.micro_batch,
                        "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
                        "pack_sequences": args.pack_sequences,
                        "options": {"lr": 1e-6,
                                    "mixed_precision": args.mixed_precision}},  # fmt: skip
            "generator": {"backend": "vllm", "options": engine},
        }
        start = time.perf_counter()
        steps = await run_one(data_cfg)
        row = summarize(name, steps, args.samples)
        row["run_s"] = time.perf_counter() - start
        row["response_len_mean"] = statistics.mean(r["response_len"] for r in steps)
        for key, name_s in (("engine_busy_s", "engine_s"), ("trainer_compute_s", "trainer_s"),
                            ("refit_work_s", "refit_s"), ("wait_s", "trainer_wait_s"),
                            ("gate_wait_s", "dispatch_wait_s")):  # fmt: skip
            # the workers' own accounts; the trainer waiting for groups; dispatch waiting for
            # the sampler's gate to open (a refit)
            row[name_s] = statistics.median(r[key] for r in steps[1:])
        rows.append(row)
        print(f"  {name}: {row['s_per_step']:.2f} s/step (engine {row['engine_s']:.2f}, trainer "
              f"{row['trainer_s']:.2f}, refit {row['refit_s']:.2f}), {row['run_s']:.0f} s in all "
              f"(start and stop included)", flush=True)  # fmt: skip
        result = {"rows": with_speedups(rows), "gpu": gpu, "size": args.size, "workload": {
            "prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens,
            "mean_len": args.mean_len, "prompt_len": LONG_PROMPT_LEN, "steps": args.steps,
            "micro_batch": args.micro_batch,
            "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
            "pack_sequences": args.pack_sequences, "mixed_precision": args.mixed_precision,
        }, "partial": len(rows) < len(args.long_modes)}  # fmt: skip
        if args.out is not None:  # each mode's row kept as it ends: a cut run still tells
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"vllm-long": result}, indent=2))
    return result


def vllm_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | s/step | engine generating | trainer computing | refit (workers) | "
        "step / (engine + trainer + refit) | staleness max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['s_per_step']:.3f} | {r['engine_s']:.3f} | {r['trainer_s']:.3f} "
            f"| {r['refit_s']:.3f} | {r['step_over_own']:.2f} | {r['staleness_max']} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | s/step | speedup vs sync | trainer idle | staleness p50 / max | wasted samples |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['s_per_step']:.3f} | {r['speedup']:.2f}x | "
            f"{100 * r['trainer_idle']:.0f}% | {r['staleness_p50']} / {r['staleness_max']} | "
            f"{r['wasted_samples']} ({100 * r['wasted_fraction']:.0f}% of generated) |"
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    from asyncrl_example_backend.model import write_model_dir

    asyncrl.obs.log.configure(
        "console", level="warning"
    )  # a program's choice; asyncrl never logs on import
    if args.gc_young_interval is not None:  # read when each run starts
        from asyncrl.obs import collector

        collector.GC_YOUNG_INTERVAL_S = args.gc_young_interval
    mean_sample_s = args.median * math.exp(0.5) * args.token_delay
    if args.seq_delay < 0:  # default: a step trains about as long as a mean sample generates
        args.seq_delay = mean_sample_s / (args.prompts * args.samples)
    results: dict[str, Any] = {} if args.part == "vllm-long" else {  # it writes its own
        "workload": {  # the bigram parts'
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "length_median": args.median,
            "length_p99": args.median * math.exp(2.326),
            "token_delay_s": args.token_delay,
            "engine_slots": args.slots,
            "train_s_per_step": args.seq_delay * args.prompts * args.samples,
            "mean_sample_s": mean_sample_s,
            "steps": args.steps,
        }
    }
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = write_model_dir(tmp / "model")
        if args.part in ("modes", "all"):
            print("modes:", json.dumps(results["workload"]), flush=True)
            results["modes"] = await part_modes(args, model, tmp)
        if args.part in ("lag", "all"):
            results["lag"] = await part_lag(args, model, tmp)
        if args.part == "vllm":
            results["vllm"] = await part_vllm(args, tmp)
        if args.part == "vllm-long":
            results["vllm-long"] = await part_vllm_long(args, tmp)
    if "modes" in results:
        print()
        print(table(results["modes"]))
    if "vllm" in results:
        print()
        print(vllm_table(results["vllm"]))
    if "vllm-long" in results:
        print()
        print(table(results["vllm-long"]["rows"]))
    if "lag" in results:
        lag = results["lag"]
        print()
        print(
            f"loop lag: {lag['samples_per_s']:.0f} samples/s through the data socket "
            f"({lag['rollout_ranks']} rollout ranks, {lag['in_flight']} samples in flight); "
            f"steady state p50 {lag['loop_lag_p50_ms']:.2f} ms, "
            f"p99 {lag['loop_lag_p99_ms']:.2f} ms, max {lag['loop_lag_max_ms']:.2f} ms "
            f"({lag['lag_samples']} samples); per-step p99: median "
            f"{lag['loop_lag_p99_median_step_ms']:.2f} ms, worst "
            f"{lag['loop_lag_p99_worst_step_ms']:.2f} ms"
        )
    out = args.out or ROOT / "runs" / "benchmarks" / f"modes-{args.part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        choices=["modes", "lag", "all", "vllm", "vllm-long"],
        default="all",
        help="all = modes + lag (bigram engine); vllm = the tiny CPU task; vllm-long = real "
        "engines on a long-tail workload",
    )
    parser.add_argument("--size", choices=["0.5b", "tiny"], default="0.5b",
                        help="vllm-long: the random model's shape")  # fmt: skip
    parser.add_argument("--mean-len", type=float, default=300.0,
                        help="vllm-long: the samples' target mean length")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=8, help="vllm-long: trainer micro-batch")
    parser.add_argument(
        "--max-tokens-per-micro-batch", type=int, default=0,
        help="vllm-long: trainer.max_tokens_per_micro_batch (sorted, token-budget micro-batches; "
        "0: --micro-batch sequences each)",
    )  # fmt: skip
    parser.add_argument(
        "--pack-sequences", action="store_true",
        help="vllm-long: trainer.pack_sequences (rows of --max-tokens-per-micro-batch tokens)",
    )  # fmt: skip
    parser.add_argument(
        "--mixed-precision", choices=["bf16", "none"], default="bf16",
        help="vllm-long: the trainer's trainer.options.mixed_precision (bf16, as runs on GPUs "
        "use it; none: float32)",
    )  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--vllm-steps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lag-steps", type=int, default=60)
    parser.add_argument(
        "--out", type=Path, default=None,
        help="results JSON (default runs/benchmarks/modes-<part>.json, outside git; the "
        "figures kept per machine live in benchmarks/results/)",
    )
    parser.add_argument("--lag-ranks", type=int, default=2, help="rollout ranks in the lag part")
    parser.add_argument(
        "--lag-in-flight",
        type=int,
        default=100,
        help="samples in flight in the lag part (sets the sample rate)",
    )
    parser.add_argument(
        "--gc-young-interval", type=float, default=None,
        help="asyncrl.obs.collector.GC_YOUNG_INTERVAL_S for every run (default: its 0.05; 0: "
        "Python's own)",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--median", type=float, default=6.0, help="median sample length")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--token-delay", type=float, default=0.01)
    parser.add_argument("--slots", type=int, default=256, help="engine batch slots")
    parser.add_argument(
        "--seq-delay",
        type=float,
        default=-1.0,
        help="trainer seconds per sequence (default: a step ~ a mean sample)",
    )
    parser.add_argument(
        "--long-modes", type=_long_modes, default=list(LONG_MODES),
        help=f"vllm-long: the modes to run, comma-separated, sync among them (default all: "
        f"{', '.join(LONG_MODES)})",
    )
    anyio.run(main, parser.parse_args())
