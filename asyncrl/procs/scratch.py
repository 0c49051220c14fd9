"""The launcher's scratch directory under ``/tmp``, and the sweep of those killed launchers left.

``asyncrl run`` (:func:`asyncrl.one_node.self_launch`) keeps torchrun's per-attempt
directories and rank 0's pid file in a directory of its own, ``asyncrl-torchrun-*`` in the
temporary directory, removed when it returns. A launcher killed outright (``kill -9``, the
OOM killer) cannot remove it. So the directory holds its owner's identity (``owner``: the
pid, the process's start time in clock ticks after boot, and the boot's id), and every
launch first removes the directories whose owner is gone: no such process (or a zombie), or
another process under a reused pid (another start time, or another boot). Never one of a
live launch; never one without a whole ``owner`` file (one being made, or an older
asyncrl's, whose owner cannot be told), another user's, or a link.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.procs.process import boot_id, stat_fields

__all__ = ["OWNER_FILE", "PREFIX", "identity", "scratch_dir", "sweep"]

PREFIX = "asyncrl-torchrun-"
OWNER_FILE = "owner"
"""In each scratch directory: ``<pid> <start ticks> <boot id>`` of the process that owns it."""


def identity(pid: int) -> str | None:
    """``<pid> <start ticks> <boot id>`` of live process ``pid``; ``None`` when there is no
    such process, or it has exited (a zombie)."""
    fields, boot = stat_fields(pid), boot_id()
    if fields is None or boot is None or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return f"{pid} {int(fields[19])} {boot}"  # field 22: starttime, in ticks after boot


@contextmanager
def scratch_dir(base: str | None = None) -> Iterator[str]:
    """A fresh ``asyncrl-torchrun-*`` directory in ``base`` (the temporary directory) owned
    by this process, removed on leaving; the leftovers of dead owners are swept first
    (:func:`sweep`)."""
    base = base or tempfile.gettempdir()
    sweep(base)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    try:
        own = identity(os.getpid())
        if own is not None:  # no /proc: never swept, removed on leaving as before
            tmp = os.path.join(path, f".{OWNER_FILE}.tmp")
            Path(tmp).write_text(own)
            os.replace(tmp, os.path.join(path, OWNER_FILE))  # whole or not at all
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep(base: str) -> list[str]:
    """Remove the scratch directories in ``base`` whose owner is gone; returns their paths."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        try:
            if not (entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False)
                    and entry.stat(follow_symlinks=False).st_uid == uid):  # fmt: skip
                continue
            owner = Path(entry.path, OWNER_FILE).read_text()
        except OSError:
            continue  # being made, an older asyncrl's, or gone meanwhile
        fields = owner.split(" ")
        if len(fields) != 3 or not (fields[0].isdigit() and fields[1].isdigit()):
            continue  # not written by this module: its owner cannot be told
        pid = int(fields[0])
        if identity(pid) == owner:
            continue  # its launch is live
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
