"""N jobs in one run against the same N jobs run one after another (docs/jobs.md).

    .venv/bin/python benchmarks/jobs.py                          # N = 1, 2, 4 on the bigram engines
    .venv/bin/python benchmarks/jobs.py --jobs 1,2,4,8 --steps 10 --machine 2core

Each job trains ``--steps`` steps; job ``i`` has seed ``i`` and, alternately, the single-turn
``repeat-digit`` reward or the two-turn ``repeat-digit-turns`` one (the reference backend's
testing environments). For each N:

- **together**: one run (the embedded :class:`asyncrl.Controller`, its workers real
  processes) with the N jobs as ``[jobs.<name>]`` tables, sharing the engine and the trainer;
- **one after another**: N runs of one job each, the same tables: each job's solo run.

Printed and written per N: the wall time of each way (the runs' start-up included, as a user
waits for it), experiment throughput (jobs x steps per hour) and its ratio, each job's
seconds per step in the run of all (its first step to its last, over its steps), and each
job's mean reward over its last three steps, together against alone (the
learning curve; equal up to the order in which the jobs' samples met the engine).

After the runs of N = max: a job added to the run while it goes on, and the time from
``Controller.add_job`` to its pipeline running (``warm_start_s``: its environment, metrics
file and adapter opened on the trainer).

The bigram engines are the CPU's: their steps take milliseconds, so what sharing saves here is
mostly the start-up each run pays (torchrun, the workers, the first refit); on a GPU it is the
engine's idle time as well (``benchmarks/gpu/run_jobs.sh`` measures one engine serving many
jobs' adapters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_results  # noqa: E402  (benchmarks/, beside this script)


def job_table(i: int, steps: int) -> dict[str, Any]:
    env = "repeat-digit" if i % 2 == 0 else "repeat-digit-turns"
    return {"run": {"seed": i, "num_steps": steps}, "environment": {"name": env}}


def run_config(model: Path, out: Path, jobs: dict[str, Any], args: argparse.Namespace) -> Any:
    from asyncrl.config import from_dict

    return from_dict({
        "model": {"path": str(model)}, "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(out), "num_steps": args.steps},
        "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "startup_timeout_s": 120.0,
                    "shutdown_grace_s": 3.0},
        "grpo": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 16},
        "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 1}},
        "trainer": {"backend": "bigram", "options": {"lr": 0.5}},
        "generator": {"backend": "bigram", "options": {"token_delay_s": args.token_delay}},
        "eval": {"num_prompts": 0}, "checkpoint": {"at_end": False},
        "jobs": jobs,
    })  # fmt: skip


async def run_jobs(cfg: Any, add: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of ``cfg``'s jobs: its wall time, and with ``add`` a job added once the first
    job has a step (its warm start)."""
    from asyncrl.run.controller import Controller

    start = time.perf_counter()
    warm = None
    async with Controller(cfg) as ctl:
        up = time.perf_counter() - start
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctl.train)
            if add is not None:
                while not any(j["step"] for j in ctl.jobs.list()):
                    await anyio.sleep(0.005)
                t = time.perf_counter()
                ctl.add_job("added", add)
                while {j["job"]: j["state"] for j in ctl.jobs.list()}["added"] == "starting":
                    await anyio.sleep(0.0005)
                warm = time.perf_counter() - t
        states = {j["job"]: j["state"] for j in ctl.jobs.list()}
    bad = {n: s for n, s in states.items() if s != "finished"}
    if bad:
        raise SystemExit(f"jobs did not finish: {bad}")
    return {"wall_s": time.perf_counter() - start, "up_s": up, "warm_start_s": warm}


def job_figures(out: Path, name: str) -> dict[str, float]:
    lines = (out / "jobs" / name / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    span = steps[-1]["t"] - steps[0]["t"]
    return {"s_per_step": span / max(1, len(steps) - 1),
            "reward_last3": statistics.fmean(r["reward"] for r in steps[-3:])}


def measure(n: int, model: Path, work: Path, args: argparse.Namespace, warm: bool) -> dict:
    names = [f"j{i}" for i in range(n)]
    tables = {name: job_table(i, args.steps) for i, name in enumerate(names)}
    together_dir = work / f"together-{n}"
    together = anyio.run(run_jobs, run_config(model, together_dir, tables, args),
                         job_table(n, 2) if warm else None)  # fmt: skip
    alone_s = 0.0
    for name in names:
        alone = anyio.run(run_jobs, run_config(model, work / f"alone-{name}",
                                               {name: tables[name]}, args))  # fmt: skip
        alone_s += alone["wall_s"]
    figures = {name: job_figures(together_dir, name) for name in names}
    solo = {name: job_figures(work / f"alone-{name}", name) for name in names}
    experiments = n * args.steps
    row = {
        "jobs": n, "steps": args.steps,
        "together_wall_s": round(together["wall_s"], 2),
        "together_up_s": round(together["up_s"], 2),
        "alone_wall_s": round(alone_s, 2),
        "together_per_hour": round(experiments * 3600 / together["wall_s"]),
        "alone_per_hour": round(experiments * 3600 / alone_s),
        "speedup": round(alone_s / together["wall_s"], 2),
        "s_per_step": {k: round(v["s_per_step"], 4) for k, v in figures.items()},
        "reward_last3_together": {k: round(v["reward_last3"], 3) for k, v in figures.items()},
        "reward_last3_alone": {k: round(v["reward_last3"], 3) for k, v in solo.items()},
    }  # fmt: skip
    if warm:
        row["warm_start_s"] = round(together["warm_start_s"], 4)
    return row


def main(args: argparse.Namespace) -> None:
    import asyncrl.obs.log
    from asyncrl_example_backend.model import write_model_dir

    asyncrl.obs.log.configure("console", level="warning")  # a program's choice
    counts = [int(x) for x in args.jobs.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-jobs-") as tmp:
        work = Path(tmp)
        model = write_model_dir(work / "model")
        for n in counts:
            row = measure(n, model, work, args, warm=n == max(counts))
            rows.append(row)
            print(f"{n} jobs x {args.steps} steps: together {row['together_wall_s']:.1f} s "
                  f"({row['together_per_hour']}/h), one after another {row['alone_wall_s']:.1f} s "
                  f"({row['alone_per_hour']}/h): {row['speedup']:.2f}x; s/step "
                  f"{row['s_per_step']}", flush=True)  # fmt: skip
            print(f"    reward (last 3 steps) together {row['reward_last3_together']}, "
                  f"alone {row['reward_last3_alone']}"
                  + (f"; warm start {row['warm_start_s'] * 1000:.1f} ms" if "warm_start_s" in row
                     else ""), flush=True)  # fmt: skip
    write_results({"args": vars(args), "rows": rows}, "jobs", args.out, args.machine)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="1,2,4", help="the N to measure, comma-separated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--token-delay", type=float, default=0.002,
                        help="the bigram engine's seconds per token")
    parser.add_argument("--machine", default="", help="names the results file to keep")
    parser.add_argument("--out", type=Path, default=None)
    main(parser.parse_args())
