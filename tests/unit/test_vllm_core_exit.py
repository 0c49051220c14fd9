"""The engine core's quick exit (asyncrl_vllm.core_exit) on a stand-in for vLLM's engine core.

The stand-in's ``shutdown`` plays vLLM's teardown (it unfreezes the heap, as vLLM's does); the
script calls it in a ``finally``, as vLLM's ``run_engine_core`` does, in a process of its own
so that the exit can be seen. The real engine is covered by
tests/e2e/test_vllm_backend.py::test_close_leaves_no_process_behind (exit code 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

from asyncrl_vllm import core_exit
from asyncrl_vllm.reaper import ENV_VAR

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent("""
    import atexit, gc, sys
    from asyncrl_vllm.core_exit import wrap_shutdown

    class Noisy:
        def __del__(self):
            print("finalized")

    keep = Noisy()  # the interpreter's finalization would say so

    class Core:
        def shutdown(self):
            gc.freeze()
            gc.unfreeze()  # vLLM's teardown does this before it collects
            print("teardown, heap frozen:", gc.get_freeze_count() > 0)

    class DataParallel(Core):
        def shutdown(self):
            super().shutdown()
            print("data-parallel teardown")

    Core.shutdown = wrap_shutdown(Core.shutdown)
    atexit.register(print, "exit handlers ran")
    sys.stdout.write("buffered; ")
    scenario = sys.argv[1]
    core = DataParallel() if scenario == "subclass" else Core()
    if scenario == "running":
        core.shutdown()
        print("went on")
        raise SystemExit(0)
    try:
        raise SystemExit(3 if scenario == "failed" else None)
    finally:
        core.shutdown()
""")


def run(scenario: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, scenario], capture_output=True, text=True, timeout=30
    )
    return proc.returncode, proc.stdout


def test_a_core_told_to_stop_exits_after_its_teardown() -> None:
    """The teardown runs with the heap kept frozen, then the exit handlers; buffered output is
    flushed; the interpreter's finalization is skipped; exit code 0."""
    code, out = run("stopping")
    assert code == 0
    assert out == "buffered; teardown, heap frozen: True\nexit handlers ran\n"


def test_a_core_not_told_to_stop_keeps_vllms_path() -> None:
    code, out = run("running")
    assert code == 0
    assert "teardown, heap frozen: False\nwent on\n" in out and "finalized" in out


def test_a_core_stopping_with_an_error_keeps_vllms_path() -> None:
    code, out = run("failed")
    assert code == 3
    assert "heap frozen: False" in out and "finalized" in out


def test_a_teardown_a_subclass_extends_is_left_to_finish() -> None:
    """vLLM's data-parallel core destroys its group after the base teardown: no exit before."""
    code, out = run("subclass")
    assert code == 0
    assert "data-parallel teardown" in out and "finalized" in out


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type:
    class EngineCoreProc:
        def shutdown(self) -> None:
            pass

    module = types.ModuleType("vllm.v1.engine.core")
    module.EngineCoreProc = EngineCoreProc  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", module)
    return EngineCoreProc


def test_apply_acts_only_in_an_engine_core_of_this_backend(monkeypatch) -> None:
    cls = fake_vllm(monkeypatch)
    original = cls.shutdown
    monkeypatch.delenv(ENV_VAR, raising=False)
    core_exit.apply()  # not an asyncrl engine
    monkeypatch.setenv(ENV_VAR, f"{os.getpid()}-00ff")
    core_exit.apply()  # the backend's own process
    monkeypatch.setenv(ENV_VAR, "not-a-token")
    core_exit.apply()
    assert cls.shutdown is original
    monkeypatch.setenv(ENV_VAR, "1-00ff")  # another process's engine: this is its core
    core_exit.apply()
    wrapped = cls.shutdown
    assert wrapped is not original and wrapped._asyncrl_exit
    core_exit.apply()  # idempotent
    assert cls.shutdown is wrapped


def test_apply_leaves_a_process_without_vllms_engine_core(monkeypatch) -> None:
    """vLLM's workers load the plugins too; the engine core module is not theirs to import."""
    monkeypatch.setenv(ENV_VAR, "1-00ff")
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.core", raising=False)
    core_exit.apply()
    assert "vllm.v1.engine.core" not in sys.modules


def test_owner_pid() -> None:
    assert core_exit.owner_pid("1234-00ff") == 1234
    assert core_exit.owner_pid("x-1") == -1
