"""Unit-test fixtures. Plain helpers shared by several files live in modules beside this one
(``schedule_support.py``, ``fake_workers.py``, ``scoring_support.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The least model directory a config accepts: ``config.json`` (a vocabulary of 8) and an
    empty ``tokenizer.json``; nothing loads weights from it."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 8}))
    (d / "tokenizer.json").write_text("{}")
    return d
