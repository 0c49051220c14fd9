"""Checkpoints on disk (:mod:`asyncrl.checkpoints.directory`): atomic commit, retention, resolution,
checksums of every file, and every way a checkpoint is refused, each with the fix."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import structlog

from asyncrl.checkpoints import directory as ckpt
from asyncrl.policy.groups import CompletedSample, Group, Part


def _part(rng: np.random.Generator) -> Part:
    return Part(
        rng.integers(0, 50, size=4).astype(np.int32), rng.integers(0, 50, size=3).astype(np.int32),
        -rng.random(3).astype(np.float32), np.array([1, 0, 1], np.uint8), "stop",
    )  # fmt: skip


def _group(index: int) -> Group:
    rng = np.random.default_rng(index)
    samples = [
        CompletedSample(
            rng.integers(0, 50, size=5).astype(np.int32),
            -rng.random(5).astype(np.float32),
            "stop",
            float(k),
            bool(k % 2),
            # sample 1 is multi-turn: tokens 1-2 were an inserted observation; sample 2 an
            # episode with its own prompt and a sequence its template split off before
            loss_mask=np.array([1, 0, 0, 1, 1], np.uint8) if k == 1 else None,
            prompt_ids=np.array([9, 8, 7], np.int32) if k == 2 else None,
            earlier=(_part(rng),) if k == 2 else (),
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
        fingerprints=None,
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
            for field in ("loss_mask", "prompt_ids"):
                got_array, want_array = getattr(a, field), getattr(b, field)
                if want_array is None:
                    assert got_array is None
                else:
                    assert got_array.dtype == want_array.dtype
                    np.testing.assert_array_equal(got_array, want_array)
            assert len(a.earlier) == len(b.earlier)
            for p, q in zip(a.earlier, b.earlier):
                for field in ("prompt_ids", "token_ids", "logprobs", "loss_mask"):
                    got_array, want_array = getattr(p, field), getattr(q, field)
                    assert got_array.dtype == want_array.dtype
                    np.testing.assert_array_equal(got_array, want_array)
                assert p.finish_reason == q.finish_reason


def test_a_format_2_state_without_loss_masks_loads_with_every_token_training(
    tmp_path: Path,
) -> None:
    """What format 2 wrote: each saved sample an array of five (no loss mask). Rebuilt here
    from the msgpack of a current state by dropping the sixth element of every sample."""
    import msgspec

    from asyncrl.policy.grpo import pack_groups

    raw = msgspec.msgpack.decode(ckpt.encode_state(_state(4, [_group(3)])))
    raw["format"] = 2
    for group in raw["groups"]:
        group[-1] = [sample[:5] for sample in group[-1]]
    state = ckpt.decode_state(msgspec.msgpack.encode(raw))
    restored = state.groups[0].group()
    assert [(s.loss_mask, s.prompt_ids, s.earlier) for s in restored.samples] == [
        (None, None, ())] * 3
    assert pack_groups([restored], normalize=True).loss_mask.tolist() == [1] * 15
    # and a format-2 manifest is still resumed
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    old = {k: v for k, v in manifest.items() if k != "manifest_sha256"} | {"format": 2}
    canonical = json.dumps(old, sort_keys=True, separators=(",", ":")).encode()
    old["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (path / "manifest.json").write_text(json.dumps(old))
    assert ckpt.open_checkpoint(path).manifest["format"] == 2


def _dead_pid() -> str:
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def test_a_save_without_manifest_is_no_checkpoint_and_is_cleaned_up(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    # a crashed save: its process is gone, its directory has no manifest
    crashed = tmp_path / f".tmp-step-00000002-{_dead_pid()}"
    (crashed / "trainer").mkdir(parents=True)
    deleting = tmp_path / f".trash-step-00000000-{_dead_pid()}-7"  # an interrupted deletion
    (deleting / "trainer").mkdir(parents=True)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001"]
    assert ckpt.resolve("latest", tmp_path).name == "step-00000001"
    removed = ckpt.remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted([crashed.name, deleting.name])
    # a save in progress by a live process (this one) is left alone
    live = ckpt.start_save(tmp_path, 3)
    assert ckpt.remove_stale(tmp_path) == [] and live.exists()


def _lose_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()


def test_a_checkpoint_without_its_manifest_is_kept_and_named(tmp_path: Path) -> None:
    """The issue's case: the newest checkpoint lost its manifest.json. Nothing deletes it
    (its trainer state included); each start warns naming it; --resume latest (or the
    directory of checkpoints) refuses to pass over it, naming it and the older checkpoint to
    resume explicitly; an older one without its manifest is only warned about."""
    older = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    _lose_manifest(newest)
    with structlog.testing.capture_logs() as logs:
        assert ckpt.remove_stale(tmp_path) == []
    assert (newest / "trainer" / "rank0.bin").read_bytes() == b"weights"
    [warning] = [e for e in logs if e["event"] == "checkpoint_without_manifest_kept"]
    assert warning["log_level"] == "warning" and warning["paths"] == [str(newest)]
    assert warning["problem"].startswith("no manifest.json: its files cannot be checked")
    for spec in ("latest", str(tmp_path)):
        with pytest.raises(ckpt.CheckpointError, match=(
            rf"^checkpoint {re.escape(str(newest))} is corrupt: it has no manifest\.json, so "
            r"none of its files can be checked \(a save never leaves a checkpoint so: it was "
            r"lost or deleted since\)\. It is newer than step-00000001 and kept as it is\. "
            rf"Fix: resume from an older checkpoint, e\.g\. --resume {re.escape(str(older))}$"
        )):  # fmt: skip
            ckpt.resolve(spec, tmp_path)
    assert ckpt.resolve(str(older), tmp_path) == older  # named, the older one resumes
    assert (newest / "trainer" / "rank0.bin").exists()
    # with no checkpoint at all beside it: refused too, with a fresh start as the fix
    alone = tmp_path / "alone"
    _lose_manifest(_save(alone, 4))
    with pytest.raises(ckpt.CheckpointError, match=r"newer than every checkpoint and kept as "
                       r"it is\. Fix: start the run again without --resume$"):  # fmt: skip
        ckpt.resolve("latest", alone)
    # once a newer checkpoint exists, the broken one is only an older directory
    _save(tmp_path, 3)
    assert ckpt.resolve("latest", tmp_path).name == "step-00000003"
    assert newest.exists()


def test_retention_neither_counts_nor_deletes_what_is_no_checkpoint(tmp_path: Path) -> None:
    """keep_last = 2 over checkpoints 1-4, beside step 5 without its manifest and a set-aside
    step 2: the two newest checkpoints are 3 and 4, so 1 and 2 go, and only they."""
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)
    _lose_manifest(tmp_path / "step-00000005")
    aside = tmp_path / "step-00000002.rejected-no-manifest"
    (aside / "trainer").mkdir(parents=True)
    removed = ckpt.prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002.rejected-no-manifest", "step-00000003", "step-00000004", "step-00000005",
    ]  # fmt: skip
    assert ckpt.remove_stale(tmp_path) == [] and aside.exists()


def test_an_interrupted_deletion_leaves_no_directory_without_a_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention renames a checkpoint out of the step-* names before deleting it: a crash
    in the deletion (here: it never happens) leaves a .trash-* directory, removed on start,
    never a step-* directory without its manifest (which is kept now: damage)."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: None)
    assert [p.name for p in ckpt.prune(tmp_path, keep_last=1)] == ["step-00000001"]
    assert ckpt.without_manifest(tmp_path) == []
    [trash] = [p for p in tmp_path.iterdir() if p.name != "step-00000002"]
    assert trash.name.startswith(".trash-step-00000001-") and (trash / "manifest.json").exists()
    monkeypatch.undo()
    assert ckpt.remove_stale(tmp_path) == [trash] and not trash.exists()


def test_a_save_of_a_broken_checkpoint_s_step_sets_it_aside(tmp_path: Path) -> None:
    """A run resumed from an older checkpoint saves the step of the one that lost its
    manifest: that one is renamed beside it, with a warning, never deleted; a second time
    gets the next free name. A checkpoint of the same step with its manifest is replaced."""
    broken = _save(tmp_path, 5, [_group(1)])
    _lose_manifest(broken)
    for n, name in enumerate(["step-00000005.rejected-no-manifest",
                              "step-00000005.rejected-no-manifest-2"]):  # fmt: skip
        with structlog.testing.capture_logs() as logs:
            path = _save(tmp_path, 5)
        assert ckpt.open_checkpoint(path).state().groups == []  # the new save
        aside = tmp_path / name
        assert (aside / "trainer" / "rank0.bin").read_bytes() == b"weights"
        [warning] = [e for e in logs if e["event"] == "checkpoint_set_aside"]
        assert warning["log_level"] == "warning"
        assert (warning["path"], warning["moved_to"]) == (str(path), str(aside))
        assert warning["problem"] == "no-manifest"
        _lose_manifest(path)
    _save(tmp_path, 5)  # its manifest lost at the loop's end: set aside a third time
    _save(tmp_path, 5)  # with its manifest: replaced, nothing more set aside
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000005", "step-00000005.rejected-no-manifest",
        "step-00000005.rejected-no-manifest-2", "step-00000005.rejected-no-manifest-3",
    ]  # fmt: skip


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
    # a later format keeps the manifest's own digest: of the other keys, as compact sorted JSON
    future = {k: v for k, v in manifest.items() if k != "manifest_sha256"} | {"format": 99}
    canonical = json.dumps(future, sort_keys=True, separators=(",", ":")).encode()
    future["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (path / "manifest.json").write_text(json.dumps(future))
    with pytest.raises(ckpt.CheckpointError, match="format 99; this asyncrl reads formats 2 and 3"):
        ckpt.open_checkpoint(path)


def test_a_format_1_checkpoint_is_refused_naming_the_version_that_reads_it(
    tmp_path: Path,
) -> None:
    """What asyncrl before per-file checksums wrote (the keys of its manifest)."""
    path = tmp_path / "step-00000003"
    (path / "trainer").mkdir(parents=True)
    (path / "controller.msgpack").write_bytes(b"x")
    old = {"format": 1, "step": 3, "finished": False, "asyncrl_version": "0.0.9",
           "controller_sha256": "0" * 64, "controller_bytes": 1, "has_model": False,
           "model_config": None, "config": {}}  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"format 1; this asyncrl reads formats 2 and 3 \(format 2 added a checksum of "
        r"every file.*3 the loss masks.*Fix: resume or export it with the asyncrl version that "
        r"wrote it \(0\.0\.9\)",
    ):
        ckpt.open_checkpoint(path)


def _full_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint with every kind of part: two trainer ranks' files (one in a
    subdirectory, as DeepSpeed writes them) and a model directory."""
    tmp = ckpt.start_save(root, step)
    trainer = tmp / ckpt.TRAINER_DIR
    (trainer / "__0_0.distcp").write_bytes(np.arange(3000, dtype=np.float32).tobytes())
    (trainer / "global_step3").mkdir()
    (trainer / "global_step3" / "rank1_states.pt").write_bytes(bytes(range(256)) * 40)
    (trainer / ".metadata").write_bytes(b"dcp-metadata" * 10)
    model = tmp / ckpt.MODEL_DIR
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (model / "model.safetensors").write_bytes(b"\x08" + b"\0" * 4095)
    return ckpt.commit(
        tmp, state=ckpt.encode_state(_state(step)), step=step, finished=False,
        config={"run": {"seed": 0}}, fingerprints={"environment": {"data": "x"}},
        has_model=True,
    )  # fmt: skip


