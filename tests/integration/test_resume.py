"""Checkpoint and resume through the embedded controller, with the bigram backends.

What must hold: a run stopped at a step boundary and resumed trains the same prompts at the
same steps and ends with the same weights as the uninterrupted run (synchronous mode, where
the run is deterministic); every prompt position is trained exactly once across the
interruption; a checkpoint that is corrupt, from another run or of a finished run is refused
before anything starts, with the fix; a save that fails (a full disk) leaves the previous
checkpoint usable and the run going, unless the disk is full (the run stops at once).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.checkpoints import directory as ckpt  # noqa: E402
from asyncrl.checkpoints import saving  # noqa: E402
from asyncrl.procs import space  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.errors import NoSpaceError, RunError  # noqa: E402
from asyncrl.obs.sample_export import sample_files  # noqa: E402
from asyncrl.policy.grpo import pack_tokens  # noqa: E402
from integration_support import assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

PROMPTS = [[1, 4 + d] for d in range(10)]
RESPONSES = [[4 + d, 4 + (d + 3) % 10, 2] for d in range(10)]
SYNC = {"sampler": {"name": "in_order", "max_lookahead_versions": 0}}


async def _trainer_logprobs(ctl: asyncrl.Controller) -> np.ndarray:
    return await ctl.trainer_logprobs(pack_tokens(PROMPTS, RESPONSES))


async def _run(cfg: Config, resume: str | None = None) -> tuple[asyncrl.RunSummary, np.ndarray]:
    async with asyncrl.Controller(cfg, resume=resume) as ctl:
        pids = worker_pids(ctl)
        summary = await ctl.train()
        logprobs = await _trainer_logprobs(ctl)
    assert_nothing_left(ctl, pids.values())
    return summary, logprobs


def _trained_positions(summary: asyncrl.RunSummary) -> int:
    return sum(e["trained"] for e in summary.ledger)


def _sample_lines(cfg: Config) -> list[dict]:
    """The run's samples files (``run.save_samples``), every line, in order."""
    return [json.loads(line) for path in sample_files(cfg.run.output_dir)
            for line in path.read_text().splitlines()]  # fmt: skip


async def test_resumed_run_equals_the_uninterrupted_one(make_config: Callable[..., Config]) -> None:
    """Synchronous training is deterministic (sampling seeds come from the group ids): a run
    resumed from its step-3 checkpoint (the next batch in flight or ready at that boundary)
    redoes steps 4-6 with the same batches and ends with the same weights, bit for bit."""
    steps, P = 6, 4
    cfg = make_config(
        run={"num_steps": steps, "save_samples": True},
        pipeline=SYNC,
        trainer={"options": {"lr": 0.5, "optimizer": "adam"}},
        generator={"options": {"token_delay_s": 0.002}},
        checkpoint={"every_steps": 3, "keep_last": 3},
    )
    whole, whole_lp = await _run(cfg)
    whole_lines = _sample_lines(cfg)
    per_step = P * cfg.grpo.samples_per_prompt
    assert [x["step"] for x in whole_lines] == [s for s in range(1, steps + 1)
                                                for _ in range(per_step)]  # fmt: skip
    at3 = Path(cfg.checkpoint.dir) / "step-00000003"
    state = ckpt.open_checkpoint(at3).state()
    in_play = len(state.scheduler["redispatch"]) + len(state.groups)
    assert in_play == P, "step 4's batch is generating or ready at the step-3 boundary"

    resumed, resumed_lp = await _run(cfg, resume=str(at3))
    assert resumed.resumed_from == 3
    assert [s["step"] for s in resumed.steps] == [4, 5, 6]
    # the same batches at the same steps: identical rewards, and identical final weights
    assert [s["reward"] for s in resumed.steps] == [s["reward"] for s in whole.steps[3:]]
    np.testing.assert_array_equal(resumed_lp, whole_lp)
    # each prompt position trained once, none lost, across the interruption
    assert [(e["trained"], e["lost"], e["repeated"]) for e in resumed.ledger] == [
        (e["trained"], e["lost"], e["repeated"]) for e in whole.ledger
    ]
    assert _trained_positions(resumed) == steps * P
    resumes = [r for r in read_metrics(cfg) if r["kind"] == "resume"]
    assert [r["step"] for r in resumes] == [3]
    # the start evaluation is not repeated by the resumed run
    assert [e["label"] for e in resumed.evals] == ["end"]
    # the samples files: steps 4-6 of the first run were cut, and trained again the same
    assert _sample_lines(cfg) == whole_lines


