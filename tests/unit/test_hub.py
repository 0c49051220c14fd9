"""Models named by their Hugging Face Hub id, found offline in a populated local cache: the
config's loading, a worker on another node, and ``asyncrl check-config`` as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import from_dict
from asyncrl.config.hub import hub_id, localize
from asyncrl.errors import ConfigError

MAIN = "a" * 40
V2 = "b" * 40


def snapshot(hub: Path, repo: str, commit: str, *, ref: str = "main") -> Path:
    """One commit of ``repo`` in a Hugging Face cache at ``hub``, laid out as
    ``huggingface_hub`` lays it out (``models--<owner>--<name>/refs/<ref>`` holds the commit,
    ``snapshots/<commit>/`` the files): a model directory's two files that loading reads."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    files = root / "snapshots" / commit
    files.mkdir(parents=True)
    (files / "config.json").write_text(json.dumps({"model_type": "qwen2", "commit": commit}))
    (files / "tokenizer.json").write_text("{}")
    return files


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache holding ``org/tiny`` at ``main`` and at tag ``v2``."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot(cache, "org/tiny", MAIN)
    snapshot(cache, "org/tiny", V2, ref="v2")
    return cache


def config(path: str, base: Path, **model: str):
    return from_dict({"model": {"path": path, **model}, "environment": {"name": "x"}},
                     base_dir=base)  # fmt: skip


@pytest.mark.parametrize(
    ("value", "is_id"),
    [("Qwen/Qwen2.5-1.5B-Instruct", True), ("openai-community/gpt2", True),
     ("meta-llama/Llama-3.1-8B", True), ("gpt2", False), ("model", False), ("./model", False), ("../runs/model", False), ("a/b/c", False), ("~/model", False),
     ("/abs/model", False), ("org/..", False), ("org/name.", False), ("", False)],
)  # fmt: skip
def test_what_reads_as_a_hub_id(value: str, is_id: bool) -> None:
    assert hub_id(value) is is_id


def test_a_hub_id_becomes_its_snapshot_and_a_revision_picks_another(hub: Path, tmp_path) -> None:
    got = config("org/tiny", tmp_path).model.path
    assert got == str(hub / "models--org--tiny" / "snapshots" / MAIN)
    assert config("org/tiny", tmp_path, revision="v2").model.path.endswith(V2)
    assert config("org/tiny", tmp_path, revision=V2).model.path.endswith(V2)  # a commit


def test_a_directory_next_to_the_config_wins_over_the_id(hub: Path, tmp_path: Path) -> None:
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "tokenizer.json").write_text("{}")
    assert config("org/tiny", tmp_path).model.path == str(local.resolve())


def test_a_model_missing_from_the_cache_names_the_id_the_cache_and_the_command(
    hub: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as caught:
        config("org/absent", tmp_path)
    message = str(caught.value)
    assert message.startswith("model.path: 'org/absent' is no directory next to the config")
    assert str(hub) in message and "Fix: fetch it with `hf download org/absent`" in message
    with pytest.raises(ConfigError, match="hf download org/tiny --revision v9"):
        config("org/tiny", tmp_path, revision="v9")


def test_a_path_that_is_no_id_keeps_the_directory_error(hub: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.path: .*/runs/model is not a Hugging Face "
                                          r"model directory \(no config.json\)"):  # fmt: skip
        config("../runs/model", tmp_path)


def test_a_worker_elsewhere_finds_the_same_commit_in_its_own_cache(hub: Path, tmp_path) -> None:
    """The controller sends its snapshot path; on a node whose cache is elsewhere the worker
    finds the same commit there, and names the commit's fetch when it has not got it."""
    sent = config("org/tiny", tmp_path, revision="v2")
    assert localize(sent) is sent  # here: unchanged
    elsewhere = f"/other/node/hub/models--org--tiny/snapshots/{V2}"
    moved = msgspec.structs.replace(sent, model=msgspec.structs.replace(sent.model, path=elsewhere))
    assert localize(moved).model.path == sent.model.path
    gone = elsewhere.replace(V2, "c" * 40)
    missing = msgspec.structs.replace(sent, model=msgspec.structs.replace(sent.model, path=gone))
    with pytest.raises(ConfigError, match=f"hf download org/tiny --revision {'c' * 40}"):
        localize(missing)


def test_check_config_resolves_an_id_from_hf_home_offline(tmp_path: Path) -> None:
    """``asyncrl check-config`` in a process whose ``HF_HOME`` holds the cache, offline."""
    home = tmp_path / "hf-home"
    found = snapshot(home / "hub", "org/tiny", MAIN)
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npath = "org/tiny"\n[environment]\nname = "arithmetic"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    run = [sys.executable, "-m", "asyncrl", "check-config", str(toml), "--config-only"]
    ok = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok: no invariant is broken" in ok.stdout
    toml.write_text('[model]\npath = "org/other"\n[environment]\nname = "arithmetic"\n')
    bad = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "holds no snapshot of it" in bad.stdout + bad.stderr
    assert str(home / "hub") in bad.stdout + bad.stderr and found.is_dir()
