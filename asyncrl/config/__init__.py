"""Run configuration: msgspec structs loaded from TOML.

Every struct is frozen, keyword-only and rejects unknown fields, so a typo is an error that
names the field. Cross-field invariants are checked by :func:`validate` right after loading,
before any worker is spawned. Backend, environment and sampler options stay opaque tables here;
each plugin converts its own table with ``msgspec.convert``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from asyncrl import plugins
from asyncrl.errors import ConfigError
from asyncrl.errors import config_error as _fail
from asyncrl.config.explain import explain
from asyncrl.policy.sampler_table import make_sampler, resolve_sampler

__all__ = [
    "explain",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "EnvironmentConfig",
    "EvalConfig",
    "ExportConfig",
    "FailuresConfig",
    "GeneratorConfig",
    "GRPOConfig",
    "LossConfig",
    "PipelineConfig",
    "RefitConfig",
    "RunConfig",
    "TrainerConfig",
    "load_config",
    "make_sampler",
    "resolve_sampler",
    "validate",
]


class _Base(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class RunConfig(_Base):
    name: str = "asyncrl"
    """A label for logs and the metrics file."""
    output_dir: str = "runs/asyncrl"
    """Where metrics (``metrics.jsonl``) and worker logs go. Relative paths are resolved
    against the directory of the config file."""
    seed: int = 0
    """Seed for the dataloader order, sampling seeds and trainer initialisation."""
    num_steps: int = 10
    """Number of optimizer steps (= weight versions) to train."""
    log_format: Literal["auto", "console", "json"] = "auto"
    """Log rendering when asyncrl configures logging itself (CLI and workers)."""
    stall_warning_s: float = 10.0
    """When the controller's event loop has not turned for this long (a blocking call starves
    both pumps), a watchdog thread logs every thread's stack (also ``logs/stall-*.txt``). 0: off."""
    gc_freeze: bool = True
    """While training, exclude the objects alive at its start from the garbage collector's
    scans (``gc.freeze``; undone at the end): a full collection over the start-up heap stalled
    the controller's event loop 20-30 ms, 5 ms with it."""


class ModelConfig(_Base):
    path: str
    """A Hugging Face causal-LM directory (``config.json``, weights, ``tokenizer.json``).
    Relative paths are resolved against the directory of the config file."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The generators' weight and compute dtype. The trainer keeps float32 master weights and
    computes in float32 (FSDP2's ``mixed_precision = "bf16"`` option computes in bf16), so by
    default the two sides differ by bf16 rounding: measured mean |logprob difference| 0.006-0.015
    on the demo, which the loss's importance weights correct and refit verification bounds.
    ``float32`` makes the generator match the trainer at a cost in speed and memory."""
    chat_template: str = "auto"
    """How prompts given as chat messages are rendered (in the controller, once, to the exact
    token ids the engine gets): ``"auto"`` uses the model directory's template
    (``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``'s
    ``chat_template``: a string, or the one named ``default``); a path to a
    ``.jinja`` file (relative to the config file) uses that one. Plain-text prompts are encoded
    as they are."""


class ClusterConfig(_Base):
    trainer_ranks: int = 1
    """Training ranks (one torch.distributed group)."""
    rollout_ranks: int = 1
    """Generation ranks, one engine each."""
    startup_timeout_s: float = 600.0
    """How long workers may take to connect and report ready (engine start included)."""
    call_timeout_s: float = 900.0
    """Upper bound on any single RPC (a train chunk, a refit)."""
    shutdown_grace_s: float = 20.0
    """After asking workers to stop, wait this long before SIGTERM, and again before SIGKILL.
    A vLLM engine takes 5-10 s to close on a small CPU host; a worker that is leaving in order
    ignores the SIGTERM (it cannot turn a clean exit into a failure), so only a hung one is
    killed, after twice this."""
    torchrun: str = "torchrun"
    """The torchrun executable used when the controller spawns worker groups itself."""
    trainer_gpus: list[int] = []
    """GPU of each trainer rank, as indexes of the GPUs its node shows (``[0]``). Empty: rank
    r uses the GPU of its local rank."""
    rollout_gpus: list[int] = []
    """GPU of each rollout rank's engine (``[1]``: the engine on GPU 1, e.g. next to a trainer
    on GPU 0; ``[0]`` with ``trainer_gpus = [0]``: both share GPU 0). The engine still sees
    the node's other GPUs, after its own, so that it can map a trainer's CUDA IPC buffers.
    Empty: vLLM's default, the first visible GPU."""


