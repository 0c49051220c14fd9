"""The launcher's scratch directories (asyncrl.procs.scratch): a later launch removes those
whose owner is gone (no such process, a zombie, a pid reused by another process, another
boot) and never one of a live owner, one without a whole owner file, or another name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from asyncrl.procs.scratch import OWNER_FILE, PREFIX, identity, scratch_dir, sweep


def _dir(base: Path, name: str, owner: str | None) -> Path:
    path = base / f"{PREFIX}{name}"
    (path / "torchelastic").mkdir(parents=True)  # what torchrun leaves there
    if owner is not None:
        (path / OWNER_FILE).write_text(owner)
    return path


def _gone_pid() -> int:
    """The pid of a process that exited and was reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_identity_is_pid_start_ticks_and_boot() -> None:
    pid = os.getpid()
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert identity(pid) == f"{pid} {fields[19]} {boot}"
    assert identity(_gone_pid()) is None


def test_only_the_leftovers_of_dead_owners_are_swept(tmp_path: Path) -> None:
    me = identity(os.getpid())
    assert me is not None
    pid, ticks, boot = me.split(" ")
    zombie = subprocess.Popen(["sleep", "60"])
    zombie_owner = identity(zombie.pid)  # read while it lives: its true start time
    zombie.kill()  # not reaped until the end: a zombie with that same identity
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        os.sched_yield()
    try:
        dirs = {
            "live": _dir(tmp_path, "live", me),
            "dead": _dir(tmp_path, "dead", f"{_gone_pid()} 12345 {boot}"),
            "zombie": _dir(tmp_path, "zombie", zombie_owner),
            "reused": _dir(tmp_path, "reused", f"{pid} {int(ticks) + 1} {boot}"),
            "reboot": _dir(tmp_path, "reboot", f"{pid} {ticks} another-boot-id"),
            "no-owner": _dir(tmp_path, "no-owner", None),  # being made, or an older asyncrl's
            "torn": _dir(tmp_path, "torn", f"{_gone_pid()} 12"),  # not written by asyncrl
        }
        other = tmp_path / "torchelastic_abc"  # not ours by name
        other.mkdir()
        (tmp_path / f"{PREFIX}file").write_text("")  # not a directory
        removed = sweep(str(tmp_path))
    finally:
        zombie.wait()
    gone = {"dead", "zombie", "reused", "reboot"}
    assert sorted(removed) == sorted(str(dirs[n]) for n in gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{PREFIX}{n}" for n in dirs if n not in gone] + [other.name, f"{PREFIX}file"]
    )


def test_a_scratch_dir_is_owned_by_this_process_and_goes_with_it(tmp_path: Path) -> None:
    left = _dir(tmp_path, "left", f"{_gone_pid()} 1 x")  # a killed launch's
    with scratch_dir(str(tmp_path)) as path:
        assert not left.exists()  # swept before this one was made
        assert Path(path).parent == tmp_path and Path(path).name.startswith(PREFIX)
        assert Path(path, OWNER_FILE).read_text() == identity(os.getpid())
        assert sweep(str(tmp_path)) == []  # a live owner's: kept
    assert list(tmp_path.iterdir()) == []
