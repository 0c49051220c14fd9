"""DeepSpeed ZeRO-2/3 training backend for asyncrl, ``asyncrl.training_backends:deepspeed``.

Importing this package imports neither torch nor DeepSpeed: the entry point is :data:`plugin`,
whose ``check_config`` runs in the controller before any worker starts and whose factory
imports DeepSpeed (:mod:`asyncrl_deepspeed.backend`) only in the trainer workers.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plugin.backend import BackendPlugin, WorkerContext
from asyncrl.plugin.common import Config

__all__ = ["check_config", "gpu_memory", "plugin"]


def _create(ctx: WorkerContext) -> Any:
    from .backend import DeepSpeedBackend

    return DeepSpeedBackend(ctx)


def check_config(config: Config, *, max_prompt_tokens: int) -> None:
    """``[trainer.options]``, before any trainer starts."""
    from .options import parse_options

    parse_options(dict(config.trainer.options))


def gpu_memory(config: Config, shape: Any, gpu_bytes: int | None) -> Any:
    """One trainer rank's share at its peak (:mod:`asyncrl_torch.memory`)."""
    from asyncrl_torch.memory import trainer_need

    from .options import parse_options

    opts = parse_options(dict(config.trainer.options))
    return trainer_need(config, shape, gpu_bytes, backend="deepspeed", zero_stage=opts.zero_stage,
                        bf16=opts.mixed_precision == "bf16",
                        reference_offload=opts.reference_offload,
                        checkpointing=opts.activation_checkpointing)  # fmt: skip


plugin = BackendPlugin(create=_create, check_config=check_config, adapters=True,
                       gpu_memory=gpu_memory)  # fmt: skip
"""The entry point ``asyncrl.training_backends:deepspeed``."""