class GRPOConfig(_Base):
    prompts_per_step: int = 16
    """P: prompt groups trained in one optimizer step."""
    samples_per_prompt: int = 8
    """N: completions generated per prompt (the GRPO group size)."""
    max_new_tokens: int = 16
    """Generation length limit per completion."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by the same value."""
    normalize_advantages: bool = True
    """Divide group-centred rewards by the group's standard deviation (when > 0)."""


class LossConfig(_Base):
    clip_eps_low: float = 0.2
    """PPO ratio lower clip: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO ratio upper clip: ratio <= 1 + clip_eps_high (DAPO's clip-higher when larger)."""
    is_cap: float = 2.0
    """Truncation of the importance weight between proximal and behaviour policy (TIS)."""


def _default_sampler() -> dict[str, Any]:
    return {"name": "in_order", "max_lookahead_versions": 1}


class PipelineConfig(_Base):
    sampler: Any = msgspec.field(default_factory=_default_sampler)
    """The staleness policy shared by both pumps: a table whose ``name`` picks a sampler
    (entry point group ``asyncrl.samplers``: ``in_order``, ``gated``, ``oversampled``,
    ``ready_first`` or a plugin's) and whose other keys are that sampler's knobs
    (docs/modes.md). Loading converts it to the sampler's own config struct."""
    min_groups_for_streaming_train: int = 0
    """Complete groups needed before a chunk is sent to the trainer (0 = prompts_per_step).
    Smaller values stream chunks into the open optimizer step sooner."""
    max_inflight_samples: int = 0
    """Samples generating at once, over all rollout ranks (0 = max_buffered_groups *
    samples_per_prompt: no cap beyond the buffer's). Set it to what the engines can run
    concurrently (e.g. vLLM's max_num_seqs times rollout_ranks): a long sample then holds one
    slot, not the admission of a whole group."""
    max_buffered_groups: int = 0
    """Groups generating or waiting to train (0 = the sampler's required capacity)."""


class RefitConfig(_Base):
    transport: str = "shm"
    """How weights travel to the generators: a weight transfer plugin (entry point group
    ``asyncrl.weight_transfers``). ``shm``: buckets in shared-memory files (one host, any
    device). ``cuda_ipc``: buckets in the trainer's GPU memory, mapped by the engine through
    CUDA IPC handles (one node; trainer and engine on the same GPU or on different ones).
    ``nccl``: each bucket broadcast over a collective group of the trainer and the engines
    (NCCL between GPUs, e.g. engines on other GPUs without IPC; gloo when the trainer is on
    the CPU). Buckets are announced over ZeroMQ ipc:// in every case."""
    bucket_size_mb: int = 1024
    """Size of one transfer bucket; tensors larger than this travel in a bucket of their own.
    Every bucket costs a round of messages between trainer, rollout worker and engine (~0.9 ms
    on an H200 host): a 7B refit took 40 ms in 1 GiB buckets and 120 ms in 256 MiB ones, and
    26 ms in 4 GiB ones (docs/refit.md). The trainer keeps ``staging_buffers`` buffers, each
    at most this large (smaller for a small model)."""
    staging_buffers: int = 2
    """Staging buffers the trainer fills in turn (2 to 8). A buffer is refilled only once
    every generator acknowledged its bucket, so with more of them the trainer packs further
    ahead of the engines, at the cost of one more bucket of memory each (on the trainer's
    device; an engine mirroring buckets from another GPU keeps one buffer per staging
    buffer too)."""
    drain: bool = False
    """Before each refit, stop dispatching and wait for every sample in flight to finish, so
    no sample is generated by two weight versions (slower: generation idles while the last
    samples finish). Without it, samples in flight continue across the weight update (their
    per-token logprobs say which version produced each token)."""
    drain_timeout_s: float = 60.0
    """The longest a drain waits; after it the refit goes ahead with what is still running
    (counted in the step's ``drain_timeouts``)."""
    timeout_s: float = 300.0
    """Upper bound on one bucket hand-off between trainer and generator."""
    verify_first_steps: int = 3
    """Verify the first this many refits: right after the refit, the generators and the
    trainer score a fixed probe batch (sequences of the first trained step) and the run stops
    with a ``RefitError`` if they disagree beyond ``verify_tolerance``."""
    verify_every_steps: int = 10
    """After the first ones, verify every this many weight versions (0 = never)."""
    verify_tolerance: float = 0.045
    """Largest allowed mean |generator logprob - trainer logprob| over the probe's tokens
    (nats). 3x the largest value measured on the CPU demo with a correct refit (bf16 vLLM vs
    float32 FSDP2: 0.006-0.015 over 30 steps); a refit that leaves the engine on old weights
    after a real update measured 0.3-1.0 (docs/architecture.md, 'Refit verification')."""
    verify_tolerance_fp8_kv: float = 0.2
    """``verify_tolerance`` when a generator serves an FP8 KV cache, which moves its logprobs
    away from the trainer's by itself: the GPU demo (H200, FlashAttention 3, q/k/v scales
    calibrated) measured a mean 0.032-0.103 per refit (median 0.065) where bf16 measured
    0.006-0.013; 0.2 is about 2x the largest, still below the 0.3 of a stale refit."""
    verify_num_sequences: int = 16
    """Sequences in the probe batch."""
    kv_calibration_sequences: int = 64
    """FP8 KV cache only (a generator reporting ``kv_cache_dtype`` fp8): after every step the
    trainer computes per-layer K/V scales with the updated weights on this many sequences of
    the step (before the first step: on this many training prompts), and every refit carries
    them. A refit without scales into an FP8 engine is an error."""
    kv_calibration_percentile: float = 99.9
    """Percentile, across micro-batches, of each layer's per-micro-batch amax (then the max
    across trainer ranks)."""
    kv_calibration_margin: float = 1.05
    """Head-room factor: ``scale = amax * margin / 448``."""
    kv_calibrate_q: bool = False
    """Also calibrate query scales when no generator asks for them. A generator whose
    attention quantizes the query with a static scale (vLLM's FlashAttention 3 with an FP8 KV
    cache reports ``kv_quantized_query``) gets them in any case: left at 1.0, small queries
    lose most of their precision (measured on an H200: mean |trainer - vLLM| logprob 0.085
    instead of bf16's 0.0095)."""


