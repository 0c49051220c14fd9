"""The ``dataset`` environment's files that do not decode: each error names the option, the
file, the line (or row and column) and the byte offset in the file, with a fix about the
file's encoding or that line. Offsets are checked against the file's own bytes (where the bad
bytes or the JSON mistake sit), not against the code's arithmetic."""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc  # noqa: F401  (pa.ipc)
import pyarrow.parquet as pq
import pytest

from asyncrl.data.dataset import make_environment
from asyncrl.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

REWARD = "def exact(completion, answer):\n    return completion == str(answer['solution'])\n"


def env_from(tmp_path: Path, train: str, **options: Any) -> Any:
    (tmp_path / "rw_files.py").write_text(REWARD)
    rewards = [{"function": "rw_files.py:exact"}]
    opts = {"train": train, "prompt_field": "question", "rewards": rewards}
    return make_environment({**opts, **options}, 0, base_dir=tmp_path)


def error_of(tmp_path: Path, train: str, **options: Any) -> str:
    with pytest.raises(ConfigError) as err:
        env_from(tmp_path, train, **options)
    message = str(err.value)
    assert "\n" not in message
    return message


def jsonl(*rows: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


# ------------------------------------------------------------------------------- JSONL
def test_a_byte_that_is_not_utf8_names_the_line_and_its_offset(tmp_path: Path) -> None:
    """The issue's case: a Latin-1 'é' (0xe9) on line 3 of a JSONL file."""
    good = jsonl({"question": "1+1", "solution": 2}, {"question": "caf\u00e9?", "solution": 3})
    bad_line = '{"question": "caf\u00e9 au lait", "solution": 4}\n'.encode("latin-1")
    data = good + bad_line + jsonl({"question": "2+2", "solution": 4})
    (tmp_path / "t.jsonl").write_bytes(data)
    offset = data.index(b"\xe9 au")  # the file's own bytes say where it is
    assert offset == 35 + 38 + 17  # by hand: line 1, line 2 ('é' is 2 bytes), '{"question": "caf'
    path = tmp_path / "t.jsonl"
    assert error_of(tmp_path, "t.jsonl") == (
        f"environment.options.train: {path} line 3 is not UTF-8: byte e9 at byte {offset} of "
        "the file (column 18 of the line, after '{\"question\": \"caf'; invalid continuation "
        "byte). Fix: save the file as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 IN > OUT), "
        "or correct those bytes."
    )


def test_a_multibyte_character_cut_at_the_end_of_a_line(tmp_path: Path) -> None:
    data = jsonl({"question": "a", "solution": 1}) + b'{"question": "\xe2\x82"}\n'
    (tmp_path / "t.jsonl").write_bytes(data)
    message = error_of(tmp_path, "t.jsonl")
    offset = data.index(b"\xe2\x82")
    assert f"line 2 is not UTF-8: byte e2 82 at byte {offset} of the file" in message


def test_a_line_that_is_not_json_names_the_byte_offset(tmp_path: Path) -> None:
    """The mistake comes after a two-byte character: the offset counts bytes, not characters."""
    bad = '{"question": "\u00e9t\u00e9", "solution": }\n'.encode()
    data = jsonl({"question": "1+1", "solution": 2}) + bad
    (tmp_path / "t.jsonl").write_bytes(data)
    offset = data.index(b"}\n", data.index(b"\n") + 1)  # the '}' where a value should be
    assert offset == 35 + 32 + 2  # by hand: line 1, 32 characters before '}', 2 of them 2 bytes
    message = error_of(tmp_path, "t.jsonl")
    assert message == (
        f"environment.options.train: {tmp_path / 't.jsonl'} line 2 is not JSON: Expecting value "
        f"at column 33 (byte {offset} of the file). Fix: correct that line: each line holds one "
        'JSON object, e.g. {"question": "...", "answer": "..."}.'
    )


def test_a_utf8_byte_order_mark_is_allowed_and_counted(tmp_path: Path) -> None:
    rows = jsonl({"question": "1+1", "solution": 2}, {"question": "2+2", "solution": 4})
    (tmp_path / "t.jsonl").write_bytes(codecs.BOM_UTF8 + rows)
    env = env_from(tmp_path, "t.jsonl")
    assert [p.text for p in env.dataset("train")] == ["1+1", "2+2"]
    bad = codecs.BOM_UTF8 + b'{"question": x}\n'
    (tmp_path / "b.jsonl").write_bytes(bad)
    says = f"line 1 is not JSON: Expecting value at column 14 (byte {bad.index(b'x')} of the file)"
    assert says in error_of(tmp_path, "b.jsonl")


# ------------------------------------------------------------------------- Parquet, Arrow
def strings(values: list[bytes]) -> pa.Array:
    """A string array holding exactly these bytes (pyarrow does not check them)."""
    return pa.array(values, type=pa.binary()).view(pa.string())


def span(message: str) -> tuple[int, int]:
    found = re.search(r"bytes (\d+)-(\d+) of the file", message)
    assert found, message
    return int(found.group(1)), int(found.group(2))


def test_parquet_names_the_row_column_and_bytes(tmp_path: Path) -> None:
    """Six rows in three row groups, row 4's question not UTF-8; no compression or dictionary,
    so its bytes appear as they are in the file, inside the span the error gives."""
    questions = [b"q0", b"q1", b"q2", b"q3", b"r\xe9ponse", b"q5"]
    table = pa.table({"question": strings(questions), "solution": list(range(6))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2, compression="none",
                   use_dictionary=False)  # fmt: skip
    message = error_of(tmp_path, "t.parquet")
    assert message.startswith(
        f"environment.options.train: {tmp_path / 't.parquet'} row 4, column 'question', holds a "
        "string that is not UTF-8 (row group 2, whose column chunk is bytes "
    )
    assert message.endswith(
        "invalid continuation byte: byte e9). Fix: correct that value where the data comes from "
        "(or decode it from its real encoding), then write the file again."
    )
    start, end = span(message)
    assert start <= (tmp_path / "t.parquet").read_bytes().index(b"r\xe9ponse") < end


def test_parquet_nested_chat_messages(tmp_path: Path) -> None:
    contents = strings([b"hi", b"ok", b"bad \xff", b"fine"])
    messages = pa.StructArray.from_arrays(
        [pa.array(["user"] * 4), contents], names=["role", "content"]
    )
    chats = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3, 4], pa.int32()), messages)
    table = pa.table({"chat": chats, "solution": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "c.parquet", compression="none", use_dictionary=False)
    message = error_of(tmp_path, "c.parquet", prompt_field=None, messages_field="chat")
    assert "c.parquet row 2, column 'chat', holds a string that is not UTF-8 (row group 0" in (
        message
    )
    start, end = span(message)
    assert start <= (tmp_path / "c.parquet").read_bytes().index(b"bad \xff") < end


def test_a_saved_dataset_names_its_arrow_file_row_and_bytes(tmp_path: Path) -> None:
    """A save_to_disk directory of two Arrow stream files (as datasets writes them, batches of
    two rows): the second file's row 3 is not UTF-8; the split's row is 5 + 3."""
    saved = tmp_path / "ds"
    saved.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    parts = [[b"a", b"b", b"c", b"d", b"e"], [b"f", b"g", b"h", b"caf\xe9", b"j"]]
    schema = pa.schema([("question", pa.string()), ("solution", pa.int64())])
    for name, questions in zip(names, parts):
        with pa.OSFile(str(saved / name), "wb") as f, pa.ipc.new_stream(f, schema) as w:
            for i in range(0, 5, 2):  # batches built apart: each holds only its own bytes
                chunk = questions[i : i + 2]
                w.write_batch(pa.record_batch([strings(chunk), pa.array(range(len(chunk)))],
                                              schema=schema))  # fmt: skip
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    message = error_of(tmp_path, "ds")
    assert message.startswith(
        f"environment.options.train: {saved / names[1]} row 8, column 'question', holds a "
        "string that is not UTF-8 (a record batch at bytes "
    )
    start, end = span(message)
    assert start <= (saved / names[1]).read_bytes().index(b"caf\xe9") < end


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"_data_files": [\n  {"filename": x}]}',
         "is not JSON: Expecting value at line 2 column 16"),
        (b'{"_data_files": "\xff"}', "is not UTF-8: byte ff at byte 17 of the file"),
    ],
)
def test_a_saved_dataset_whose_state_does_not_decode(
    tmp_path: Path, content: bytes, says: str
) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_bytes(content)
    message = error_of(tmp_path, "ds")
    assert message.startswith(f"environment.options.train: {tmp_path / 'ds' / 'state.json'} {says}")
    if "JSON" in says:
        assert f"(byte {content.index(b'x')} of the file)" in message