async def test_refusals_name_the_problem_and_the_fix(make_config: Callable[..., Config]) -> None:
    cfg = make_config("run", run={"num_steps": 2}, pipeline=SYNC, eval={"num_prompts": 0})
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .*Fix"):
        async with asyncrl.Controller(cfg, resume="latest"):
            pass
    summary, _ = await _run(cfg)
    assert summary.checkpoint is not None
    # finished: resuming it is an error that says how to train further
    with pytest.raises(ckpt.CheckpointError, match=r"finished.*run.num_steps=4"):
        async with asyncrl.Controller(cfg, resume="latest"):
            pass
    # another run's checkpoint: the differing strict field is named
    other = make_config("run", run={"num_steps": 4, "seed": 7}, pipeline=SYNC)
    with pytest.raises(ckpt.CheckpointError, match=r"another run: run.seed: 0 -> 7"):
        async with asyncrl.Controller(other, resume=summary.checkpoint):
            pass
    # corrupt: the controller state no longer matches its hash
    state = Path(summary.checkpoint) / "controller.msgpack"
    state.write_bytes(state.read_bytes()[:-3] + b"xyz")
    more = make_config("run", run={"num_steps": 4}, pipeline=SYNC)
    with pytest.raises(ckpt.CheckpointError, match="corrupt: controller.msgpack does not match"):
        async with asyncrl.Controller(more, resume="latest"):
            pass


