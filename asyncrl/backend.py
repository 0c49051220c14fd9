"""Contracts between the worker runtime and backend plugins.

A backend distribution registers, under ``asyncrl.generation_backends`` or
``asyncrl.training_backends``, either a :class:`BackendPlugin` (preferred: a factory plus a
check of its config section that the controller runs before any worker is spawned) or a bare
factory. The factory is called with a :class:`WorkerContext` in the worker and returns an
object implementing :class:`GenerationBackend` or :class:`TrainingBackend`. The worker runtime
(:mod:`asyncrl.worker.rollout_runtime`, :mod:`asyncrl.worker.trainer_runtime`) owns the sockets
and calls these methods; backends never see ZeroMQ.

Generation backends are asyncio-native (vLLM's ``AsyncLLM`` is): their methods are coroutines
run on the worker's event loop. Training backends are blocking torch code: the runtime calls
them in one dedicated thread, one call at a time, in the order the controller sent them, so
collectives line up across ranks.

The worker checks a backend against its protocol once, when it is created
(:func:`check_plugin`): a missing, misspelt or wrongly ``async`` method is one
:class:`~asyncrl.errors.PluginError` before the engine starts, and the runtime then calls the
methods directly.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import structlog

from asyncrl.config import Config
from asyncrl.wire.messages import (
    ChunkResult,
    GenRequest,
    Sample,
    StepResult,
    TensorEntry,
    TokenBatch,
    TrainBatch,
)

__all__ = [
    "BackendPlugin",
    "EngineWatch",
    "GenerationBackend",
    "KVCalibration",
    "ReadsLossInputs",
    "ReferencePolicy",
    "Reprefill",
    "SampleSink",
    "SentWeightsScoring",
    "ServesJobs",
    "Sleeps",
    "StateOffload",
    "TrainingBackend",
    "TrainsJobs",
    "WeightBucketView",
    "WeightTensor",
    "WorkerContext",
    "drain_weights",
    "generate_all",
]

log = structlog.get_logger("asyncrl.backend")


SampleSink = Callable[[int, Sample], Awaitable[None]]
"""``await emit(index, sample)``: hands sample ``index`` of a group to the runtime, which pushes
it to the controller at once."""


@dataclass(frozen=True)
class WorkerContext:
    """What a backend learns about its place in the run."""

    group: str
    """``trainer`` or ``rollout``."""
    rank: int
    """Rank within the group."""
    world_size: int
    """Ranks in the group."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    config: Config
    """The whole run config; the backend reads its own ``options`` table from it."""
    run_dir: str
    """Private per-run directory (mode 0700) for sockets and shared-memory files."""
    extra: dict[str, Any] = field(default_factory=dict)
    gpu: int | None = None
    """The GPU this rank must use (``cluster.trainer_gpus`` / ``cluster.rollout_gpus``, an
    index among the GPUs the node shows), or ``None`` for the backend's default."""


@dataclass(frozen=True)
class BackendPlugin:
    """What a backend entry point names: define it in a module that imports no engine (the
    package's ``__init__``), since the controller loads it to run :attr:`check_config`."""

    create: Callable[[WorkerContext], Any]
    """The factory, called in each worker of the backend's group (import the engine here)."""
    check_config: Callable[..., None] | None = None
    """``check_config(config, *, max_prompt_tokens)``: raise
    :class:`~asyncrl.errors.ConfigError` naming the field and the fix for anything the backend
    would refuse (its ``options`` table, limits such as a context length shorter than the
    longest prompt (``max_prompt_tokens``, in tokens) plus ``grpo.max_new_tokens``). Called by
    the controller before any worker is spawned; must be cheap and import no engine."""
    shm_bytes: Callable[[Any], int] | None = None
    """``shm_bytes(config)``: bytes one rank of the backend needs free in ``/dev/shm`` when it
    starts (an engine's shared-memory queues), added to the ``shm`` transfer's own by the
    controller's check before any worker is spawned (:mod:`asyncrl.procs.space`). Cheap; imports
    no engine."""

    adapters: bool = False
    """Whether the backend trains (a training backend) or serves (a generation backend) LoRA
    adapters: a run with ``[lora]`` is refused before any worker starts unless both of its
    backends say so (docs/lora.md)."""
    gpu_memory: Callable[[Any, Any, int | None], Any] | None = None
    """``gpu_memory(config, shape, gpu_bytes)``: what one process of the backend holds on its
    GPU at its peak (a :class:`~asyncrl.procs.gpu_memory.MemoryNeed`; ``shape`` a
    :class:`~asyncrl.procs.gpu_memory.ModelShape`, ``gpu_bytes`` its GPU's memory or ``None``),
    for the run's memory plan, checked before any worker is spawned (docs/one-gpu.md). Cheap;
    imports no engine. ``None``: the plan counts nothing for the backend."""

    def __call__(self, ctx: WorkerContext) -> Any:
        """Same as :attr:`create` (so a plugin can be used where a factory is expected)."""
        return self.create(ctx)

    @classmethod
    def of(cls, obj: Any) -> BackendPlugin:
        """``obj`` as a plugin: a :class:`BackendPlugin` as is, a bare factory wrapped."""
        if isinstance(obj, BackendPlugin):
            return obj
        if callable(obj):
            return cls(create=obj)
        raise TypeError(f"a backend entry point must name a BackendPlugin or a factory, got {obj!r}")


