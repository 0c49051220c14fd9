"""Shared fixtures and the GPU/e2e switches."""

from __future__ import annotations

import os

import pytest


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