async def test_a_failed_save_keeps_the_previous_checkpoint(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second save fails with an I/O error: the run goes on (MAX_SAVE_FAILURES),
    the first checkpoint stays whole and resumable, nothing of the failed save remains. The
    same save hitting ENOSPC (its controller state goes to /dev/full) stops the run at once
    with a NoSpaceError (docs/failures.md), the first checkpoint still whole."""
    real_write = ckpt._write_durable
    calls = {"n": 0}
    fault = {"full": False}

    def write(path: Path, data: bytes) -> None:
        if path.name == ckpt.CONTROLLER_FILE:
            calls["n"] += 1
            if calls["n"] == 2 and fault["full"]:
                with open("/dev/full", "wb") as f:  # the kernel's own "no space left"
                    f.write(data)
                    f.flush()
            if calls["n"] == 2:
                raise OSError(errno.EIO, "Input/output error", str(path))
        real_write(path, data)

    monkeypatch.setattr(ckpt, "_write_durable", write)
    cfg = make_config(
        run={"num_steps": 3},
        pipeline=SYNC,
        checkpoint={"every_steps": 1, "at_end": False, "keep_last": 3},
        eval={"num_prompts": 0},
    )
    summary, _ = await _run(cfg)
    assert len(summary.steps) == 3
    failed = [r for r in read_metrics(cfg) if r["kind"] == "checkpoint_failed"]
    assert [r["step"] for r in failed] == [2] and "Input/output error" in failed[0]["error"]
    root = Path(cfg.checkpoint.dir)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000001", "step-00000003"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no partial save left
    first = ckpt.open_checkpoint(root / "step-00000001")
    assert first.state().step == 1

    # with no failure allowed, the same fault stops the run with the fix
    calls["n"] = 0
    strict = make_config(
        "strict",
        run={"num_steps": 3},
        pipeline=SYNC,
        checkpoint={"every_steps": 1},
        eval={"num_prompts": 0},
    )
    monkeypatch.setattr(saving, "MAX_SAVE_FAILURES", 0)
    with pytest.raises(RunError, match=r"the checkpoint of step 2 could not be saved \(MAX_SAVE_"
                       r"FAILURES = 0: the first failure stops the run\); the last: .*"
                       r"Input/output error.*Fix: the device or network file system under "):
        await _run(strict)

    # a full disk uses no budget: the run stops at the failed save, naming it (the disk is
    # not full, /dev/full is: it is said to have no byte free, as a full one would)
    calls["n"], fault["full"] = 0, True
    full = make_config(
        "full",
        run={"num_steps": 3},
        pipeline=SYNC,
        checkpoint={"every_steps": 1, "at_end": False, "keep_last": 3},
        eval={"num_prompts": 0},
    )
    real_free = space.free_bytes
    monkeypatch.setattr(space, "free_bytes", lambda path: 0 if path.startswith(
        full.checkpoint.dir) and calls["n"] >= 2 else real_free(path))
    with pytest.raises(NoSpaceError) as err:
        await _run(full)
    text = str(err.value)
    assert text.startswith("no space left on device (ENOSPC) for the checkpoint of step 2 in ")
    # /dev/full's error names no file: the save's directory stands for it
    assert err.value.path.startswith(f"{full.checkpoint.dir}/.tmp-step-00000002-")
    # needed: about the size of the last checkpoint (the bigram names no weight files)
    last = Path(full.checkpoint.dir) / "step-00000001"
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    assert err.value.needed_bytes == size and err.value.free_bytes == 0
    assert f": 0 bytes free, {size} bytes" in text and " needed. Fix: free space in " in text
    assert f"resume from {Path(full.checkpoint.dir) / 'step-00000001'}" in text
    assert [r["step"] for r in read_metrics(full) if r["kind"] == "train"] == [1, 2]
    root = Path(full.checkpoint.dir)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000001"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


async def test_checkpoint_on_demand(make_config: Callable[..., Config]) -> None:
    import anyio

    cfg = make_config(
        run={"num_steps": 4},
        generator={"options": {"token_delay_s": 0.005}},
        checkpoint={"at_end": False},
        eval={"num_prompts": 0},
    )
    async with asyncrl.Controller(cfg) as ctl:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctl.train)
            path = await ctl.save_checkpoint()
        # after the run no step boundary is left: the answer is the last checkpoint, at once
        with anyio.fail_after(5):
            assert await ctl.save_checkpoint() == path
    assert path is not None
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert 1 <= manifest["step"] <= 4 and manifest["finished"] is False


async def test_a_dead_trainer_stops_the_run_and_resume_goes_on_losing_nothing(
    make_config: Callable[..., Config],
) -> None:
    """trainer:0 is SIGKILLed after step 3 of 6 (a checkpoint every 2 steps): the run stops
    with the error naming it and records where it stood (the ledger, a ``stopped`` record
    naming the checkpoint of step 2); ``resume="latest"`` trains steps 3-6, and across both
    runs every prompt position is trained exactly once."""
    import os
    import signal

    import anyio

    cfg = make_config(
        run={"num_steps": 6, "save_samples": True},
        eval={"num_prompts": 0},
        checkpoint={"every_steps": 2},
        generator={"options": {"token_delay_s": 0.002}},
    )
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.WorkerDiedError) as info:
        async with ctl:
            pids = worker_pids(ctl)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctl.train)
                with anyio.fail_after(60):
                    while ctl.status().step < 3:
                        await anyio.sleep(0.005)
                os.kill(pids["trainer:0"], signal.SIGKILL)
                await anyio.sleep_forever()
    assert (info.value.group, info.value.rank) == ("trainer", 0)
    assert_nothing_left(ctl, pids.values())
    records = read_metrics(cfg)
    (stopped,) = [r for r in records if r["kind"] == "stopped"]
    assert stopped["checkpoint"] == str(ckpt.latest(cfg.checkpoint.dir))
    assert stopped["checkpoint"].endswith("step-00000002") and stopped["step"] >= 3
    assert "worker trainer:0 died with exit code -9" in stopped["deaths"][0]
    assert records[-1]["kind"] == "stopped" and records[-2]["kind"] == "ledger"

    summary, _ = await _run(cfg, resume="latest")
    assert summary.resumed_from == 2
    assert [s["step"] for s in summary.steps] == [3, 4, 5, 6]
    assert _trained_positions(summary) == 6 * cfg.grpo.prompts_per_step
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in summary.ledger)
    # the samples files: each step once, in order, whatever the dead run wrote after step 2
    per_step = cfg.grpo.prompts_per_step * cfg.grpo.samples_per_prompt
    assert [x["step"] for x in _sample_lines(cfg)] == [s for s in range(1, 7)
                                                       for _ in range(per_step)]  # fmt: skip


async def test_max_num_epochs_ends_the_run_and_a_resume_respects_it(
    make_config: Callable[..., Config],
) -> None:
    """10 train prompts, 4 a step: a pass is 2 steps (the remainder dropped), so 2 passes end
    a 10-step run after 4; resuming it is refused until the bound is raised, and then trains
    on to the new bound."""
    env = {"name": "repeat-digit", "options": {"num_train": 10}}
    cfg = make_config("run", run={"num_steps": 10, "max_num_epochs": 2}, environment=env,
                      pipeline=SYNC, eval={"num_prompts": 0})  # fmt: skip
    summary, _ = await _run(cfg)
    assert len(summary.steps) == 4 and _trained_positions(summary) == 4 * 4
    with pytest.raises(ckpt.CheckpointError, match=r"max_num_epochs = 2 .*10 prompts, 4 steps"
                                                   r".*--set run.max_num_epochs=3"):  # fmt: skip
        async with asyncrl.Controller(cfg, resume="latest"):
            pass
    more = make_config("run", run={"num_steps": 10, "max_num_epochs": 3}, environment=env,
                       pipeline=SYNC, eval={"num_prompts": 0})  # fmt: skip
    resumed, _ = await _run(more, resume="latest")
    assert [s["step"] for s in resumed.steps] == [5, 6]
