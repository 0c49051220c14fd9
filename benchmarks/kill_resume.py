"""Kill a run with SIGKILL at random moments, resume it each time, and check that nothing was
lost or repeated.

    .venv/bin/python benchmarks/kill_resume.py                  # the CPU demo, 20 kills
    .venv/bin/python benchmarks/kill_resume.py --kills 4 --config run.toml --set k=v ...

Each *life* is ``python -m asyncrl.launch CONFIG --resume latest`` (a fresh start while no
checkpoint exists) with ``checkpoint.every_steps`` (default 1), in a session of its own. While
the life runs, its controller log is watched; the kill lands in a phase chosen in turn:

* ``generation``: after a step's record, while the next batch is generated and nothing else;
* ``training``: right after ``step_started`` (the trainer computing the step);
* ``refit``: right after ``refit_started`` (weights on their way to the engines);
* ``checkpoint``: right after ``checkpoint_started`` (trainer and controller writing);

after a random number (0-3) of such moments, plus a random 0-5 ms. Odd kills SIGKILL the
controller (global rank 0) alone, whose workers must then stop and clean up by themselves;
even kills SIGKILL every process of the run at once (a lost machine), whose files the next
life must clean up. The phase the run was really in is read back from the log (the last phase
event before the kill). After the last kill the run goes to the end.

Checked at the end (exit code 1 if any fails):

* the final checkpoint's prompt ledger: every position of the prompt stream the run needed
  trained exactly once; nothing dropped (for samplers that waste nothing), lost or repeated;
* the staleness bound in every step record of every life;
* no process, ipc socket directory or shared-memory directory of any life left behind;

and reported: the final held-out accuracy (``--reference`` also runs the same config without
interruption for comparison), the steps redone after kills, the time lost.

Results: a markdown table on stdout and ``--out`` (default ``runs/benchmarks/kill-resume.json``).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.checkpoints import directory as ckpt  # noqa: E402
from asyncrl.config import load_config  # noqa: E402
from asyncrl.config import parse_overrides  # noqa: E402
from asyncrl.procs.space import shm_dir  # noqa: E402

PHASES = ("generation", "training", "refit", "checkpoint")
EVENTS = {
    "step_started": "training",
    "refit_started": "refit",
    "checkpoint_started": "checkpoint",
    "checkpoint_saved": "generation",
    "step_finished": "generation",
}
"""Log events that start a phase (``step_finished`` and ``checkpoint_saved``: the trainer is
idle, the engines generate)."""
_EVENT_RE = re.compile(r"\] (step_started|refit_started|checkpoint_started|checkpoint_saved|"
                       r"step_finished|run_started|run_resumed)\b(.*)$")


def _event_of(line: str) -> tuple[str | None, str]:
    """The phase event a controller log line (JSON or console) reports, and the rest."""
    if line.startswith("{"):
        try:
            data = json.loads(line)
        except ValueError:
            return None, ""
        event = data.get("event")
        rest = " ".join(f"{k}={v}" for k, v in data.items() if k != "event")
        return (event, rest) if event in EVENTS or event in ("run_started", "run_resumed") else (
            None, "")
    m = _EVENT_RE.search(line)
    return (m.group(1), m.group(2)) if m else (None, "")


class Life:
    """One launch of the run, its log, and what the log says it is doing."""

    def __init__(self, number: int, cmd: list[str], log_path: Path) -> None:
        self.number = number
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        env = dict(os.environ, PYTHONUNBUFFERED="1", ASYNCRL_LOG_LEVEL="debug")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        self.started = time.monotonic()
        self._reader = open(log_path, errors="replace")  # noqa: SIM115 - closed in close()
        self._partial = ""  # a line not complete yet
        self.events: list[tuple[float, str, str]] = []  # (monotonic time seen, event, rest)
        self.controller_pid: int | None = None
        self.run_id: str | None = None

    def poll_events(self) -> list[tuple[float, str, str]]:
        """The phase events written since the last poll (only the new bytes are read: this
        runs every few milliseconds while the log grows)."""
        *complete, self._partial = (self._partial + self._reader.read()).split("\n")
        now = time.monotonic()
        new = []
        for line in complete:
            event, rest = _event_of(line)
            if event is None:
                continue
            if event == "run_started":
                pid = re.search(r"\bpid=(\d+)", rest)
                rid = re.search(r"\brun_id=(\w+)", rest)
                self.controller_pid = int(pid.group(1)) if pid else None
                self.run_id = rid.group(1) if rid else None
            new.append((now, event, rest))
        self.events += new
        return new

    def phase(self) -> str:
        for _, event, _ in reversed(self.events):
            if event in EVENTS:
                return EVENTS[event]
        return "startup"

    def last_step(self) -> int | None:
        for _, event, rest in reversed(self.events):
            if event == "step_finished":
                m = re.search(r"\bstep=(\d+)", rest)
                return int(m.group(1)) if m else None
        return None

    def close(self) -> None:
        self._log.close()
        self._reader.close()


def _tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (torchrun puts each rank in a session of its own, so a
    process group or session does not cover the run)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill(life: Life, whole: bool) -> tuple[str, list[psutil.Process]]:
    """SIGKILL the controller alone, or every process of the run at once; returns what was
    killed and every process of the run at that moment (to check none outlives it)."""
    procs = _tree(life.proc.pid)
    if whole or life.controller_pid is None:
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        return "whole run", procs
    os.kill(life.controller_pid, signal.SIGKILL)
    return "controller", procs


def run_life(
    number: int,
    base_cmd: list[str],
    out: Path,
    checkpoint_dir: Path,
    kill: dict[str, Any] | None,
    rng: random.Random,
    timeout_s: float,
) -> dict[str, Any]:
    """One life: launch (resuming when a checkpoint exists); kill it as ``kill`` says, or let
    it finish. Returns what happened."""
    last = ckpt.latest(checkpoint_dir)
    if last is not None and ckpt.open_checkpoint(last).manifest["finished"]:
        # the previous life saved the final checkpoint before it was killed
        return {"life": number, "resumed": False, "outcome": "finished in an earlier life",
                "exit_code": 0}
    resume = last is not None
    cmd = base_cmd + (["--resume", "latest"] if resume else [])
    life = Life(number, cmd, out / f"life-{number:02d}.log")
    record: dict[str, Any] = {"life": number, "resumed": resume}
    try:
        if kill is None:
            code = life.proc.wait(timeout=timeout_s)
            life.poll_events()
            record.update(outcome="finished", exit_code=code)
            return record
        target, whole = kill["target"], kill["whole"]
        skip = rng.randint(0, 3)
        deadline = time.monotonic() + timeout_s
        while True:
            if life.proc.poll() is not None:
                life.poll_events()
                record.update(outcome="finished before the kill", exit_code=life.proc.returncode)
                return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"life {number}: no {target} phase within {timeout_s} s")
            hits = [e for _, e, _ in life.poll_events() if EVENTS.get(e) == target]
            if hits:
                if skip <= 0:
                    break
                skip -= len(hits)
            time.sleep(0.003)
        time.sleep(rng.uniform(0.0, 0.005))
        life.poll_events()
        phase, step = life.phase(), life.last_step()
        tmp_saves = list(checkpoint_dir.glob(".tmp-step-*")) if checkpoint_dir.is_dir() else []
        how, procs = _kill(life, whole)
        record.update(
            outcome="killed",
            target=target,
            phase=phase,
            killed=how,
            last_step=step,
            in_checkpoint_save=bool(tmp_saves),
            alive_s=round(time.monotonic() - life.started, 2),
        )
        # the workers of a killed controller stop by themselves; torchrun's agent follows
        _, alive = psutil.wait_procs(procs, timeout=120)
        record["left_behind"] = [p.pid for p in alive]
        for p in alive:
            p.send_signal(signal.SIGKILL)
        life.proc.wait()
        return record
    finally:
        record["run_id"] = life.run_id
        life.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples/tiny_arith.toml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--every", type=int, default=1, help="checkpoint.every_steps")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill plan")
    parser.add_argument("--workdir", default=str(ROOT / "runs/benchmarks/kill-resume"))
    parser.add_argument("--reference", action="store_true",
                        help="also run the config once without interruption")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per life")
    parser.add_argument("--out", default=str(ROOT / "runs/benchmarks/kill-resume.json"))
    args = parser.parse_args()

    work = Path(args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    sets = list(args.set) + [
        f"run.output_dir={json.dumps(str(work / 'run'))}",
        f"checkpoint.every_steps={args.every}",
    ]
    config = load_config(args.config, parse_overrides(sets))
    ckdir = Path(config.checkpoint.dir)
    base = [sys.executable, "-m", "asyncrl.launch", args.config]
    for item in sets:
        base += ["--set", item]
    rng = random.Random(args.seed)
    plan = [{"target": PHASES[i % len(PHASES)], "whole": i % 2 == 1} for i in range(args.kills)]
    lives = []
    t0 = time.monotonic()
    for i, kill in enumerate(plan + [None]):
        rec = run_life(i, base, work, ckdir, kill, rng, args.timeout)
        lives.append(rec)
        print(json.dumps(rec), flush=True)
        if rec["outcome"].startswith("finished"):
            break
    wall = time.monotonic() - t0
    if not lives[-1]["outcome"].startswith("finished"):  # the last kill missed the run's end
        lives.append(run_life(len(lives), base, work, ckdir, None, rng, args.timeout))
    report = check(config, work, lives)
    report["wall_s"] = round(wall, 1)
    if args.reference:
        ref_sets = list(args.set) + [f"run.output_dir={json.dumps(str(work / 'reference'))}"]
        ref_cmd = [sys.executable, "-m", "asyncrl.launch", args.config]
        for item in ref_sets:
            ref_cmd += ["--set", item]
        start = time.monotonic()
        subprocess.run(ref_cmd, stdout=open(work / "reference.log", "w"),
                       stderr=subprocess.STDOUT, check=True)
        report["reference"] = {
            "accuracy": _final_accuracy(work / "reference" / "metrics.jsonl"),
            "wall_s": round(time.monotonic() - start, 1),
        }
    print_report(report, lives)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"report": report, "lives": lives}, indent=1))
    return 0 if report["ok"] else 1


def _final_accuracy(metrics: Path) -> float | None:
    evals = [json.loads(x) for x in metrics.read_text().splitlines() if '"eval"' in x]
    ends = [e for e in evals if e.get("kind") == "eval" and e.get("label") == "end"]
    return ends[-1]["accuracy"] if ends else None


def check(config: Any, work: Path, lives: list[dict[str, Any]]) -> dict[str, Any]:
    problems: list[str] = []
    final = lives[-1]
    if final.get("exit_code") != 0:
        problems.append(f"the last life exited with {final.get('exit_code')}")
    steps, per_step = config.run.num_steps, config.grpo.prompts_per_step
    last = ckpt.latest(config.checkpoint.dir)
    ledger: dict[str, Any] = {}
    if last is None:
        problems.append("no checkpoint at the end")
    else:
        c = ckpt.open_checkpoint(last)
        state = c.state()
        ledger = state.scheduler["ledger"]
        if not (c.manifest["finished"] and c.step == steps):
            finished = c.manifest["finished"]
            problems.append(f"the last checkpoint is step {c.step}, finished={finished}")
        if ledger["trained"] != [[0, steps * per_step]]:
            problems.append(f"trained positions {ledger['trained']} != [[0, {steps * per_step}]]")
        dropped = {k: v for k, v in ledger["dropped"].items() if v}
        if dropped:
            problems.append(f"dropped positions: {dropped}")
        if ledger["num_repeated"]:
            twice = ledger["repeated"]
            problems.append(f"{ledger['num_repeated']} positions recorded twice: {twice}")
    records = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    bound = _bound(config)
    worst = max((r["staleness_max"] for r in train), default=0)
    if worst > bound:
        problems.append(f"staleness {worst} above the bound {bound}")
    counts: dict[int, int] = {}
    for r in train:
        counts[r["step"]] = counts.get(r["step"], 0) + 1
    missing = [s for s in range(1, steps + 1) if s not in counts]
    if missing:
        problems.append(f"steps never recorded: {missing}")
    left = [r for r in lives if r.get("left_behind") or r.get("stragglers")]
    if left:
        problems.append(f"processes left behind by lives {[r['life'] for r in left]}")
    base = Path("/tmp") / f"asyncrl-{getpass.getuser()}"
    leftovers = [
        str(p)
        for r in lives
        if r.get("run_id")
        for p in (base / r["run_id"], Path(shm_dir(r["run_id"])))
        if p.exists()
    ]
    if leftovers:
        problems.append(f"files left behind: {leftovers}")
    killed = [r for r in lives if r["outcome"] == "killed"]
    return {
        "ok": not problems,
        "problems": problems,
        "kills": len(killed),
        "phases": {p: sum(1 for r in killed if r["phase"] == p) for p in ("startup", *PHASES)},
        "killed_in_checkpoint_save": sum(1 for r in killed if r.get("in_checkpoint_save")),
        "lives": len(lives),
        "steps": steps,
        "step_records": len(train),
        "steps_redone": len(train) - len(counts),
        "staleness_max": worst,
        "staleness_bound": bound,
        "trained_positions": ledger.get("trained"),
        "accuracy": _final_accuracy(work / "run" / "metrics.jsonl"),
    }


def _bound(config: Any) -> int:
    sampler = config.sampler
    return int(sampler.max_staleness)


def print_report(report: dict[str, Any], lives: list[dict[str, Any]]) -> None:
    print("\n| life | target | phase at the kill | killed | last step | in a save | alive s |")
    print("|---|---|---|---|---|---|---|")
    for r in lives:
        if r["outcome"] == "killed":
            save = "yes" if r["in_checkpoint_save"] else ""
            print(f"| {r['life']} | {r['target']} | {r['phase']} | {r['killed']} | "
                  f"{r['last_step']} | {save} | {r['alive_s']} |")
        else:
            print(f"| {r['life']} | - | {r['outcome']} (exit {r.get('exit_code')}) | | | | |")
    print()
    for key, value in report.items():
        print(f"- {key}: {value}")


if __name__ == "__main__":
    sys.exit(main())
