"""Managed agents on a small machine: the controller's loop lag while ``gateway.agent`` runs a
Python agent per session that imports ``openai``, with and without the cap on agents at once.

    .venv/bin/python benchmarks/managed_agents.py                        # the default cap
    .venv/bin/python benchmarks/managed_agents.py --max-agents 64        # as good as none
    .venv/bin/python benchmarks/managed_agents.py --machine 2core        # both, kept in results/

A real run: the embedded :class:`asyncrl.Controller` with ``[gateway] enabled = true`` and
``agent = ["python", "agent.py"]`` (a script beside the config, started from another working
directory), the example (bigram) trainer and rollout ranks as real processes, the testing
environment ``repeat-digit`` scoring the agents' last answers. ``--prompts`` x ``--samples``
sessions a step (16 x 4 = 64) and ``pipeline.max_inflight_samples`` as many: 64 sessions are
open at once. Each agent (:data:`AGENT`) reads its prompt, makes two chat calls with the
official ``openai`` client (``max_tokens`` 8, ``--token-delay`` s a token) and exits 0.

Measured, over the whole run (``--steps`` steps, each a fresh interpreter per setting):
the loop's lag (how late a 10 ms sleep wakes on the controller's loop: p50, p99, max), each
step's ``loop_lag_p99_s`` as the run records it, the machine's load (``/proc/loadavg``: its
runnable tasks sampled every 0.5 s, mean and max, and the 1-minute average before and after),
the most agents alive at once (``agent.py`` processes, counted in ``/proc`` from a thread),
and sessions a second. The machine may be shared: the load before the run says by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

AGENT = """\
import json, sys
import openai

prompt = json.loads(sys.stdin.readline())
client = openai.OpenAI(max_retries=0)
messages = prompt["messages"]
for _ in range(2):
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "again"}]
print(messages[-2]["content"])
"""


def config(model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    sessions = args.prompts * args.samples
    return {
        "model": {"path": str(model)},
        "environment": {"name": "repeat-digit"},
        "run": {"num_steps": args.steps, "seed": 0, "output_dir": str(out)},
        "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "shutdown_grace_s": 5.0},
        "grpo": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                 "max_new_tokens": 8},
        "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 0},
                     "max_inflight_samples": sessions},
        "refit": {"bucket_size_mb": 1, "verify_every_steps": 0},
        "trainer": {"backend": "bigram", "options": {"lr": 0.5}},
        "generator": {"backend": "bigram", "options": {"token_delay_s": args.token_delay}},
        "episode": {"max_turns": 3, "max_context_tokens": 64},
        "gateway": {"enabled": True, "agent": ["python", "agent.py"],
                    "max_agents": args.max_agents},
        "failures": {"max_failed_groups": 1000},
        "eval": {"num_prompts": 0},
    }  # fmt: skip


def agents_alive() -> int:
    """``agent.py`` processes alive now (a scan of ``/proc``)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:  # the shim's ends so too
                    n += f.read().split(b"\0")[1:] == [b"agent.py", b""]
            except OSError:
                continue
    return n


def runnable() -> int:
    """Runnable tasks on the machine now (``/proc/loadavg``'s fourth field, less this one)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0]) - 1


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    import asyncrl
    from asyncrl.config import from_dict
    from asyncrl_example_backend.model import write_model_dir
    from asyncrl_gateway.config import gateway_config

    root = Path(tempfile.mkdtemp(prefix="managed-agents-"))
    conf = root / "conf"
    conf.mkdir()
    model = write_model_dir(conf / "model")
    (conf / "agent.py").write_text(AGENT)
    data = config(model, root / "run", args)
    os.chdir(root)  # not the config's directory: the agent is found from the config's
    cfg = from_dict(data, base_dir=conf)
    lags: list[float] = []
    load: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample_load() -> None:  # a thread: the scans cost the loop nothing
        while not stop.wait(0.5):
            load.append((runnable(), agents_alive()))

    async def main() -> list[dict[str, Any]]:
        async def lag_probe() -> None:
            while True:
                t = time.perf_counter()
                await anyio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)

        async with anyio.create_task_group() as tg:
            async with asyncrl.Controller(cfg) as ctl:
                tg.start_soon(lag_probe)
                steps = (await ctl.train()).steps
            tg.cancel_scope.cancel()
        return steps

    before = os.getloadavg()[0]
    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    steps = anyio.run(main)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    metrics = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r.get("kind") == "train"]
    q = lambda xs, p: float(np.quantile(xs, p))  # noqa: E731
    return {
        "max_agents": args.max_agents or "default",
        "agents_at_once_limit": gateway_config(cfg).agents_at_once(),
        "cores": len(os.sched_getaffinity(0)),
        "steps": len(steps),
        "sessions": sum(r["episodes"] for r in train),
        "sessions_failed": sum(r["episode_failed"] for r in train),
        "wall_s": wall,
        "sessions_per_s": sum(r["episodes"] for r in train) / wall,
        "loop_lag_p50_ms": 1e3 * q(lags, 0.5),
        "loop_lag_p99_ms": 1e3 * q(lags, 0.99),
        "loop_lag_max_ms": 1e3 * max(lags),
        "lag_samples": len(lags),
        "step_loop_lag_p99_ms": [round(1e3 * r["loop_lag_p99_s"], 2) for r in train],
        "runnable_mean": float(np.mean([r for r, _ in load])),
        "runnable_max": max(r for r, _ in load),
        "agents_alive_max": max(a for _, a in load),
        "loadavg_1m_before": before,
        "loadavg_1m_after": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-agents", type=int, default=None,
                   help="gateway.max_agents (0: the default); omitted: 0, then 64")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--token-delay", type=float, default=0.05)
    p.add_argument("--machine", default="",
                   help="write benchmarks/results/managed-agents-<machine>.json")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(args)))
        return
    settings = [args.max_agents] if args.max_agents is not None else [0, 64]
    results = []
    for cap in settings:
        argv = [sys.executable, __file__, "--one", "--max-agents", str(cap),
                "--prompts", str(args.prompts), "--samples", str(args.samples),
                "--steps", str(args.steps), "--token-delay", str(args.token_delay)]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"the run with max_agents={cap} failed:\n{proc.stderr[-4000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"max_agents {r['max_agents']} (limit {r['agents_at_once_limit']}, {r['cores']} "
              f"cores): loop lag p50 {r['loop_lag_p50_ms']:.2f} ms, p99 "
              f"{r['loop_lag_p99_ms']:.2f} ms, max {r['loop_lag_max_ms']:.1f} ms; per step p99 "
              f"{r['step_loop_lag_p99_ms']} ms; runnable mean {r['runnable_mean']:.1f} max "
              f"{r['runnable_max']}; agents alive max {r['agents_alive_max']}; "
              f"{r['sessions']} sessions ({r['sessions_failed']} failed) in {r['wall_s']:.1f} s; "
              f"load 1m {r['loadavg_1m_before']:.2f} before, {r['loadavg_1m_after']:.2f} after")  # fmt: skip
    if args.machine or args.out:
        sys.path.insert(0, str(Path(__file__).parent))
        from results_file import write_results

        write_results({"runs": results}, "managed-agents", args.out, args.machine)


if __name__ == "__main__":
    main()
