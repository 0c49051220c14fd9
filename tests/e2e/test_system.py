"""The whole system with real engines: vLLM CPU build + FSDP2, spawned as torchrun groups.

For lookahead 0 (sync) and 1 (async): before training, vLLM's and the trainer's logprobs of
fixed token sequences agree within bf16 noise; after two steps (two refits) they agree again
and differ from before (the generator really serves the new weights); every trained group
respects the staleness bound; with lookahead 1 the generation of step k+1 overlaps training of
step k; nothing is left behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl import Controller
from asyncrl.config import from_dict
from asyncrl.grpo import pack_tokens

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from integration_support import (  # noqa: E402
    assert_nothing_left,
    mark_test_start,
    read_metrics,
    worker_pids,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    # vLLM's front end leaves a pyzmq context to the garbage collector
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

BF16_TOL = 0.05  # measured worst case 0.011 after a refit (docs/backends/vllm.md)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen") / "model", seed=0)


def fixed_sequences(rng: np.random.Generator, vocab: int = 40) -> object:
    prompts = [[1, *rng.integers(4, vocab, size=int(n)).tolist()] for n in (3, 5, 7, 4)]
    responses = [rng.integers(4, vocab, size=int(n)).tolist() for n in (6, 3, 5, 8)]
    return pack_tokens(prompts, responses)


@pytest.mark.asyncio
@pytest.mark.parametrize("lookahead", [0, 1])
async def test_refit_keeps_generator_and_trainer_in_sync(
    tmp_path: Path, qwen_dir: Path, lookahead: int
) -> None:
    config = from_dict(
        {
            "run": {"output_dir": str(tmp_path / "out"), "seed": 3, "num_steps": 2},
            "model": {"path": str(qwen_dir)},
            "environment": {"name": "repeat-digit"},
            "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "startup_timeout_s": 400},
            "grpo": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 6},
            "pipeline": {
                "sampler": {"name": "in_order", "max_lookahead_versions": lookahead},
                "min_groups_for_streaming_train": 4,
            },
            "trainer": {"backend": "fsdp2", "options": {"lr": 0.02}},
            "generator": {
                "backend": "vllm",
                "options": {"cpu_kvcache_space_gib": 1, "enforce_eager": True},
            },
        }
    )
    batch = fixed_sequences(np.random.default_rng(0))
    mark_test_start()
    async with Controller(config) as ctl:
        pids = worker_pids(ctl).values()
        gen0 = await ctl.generator_logprobs(batch)
        trn0 = await ctl.trainer_logprobs(batch)
        assert gen0.shape == trn0.shape == (int((batch.seq_lens - batch.prompt_lens).sum()),)
        assert np.abs(gen0 - trn0).max() < BF16_TOL
        summary = await ctl.train()
        gen1 = await ctl.generator_logprobs(batch)
        trn1 = await ctl.trainer_logprobs(batch)
    assert_nothing_left(ctl, pids)

    assert np.abs(gen1 - trn1).max() < BF16_TOL
    assert np.abs(trn1 - trn0).max() > 4 * BF16_TOL, "the trainer did not move"
    assert np.abs(gen1 - gen0).max() > 4 * BF16_TOL, "the generator still serves old weights"

    steps = [r for r in read_metrics(config) if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2] == [s["step"] for s in summary.steps]
    assert all(r["staleness_max"] <= lookahead for r in steps)
    assert all(r["grad_norm"] > 0 for r in steps)
    if lookahead == 1:
        # batch 2 was generated while step 1 trained: its generation started before step 1's
        # training ended
        assert steps[1]["gen_start"] < steps[0]["train_end"]
        assert steps[1]["staleness_max"] == 1
    else:
        assert steps[1]["gen_start"] >= steps[0]["train_end"]
        assert all(r["staleness_max"] == 0 for r in steps)
