"""``torchrun --nproc-per-node 2 -m asyncrl.launch run.toml``: the mixed-role launch.

Global rank 0 hosts the controller and serves trainer rank 0 in the same process; rank 1 is
rollout rank 0. Run as a real subprocess (in a session of its own, so that a hung launch can
be killed as a whole and leftovers can be found by session id).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl.refit import shm_dir  # noqa: E402
from integration_support import BASE, merge  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_stray_processes")
TIMEOUT_S = 120


def _toml(data: dict, prefix: str = "") -> str:
    """Just enough TOML for the run configs used here (tables, scalars, inline arrays)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    lines += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
    for key, value in tables.items():
        lines.append(_toml(value, f"{prefix}.{key}" if prefix else key))
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return found


def _launch(tmp_path: Path, config: dict) -> tuple[int, str]:
    path = tmp_path / "run.toml"
    path.write_text(_toml(config) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",  # = the torchrun script of this venv
        "--nproc-per-node", "2", "--master-port", str(_free_port()),
        "-m", "asyncrl.launch", str(path),
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the launch did not finish within {TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        left = _session_processes(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == [], f"processes of the launch outlived it: {left}"
    return proc.returncode, out


def _config(model_dir: Path, **over: dict) -> dict:
    data = merge(BASE, over)
    data["model"] = {"path": str(model_dir)}
    data["run"]["output_dir"] = "out"  # relative: resolved against the config file's dir
    return data


def test_mixed_launch_runs_to_completion(tmp_path: Path, model_dir: Path) -> None:
    num_steps = 3
    rc, out = _launch(tmp_path, _config(model_dir, run={"num_steps": num_steps}))
    assert rc == 0, out[-4000:]
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert f"metrics: {metrics}" in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    assert all(r["staleness_max"] <= 1 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(e["label"], e["version"]) for e in evals] == [("start", 0), ("end", num_steps)]
    # rank 1 (rollout 0) logs to its file; rank 0 (controller + trainer 0) to the console
    assert "worker_ready" in (tmp_path / "out" / "logs" / "rollout-0.log").read_text()
    run_id = next(r["run_id"] for r in records if r["kind"] == "config")
    assert f'"run_id": "{run_id}"' in out
    assert not list(Path("/tmp").glob(f"asyncrl-*/{run_id}")), "socket dir left behind"
    assert not os.path.exists(shm_dir(run_id)), "shm dir left behind"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"run": {"num_stepz": 3}}, "num_stepz"),  # a typo: unknown field
        ({"cluster": {"rollout_ranks": 2}}, "cluster.rollout_ranks"),  # 1 + 2 ranks != 2
    ],
    ids=["unknown-key", "world-size"],
)
def test_bad_config_exits_nonzero_naming_the_field(
    tmp_path: Path, model_dir: Path, change: dict, named: str
) -> None:
    rc, out = _launch(tmp_path, _config(model_dir, **change))
    assert rc != 0
    assert named in out, out[-4000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no run was started
