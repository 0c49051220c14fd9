"""``torchrun --nproc-per-node 2 -m asyncrl.launch run.toml``: the mixed-role launch.

Global rank 0 hosts the controller and serves trainer rank 0 in the same process; rank 1 is
rollout rank 0. Run as a real subprocess (in a session of its own, so that a hung launch can
be killed as a whole and leftovers can be found by session id).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl.procs.space import shm_dir  # noqa: E402
from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from integration_support import (  # noqa: E402
    BASE,
    merge,
    session_processes,
    to_toml,
)

pytestmark = pytest.mark.usefixtures("no_stray_processes")
TIMEOUT_S = 120



def _launch(tmp_path: Path, config: dict) -> tuple[int, str]:
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",  # = the torchrun script of this venv
        # torchrun's own log dir with the run, not a /tmp/torchelastic_* left behind
        *torchrun_log_args(str(tmp_path / "torchrun")),
        "--nproc-per-node", "2", "--standalone",
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
        left = session_processes(proc.pid)
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
    # asyncrl.launch.EVENT_LOOP = "auto": the controller on uvloop (installed with asyncrl on Linux)
    assert '"event_loop": "uvloop"' in out, out[-4000:]
    assert not list(Path("/tmp").glob(f"asyncrl-*/{run_id}")), "socket dir left behind"
    assert not os.path.exists(shm_dir(run_id)), "shm dir left behind"


@pytest.mark.parametrize("keys", ["store", "file"])
def test_mixed_launch_over_tcp(tmp_path: Path, model_dir: Path, keys: str) -> None:
    """cluster.network = "tcp": the controller's sockets and trainer rank 0's weights socket
    on TCP with CURVE; rank 1 (a supervised rollout rank) gets the keys from torchrun's store
    or from cluster.keys_file (written by ``python -m asyncrl.wire.curve``)."""
    cluster: dict = {"network": "tcp"}
    if keys == "file":
        made = subprocess.run([sys.executable, "-m", "asyncrl.wire.curve", str(tmp_path / "keys.json")],
                              capture_output=True, text=True, check=True)  # fmt: skip
        assert "mode 0600" in made.stdout
        cluster["keys_file"] = "keys.json"  # relative: resolved against the config file's dir
    rc, out = _launch(tmp_path, _config(model_dir, run={"num_steps": 2}, cluster=cluster))
    assert rc == 0, out[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert records[0]["config"]["cluster"]["network"] == "tcp"
    assert "peer_refused" not in out


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"run": {"num_stepz": 3}}, "num_stepz"),  # a typo: unknown field
        ({"cluster": {"rollout_ranks": 2}}, "cluster.rollout_ranks"),  # 1 + 2 ranks != 2
        ({"generator": {"options": {"token_dleay_s": 1}}}, "generator.options.token_dleay_s"),
    ],
    ids=["unknown-key", "world-size", "backend-option"],
)
def test_bad_config_exits_nonzero_naming_the_field(
    tmp_path: Path, model_dir: Path, change: dict, named: str
) -> None:
    rc, out = _launch(tmp_path, _config(model_dir, **change))
    assert rc != 0
    errors = [line for line in out.splitlines() if line.startswith("asyncrl: ")]
    assert len(errors) == 1 and named in errors[0] and "Fix:" in errors[0], out[-4000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no run was started


def _front_door(
    tmp_path: Path, config: dict, *, stop_after_s: float | None = None
) -> tuple[int, str]:
    """``python -m asyncrl.launch run.toml``: asyncrl runs torchrun itself."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch", str(path)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        if stop_after_s is not None:
            metrics = tmp_path / "out" / "metrics.jsonl"
            deadline = time.monotonic() + TIMEOUT_S
            while not (metrics.exists() and '"train"' in metrics.read_text()):
                assert time.monotonic() < deadline and proc.poll() is None, "no step was trained"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert session_processes(proc.pid) == []
    return proc.returncode, out


def test_front_door_keeps_exit_codes_and_prints_one_line(tmp_path: Path, model_dir: Path) -> None:
    """Without torchrun around it, ``python -m asyncrl.launch`` starts the ranks itself and
    exits with asyncrl's code: 0, 2 for a config mistake (before anything starts), 1 for a
    failed run, 128 + N for a signal; one ``asyncrl:`` line and no torchrun report."""
    rc, out = _front_door(tmp_path / "ok", _config(model_dir, run={"num_steps": 2}))
    assert rc == 0, out[-4000:]
    assert "metrics: " in out and "ChildFailedError" not in out

    rc, out = _front_door(tmp_path / "bad", _config(model_dir, grpo={"prompts_per_step": 0}))
    assert rc == 2
    assert out.strip().splitlines() == [line for line in out.strip().splitlines()
                                        if line.startswith("asyncrl: error: ")]
    assert "grpo.prompts_per_step" in out and "Fix:" in out

    crash = _config(model_dir, run={"num_steps": 50}, generator={"options": {"crash_after_groups": 3}})
    rc, out = _front_door(tmp_path / "crash", crash)
    assert rc == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("asyncrl: ")]
    assert len(errors) == 1 and "worker rollout:0 died with exit code -9" in errors[0], out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out

    slow = _config(model_dir, run={"num_steps": 1000}, eval={"num_prompts": 0},
                   generator={"options": {"token_delay_s": 0.01}})
    rc, out = _front_door(tmp_path / "term", slow, stop_after_s=0)
    assert rc == 128 + signal.SIGTERM, out[-4000:]
    assert "asyncrl: stopped by SIGTERM" in out and "Traceback" not in out


