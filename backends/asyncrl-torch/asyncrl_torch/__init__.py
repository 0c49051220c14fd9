"""The torch side of asyncrl, for training-backend authors.

``import asyncrl`` never imports torch; this package does (except :mod:`.options` and
:mod:`.step_ledger`, which a backend's ``check_config`` may import in the controller). It
holds what every first-party training backend shares, so a new backend inherits the exact
same loss, batching and step bookkeeping:

- :mod:`.loss`: the clipped-surrogate loss as a token *sum* (:func:`ppo_clip_loss`);
- :mod:`.batches`: packed batches to right-padded micro-batches and response logprobs (the
  layout itself is :class:`asyncrl.plugin.backend.Layout`);
- :mod:`.trainer`: :class:`DistributedTrainer`, the base class of the ``fsdp2`` and
  ``deepspeed`` backends (lockstep micro-batching, the step ledger, exact normalization);
- :mod:`.kv_calibration`: FP8 KV-cache scales from the trainer's own forwards;
- :mod:`.options`: the ``[trainer.options]`` fields the backends share;
- :mod:`.byte_groups`: full weights in byte-budgeted groups for sharded exporters.

The contract suite that checks a backend against a float64 reference is
:mod:`asyncrl_torch.contract.suite`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["DistributedTrainer", "StepStateError"]

if TYPE_CHECKING:
    from asyncrl_torch.step_ledger import StepStateError
    from asyncrl_torch.trainer import DistributedTrainer


def __getattr__(name: str) -> Any:
    # lazy, so that asyncrl_torch.options stays importable without torch
    if name == "DistributedTrainer":
        from asyncrl_torch.trainer import DistributedTrainer

        return DistributedTrainer
    if name == "StepStateError":
        from asyncrl_torch.step_ledger import StepStateError

        return StepStateError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
