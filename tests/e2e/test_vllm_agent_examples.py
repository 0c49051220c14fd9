"""The agent examples of ``asyncrl-arith`` on the real engines: vLLM CPU build + FSDP2.

Two steps of ``arithmetic-calc`` (the ``calc`` tool, the ``compact`` parser, the tiny chat
template) and of ``arithmetic-feedback``, from the demo's shipped warm start given a short
warm start on each teacher (40 steps of 32 conversations, so that it writes calls and second
answers; not the calibrated recipe, which takes minutes): the episodes call the tool / get the
feedback, the trainer trains, and the evaluation records carry each environment's components
(the tool-call rate). The learning figures themselves are docs/agent-examples.md's (30 steps
each).
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


def _model(tmp: Path, task: str) -> Path:
    """The shipped single-turn warm start, the chat template, 40 teacher steps of 32
    conversations: the recipe's 128 a step took 10-12 s of one core here, and the runs after
    32 call the tool and retry as those after 128 did (calc's first step: 52 tool calls and
    1.73 turns a sample against 38 and 1.59; feedback's retried share 0.72 both)."""
    from asyncrl_arith.agent_sft import (
        AgentSFTSettings,
        calc_teacher,
        feedback_teacher,
        train_agent_sft,
    )
    from asyncrl_arith.chat import write_chat_template
    from asyncrl_arith.make_model import _install_shipped, _settings_key, shipped_warm_start
    from asyncrl_arith.model import build_model
    from asyncrl_arith.sft import SFTSettings

    path = build_model(tmp / task, seed=0)
    shipped = shipped_warm_start(_settings_key(0, 0, {}, SFTSettings()))
    assert shipped is not None
    _install_shipped(shipped, path)
    write_chat_template(path)
    if task == "calc":
        from asyncrl_arith.calc_env import make_environment

        teacher = calc_teacher(0.9)
    else:
        from asyncrl_arith.feedback_env import make_environment

        teacher = feedback_teacher(1.0, 0.5)
    cfg = AgentSFTSettings(steps=40, batch_size=32)
    train_agent_sft(path, make_environment({}, 0), [(teacher, 40, cfg.lr)], cfg)
    return path


@pytest.mark.asyncio
@pytest.mark.parametrize("task", ["calc", "feedback"])
async def test_agent_example_runs(tmp_path: Path, task: str) -> None:
    model = _model(tmp_path, task)
    episode = ({"tool_parser": "compact", "max_turns": 4, "max_context_tokens": 160}
               if task == "calc" else {"max_turns": 2, "max_context_tokens": 64})  # fmt: skip
    config = from_dict(
        {
            "run": {"output_dir": str(tmp_path / "out"), "seed": 0, "num_steps": 2},
            "model": {"path": str(model)},
            "environment": {"name": f"arithmetic-{task}"},
            "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "startup_timeout_s": 400},
            "grpo": {"prompts_per_step": 8, "samples_per_prompt": 4,
                     "max_new_tokens": 24 if task == "calc" else 8},
            "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 1},
                         "min_groups_for_streaming_train": 8},
            "trainer": {"backend": "fsdp2", "options": {"lr": 1e-4}},
            "generator": {"backend": "vllm",
                          # as the example configs: no max_num_batched_tokens (the backend
                          # starts vLLM's CPU build without chunked prefill)
                          "options": {"cpu_kvcache_space_gib": 1, "enforce_eager": True}},
            "episode": episode,
            "eval": {"num_prompts": 16},
        }
    )  # fmt: skip
    mark_test_start()
    async with Controller(config) as ctl:
        pids = worker_pids(ctl).values()
        await ctl.train()
    assert_nothing_left(ctl, pids)

    records = read_metrics(config)
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["episode_failed"] == 0 for r in steps)
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [(e["label"], e["num_prompts"], e["failed_groups"]) for e in evals] == [
        ("start", 16, 0), ("end", 16, 0)
    ]
    if task == "calc":
        # the teacher called on 90%: the episodes call, the tool answers, turns follow
        assert sum(r["reward/tool_call"] for r in steps) > 0
        assert max(r["episode_turns_mean"] for r in steps) > 1.0
        assert all("reward/tool_call" in e and "reward/exact" in e for e in evals)
    else:
        assert all(0.0 <= e["reward/first"] <= e["accuracy"] for e in evals)
        assert sum(r["reward/retried"] for r in steps) > 0
