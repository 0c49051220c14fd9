"""The ``jsonl`` metrics sink: ``<run.output_dir>/metrics.jsonl``, one JSON object per line
(sorted keys), flushed per record. Always on, and synchronous: ``asyncrl plot`` and
``--resume`` read this file, so it must hold every record, in order. No options.

Lines are whole: each is one ``write`` to the file; one that fails (a full disk) or is cut
short is truncated away, so the file ends with the last whole record, and a full file
system raises :class:`~asyncrl.errors.NoSpaceError`. A file whose last line was torn anyway
(a crash mid-write, an older version) has that line cut when it is opened again (a resumed
run), so the next record starts a line of its own.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from typing import Any

import msgspec
import structlog

from asyncrl.procs.space import is_no_space, no_space
from asyncrl.sinks import SinkPlugin, parse_options

__all__ = ["PLUGIN", "JsonlSink", "cut_torn_line"]

log = structlog.get_logger("asyncrl.metrics")

FILENAME = "metrics.jsonl"


class _Options(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


def cut_torn_line(fd: int) -> int:
    """Truncate the file open as ``fd`` after its last newline (a last line without one was
    torn by a crash or a full disk); returns the bytes cut."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - 4096)
        chunk = os.pread(fd, end - start, start)
        if start + len(chunk) == size and chunk.endswith(b"\n"):
            return 0  # whole
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    os.ftruncate(fd, end)
    return size - end


class JsonlSink:
    """Appends to ``path`` (created with its directory), one ``write`` per line, after
    cutting a torn last line; the ``config`` record is written as a line like any other.
    One writer at a time (the run directory's)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            cut = cut_torn_line(self._fd)
            self._size = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            raise
        if cut:
            log.warning("metrics_torn_line_cut", path=path, bytes=cut,
                        hint="the last line was cut short by an earlier run (a crash or a full "
                        "disk); it is removed so that the next record starts a line")

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass  # the config record itself is a line (see log)

    def log(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line, whole or not at all.

        Raises:
            NoSpaceError: the file system is full (nothing of the line is left).
            OSError: another failed write (nothing of the line is left either).
        """
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a short write: the disk filled up within the line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        except OSError as exc:
            os.ftruncate(self._fd, self._size)  # back to the last whole line
            if not is_no_space(exc):
                raise
            raise no_space(
                self.path, len(data), "a metrics record in",
                "free space on that file system, or point run.output_dir at one with more "
                "room, then resume (the file ends with the last whole record)",
            ) from None
        self._size += written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _make(options: dict[str, Any], *, run_dir: str, run_name: str, run_id: str) -> JsonlSink:
    parse_options("jsonl", options, _Options)
    return JsonlSink(os.path.join(run_dir, FILENAME))


def _check(options: dict[str, Any]) -> None:
    parse_options("jsonl", options, _Options)


PLUGIN = SinkPlugin(make=_make, check_options=_check, synchronous=True)
