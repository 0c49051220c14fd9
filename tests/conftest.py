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


def _xdist_group(item: pytest.Item) -> str | None:
    """The worker group ``item`` must share under ``--dist loadgroup`` (``scripts/test.sh``):
    every vLLM test in one, and the tests of a module (or class) with a module- (or class-)
    scoped fixture together, so that the fixture is made once and never on both workers.
    ``None``: any worker, in any order."""
    parts = item.nodeid.split("::")[0].split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in ENGINE_DIRS:
        return "vllm"
    # pytest has no public view of an item's fixtures with their scopes
    defs = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
    scopes = {fixturedefs[-1].scope for fixturedefs in defs.values()}
    if "package" in scopes or "module" in scopes:
        return item.nodeid.split("::")[0]
    if "class" in scopes and item.cls is not None:
        return item.nodeid.rsplit("::", 1)[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if (group := _xdist_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
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
