"""Embed the asyncrl controller in an existing asyncio application.

The controller spawns its worker groups itself (torchrun subprocesses) and removes them, their
sockets and shared-memory files when the ``async with`` block ends — normally, on error, or
when the host cancels it. Here the host also runs a heartbeat task of its own and stops the
run early if it takes longer than ``--deadline-s``.

    .venv/bin/python examples/embed_in_asyncio.py examples/tiny_arith.toml
"""

from __future__ import annotations

import argparse
import asyncio

import asyncrl


async def heartbeat(period_s: float) -> None:
    n = 0
    while True:
        await asyncio.sleep(period_s)
        n += 1
        print(f"[host] still serving ({n * period_s:.0f} s)", flush=True)


async def main(config_path: str, deadline_s: float, overrides: dict) -> None:
    config = asyncrl.load_config(config_path, overrides)
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


if __name__ == "__main__":  # vLLM's engine uses multiprocessing spawn: keep this guard
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--deadline-s", type=float, default=3600)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    asyncio.run(main(args.config, args.deadline_s, {"run.num_steps": args.steps} if args.steps else {}))
