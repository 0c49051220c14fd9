"""Kill rollout workers of a running launch and check that the run outlives them.

``python -m asyncrl.launch CONFIG`` runs; each time a few steps have been trained, one victim
is SIGKILLed, in turn: the rollout worker process itself, then its engine's process (vLLM's
EngineCore; a worker whose engine runs in-process is killed itself). The next kill waits
until the worker is back (its ``worker_restarted`` record). The run must then finish on its
own: exit 0, every step trained, every prompt position trained once (the ledger), the
staleness bound kept, and the restarts recorded with how long each took.

    python benchmarks/restart.py --kills 3 --set run.num_steps=120
    python benchmarks/restart.py --config examples/tiny_arith_gpu.toml --kills 2

Results: a markdown table on stdout and ``--out`` (JSON). ``failures.rollout_restarts`` must
allow the kills (``--kills`` at most its value, 3 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]


def _records(metrics: Path) -> list[dict[str, Any]]:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return out


def _victim(launch: int, engine: bool) -> psutil.Process | None:
    """The supervised rollout worker (``--worker rollout --rank``), or its engine's process:
    its child named like vLLM's engine core (``VLLM::EngineCore``, ``EngineCore_DP0``; the
    name is cut at 15 characters), else its largest child that is not a helper (the
    backend's reaper, multiprocessing's resource tracker)."""
    for p in psutil.Process(launch).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "--rank" not in cmd or "rollout" not in cmd or "--worker" not in cmd:
            continue
        if not engine:
            return p
        candidates = []
        for c in p.children():
            try:
                text = c.name() + " " + " ".join(c.cmdline())
                if "reaper" in text or "resource_tracker" in text:
                    continue
                if "Engine" in text:
                    return c
                candidates.append((c.memory_info().rss, c))
            except psutil.Error:
                continue
        return max(candidates, key=lambda x: x[0])[1] if candidates else p
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples/tiny_arith.toml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=3,
                        help="steps trained between a worker's return and the next kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workdir", default=str(ROOT / "runs/benchmarks/restart"))
    parser.add_argument("--out", default=str(ROOT / "runs/benchmarks/restart.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from asyncrl.config import load_config
    from asyncrl.config import parse_overrides

    work = Path(args.workdir)
    sets = args.set + [f"run.output_dir={work}", "checkpoint.every_steps=0",
                       "checkpoint.at_end=false", "export.at_end=false"]
    config = load_config(args.config, parse_overrides(sets))
    metrics = work / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    rng = random.Random(args.seed)
    cmd = [sys.executable, "-m", "asyncrl.launch", args.config]
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, ASYNCRL_LOG_LEVEL="debug")
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "launch.log", "wb")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    kills: list[dict[str, Any]] = []
    try:
        for k in range(args.kills):
            engine = k % 2 == 1
            wait_for = len([r for r in _records(metrics) if r["kind"] == "train"])
            wait_for += args.steps_between
            while len([r for r in _records(metrics) if r["kind"] == "train"]) < wait_for:
                if proc.poll() is not None or time.monotonic() - start > args.timeout:
                    raise SystemExit(f"the run ended or stalled before kill {k + 1}")
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.3))  # land anywhere in a step: generating, refitting
            victim = _victim(proc.pid, engine)
            if victim is None:
                raise SystemExit("no rollout worker found (failures.rollout_restarts = 0?)")
            step = len([r for r in _records(metrics) if r["kind"] == "train"])
            name = " ".join(victim.cmdline())[:40] or victim.name()
            victim.send_signal(signal.SIGKILL)
            kills.append({"kill": k + 1, "victim": "engine" if engine else "worker",
                          "process": name, "after_step": step})
            print(f"kill {k + 1}: SIGKILL {name} (pid {victim.pid}) after step {step}",
                  flush=True)
            while len([r for r in _records(metrics) if r["kind"] == "worker_restarted"]) <= k:
                if proc.poll() is not None or time.monotonic() - start > args.timeout:
                    raise SystemExit(f"the worker did not come back after kill {k + 1}")
                time.sleep(0.05)
        code = proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - start)))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    report = check(config, metrics, kills, code, time.monotonic() - start)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    return 0 if report["ok"] else 1


def check(config: Any, metrics: Path, kills: list[dict[str, Any]], code: int,
          seconds: float) -> dict[str, Any]:
    records = _records(metrics)
    train = [r for r in records if r["kind"] == "train"]
    ledger = next((r["epochs"] for r in reversed(records) if r["kind"] == "ledger"), [])
    restarts = [r for r in records if r["kind"] == "worker_restarted"]
    for kill, rec in zip(kills, restarts):
        kill.update(back_s=rec["seconds"], exit_code=rec["exit_code"],
                    error=rec["error"][:100])
    bound = config.sampler.max_staleness
    evals = [r for r in records if r["kind"] == "eval"]
    report = {
        "config": str(config.run.name), "exit_code": code, "seconds": round(seconds, 1),
        "steps": len(train), "num_steps": config.run.num_steps,
        "trained_positions": sum(e["trained"] for e in ledger),
        "lost": sum(e["lost"] for e in ledger), "repeated": sum(e["repeated"] for e in ledger),
        "staleness_max": max((r["staleness_max"] for r in train), default=None),
        "staleness_bound": bound,
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "kills": kills,
    }
    report["ok"] = (
        code == 0 and len(train) == config.run.num_steps and len(restarts) == len(kills)
        and report["lost"] == 0 and report["repeated"] == 0
        and report["trained_positions"] == config.run.num_steps * config.grpo.prompts_per_step
        and (bound is None or (report["staleness_max"] or 0) <= bound)
    )
    return report


def print_report(report: dict[str, Any]) -> None:
    print("\n| kill | victim | process | after step | back in s | exit code |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in report["kills"]:
        print(f"| {k['kill']} | {k['victim']} | {k['process']} | {k['after_step']} | "
              f"{k.get('back_s', '?')} | {k.get('exit_code', '?')} |")
    print(f"\nexit {report['exit_code']} after {report['seconds']} s; steps {report['steps']}/"
          f"{report['num_steps']}; positions trained {report['trained_positions']} (lost "
          f"{report['lost']}, repeated {report['repeated']}); staleness max "
          f"{report['staleness_max']} (bound {report['staleness_bound']}); final accuracy "
          f"{report['final_accuracy']}; {'OK' if report['ok'] else 'FAILED'}")


if __name__ == "__main__":
    sys.exit(main())
