"""Many multi-turn episodes at once on the controller: throughput, loop lag, memory.

    .venv/bin/python benchmarks/episodes.py               # ~3 min on 2 cores
    .venv/bin/python benchmarks/episodes.py --prompts 8 --steps 4   # a quick look
    .venv/bin/python benchmarks/episodes.py --profile     # + where the loop's time goes

A real run: the embedded :class:`asyncrl.Controller` with the example (bigram) trainer and
rollout ranks as real processes, on the testing environment ``repeat-digit-turns`` with
``turns = 4`` (the digit as a user turn between each two turns). ``--prompts`` x
``--samples`` episodes a step (64 x 16 = 1,024 by default) and
``pipeline.max_inflight_samples`` as many, with the ``gated`` sampler (W = 2), so the
next step's groups start while the last ones finish: about that many episodes are in flight
throughout. Each turn generates ``--turn-tokens`` tokens (log-normal, sigma 0.5) at
``--token-delay`` s a token on engines with no slot limit (~1 s a turn by default, as an LLM
turn takes seconds): every episode holds a turn on a worker most of the time.

Measured, over the steady state (from the end of step 2 to the last step):

- **episodes/s** (and turns/s): episodes that ended with a score, from the ``train`` records'
  ``episodes`` and ``episode_turns_mean``;
- **episodes in flight**: the run's :meth:`~asyncrl.Controller.status` (``inflight_samples``,
  ``turns_in_flight``) sampled every 50 ms: mean, p10, p50, max;
- **loop lag**: how late a 10 ms sleep wakes on the controller's loop, sampled by the
  benchmark as :class:`~asyncrl.obs.watchdog.LoopLag` does (p50, p99, max, pooled), and each
  step's ``loop_lag_p99_s`` as the run records it;
- **memory per episode**: the controller's RSS (this process: the controller is embedded),
  median over the steady state, in this run and in one with ``--small-prompts`` x
  ``--samples`` episodes (~100 in flight); the difference divided by the difference in mean
  episodes in flight. RSS, not tracemalloc: it is what the host pays (ZeroMQ's buffers and
  allocator slack included), and tracemalloc would slow the loop it measures (``--tracemalloc``
  adds the Python heap's share, traced in the same runs, for the split).

``--profile`` runs once more under cProfile (the controller's thread) and prints the top
functions by own time, with each one's share of the loop's busy time.

Results are printed and written to ``--out`` (default
``benchmarks/results/episodes-<machine>.json`` with ``--machine``, else
``runs/benchmarks/episodes.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import asyncrl
import asyncrl.obs.log
from asyncrl.config import from_dict

ROOT = Path(__file__).resolve().parents[1]
TURNS = 4


def config(model: Path, out: Path, args: argparse.Namespace, prompts: int) -> dict[str, Any]:
    episodes = prompts * args.samples
    return {
        "model": {"path": str(model)},
        "environment": {"name": "repeat-digit-turns", "options": {"turns": TURNS}},
        "run": {"num_steps": args.steps, "seed": 0, "output_dir": str(out)},
        "cluster": {"trainer_ranks": 1, "rollout_ranks": args.ranks, "shutdown_grace_s": 5.0},
        "grpo": {
            "prompts_per_step": prompts,
            "samples_per_prompt": args.samples,
            "max_new_tokens": 4 * args.turn_tokens,
        },
        "episode": {"max_turns": TURNS, "max_context_tokens": 1024},
        "pipeline": {
            "sampler": {"name": "gated", "max_staleness_versions": 2},
            "min_groups_for_streaming_train": max(1, prompts // 4),
            "max_inflight_samples": episodes,
        },
        "refit": {"bucket_size_mb": 1, "verify_first_steps": 0, "verify_every_steps": 0},
        "trainer": {"backend": "bigram", "options": {"lr": 0.5}},
        "generator": {
            "backend": "bigram",
            "options": {
                "length_median": float(args.turn_tokens),
                "length_sigma": 0.5,
                "token_delay_s": args.token_delay,
            },
        },
        "eval": {"num_prompts": 0},
    }


def rss_bytes() -> int:
    """This process's resident set (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def one_run(data: dict[str, Any], *, trace: bool = False) -> dict[str, Any]:
    """Run ``data``'s config to its end, sampling the loop's lag (every 10 ms) and the
    episodes in flight and the memory (every 50 ms) meanwhile; returns the raw series and
    the ``train`` records, on the run's clock."""
    lags: list[tuple[float, float]] = []
    load: list[tuple[float, int, int, int, int]] = []  # at, in flight, turns, rss, traced
    ctl: asyncrl.Controller | None = None

    async def lag_probe() -> None:
        while True:
            t = time.perf_counter()
            await anyio.sleep(0.01)
            lags.append((time.perf_counter(), time.perf_counter() - t - 0.01))

    async def load_probe() -> None:
        while True:
            await anyio.sleep(0.05)
            try:
                status = ctl.status() if ctl is not None else None
            except RuntimeError:  # not running yet, or over
                status = None
            if status is not None:
                traced = tracemalloc.get_traced_memory()[0] if trace else 0
                load.append((time.perf_counter(), status.inflight_samples,
                             status.turns_in_flight, rss_bytes(), traced))  # fmt: skip

    if trace:
        tracemalloc.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lag_probe)
            tg.start_soon(load_probe)
            async with asyncrl.Controller(from_dict(data)) as ctl:
                t0 = ctl.status().clock_origin
                steps = (await ctl.train()).steps
            tg.cancel_scope.cancel()
    finally:
        if trace:
            tracemalloc.stop()
    return {"t0": t0, "steps": steps, "lags": lags, "load": load}


