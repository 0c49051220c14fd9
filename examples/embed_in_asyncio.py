"""Embed the asyncrl controller in an existing asyncio application.

The controller spawns its worker groups itself (torchrun subprocesses) and removes them, their
sockets and shared-memory files when the ``async with`` block ends — normally, on error, or
when the host cancels it. Here the host also runs a heartbeat task of its own, stops the run
early if it takes longer than ``--deadline-s``, and turns SIGTERM and SIGINT into cancellation
of its main task: the library installs no signal handlers (it is a guest in your process), so
a host that wants an orderly stop on a signal says so, as below. A host that is killed outright
(SIGKILL) cannot clean up; its workers then notice the lost controller within a second, stop
their engines, remove the run's files and exit.

    .venv/bin/python examples/embed_in_asyncio.py examples/tiny_arith.toml [--set run.num_steps=3]

Exit codes: 0 done, 1 the run failed (one ``asyncrl: error`` line), 2 a config mistake,
128 + N stopped by signal N.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import asyncrl
from asyncrl.config import parse_overrides


async def heartbeat(period_s: float) -> None:
    n = 0
    while True:
        await asyncio.sleep(period_s)
        n += 1
        print(f"[host] still serving ({n * period_s:.0f} s)", flush=True)


async def run(config: asyncrl.Config, deadline_s: float) -> None:
    beat = asyncio.create_task(heartbeat(30))  # the host's own task, owned by the host
    try:
        async with asyncio.timeout(deadline_s):
            async with asyncrl.Controller(config) as ctl:
                summary = await ctl.train()
        for e in summary.evals:
            print(f"[host] eval {e['label']}: accuracy {e['accuracy']:.3f}")
        print(f"[host] {len(summary.steps)} steps; metrics in {summary.metrics_path}")
    finally:
        beat.cancel()


async def main(config: asyncrl.Config, deadline_s: float) -> int:
    task = asyncio.current_task()
    assert task is not None
    stopped_by: list[signal.Signals] = []
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        if not stopped_by:
            stopped_by.append(sig)
            print(f"[host] {sig.name}: stopping the run in order", flush=True)
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    try:
        await run(config, deadline_s)
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        print(f"asyncrl: stopped by {stopped_by[0].name}", file=sys.stderr)
        return 128 + int(stopped_by[0])
    except asyncrl.AsyncRLError as exc:
        print(f"asyncrl: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


if __name__ == "__main__":  # vLLM's engine uses multiprocessing spawn: keep this guard
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--deadline-s", type=float, default=3600)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    try:
        cfg = asyncrl.load_config(args.config, parse_overrides(args.set))
    except asyncrl.ConfigError as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(main(cfg, args.deadline_s)))