@dataclass(frozen=True)
class WeightTensor:
    """One full (unsharded) tensor for refit.

    ``data`` is the tensor itself: a contiguous torch tensor of ``dtype`` on any device (a
    device transfer such as ``cuda_ipc`` copies it on the GPU; ``shm`` copies it to the host),
    or a ``uint8`` numpy view of its bytes (backends without torch). Only the sending rank needs
    ``data``; other ranks may yield ``None`` after taking part in the gather, and
    :meth:`TrainingBackend.weight_specs` lists the tensors with ``data=None``.
    """

    name: str
    """Hugging Face checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    dtype: str
    """torch dtype name without the prefix: ``bfloat16``, ``float32``..."""
    shape: tuple[int, ...]
    data: Any = None
    stable: bool = False
    """``data`` stays valid and unchanged until the iteration ends (a live parameter, or a
    tensor of its own that nothing reuses): the sender may defer its copy and batch it with
    the rest of its bucket. Leave ``False`` for memory the trainer reuses once it moves on
    (a sharded trainer's gathered unit)."""


@dataclass(frozen=True)
class WeightBucketView:
    """A received bucket: ``entries`` describe tensors inside the staged bytes behind
    ``handle``, which the weight transfer named ``transport`` opens
    (:mod:`asyncrl.transfers`; ``asyncrl.transfers.shm.read_bytes`` reads ``shm`` buckets
    without torch). The sender leaves them unchanged until the receiver acknowledges the bucket.
    The runtime has checked the entries against the manifest: each is the next tensor, of its
    exact size, inside the bucket.
    """

    version: int
    index: int
    transport: str
    handle: bytes
    nbytes: int
    entries: list[TensorEntry]
    last: bool


@runtime_checkable
class GenerationBackend(Protocol):
    """One inference engine per rollout rank."""

    async def start(self) -> dict[str, Any]:
        """Start the engine. Returns capabilities reported to the controller
        (e.g. ``{"backend_version": "0.32.0", "kv_cache_dtype": "auto"}``)."""

    async def generate(self, request: GenRequest, emit: SampleSink) -> None:
        """Generate ``request.n`` samples and ``await emit(i, sample)`` for each one as soon
        as it finishes (any order, each index ``0 .. n-1`` exactly once); return when all are
        emitted. Logprobs are of the sampled tokens after temperature. Raising ends the group
        (the controller is told). Cancellation: the engine requests are aborted and the
        cancellation propagates."""

    async def abort(self, group_ids: list[str]) -> None:
        """Abort running groups: every sample of theirs not yet emitted is emitted now or
        soon, cut short, with ``finish_reason == "abort"``. Unknown ids are ignored."""

    async def score(self, batch: TokenBatch, temperature: float) -> np.ndarray:
        """Logprobs (float32, flat) of every response token of ``batch`` under the engine's
        current weights."""

    async def begin_weight_update(
        self,
        version: int,
        manifest: list[TensorEntry],
        *,
        kv_scales: dict[str, float] | None = None,
    ) -> None:
        """Check ``manifest`` (every tensor of the version, in sending order, with
        ``offset = nbytes = 0``) against the model: names, dtypes and shapes. Raise, touching
        nothing, if it does not fit (the refit fails and the engine keeps its weights), or if
        the engine needs KV-cache scales (an FP8 KV cache) and ``kv_scales`` is empty.
        Otherwise stop scheduling (in-flight requests are kept) and prepare to load.
        ``kv_scales`` are applied after the last bucket's weights (a reload resets them)."""

    async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
        """Load every tensor of ``bucket`` into the engine. When this returns the engine no
        longer reads the bucket's memory. ``bucket.last`` marks the version's last bucket; the
        next bucket's load may be called before this one returns (the engine must apply them
        in call order)."""

    async def abort_weight_update(self, version: int, *, loaded_any: bool) -> None:
        """The refit of ``version`` failed after :meth:`begin_weight_update`. Without any
        bucket loaded (``loaded_any`` false) resume serving the previous weights; otherwise
        stay paused (the weights are mixed; the run stops)."""

    async def finish_weight_update(self, version: int, *, reset_prefix_cache: bool) -> None:
        """Every bucket is loaded: finalize, make sure nothing cached from older weights is
        reused (``reset_prefix_cache``; the controller always asks) and resume scheduling."""

    async def close(self) -> None:
        """Shut the engine down and reap its processes. Idempotent."""


class KVCalibration(Protocol):
    """Optional for a :class:`TrainingBackend`: needed when a generator serves an FP8 KV cache
    (the controller refuses such a run otherwise)."""

    def calibrate_kv_scales(
        self, batch: TokenBatch, *, percentile: float, margin: float, include_q: bool
    ) -> dict[str, float]:
        """Per-layer K/V (and Q) scales of the current weights on ``batch`` (this rank's
        share): per-layer amax of what enters the KV cache (after RoPE) per micro-batch, the
        ``percentile`` across micro-batches, the max across ranks, ``amax * margin / 448``.
        Named ``model.layers.{i}.self_attn.{k,v,q}_scale``. Collective: every rank calls it
        and returns the same scales."""


class ReferencePolicy(Protocol):
    """Optional for a :class:`TrainingBackend`: a frozen reference policy, which a loss with
    a KL term (``loss.kl_coef > 0``) needs (the trainer worker refuses such a run on a
    backend without it, before it starts)."""

    def reference_logprobs(self, batch: TokenBatch, temperature: float) -> np.ndarray:
        """Like :meth:`~TrainingBackend.compute_logprobs`, under the reference policy."""


class ReadsLossInputs(Protocol):
    """Optional for a :class:`TrainingBackend` whose ``train_chunk`` reads optional
    :class:`~asyncrl.wire.messages.TrainBatch` fields: the trainer worker refuses, before the
    backend starts, a run whose loss needs a field the backend does not list (docs/losses.md)."""

    loss_inputs: frozenset[str]
    """The fields it reads, of ``proximal_logprobs`` (the ratio's denominator instead of the
    forward's own) and ``reference_logprobs`` (the KL term against the reference policy): a
    set, frozenset, list or tuple of those names."""


class SentWeightsScoring(Protocol):
    """Optional for a :class:`TrainingBackend` whose weights are not the ones it sends: float32
    master weights that :meth:`~TrainingBackend.iter_weights` rounds to ``model.dtype``. Refit
    verification compares the generators with this instead of
    :meth:`~TrainingBackend.compute_logprobs`, so that both sides score the same weights and
    only the kernels differ (without it, a bf16 run's generators drift from the float32
    trainer by rounding after every step that moves weights less than bf16 resolves, and the
    check can stop a healthy run: docs/refit.md, 'Refit verification')."""

    def sent_logprobs(self, batch: TokenBatch, temperature: float, dtype: str) -> np.ndarray:
        """Like :meth:`~TrainingBackend.compute_logprobs`, with every weight rounded to
        ``dtype`` (a torch dtype name, ``model.dtype``) as :meth:`iter_weights` rounds it; the
        backend's own weights are bit for bit what they were after the call. Collective."""


class EngineWatch(Protocol):
    """Optional for a :class:`GenerationBackend` whose engine runs in processes of its own (vLLM
    does). The worker runtime runs :meth:`watch` next to its calls once :meth:`start` returned.

    A backend with a watch also raises :class:`~asyncrl.errors.EngineDeadError` itself from a
    call (``generate``, ``score``, the weight loads, ``abort``) that failed because its engine
    died, even before :meth:`watch` has seen the process exit: the worker reports any other
    error at once as that call's or that group's own (a ``Failure``, a ``GroupFailed`` the
    controller retries or drops), and waits for no verdict."""

    async def watch(self) -> None:
        """Never return while the engine can serve; raise
        :class:`~asyncrl.errors.EngineDeadError` (naming the process and its exit code) as soon
        as it cannot, so the worker stops at once instead of waiting on a dead engine.
        Cancellation: stops watching."""


class Reprefill(Protocol):
    """Optional for a :class:`GenerationBackend` with a KV cache: what the sampler's
    ``in_flight_at_refit = "reprefill"`` needs (the worker refuses to start such a run on a
    backend without it)."""

    async def reprefill_in_flight(self) -> None:
        """During a refit (after the last bucket loaded, before
        :meth:`~GenerationBackend.finish_weight_update`): drop the KV cache of every request
        in flight, so that once generation resumes the new weights recompute it from the
        request's tokens (prompt and those generated so far) before its next token. Nothing
        generated is lost; the tokens keep the versions that generated them. (A backend that
        serves ``[lora]`` adapter versions side by side moves each request to the new version
        once it is installed, to the same effect.)"""


class ServesJobs(Protocol):
    """Optional for a :class:`GenerationBackend` that serves ``[lora]`` adapters: the
    adapters of several jobs at once, on one base (docs/jobs.md; the controller gives a run
    jobs only over backends with it). Such a backend serves each request with the newest
    adapter of ``request.job`` (``""``: the run's one policy), never another job's, and takes
    ``job=`` (a keyword, given only when it is not ``""``) in ``score`` (under that job's
    newest adapter) and in ``begin_weight_update``, ``abort_weight_update`` and
    ``finish_weight_update`` (the version is that job's adapter; only its requests move to it
    at a re-prefill). A job's version 0 is the base with no adapter, until its first refit."""

    async def close_job(self, job: str) -> None:
        """``job`` ended (its requests were aborted): refuse its requests from now on, and
        drop its adapters as their last requests end."""


class TrainsJobs(Protocol):
    """Optional for a :class:`TrainingBackend` with ``[lora]``: the adapters of several jobs
    on the same ranks and the same frozen base (docs/jobs.md). Each job has its own adapter,
    optimizer and open step; a job's steps update its adapter alone, and two jobs' steps may
    be open at once, their chunks interleaved. Such a backend takes ``job=`` (a keyword, given
    only when it is not ``""``) in ``compute_logprobs``, ``begin_step``, ``train_chunk``,
    ``finish_step``, ``weight_specs`` and ``iter_weights`` (that job's adapter alone is sent,
    under PEFT's saved names), ``save_state`` and ``load_state`` (that job's adapter and
    optimizer state alone, under names of no slot: a resumed job may get another slot)."""

    def open_job(self, job: str, *, seed: int, lr: float) -> None:
        """Collective: ``job`` takes a free adapter slot, started afresh from ``seed`` (its
        policy is the base), with an optimizer of its own at ``lr``. Raises when no slot is
        free, naming the fix."""

    def close_job(self, job: str) -> None:
        """``job`` ends (no step of its open): its slot is free again, its optimizer state
        dropped."""


class Sleeps(Protocol):
    """Optional for a :class:`GenerationBackend` that shares its GPU with a trainer rank:
    what ``cluster.placement = "take_turns"`` needs (the worker refuses to start such a run on
    a backend without it). The engine sleeps while the trainer steps; the next refit wakes it
    (:meth:`~GenerationBackend.begin_weight_update` brings the weights' memory back and loads
    the new weights into it, :meth:`~GenerationBackend.finish_weight_update` the KV cache's,
    then serving resumes). docs/one-gpu.md."""

    async def sleep(self) -> dict[str, Any]:
        """Release the engine's GPU memory: the KV cache, and the weights where the next refit
        replaces them all (with ``[lora]`` the base weights are kept, in host memory). Nothing
        is lost: a request in flight stops, keeps its tokens, and goes on from them after the
        wake (its prompt and those tokens prefilled again by the new weights); a request that
        arrives while asleep waits for the wake. Returns facts for the run's records
        (``sleep_s``, ``held``: requests held). Asleep already: does nothing."""


class StateOffload(Protocol):
    """Optional for a :class:`TrainingBackend` on a GPU: with ``cluster.placement =
    "take_turns"``, the trainer's optimizer state goes to host memory while the engine
    generates, and its gradients are freed (the controller asks only when they do not fit
    beside the engine: docs/one-gpu.md). The parameters stay: they are the refit's source."""

    def state_to_host(self) -> int:
        """Between steps: move the optimizer state to host memory and free the gradients;
        returns the bytes that left the GPU. Already there (or a CPU trainer): 0. Collective
        only if the backend's own offload is."""

    def state_to_device(self) -> int:
        """Bring what :meth:`state_to_host` moved back, before the next step; returns the
        bytes moved. A step after ``state_to_host`` → ``state_to_device`` equals the step
        without them, bit for bit. Nothing moved: 0."""


@runtime_checkable
class TrainingBackend(Protocol):
    """One rank of a torch.distributed training group. All methods are blocking; every rank
    receives the same sequence of calls (with its own share of the data)."""

    def start(self) -> dict[str, Any]:
        """Initialise the process group, load the model, build the optimizer."""

    def compute_logprobs(self, batch: TokenBatch, temperature: float) -> np.ndarray:
        """Logprobs (float32, flat) of the response tokens of this rank's ``batch``."""

    def begin_step(self, step: int) -> None:
        """Open an optimizer step; zero gradients. Called for the step that is open, it starts
        that step again from zero gradients (the controller retries a step whose train call
        failed on some rank); called while another step is open, it raises."""

    def train_chunk(self, step: int, batch: TrainBatch) -> ChunkResult:
        """Accumulate raw (unnormalized) loss-sum gradients of ``batch`` into the open step.
        Only the tokens ``batch.loss_mask`` marks train (the others add no loss, no gradient,
        no stats); ``num_loss_tokens`` counts them. Every rank runs the same number of
        forward/backward passes (ranks with less data pad with fully masked micro-batches)
        because FSDP's collectives must line up."""

    def finish_step(self, step: int, num_loss_tokens: int) -> StepResult:
        """Scale gradients by 1/num_loss_tokens (the step's global count), clip, step the
        optimizer. The result equals one big batch of all the step's chunks. A step whose loss
        or gradient norm is not finite is not applied (on any rank): the result carries the
        non-finite value, and the controller skips the step or stops the run.

        With ``loss.aggregation`` other than ``token_mean`` it is called with a keyword
        ``normalizer`` (> 0): scale by 1/normalizer instead (still checking
        ``num_loss_tokens``); the trainer worker refuses a backend without the keyword
        before it starts."""

    def weight_specs(self) -> list[WeightTensor]:
        """What :meth:`iter_weights` yields, in order, with ``data=None`` (name, dtype, shape):
        the refit's manifest, checked by the generators before any weight moves. Cheap; not
        collective."""

    def iter_weights(self) -> Iterator[WeightTensor]:
        """Yield every parameter as a full tensor in Hugging Face naming, on the trainer's
        device (the transfer copies it). Collective: all ranks iterate in lockstep; only rank
        0's ``data`` is used."""

    def save_state(self, path: str) -> None:
        """Write model and optimizer state under the directory ``path`` (created if missing;
        the same path on every rank, visible to all). Collective: every rank writes its own
        part. Only between steps (raise if a step is open). Saving must not change training:
        save -> step equals step. Weights holding a NaN or an infinity are refused
        (:class:`~asyncrl.errors.NonFiniteError`), nothing written."""

    def load_state(self, path: str) -> None:
        """Restore what :meth:`save_state` wrote into this started backend (same model,
        options and world size): load -> step equals the step the saving run took next.
        Collective; only between steps. Loaded weights holding a NaN or an infinity are
        refused (:class:`~asyncrl.errors.NonFiniteError`, naming ``path``)."""

    def close(self) -> None:
        """Destroy the process group and free memory. Idempotent."""


def drain_weights(weights: Iterator[WeightTensor], *, after_failure: bool = False) -> None:
    """Run ``weights`` (an ``iter_weights()``) to its end, dropping what it yields: how a
    rank that sends nothing, or one whose send or write failed, still takes part in every
    gather (the other ranks wait in the collective otherwise). ``after_failure``: an error of
    the iteration itself is logged, not raised (the failure's own error is the one reported)."""
    try:
        collections.deque(weights, 0)
    except Exception as exc:
        if not after_failure:
            raise
        error = f"{type(exc).__name__}: {exc}"
        log.warning("weight_iteration_failed_while_draining", error=error)


async def generate_all(backend: GenerationBackend, request: GenRequest) -> list[Sample]:
    """Run ``backend.generate(request, emit)`` and return the samples in index order (for
    callers that want a whole group at once, e.g. tests and notebooks).

    Raises:
        RuntimeError: the backend emitted an index twice, out of range, or not at all.
    """
    got: dict[int, Sample] = {}

    async def emit(index: int, sample: Sample) -> None:
        if index in got or not 0 <= index < request.n:
            raise RuntimeError(f"group {request.group_id}: sample {index} emitted twice or out of range")
        got[index] = sample

    await backend.generate(request, emit)
    if len(got) != request.n:
        missing = sorted(set(range(request.n)) - set(got))
        raise RuntimeError(f"group {request.group_id}: samples {missing} were never emitted")
    return [got[i] for i in range(request.n)]
