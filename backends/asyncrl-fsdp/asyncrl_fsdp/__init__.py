"""FSDP2 training backend for asyncrl, registered as ``asyncrl.training_backends:fsdp2``, and
the ``frozen`` backend (``asyncrl.training_backends:frozen``: the same sharded model, steps
that change nothing; see :mod:`asyncrl_fsdp.frozen`).

Importing this package imports nothing heavy: the entry point is :data:`plugin`, whose
``check_config`` runs in the controller before any worker starts and whose factory imports
torch (:mod:`asyncrl_fsdp.backend`) only in the trainer workers.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plugin.backend import BackendPlugin, WorkerContext
from asyncrl.plugin.common import Config

__all__ = ["check_config", "frozen_plugin", "plugin"]


def _create(ctx: WorkerContext) -> Any:
    from .backend import FSDPBackend

    return FSDPBackend(ctx)


def _create_frozen(ctx: WorkerContext) -> Any:
    from .frozen import FrozenBackend

    return FrozenBackend(ctx)


def check_config(config: Config, *, max_prompt_tokens: int) -> None:
    """``[trainer.options]``, before any trainer starts."""
    from .options import parse_options

    parse_options(dict(config.trainer.options))


plugin = BackendPlugin(create=_create, check_config=check_config, adapters=True)
"""The entry point ``asyncrl.training_backends:fsdp2``."""

frozen_plugin = BackendPlugin(create=_create_frozen, check_config=check_config)
"""The entry point ``asyncrl.training_backends:frozen`` (same ``[trainer.options]``)."""
