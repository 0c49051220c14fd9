"""Reading the ``dataset`` environment's files (:mod:`asyncrl.data.dataset`): JSON Lines,
Parquet, and ``datasets`` ``save_to_disk`` directories (read with pyarrow alone).

Every problem is a ``ConfigError`` naming the option (``environment.options.train`` /
``eval``), the file and the fix; a decoding error also says where in the file: for JSON Lines
the line and the byte offset in the file (text that is not UTF-8, a line that is not JSON), for
Parquet and Arrow files the row, the column and the bytes of the file that hold it (a string
that is not UTF-8). A UTF-8 byte-order mark at the start of a JSONL file is allowed.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError, config_error

__all__ = ["OPT", "Source", "read_source"]

OPT = "environment.options"
INSTALL = "pip install 'asyncrl[data]' (or pip install pyarrow)"
RECODE = (
    "save the file as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 IN > OUT), or correct "
    "those bytes"
)


def _fail(key: str, problem: str, fix: str) -> ConfigError:
    return config_error(f"{OPT}.{key}", problem, fix)


@dataclass
class Source:
    """Rows read from one file (or one split of a directory)."""

    key: str
    """The option it came from (``train`` / ``eval``)."""
    label: str
    """The path, and the split of a DatasetDict, for messages."""
    rows: list[dict[str, Any]]
    lines: list[int] | None = None
    """A JSONL file's line number of each row."""

    def at(self, i: int) -> str:
        where = f"line {self.lines[i]}" if self.lines is not None else f"row {i}"
        return f"{self.label} {where}"


def read_source(text: str, base: Path, key: str, split: str | None, default_split: str) -> Source:
    """The rows of option ``key``'s file ``text`` (relative to ``base``): a ``.jsonl`` or
    ``.parquet`` file, or a ``save_to_disk`` directory (its ``split`` when it holds a
    DatasetDict, default ``default_split``).

    Raises:
        ConfigError: naming ``environment.options.<key>`` (or ``<key>_split``), the file, where
            in it for a decoding error, and the fix.
    """
    path = base / text
    if path.is_dir():
        return _read_saved(path, key, split, default_split)
    if split is not None:
        raise _fail(
            f"{key}_split",
            f"applies to a DatasetDict directory, not {str(path)!r}",
            f"remove {key}_split",
        )
    if not path.exists():
        raise _fail(
            key,
            f"no file {str(path)!r}",
            "give a .jsonl or .parquet file or a datasets directory, relative to the config "
            "file's directory (or environment.base_dir)",
        )
    if path.suffix == ".jsonl":
        return _read_jsonl(path, key)
    if path.suffix == ".parquet":
        return Source(key, str(path), _read_parquet(path, key))
    raise _fail(
        key,
        f"{str(path)!r} is not a .jsonl or .parquet file or a directory",
        "convert it to JSON Lines (one object per line) or Parquet",
    )


# ---------------------------------------------------------------------------------- JSON
def _read_jsonl(path: Path, key: str) -> Source:
    rows, lines = [], []
    offset = 0  # of the line in the file, in bytes
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            skip = len(codecs.BOM_UTF8) if lineno == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            line = _decode(raw, skip, key, f"{path} line {lineno}", start)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                at = start + skip + len(line[: exc.pos].encode())
                raise _fail(
                    key,
                    f"{path} line {lineno} is not JSON: {exc.msg} at column {exc.colno} "
                    f"(byte {at} of the file)",
                    'correct that line: each line holds one JSON object, e.g. {"question": '
                    '"...", "answer": "..."}',
                ) from None
            if not isinstance(row, dict):
                raise _fail(
                    key,
                    f"{path} line {lineno} is a JSON {type(row).__name__}, not an object",
                    'write one object per line, e.g. {"question": "...", "answer": "..."}',
                )
            rows.append(row)
            lines.append(lineno)
    return Source(key, str(path), rows, lines)


def _decode(raw: bytes, skip: int, key: str, where: str, start: int) -> str:
    """``raw[skip:]`` as UTF-8; ``where`` (a file and line) starts at byte ``start``."""
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.end]
        before = exc.object[max(0, exc.start - 24) : exc.start].decode("utf-8", "replace")
        column = len(exc.object[: exc.start].decode("utf-8", "replace")) + 1
        raise _fail(
            key,
            f"{where} is not UTF-8: byte {bad.hex(' ')} at byte {start + skip + exc.start} of "
            f"the file (column {column} of the line, after {before!r}; {exc.reason})",
            RECODE,
        ) from None


