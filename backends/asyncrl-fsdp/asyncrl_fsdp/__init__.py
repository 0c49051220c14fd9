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
from asyncrl.plugin.common import Config, config_error

__all__ = ["check_config", "frozen_plugin", "gpu_memory", "plugin"]


def _create(ctx: WorkerContext) -> Any:
    from .backend import FSDPBackend

    return FSDPBackend(ctx)


def _create_frozen(ctx: WorkerContext) -> Any:
    from .frozen import FrozenBackend

    return FrozenBackend(ctx)


def check_config(config: Config, *, max_prompt_tokens: int) -> None:
    """``[trainer.options]``, before any trainer starts."""
    from .options import parse_options

    opts = parse_options(dict(config.trainer.options))
    if config.jobs and not config.lora.enabled:
        raise config_error("lora.rank", "is 0, but the run has jobs: fsdp2 trains each job's "
                           "adapter on the shared base", "set lora.rank (8 to 128)")  # fmt: skip
    if len(config.jobs) > opts.job_slots:
        raise config_error(
            "trainer.options.job_slots", f"is {opts.job_slots}, fewer than the run's "
            f"{len(config.jobs)} jobs (each needs an adapter slot on the trainer)",
            f"set trainer.options.job_slots to at least {len(config.jobs)} (docs/jobs.md)",
        )  # fmt: skip


def gpu_memory(config: Config, shape: Any, gpu_bytes: int | None) -> Any:
    """One trainer rank's share at its peak (:mod:`asyncrl_torch.memory`)."""
    from asyncrl_torch.memory import trainer_need

    from .options import parse_options

    opts = parse_options(dict(config.trainer.options))
    return trainer_need(config, shape, gpu_bytes, backend="fsdp2", optimizer=opts.optimizer,
                        bf16=opts.mixed_precision == "bf16",
                        reference_offload=opts.reference_offload,
                        checkpointing=opts.activation_checkpointing,
                        job_slots=opts.job_slots)  # fmt: skip


def _frozen_gpu_memory(config: Config, shape: Any, gpu_bytes: int | None) -> Any:
    from asyncrl_torch.memory import trainer_need

    return trainer_need(config, shape, gpu_bytes, backend="frozen")


plugin = BackendPlugin(create=_create, check_config=check_config, adapters=True,
                       gpu_memory=gpu_memory)  # fmt: skip
"""The entry point ``asyncrl.training_backends:fsdp2``."""

frozen_plugin = BackendPlugin(create=_create_frozen, check_config=check_config,
                              gpu_memory=_frozen_gpu_memory)  # fmt: skip
"""The entry point ``asyncrl.training_backends:frozen`` (same ``[trainer.options]``)."""
