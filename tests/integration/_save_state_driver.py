"""Writes the trainer's part of a real checkpoint with the fsdp2 or deepspeed backend.

Usage: ``torchrun --standalone --nproc-per-node N _save_state_driver.py SPEC.json``, where SPEC
holds ``config`` (a run config as a mapping), ``vocab_size``, ``run_dir``, ``trainer_dir`` and
``model_dir``.
Each rank starts the backend on the config's model, trains one step (so the optimizer has
state), then the ranks save their state into ``trainer_dir`` (``TrainingBackend.save_state``,
what a checkpoint's ``trainer/`` holds) and export the model into ``model_dir``.
``test_checkpoint_shards.py`` commits them as a checkpoint and damages it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from asyncrl.backend import WorkerContext
from asyncrl.config import from_dict
from asyncrl.worker.export import export_model
from asyncrl.wire.messages import TrainBatch
from asyncrl.registry import load


def _step(backend, vocab_size: int, rank: int) -> None:
    """One optimizer step on a few random sequences of this rank."""
    rng = np.random.default_rng(rank)
    seq_lens = np.array([10, 7], np.int32)
    prompt_lens = np.array([4, 3], np.int32)
    responses = int((seq_lens - prompt_lens).sum())
    batch = TrainBatch(
        tokens=rng.integers(4, vocab_size, size=int(seq_lens.sum())).astype(np.int32),
        seq_lens=seq_lens,
        prompt_lens=prompt_lens,
        behaviour_logprobs=np.full(responses, -3.0, np.float32),
        advantages=np.array([1.0, -1.0], np.float32),
        loss_mask=np.ones(responses, np.uint8),
    )
    backend.begin_step(0)
    backend.train_chunk(0, batch)
    backend.finish_step(0, responses * int(os.environ["WORLD_SIZE"]))


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    config = from_dict(spec["config"])
    rank = int(os.environ["RANK"])
    ctx = WorkerContext(
        group="trainer",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        config=config,
        run_dir=spec["run_dir"],
    )
    backend = load("asyncrl.training_backends", config.trainer.backend)(ctx)
    try:
        backend.start()
        _step(backend, int(spec["vocab_size"]), rank)
        backend.save_state(spec["trainer_dir"])
        export_model(backend, rank, spec["model_dir"], source_dir=config.model.path)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