def summarize(raw: dict[str, Any], samples: int) -> dict[str, Any]:
    """The steady state's figures (after step 2: start-up and the first fill are out)."""
    steps, t0 = raw["steps"], raw["t0"]
    if len(steps) < 4:
        raise SystemExit("--steps: at least 4 (the steady state starts after step 2)")
    start, end = t0 + steps[1]["time"], t0 + steps[-1]["time"]
    window = end - start
    episodes = sum(r["episodes"] for r in steps[2:])
    turns = sum(r["episodes"] * r["episode_turns_mean"] for r in steps[2:])
    lags = [lag for at, lag in raw["lags"] if start <= at <= end]
    load = [row for row in raw["load"] if start <= row[0] <= end]
    inflight = np.array([row[1] for row in load], float)
    q = lambda xs, p: float(np.quantile(xs, p))  # noqa: E731
    return {
        "steps": len(steps),
        "window_s": window,
        "episodes_per_s": episodes / window,
        "turns_per_s": turns / window,
        "turns_per_episode": turns / max(episodes, 1),
        "trained_episodes_per_s": sum(r["groups"] * samples for r in steps[2:]) / window,
        "aborted_samples": sum(r["aborted_samples"] for r in steps),
        "reward_first": steps[0]["reward"],
        "reward_last": steps[-1]["reward"],
        "in_flight_mean": float(inflight.mean()),
        "in_flight_p10": q(inflight, 0.1),
        "in_flight_p50": q(inflight, 0.5),
        "in_flight_max": int(inflight.max()),
        "turns_in_flight_mean": float(np.mean([row[2] for row in load])),
        "loop_lag_p50_ms": 1e3 * q(lags, 0.5),
        "loop_lag_p99_ms": 1e3 * q(lags, 0.99),
        "loop_lag_max_ms": 1e3 * max(lags),
        "lag_samples": len(lags),
        "step_lag_p99_median_ms": 1e3 * statistics.median(r["loop_lag_p99_s"] for r in steps[2:]),
        "step_lag_p99_worst_ms": 1e3 * max(r["loop_lag_p99_s"] for r in steps[2:]),
        "rss_mib": statistics.median(row[3] for row in load) / 2**20,
        "traced_mib": statistics.median(row[4] for row in load) / 2**20,
    }


def profile_table(prof: cProfile.Profile, busy_s: float, top: int = 25) -> list[dict[str, Any]]:
    """The functions with the most own time (cProfile's ``tottime``), with cumulative time
    and calls; ``share`` is own time over the loop's busy time."""
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({name})" if line else name
        rows.append({"function": where, "own_s": own, "cum_s": cum, "calls": calls})
    rows.sort(key=lambda r: -r["own_s"])
    for row in rows:
        row["share"] = row["own_s"] / busy_s
    return rows[:top]


async def run_profiled(data: dict[str, Any]) -> dict[str, Any]:
    """One more run under cProfile (it profiles this thread: the controller's loop and all
    its tasks); the loop's busy time is the CPU time of the process's main thread."""
    prof = cProfile.Profile()
    cpu0 = time.thread_time()
    prof.enable()
    try:
        raw = await one_run(data)
    finally:
        prof.disable()
    busy = time.thread_time() - cpu0
    wall = raw["steps"][-1]["time"]
    return {"busy_s": busy, "wall_s": wall, "top": profile_table(prof, busy)}
