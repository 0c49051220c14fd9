"""The vLLM backend's engine watchdog (asyncrl_vllm.reaper) with stand-in processes.

A stand-in "engine" is a python process that starts a child of its own (engine core →
worker). The real engine is covered by tests/e2e/test_vllm_backend.py; these run in seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl_vllm.reaper import Reaper, descendants, proc_table

pytestmark = pytest.mark.timeout(60)

ENGINE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "time.sleep(120)"
)


def alive(pids: list[int]) -> list[int]:
    table = proc_table()
    return [p for p in pids if p in table]


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    end = time.monotonic() + timeout_s
    while (left := alive(pids)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def owner_script(tmp_path: Path, *, announce_ready: bool) -> Path:
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, subprocess, sys, time
        from asyncrl_vllm.reaper import Reaper, descendants, proc_table

        reaper = Reaper()
        env = dict(os.environ, **reaper.environ)
        subprocess.Popen([sys.executable, "-c", {ENGINE!r}], env=env)
        while len(descendants(os.getpid(), proc_table())) < 3:  # watchdog, engine, worker
            time.sleep(0.05)
        time.sleep(1.2)  # let the watchdog poll at least twice
        pids = {"reaper.engine_started()" if announce_ready else "None"}
        if pids is None:
            table = proc_table()
            pids = [p for p in descendants(os.getpid(), table) if p != reaper._proc.pid]
        with open("{tmp_path / "pids.tmp"}", "w") as f:
            f.write(" ".join(map(str, pids)))
        os.rename("{tmp_path / "pids.tmp"}", "{tmp_path / "pids"}")
        time.sleep(120)
    """)
    )
    return script


@pytest.mark.parametrize("announce_ready", [True, False], ids=["running", "starting"])
def test_sigkill_of_the_owner_kills_the_engine_tree(tmp_path: Path, announce_ready: bool) -> None:
    owner = subprocess.Popen(
        [sys.executable, str(owner_script(tmp_path, announce_ready=announce_ready))]
    )
    try:
        end = time.monotonic() + 30
        while not (tmp_path / "pids").exists() and owner.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert len(pids) == 2 and alive(pids) == pids
        owner.send_signal(signal.SIGKILL)
        owner.wait(5)
        assert wait_gone(pids) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_close_kills_the_engine_and_nothing_else() -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reaper = Reaper()
        engine = subprocess.Popen(
            [sys.executable, "-c", ENGINE], env=dict(os.environ, **reaper.environ)
        )
        while len(descendants(engine.pid, proc_table())) < 1:
            time.sleep(0.05)
        pids = reaper.engine_started()
        assert engine.pid in pids and bystander.pid not in pids and len(pids) == 2
        assert reaper.alive() == pids
        killed = reaper.close()
        assert sorted(killed) == pids
        engine.wait(5)
        assert wait_gone(pids) == [] and reaper.alive() == []
        assert reaper.close() == []  # idempotent
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_close_after_a_clean_shutdown_kills_nothing() -> None:
    reaper = Reaper()
    engine = subprocess.Popen(
        [sys.executable, "-c", "pass"], env=dict(os.environ, **reaper.environ)
    )
    engine.wait(10)
    reaper.engine_started()
    assert reaper.close() == []
