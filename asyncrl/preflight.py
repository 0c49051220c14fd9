"""What the controller checks before any process or file exists: the plugins load, the
environment and the tokenizer load, the prompts fit, and both backends accept their config
(each mistake a ``ConfigError`` naming its field)."""

from __future__ import annotations

import json
import os
from typing import Any

import anyio

from . import plugins
from .backend import BackendPlugin
from .config import Config
from .prompts import Tokenizer

__all__ = ["check_before_spawn"]


async def check_before_spawn(cfg: Config) -> tuple[Any, Tokenizer]:
    """Load the environment and the tokenizer, measure the prompts and run both backends'
    ``check_config``: every mistake a plugin can see is a ``ConfigError`` (or
    ``PluginError``) naming its field, raised before any process or file exists."""
    trainer = BackendPlugin.of(
        plugins.load("asyncrl.training_backends", cfg.trainer.backend, "trainer.backend")
    )
    generator = BackendPlugin.of(
        plugins.load("asyncrl.generation_backends", cfg.generator.backend, "generator.backend")
    )
    make_env = plugins.load("asyncrl.environments", cfg.environment.name, "environment.name")
    environment = make_env(dict(cfg.environment.options), cfg.run.seed)
    tokenizer = Tokenizer(
        os.path.join(cfg.model.path, "tokenizer.json"), _eos_token_id(cfg.model.path)
    )
    longest = await anyio.to_thread.run_sync(_longest_prompt, environment, tokenizer, cfg)
    for plugin in (trainer, generator):
        if plugin.check_config is not None:
            plugin.check_config(cfg, max_prompt_tokens=longest)
    return environment, tokenizer


def _longest_prompt(environment: Any, tokenizer: Tokenizer, cfg: Config) -> int:
    """Tokens in the longest prompt the run can send (the train split and the evaluated part
    of the eval split)."""
    texts = [p.text for p in environment.dataset("train")]
    if cfg.eval.num_prompts:
        texts += [p.text for p in list(environment.dataset("eval"))[: cfg.eval.num_prompts]]
    longest = 0
    for start in range(0, len(texts), 4096):
        ids = tokenizer.encode_batch(texts[start : start + 4096])
        longest = max([longest, *(len(x) for x in ids)])
    return longest


def _eos_token_id(model_path: str) -> int | None:
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_path, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return None
