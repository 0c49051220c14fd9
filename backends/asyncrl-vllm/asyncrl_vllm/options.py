"""``[generator.options]`` of the vLLM generation backend.

asyncrl keeps backend options as an opaque table; this module converts it to
:class:`VLLMOptions` (unknown fields rejected) and raises
:class:`~asyncrl.plugin.common.ConfigError` naming the bad field. It imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncrl.plugin.common import ConfigError, explain

__all__ = ["GEMM_ENV_VAR", "RESERVED_ENGINE_ARGS", "VLLMOptions", "parse_options"]

GEMM_ENV_VAR = "ASYNCRL_VLLM_CPU_GEMM"
"""Carries ``cpu_gemm_kernel`` to the engine's processes (read by :mod:`asyncrl_vllm.ext`)."""

RESERVED_ENGINE_ARGS = frozenset(
    {
        "model",
        "dtype",
        "worker_extension_cls",
        "logprobs_mode",
        "skip_tokenizer_init",
        "max_logprobs",
    }
)
"""Engine arguments the backend sets itself; ``extra_engine_args`` may not override them."""


class VLLMOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``[generator.options]`` of the ``vllm`` generation backend."""

    enforce_eager: bool = False
    """Run the model eagerly: no torch.compile and no CUDA graphs. Starts much faster (on CPU
    and GPU) at some cost in generation speed on GPU."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens (``None``: the model config's limit)."""
    max_num_seqs: int | None = None
    """Sequences the scheduler runs at once (``None``: vLLM's default)."""
    max_num_batched_tokens: int | None = None
    """Tokens per scheduler step (``None``: vLLM's default)."""
    gpu_memory_utilization: float | None = None
    """Fraction of accelerator memory vLLM may use for weights + KV cache (``None``: vLLM's
    default). On the CPU build it is the fraction of the NUMA node's memory, unless
    ``cpu_kvcache_space_gib`` is set."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: ``auto`` (the model dtype), ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``...
    With an FP8 cache, send calibrated scales with every refit (``kv_scales``)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (GRPO groups share their prompt)."""
    tensor_parallel_size: int = 1
    """GPUs per engine."""
    seed: int | None = None
    """Engine seed for requests without their own seed (``None``: ``run.seed``)."""
    cpu_kvcache_space_gib: int | None = None
    """CPU build only: KV cache size in GiB (sets ``VLLM_CPU_KVCACHE_SPACE`` before the engine
    starts). ``None`` leaves the environment as it is."""
    cpu_omp_threads_bind: str | None = None
    """CPU build only: cores the engine's worker binds its OpenMP threads to (sets
    ``VLLM_CPU_OMP_THREADS_BIND``): ``auto``, ``nobind`` or a list such as ``1`` or ``0-3``.
    On a small shared host, binding the engine to its own core(s) matters a lot (see
    docs/backends/vllm.md). ``None`` leaves the environment as it is."""
    cpu_gemm_kernel: Literal["auto", "onednn", "sgl", "torch"] = "auto"
    """CPU build only: the kernel for unquantized linear layers. ``auto`` lets vLLM choose by
    CPU features and weight size (AMX: sgl-kernel for weights under 1 MiB, oneDNN above;
    AVX-512 or AVX2: oneDNN). ``onednn``, ``sgl`` (needs AMX) and ``torch`` (plain
    ``F.linear``, slowest) force one, for diagnosis or to work around a kernel problem.
    Every choice is refit-safe (docs/backends/vllm.md)."""
    cpu_idle_spin_s: float | None = 0.0
    """CPU build only: how long the engine's processes keep polling their shared-memory
    queues after each message before they sleep. vLLM's default (1 s; ``None`` keeps it) is
    longer than a whole RL step here, so the worker never sleeps and holds a core the trainer
    needs (measured on 2 cores: 84% of a core while idle; lookahead-1 steps 0.40-0.51 s ->
    0.18-0.22 s with 0). A sleeping reader then re-checks its queue every 2 ms (vLLM's wake-up
    ping can be dropped; its own re-check comes after 5 s). Applied by the vLLM plugin
    ``asyncrl_vllm.idle``."""
    weight_load_mode: Literal["auto", "layerwise", "plain", "direct"] = "auto"
    """How refit writes weights into the running model. ``direct``: copies compiled once per
    tensor name from ``model.load_weights`` and replayed on later refits, straight into the
    engine's parameters (no loader overhead; names that do not reduce to plain copies keep
    using ``load_weights``); needs live unquantized parameters (CUDA, or the CPU build with
    ``cpu_gemm_kernel = "torch"``). ``plain``: ``model.load_weights`` every time.
    ``layerwise``: vLLM's layerwise reload (each layer is re-processed after its weights
    arrived; required on the CPU build, whose linear layers are prepacked). ``auto``:
    ``direct`` on a GPU, ``layerwise`` on the CPU build."""
    refit_mirror: Literal["auto", "always", "never"] = "auto"
    """How ``direct`` mode reads a bucket staged on a GPU (``cuda_ipc``). ``auto``: a bucket
    on another GPU is copied whole into a buffer on the engine's GPU (one copy over the link,
    overlapped with writing the previous bucket into the parameters; one buffer per staging
    buffer of the trainer, of its size: 2 × 1 GiB by default); one on the engine's GPU is read
    where it is. ``never``: read every bucket where it is (saves that memory; a tensor per
    cross-GPU copy, ~25 µs each on an H200 pair). ``always``: mirror buckets on the same GPU
    too (no gain there; it runs the cross-GPU path on one GPU, for tests)."""
    prefix_cache_after_refit: Literal["salt", "reset"] = "salt"
    """How a refit keeps blocks computed by older weights from being reused. ``salt``: every
    request carries the served weight version as its ``cache_salt``, so older blocks never
    match (free; requests in flight across the refit keep the KV they have). ``reset``: drop
    the prefix cache and re-prefill requests in flight with the new weights (its cost grows
    with the KV cache: 16-17 ms per refit on an H200 with 49 GB of KV cache)."""
    logprobs_at_end: bool = True
    """Send a sample's logprobs from vLLM's engine core once, with its last output, instead of
    once per step (the engine core's scheduler :mod:`asyncrl_vllm.scheduler`). The same
    numbers arrive; what goes is three small arrays per sequence per step, serialised on
    the engine core's critical path and decoded again by the front end. A sample aborted
    mid-way then comes back without tokens (aborted samples are never trained). ``false``:
    vLLM's own scheduler. ``extra_engine_args.scheduler_cls`` replaces it either way."""
    lora_slots: int = 0
    """With ``[lora]``: adapter versions the engine serves at once (vLLM's ``max_loras``): the
    newest and every older one a request in flight still holds. 0: the sampler's staleness
    bound + 2. Each slot costs the adapter's size in device memory. Raise it when a refit is
    refused because every slot is held."""
    rpc_timeout_s: float = 300.0
    """Upper bound on one call into the engine's workers (loading one weight bucket)."""
    shutdown_timeout_s: float = 2.0
    """Grace period for the engine's processes to exit in ``close()`` before they are killed.
    The engine core exits 0.2 s after vLLM's SIGTERM (2 cores): :mod:`asyncrl_vllm.core_exit`
    skips the garbage collections of vLLM's and torch's heap in vLLM's teardown and in the
    interpreter's, 2.5 s more that made every ``close()`` end in the kill. The grace is for
    a core that does not exit."""
    extra_engine_args: dict[str, Any] = {}
    """Further ``vllm.AsyncEngineArgs`` fields, passed through unchecked (for example
    ``{"block_size": 32}``). Fields the backend sets itself are refused."""


