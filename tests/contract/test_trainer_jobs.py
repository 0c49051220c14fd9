"""Jobs on one trainer (docs/jobs.md): the fsdp2 backend with ``job_slots`` under real torchrun
(two ranks, gloo), driven through the backend's API.

Two jobs open beside the run's own adapter, each with its own seed and learning rate; their
steps are open at once and their chunks interleave. Each job's adapter must end exactly as the
same job trained alone on a trainer of its own (bit for bit: a step of one job that touched the
other's gradients, optimizer or adapter would show), the run's own adapter untouched, and the
adapters sent under PEFT's saved names, the slot's name dropped. A job saved after a step
and loaded into another slot of a new trainer goes on exactly as if it had never stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncrl_arith.model import build_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

RANK_SCRIPT = Path(__file__).with_name("_jobs_rank.py")
A, B = ["a", 1, 0.05], ["b", 2, 0.02]
INTERLEAVED = [
    ["begin", "a", 1], ["begin", "b", 1], ["chunk", "a", 1, [0, 1, 2, 3, 4, 5]],
    ["chunk", "b", 1, [6, 7, 8, 9, 10, 11]], ["chunk", "a", 1, [12, 13, 14, 15]],
    ["finish", "b", 1], ["finish", "a", 1],
    ["begin", "a", 2], ["chunk", "a", 2, [2, 4, 6, 8]], ["begin", "b", 2],
    ["chunk", "b", 2, [1, 3, 5]], ["finish", "a", 2],
    ["save", "a", "a-beside-b"],  # b's step is open: a's state is a's alone, and saves
    ["finish", "b", 2],
]  # fmt: skip


def alone(job: str) -> list[list]:
    return [op for op in INTERLEAVED if op[1] == job and op[0] != "save"]


def run_ranks(tmp: Path, model_dir: Path, tag: str, opened: list, ops: list) -> dict:
    config = {
        "model": {"path": str(model_dir), "dtype": "bfloat16"},
        "environment": {"name": "arithmetic"},
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "trainer": {"backend": "fsdp2", "options": {"job_slots": 2, "lr": 0.01}},
    }  # fmt: skip
    spec = {"config": config, "out": str(tmp), "tag": tag, "open": opened, "ops": ops,
            "vocab_size": 51}  # fmt: skip
    path = tmp / f"spec-{tag}.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(RANK_SCRIPT), str(path)]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    out = json.loads((tmp / f"{tag}.json").read_text())
    out["adapters"] = {job: dict(np.load(tmp / f"{tag}-{job}.npz"))
                       for job in ["run", *(j for j, _, _ in opened)]}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny", seed=7)


@pytest.fixture(scope="module")
def solo(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each job trained alone on a trainer of its own; a saves its state after step 1 (into
    ``job-a`` under ``out``) and goes on."""
    out = tmp_path_factory.mktemp("solo")
    a = [op for op in alone("a") if op[2] == 1] + [["save", "a", "job-a"]]
    a += [op for op in alone("a") if op[2] == 2]
    return {"a": run_ranks(out, model_dir, "solo-a", [A], a),
            "b": run_ranks(out, model_dir, "solo-b", [B], alone("b")), "out": out}  # fmt: skip


def test_interleaved_jobs_train_as_each_alone(model_dir: Path, tmp_path: Path, solo) -> None:
    both = run_ranks(tmp_path, model_dir, "both", [A, B], INTERLEAVED)
    for job, _, lr in (A, B):
        mine = both["adapters"][job]
        ref = solo[job]["adapters"][job]
        assert mine.keys() == ref.keys() and len(mine) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
        assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in mine)
        assert not any(".job" in k or ".default." in k for k in mine)  # PEFT's saved names
        worst = max(float(np.abs(mine[k] - ref[k]).max()) for k in mine)
        assert worst == 0.0, f"job {job}: interleaved differs from alone by {worst}"
        assert any(np.abs(v).max() > 0 for k, v in mine.items() if ".lora_B." in k)  # it trained
        steps = [r for r in both["results"] if r[0] == job]
        assert [r[1] for r in steps] == [1, 2] and all(r[4] == lr for r in steps)
    a, b = both["adapters"]["a"], both["adapters"]["b"]
    assert any(np.abs(a[k] - b[k]).max() > 0 for k in a)  # two seeds, two policies
    run = both["adapters"]["run"]  # the run's own adapter: never stepped, lora_B still zero
    assert all(np.abs(v).max() == 0 for k, v in run.items() if ".lora_B." in k)


def test_a_job_saved_and_loaded_into_another_slot_goes_on_as_if_never_stopped(
    model_dir: Path, solo
) -> None:
    """Job a (AdamW) saved after its first step; a new trainer opens b first, so a gets the
    other slot, loads its state there and takes its second step: its adapter ends bit for bit
    as a's uninterrupted run, and with its learning rate from the checkpoint."""
    second = [op for op in alone("a") if op[2] == 2]
    moved = ["a", 99, 0.5]  # another seed and lr: the checkpoint's must win
    resumed = run_ranks(solo["out"], model_dir, "resumed", [B, moved],
                        [["load", "a", "job-a"], *second])  # fmt: skip
    want, got = solo["a"]["adapters"]["a"], resumed["adapters"]["a"]
    assert want.keys() == got.keys()
    worst = max(float(np.abs(want[k] - got[k]).max()) for k in want)
    assert worst == 0.0, f"the resumed job differs by {worst}"
    assert [r[4] for r in resumed["results"]] == [A[2]]
