"""The switch between the engines' and the trainer's turns on a shared GPU
(``asyncrl.run.turns.Turns``) against a scripted control plane: an engine restarted in the
trainer's turn does not start until the engines' turn, and the switch to the trainer's turn
waits for an engine still starting, then puts it to sleep with the others."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
from tokenizers import Tokenizer, models

from asyncrl.config import from_dict
from asyncrl.run.turns import Turns
from asyncrl.run.wake import Signal
from asyncrl.wire.messages import PROTOCOL_VERSION, Hello, MoveState, Sleep, TurnResult

pytestmark = pytest.mark.anyio


class Plane:
    """What ``Turns`` asks of the control plane, with the workers' states set by the test:
    ``started`` the rollout workers that got their Init, ``held`` those waiting for it."""

    def __init__(self) -> None:
        self.admit = None
        self.started_rollouts: list[str] = []
        self.held: list[str] = []
        self.calls: list[tuple[str, object]] = []

    def hold_starts(self, admit) -> None:  # noqa: ANN001
        self.admit = admit

    async def admit_held(self) -> list[str]:
        admitted, self.held = self.held, []
        self.started_rollouts += admitted
        return admitted

    def started(self, group: str) -> list[str]:
        assert group == "rollout"
        return list(self.started_rollouts)

    async def call_unless_restarting(  # noqa: ANN201
        self, worker: str, msg: object, *, timeout_s: float
    ):
        self.calls.append((worker, msg))
        return TurnResult(seconds=0.01, moved_bytes=0, held=0)

    async def call_each(self, workers, msgs, *, timeout_s: float):  # noqa: ANN001, ANN201
        self.calls += list(zip(workers, msgs, strict=True))
        return [TurnResult(seconds=0.01, moved_bytes=1 << 30, held=0) for _ in workers]


def hello(group: str) -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, group=group, rank=1, world_size=2, pid=1,
                 log_path="")  # fmt: skip


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """What a config's checks need of a model directory: its config and a tokenizer."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    return tmp_path


def make_turns(plane: Plane, serving: list[str], model_dir: Path) -> Turns:
    config = from_dict({"model": {"path": str(model_dir)}, "environment": {"name": "arithmetic"},
                        "cluster": {"placement": "take_turns"}})  # fmt: skip
    ctx = SimpleNamespace(config=config, control=plane, trainers=["trainer:0"],
                          serving=lambda: list(serving), changed=Signal())  # fmt: skip

    async def nothing() -> None:
        pass

    return Turns(ctx, offload=True, before_sleep=nothing)  # type: ignore[arg-type]


async def test_an_engine_restarted_in_the_trainers_turn_starts_in_the_engines_turn(
    model_dir: Path,
) -> None:
    plane, serving = Plane(), ["rollout:0", "rollout:1"]
    turns = make_turns(plane, serving, model_dir)
    assert plane.admit(hello("rollout")) and plane.admit(hello("trainer"))  # engines' turn
    plane.started_rollouts = ["rollout:0", "rollout:1"]
    await turns.to_trainer()
    assert [w for w, m in plane.calls if isinstance(m, Sleep)] == ["rollout:0", "rollout:1"]
    # rollout:1 dies and comes back while the trainer steps: its Init waits
    serving.remove("rollout:1")
    plane.started_rollouts.remove("rollout:1")
    assert not plane.admit(hello("rollout")) and plane.admit(hello("trainer"))
    plane.held = ["rollout:1"]
    await turns.before_refit()
    await turns.to_engines()
    assert plane.held == [] and plane.started_rollouts == ["rollout:0", "rollout:1"]
    assert turns.dispatching and plane.admit(hello("rollout"))

    # the next switch waits while rollout:1 starts (and syncs), then puts it to sleep too
    plane.calls.clear()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(turns.to_trainer)
            await anyio.sleep(0.3)
            assert not [m for _, m in plane.calls if isinstance(m, Sleep)]  # still waiting
            serving.append("rollout:1")  # it serves now
    slept = [w for w, m in plane.calls if isinstance(m, Sleep)]
    assert slept == ["rollout:0", "rollout:1"]
    assert [m for _, m in plane.calls if isinstance(m, MoveState)] == [MoveState(to="device")]
    record = turns.take()
    assert 0.3 <= record["turn_start_wait_s"] <= record["turn_to_trainer_s"]


async def test_resident_placement_holds_no_start(model_dir: Path) -> None:
    plane = Plane()
    config = from_dict({"model": {"path": str(model_dir)}, "environment": {"name": "arithmetic"}})
    ctx = SimpleNamespace(config=config, control=plane, trainers=["trainer:0"],
                          serving=lambda: ["rollout:0"], changed=Signal())  # fmt: skip

    async def nothing() -> None:
        pass

    turns = Turns(ctx, offload=False, before_sleep=nothing)  # type: ignore[arg-type]
    assert plane.admit is None  # the control plane's own default: every start at once
    await turns.to_trainer()
    await turns.to_engines()
    assert plane.calls == [] and turns.take() == {}
