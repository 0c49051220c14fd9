"""Failed checkpoint saves (:meth:`asyncrl.checkpoints.saving.Checkpointer.save`): exactly
``MAX_SAVE_FAILURES`` failures in a row stop the run, and each cause (by its errno) is told its
own fix."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import from_dict
from asyncrl.errors import NoSpaceError, RemoteCallError, RunError
from asyncrl.checkpoints import directory as ckpt
from asyncrl.checkpoints import saving
from asyncrl.checkpoints.saving import Checkpointer
from asyncrl.wire.messages import SaveState


class Trainers:
    """A control plane whose trainers fail ``SaveState`` while ``fail`` says so, with
    ``error`` (a worker's ``OSError`` arrives as its type and message, as over the wire)."""

    def __init__(self, error: OSError | None = None) -> None:
        self.error = error or OSError(errno.EIO, "Input/output error", "/ck/trainer/x.distcp")
        self.fail = True
        self.saves = 0

    async def call_each(self, workers: list[str], requests: list[Any], *, timeout_s: float):
        if isinstance(requests[0], SaveState):
            self.saves += 1
            if self.fail:
                raise RemoteCallError("trainer:0", "SaveState", type(self.error).__name__,
                                      str(self.error), "Traceback ...")  # fmt: skip
            Path(requests[0].path, "rank0.bin").write_bytes(b"w")
        return [None] * len(workers)


def _saver(tmp_path: Path, model_dir: Path, trainers: Trainers) -> Checkpointer:
    config = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(tmp_path / "out")}, "checkpoint": {"save_model": False},
    })  # fmt: skip
    return Checkpointer(config, control=trainers, trainers=["trainer:0"],  # type: ignore[arg-type]
                        metrics=None, train_prompts=())  # fmt: skip


def _state(step: int) -> ckpt.ControllerState:
    return ckpt.ControllerState(step=step, finished=False, groups=[],
                                scheduler={"ledger": {"trained": [], "num_repeated": 0}})