class TrainerConfig(_Base):
    backend: str = "fsdp2"
    """Training backend (entry point group ``asyncrl.training_backends``)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank."""
    options: dict[str, Any] = {}
    """Backend-specific options, validated by the backend."""


class GeneratorConfig(_Base):
    backend: str = "vllm"
    """Generation backend (entry point group ``asyncrl.generation_backends``)."""
    options: dict[str, Any] = {}
    """Backend-specific options, validated by the backend."""


class EnvironmentConfig(_Base):
    name: str
    """Environment plugin (entry point group ``asyncrl.environments``)."""
    options: dict[str, Any] = {}
    """Environment-specific options, validated by the environment."""
    base_dir: str = ""
    """The directory relative paths in ``options`` are taken from (``""``: the config file's
    directory); given to a factory that takes a ``base_dir`` keyword."""


class EvalConfig(_Base):
    num_prompts: int = 0
    """Held-out prompts scored greedily (0 = no evaluation)."""
    at_start: bool = True
    """Evaluate the starting policy before the first step."""
    at_end: bool = True
    """Evaluate the final policy after the last refit."""
    every_steps: int = 0
    """Also evaluate every this many steps, on the same engines while training goes on (the
    next refit waits for it); the best result goes to ``<checkpoint.dir>/best.json``."""


class CheckpointConfig(_Base):
    dir: str = ""
    """Where checkpoints go (``""``: ``<run.output_dir>/checkpoints``; relative to the config
    file). Every rank must see it (one host, or a shared file system)."""
    every_steps: int = 0
    """Save after every this many optimizer steps (0: only at the end and on demand): the
    trainer's and the controller's whole state (docs/checkpointing.md). Generation goes on."""
    at_end: bool = True
    """Save after the last step (to export it, or to resume with a larger run.num_steps)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints, and the best one (``best.json``); older ones
    are deleted once a save succeeded."""
    save_model: bool = True
    """Also write the policy as a Hugging Face directory (``model/``, ``model.dtype`` bytes a
    parameter) into each checkpoint: ``asyncrl export`` needs no trainer."""
    max_failures: int = 3
    """Failed periodic saves in a row the run tolerates (a full disk, a trainer that cannot
    write); one more stops it, as does a failed final save. A failed save leaves the previous
    checkpoint as it was."""


