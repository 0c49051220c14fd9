"""Integration fixtures: a tiny bigram model directory, run configs, and a stray-process check.

The tests using them start real worker processes (torchrun agents + ranks) talking real ZeroMQ
over ipc://, with the ``bigram`` backends of ``plugins/asyncrl-example-backend`` (numpy only,
so a whole run takes seconds). Tests enter ``async with Controller(...)`` in their own body,
never in a fixture: pytest-asyncio runs a fixture's setup and teardown in different tasks.
Helpers live in ``integration_support.py``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from asyncrl.config import Config, from_dict
from integration_support import config_dict, live_children, mark_test_start, write_model_dir


@pytest.fixture(autouse=True)
def _test_start() -> None:
    mark_test_start()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("bigram-model"))


@pytest.fixture
def make_config(tmp_path: Path, model_dir: Path) -> Callable[..., Config]:
    """``make_config(cluster={"rollout_ranks": 2}, ...)``: :data:`BASE` with overrides;
    outputs go to ``tmp_path / subdir``."""

    def make(subdir: str = "run", **sections: dict[str, Any]) -> Config:
        return from_dict(config_dict(model_dir, tmp_path / subdir, **sections))

    return make


@pytest.fixture
def no_stray_processes() -> Iterator[None]:
    """After the test: fail if any descendant of the test process survived, and kill it so
    that one broken test cannot slow down or poison the next. (Not autouse: other tests in
    this directory may keep module-scoped processes on purpose.)"""
    yield
    # A guard, not a bound: a clean test returns at once; a rank's interpreter can take
    # several seconds to exit after its Shutdown on a busy 2-core machine (docs/failures.md).
    deadline = time.monotonic() + 30.0
    while True:
        strays = live_children()
        if not strays or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for proc in strays:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert strays == [], f"processes outlived the test: {strays}"
