"""A controller runs again after its ``async with`` block: each run starts with state of its
own (its torchrun agents, its heartbeat's verdicts, its restart budget), none of the
previous run's, and leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from integration_support import assert_nothing_left, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes"),
              pytest.mark.timeout(240)]  # fmt: skip


async def test_a_controller_runs_twice_one_block_after_the_other(
    make_config: Callable[..., Config],
) -> None:
    """The second ``async with`` spawns and watches its own workers (not the first run's
    exited torchrun agents, which would stop it at once as a startup failure)."""
    cfg = make_config(run={"num_steps": 1}, eval={"num_prompts": 0})
    ctl = asyncrl.Controller(cfg)
    seen: list[dict[str, int]] = []
    for _ in range(2):
        async with ctl:
            seen.append(worker_pids(ctl))
            summary = await ctl.train()
        assert len(summary.steps) == 1
        assert_nothing_left(ctl, seen[-1].values())
    first, second = seen
    assert first.keys() == second.keys() and not set(first.values()) & set(second.values())
