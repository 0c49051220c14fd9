"""Build a warm-started model for an agent example: ``python -m asyncrl_arith.make_agent_model
{calc,feedback} OUT_DIR``.

The directory is the single-turn demo's (config, tokenizer, the shipped warm start installed
after its sha256 check: :mod:`asyncrl_arith.make_model`) plus the chat template
(:mod:`asyncrl_arith.chat`), then trained on the task's sloppy teacher
(:mod:`asyncrl_arith.agent_sft`) and measured: held-out greedy accuracy and tool-call rate
over ``EVAL_PROMPTS`` episodes, and the same at temperature 1 (what GRPO samples from).
Prints one JSON object. A stamp (the settings) makes a second run with the same settings a
no-op; ``--force`` rebuilds. Use ``--env-seed`` equal to the RL run's ``run.seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .agent_sft import (
    AgentSFTSettings,
    phases,
    run_episodes,
    summarize,
    train_agent_sft,
)
from .chat import write_chat_template
from .make_model import _install_shipped, _settings_key, read_stamp, shipped_warm_start
from .sft import SFTSettings

__all__ = ["RECIPES", "main", "make_agent_model"]

EVAL_PROMPTS = 200
SAMPLED_PROMPTS = 100
STAMP = "asyncrl_arith_stamp.json"

RECIPES: dict[str, AgentSFTSettings] = {
    "calc": AgentSFTSettings(skill_steps=1200, noise=0.5, steps=100, tool_rate=0.3),
    "feedback": AgentSFTSettings(steps=100, slip_rate=0.75, fix_rate=0.5),
}
"""The calibrated recipe of each task (docs/agent-examples.md)."""

LIMITS = {"calc": {"max_turns": 4, "max_turn_tokens": 24},
          "feedback": {"max_turns": 2, "max_turn_tokens": 8}}  # fmt: skip
"""The ``[episode]`` limits of ``examples/tiny_<task>.toml``, for the local measurement."""


def _environment(task: str, env_seed: int) -> Any:
    if task == "calc":
        from .calc_env import make_environment
    else:
        from .feedback_env import make_environment
    return make_environment({}, env_seed)


def make_agent_model(
    task: str, out_dir: str | Path, *, env_seed: int = 0, settings: AgentSFTSettings | None = None,
    force: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Build, warm-start, measure and save the ``task`` model in ``out_dir``; the report.

    Raises:
        ValueError: ``task`` is not ``calc`` or ``feedback``.
        RuntimeError: the shipped single-turn warm start is damaged (its sha256).
    """
    if task not in RECIPES:
        raise ValueError(f"unknown task {task!r}: give calc or feedback")
    from .model import build_model

    cfg = settings or RECIPES[task]
    key = {"task": task, "env_seed": env_seed, "sft": dataclasses.asdict(cfg)}
    out = Path(out_dir)
    stamp = read_stamp(out)
    if not force and stamp is not None and stamp.get("settings") == key:
        return {**stamp["report"], "skipped": True}
    start = time.perf_counter()
    env = _environment(task, env_seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        build_model(tmp, seed=0)
        shipped = shipped_warm_start(_settings_key(0, 0, {}, SFTSettings()))
        assert shipped is not None, "the package ships the single-turn warm start"
        _install_shipped(shipped, tmp)
        write_chat_template(tmp)
        report = {"task": task, "env_seed": env_seed,
                  **train_agent_sft(tmp, env, phases(task, cfg), cfg),
                  **measure(tmp, env, task)}  # fmt: skip
        report["total_seconds"] = round(time.perf_counter() - start, 1)
        (tmp / STAMP).write_text(json.dumps({"settings": key, "report": report}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**report, "skipped": False}


def measure(model_dir: str | Path, env: Any, task: str) -> dict[str, Any]:
    """Greedy figures over the first ``EVAL_PROMPTS`` eval prompts and temperature-1 figures
    over the first ``SAMPLED_PROMPTS`` (8 episodes each), with the example config's limits."""
    prompts = list(env.dataset("eval"))
    greedy = summarize(run_episodes(model_dir, env, prompts[:EVAL_PROMPTS], **LIMITS[task]))
    sampled = run_episodes(model_dir, env, [p for p in prompts[:SAMPLED_PROMPTS] for _ in range(8)],
                           temperature=1.0, **LIMITS[task])  # fmt: skip
    groups = [sampled[i : i + 8] for i in range(0, len(sampled), 8)]
    mixed = sum(len({r.score.reward for r in g}) > 1 for g in groups) / len(groups)
    return {"greedy": greedy, "greedy_prompts": EVAL_PROMPTS,
            "t1": {**summarize(sampled), "mixed_groups": round(mixed, 4)},
            "t1_prompts": SAMPLED_PROMPTS}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); prints the report as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m asyncrl_arith.make_agent_model",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("task", choices=sorted(RECIPES))
    p.add_argument("out_dir")
    p.add_argument("--env-seed", type=int, default=0, help="the RL run's run.seed (0)")
    p.add_argument("--skill-steps", type=int, help="calc: phase 1 steps (the recipe's)")
    p.add_argument("--steps", type=int, help="sloppy-teacher steps (the recipe's by default)")
    p.add_argument("--tool-rate", type=float, help="calc: the teacher's tool-call share")
    p.add_argument("--fix-rate", type=float, help="feedback: the teacher's right retries")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = p.parse_args(argv)
    changes = {k: v for k, v in (("steps", args.steps), ("skill_steps", args.skill_steps),
                                 ("tool_rate", args.tool_rate), ("fix_rate", args.fix_rate))
               if v is not None}  # fmt: skip
    for name in ("tool_rate", "fix_rate"):
        if not 0.0 <= changes.get(name, 0.0) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be within [0, 1]")
    if changes.get("steps", 1) < 1 or changes.get("skill_steps", 0) < 0:
        p.error("--steps must be >= 1 and --skill-steps >= 0")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = dataclasses.replace(RECIPES[args.task], **changes)
    report = make_agent_model(args.task, args.out_dir, env_seed=args.env_seed, settings=cfg,
                              force=args.force)  # fmt: skip
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
