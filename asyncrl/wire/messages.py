"""Every message that crosses a socket, as msgspec structs.

Rules (see docs/protocol.md):

* Control messages are tagged unions with explicit short tags (``tag_field="k"``). A tag is
  never reused, also after its message is gone (retired: ``reset_pc``, protocol 7); fields
  are only ever appended, with defaults.
* Data messages (rollouts, batches, weight buckets) are ``array_like=True, gc=False``.
* Numeric arrays are ``numpy.ndarray`` fields; :mod:`asyncrl.wire.codec` moves them as separate
  zero-copy frames described by (dtype, shape). Nothing is ever pickled.
* :data:`PROTOCOL_VERSION` is checked once, in the :class:`Hello` handshake. Bump it on any
  change that an older peer could misread, and say so in CHANGELOG.md.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

PROTOCOL_VERSION = 18

_CTRL = dict(tag_field="k", kw_only=True, omit_defaults=True)
_DATA = dict(tag_field="k", array_like=True, gc=False)


# --------------------------------------------------------------------------- batches
class TokenBatch(msgspec.Struct, array_like=True, gc=False):
    """B packed sequences: ``tokens[offsets[i]:offsets[i]+seq_lens[i]]`` is sequence i.

    The first ``prompt_lens[i]`` tokens of a sequence are the prompt; the rest is the response.
    """

    tokens: np.ndarray  # int32 [sum(seq_lens)]
    seq_lens: np.ndarray  # int32 [B]
    prompt_lens: np.ndarray  # int32 [B]


class TrainBatch(msgspec.Struct, array_like=True, gc=False):
    """A :class:`TokenBatch` with what the loss needs, per response token and per sequence.

    ``loss_mask`` (protocol 8) says which response tokens train: 1 for a generated token, 0
    for one the controller inserted (a tool result, a user turn), whose behaviour logprob is
    a placeholder. Masked tokens add neither loss nor gradient nor statistics, and the step
    is normalized by the trained tokens only. A single-turn batch is all ones.
    """

    tokens: np.ndarray  # int32 [sum(seq_lens)]
    seq_lens: np.ndarray  # int32 [B]
    prompt_lens: np.ndarray  # int32 [B]
    behaviour_logprobs: np.ndarray  # float32 [sum(seq_lens - prompt_lens)]
    advantages: np.ndarray  # float32 [B]
    loss_mask: np.ndarray  # uint8 [sum(seq_lens - prompt_lens)], 1 = the token trains
    proximal_logprobs: np.ndarray | None = None  # float32 [responses] (protocol 12)
    """The trainer's logprobs before the RL step's first optimizer step (a refresh forward),
    when the loss needs them from outside the step's own forward (``grpo.mini_steps``)."""
    reference_logprobs: np.ndarray | None = None  # float32 [responses] (protocol 12)
    """The reference policy's logprobs, for a KL term in the loss (``loss.kl_coef``)."""


