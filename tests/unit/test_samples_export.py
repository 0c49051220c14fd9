"""The trained samples on disk (asyncrl/obs/sample_export.py): each line against a hand-written
one and against the batch the trainer is sent, rotation by size at step boundaries, the cut
back to a resumed step, a full disk, and the writer task off the event loop."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

from asyncrl.config import from_dict
from asyncrl.errors import NoSpaceError
from asyncrl.obs import sample_export as export
from asyncrl.obs.sample_export import SampleExport, SampleFiles, SampleLine, sample_files, step_lines
from asyncrl.policy.grpo import pack_groups
from asyncrl.policy.groups import CompletedSample, Group, Part
from asyncrl.procs import space
from asyncrl.checkpoints import directory as ckpt
from asyncrl.checkpoints.saving import Checkpointer
from asyncrl.wire.messages import SaveState


def _single(tokens: list[int], reward: float, versions: list[int] | None = None) -> CompletedSample:
    return CompletedSample(
        np.asarray(tokens, np.int32), np.linspace(-1, -0.1, len(tokens)).astype(np.float32),
        "stop", reward, reward > 0, {"exact": reward},
        versions=None if versions is None else np.asarray(versions, np.int32),
    )  # fmt: skip


def _episode(reward: float) -> CompletedSample:
    """A two-turn episode whose template split off its first turn: two sequences."""
    first = Part(
        prompt_ids=np.asarray([1, 2], np.int32), token_ids=np.asarray([7, 8, 9], np.int32),
        logprobs=np.asarray([-0.5, 0.0, -0.25], np.float32),
        loss_mask=np.asarray([1, 0, 1], np.uint8), finish_reason="stop",
        versions=np.asarray([3, -1, 4], np.int32),
    )  # fmt: skip
    return CompletedSample(
        np.asarray([11, 12], np.int32), np.asarray([-0.125, -2.0], np.float32), "max_turns",
        reward, False, loss_mask=np.asarray([0, 1], np.uint8),
        prompt_ids=np.asarray([1, 2, 7, 8, 9, 10], np.int32), earlier=(first,),
    )  # fmt: skip


def _group(gid: str, samples: list[CompletedSample], start: int = 0) -> Group:
    return Group(gid, f"train:{gid}", [1, 2], start, None, 0.0, samples=samples, index=0)


def _groups() -> list[Group]:
    return [
        _group("g0", [_single([5, 6, 2], 1.0, [0, 0, 1]), _single([4, 2], 0.0)]),
        _group("g1", [_episode(0.5), _single([3], 1.5, [2])], start=2),
    ]


def _advantages(groups: list[Group]) -> list[np.ndarray]:
    return [pack_groups(groups, normalize=False).advantages]


def test_each_line_is_a_sequence_the_trainer_is_sent() -> None:
    groups = _groups()
    batch = pack_groups(groups, normalize=False)
    lines = list(step_lines(7, groups, [batch.advantages]))
    # by hand: g0's two samples, then g1's episode (two sequences) and its single-turn sample
    assert [(x.episode, x.part, x.parts) for x in lines] == [
        ("g0/0", 0, 1), ("g0/1", 0, 1), ("g1/0", 0, 2), ("g1/0", 1, 2), ("g1/1", 0, 1)
    ]
    split, own = lines[2], lines[3]
    assert split.prompt_ids == [1, 2] and split.token_ids == [7, 8, 9]
    assert split.loss_mask == [1, 0, 1] and split.logprobs == [-0.5, 0.0, -0.25]
    assert split.versions == [3, -1, 4] and split.finish_reason == "max_turns"
    assert own.prompt_ids == [1, 2, 7, 8, 9, 10] and own.token_ids == [11, 12]
    assert own.loss_mask == [0, 1] and own.versions is None and own.start_version == 2
    assert (own.reward, own.correct, own.group, own.prompt_id) == (0.5, False, "g1", "train:g1")
    first = lines[0]
    assert first.loss_mask == [1, 1, 1] and first.versions == [0, 0, 1]
    assert first.components == {"exact": 1.0} and first.correct and first.step == 7
    # GRPO advantages by hand: g0 rewards (1, 0) -> +-0.5; g1 rewards (0.5, 1.5) -> -+0.5,
    # the episode's advantage on both its sequences
    assert [x.advantage for x in lines] == [0.5, -0.5, -0.5, -0.5, 0.5]
    # and the trainer's batch, sequence by sequence
    offsets = np.concatenate([[0], np.cumsum(batch.seq_lens)])
    responses = np.concatenate([[0], np.cumsum(batch.seq_lens - batch.prompt_lens)])
    for i, x in enumerate(lines):
        seq = batch.tokens[offsets[i]:offsets[i + 1]].tolist()
        assert seq == x.prompt_ids + x.token_ids and batch.prompt_lens[i] == len(x.prompt_ids)
        r = slice(responses[i], responses[i + 1])
        assert batch.loss_mask[r].tolist() == x.loss_mask
        np.testing.assert_array_equal(np.float32(x.logprobs), batch.behaviour_logprobs[r])
        assert np.float32(x.advantage) == batch.advantages[i]


def test_advantages_must_cover_every_sequence() -> None:
    groups = _groups()
    with pytest.raises(ValueError, match="4 advantages for 5 sequences"):
        list(step_lines(1, groups, [np.zeros(4, np.float32)]))


def _steps(path: Path) -> list[int]:
    return [step for f in sample_files(path) for step in _steps_of(f)]


def test_files_rotate_at_step_boundaries_past_the_size(tmp_path: Path) -> None:
    groups = _groups()
    files = SampleFiles(str(tmp_path), max_bytes=1)  # every step over it: a file per step
    files.keep_through(0)
    for step in (1, 2, 3):
        assert files.write_step(step, groups, _advantages(groups)) == 5
    files.close()
    names = [p.name for p in sample_files(tmp_path)]
    assert names == ["samples-00000.jsonl", "samples-00001.jsonl", "samples-00002.jsonl"]
    assert [_steps_of(p) for p in sample_files(tmp_path)] == [[1] * 5, [2] * 5, [3] * 5]
    line = (tmp_path / names[0]).read_bytes().splitlines()[0]
    assert msgspec.json.decode(line, type=SampleLine).episode == "g0/0"

    big = SampleFiles(str(tmp_path / "big"), max_bytes=10 << 20)  # all steps fit in one
    big.keep_through(0)
    for step in (1, 2, 3):
        big.write_step(step, groups, _advantages(groups))
    big.close()
    assert [p.name for p in sample_files(tmp_path / "big")] == ["samples-00000.jsonl"]
    assert _steps(tmp_path / "big") == [1] * 5 + [2] * 5 + [3] * 5


def _steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "max_bytes", [1, 1700, 10 << 20], ids=["file-per-step", "two-steps", "one-file"]
)
def test_a_resume_keeps_the_steps_of_its_checkpoint_and_goes_on(
    tmp_path: Path, max_bytes: int
) -> None:
    groups = _groups()
    files = SampleFiles(str(tmp_path), max_bytes)
    files.keep_through(0)
    for step in range(1, 7):
        files.write_step(step, groups, _advantages(groups))
    files.close()
    last = sample_files(tmp_path)[-1]
    with open(last, "ab") as f:
        f.write(b'{"step":7,"episode":"g0/0","gro')  # the process died mid-write
    # resumed from the step-3 checkpoint: steps 4-6 and the torn line go
    again = SampleFiles(str(tmp_path), max_bytes)
    cut = again.keep_through(3)
    assert cut.bytes > 0
    assert _steps(tmp_path) == [1] * 5 + [2] * 5 + [3] * 5
    for step in (4, 5):  # trained again
        again.write_step(step, groups, _advantages(groups))
    again.close()
    assert _steps(tmp_path) == [s for s in range(1, 6) for _ in range(5)]
    for path in sample_files(tmp_path):  # whole steps per file, files in order
        steps = _steps_of(path)
        assert steps == sorted(steps) and steps
    # a new run in the same directory starts afresh
    SampleFiles(str(tmp_path), max_bytes).keep_through(0)
    assert sample_files(tmp_path) == []


@pytest.mark.parametrize("how", ["short", "raise"])
def test_a_full_disk_leaves_the_last_whole_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    groups = _groups()
    files = SampleFiles(str(tmp_path), max_bytes=10 << 20)
    files.keep_through(0)
    files.write_step(1, groups, _advantages(groups))
    monkeypatch.setattr(export, "WRITE_BYTES", 200)  # step 2 in several writes: the 2nd fails
    real_write = os.write
    calls = []

    def full_disk(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data)
        n = real_write(fd, data[: len(data) // 2])
        if how == "raise":
            raise OSError(errno.ENOSPC, "No space left on device")
        return n

    monkeypatch.setattr(export.os, "write", full_disk)
    monkeypatch.setattr(space, "free_bytes", lambda path: 0)
    with pytest.raises(NoSpaceError) as err:
        files.write_step(2, groups, _advantages(groups))
    assert len(calls) == 2 and err.value.path == files.path
    assert "ENOSPC" in str(err.value) and "run.save_samples = false" in str(err.value)
    assert _steps(tmp_path) == [1] * 5
    monkeypatch.setattr(export.os, "write", real_write)  # room again
    files.write_step(2, groups, _advantages(groups))
    files.close()
    assert _steps(tmp_path) == [1] * 5 + [2] * 5


@pytest.mark.asyncio
async def test_the_writer_task_writes_each_step_put_and_flushed_waits_for_them(
    tmp_path: Path,
) -> None:
    groups = _groups()
    old = SampleFiles(str(tmp_path), 10 << 20)
    old.keep_through(0)
    for step in (1, 2, 3):
        old.write_step(step, groups, _advantages(groups))
    old.close()
    writer = SampleExport(str(tmp_path), 10 << 20)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run, 1)  # resumed from step 1
        assert _steps(tmp_path) == [1] * 5
        for step in (2, 3, 4):
            await writer.put(step, groups, _advantages(groups))
        await writer.flushed()
        assert _steps(tmp_path) == [s for s in (1, 2, 3, 4) for _ in range(5)]
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_failed_write_ends_the_writer_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = SampleExport(str(tmp_path), 10 << 20)
    groups = _groups()
    with pytest.raises(BaseException) as err:
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run, 0)
            monkeypatch.setattr(export.os, "write", full)
            await writer.put(1, groups, _advantages(groups))
            with anyio.fail_after(10):
                await writer.flushed()  # never: the error cancels the wait
    assert space.no_space_in([err.value]) is not None


@pytest.mark.asyncio
async def test_a_checkpoint_waits_for_the_samples_of_the_steps_it_covers(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainers save a checkpoint only once the samples of every step before it are in
    the files: a resume from it keeps them (it cuts only later steps)."""
    config = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(tmp_path / "out")},
        "checkpoint": {"save_model": False, "every_steps": 1, "dir": str(tmp_path / "ck")},
    })  # fmt: skip
    writer = SampleExport(config.run.output_dir, 10 << 20)
    write_step = writer.files.write_step

    def slow_write(*args: Any) -> int:  # a slow disk: the checkpoint comes first unless it waits
        time.sleep(0.3)
        return write_step(*args)

    monkeypatch.setattr(writer.files, "write_step", slow_write)
    seen: list[list[int]] = []

    class Trainers:
        async def call_each(self, workers: list[str], requests: list[Any], *, timeout_s: float):
            if isinstance(requests[0], SaveState):
                seen.append(_steps(tmp_path / "out"))
                Path(requests[0].path, "rank0.bin").write_bytes(b"w")
            return [None] * len(workers)

    saver = Checkpointer(config, control=Trainers(), trainers=["trainer:0"],  # type: ignore[arg-type]
                         metrics=None, train_prompts=(), before_save=writer.flushed)  # fmt: skip
    state = ckpt.ControllerState(step=1, finished=False, groups=[],
                                 scheduler={"ledger": {"trained": [], "num_repeated": 0}})
    groups = _groups()
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run, 0)
        await writer.put(1, groups, _advantages(groups))
        await saver.after_step(1, False, lambda: state)
        tg.cancel_scope.cancel()
    assert seen == [[1] * 5]
