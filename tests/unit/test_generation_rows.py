"""``benchmarks/generation.py --rows``: which option rows a list of words selects."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from generation import OPTIONS, selected  # noqa: E402

FIRST = next(iter(OPTIONS))


def test_a_row_s_whole_name_selects_that_row_alone() -> None:
    # "no per-sample seed" is also part of an engine row's name
    assert list(selected("no per-sample seed")) == [FIRST, "no per-sample seed"]


def test_a_part_of_a_name_selects_every_row_holding_it() -> None:
    assert list(selected("max_num_seqs 512")) == [
        FIRST, "max_num_seqs 512, 8,192 batched tokens", "max_num_seqs 512, no per-sample seed"]


def test_no_words_select_every_row_and_a_word_naming_none_is_refused() -> None:
    assert list(selected("")) == list(OPTIONS)
    with pytest.raises(SystemExit, match="--rows: nothing like this names no row"):
        selected("nothing like this")
