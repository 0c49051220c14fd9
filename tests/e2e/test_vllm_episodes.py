"""Multi-turn episodes on the real engines: vLLM CPU build + FSDP2 (torchrun groups).

The ``repeat-digit-turns`` environment (two turns, a user turn between) on the tiny Qwen2
model with a chat template of its own: every turn is one vLLM request (ids ``g<k>/<i>#<j>``),
the episodes of groups the end of the run aborts have their requests aborted in the engine,
the trainer trains the generated tokens only, and evaluation runs greedy episodes.

The run trains a LoRA adapter (``[lora]``): each turn leases the adapter version that is
newest when it starts, so an episode's turns may span refits. Episodes with full weights run
on the example engine (tests/integration/test_episodes_bigram.py), and full refits on vLLM in
tests/e2e/test_system.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncrl import Controller
from asyncrl.config import from_dict

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
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

# a message's content as it is, an assistant's followed by <eos> (the tiny model's EOS)
TEMPLATE = (
    "{%- for m in messages -%}{{ m.content }}{%- if m.role == 'assistant' -%}<eos>"
    "{%- endif -%}{%- endfor -%}"
)


@pytest.fixture(scope="module")
def chat_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    path = build_model(tmp_path_factory.mktemp("tiny-qwen-chat") / "model", seed=0)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.mark.asyncio
async def test_episodes_on_vllm_and_fsdp2(tmp_path: Path, chat_qwen_dir: Path) -> None:
    config = from_dict(
        {
            "run": {"output_dir": str(tmp_path / "out"), "seed": 3, "num_steps": 2},
            "model": {"path": str(chat_qwen_dir)},
            "environment": {"name": "repeat-digit-turns"},
            "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "startup_timeout_s": 400},
            "grpo": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 6},
            "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 1},
                         "min_groups_for_streaming_train": 4},  # fmt: skip
            "trainer": {"backend": "fsdp2", "options": {"lr": 0.02}},
            "lora": {"rank": 8},
            "generator": {"backend": "vllm",
                          "options": {"cpu_kvcache_space_gib": 1, "enforce_eager": True}},
            "episode": {"max_turns": 2, "max_context_tokens": 64},
            "eval": {"num_prompts": 8},
        }
    )  # fmt: skip
    mark_test_start()
    async with Controller(config) as ctl:
        pids = worker_pids(ctl).values()
        summary = await ctl.train()
    assert_nothing_left(ctl, pids)

    records = read_metrics(config)
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2] == [s["step"] for s in summary.steps]
    assert all(r["grad_norm"] > 0 and r["staleness_max"] <= 1 for r in steps)
    assert sum(r["episodes"] for r in steps) >= 2 * 8 * 4
    assert all(r["episode_turns_mean"] == 2.0 for r in steps if r["episodes"])
    assert all(r["episode_failed"] == 0 for r in steps)
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [(e["label"], e["num_prompts"], e["failed_groups"]) for e in evals] == [
        ("start", 8, 0), ("end", 8, 0)
    ]


def test_the_template_is_the_bigram_models(tmp_path: Path) -> None:
    """The same template as the bigram model directory's (one environment, two engines)."""
    from asyncrl_example_backend.model import write_model_dir

    assert (write_model_dir(tmp_path) / "chat_template.jinja").read_text() == TEMPLATE
