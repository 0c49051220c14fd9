"""vLLM generation backend for asyncrl (entry point ``asyncrl.generation_backends:vllm``).

Modules: :mod:`.backend` (the ``AsyncLLM``-driving backend), :mod:`.ext` (the worker
extension run inside vLLM's workers), :mod:`.options` (``[generator.options]``),
:mod:`.scoring` and :mod:`.kv_scales` (pure helpers), :mod:`.reaper` (kills the engine's
processes if their owner dies). Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.backend import BackendPlugin, WorkerContext
from asyncrl.config import Config
from asyncrl.errors import ConfigError

__version__ = "0.1.0.dev0"
__all__ = ["check_config", "plugin"]


def _create(ctx: WorkerContext) -> Any:
    from .backend import VLLMBackend

    return VLLMBackend(ctx)


def _model_limit(model_path: str) -> int | None:
    """The context length vLLM derives from the model when ``max_model_len`` is unset."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = data.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def check_config(config: Config, *, max_prompt_tokens: int) -> None:
    """``[generator.options]`` and the context length, before any engine starts."""
    from .options import parse_options

    options = parse_options(dict(config.generator.options))
    limit = options.max_model_len or _model_limit(config.model.path)
    need = max_prompt_tokens + config.grpo.max_new_tokens
    if limit is not None and need > limit:
        field = (
            "generator.options.max_model_len"
            if options.max_model_len
            else f"model.path ({config.model.path}: max_position_embeddings)"
        )
        raise ConfigError(
            f"{field}: a context of {limit} tokens cannot hold the longest prompt "
            f"({max_prompt_tokens} tokens) plus grpo.max_new_tokens ({config.grpo.max_new_tokens})"
            f" = {need}. Fix: set generator.options.max_model_len >= {need}, lower "
            f"grpo.max_new_tokens, or drop prompts longer than "
            f"{max(0, limit - config.grpo.max_new_tokens)} tokens"
        )


plugin = BackendPlugin(create=_create, check_config=check_config)
"""The entry point ``asyncrl.generation_backends:vllm``."""
