"""A checkpoint a trainer refuses to save because its weights are not finite stops the run at
once, with the trainer's own words: unlike a full disk's, it is no failure to retry, and its
fix is not "free space"."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.checkpoints.saving import Checkpointer
from asyncrl.config import from_dict
from asyncrl.errors import NonFiniteError, RemoteCallError
from asyncrl.wire.messages import SaveState

MESSAGE = (
    "the weights to save hold NaN or infinite values (1 tensors: model.norm.weight), so "
    "nothing was written; likely a step applied although it was not finite (a backend fault)"
)


class RefusingTrainers:
    """A control plane whose trainers refuse ``SaveState`` as the torch trainers do."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def call_each(self, workers: list[str], requests: list[Any], *, timeout_s: float):
        self.calls.append(requests[0])
        if isinstance(requests[0], SaveState):
            raise RemoteCallError("trainer:0", "SaveState", "NonFiniteError", MESSAGE, "tb")
        return [None] * len(workers)


@pytest.mark.anyio
async def test_a_refused_save_stops_the_run_at_once(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    config = from_dict(
        {
            "model": {"path": str(tmp_path / "model")},
            "environment": {"name": "repeat-digit"},
            "run": {"output_dir": str(tmp_path / "out")},
        }
    )  # a budget of failed saves (MAX_SAVE_FAILURES = 3) is not spent on a NaN: it stops at once
    control = RefusingTrainers()
    saver = Checkpointer(
        config, control=control, trainers=["trainer:0"],  # type: ignore[arg-type]
        metrics=None, train_prompts=(),
    )  # fmt: skip
    with pytest.raises(NonFiniteError) as err:
        await saver.save(SimpleNamespace(step=7), finished=False)  # type: ignore[arg-type]
    assert str(err.value) == (
        "the checkpoint of step 7 was not saved: SaveState failed on worker trainer:0: "
        f"NonFiniteError: {MESSAGE}"
    )
    assert [type(c).__name__ for c in control.calls] == ["SaveState"]  # no model export
    checkpoints = Path(config.run.output_dir) / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == []  # the partial save was removed
