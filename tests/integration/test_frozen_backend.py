"""The ``frozen`` training backend in one process (one gloo rank over a HashStore): a step
trains nothing and changes no weight, and its checkpoint is a marker that only it loads.

The whole pipeline with it (vLLM CPU build) is ``tests/e2e/test_system.py::
test_a_frozen_trainer_serves_the_checkpoint_unchanged``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("asyncrl_fsdp", reason="pip install -e backends/asyncrl-fsdp")
pytest.importorskip("asyncrl_arith", reason="pip install -e plugins/asyncrl-arith")

from asyncrl.backend import WorkerContext  # noqa: E402
from asyncrl.config import from_dict  # noqa: E402
from asyncrl.registry import load  # noqa: E402
from asyncrl.policy.grpo import pack_tokens  # noqa: E402
from asyncrl.wire.messages import TrainBatch  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def frozen(tmp_path: Path):  # noqa: ANN201 - a started FrozenBackend
    import torch.distributed as dist
    from asyncrl_arith.model import build_model

    model = build_model(tmp_path / "model", seed=0)
    config = from_dict({
        "model": {"path": str(model)}, "environment": {"name": "arithmetic"},
        "run": {"output_dir": str(tmp_path / "run")},
        "trainer": {"backend": "frozen", "options": {"num_threads": 1}},
        "generator": {"backend": "bigram"}, "eval": {"num_prompts": 0},
    })  # fmt: skip
    ctx = WorkerContext(group="trainer", rank=0, world_size=1, local_rank=0, config=config,
                        run_dir=str(tmp_path), extra={"dist_store": dist.HashStore()})  # fmt: skip
    backend = load("asyncrl.training_backends", "frozen").create(ctx)
    backend.start()
    yield backend
    backend.close()


def _batch() -> TrainBatch:
    tokens = pack_tokens([[1, 5, 6], [1, 7]], [[8, 9, 10], [11, 12]])
    n = int((tokens.seq_lens - tokens.prompt_lens).sum())
    return TrainBatch(
        tokens.tokens, tokens.seq_lens, tokens.prompt_lens,
        behaviour_logprobs=np.full(n, -1.0, np.float32),
        advantages=np.array([1.0, -1.0], np.float32), loss_mask=np.ones(n, np.uint8),
    )  # fmt: skip


def test_a_frozen_step_changes_nothing_and_its_checkpoint_is_a_marker(
    frozen, tmp_path: Path
) -> None:
    batch = _batch()
    before = {w.name: w.data.clone() for w in frozen.iter_weights()}
    frozen.begin_step(0)
    chunk = frozen.train_chunk(0, batch)
    result = frozen.finish_step(0, 5)
    assert (chunk.num_loss_tokens, chunk.loss_sum, result.loss, result.grad_norm) == (5, 0, 0, 0)
    after = {w.name: w.data for w in frozen.iter_weights()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)
    # the step's token count is still checked, as in training
    frozen.begin_step(1)
    frozen.train_chunk(1, batch)
    with pytest.raises(ValueError, match="the trainer ranks received 5"):
        frozen.finish_step(1, 6)

    frozen.save_state(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["frozen.json"]
    frozen.load_state(str(tmp_path / "ckpt"))
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match=r"not saved by the frozen backend"):
        frozen.load_state(str(tmp_path / "other"))
