"""Resume as users run it: ``python -m asyncrl.launch CONFIG --resume``, SIGKILLed at random
moments (``benchmarks/kill_resume.py`` on the bigram backends), SIGUSR1 for a checkpoint on
demand, and a checkpoint that cannot be resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from integration_support import BASE, controller_pid, launch, merge, to_toml  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_stray_processes")
ROOT = Path(__file__).parents[2]
TIMEOUT_S = 300


def _config_file(tmp_path: Path, model_dir: Path, **over: dict) -> Path:
    data = merge(BASE, over)
    data["model"] = {"path": str(model_dir)}
    data["run"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "run.toml"
    path.write_text(to_toml(data) + "\n")
    return path


@pytest.mark.parametrize("environment", ["repeat-digit-turns"])
def test_killed_at_random_moments_every_prompt_is_trained_once(
    tmp_path: Path, model_dir: Path, environment: str
) -> None:
    """Four SIGKILLs, in generation, training, refit and a checkpoint save, alternately of the
    controller alone and of the whole run; each life resumes from the latest checkpoint. The
    benchmark itself checks the ledger, the staleness bound and what is left behind. The kills
    find two-turn episodes in flight: a resumed run starts each group that was in flight
    afresh (nothing of its episodes trains twice; a tool with side effects never sees a turn
    replayed). Single-turn groups were killed the same way in a case of their own until
    2026-12-08 (38 s); they are SIGKILLed mid-run in test_jobs_bigram.py's resume of jobs (one
    of them single-turn) and stopped at every phase in test_resume.py."""
    config = _config_file(
        tmp_path,
        model_dir,
        environment={"name": environment},
        run={"num_steps": 16},
        pipeline={"sampler": {"name": "gated", "max_staleness_versions": 1}},
        generator={"options": {"token_delay_s": 0.004}},
        trainer={"options": {"step_delay_s": 0.05}},
    )
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kill_resume.py"), "--config", str(config),
         "--kills", "4", "--workdir", str(tmp_path / "work"), "--out", str(out),
         "--timeout", "120"],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())["report"]
    assert report["ok"] and report["problems"] == []
    assert report["kills"] >= 3  # a kill may miss when the run ends first
    assert report["trained_positions"] == [[0, 16 * 4]]
    assert report["staleness_max"] <= 1


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return out


def test_sigusr1_saves_a_checkpoint_and_the_run_goes_on(tmp_path: Path, model_dir: Path) -> None:
    config = _config_file(
        tmp_path,
        model_dir,
        run={"num_steps": 12},
        generator={"options": {"token_delay_s": 0.01}},
        checkpoint={"at_end": False},
        eval={"num_prompts": 0},
    )
    proc = launch(config)
    # one SIGUSR1 while rank 0 is still starting (before the controller runs): it must not
    # kill it (SIGUSR1's default action), and is honoured once the run is going
    deadline = time.monotonic() + 120
    rank1_log = tmp_path / "out" / "logs" / "rollout-0.log"  # rank 1 has read the config
    while not rank1_log.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never started"
        time.sleep(0.01)
    os.kill(controller_pid(proc), signal.SIGUSR1)
    metrics = tmp_path / "out" / "metrics.jsonl"
    while not (metrics.exists() and '"train"' in metrics.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "no step was trained"
        time.sleep(0.05)
    pid = controller_pid(proc)  # the controller is global rank 0
    os.kill(pid, signal.SIGUSR1)
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    saved = [r for r in records if r["kind"] == "checkpoint"]
    assert len(saved) == 2 and saved[0]["step"] == 1, saved  # the early one: the first boundary
    assert saved[0]["step"] < saved[1]["step"] < 12 and not saved[1]["finished"]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    assert Path(saved[1]["path"], "manifest.json").is_file()


def test_resume_refusal_exits_2_with_one_line(tmp_path: Path, model_dir: Path) -> None:
    config = _config_file(tmp_path, model_dir, run={"num_steps": 2}, eval={"num_prompts": 0})
    out = _finish(launch(config, "--resume"))
    errors = [line for line in out.splitlines() if line.startswith("asyncrl: ")]
    assert len(errors) == 1 and "no checkpoint in" in errors[0] and "Fix:" in errors[0], out
    done = launch(config)
    assert "metrics:" in _finish(done) and done.returncode == 0
    again = launch(config, "--resume", "latest")
    text = _finish(again)
    assert again.returncode == 2
    assert "the run is finished. Fix: to train further, raise run.num_steps" in text, text


def test_a_changed_setting_needs_allow_changed_on_the_command_line(
    tmp_path: Path, model_dir: Path
) -> None:
    """``--resume`` with another temperature: refused with one line naming it and the flag
    (``python -m asyncrl.launch``); ``asyncrl run ... --allow-changed grpo.temperature`` goes
    on (through torchrun's ranks to the controller), and its ``resume`` record lists it."""
    config = _config_file(tmp_path, model_dir, run={"num_steps": 2}, eval={"num_prompts": 0})
    done = launch(config)
    assert "metrics:" in _finish(done) and done.returncode == 0
    change = ["--set", "grpo.temperature=3.0", "--set", "run.num_steps=3"]
    refused = launch(config, *change, "--resume")
    text = _finish(refused)
    errors = [line for line in text.splitlines() if line.startswith("asyncrl: ")]
    assert refused.returncode == 2 and len(errors) == 1, text
    assert "is from another run: grpo.temperature: 1.0 -> 3.0." in errors[0]
    assert "--allow-changed grpo.temperature " in errors[0]
    exe = Path(sys.executable).parent / "asyncrl"
    allowed = subprocess.Popen(
        [str(exe), "run", str(config), *change, "--resume", "--allow-changed",
         "grpo.temperature"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    text = _finish(allowed)
    assert allowed.returncode == 0, text[-4000:]
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in records if r["kind"] == "resume"]
    assert resume["step"] == 2 and resume["allowed_changes"] == ["grpo.temperature: 1.0 -> 3.0"]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
