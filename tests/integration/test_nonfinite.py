"""Nothing non-finite is committed: whole runs of the bigram backends.

A reward of 1e308 (its square overflows float64) stops the run at the controller, naming the
reward function and the value, before any step trains on it; every checkpoint and export the
run wrote before is finite (read back with numpy and safetensors, not with asyncrl). A step
whose gradient is NaN (the bigram trainer's testing knob) is not applied: within
``failures.max_nonfinite_steps`` it is skipped and the weights stay as they were, one more
stops the run naming the likely cause."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

from asyncrl_example_backend.model import initial_table  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.errors import NonFiniteError  # noqa: E402
from integration_support import read_metrics  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

REWARDS = '''
import itertools

_calls = itertools.count(1)


def huge(completion, answer):
    """1 when the completion holds the digit; from the 41st call on, 1e308."""
    if next(_calls) > 40:
        return 1e308
    return float(answer["d"] in completion)
'''


async def _train(cfg: Config) -> asyncrl.RunSummary:
    async with asyncrl.Controller(cfg) as ctl:
        return await ctl.train()


def _arrays(run_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of every safetensors and npz file under ``run_dir``, by file and name."""
    found: dict[str, np.ndarray] = {}
    for path in sorted(run_dir.rglob("*.safetensors")):
        found.update({f"{path}:{k}": v for k, v in load_file(str(path)).items()})
    for path in sorted(run_dir.rglob("*.npz")):
        with np.load(path) as f:
            found.update({f"{path}:{k}": f[k] for k in f.files})
    return found


async def test_a_reward_of_1e308_stops_the_run_naming_it(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": d, "d": d}) + "\n" for d in "0123456789" * 4))
    (tmp_path / "rewards_huge.py").write_text(REWARDS)
    cfg = make_config(
        run={"num_steps": 6},
        environment={
            "name": "dataset",
            "options": {
                "train": str(data),
                "prompt_field": "question",
                "answer_fields": ["d"],
                "rewards": [{"function": f"{tmp_path / 'rewards_huge.py'}:huge"}],
            },
        },
        checkpoint={"every_steps": 1, "keep_last": 10},
        export={"every_steps": 1},
        eval={"num_prompts": 0},
    )
    # 16 samples a step: the 41st score comes in step 2 (or in step 1, when a group of step 2
    # completed before one of step 1)
    with pytest.raises(NonFiniteError) as err:
        await _train(cfg)
    msg = str(err.value)
    assert msg.startswith("the rewards of group ")
    assert re.search(
        r"are too large for GRPO's advantages: their (mean|standard deviation) overflows "
        r"float64.*; the largest is 1e\+308, given by environment 'dataset' \(environment.name"
        r"\), reward function 'huge' \(which returned 1e\+308\)\. No step was trained on them\.",
        msg,
    ), msg
    assert "generat" not in msg  # the generation backend is not blamed
    trained = [r["step"] for r in read_metrics(cfg) if r["kind"] == "train"]
    assert trained in ([1], [1, 2])
    arrays = _arrays(Path(cfg.run.output_dir))
    # the steps' checkpoints (trainer state and model) and exports: all finite
    kinds = {("checkpoints" in k, k.endswith(":weights"), ".safetensors:" in k) for k in arrays}
    assert {(True, True, False), (True, False, True), (False, False, True)} <= kinds
    assert len([k for k in arrays if "/hf/step-" in k]) == len(trained)
    bad = [k for k, v in arrays.items() if not np.isfinite(v).all()]
    assert bad == []


@pytest.mark.parametrize("budget", [0, 2])
async def test_nonfinite_steps_are_skipped_within_the_budget_then_stop_the_run(
    make_config: Callable[..., Config], model_dir: Path, budget: int
) -> None:
    cfg = make_config(
        run={"num_steps": 6},
        trainer={"options": {"lr": 0.5, "nan_grad_at_steps": [1, 2, 3]}},
        failures={"max_nonfinite_steps": budget},
        checkpoint={"every_steps": 1, "keep_last": 10},
        eval={"num_prompts": 0},
    )
    with pytest.raises(NonFiniteError) as err:
        await _train(cfg)
    stop = 1 + budget  # the internal index of the step that stopped the run
    msg = str(err.value)
    assert msg.startswith(f"step {stop}: the trainer's loss is ")
    assert f"and its gradient norm nan; the update was not applied (the weights are " \
           f"unchanged); {budget + 1} such steps, failures.max_nonfinite_steps = {budget}. " \
           "The step's advantages are of a sane size" in msg
    assert "likely cause is the model's state" in msg and "Fix: resume from an older" in msg
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, stop + 1))
    assert [r["nonfinite_skipped"] for r in train] == [False] + [True] * budget
    assert [np.isnan(r["grad_norm"]) for r in train] == [False] + [True] * budget

    # the trainer's state in each checkpoint, read with numpy: step 1 moved the weights, the
    # skipped steps left them as they were, and nothing was saved after the stop
    ckpts = Path(cfg.run.output_dir) / "checkpoints"
    steps = sorted(p.name for p in ckpts.glob("step-*"))
    assert len(steps) == stop
    tables = []
    for name in steps:
        with np.load(ckpts / name / "trainer" / "bigram-state.npz") as f:
            tables.append(f["weights"])
    assert not np.array_equal(tables[0], initial_table(str(model_dir), 0).astype(np.float64))
    for table in tables[1:]:
        np.testing.assert_array_equal(table, tables[0])
