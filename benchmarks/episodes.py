"""Many multi-turn episodes at once on the controller: throughput, loop lag, memory.

    .venv/bin/python benchmarks/episodes.py               # ~2 min on 2 cores
    .venv/bin/python benchmarks/episodes.py --prompts 8 --small-prompts 2 --steps 4  # a look
    .venv/bin/python benchmarks/episodes.py --profile --sweep 0.2 0.4 --machine 2core  # ~7 min
    .venv/bin/python benchmarks/episodes.py --own-core --out benchmarks/results/episodes-2core-own-core.json

A real run: the embedded :class:`asyncrl.Controller` with the example (bigram) trainer and
rollout ranks as real processes, on the testing environment ``repeat-digit-turns`` with
``turns = 4`` (the digit as a user turn between each two turns). ``--prompts`` x
``--samples`` episodes a step (64 x 16 = 1,024 by default) and
``pipeline.max_inflight_samples`` as many, with the ``gated`` sampler (W = 2), so the
next step's groups start while the last ones finish: about that many episodes are in flight
throughout. Each turn generates at most ``--turn-tokens`` tokens (it stops at the end
token: about 1 in 20 of an untrained bigram's) at ``--token-delay`` s a token on engines with
no slot limit (~0.8 s a turn by default; an LLM's turn takes seconds): every episode holds a
turn on a worker most of the time.

Each run is a fresh interpreter (a child of this script) holding the controller. Measured,
over the steady state (from the end of step 2 to the last step):

- **episodes/s** (and turns/s): episodes that ended with a score, from the ``train`` records'
  ``episodes`` and ``episode_turns_mean``;
- **episodes in flight**: the run's :meth:`~asyncrl.Controller.status` (``inflight_samples``,
  ``requests_in_flight``: its turns) sampled every 100 ms: mean, p10, p50, max;
- **loop lag**: how late a 10 ms sleep wakes on the controller's loop, sampled by the
  benchmark as :class:`~asyncrl.obs.watchdog.LoopLag` does (p50, p99, max, pooled), and each
  step's ``loop_lag_p99_s`` as the run records it; and how busy the loop's thread was (its
  CPU time over the wall time);
- **memory per episode**: the controller's RSS (the child's: the controller is embedded),
  median over the steady state, in this run and in one with ``--small-prompts`` x
  ``--samples`` episodes (~100 in flight); the difference divided by the difference in mean
  episodes in flight. RSS, not tracemalloc: it is what the host pays (ZeroMQ's buffers and
  allocator slack included), and tracemalloc would slow the loop it measures (``--tracemalloc``
  adds the Python heap's share, traced in the same runs, for the split).

``--own-core`` gives the controller's event-loop thread CPU 0 to itself and puts everything
else the run starts (workers, trainer, ZeroMQ's I/O threads) on the other CPUs, as on a host
with cores to spare: the lag it measures is then the loop's own work, not its wait for a core.

``--profile`` runs once more under cProfile (the controller's thread, over the steady state)
and prints own time by file, the top functions by own time, and asyncrl's by cumulative
time, each as a share of the loop thread's CPU time. ``--sweep`` runs ~1,000 episodes again
at slower tokens: the loop lag against the turn rate.

Results are printed and written to ``--out`` (default
``benchmarks/results/episodes-<machine>.json`` with ``--machine``, else
``runs/benchmarks/episodes.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
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
from results_file import write_results  # benchmarks/, beside this script

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
            "max_new_tokens": args.turn_tokens,
        },
        "episode": {"max_turns": TURNS, "max_context_tokens": 1024},
        "pipeline": {
            "sampler": {"name": "gated", "max_staleness_versions": 2},
            "min_groups_for_streaming_train": max(1, prompts // 4),
            "max_inflight_samples": episodes,
        },
        "refit": {"bucket_size_mb": 1, "verify_every_steps": 0},
        "trainer": {"backend": "bigram", "options": {"lr": 0.5}},
        "generator": {
            "backend": "bigram",
            # no drawn lengths: a turn must stop at its end token (the trajectory check)
            "options": {"token_delay_s": args.token_delay},
        },
        "eval": {"num_prompts": 0},
    }


def rss_bytes() -> int:
    """This process's resident set (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pin(cpus: set[int]) -> None:
    """Run the calling thread (Linux: only it; what it starts later inherits it) on ``cpus``."""
    os.sched_setaffinity(0, cpus)