def parse_options(raw: dict[str, Any], table: str = "generator.options") -> VLLMOptions:
    """Convert the raw options table, raising :class:`ConfigError` naming the bad field."""
    try:
        options = msgspec.convert(raw, VLLMOptions)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            explain(exc, VLLMOptions, table) + " (options: docs/backends/vllm.md)"
        ) from None
    checks = [
        (
            "max_model_len",
            options.max_model_len is None or options.max_model_len >= 1,
            "must be >= 1",
        ),
        ("max_num_seqs", options.max_num_seqs is None or options.max_num_seqs >= 1, "must be >= 1"),
        (
            "max_num_batched_tokens",
            options.max_num_batched_tokens is None or options.max_num_batched_tokens >= 1,
            "must be >= 1",
        ),
        (
            "gpu_memory_utilization",
            options.gpu_memory_utilization is None or 0 < options.gpu_memory_utilization <= 1,
            "must be in (0, 1]",
        ),
        ("tensor_parallel_size", options.tensor_parallel_size >= 1, "must be >= 1"),
        (
            "cpu_kvcache_space_gib",
            options.cpu_kvcache_space_gib is None or options.cpu_kvcache_space_gib >= 1,
            "must be >= 1 (GiB, an integer)",
        ),
        ("rpc_timeout_s", options.rpc_timeout_s > 0, "must be > 0"),
        ("shutdown_timeout_s", options.shutdown_timeout_s > 0, "must be > 0"),
    ]
    for field, ok, problem in checks:
        if not ok:
            value = getattr(options, field)
            raise ConfigError(f"{table}.{field}: {problem}, got {value!r}")
    reserved = sorted(RESERVED_ENGINE_ARGS & options.extra_engine_args.keys())
    if reserved:
        raise ConfigError(
            f"{table}.extra_engine_args: {', '.join(reserved)} cannot be overridden (the backend "
            "sets them itself). Fix: remove them; the model comes from model.path and model.dtype"
        )
    return options
