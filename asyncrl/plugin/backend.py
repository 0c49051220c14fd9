"""The plugin API for generation and training backends (engines): the protocols a backend
implements, the plugin wrapper its entry point names, what it receives and returns, the errors
it raises, and the helpers a torch trainer and its contract suite share. A backend reading
refit buckets also imports :mod:`asyncrl.plugin.transfer`; the run config and the config errors
are in :mod:`asyncrl.plugin.common`.

Protocols and the plugin:

- ``BackendPlugin``: what a backend entry point names: ``create(ctx)``, ``check_config``,
  ``shm_bytes``, ``adapters``, ``gpu_memory``.
- ``MemoryNeed``: what ``gpu_memory`` returns (the parts one process holds on its GPU).
- ``ModelShape``: the model's size and shape ``gpu_memory`` gets.
- ``WorkerContext``: what ``create`` learns of its place in the run (group, rank, config, ...).
- ``GenerationBackend``: the protocol of one inference engine per rollout rank (async).
- ``TrainingBackend``: the protocol of one rank of a training group (blocking).
- ``EngineWatch``: optional for a generation backend with processes of its own: ``watch()``.
- ``Reprefill``: optional for a generation backend: recompute in-flight requests' KV at a refit.
- ``Sleeps``: optional for a generation backend: sleep while the trainer steps on its GPU.
- ``ServesJobs``: optional for a generation backend: serve several jobs' adapters at once.
- ``TrainsJobs``: optional for a training backend: train several jobs' adapters on its ranks.
- ``StateOffload``: optional for a training backend: its optimizer state to host memory and back.
- ``KVCalibration``: optional for a training backend: FP8 KV-cache scales.
- ``ReadsLossInputs``: optional for a training backend: the loss inputs it reads (``loss_inputs``).
- ``ReferencePolicy``: optional for a training backend: a frozen reference policy's logprobs.
- ``SentWeightsScoring``: optional for a training backend: logprobs under the weights it sends.
- ``SampleSink``: the ``emit(index, sample)`` callback ``generate`` hands each sample to.
- ``WeightTensor``: one full tensor a training backend's ``iter_weights`` yields.
- ``WeightBucketView``: one received refit bucket a generation backend loads.
- ``check_plugin``: the check every worker runs on a new backend (for a plugin's own tests).
- ``drain_weights``: run an ``iter_weights()`` to its end (a rank that sends nothing).
- ``generate_all``: run one ``generate`` and return the samples in index order (tests).

What a backend receives and returns (the wire structs):

- ``GenRequest``: one prompt group to generate (``n`` samples of ``prompt_ids``).
- ``Sample``: one generated sequence (token ids, logprobs, finish reason, weight versions).
- ``TokenBatch``: packed sequences to score.
- ``TrainBatch``: a ``TokenBatch`` with what the loss needs.
- ``ChunkResult``: a rank's sums over one ``train_chunk``.
- ``StepResult``: what ``finish_step`` returns.
- ``TensorEntry``: where one tensor lies in a refit bucket.

Errors a backend raises:

- ``EngineDeadError``: the engine can no longer serve (from ``watch`` or a failed call).
- ``RequestError``: a request unservable because of its own data (its group is dropped).
- ``RefitError``: a weight transfer did not complete.
- ``NonFiniteError``: a loss, gradient norm or weights that are not finite.

Helpers of a torch trainer and of its contract suite:

- ``Layout``: where each sequence and response lies in a packed batch.
- ``check_packed``: what is wrong with a packed batch, or ``None``.
- ``length_order``: a batch's sequences shortest first.
- ``micro_batch_bounds``: sequence ranges of at most a micro-batch size.
- ``token_budget_bounds``: sequence ranges of at most a token budget.
- ``AnyBatch``: a ``TokenBatch`` or a ``TrainBatch`` (a type variable).
- ``take_sequences``: some sequences of a batch, with their per-token values.
- ``read_safetensors_header``: a safetensors file's header and data offset (no torch).
- ``export_model``: one trainer rank's part of an export of the model.
- ``Adapter``: one adapter an engine holds: a job's version and the engine's id for it.
- ``AdapterLeases``: which LoRA adapter versions an engine holds, and for which requests
  (``[lora]``; docs/lora.md).
- ``AdapterError``: an adapter version that cannot be installed or leased.
- ``collective_timed_out``: whether an exception is a torch collective's timeout.
- ``torchrun_log_args``: torchrun's ``--log-dir`` arguments, under a run's scratch directory.
"""

from __future__ import annotations

from asyncrl.backend import (
    BackendPlugin,
    EngineWatch,
    GenerationBackend,
    KVCalibration,
    ReadsLossInputs,
    ReferencePolicy,
    Reprefill,
    SampleSink,
    SentWeightsScoring,
    ServesJobs,
    Sleeps,
    StateOffload,
    TrainingBackend,
    TrainsJobs,
    WeightBucketView,
    WeightTensor,
    WorkerContext,
    drain_weights,
    generate_all,
)
from asyncrl.errors import EngineDeadError, NonFiniteError, RefitError, RequestError
from asyncrl.policy.adapter_leases import Adapter, AdapterError, AdapterLeases
from asyncrl.registry import check_plugin
from asyncrl.policy.grpo import AnyBatch, take_sequences
from asyncrl.policy.packing import (
    Layout,
    check_packed,
    length_order,
    micro_batch_bounds,
    token_budget_bounds,
)
from asyncrl.procs.gpu_memory import MemoryNeed, ModelShape
from asyncrl.procs.spawn import torchrun_log_args
from asyncrl.safetensors import read_safetensors_header
from asyncrl.wire.messages import (
    ChunkResult,
    GenRequest,
    Sample,
    StepResult,
    TensorEntry,
    TokenBatch,
    TrainBatch,
)
from asyncrl.worker.export import export_model
from asyncrl.worker.trainer_runtime import collective_timed_out

__all__ = [
    "Adapter",
    "AdapterError",
    "AdapterLeases",
    "AnyBatch",
    "BackendPlugin",
    "ChunkResult",
    "EngineDeadError",
    "EngineWatch",
    "GenRequest",
    "GenerationBackend",
    "KVCalibration",
    "Layout",
    "MemoryNeed",
    "ModelShape",
    "NonFiniteError",
    "ReadsLossInputs",
    "ReferencePolicy",
    "RefitError",
    "Reprefill",
    "RequestError",
    "Sample",
    "SampleSink",
    "SentWeightsScoring",
    "ServesJobs",
    "Sleeps",
    "StateOffload",
    "StepResult",
    "TensorEntry",
    "TokenBatch",
    "TrainBatch",
    "TrainingBackend",
    "TrainsJobs",
    "WeightBucketView",
    "WeightTensor",
    "WorkerContext",
    "check_plugin",
    "check_packed",
    "collective_timed_out",
    "drain_weights",
    "export_model",
    "generate_all",
    "length_order",
    "micro_batch_bounds",
    "read_safetensors_header",
    "take_sequences",
    "token_budget_bounds",
    "torchrun_log_args",
]
