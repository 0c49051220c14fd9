"""A run from JSONL files and reward functions named by import path, with no plugin package,
through ``asyncrl run`` with the real engines (vLLM CPU build + FSDP2): the shipped
``examples/jsonl_arith`` config, its TensorBoard event files, and ``asyncrl plot``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from integration_support import read_tensorboard, session_processes  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "jsonl_arith"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def arith_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen") / "model", seed=0)


def test_jsonl_and_rewards_by_import_path_end_to_end(tmp_path: Path, arith_model: Path) -> None:
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(data)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    out = tmp_path / "out"
    overrides = {
        "model.path": arith_model,
        "run.output_dir": out,
        "run.num_steps": 4,
        "run.log_format": "json",
        "environment.options.train": data / "train.jsonl",
        "environment.options.eval": data / "eval.jsonl",
        "eval.num_prompts": 16,
        "grpo.prompts_per_step": 8,
        "pipeline.min_groups_for_streaming_train": 8,
        "metrics.completions_every": 2,
        "cluster.startup_timeout_s": 400,
    }
    args = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen([str(BIN / "asyncrl"), "run", str(EXAMPLE / "run.toml"), *args],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=500)
    finally:
        left = session_processes(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (stdout + stderr)[-4000:]
    assert left == [], f"processes of the run outlived it: {left}"

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        # the step's reward is the weighted sum of its components' means (1.0 and 0.1 in
        # run.toml): sums of float64 means, so equal to rounding
        assert r["reward"] == pytest.approx(r["reward/exact_match"] + 0.1 * r["reward/brevity"],
                                            abs=1e-9)  # fmt: skip
        # correct_reward = "exact_match": accuracy is the share with exact_match > 0
        assert r["accuracy"] == pytest.approx(r["reward/exact_match"], abs=1e-9)
        assert 0.0 <= r["reward/brevity"] <= 1.0
    config = next(r for r in records if r["kind"] == "config")["config"]
    assert config["environment"]["name"] == "dataset"
    assert config["environment"]["options"]["rewards"][0]["function"] == "rewards:exact_match"
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["label"] for e in evals] == ["start", "end"] and evals[0]["num_prompts"] == 16
    assert [r["step"] for r in records if r["kind"] == "completions"] == [2, 4]

    # TensorBoard: the same figures at the same steps, and the completions table
    scalars, texts = read_tensorboard(out / "tensorboard")
    assert [s for s, _ in scalars["train/reward"]] == [1, 2, 3, 4]
    for (step, value), r in zip(scalars["train/reward/exact_match"], train, strict=True):
        assert step == r["step"] and value == pytest.approx(r["reward/exact_match"], rel=1e-6)
    assert [s for s, _ in scalars["eval/accuracy"]] == [0, 4]
    tables = texts["completions/text_summary"]  # tensorboardX's tag for the "completions" text
    assert [s for s, _ in tables] == [2, 4]
    assert tables[0][1].startswith("| prompt | completion | reward | correct |")

    plot = subprocess.run([str(BIN / "asyncrl"), "plot", str(out)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    for name in ("reward.png", "staleness.png", "timeline.png", "timeline.json"):
        assert (out / "plots" / name).stat().st_size > 1000, name
