"""The ``jsonl`` metrics sink: ``<run.output_dir>/metrics.jsonl``, one JSON object per line
(sorted keys), flushed per record. Always on, and synchronous: ``asyncrl plot`` and
``--resume`` read this file, so it must hold every record, in order. No options."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from . import SinkPlugin, parse_options

__all__ = ["PLUGIN", "JsonlSink"]

FILENAME = "metrics.jsonl"


class _Options(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class JsonlSink:
    """Appends to ``path`` (created with its directory); the ``config`` record is written as
    a line like any other."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass  # the config record itself is a line (see log)

    def log(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _make(options: dict[str, Any], *, run_dir: str, run_name: str, run_id: str) -> JsonlSink:
    parse_options("jsonl", options, _Options)
    return JsonlSink(os.path.join(run_dir, FILENAME))


def _check(options: dict[str, Any]) -> None:
    parse_options("jsonl", options, _Options)


PLUGIN = SinkPlugin(make=_make, check_options=_check, synchronous=True)
