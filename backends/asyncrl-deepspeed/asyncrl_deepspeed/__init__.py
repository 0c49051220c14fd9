"""DeepSpeed ZeRO-2/3 training backend for asyncrl, ``asyncrl.training_backends:deepspeed``.

Importing this package imports neither torch nor DeepSpeed: the entry point is :data:`plugin`,
whose ``check_config`` runs in the controller before any worker starts and whose factory
imports DeepSpeed (:mod:`asyncrl_deepspeed.backend`) only in the trainer workers.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plugin.backend import BackendPlugin, WorkerContext
from asyncrl.plugin.common import Config

__all__ = ["check_config", "plugin"]


def _create(ctx: WorkerContext) -> Any:
    from .backend import DeepSpeedBackend

    return DeepSpeedBackend(ctx)


def check_config(config: Config, *, max_prompt_tokens: int) -> None:
    """``[trainer.options]``, before any trainer starts."""
    from .options import parse_options

    parse_options(dict(config.trainer.options))


plugin = BackendPlugin(create=_create, check_config=check_config, adapters=True)
"""The entry point ``asyncrl.training_backends:deepspeed``."""