class ExportConfig(_Base):
    dir: str = ""
    """Where exported models go (``""``: ``<run.output_dir>/hf``): ``final/``, ``step-<N>/``."""
    at_end: bool = True
    """Export the final policy."""
    every_steps: int = 0
    """Also export every this many optimizer steps (0: never)."""


class FailuresConfig(_Base):
    generation_retries: int = 3
    """Times a group whose generation failed in the engine is dispatched again (same prompt,
    same step) after a back-off; then it is dropped. A request its own data makes unservable
    (``RequestError``: a prompt longer than the context...) is dropped at once."""
    retry_backoff_s: float = 1.0
    """Wait before the first retry of a group; doubled for each further one."""
    max_failed_groups: int = 16
    """Groups dropped for good that the run tolerates; one more stops it with the last error.
    A dropped group's step gets a fresh prompt; the ledger counts it as ``failed``."""
    on_reward_error: Literal["fail_run", "drop_group"] = "fail_run"
    """``score()`` raised, returned a non-finite reward or ran past ``reward_timeout_s``:
    ``fail_run`` stops the run naming the prompt, the completion and the error; ``drop_group``
    logs them and drops the group."""
    reward_timeout_s: float = 60.0
    """Deadline of each reward call: an environment's ``score()`` (per completion) or
    ``score_async()``, and so each reward function of the ``dataset`` environment. A call past
    it fails its group under ``on_reward_error``, naming the function, the prompt and the
    deadline; an async call is cancelled, a sync one's thread abandoned (it cannot be stopped;
    at most 16 such threads may still be running, then the run stops)."""
    train_step_retries: int = 1
    """Times a step whose train call raised on a trainer rank (out of memory in one
    micro-batch...; the trainer drops the step's gradients) is trained again from the same
    groups; then the run stops. A trainer that died or hung is not retried."""
    max_nonfinite_steps: int = 0
    """Steps whose loss or gradient norm is not finite (NaN or infinite) that the run skips:
    the trainer never applies such a step (the weights stay as they were) and its groups are
    used up. One more stops the run, naming the likely cause (the step's rewards and
    advantages, or the weights). ``0``: the first stops it. Counted from the start of the
    process (a resumed run counts afresh)."""
    rollout_restarts: int = 3
    """Times in a run a rollout worker that died (its process, or its engine) is started
    again in place: its groups go to the other workers meanwhile (or wait for it), and it is
    refitted before it gets new ones. One more death stops the run. ``0``: the first death
    stops it. Not with ``refit.transport = "nccl"`` (its group cannot take a new member)."""
    heartbeat_interval_s: float = 5.0
    """Every worker is sent a health probe this often; its event loop answers it at once,
    whatever call it is serving."""
    heartbeat_timeout_s: float = 60.0
    """A worker that answers no probe for this long while its process lives (stopped,
    deadlocked, its loop blocked) is hung: it is named (group, rank, last answer, log file)
    and handled as a death, so a rollout worker is restarted under ``rollout_restarts`` and a
    trainer stops the run. ``0``: no heartbeat."""


class MetricsConfig(_Base):
    sinks: list[str] = msgspec.field(default_factory=lambda: ["jsonl"])
    """Where step, evaluation and completion records go (entry point group
    ``asyncrl.metrics_sinks``): ``jsonl`` (``<run.output_dir>/metrics.jsonl``, always written:
    ``asyncrl plot`` and ``--resume`` read it), ``tensorboard``, ``wandb``, ``mlflow``, or a
    plugin's name; several at once. Each gets the run's resolved config first."""
    options: dict[str, dict[str, Any]] = {}
    """Per-sink options, by sink name (``[metrics.options.wandb] project = "x"``), validated
    by the sink before any process starts."""
    progress: Literal["auto", "on", "off"] = "auto"
    """A one-line progress bar (step, reward, accuracy, staleness, tokens/s, ETA) on stderr:
    ``auto`` shows it only on an interactive terminal, so logs stay clean."""
    completions_every: int = 10
    """Every this many steps, a few of the step's completions with their rewards are printed
    and sent to the sinks as a table (``completions`` records). 0: never."""
    completions_count: int = 3
    """Completions shown each time (one per group, the first groups of the step)."""


