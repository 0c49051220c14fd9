"""What a resume checks before it loads anything, through the embedded controller with the
bigram backends: the rule for changed settings (docs/checkpointing.md, "Resuming with changed
settings") and the checksum of every checkpoint file.

Each refusal happens before any process starts or any file of the run is written (the
``no_stray_processes`` fixture, and ``metrics.jsonl`` left as it was).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import structlog

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.checkpoints import directory as ckpt  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from integration_support import assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

SYNC = {"sampler": {"name": "in_order", "max_lookahead_versions": 0}}


async def _train(cfg: Config, **kwargs) -> asyncrl.RunSummary:
    async with asyncrl.Controller(cfg, **kwargs) as ctl:
        pids = worker_pids(ctl)
        summary = await ctl.train()
    assert_nothing_left(ctl, pids.values())
    return summary


async def _refused(cfg: Config, match: str, **kwargs) -> str:
    """Resume ``cfg`` from the latest checkpoint: refused, before anything is written."""
    metrics = Path(cfg.run.output_dir) / "metrics.jsonl"
    before = metrics.read_bytes()
    with pytest.raises(ckpt.CheckpointError, match=match) as info:
        async with asyncrl.Controller(cfg, resume="latest", **kwargs):
            pass
    assert metrics.read_bytes() == before
    return str(info.value)


def _with_model(cfg: Config, path: Path) -> Config:
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(path)))


async def test_changes_of_meaning_are_refused_unless_named_and_harmless_ones_pass(
    make_config: Callable[..., Config], model_dir: Path, tmp_path: Path
) -> None:
    """The issue's cases: another tokenizer, another temperature, another PPO clip; then the
    same changes named in ``allow_changed`` (logged, and in the ``resume`` record); then a
    resume with harmless changes only."""
    common = {"pipeline": SYNC, "eval": {"num_prompts": 0}}
    await _train(make_config("run", run={"num_steps": 2}, **common))

    # another tokenizer: a copy of the model directory with one more token
    from tokenizers import Tokenizer

    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    tok = Tokenizer.from_file(str(other / "tokenizer.json"))
    tok.add_special_tokens(["<extra>"])
    tok.save(str(other / "tokenizer.json"))
    text = await _refused(
        _with_model(make_config("run", run={"num_steps": 4}, **common), other),
        r"is from another run: model\.tokenizer\.tokenizer\.json: sha256 [0-9a-f]{12}\.\.\. -> "
        r"sha256 [0-9a-f]{12}\.\.\.\. These settings change what the checkpoint means",
    )
    assert "Fix: restore them" in text and "--allow-changed model.tokenizer " in text
    # the same model directory moved elsewhere is the same model (only logged)
    moved = tmp_path / "moved-model"
    shutil.copytree(model_dir, moved)

    # another temperature, another clip: both named, with the flag that accepts them
    changed = make_config("run", run={"num_steps": 4}, grpo={"temperature": 3.0},
                          loss={"clip_eps_low": 0.9}, **common)  # fmt: skip
    text = await _refused(
        changed, r"another run: grpo\.temperature: 1\.0 -> 3\.0; loss\.clip_eps_low: 0\.2 -> 0\.9"
    )
    assert "--allow-changed grpo.temperature,loss.clip_eps_low " in text
    # one of the two named: the other is still refused
    await _refused(changed, r"another run: loss\.clip_eps_low: 0\.2 -> 0\.9\.",
                   allow_changed=["grpo.temperature"])  # fmt: skip
    # a misspelt name is refused, not ignored
    await _refused(changed, r"--allow-changed grpo\.temprature: no setting of that name",
                   allow_changed=["grpo.temprature", "loss"])  # fmt: skip

    # both named (as --allow-changed passes them, comma-separated): the run goes on
    with structlog.testing.capture_logs() as logs:
        summary = await _train(
            changed, resume="latest", allow_changed=["grpo.temperature,loss.clip_eps_low"]
        )
    assert summary.resumed_from == 2 and [s["step"] for s in summary.steps] == [3, 4]
    allowed = ["grpo.temperature: 1.0 -> 3.0", "loss.clip_eps_low: 0.2 -> 0.9"]
    (resume,) = [r for r in read_metrics(changed) if r["kind"] == "resume"]
    assert resume["allowed_changes"] == allowed
    assert resume["changed_settings"] == ["run.num_steps: 2 -> 4"]
    (warning,) = [e for e in logs if e["event"] == "resumed_with_allowed_changes"]
    assert warning["log_level"] == "warning" and warning["changes"] == allowed

    # harmless changes only (and the model moved): no flag needed, each one listed
    harmless = _with_model(make_config(
        "run", run={"num_steps": 5}, grpo={"temperature": 3.0}, loss={"clip_eps_low": 0.9},
        pipeline=SYNC, eval={"num_prompts": 2, "at_start": False},
        checkpoint={"keep_last": 3}, cluster={"call_timeout_s": 30.0},
    ), moved)  # fmt: skip
    summary = await _train(harmless, resume="latest")
    assert summary.resumed_from == 4 and [s["step"] for s in summary.steps] == [5]
    last = [r for r in read_metrics(harmless) if r["kind"] == "resume"][-1]
    assert last["allowed_changes"] == []
    assert last["changed_settings"] == [
        "checkpoint.keep_last: 2 -> 3",
        "cluster.call_timeout_s: 60.0 -> 30.0",
        "eval.at_start: True -> False",
        "eval.num_prompts: 0 -> 2",
        f"model.path: {str(model_dir)!r} -> {str(moved)!r}",
        "run.num_steps: 4 -> 5",
    ]


async def test_a_flipped_byte_in_any_checkpoint_file_is_refused_before_anything_loads(
    make_config: Callable[..., Config],
) -> None:
    """Every file of a real checkpoint (controller state, the trainer's files, the saved
    model, the manifest), one at a time: one byte flipped, the resume is refused naming the
    file and the checkpoint before it; all restored, the same resume goes on."""
    cfg = make_config(run={"num_steps": 2}, pipeline=SYNC, eval={"num_prompts": 0},
                      checkpoint={"every_steps": 1})  # fmt: skip
    await _train(cfg)
    root = Path(cfg.checkpoint.dir)
    older, path = ckpt.list_checkpoints(root)
    files = sorted(ckpt.open_checkpoint(path).manifest["files"])
    assert "controller.msgpack" in files
    assert any(f.startswith("trainer/") for f in files), files
    assert any(f.startswith("model/") for f in files), files
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert on_disk == sorted([*files, "manifest.json"])
    more = make_config(run={"num_steps": 3}, pipeline=SYNC, eval={"num_prompts": 0},
                       checkpoint={"every_steps": 1})  # fmt: skip
    fix = rf"\. Fix: resume from an older checkpoint, e\.g\. --resume {re.escape(str(older))}$"
    for rel in [*files, "manifest.json"]:
        file = path / rel
        original = file.read_bytes()
        middle = len(original) // 2
        file.write_bytes(original[:middle] + bytes([original[middle] ^ 0x01])
                         + original[middle + 1 :])  # fmt: skip
        problem = (
            rf"manifest\.json (does not match its own sha256|is unreadable|lacks).*"
            if rel == "manifest.json"
            else rf"{re.escape(rel)} does not match its sha256 in the manifest"
        )
        await _refused(more, rf"checkpoint {re.escape(str(path))} is corrupt: {problem}{fix}")
        file.write_bytes(original)
    summary = await _train(more, resume="latest")
    assert summary.resumed_from == 2 and [s["step"] for s in summary.steps] == [3]
