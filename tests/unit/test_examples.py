"""The reward functions and data preparation the example recipes ship, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[2]


def _load(relative: str) -> ModuleType:
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem + "_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_rewards() -> None:
    r = _load("examples/gsm8k_qwen/rewards.py")
    answer = {"answer": "1234"}
    assert r.correct("So 1,200 + 34 = 1,234.\n#### 1,234", answer) == 1.0
    assert r.correct("#### 1234.0", answer) == 1.0
    assert r.correct("#### 12 then #### 1234", answer) == 1.0  # the last one counts
    assert r.correct("The answer is 1234", answer) == 0.0  # no #### line
    assert r.correct("#### 1235", answer) == 0.0
    assert r.correct("#### -3", {"answer": "-3"}) == 1.0
    assert r.formatted("work\n#### 7") == 1.0
    assert r.formatted("#### 7\nand more words") == 0.0
    assert r.formatted("") == 0.0


def test_gsm8k_final_number() -> None:
    prepare = _load("examples/gsm8k_qwen/prepare.py")
    assert prepare.final_number("Natalia sold 48/2 = 24 clips.\n#### 1,072") == "1072"


def test_jsonl_arith_rewards() -> None:
    r = _load("examples/jsonl_arith/rewards.py")
    assert r.exact_match("46 \n", {"answer": "46"}) == 1.0
    assert r.exact_match(" 46", {"answer": "46"}) == 0.0
    assert r.brevity("46") == 1.0 and r.brevity("123456") == 0.5 and r.brevity("1234567890") == 0