def _flip(path: Path, offset: int | None = None) -> bytes:
    """Flip every bit of one byte (the middle one by default); returns the old contents."""
    data = path.read_bytes()
    at = len(data) // 2 if offset is None else offset
    path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    return data


def test_every_file_has_a_checksum_and_a_flipped_byte_in_any_is_refused(tmp_path: Path) -> None:
    older = _full_checkpoint(tmp_path, 2)
    path = _full_checkpoint(tmp_path, 3)
    checkpoint = ckpt.open_checkpoint(path)
    on_disk = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
    )
    # every file but the manifest (which carries its own digest) is listed, with its digest
    assert sorted(checkpoint.manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    for rel, entry in checkpoint.manifest["files"].items():
        data = (path / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    checkpoint.verify()  # intact
    for rel in checkpoint.manifest["files"]:
        original = _flip(path / rel)
        with pytest.raises(
            ckpt.CheckpointError,
            match=rf"corrupt: {re.escape(rel)} does not match its sha256 in the manifest\. "
            rf"Fix: resume from an older checkpoint, e\.g\. --resume {re.escape(str(older))}$",
        ):
            ckpt.open_checkpoint(path).verify()
        (path / rel).write_bytes(original)
    # the controller's state is checked on its own too (read without verify())
    original = _flip(path / "controller.msgpack")
    with pytest.raises(ckpt.CheckpointError, match="controller.msgpack does not match"):
        checkpoint.state()
    (path / "controller.msgpack").write_bytes(original)
    # the manifest: a flipped byte inside a value, and one that leaves it valid JSON
    text = (path / "manifest.json").read_text()
    at = text.index('"step": 3') + len('"step": ')
    (path / "manifest.json").write_text(text[:at] + "4" + text[at + 1 :])
    with pytest.raises(ckpt.CheckpointError, match="corrupt: manifest.json does not match its "
                       "own sha256"):  # fmt: skip
        ckpt.open_checkpoint(path)
    _flip(path / "manifest.json", offset=0)  # "{" is no more
    with pytest.raises(ckpt.CheckpointError, match="corrupt: manifest.json is unreadable"):
        ckpt.open_checkpoint(path)


def test_missing_truncated_and_extra_files_are_refused(tmp_path: Path) -> None:
    path = _full_checkpoint(tmp_path, 3)
    shard = path / "trainer" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-4096])
    with pytest.raises(ckpt.CheckpointError, match=r"trainer/__0_0.distcp has 7904 bytes, the "
                       r"manifest 12000"):  # fmt: skip
        ckpt.open_checkpoint(path).verify()
    shard.unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"trainer/__0_0.distcp is missing\. Fix"):
        ckpt.open_checkpoint(path).verify()
    shard.write_bytes(data)
    (path / "trainer" / "global_step3" / "stray.pt").write_bytes(b"?")
    with pytest.raises(ckpt.CheckpointError, match="trainer/global_step3/stray.pt is not in "
                       "the manifest"):  # fmt: skip
        ckpt.open_checkpoint(path).verify()


def test_a_copy_of_the_model_is_checked_against_the_manifest(tmp_path: Path) -> None:
    import shutil

    older = _full_checkpoint(tmp_path, 2)
    path = _full_checkpoint(tmp_path, 3)
    checkpoint = ckpt.open_checkpoint(path)
    copy = tmp_path / "copy"
    shutil.copytree(path / "model", copy)
    checkpoint.verify_copy("model", copy)
    _flip(copy / "model.safetensors")
    with pytest.raises(
        ckpt.CheckpointError,
        match=rf"corrupt: model/model.safetensors does not match its sha256 in the manifest\. "
        rf"Fix: export an older checkpoint, e\.g\. asyncrl export {re.escape(str(older))} OUT",
    ):
        checkpoint.verify_copy("model", copy)