def test_slow_engine_close_does_not_fail_a_finished_run(tmp_path: Path, model_dir: Path) -> None:
    """The rollout's engine takes 3 s to close, longer than cluster.shutdown_grace_s (2 s):
    the controller's SIGTERM lands while the worker shuts down in order. The worker ignores
    it (it is already leaving), so a finished run still exits 0 (it used to exit 1: torchrun
    reported the SIGTERMed rank as the failure)."""
    rc, out = _launch(
        tmp_path,
        _config(
            model_dir,
            run={"num_steps": 2},
            cluster={"shutdown_grace_s": 2.0},
            generator={"options": {"close_delay_s": 3.0}},
        ),
    )
    assert rc == 0, out[-4000:]
    assert "asyncrl: error" not in out
    assert "worker_stopping" in (tmp_path / "out" / "logs" / "rollout-0.log").read_text()


def test_launch_restarts_a_killed_rollout_worker(tmp_path: Path, model_dir: Path) -> None:
    """Under torchrun the rollout rank supervises its worker: SIGKILL to the worker (not the
    rank) mid-run, and a new one serves within the run, which exits 0 with every step."""
    num_steps = 30  # enough steps after the kill for the worker to come back (~2 s)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(_config(
        model_dir, run={"num_steps": num_steps}, eval={"num_prompts": 0},
        generator={"options": {"token_delay_s": 0.003}},
    )) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        *torchrun_log_args(str(tmp_path / "torchrun")),  # not a /tmp/torchelastic_*
        "--standalone", "-m", "asyncrl.launch", str(path),
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "out" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().count('"train"') >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "no step was trained"
            time.sleep(0.05)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "--rank" in p.cmdline() and "rollout" in p.cmdline()]
        assert len(workers) == 1, workers  # the supervised worker, not its rank
        workers[0].kill()
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert session_processes(proc.pid) == []
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "train"]) == num_steps
    restarted = [r for r in records if r["kind"] == "worker_restarted"]
    assert [(r["worker"], r["exit_code"]) for r in restarted] == [("rollout:0", -signal.SIGKILL)]


def test_a_stopped_launch_says_where_resume_goes_on_from(tmp_path: Path, model_dir: Path) -> None:
    """SIGTERM after a checkpoint was saved: after its stop line, the launch names the newest
    checkpoint and the flag that goes on from it."""
    slow = _config(model_dir, run={"num_steps": 1000}, eval={"num_prompts": 0},
                   checkpoint={"every_steps": 1}, generator={"options": {"token_delay_s": 0.01}},
                   failures={"rollout_restarts": 0})  # the line, not restarts, is tested here
    rc, out = _front_door(tmp_path, slow, stop_after_s=0)
    assert rc == 128 + signal.SIGTERM, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("asyncrl: ")]
    assert lines[0].startswith("asyncrl: stopped by SIGTERM"), out[-4000:]
    newest = sorted((tmp_path / "out" / "checkpoints").glob("step-*"))[-1]
    assert lines[1:] == [f"asyncrl: the newest checkpoint is {newest}: add --resume to go on "
                         "from it"], out[-4000:]


@pytest.mark.fast  # the everyday tier's run through the command users type
def test_asyncrl_run_through_the_console_script(tmp_path: Path, model_dir: Path) -> None:
    """``asyncrl run CONFIG --set ...`` is the one-node launch: a run to its end (exit 0),
    and a config mistake (exit 2, one line naming the field, nothing started)."""
    exe = str(Path(sys.executable).parent / "asyncrl")
    path = tmp_path / "run.toml"
    path.write_text(to_toml(_config(model_dir)) + "\n")
    proc = subprocess.run([exe, "run", str(path), "--set", "run.num_steps=2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"metrics: {tmp_path / 'out' / 'metrics.jsonl'}" in proc.stdout
    train = [line for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line]
    assert len(train) == 2
    bad = subprocess.run([exe, "run", str(path), "--set", "grpo.prompts_per_step=0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert bad.returncode == 2
    assert bad.stderr.startswith(f"asyncrl: error: {path}: grpo.prompts_per_step: must be >= 1")
    assert "Fix:" in bad.stderr and len(bad.stderr.splitlines()) == 1
    # a plugin that is not installed is a mistake in the config too: exit 2, nothing started
    missing = subprocess.run([exe, "run", str(path), "--set", "generator.backend=nope"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert "asyncrl: error: generator.backend: no generation backend named 'nope'" in (
        missing.stderr)


def test_a_hanging_reward_ends_the_launch_with_one_line(tmp_path: Path, model_dir: Path) -> None:
    """``score()`` never returns (the repeat-digit knob): at its deadline the run stops with
    one ``asyncrl: error:`` line naming the environment's score, the prompt and the deadline,
    and the process exits although the call's thread is still stuck in it (a daemon thread,
    abandoned); nothing of the run is left."""
    hang = {"options": {"score_fault": "hang"}}
    config = _config(model_dir, run={"num_steps": 50}, eval={"num_prompts": 0},
                     environment=hang, failures={"reward_timeout_s": 1.0})  # fmt: skip
    rc, out = _front_door(tmp_path, config)  # never ends without the deadline: TIMEOUT_S guards
    assert rc == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("asyncrl: ")]
    assert len(errors) == 1, out[-4000:]
    assert errors[0].startswith(
        "asyncrl: error: environment 'repeat-digit' (environment.name): score() did not return "
        "within 1 s (failures.reward_timeout_s) for prompt 'train:"
    ), errors
    assert "Traceback" not in out
    run_id = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["run_id"]
    assert not list(Path("/tmp").glob(f"asyncrl-*/{run_id}")), "socket dir left behind"
    assert not os.path.exists(shm_dir(run_id)), "shm dir left behind"
