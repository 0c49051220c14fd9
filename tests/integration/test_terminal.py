"""What ``asyncrl run`` shows on a terminal and what it leaves in plain logs: the progress bar
only on an interactive terminal, the sampled completions every N steps (a text block there, a
JSON log event in plain logs, a ``completions`` record in metrics.jsonl either way), and each
rollout worker's generation spans for ``asyncrl plot``'s per-worker lanes."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from integration_support import BASE, merge, session_processes, to_toml  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_stray_processes")
TIMEOUT_S = 120
EXE = str(Path(sys.executable).parent / "asyncrl")


def _write_config(tmp_path: Path, model_dir: Path) -> Path:
    data = merge(BASE, {
        "run": {"num_steps": 4, "output_dir": "out"},
        "cluster": {"rollout_ranks": 2},
        "metrics": {"completions_every": 2},  # COMPLETIONS_SHOWN = 3 of the step's 4 groups
    })  # fmt: skip
    data["model"] = {"path": str(model_dir)}
    path = tmp_path / "run.toml"
    path.write_text(to_toml(data) + "\n")
    return path


def _run_on_a_pty(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as its stdin, stdout and stderr (as in a shell)."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "200"}  # a terminal wide enough for every field
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)  # fmt: skip
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the run did not finish within {TIMEOUT_S} s:\n{out.decode()[-4000:]}")
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
        left = session_processes(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == [], f"processes of the run outlived it: {left}"
    return code, out.decode(errors="replace")


def test_a_terminal_gets_the_bar_and_completion_blocks(tmp_path: Path, model_dir: Path) -> None:
    config = _write_config(tmp_path, model_dir)
    code, out = _run_on_a_pty([EXE, "run", str(config)], tmp_path)
    assert code == 0, out[-4000:]
    # the bar is redrawn in place (erase-line) and reaches the last step
    assert "\r\x1b[K" in out and "step 4/4 " in out, out[-3000:]
    assert "tok/s" in out
    assert "── step 2: 3 sampled completions ──" in out
    assert "── step 4: 3 sampled completions ──" in out
    assert "    completion: " in out
    # where the time to step 1 went, as a line of text once (asyncrl run's launch as origin)
    started = [line for line in out.splitlines() if "start-up: first step " in line]
    assert len(started) == 1 and "s after the launch: launch " in started[0], out[-3000:]


def test_plain_logs_get_no_bar_and_completions_as_json(tmp_path: Path, model_dir: Path) -> None:
    config = _write_config(tmp_path, model_dir)
    proc = subprocess.run([EXE, "run", str(config)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT_S, start_new_session=True)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "\r" not in proc.stderr and "\x1b[" not in proc.stderr
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    shown = [e for e in events if e.get("event") == "sampled_completions"]
    assert [e["step"] for e in shown] == [2, 4]
    assert all(len(e["completions"]) == 3 for e in shown)
    (startup,) = [e for e in events if e.get("event") == "startup_measured"]
    assert set(startup["by_worker"]) == {"trainer:0", "rollout:0", "rollout:1"}, startup
    assert startup["first_step_s"] > startup["launch"] > 0
    text = (tmp_path / "out" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    tables = [r for r in records if r["kind"] == "completions"]
    assert [t["step"] for t in tables] == [2, 4]
    for row in tables[0]["rows"]:
        assert set(row) == {"prompt", "completion", "reward", "correct"}
        assert row["prompt"] and isinstance(row["reward"], float)
    # each step says which worker generated when; both workers took groups
    train = [r for r in records if r["kind"] == "train"]
    workers = set()
    for r in train:
        for worker, spans in r["gen_by_worker"].items():
            workers.add(worker)
            for a, b in spans:  # inside the step's own generation span
                assert r["gen_start"] - 1e-6 <= a <= b <= r["gen_end"] + 1e-6
    assert len(workers) == 2, workers
    for r in train:  # the trainers' waits for the step's data end before it does; they add
        for a, b in r["wait_spans"]:  # up to wait_s
            assert a <= b <= r["train_end"] + 1e-6
        total = sum(b - a for a, b in r["wait_spans"])
        assert total == pytest.approx(r["wait_s"], abs=1e-5)  # spans rounded to 1 us
