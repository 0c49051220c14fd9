"""Shared fixtures and the GPU/e2e switches."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def run_dir() -> Iterator[str]:
    """A private (0700) directory with a short path: ipc:// socket paths are limited to ~100
    characters."""
    d = tempfile.mkdtemp(prefix="asyncrl-t-")
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


ENGINE_DIRS = ("e2e", "gpu")
"""Suites whose tests run one at a time even on several workers: each starts real vLLM
engines, and checks that nothing of vLLM's is left machine-wide (``/tmp/asyncrl-vllm-*``,
``psm_*`` in ``/dev/shm``)."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadscope`` (the engines stage of ``scripts/test.sh``): xdist's scheduling by
    module (by class for a test class), so that a module- or class-scoped fixture is made once
    and on one worker, with every vLLM test in one unit of its own: they run one after the
    other on one worker while the other takes the rest, and both take what is left. (Marking
    ``xdist_group`` would say this per test, but xdist 3.8 cannot rename a node id on pytest
    9, so ``--dist loadgroup`` groups nothing there.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EnginesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("::")[0].split("/")
            if len(parts) > 2 and parts[0] == "tests" and parts[1] in ENGINE_DIRS:
                return "vllm"
            return super()._split_scope(nodeid)

    return EnginesApart(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = False
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        pass
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_e2e = pytest.mark.skip(reason="ASYNCRL_SKIP_E2E is set")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "e2e" in item.keywords and os.environ.get("ASYNCRL_SKIP_E2E"):
            item.add_marker(skip_e2e)
