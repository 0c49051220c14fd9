"""A mixture-of-experts model is refused unless the user accepts the router mismatch
(``model.allow_moe_mismatch``): asyncrl does not replay the generator's expert routes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import from_dict
from asyncrl.config.setup import moe_experts
from asyncrl.errors import ConfigError


def model(tmp_path: Path, config: dict[str, Any]) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"vocab_size": 8, **config}))
    (d / "tokenizer.json").write_text("{}")
    return d


def load(d: Path, **model_fields: Any) -> Any:
    return from_dict({"model": {"path": str(d), **model_fields},
                      "environment": {"name": "repeat-digit"}})  # fmt: skip


# the keys as the model families' config.json files spell them
MOE = [
    ({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8}, "num_experts"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "num_local_experts"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "n_routed_experts"),
    ({"model_type": "llava", "text_config": {"num_local_experts": 8}}, "num_local_experts"),
]


@pytest.mark.parametrize(("config", "key"), MOE, ids=[c["model_type"] for c, _ in MOE])
def test_a_moe_model_is_refused_naming_the_option(tmp_path: Path, config: dict, key: str) -> None:
    d = model(tmp_path, config)
    with pytest.raises(ConfigError, match=f"mixture of experts \\(config.json: {key} = ") as err:
        load(d)
    assert "model.allow_moe_mismatch = true" in str(err.value)
    assert load(d, allow_moe_mismatch=True).model.allow_moe_mismatch


@pytest.mark.parametrize("config", [
    {"model_type": "qwen2"},
    {"model_type": "qwen2", "num_experts": None},
    {"model_type": "x", "num_experts": 1},
    {"model_type": "x", "num_experts": True},
    {"model_type": "x", "text_config": None},
])  # fmt: skip
def test_a_dense_model_passes(tmp_path: Path, config: dict) -> None:
    assert moe_experts(model(tmp_path, config) / "config.json") is None
    load(model(tmp_path, config))


def test_an_unreadable_config_json_is_left_to_the_other_checks(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert moe_experts(tmp_path / "config.json") is None
    assert moe_experts(tmp_path / "missing.json") is None
