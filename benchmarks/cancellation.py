"""How fast a cancellation reaches what it cancels: issue 24's requirement is 1 s (p99) for an
evicted episode's engine request and running tool. The tests hold their cancellations to that
bound; this measures the latencies themselves, over many more trials than a test can afford.

    .venv/bin/python benchmarks/cancellation.py                       # ~75 s on 2 cores
    .venv/bin/python benchmarks/cancellation.py --trials 100          # a look
    .venv/bin/python benchmarks/cancellation.py --busy 2 --machine 2core-busy2

Each path is driven by the very function its unit test calls (``tests/unit/test_tools.py``,
``tests/unit/test_episodes.py``), on the real event loop and the real classes:

- ``tool``: a caller blocked in a coroutine tool is cancelled; until the tool's ``finally``;
- ``tool in blocking()``: the same for a tool blocked in :func:`asyncrl.env.toolbox.blocking`
  (a daemon thread);
- ``episode request``: an episode's deadline strikes while its turn is in flight; until the
  abort of that turn's request is sent (the :class:`~asyncrl.run.episodes.EpisodeRunner` on
  the real live groups and rollout phase, the workers played by the test's harness);
- ``episode tool``: the group of an episode in a tool call is aborted; until the tool's
  ``finally``.

``--busy N`` runs N processes that spin on a core beside the measurement, as other work on the
machine does: the tail then is the OS's scheduling. Prints p50, p99 and max per path and
writes them (``--out``; with ``--machine``, ``benchmarks/results/cancellation-<machine>.json``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

import asyncrl.obs.log
from results_file import ROOT, write_results  # benchmarks/, beside this script

sys.path.insert(0, str(ROOT / "tests" / "unit"))  # the tests' drivers of each path

from test_episodes import CANCEL_BOUND_S, request_abort_latency, tool_cancel_latency  # noqa: E402
from test_tools import blocking_cancel_latencies, tool_cancel_latencies  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    """Nearest rank, as the tests and a step's metrics compute it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def repeated(trial: Callable[[], Awaitable[float]], trials: int) -> list[float]:
    return [await trial() for _ in range(trials)]


async def measure(trials: int) -> dict[str, list[float]]:
    return {
        "tool": (await tool_cancel_latencies(trials))[0],
        "tool in blocking()": (await blocking_cancel_latencies(trials))[0],
        "episode request": await repeated(request_abort_latency, trials),
        "episode tool": await repeated(tool_cancel_latency, trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000, help="cancellations per path")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside it")
    parser.add_argument("--machine", default="", help="keep as results/cancellation-MACHINE")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # each episode-request trial ends an episode at its deadline: one warning apiece
    asyncrl.obs.log.configure("console", level="error")  # a program's choice
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]  # fmt: skip
    try:
        start = time.perf_counter()
        latencies = anyio.run(measure, args.trials, backend="asyncio")
        seconds = time.perf_counter() - start
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    rows = []
    print(f"{'path':>20} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  ({args.trials} trials each, "
          f"{args.busy} busy processes, {os.cpu_count()} CPUs)")  # fmt: skip
    for path, values in latencies.items():
        row = {"path": path, "trials": len(values), "p50_ms": quantile(values, 0.5) * 1e3,
               "p99_ms": quantile(values, 0.99) * 1e3, "max_ms": max(values) * 1e3}  # fmt: skip
        rows.append(row)
        print(f"{path:>20} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f} {row['max_ms']:>8.3f}")
    print(f"requirement: p99 under {CANCEL_BOUND_S * 1e3:.0f} ms; {seconds:.0f} s in all")
    write_results({"rows": rows, "trials": args.trials, "busy": args.busy,
                   "bound_ms": CANCEL_BOUND_S * 1e3, "cpus": os.cpu_count(),
                   "cpu": platform.processor() or platform.machine(),
                   "loadavg_at_end": os.getloadavg()[0],
                   "date": time.strftime("%Y-%m-%d")}, "cancellation", args.out,
                  args.machine)  # fmt: skip


if __name__ == "__main__":
    main()