class Config(_Base):
    model: ModelConfig
    environment: EnvironmentConfig
    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss: LossConfig = LossConfig()
    pipeline: PipelineConfig = PipelineConfig()
    refit: RefitConfig = RefitConfig()
    trainer: TrainerConfig = TrainerConfig()
    generator: GeneratorConfig = GeneratorConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()
    failures: FailuresConfig = FailuresConfig()
    metrics: MetricsConfig = MetricsConfig()

    @property
    def rollout_restarts(self) -> int:
        """``failures.rollout_restarts``, or 0 over the ``nccl`` transfer (see there)."""
        return 0 if self.refit.transport == "nccl" else self.failures.rollout_restarts

    @property
    def min_groups_for_streaming_train(self) -> int:
        return self.pipeline.min_groups_for_streaming_train or self.grpo.prompts_per_step

    @property
    def max_buffered_groups(self) -> int:
        return self.pipeline.max_buffered_groups or required_buffer_capacity(self)

    @property
    def max_inflight_samples(self) -> int:
        return self.pipeline.max_inflight_samples or (
            self.max_buffered_groups * self.grpo.samples_per_prompt
        )

    def make_sampler(self) -> Any:
        """A fresh :class:`~asyncrl.policy.samplers.Sampler` for this run."""
        return make_sampler(self.pipeline.sampler)


def required_buffer_capacity(config: Config) -> int:
    """Groups the buffer must hold so that the pumps can never deadlock (the sampler's rule)."""
    return config.make_sampler().required_buffer_capacity(config.grpo.prompts_per_step)


def validate(config: Config) -> Config:
    """Check cross-field invariants; raise :class:`ConfigError` naming the field and the fix
    of the first one broken. Returns the config with ``[pipeline.sampler]`` resolved to its
    sampler's struct."""
    found = problems(config)
    if found:
        raise found[0]
    p = config.pipeline
    return msgspec.structs.replace(
        config, pipeline=msgspec.structs.replace(p, sampler=resolve_sampler(p.sampler))
    )


