"""Fixtures of the gateway's own tests (they run without the repository's tests/: `pytest
plugins/asyncrl-gateway/tests` on an install of asyncrl and asyncrl-gateway[test] alone).
Helpers shared by several files live beside this one (``gateway_support.py``,
``gateway_model.py``)."""

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