async def one_run(
    data: dict[str, Any], *, trace: bool = False, prof: cProfile.Profile | None = None,
    own_core: bool = False,
) -> dict[str, Any]:
    """Run ``data``'s config to its end, sampling the loop's lag (every 10 ms) and the
    episodes in flight and the memory (every 100 ms) meanwhile; returns the raw series and
    the ``train`` records, on the run's clock, and the loop thread's CPU time from the end
    of step 2 to the end of training (``prof``, if given, profiles that span)."""
    lags: list[tuple[float, float]] = []
    ran: list[float] = []  # per lag sample: CPU seconds the loop's thread used meanwhile
    load: list[tuple[float, int, int, int, int]] = []  # at, in flight, turns, rss, traced
    steady: list[tuple[float, float]] = []  # (perf_counter, thread_time) at its start
    probe_s: list[float] = []  # what each load sample cost the loop
    collections: list[tuple[float, int, float]] = []  # at, generation, seconds
    started: list[float] = [0.0]
    ctl: asyncrl.Controller | None = None

    def on_gc(phase: str, info: dict[str, Any]) -> None:  # the collector's pauses
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            now = time.perf_counter()
            collections.append((now, int(info["generation"]), now - started[0]))

    async def lag_probe() -> None:
        while True:
            t, c = time.perf_counter(), time.thread_time()
            await anyio.sleep(0.01)
            now = time.perf_counter()
            lags.append((now, now - t - 0.01))
            ran.append(time.thread_time() - c)  # the loop thread's CPU over that sleep

    async def load_probe() -> None:
        while True:
            await anyio.sleep(0.1)
            t = time.perf_counter()
            try:
                status = ctl.status() if ctl is not None else None
            except RuntimeError:  # not running yet, or over
                status = None
            if status is None:
                continue
            traced = tracemalloc.get_traced_memory()[0] if trace else 0
            load.append((time.perf_counter(), status.inflight_samples,
                         status.requests_in_flight, rss_bytes(), traced))  # fmt: skip
            probe_s.append(time.perf_counter() - t)
            if status.step >= 2 and not steady:
                steady.append((time.perf_counter(), time.thread_time()))
                if prof is not None:
                    prof.enable()

    if trace:
        tracemalloc.start()
    gc.callbacks.append(on_gc)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lag_probe)
            tg.start_soon(load_probe)
            async with asyncrl.Controller(from_dict(data)) as ctl:
                if own_core:  # the workers started on the other cores: the loop takes CPU 0
                    pin({0})
                t0 = ctl.status().clock_origin
                steps = (await ctl.train()).steps
                if prof is not None:
                    prof.disable()
                end = (time.perf_counter(), time.thread_time())
            tg.cancel_scope.cancel()
    finally:
        gc.callbacks.remove(on_gc)
        if trace:
            tracemalloc.stop()
    (w0, c0), (w1, c1) = steady[0], end
    return {"t0": t0, "steps": steps, "lags": lags, "load": load, "gc": collections, "ran": ran,
            "loop_cpu_s": c1 - c0, "loop_wall_s": w1 - w0, "probe_s": probe_s}  # fmt: skip


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
        "probe_ms_mean": 1e3 * statistics.mean(raw["probe_s"]),
        **gc_pauses([(g, s) for at, g, s in raw["gc"] if start <= at <= end]),
        **late_near_steps([(at, lag) for at, lag in raw["lags"] if start <= at <= end],
                          [t0 + r["time"] for r in steps]),
        **late_running([(lag, cpu) for (at, lag), cpu in zip(raw["lags"], raw["ran"])
                        if start <= at <= end]),  # fmt: skip
    }