# --------------------------------------------------------------------------- requests
class GenRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One prompt group: ``n`` samples of ``prompt_ids``."""

    group_id: str
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    seed: int | None = None
    job: str = ""
    """(protocol 18) The job whose adapter serves it (``""``: the run's one policy)."""


class Generate(msgspec.Struct, tag="gen", **_CTRL):
    """Start generating these groups; each sample is pushed on the data socket
    (:class:`SampleDone`) as soon as it finishes."""

    requests: list[GenRequest]


class Abort(msgspec.Struct, tag="abort", **_CTRL):
    """Abort these groups; every sample not yet pushed still comes back, cut short, with
    ``finish_reason == "abort"``."""

    group_ids: list[str]


class ScoreTokens(msgspec.Struct, tag="score", **_CTRL):
    """Return the engine's logprobs of the response tokens of fixed sequences."""

    batch: TokenBatch
    temperature: float = 1.0
    job: str = ""
    """(protocol 18) Under this job's newest adapter (``""``: the run's one policy)."""


class ReceiveWeights(msgspec.Struct, tag="recv_w", **_CTRL):
    """Pull weight version ``version`` from the trainer's transfer socket and load it (the
    controller always asks for the prefix-cache reset: cached KV of old weights is stale)."""

    version: int
    address: str
    transport: str = "shm"
    reset_prefix_cache: bool = True
    kv_scales: dict[str, float] | None = None
    timeout_s: float = 300.0
    reprefill: bool = False
    """The requests in flight recompute their KV cache with the new weights before they go on
    (the sampler's ``in_flight_at_refit = "reprefill"``); else they continue over it."""
    job: str = ""
    """(protocol 18) The version is this job's adapter (``""``: the run's one policy); only
    the job's requests move to it."""


class OpenJob(msgspec.Struct, tag="open_job", **_CTRL):
    """(protocol 18) Trainer: ``job`` takes a free adapter slot, started afresh from ``seed``
    (its policy is the base), with an optimizer of its own at ``lr``. Answered with
    :class:`Empty`."""

    job: str
    seed: int
    lr: float


class CloseJob(msgspec.Struct, tag="close_job", **_CTRL):
    """(protocol 18) ``job`` ended. Rollout: its requests are refused from now on and its
    adapters leave the engine as their last requests end (abort them first). Trainer: its
    slot is free again, its optimizer state dropped, a step of it still open abandoned.
    Answered with :class:`Empty`."""

    job: str


class ComputeLogprobs(msgspec.Struct, tag="logprobs", **_CTRL):
    """Trainer: logprobs of the response tokens under the current weights, under them as sent
    to the generators (``policy = "sent"``: rounded to ``model.dtype``, refit verification's
    side), or under the reference policy (``policy = "reference"``, protocol 12; ``"sent"``: 15)."""

    batch: TokenBatch
    temperature: float = 1.0
    policy: str = "current"
    job: str = ""
    """(protocol 18) Under this job's adapter (``""``: the run's own policy)."""


class BeginStep(msgspec.Struct, tag="begin", **_CTRL):
    """Open optimizer step ``step``; chunks accumulate gradients until :class:`FinishStep`."""

    step: int
    job: str = ""
    """(protocol 18) This job's step; each job has its own (``""``: the run's own)."""


class TrainChunk(msgspec.Struct, tag="chunk", **_CTRL):
    """Forward/backward this rank's share of a chunk into the open step (no optimizer step)."""

    step: int
    batch: TrainBatch
    job: str = ""
    """(protocol 18) Into this job's open step, through its adapter (``""``: the run's)."""


class FinishStep(msgspec.Struct, tag="finish", **_CTRL):
    """Normalize gradients by the step's loss tokens (or ``normalizer``), clip, take one
    optimizer step."""

    step: int
    num_loss_tokens: int
    normalizer: float = 0.0
    """What the step's loss sum is divided by (``loss.aggregation``): 0 means
    ``num_loss_tokens`` (token-mean); else the step's sequences, or sequences x a constant."""
    job: str = ""
    """(protocol 18) This job's step: its adapter and optimizer alone (``""``: the run's)."""


class SendWeights(msgspec.Struct, tag="send_w", **_CTRL):
    """Trainer: publish version ``version`` to ``receivers`` (``group:rank`` identities),
    whose processes are ``receiver_pids`` on ``receiver_hosts`` (same order; ``Hello.pid``
    and ``Hello.host``): the sender goes on without one on its host that exits meanwhile (a
    restarted rollout worker), and a transfer may route by host and tell a new process
    under the same identity."""

    version: int
    receivers: list[str]
    receiver_pids: list[int] = []
    receiver_hosts: list[str] = []
    transport: str = "shm"
    bucket_size_bytes: int = 256 << 20
    timeout_s: float = 300.0
    job: str = ""
    """(protocol 18) This job's adapter is the version sent (``""``: the run's own policy)."""


class CalibrateKV(msgspec.Struct, tag="calib_kv", **_CTRL):
    """Trainer: FP8 KV-cache scales of the current weights on ``batch`` (this rank's share;
    every rank answers with the same scales, maxed across ranks)."""

    batch: TokenBatch
    percentile: float = 99.9
    margin: float = 1.05
    include_q: bool = False


class SaveState(msgspec.Struct, tag="save", **_CTRL):
    """Trainer: write model and optimizer state under the directory ``path``
    (``TrainingBackend.save_state``; collective, between steps)."""

    path: str
    job: str = ""
    """(protocol 18) That job's adapter and optimizer state alone (``""``: the run's)."""


class LoadState(msgspec.Struct, tag="load", **_CTRL):
    """Trainer: restore what :class:`SaveState` wrote (collective, before any step)."""

    path: str
    job: str = ""
    """(protocol 18) Into this job's slot, what was saved of a job (``""``: the run's)."""


class ExportModel(msgspec.Struct, tag="export", **_CTRL):
    """Trainer: write the current weights as a Hugging Face directory at ``path`` (rank 0
    writes; the others take part in the gathers), with the non-weight files of
    ``source_dir``."""

    path: str
    source_dir: str
    shard_bytes: int = 5 << 30


class ReceiverGone(msgspec.Struct, tag="rcv_gone", **_CTRL):
    """Trainer rank 0, sent unanswered: rollout worker ``receiver`` died (the controller saw
    it: its pid, its last words, its successor's ``Hello`` or its silence). A refit under way
    leaves it out at once, as the sender's own pid watch does on its host; on another host
    that watch sees nothing, and a collective transfer's broadcast would wait for the dead
    one until its timeout."""

    receiver: str


class Sleep(msgspec.Struct, tag="sleep", **_CTRL):
    """(protocol 17) Rollout: the engine sleeps, its GPU memory released, while the trainer
    steps (``cluster.placement = "take_turns"``); requests are held, not dropped, and the next
    :class:`ReceiveWeights` wakes it. Answered with a :class:`TurnResult`."""


class MoveState(msgspec.Struct, tag="move_state", **_CTRL):
    """(protocol 17) Trainer, between steps: the optimizer state to host memory (``to =
    "host"``, gradients freed) while the engine generates, or back (``"device"``) before the
    next step. Answered with a :class:`TurnResult`."""

    to: str


class Health(msgspec.Struct, tag="health", **_CTRL):
    """Either group: answered at once from the worker's event loop, never queued behind a
    call, so an answer says the worker's loop turns (the controller's heartbeat)."""


Request = Union[
    Generate,
    Abort,
    ScoreTokens,
    ReceiveWeights,
    ComputeLogprobs,
    BeginStep,
    TrainChunk,
    FinishStep,
    SendWeights,
    CalibrateKV,
    SaveState,
    LoadState,
    ExportModel,
    ReceiverGone,
    Sleep,
    MoveState,
    Health,
    OpenJob,
    CloseJob,
]


# --------------------------------------------------------------------------- results
class Empty(msgspec.Struct, tag="empty", **_CTRL):
    pass


class LogprobsResult(msgspec.Struct, tag="lp", **_CTRL):
    logprobs: np.ndarray  # float32 [sum(seq_lens - prompt_lens)]


class ChunkResult(msgspec.Struct, tag="chunk_r", **_CTRL):
    """Local sums over this rank's share of a chunk."""

    num_sequences: int
    num_loss_tokens: int
    loss_sum: float
    clipped_tokens: int
    is_weight_sum: float
    abs_logprob_diff_sum: float
    masked_tokens: int = 0
    """Trained tokens the loss's masking correction set to 0 (``loss.correction``)."""
    abs_logprob_diff_max: float = 0.0
    """The largest ``|logprobs - behaviour_logprobs|`` of a trained token."""
    mismatch_k3_sum: float = 0.0
    """Sum over trained tokens of k3 = exp(d) - 1 - d, d = logprobs - behaviour_logprobs:
    an estimate of KL(generator || trainer) per token, >= 0."""
    kl_sum: float = 0.0
    """Sum over trained tokens of the KL estimate to the reference (``loss.kl_estimator``;
    0 without a KL term in the loss)."""


class StepResult(msgspec.Struct, tag="step_r", **_CTRL):
    step: int
    loss: float
    grad_norm: float
    num_loss_tokens: int
    lr: float
    seconds: float
    peak_allocated_bytes: int = 0
    """(protocol 16) The most accelerator memory this rank's tensors held since its previous
    optimizer step (torch's ``max_memory_allocated``): 0 where it is not measured (CPU)."""
    peak_reserved_bytes: int = 0
    """(protocol 16) The most its allocator held from the device over the same time
    (``max_memory_reserved``): what the GPU had to have free for it."""


class WeightsResult(msgspec.Struct, tag="w_r", **_CTRL):
    version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    rejected_frames: int = 0
    """Sender only: frames its transfer socket refused so far in this run (all refits)."""
    busy_s: float = 0.0
    """Receiver only: seconds since its previous refit during which it was generating (at
    least one sample in flight)."""
    pack_s: float = 0.0
    """Sender only: seconds in the trainer's thread producing the tensors and packing them
    into the staging buffers (an FSDP trainer's gathers included)."""


class KVScalesResult(msgspec.Struct, tag="kv_r", **_CTRL):
    scales: dict[str, float]
    """``{"model.layers.{i}.self_attn.{k,v,q}_scale": scale}`` (dequantisation multipliers)."""


class TurnResult(msgspec.Struct, tag="turn_r", **_CTRL):
    """(protocol 17) What a :class:`Sleep` or a :class:`MoveState` did."""

    seconds: float
    moved_bytes: int = 0
    """A state move's: the bytes that left or came back to the GPU."""
    held: int = 0
    """A sleep's: requests in flight that stopped and wait for the wake."""


class HealthResult(msgspec.Struct, tag="health_r", **_CTRL):
    pid: int
    busy: bool = False


Result = Union[
    Empty, LogprobsResult, ChunkResult, StepResult, WeightsResult, KVScalesResult, HealthResult,
    TurnResult,
]


# --------------------------------------------------------------------------- control
class Hello(msgspec.Struct, tag="hello", **_CTRL):
    """First message of a worker. The controller refuses any other protocol version."""

    protocol_version: int
    group: str
    rank: int
    world_size: int
    pid: int
    log_path: str = ""
    host: str = ""
    """The worker's :func:`~asyncrl.procs.process.host_id`: its ``pid`` means something to
    the controller only on the same host."""


def host_name(host: str) -> str:
    """The name part of a host id (:func:`asyncrl.procs.process.host_id`, as ``Hello.host``
    and ``Init.controller_host`` carry it): what messages show of another host."""
    return host.split("/", 1)[0]


class Init(msgspec.Struct, tag="init", **_CTRL):
    """Controller's answer to :class:`Hello`: everything the worker needs to start."""

    run_id: str
    config: dict[str, Any]
    data_address: str
    transfer_address: str = ""
    controller_pid: int = 0
    """The controller's process: workers on the same host watch it and exit when it is gone
    (0: do not watch)."""
    controller_host: str = ""
    """The controller's :func:`~asyncrl.procs.process.host_id`. A worker on another host
    ignores ``controller_pid`` and takes the controller for gone when its heartbeat probes
    stop (``failures.heartbeat_timeout_s``)."""


class WorkerStamps(msgspec.Struct, kw_only=True, frozen=True):
    """A worker's start, on the wall clock (seconds since the epoch; the controller's
    start-up record, :mod:`asyncrl.obs.startup`)."""

    process: float
    """Its process started (or, where ``/proc`` cannot tell, when it began to serve)."""
    serving: float
    """It began to serve: Python and asyncrl imported."""
    init: float
    """The controller's ``Init`` came (the handshake is done)."""
    created: float
    """Its backend was made: the plugin imported (vLLM, torch...) and its factory ran."""
    started: float
    """Its backend started (an engine, a model loaded) and it said ``Ready``."""

    def phases(self) -> dict[str, float]:
        """Seconds of each phase: ``imports`` (process start to serving), ``handshake``,
        ``plugin`` (the backend's import and factory), ``backend`` (its start)."""
        return {
            "imports": self.serving - self.process,
            "handshake": self.init - self.serving,
            "plugin": self.created - self.init,
            "backend": self.started - self.created,
        }


class Ready(msgspec.Struct, tag="ready", **_CTRL):
    backend: str
    backend_version: str = ""
    capabilities: dict[str, Any] = {}
    startup: WorkerStamps | None = None
    """How the worker's start went (a worker that sends none is left out of the run's
    start-up record)."""


class Call(msgspec.Struct, tag="call", **_CTRL):
    call_id: int
    request: Request


class Cast(msgspec.Struct, tag="cast", **_CTRL):
    """A request that wants no answer: the worker serves it at once, in the order it came,
    and replies nothing (the controller does not wait). Only :data:`CASTABLE` requests, whose
    work has its own way back: a ``Generate``'s samples and ``GroupFailed`` come on the data
    socket. A cast the worker cannot serve is fatal for it (its ``Dead`` says why): the
    controller has nobody waiting to tell."""

    request: Request


CASTABLE = (Generate, ReceiverGone)
"""The requests sent as a :class:`Cast` (each multi-turn episode's turn is one: a reply to
each would double the controller's messages per turn)."""


class Reply(msgspec.Struct, tag="reply", **_CTRL):
    call_id: int
    result: Result
    seconds: float = 0.0
    """How long the worker spent serving the call (its own time, without the wire)."""


class Failure(msgspec.Struct, tag="fail", **_CTRL):
    """A call raised on the worker; the worker keeps serving."""

    call_id: int
    error_type: str
    message: str
    traceback: str = ""


class Shutdown(msgspec.Struct, tag="bye", **_CTRL):
    pass


class Dead(msgspec.Struct, tag="dead", **_CTRL):
    """A worker's last words before it exits with an error."""

    reason: str
    traceback: str = ""


ToWorker = Union[Init, Call, Cast, Shutdown]
FromWorker = Union[Hello, Ready, Reply, Failure, Dead]


# --------------------------------------------------------------------------- data plane
def _no_versions() -> np.ndarray:
    return np.zeros(0, np.int32)


class Sample(msgspec.Struct, array_like=True, gc=False):
    """One generated sequence. ``versions`` (protocol 9) is the weight version that generated
    each token (a request that spans a refit has two or more); empty when the engine cannot
    tell, and the controller then counts every token at the version it dispatched the
    request at (the oldest it can be)."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], sampled-token logprobs after temperature
    finish_reason: str
    versions: np.ndarray = msgspec.field(default_factory=_no_versions)  # int32 [T] or [0]


class SampleDone(msgspec.Struct, tag="s", **_DATA):
    """Sample ``index`` (0 .. n-1) of a prompt group, pushed by a rollout worker as soon as it
    finished (or was aborted). A group is complete with its n-th sample."""

    group_id: str
    worker: str
    index: int
    sample: Sample


class GroupFailed(msgspec.Struct, tag="gf", **_DATA):
    """Generation of a group failed on ``worker``; no more of its samples will come."""

    group_id: str
    worker: str
    error_type: str
    message: str
    retryable: bool = True
    """False when the request's own data made it fail (``RequestError``): a retry would fail
    the same way. True for engine or infrastructure failures."""


class DataBatch(msgspec.Struct, tag="db", **_DATA):
    """Several data messages that were ready together on one rollout worker, in the order they
    were produced: one message (one receive, one decode on the controller's loop) instead of
    one each. Each item is taken as if it had come alone."""

    items: list[Union[SampleDone, GroupFailed]]


DataMessage = Union[SampleDone, GroupFailed, DataBatch]


# --------------------------------------------------------------------------- weight transfer
class TensorEntry(msgspec.Struct, array_like=True, gc=False):
    """Where one tensor lies in a bucket: ``nbytes`` bytes at ``offset``."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    offset: int
    nbytes: int


class WeightsPull(msgspec.Struct, tag="wpull", **_DATA):
    """Receiver → sender: ready for version ``version``."""

    version: int
    receiver: str


class Manifest(msgspec.Struct, tag="wman", **_DATA):
    """Sender → receiver, before any bucket: every tensor of ``version`` in sending order
    (``offset`` and ``nbytes`` of each entry are 0 here), and the transfer that carries them.
    The receiver checks it against its model before touching a weight and answers with a
    :class:`BucketAck` of index -1."""

    version: int
    transport: str
    entries: list[TensorEntry]


class Bucket(msgspec.Struct, tag="wbkt", **_DATA):
    """Sender → receiver: bucket ``index`` of ``version`` is filled and readable through
    ``handle`` (the transfer's own struct, encoded; see :mod:`asyncrl.transfers`)."""

    version: int
    index: int
    handle: bytes
    nbytes: int
    entries: list[TensorEntry]
    last: bool


class BucketAck(msgspec.Struct, tag="wack", **_DATA):
    """Receiver → sender: done with bucket ``index`` (-1: the manifest is accepted); ``error``
    set if checking or loading failed."""

    version: int
    index: int
    receiver: str
    error: str | None = None


WeightMessage = Union[WeightsPull, Manifest, Bucket, BucketAck]
