"""Checkpoints on disk (:mod:`asyncrl.checkpoint`): atomic commit, retention, resolution and
every way a checkpoint is refused, each with the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl import checkpoint as ckpt
from asyncrl.buffer import CompletedSample, Group


def _group(index: int) -> Group:
    rng = np.random.default_rng(index)
    samples = [
        CompletedSample(
            rng.integers(0, 50, size=5).astype(np.int32),
            -rng.random(5).astype(np.float32),
            "stop",
            float(k),
            bool(k % 2),
        )
        for k in range(3)
    ]
    return Group(f"g{index}", f"p{index}", [1, 2, index], 1, None, 0.0, samples,
                 end_version=2, index=index)  # fmt: skip


def _state(step: int, groups: list[Group] = ()) -> ckpt.ControllerState:
    return ckpt.ControllerState(
        step=step,
        finished=False,
        scheduler={"trainer_version": step, "redispatch": [[7, -1]], "ready": [],
                   "ledger": {"trained": [[0, 4 * step]], "num_repeated": 0}},
        groups=[ckpt.SavedGroup.of(g) for g in groups],
    )


def _save(root: Path, step: int, groups: list[Group] = (), **config: object) -> Path:
    tmp = ckpt.start_save(root, step)
    (tmp / ckpt.TRAINER_DIR / "rank0.bin").write_bytes(b"weights")
    return ckpt.commit(
        tmp,
        state=ckpt.encode_state(_state(step, groups)),
        step=step,
        finished=False,
        config={"run": {"seed": 0}, **config},
        model_config=None,
        has_model=False,
    )


def test_commit_round_trips_the_state_and_leaves_no_temporary(tmp_path: Path) -> None:
    groups = [_group(3), _group(5)]
    path = _save(tmp_path, 12, groups)
    assert path.name == "step-00000012"
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000012"]
    checkpoint = ckpt.open_checkpoint(path)
    state = checkpoint.state()
    assert state.step == 12 and state.scheduler["redispatch"] == [[7, -1]]
    for saved, want in zip(state.groups, groups):
        got = saved.group()
        assert (got.group_id, got.index, got.prompt_ids, got.start_version) == (
            want.group_id, want.index, want.prompt_ids, want.start_version,
        )  # fmt: skip
        for a, b in zip(got.samples, want.samples):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            assert (a.reward, a.correct, a.finish_reason) == (b.reward, b.correct, b.finish_reason)


def test_a_save_without_manifest_is_no_checkpoint_and_is_cleaned_up(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    # a crashed save: its process is gone, its directory has no manifest
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    crashed = tmp_path / f".tmp-step-00000002-{dead}"
    (crashed / "trainer").mkdir(parents=True)
    half_deleted = tmp_path / "step-00000000"
    half_deleted.mkdir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001"]
    assert ckpt.resolve("latest", tmp_path).name == "step-00000001"
    removed = ckpt.remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted([crashed.name, half_deleted.name])
    # a save in progress by a live process (this one) is left alone
    live = ckpt.start_save(tmp_path, 3)
    assert ckpt.remove_stale(tmp_path) == [] and live.exists()


def test_prune_keeps_the_newest_and_the_protected(tmp_path: Path) -> None:
    paths = [_save(tmp_path, s) for s in (1, 2, 3, 4)]
    removed = ckpt.prune(tmp_path, keep_last=2, keep=[paths[0]])
    assert [p.name for p in removed] == ["step-00000002"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000001", "step-00000003", "step-00000004",
    ]  # fmt: skip
    assert not (tmp_path / "step-00000002").exists()


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 5, [_group(1)])
    _save(tmp_path, 5)
    assert ckpt.open_checkpoint(tmp_path / "step-00000005").state().groups == []
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000005"]


def test_resolve_names_what_it_looked_at(tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .*Fix"):
        ckpt.resolve("latest", tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint there.*Fix"):
        ckpt.resolve(str(tmp_path / "nowhere"), tmp_path)
    first = _save(tmp_path, 1)
    _save(tmp_path, 2)
    assert ckpt.resolve(str(tmp_path), "unused").name == "step-00000002"
    assert ckpt.resolve(str(first), "unused") == first


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
        (lambda p: (p / "manifest.json").write_text("{}"), "manifest.json lacks format"),
        (lambda p: (p / "controller.msgpack").write_bytes(b"x"), "controller.msgpack does not match"),
        (lambda p: (p / "controller.msgpack").unlink(), "controller.msgpack is missing"),
        (lambda p: __import__("shutil").rmtree(p / "trainer"), "trainer is missing"),
    ],
    ids=["manifest-garbage", "manifest-empty", "state-changed", "state-missing", "no-trainer"],
)
def test_a_corrupt_checkpoint_is_refused_and_an_older_one_suggested(
    tmp_path: Path, damage, problem: str
) -> None:
    older = _save(tmp_path, 1)
    broken = _save(tmp_path, 2)
    damage(broken)
    with pytest.raises(ckpt.CheckpointError, match=f"corrupt: {problem}.*--resume {older}"):
        ckpt.open_checkpoint(broken).state()


def test_another_format_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(ckpt.CheckpointError, match="format 99; this asyncrl reads format 1"):
        ckpt.open_checkpoint(path)


def test_compare_configs_separates_what_must_match() -> None:
    saved = {"run": {"seed": 0, "num_steps": 10}, "trainer": {"options": {"lr": 1e-4}},
             "cluster": {"call_timeout_s": 900.0}}  # fmt: skip
    now = {"run": {"seed": 0, "num_steps": 20}, "trainer": {"options": {"lr": 3e-4}},
           "cluster": {"call_timeout_s": 60.0}}  # fmt: skip
    errors, notes = ckpt.compare_configs(saved, now)
    assert errors == ["trainer.options.lr: 0.0001 -> 0.0003"]
    assert notes == ["cluster.call_timeout_s: 900.0 -> 60.0", "run.num_steps: 10 -> 20"]