def problems(config: Config) -> list[ConfigError]:
    """Every broken cross-field invariant, each a :class:`ConfigError` naming the field and
    the fix (``asyncrl check-config`` prints them all)."""
    out: list[ConfigError] = []
    g, p = config.grpo, config.pipeline
    positive = {
        "run.num_steps": config.run.num_steps,
        "cluster.trainer_ranks": config.cluster.trainer_ranks,
        "cluster.rollout_ranks": config.cluster.rollout_ranks,
        "grpo.prompts_per_step": g.prompts_per_step,
        "grpo.max_new_tokens": g.max_new_tokens,
        "trainer.micro_batch_size": config.trainer.micro_batch_size,
        "refit.bucket_size_mb": config.refit.bucket_size_mb,
        "refit.verify_num_sequences": config.refit.verify_num_sequences,
        "refit.kv_calibration_sequences": config.refit.kv_calibration_sequences,
    }
    for name, value in positive.items():
        if value < 1:
            out.append(
                _fail(name, f"must be >= 1, got {value}", f"set {name} to a positive integer")
            )
    if not 2 <= config.refit.staging_buffers <= 8:
        out.append(
            _fail(
                "refit.staging_buffers",
                f"must be 2 to 8, got {config.refit.staging_buffers}",
                "use 2 (the default) or 3",
            )
        )
    m = config.metrics
    if m.completions_every < 0:
        out.append(_fail("metrics.completions_every", "must be >= 0", "use 0 to show none"))
    if m.completions_every and m.completions_count < 1:
        out.append(
            _fail(
                "metrics.completions_count",
                f"must be >= 1 when metrics.completions_every is set, got {m.completions_count}",
                "use e.g. 3, or set metrics.completions_every = 0",
            )
        )
    if g.samples_per_prompt < 2:
        out.append(
            _fail(
                "grpo.samples_per_prompt",
                f"GRPO needs at least 2 samples per prompt to form a baseline, got "
                f"{g.samples_per_prompt}",
                "set grpo.samples_per_prompt >= 2",
            )
        )
    if not g.temperature > 0:
        out.append(_fail("grpo.temperature", f"must be > 0, got {g.temperature}", "use e.g. 1.0"))
    try:
        sampler = make_sampler(p.sampler)
    except ConfigError as exc:
        out.append(exc)
        sampler = None
    for name in ("min_groups_for_streaming_train", "max_inflight_samples", "max_buffered_groups"):
        if getattr(p, name) < 0:
            out.append(_fail(f"pipeline.{name}", "must be >= 0", "use 0 for the default"))
            sampler = None  # the capacity checks below would only repeat it
    if sampler is not None and config.min_groups_for_streaming_train > g.prompts_per_step:
        out.append(
            _fail(
                "pipeline.min_groups_for_streaming_train",
                f"{p.min_groups_for_streaming_train} exceeds grpo.prompts_per_step "
                f"({g.prompts_per_step}); a step could never start",
                f"set it to at most {g.prompts_per_step}",
            )
        )
    need = sampler.required_buffer_capacity(g.prompts_per_step) if sampler else 0
    if sampler is not None and config.max_buffered_groups < need:
        out.append(
            _fail(
                "pipeline.max_buffered_groups",
                f"{p.max_buffered_groups} is below what the {sampler.name} sampler needs "
                f"({need} groups for prompts_per_step={g.prompts_per_step}; docs/modes.md); "
                "the pumps would deadlock",
                f"set pipeline.max_buffered_groups >= {need} (or 0 for the default)",
            )
        )
    if sampler is not None and config.max_inflight_samples < g.samples_per_prompt:
        out.append(
            _fail(
                "pipeline.max_inflight_samples",
                f"{p.max_inflight_samples} cannot hold one group ({g.samples_per_prompt} samples)",
                f"set it to at least grpo.samples_per_prompt ({g.samples_per_prompt}), or 0",
            )
        )
    transfers = plugins.available("asyncrl.weight_transfers")
    if config.refit.transport not in transfers:
        out.append(
            _fail(
                "refit.transport",
                f"no weight transfer named {config.refit.transport!r} is installed",
                f"use one of: {', '.join(sorted(transfers)) or 'none (reinstall asyncrl)'}",
            )
        )
    cluster = config.cluster
    for name, ranks in (("trainer", cluster.trainer_ranks), ("rollout", cluster.rollout_ranks)):
        gpus = getattr(config.cluster, f"{name}_gpus")
        if gpus and (len(gpus) != ranks or min(gpus) < 0):
            out.append(
                _fail(
                    f"cluster.{name}_gpus",
                    f"{gpus} must list one GPU index (>= 0) per {name} rank ({ranks})",
                    f"give {ranks} indexes, or leave it empty for the default placement",
                )
            )
    if not 0 < config.refit.kv_calibration_percentile <= 100:
        out.append(_fail("refit.kv_calibration_percentile", "must be in (0, 100]", "use 99.9"))
    if not config.refit.kv_calibration_margin >= 1:
        out.append(_fail("refit.kv_calibration_margin", "must be >= 1", "use e.g. 1.05"))
    if not config.refit.drain_timeout_s > 0:
        out.append(_fail("refit.drain_timeout_s", "must be > 0", "use e.g. 60"))
    if not 0 < config.failures.reward_timeout_s < float("inf"):
        out.append(_fail("failures.reward_timeout_s", "must be > 0 and finite", "use e.g. 60"))
    beat = config.failures
    if beat.heartbeat_timeout_s and not 0 < beat.heartbeat_interval_s < beat.heartbeat_timeout_s:
        out.append(_fail(
            "failures.heartbeat_interval_s",
            f"must be > 0 and below heartbeat_timeout_s ({beat.heartbeat_timeout_s})",
            "use e.g. 5 (a few probes fit in the timeout)",
        ))
    if not 0 <= beat.heartbeat_timeout_s < float("inf"):
        out.append(_fail("failures.heartbeat_timeout_s", "must be >= 0 and finite",
                         "use e.g. 60, or 0 to turn the heartbeat off"))
    if not 0 <= config.loss.clip_eps_low < 1:
        out.append(_fail("loss.clip_eps_low", "must be in [0, 1)", "use e.g. 0.2"))
    if config.loss.clip_eps_high < 0:
        out.append(_fail("loss.clip_eps_high", "must be >= 0", "use e.g. 0.2 or 0.28"))
    if config.loss.is_cap < 1:
        out.append(_fail("loss.is_cap", "must be >= 1", "use e.g. 2.0"))
    for name in ("verify_first_steps", "verify_every_steps"):
        if getattr(config.refit, name) < 0:
            out.append(_fail(f"refit.{name}", "must be >= 0", "use 0 to turn it off"))
    for name in ("verify_tolerance", "verify_tolerance_fp8_kv"):
        if not getattr(config.refit, name) > 0:
            out.append(
                _fail(
                    f"refit.{name}",
                    f"must be > 0, got {getattr(config.refit, name)}",
                    "use e.g. 0.03 (mean |logprob difference| in nats)",
                )
            )
    non_negative = {
        "checkpoint.every_steps": config.checkpoint.every_steps,
        "checkpoint.max_failures": config.checkpoint.max_failures,
        "export.every_steps": config.export.every_steps,
        "eval.every_steps": config.eval.every_steps,
        **{f"failures.{k}": getattr(config.failures, k) for k in (
            "generation_retries", "max_failed_groups", "train_step_retries", "retry_backoff_s",
            "rollout_restarts", "max_nonfinite_steps",
        )},
    }  # fmt: skip
    for name, value in non_negative.items():
        if value < 0:
            out.append(_fail(name, f"must be >= 0, got {value}", "use 0 to turn it off"))
    if config.checkpoint.keep_last < 1:
        out.append(_fail("checkpoint.keep_last", "must be >= 1", "keep at least 1"))
    if config.eval.num_prompts < 0:
        out.append(_fail("eval.num_prompts", "must be >= 0", "use 0 to disable evaluation"))
    model_dir = Path(config.model.path)
    if not (model_dir / "config.json").is_file():
        out.append(
            _fail(
                "model.path",
                f"{model_dir} is not a Hugging Face model directory (no config.json)",
                "point model.path at a directory made by save_pretrained (for the tiny demo run "
                "`python -m asyncrl_arith.make_model DIR` first)",
            )
        )
    if not (model_dir / "tokenizer.json").is_file():
        out.append(
            _fail(
                "model.path",
                f"{model_dir} has no tokenizer.json (the controller tokenizes prompts with it)",
                "save a fast tokenizer into the model directory (tokenizer.save_pretrained)",
            )
        )
    return out


