"""Held-out evaluation during training (``eval.every_steps``), with the bigram backends: it
runs on the same engines while the next step trains, its groups never reach a batch, and the
best result is recorded with its checkpoint, which retention keeps."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.checkpoints import directory as ckpt  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from integration_support import read_metrics  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]


async def test_validation_during_training(make_config: Callable[..., Config]) -> None:
    steps, P = 4, 4
    cfg = make_config(
        run={"num_steps": steps},
        grpo={"max_new_tokens": 6},
        generator={"options": {"token_delay_s": 0.01}},
        trainer={"options": {"step_delay_s": 0.3}},
        eval={"num_prompts": 4, "every_steps": 2},
        checkpoint={"every_steps": 2, "keep_last": 1},
    )
    async with asyncrl.Controller(cfg) as ctl:
        summary = await ctl.train()
    records = read_metrics(cfg)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(e["label"], e["version"]) for e in evals] == [
        ("start", 0), ("step-2", 2), ("step-4", 4), ("end", 4),
    ]  # fmt: skip
    assert [e["label"] for e in summary.evals] == ["start", "step-2", "step-4", "end"]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    # training went on meanwhile: step 3 was training while version 2 was evaluated
    during = evals[1]
    assert train[3]["train_start"] < during["end"] and during["start"] < train[3]["train_end"]
    # no evaluation sample reached a batch: every step trained exactly its P groups
    assert all(train[k]["groups"] == P for k in range(1, steps + 1))
    assert sum(e["trained"] for e in summary.ledger) == steps * P
    # the best evaluation, with its checkpoint, which retention kept
    best = json.loads((Path(cfg.checkpoint.dir) / "best.json").read_text())
    top = max(evals[1:3], key=lambda e: e["accuracy"])  # ties: the first
    assert (best["step"], best["accuracy"]) == (top["version"], top["accuracy"])
    assert best["checkpoint"] is not None and Path(best["checkpoint"], "manifest.json").is_file()
    kept = {p.name for p in ckpt.list_checkpoints(cfg.checkpoint.dir)}
    assert kept == {f"step-{steps:08d}", Path(best["checkpoint"]).name}
