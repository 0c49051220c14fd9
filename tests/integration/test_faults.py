"""The fault matrix: kill any process of a run at any phase, or signal the launcher or the
embedding host, and the run ends within 30 s with one line naming the cause, leaving no
process, no run directory and no shared memory behind.

Both ways users start a run are driven as users drive them, as real subprocesses in sessions
of their own:

* launch: ``torchrun --nproc-per-node 3 -m asyncrl.launch run.toml`` (rank 0 = controller +
  trainer:0, rank 1 = trainer:1, rank 2 = rollout:0);
* embedded: ``python examples/embed_in_asyncio.py run.toml`` (the host spawns a torchrun group
  of two trainer ranks and one of one rollout rank).

The bigram backend's testing knobs make each phase last long enough to strike in it (slow
tokens, a slow optimizer step, a slow bucket load) and mark when it starts
(``phase_marker_dir``). The vLLM engine's own processes are covered by
``tests/e2e/test_vllm_faults.py`` (backend level) and
``test_launch_vllm_engine_death_is_outlived`` in ``tests/e2e/test_system.py`` (through the
launcher).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from integration_support import (  # noqa: E402
    BASE,
    merge,
    run_files,
    run_processes,
    session_processes,
    to_toml,
)

pytestmark = [pytest.mark.usefixtures("no_stray_processes"), pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0  # from the strike to everything gone
PHASE_MARKER = {  # the marker that says a phase is under way
    "generate": "rollout-0.generate",
    "train": "trainer-0.train",
    "refit": "rollout-0.refit",
}
LAUNCH_RANKS = {"trainer:0": 0, "trainer:1": 1, "rollout:0": 2}


@dataclass
class Outcome:
    returncode: int
    output: str
    seconds: float
    lines: list[str]


def _config(
    tmp_path: Path, model_dir: Path, markers: Path, restarts: int = 3, trainers: int = 2
) -> Path:
    data = merge(
        BASE,
        {
            "run": {"num_steps": 1000, "output_dir": str(tmp_path / "out")},
            "cluster": {"trainer_ranks": trainers, "rollout_ranks": 1, "shutdown_grace_s": 5.0},
            "generator": {
                "options": {
                    "token_delay_s": 0.01,
                    "load_delay_s": 2.0,
                    "phase_marker_dir": str(markers),
                }
            },
            "trainer": {"options": {"step_delay_s": 2.0, "phase_marker_dir": str(markers)}},
            "refit": {"timeout_s": 60.0},
            "eval": {"num_prompts": 0},
            # restarting a killed rollout worker: tests/integration/test_restarts.py
            "failures": {"rollout_restarts": restarts},
        },
    )
    data["model"] = {"path": str(model_dir)}
    path = tmp_path / "run.toml"
    path.write_text(to_toml(data) + "\n")
    return path



def _start(mode: str, config: Path, log: Path, nproc: int = 3) -> subprocess.Popen[bytes]:
    if mode == "launch":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            *torchrun_log_args(str(config.parent / "torchrun")),  # not a /tmp/torchelastic_*
            "--standalone", "-m", "asyncrl.launch", str(config),
        ]
    else:
        cmd = [sys.executable, str(ROOT / "examples" / "embed_in_asyncio.py"), str(config)]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=config.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{path.name} never appeared; output:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _rank_pid(mode: str, victim: str, proc: subprocess.Popen[bytes], config: Path) -> int:
    """The pid of worker ``victim`` (``group:rank``), found by its environment."""
    group, rank = victim.split(":")
    for p in psutil.Process(proc.pid).children(recursive=True) + _spawned(config):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if mode == "launch" and env.get("RANK") == str(LAUNCH_RANKS[victim]):
            if "asyncrl.launch" in " ".join(p.cmdline()):
                return p.pid
        if mode == "embedded" and env.get("ASYNCRL_GROUP") == group and env.get("RANK") == rank:
            if "--worker" in p.cmdline():
                return p.pid
    raise AssertionError(f"no process for {victim}")


def _spawned(config: Path) -> list[psutil.Process]:
    """Processes of an embedded run (their torchrun agents run in sessions of their own)."""
    run_id = _run_id(config)
    return run_processes(run_id) if run_id else []


def _run_id(config: Path) -> str | None:
    metrics = config.parent / "out" / "metrics.jsonl"
    try:
        first = metrics.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return json.loads(first)["run_id"]


def _strike(
    tmp_path: Path, model_dir: Path, mode: str, target: str, sig: signal.Signals, phase: str,
    trainers: int = 2,
) -> tuple[Outcome, str, Path]:
    markers = tmp_path / "markers"
    config = _config(tmp_path, model_dir, markers, restarts=0 if ":" in target else 3,
                     trainers=trainers)  # fmt: skip
    log = tmp_path / "console.log"
    proc = _start(mode, config, log, nproc=trainers + 1)
    try:
        _wait_for(markers / PHASE_MARKER[phase], proc, log)
        if phase != "generate":  # the slow part of the phase has begun
            time.sleep(0.3)
        run_id = _run_id(config)
        assert run_id, "the run wrote no config record"
        if target in ("launcher", "host"):
            pid = proc.pid
        elif target == "rank0":
            pid = _rank_pid(mode, "trainer:0", proc, config)
        else:
            pid = _rank_pid(mode, target, proc, config)
        struck = time.monotonic()
        os.kill(pid, sig)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {DEADLINE_S} s after the strike:\n{log.read_text()[-4000:]}")
        # leftovers: every process of the run (launch: the session; embedded: the spawned
        # groups, found by run id), the socket directory and the shared memory
        while True:
            left = session_processes(proc.pid) + run_processes(run_id)
            files = run_files(run_id)
            if not (left or files) or time.monotonic() - struck > DEADLINE_S:
                break
            time.sleep(0.1)
        seconds = time.monotonic() - struck
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert left == [], f"processes outlived the run: {left}"
    assert files == [], f"run files left behind: {files}"
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.startswith("asyncrl: ")]
    return Outcome(proc.returncode, output, seconds, lines), run_id, config


def _report(mode: str, target: str, sig: signal.Signals, phase: str, out: Outcome) -> None:
    line = out.lines[0] if out.lines else "(none)"
    print(
        f"\nFAULT | {mode} | {target} | {sig.name} | {phase} | {out.seconds:.1f} s | "
        f"rc {out.returncode} | {line}"
    )


PHASES = ["generate", "train", "refit"]

KILLS = [
    ("launch", "rollout:0", "generate"), ("embedded", "trainer:1", "generate"),
    ("embedded", "rollout:0", "train"), ("launch", "trainer:1", "train"),
    ("launch", "rollout:0", "refit"), ("embedded", "trainer:1", "refit"),
]  # fmt: skip
"""Every pair of a mode, a victim and a phase at least once: 6 of the 12 combinations (about
11 s each on 2 cores). The path from a death to the run's one line does not depend on the
combination, only on which side sees it first, which each pair covers."""


@pytest.mark.parametrize(("mode", "victim", "phase"), KILLS)
def test_worker_killed(
    tmp_path: Path, model_dir: Path, mode: str, victim: str, phase: str
) -> None:
    out, _, config = _strike(tmp_path, model_dir, mode, victim, signal.SIGKILL, phase)
    _report(mode, victim, signal.SIGKILL, phase, out)
    assert out.returncode != 0
    assert len(out.lines) == 1, out.output[-4000:]
    group, rank = victim.split(":")
    log_path = config.parent / "out" / "logs" / f"{group}-{rank}.log"
    codes = ["-9"]
    if mode == "launch":
        # The controller reads a sibling rank's status from /proc while it is a zombie; its
        # parent, torchrun's agent, reaps it at its next monitor tick (0.1 s) and then the
        # status is gone. One CI run in about forty lost that race (issue 27's notes).
        codes.append("unknown")
    assert out.lines[0] in [
        f"asyncrl: error: worker {victim} died with exit code {code}; its log: {log_path}"
        for code in codes
    ], out.output[-4000:]


@pytest.mark.parametrize("phase", PHASES)
def test_launch_rank0_killed(tmp_path: Path, model_dir: Path, phase: str) -> None:
    """Rank 0 is the controller: rank 1 speaks for the run, the workers remove its files."""
    out, _, config = _strike(tmp_path, model_dir, "launch", "rank0", signal.SIGKILL, phase)
    _report("launch", "rank0", signal.SIGKILL, phase, out)
    assert out.returncode != 0
    assert len(out.lines) == 1, out.output[-4000:]
    assert out.lines[0].startswith("asyncrl: error: the controller (global rank 0, pid ")
    assert "exit code -9" in out.lines[0]
    assert str(config.parent / "out" / "logs" / "trainer-1.log") in out.lines[0]


def test_launch_rank0_killed_with_a_supervised_rank1(tmp_path: Path, model_dir: Path) -> None:
    """One trainer rank: rank 1 is the rollout rank, which supervises its worker (restarts
    on). torchrun SIGTERMs it right after rank 0 died; it still says the controller died."""
    out, _, config = _strike(tmp_path, model_dir, "launch", "rank0", signal.SIGKILL, "generate",
                             trainers=1)  # fmt: skip
    _report("launch", "rank0 (supervised rank 1)", signal.SIGKILL, "generate", out)
    assert out.returncode != 0
    assert len(out.lines) == 1, out.output[-4000:]
    assert out.lines[0].startswith("asyncrl: error: the controller (global rank 0, pid ")
    assert "exit code -9" in out.lines[0]
    assert str(config.parent / "out" / "logs" / "rollout-0.log") in out.lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("mode", ["launch", "embedded"])
def test_signal_to_launcher_or_host(
    tmp_path: Path, model_dir: Path, mode: str, sig: signal.Signals
) -> None:
    """SIGTERM/SIGINT to torchrun (which forwards SIGTERM to every rank) or to the embedding
    host (which turns it into cancellation): an orderly stop, one line."""
    target = "launcher" if mode == "launch" else "host"
    out, _, _ = _strike(tmp_path, model_dir, mode, target, sig, "train")
    _report(mode, target, sig, "train", out)
    assert len(out.lines) == 1, out.output[-4000:]
    assert out.lines[0].startswith("asyncrl: stopped by SIG"), out.output[-4000:]
    if mode == "embedded":
        assert out.returncode == 128 + int(sig)


def test_embedding_host_killed(tmp_path: Path, model_dir: Path) -> None:
    """The host dies outright: nobody is left to print, but the workers notice the lost
    controller, stop and remove the run's files (checked by _strike) well within 30 s."""
    out, _, _ = _strike(tmp_path, model_dir, "embedded", "host", signal.SIGKILL, "train")
    _report("embedded", "host", signal.SIGKILL, "train", out)
    assert out.returncode == -signal.SIGKILL
    assert out.lines == []