def _resolve(base: Path, value: str) -> str:
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path).resolve())


def from_dict(data: dict[str, Any], *, base_dir: str | os.PathLike[str] = ".") -> Config:
    """Build and validate a :class:`Config` from a plain mapping (e.g. parsed TOML).

    Relative ``model.path`` and ``run.output_dir`` are resolved against ``base_dir``.
    """
    return validate(_convert(data, base_dir))


def _convert(data: dict[str, Any], base_dir: str | os.PathLike[str]) -> Config:
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, Config)) from None
    base = Path(base_dir)
    output_dir = _resolve(base, config.run.output_dir)
    template = config.model.chat_template
    if template != "auto":
        template = _resolve(base, template)
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(
            config.model, path=_resolve(base, config.model.path), chat_template=template
        ),
        run=msgspec.structs.replace(config.run, output_dir=output_dir),
        environment=msgspec.structs.replace(
            config.environment, base_dir=_resolve(base, config.environment.base_dir or ".")
        ),
        checkpoint=msgspec.structs.replace(
            config.checkpoint,
            dir=_resolve(base, config.checkpoint.dir or os.path.join(output_dir, "checkpoints")),
        ),
        export=msgspec.structs.replace(
            config.export, dir=_resolve(base, config.export.dir or os.path.join(output_dir, "hf"))
        ),
    )
    return config


def load_config(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> Config:
    """Load a TOML config file, apply dotted ``overrides`` and validate it.

    Args:
        path: the TOML file.
        overrides: ``{"grpo.prompts_per_step": 8, ...}`` applied on top of the file.

    Raises:
        ConfigError: the file is missing, not TOML, or fails validation.
    """
    config = load_unvalidated(path, overrides)
    try:
        return validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_unvalidated(
    path: str | os.PathLike[str], overrides: dict[str, Any] | None = None
) -> Config:
    """:func:`load_config` up to the typed struct, before the cross-field checks (for
    :func:`problems`, which lists every broken invariant instead of raising the first).

    Raises:
        ConfigError: the file is missing, not TOML, or a field is unknown or mistyped.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {key} is not a table")
        node[leaf] = value
    try:
        return _convert(data, path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain builtins (for logging and for handing to workers)."""
    return msgspec.to_builtins(config)