def _json_file(path: Path, key: str, fix: str) -> Any:
    """A JSON file of a ``save_to_disk`` directory (``state.json``, ``dataset_dict.json``)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _fail(key, f"cannot read {str(path)!r} ({exc})", fix) from None
    text = _decode(data, 0, key, str(path), 0)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = len(text[: exc.pos].encode())
        raise _fail(
            key,
            f"{path} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno} (byte {at} "
            "of the file)",
            fix,
        ) from None


# ------------------------------------------------------------------------- Parquet, Arrow
def _pyarrow(key: str, path: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise _fail(
            key, f"reading {path!r} needs pyarrow, which is not installed", INSTALL
        ) from None
    return pyarrow


def _read_parquet(path: Path, key: str) -> list[dict[str, Any]]:
    """Row group by row group, so that a string that is not UTF-8 is found with its bytes."""
    pa = _pyarrow(key, str(path))
    rows: list[dict[str, Any]] = []
    try:
        parquet = pa.parquet.ParquetFile(path)
        meta = parquet.metadata
        for g in range(meta.num_row_groups):
            table = parquet.read_row_group(g)

            def where(column: str, g: int = g) -> str:
                start, end = _chunk_bytes(meta.row_group(g), column)
                return f"row group {g}, whose column chunk is bytes {start}-{end} of the file"

            rows += _table_rows(table, key, str(path), len(rows), where)
    except (OSError, pa.ArrowException) as exc:
        problem = f"cannot read {str(path)!r} as Parquet ({exc})"
        raise _fail(key, problem, "check the file") from None
    return rows


def _chunk_bytes(group: Any, column: str) -> tuple[int, int]:
    """The bytes of row group ``group`` that hold top-level column ``column`` (all its
    leaves)."""
    spans = []
    for i in range(group.num_columns):
        chunk = group.column(i)
        if chunk.path_in_schema.split(".")[0] == column:
            first = chunk.dictionary_page_offset or chunk.data_page_offset
            spans.append((first, first + chunk.total_compressed_size))
    return min(s for s, _ in spans), max(e for _, e in spans)


def _read_saved(path: Path, key: str, split: str | None, default_split: str) -> Source:
    """A ``save_to_disk`` directory: a Dataset, or a DatasetDict's ``split``."""
    listing = path / "dataset_dict.json"
    label = str(path)
    again = "save it again with save_to_disk, or export it to .parquet"
    if listing.is_file():
        try:
            splits = list(_json_file(listing, key, again)["splits"])
        except (KeyError, TypeError) as exc:
            raise _fail(key, f"cannot read {str(listing)!r} ({exc!r})", again) from None
        pick = split if split is not None else default_split
        if pick not in splits:
            raise _fail(
                f"{key}_split",
                f"{label!r} has no split {pick!r} (its splits: {', '.join(splits)})",
                f'set {key}_split = "<one of them>"',
            )
        path, label = path / pick, f"{label} (split {pick!r})"
    elif split is not None:
        raise _fail(
            f"{key}_split", f"{label!r} is not a DatasetDict directory", f"remove {key}_split"
        )
    state = path / "state.json"
    if not state.is_file():
        raise _fail(
            key,
            f"{label!r} is a directory without state.json or dataset_dict.json",
            "give a directory written by datasets' save_to_disk, or a .jsonl/.parquet file",
        )
    pa = _pyarrow(key, label)
    rows: list[dict[str, Any]] = []
    try:
        for entry in _json_file(state, key, again)["_data_files"]:
            rows += _read_arrow_stream(pa, path / entry["filename"], key, len(rows))
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
        raise _fail(
            key,
            f"cannot read {label!r} as a datasets save_to_disk directory "
            f"({type(exc).__name__}: {exc})",
            again,
        ) from None
    return Source(key, label, rows)


def _read_arrow_stream(pa: Any, path: Path, key: str, first_row: int) -> list[dict[str, Any]]:
    """One Arrow stream file of a ``save_to_disk`` directory, batch by batch (the file's
    position after each batch bounds its bytes)."""
    rows: list[dict[str, Any]] = []
    with pa.OSFile(str(path)) as f:
        reader = pa.ipc.open_stream(f)
        end = f.tell()
        for batch in reader:
            start, end = end, f.tell()

            def where(column: str, start: int = start, end: int = end) -> str:
                return f"a record batch at bytes {start}-{end} of the file"

            rows += _table_rows(batch, key, str(path), first_row + len(rows), where)
    return rows


def _table_rows(
    table: Any, key: str, label: str, first_row: int, where: Callable[[str], str]
) -> list[dict[str, Any]]:
    """``table``'s rows as dicts; a string that is not UTF-8 is named by its row (counted
    from ``first_row`` in the file), its column and ``where(column)`` (bytes of the file)."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError as exc:
        row, column = _first_undecodable(table)
        bad = exc.object[exc.start : exc.end].hex(" ")
        raise _fail(
            key,
            f"{label} row {first_row + row}, column {column!r}, holds a string that is not "
            f"UTF-8 ({where(column)}; {exc.reason}: byte {bad})",
            "correct that value where the data comes from (or decode it from its real "
            "encoding), then write the file again",
        ) from None


def _first_undecodable(table: Any) -> tuple[int, str]:
    """The first (row, column) of ``table`` whose value does not convert to Python (a string
    that is not UTF-8), by bisection over each column in turn."""
    for name in table.column_names:
        column = table.column(name)
        if not _fails(column, 0, len(column)):
            continue
        lo, hi = 0, len(column)  # the first bad row is in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _fails(column, lo, mid - lo):
                hi = mid
            else:
                lo = mid
        return lo, name
    raise AssertionError("to_pylist() failed but no column does")  # pragma: no cover


def _fails(column: Any, offset: int, length: int) -> bool:
    try:
        column.slice(offset, length).to_pylist()
    except UnicodeDecodeError:
        return True
    return False
