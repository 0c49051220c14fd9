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