async def _saves_until_stopped(saver: Checkpointer, outcomes: str) -> int | None:
    """Save once per character of ``outcomes`` (``f``: the trainers fail, ``s``: they
    save); returns the number of the save that stopped the run (``None``: none did)."""
    trainers = saver.control
    for i, outcome in enumerate(outcomes, 1):
        trainers.fail = outcome == "f"  # type: ignore[attr-defined]
        try:
            await saver.save(_state(i), finished=False)
        except RunError:
            return i
    return None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("max_failures", "outcomes", "stopped_at"),
    [
        (3, "ffff", 3),  # the docs' promise: the 3rd failure in a row stops the run
        (3, "ffsffsff", None),  # a save in between starts the count again: 2, 2, then 2
        (3, "ffsfff", 6),
        (2, "ff", 2),
        (1, "ff", 1),
        (0, "ff", 1),  # 0 as 1: the first failure stops it (as before)
    ],
)
async def test_max_failures_failures_in_a_row_stop_the_run(
    tmp_path: Path, model_dir: Path, max_failures: int, outcomes: str, stopped_at: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(saving, "MAX_SAVE_FAILURES", max_failures)
    trainers = Trainers()
    saver = _saver(tmp_path, model_dir, trainers)
    assert await _saves_until_stopped(saver, outcomes) == stopped_at
    assert trainers.saves == (stopped_at or len(outcomes))
    assert saver.failures == (max(max_failures, 1) if stopped_at else 2)


@pytest.mark.anyio
async def test_the_stop_names_the_count_and_the_last_error(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(saving, "MAX_SAVE_FAILURES", 2)
    saver = _saver(tmp_path, model_dir, Trainers())
    assert await saver.save(_state(1), finished=False) is None  # type: ignore[arg-type]
    with pytest.raises(RunError) as stopped:
        await saver.save(_state(2), finished=False)
    assert str(stopped.value).startswith(
        "2 checkpoint saves in a row failed (MAX_SAVE_FAILURES = 2, "
        "asyncrl.checkpoints.saving); the last: "
        "RemoteCallError: SaveState failed on worker trainer:0: OSError: [Errno 5] "
        "Input/output error: '/ck/trainer/x.distcp'. Fix: the device or network file system "
        f"under {saver.config.checkpoint.dir} reported an I/O error"
    )
    monkeypatch.setattr(saving, "MAX_SAVE_FAILURES", 0)
    first = _saver(tmp_path / "first", model_dir, Trainers())
    with pytest.raises(RunError) as stopped:
        await first.save(_state(7), finished=False)
    assert str(stopped.value).startswith(
        "the checkpoint of step 7 could not be saved (MAX_SAVE_FAILURES = 0: the first "
        "failure stops the run); the last: RemoteCallError: "
    )


# What each cause is told (and what it must not be told), written out by hand.
FIXES = [
    (errno.EFBIG, "File too large", ["ulimit -f", "file-size limit", "4 GiB on FAT32"],
     ["writable", "free space"]),
    (errno.EACCES, "Permission denied", ["writable by this user", "ls -ld", "chown or chmod"],
     ["ulimit", "free space"]),
    (errno.EPERM, "Operation not permitted", ["writable by this user"], ["ulimit"]),
    (errno.EROFS, "Read-only file system", ["read-only file system", "remount it read-write"],
     ["writable by this user", "ulimit"]),
    (errno.EIO, "Input/output error", ["reported an I/O error", "dmesg"], ["writable", "ulimit"]),
    (errno.ENAMETOOLONG, "File name too long", ["find the cause in the error"],
     ["writable", "ulimit"]),
]  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize(("number", "text", "said", "unsaid"), FIXES,
                         ids=[errno.errorcode[f[0]] for f in FIXES])  # fmt: skip
@pytest.mark.parametrize("where", ["trainer", "controller"])
async def test_each_errno_is_told_its_own_fix(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, number: int, text: str,
    said: list[str], unsaid: list[str], where: str,
) -> None:
    """The failure on a trainer (its message over the wire) or in the controller's own write
    of the checkpoint (a local OSError)."""
    error = OSError(number, text, "/ck/.tmp-step-00000001-1/x")
    trainers = Trainers(error)
    monkeypatch.setattr(saving, "MAX_SAVE_FAILURES", 1)
    saver = _saver(tmp_path, model_dir, trainers)
    if where == "controller":
        trainers.fail = False

        def commit(*args: Any, **kwargs: Any) -> None:
            raise error

        monkeypatch.setattr("asyncrl.checkpoints.directory.commit", commit)
    with pytest.raises(RunError) as stopped:
        await saver.save(_state(1), finished=False)
    message = str(stopped.value)
    fix = message.partition(". Fix: ")[2]
    assert f"[Errno {number}] {text}" in message
    for phrase in said:
        assert phrase in fix, (phrase, fix)
    for phrase in unsaid:
        assert phrase not in fix, (phrase, fix)
    assert fix.endswith("then start again (no checkpoint was saved)")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("number", "text", "head", "fix"),
    [
        (errno.ENOSPC, "No space left on device", "no space left on device (ENOSPC) for the "
         "checkpoint of step 1 in /ck/x", "Fix: free space in "),
        (errno.EDQUOT, "Disk quota exceeded", "disk quota exceeded (EDQUOT) for the checkpoint "
         "of step 1 in /ck/x: this user's quota on that file system is used up",
         "Fix: free space within the quota (`quota -s` shows it) or ask for a larger one"),
    ],
    ids=["ENOSPC", "EDQUOT"],
)
async def test_a_full_disk_or_quota_stops_at_once_with_its_own_fix(
    tmp_path: Path, model_dir: Path, number: int, text: str, head: str, fix: str
) -> None:
    """No budget for either (MAX_SAVE_FAILURES = 3 is not used): a quota is not a full disk,
    and is not told that the file system has no room."""
    trainers = Trainers(OSError(number, text, "/ck/x"))
    saver = _saver(tmp_path, model_dir, trainers)
    with pytest.raises(NoSpaceError) as stopped:
        await saver.save(_state(1), finished=False)
    message = str(stopped.value)
    assert message.startswith(head) and fix in message, message
    assert message.endswith("then start again (no checkpoint was saved)")
    assert trainers.saves == 1 and os.path.basename(stopped.value.path) == "x"