def late_running(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """For the lag samples over 10 ms: the median share of the sample's wall time (10 ms plus
    the lag) in which the loop's thread was on a CPU. Low: the thread waited for a core (the
    machine's other processes), not for the loop's own work."""
    shares = [cpu / (0.01 + lag) for lag, cpu in samples if lag > 0.010]
    return {"late_samples_cpu_share_median": statistics.median(shares) if shares else None}


def late_near_steps(lags: list[tuple[float, float]], step_ends: list[float]) -> dict[str, Any]:
    """Lag samples over 10 ms, and how many of them came within 0.3 s after a step's end
    (its record, the refit and the next step's packing run on the loop then)."""
    late = [at for at, lag in lags if lag > 0.010]
    near = sum(any(0 <= at - e <= 0.3 for e in step_ends) for at in late)
    return {"lag_over_10ms": len(late), "lag_over_10ms_near_step_end": near}


def gc_pauses(collections: list[tuple[int, float]]) -> dict[str, Any]:
    """The collector's passes over the steady state: how many of each generation, and the
    longest (a pass holds the loop: a lag sample taken across it is late by as much)."""
    out: dict[str, Any] = {}
    for gen in (0, 1, 2):
        pauses = [s for g, s in collections if g == gen]
        out[f"gc_gen{gen}_passes"] = len(pauses)
        out[f"gc_gen{gen}_max_ms"] = 1e3 * max(pauses, default=0.0)
    return out


IDLE = "<method 'poll' of 'select.epoll' objects>"
"""The loop waiting for I/O: not busy time (left out of the tables)."""


def profile_tables(prof: cProfile.Profile, busy_s: float, top: int = 20) -> dict[str, Any]:
    """Where the loop's busy time went: own time (cProfile's ``tottime``) summed by source
    file, the functions with the most own time, and asyncrl's functions with the most
    cumulative time (a coroutine's counts its resumptions); ``share`` is over the loop
    thread's CPU time."""
    files: dict[str, float] = {}
    rows = []
    table = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for (file, line, name), (_, calls, own, cum, _) in table.items():
        if name == IDLE:
            continue
        parts = Path(file).parts if file != "~" else (name,)
        short = "/".join(parts[-2:])
        files[short] = files.get(short, 0.0) + own
        where = f"{short}:{line}({name})" if line else name
        rows.append({"function": where, "own_s": own, "cum_s": cum, "calls": calls,
                     "share": own / busy_s, "cum_share": cum / busy_s})  # fmt: skip
    ours = [r for r in rows if "/asyncrl/" in r["function"] or r["function"].startswith(
        ("run/", "env/", "wire/", "policy/", "obs/", "data/"))]  # fmt: skip
    return {
        "by_file": sorted(({"file": k, "own_s": v, "share": v / busy_s} for k, v in files.items()),
                          key=lambda r: -r["own_s"])[:top],  # fmt: skip
        "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
        "asyncrl_by_cum": sorted(ours, key=lambda r: -r["cum_s"])[:top],
    }


def memory(big: dict[str, Any], small: dict[str, Any]) -> dict[str, Any]:
    """Bytes per episode in flight: the RSS (and traced heap) difference between the two
    runs over the difference in mean episodes in flight."""
    d_eps = big["in_flight_mean"] - small["in_flight_mean"]
    return {
        "method": "controller RSS median over the steady state, run with ~1,000 in flight "
        "minus run with ~100, over the difference in mean episodes in flight",
        "rss_kib_per_episode": (big["rss_mib"] - small["rss_mib"]) * 1024 / d_eps,
        "traced_kib_per_episode": (big["traced_mib"] - small["traced_mib"]) * 1024 / d_eps
        if big["traced_mib"] else None,  # None: not traced (--tracemalloc)
        "episodes_difference": d_eps,
    }


def report(results: dict[str, Any]) -> None:
    r, m = results["run"], results.get("memory")
    memory_line = (
        f"memory: {m['rss_kib_per_episode']:.1f} KiB RSS per episode in flight "
        f"({r['rss_mib']:.0f} MiB vs {results['small']['rss_mib']:.0f} MiB over "
        f"{m['episodes_difference']:.0f} episodes)\n" if m is not None else ""
    )  # fmt: skip
    print(
        f"\n{r['in_flight_mean']:.0f} episodes in flight (p10 {r['in_flight_p10']:.0f}, p50 "
        f"{r['in_flight_p50']:.0f}, max {r['in_flight_max']}; {r['turns_in_flight_mean']:.0f} "
        f"turns on the engines), {TURNS} turns each\n"
        f"throughput: {r['episodes_per_s']:.1f} episodes/s, {r['turns_per_s']:.0f} turns/s "
        f"(trained {r['trained_episodes_per_s']:.1f} episodes/s) over {r['window_s']:.1f} s\n"
        f"loop lag: p50 {r['loop_lag_p50_ms']:.2f} ms, p99 {r['loop_lag_p99_ms']:.2f} ms, max "
        f"{r['loop_lag_max_ms']:.1f} ms ({r['lag_samples']} samples); per-step p99 median "
        f"{r['step_lag_p99_median_ms']:.2f} ms, worst {r['step_lag_p99_worst_ms']:.2f} ms\n"
        f"{memory_line}"
        f"the loop's thread: {r['loop_cpu_s']:.1f} s CPU in {r['loop_wall_s']:.1f} s of the "
        f"steady state "
        f"({100 * r['loop_cpu_s'] / r['loop_wall_s']:.0f}% busy)\n"
        f"garbage collection: {r['gc_gen2_passes']} full passes (longest "
        f"{r['gc_gen2_max_ms']:.0f} ms), {r['gc_gen1_passes']} of generation 1 (longest "
        f"{r['gc_gen1_max_ms']:.1f} ms)"
        + (f"; Python heap {m['traced_kib_per_episode']:.1f} KiB"
           if results["tracemalloc"] and m is not None else "")  # fmt: skip
    )
    if "profile" in results:
        report_profile(results["profile"])
    if results.get("sweep"):
        print("\nloop lag against the turn rate, ~1,000 episodes in flight (--sweep):")
        print("| s a token | turns/s | episodes in flight | loop busy | lag p50 | lag p99 "
              "| lag max |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in results["sweep"]:
            print(f"| {row['token_delay_s']} | {row['turns_per_s']:.0f} "
                  f"| {row['in_flight_mean']:.0f} "
                  f"| {100 * row['loop_cpu_s'] / row['loop_wall_s']:.0f}% "
                  f"| {row['loop_lag_p50_ms']:.1f} ms | {row['loop_lag_p99_ms']:.1f} ms "
                  f"| {row['loop_lag_max_ms']:.0f} ms |")  # fmt: skip


def report_profile(p: dict[str, Any]) -> None:
    """Print the ``--profile`` run's tables."""
    print(f"\nprofile: the loop's thread used {p['loop_cpu_s']:.1f} s CPU in "
          f"{p['loop_wall_s']:.1f} s of the steady state (cProfile's overhead included); own "
          f"time by file, then by function (waiting in epoll left out):")  # fmt: skip
    tables = p["profile"]
    for row in tables["by_file"]:
        print(f"  {100 * row['share']:5.1f}%  {row['own_s']:7.2f} s  {row['file']}")
    for key, title in (("by_own", "own"), ("asyncrl_by_cum", "cumulative, asyncrl's")):
        print(f"  by {title} time:")
        for row in tables[key]:
            print(f"  {100 * row['share']:5.1f}% own {row['own_s']:6.2f} s, cum "
                  f"{row['cum_s']:6.2f} s ({100 * row['cum_share']:5.1f}%) "
                  f"{row['calls']:>8} calls  {row['function']}")  # fmt: skip


def child_command(args: argparse.Namespace, name: str, prompts: int, *, profile: bool,
                  out: Path, token_delay: float) -> list[str]:  # fmt: skip
    """This script, to run one measurement in a fresh interpreter."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name,
           "--child-prompts", str(prompts), "--child-out", str(out),
           "--token-delay", str(token_delay)]  # fmt: skip
    for flag in ("samples", "steps", "ranks", "turn_tokens"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return (cmd + ["--tracemalloc"] * args.tracemalloc + ["--profile"] * profile
            + ["--own-core"] * args.own_core)


async def child(args: argparse.Namespace) -> None:
    """One run (``--child``): its steady state's figures (and its profile) as JSON."""
    from asyncrl_example_backend.model import write_model_dir

    asyncrl.obs.log.configure("console", level="warning")  # a program's choice
    with tempfile.TemporaryDirectory(prefix="asyncrl-episodes-") as tmp_name:
        tmp = Path(tmp_name)
        data = config(write_model_dir(tmp / "model"), tmp / "run", args, args.child_prompts)
        prof = cProfile.Profile() if args.profile else None
        if args.own_core:  # every process and thread the run starts: off CPU 0
            pin(set(os.sched_getaffinity(0)) - {0})
        raw = await one_run(data, trace=args.tracemalloc, prof=prof, own_core=args.own_core)
    out = summarize(raw, args.samples)
    out["loop_cpu_s"], out["loop_wall_s"] = raw["loop_cpu_s"], raw["loop_wall_s"]
    if prof is not None:
        out["profile"] = profile_tables(prof, raw["loop_cpu_s"])
    args.child_out.write_text(json.dumps(out))


def measure(args: argparse.Namespace, name: str, prompts: int, *, profile: bool = False,
            token_delay: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Run ``child`` in a fresh interpreter (so each RSS starts from the same place)."""
    delay = args.token_delay if token_delay is None else token_delay
    with tempfile.TemporaryDirectory(prefix="asyncrl-episodes-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = child_command(args, name, prompts, profile=profile, out=out, token_delay=delay)
        subprocess.run(cmd, check=True)
        result = json.loads(out.read_text())
    print(f"{name}:", json.dumps({k: v for k, v in result.items() if k != "profile"}),
          flush=True)  # fmt: skip
    return result


def main(args: argparse.Namespace) -> None:
    results: dict[str, Any] = {
        "workload": {
            "environment": f"repeat-digit-turns, {TURNS} turns",
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "episodes_per_step": args.prompts * args.samples,
            "small_prompts_per_step": args.small_prompts,
            "rollout_ranks": args.ranks,
            "turn_tokens_max": args.turn_tokens,
            "token_delay_s": args.token_delay,
            "steps": args.steps,
            "machine": args.machine or "",
            "own_core": args.own_core,
            "cpus": os.cpu_count(),
        },
        "tracemalloc": args.tracemalloc,
    }
    print("workload:", json.dumps(results["workload"]), flush=True)
    results["run"] = measure(args, "run", args.prompts)
    if args.small_prompts:  # 0: the main run alone (no memory per episode then)
        results["small"] = measure(args, "small", args.small_prompts)
        results["memory"] = memory(results["run"], results["small"])
    if args.profile:
        results["profile"] = measure(args, "profile", args.prompts, profile=True)
    results["sweep"] = []
    for delay in args.sweep:
        row = measure(args, f"sweep {delay}", args.prompts, token_delay=delay)
        results["sweep"].append({"token_delay_s": delay, **row})
    report(results)
    write_results(results, "episodes", args.out, args.machine)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="groups a step (~1,000 in flight)")
    parser.add_argument("--small-prompts", type=int, default=6,
                        help="groups a step of the memory baseline run (~100 in flight); 0: none")
    parser.add_argument("--samples", type=int, default=16, help="episodes a group")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2, help="rollout ranks")
    parser.add_argument("--turn-tokens", type=int, default=8,
                        help="at most this many tokens a turn")
    parser.add_argument("--token-delay", type=float, default=0.1,
                        help="engine seconds a token (~0.8 s a turn by default)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also trace the Python heap (slows the runs)")
    parser.add_argument("--profile", action="store_true",
                        help="one more run under cProfile: where the loop's time goes")
    parser.add_argument("--sweep", type=float, nargs="*", default=[],
                        help="more runs of ~1,000 episodes at these seconds a token (slower "
                        "turns, fewer turns/s): the loop lag against the turn rate")
    parser.add_argument("--own-core", action="store_true",
                        help="the controller's event-loop thread alone on CPU 0, everything "
                             "else (workers, trainer, ZeroMQ's threads) on the other CPUs")
    parser.add_argument("--machine", default="", help="names the results file, e.g. 2core")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-prompts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.child:
        anyio.run(child, parsed)
    else:
        main(parsed)
