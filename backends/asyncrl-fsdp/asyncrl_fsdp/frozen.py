"""The ``frozen`` training backend: the weights of ``model.path``, served and never changed.

A run with ``trainer.backend = "frozen"`` is a generation-only run through the whole
pipeline: prompts are dispatched, generated, returned, scored and batched into steps exactly
as in training, the trainer ranks take every chunk and finish every step, the generators are
refitted after each one, and the metrics file gets one record per step. Only the update is
missing: a chunk costs no forward pass, a step changes no weight (its loss and gradient norm
are reported as 0). Uses: evaluating or sampling a checkpoint with a training config, and
measuring what the pipeline costs on top of the engine (``benchmarks/generation.py``).

The model is sharded as by ``fsdp2`` (same options), so that :meth:`compute_logprobs`
(probes, ``refit.verify_*``) and :meth:`iter_weights` (refits) are those of the trained
backend; no optimizer is built, so ``state_to_host`` and ``state_to_device`` move nothing
(0 bytes: there is no optimizer state and no gradient). A checkpoint holds a marker only: the
weights are ``model.path``'s, which a resumed run loads again.
"""

from __future__ import annotations

import json
import os

import torch

from asyncrl.plugin.backend import Layout, TrainBatch
from asyncrl.plugin.common import ConfigError
from asyncrl_torch.trainer import ChunkSums

from .backend import FSDPBackend

__all__ = ["FrozenBackend"]

MARKER = "frozen.json"


class FrozenBackend(FSDPBackend):
    """:class:`~asyncrl.plugin.backend.TrainingBackend` whose steps change nothing (see the module
    docstring)."""

    name = "frozen"

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self._lora:
            raise ConfigError(
                "trainer.backend: 'frozen' trains nothing, so [lora] has nothing to train. "
                "Fix: remove [lora] (lora.rank = 0), or train with fsdp2 or deepspeed"
            )
        model.requires_grad_(False)
        self._shard(model)
        return model

    def _forward_backward(
        self, batch: TrainBatch, layout: Layout, bounds: list[tuple[int, int]], passes: int
    ) -> ChunkSums:
        return ChunkSums(*[0.0] * len(ChunkSums._fields))  # nothing trained

    def _zero_grad(self) -> None:
        pass  # no gradient is ever made

    def _apply_step(self, num_loss_tokens: float) -> float:
        return 0.0

    def _save_state(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        if self._ctx.rank == 0:
            marker = {"backend": self.name, "model": self._ctx.config.model.path}
            with open(os.path.join(path, MARKER), "w") as f:
                json.dump(marker, f)

    def _load_state(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise FileNotFoundError(
                f"{path} was not saved by the frozen backend (no {MARKER} inside). Fix: resume "
                "it with the backend that saved it, or start a fresh run"
            )
