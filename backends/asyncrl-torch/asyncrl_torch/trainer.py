"""What every first-party training backend does the same way: :class:`DistributedTrainer`.

A Hugging Face causal LM, one torch.distributed rank per object, driven by the worker runtime
from one thread, the same sequence of calls on every rank::

    start -> (compute_logprobs | begin_step -> train_chunk* -> finish_step | iter_weights
              | save_state | load_state | state_to_host | state_to_device)* -> close

This class owns the parts that must not differ between engines: joining the process group,
loading the model, lockstep micro-batching with malformed-batch agreement, the loss, the step
ledger, the token-count check at the end of a step, and the finite checks. A backend (FSDP2,
DeepSpeed) fills in the engine-specific hooks: how the model is wrapped, how a loss is
back-propagated, how the accumulated raw gradient is normalized, clipped and applied, how full
weights are gathered, and how state is saved.

Nothing non-finite is committed. A step whose (all-reduced) loss is not finite is dropped
before the engine sees it; one whose gradient norm is not finite is not applied by the engine
(:meth:`_apply_step`); either way the weights stay as they were and the returned
:class:`StepResult` carries the non-finite value, so the controller skips the step or stops
(``failures.max_nonfinite_steps``). The weights are checked for NaN and infinities when the
model is loaded, after :meth:`load_state` (a corrupted checkpoint) and before
:meth:`save_state` (one ``aminmax`` per local shard and one all-reduce: every rank raises the
same :class:`~asyncrl.plugin.backend.NonFiniteError`).

Gradient normalization. A step's chunks stream in one by one and nobody knows the step's
token count until :meth:`finish_step`, so every micro-batch back-propagates the raw *sum* of
its token losses; after all chunks, every rank's gradient (shard) must hold the gradient of
the global loss sum, and :meth:`_apply_step` divides it by ``num_loss_tokens`` exactly once.
Only the tokens a batch's ``loss_mask`` marks train: the others (observations the controller
inserted into a multi-turn sequence) are forwarded as context but add neither loss, nor
gradient, nor statistics, and are not counted in ``num_loss_tokens``.
The contract suite (:mod:`asyncrl_torch.contract.suite`) checks the result against a float64
single-process reference, so an engine's own averaging over ranks or accumulation steps
cannot slip through.

Lockstep. Sharded engines' collectives must line up across ranks, so every rank runs the same
number of forwards (and backwards) per call: ranks agree on the largest local micro-batch
count (one all-reduce, which also tells every rank whether some rank's batch is malformed)
and pad with fully masked dummy micro-batches.

State offload (:class:`~asyncrl.plugin.backend.StateOffload`, for ``cluster.placement =
"take_turns"``). Between steps, :meth:`~DistributedTrainer.state_to_host` moves the optimizer
state to pinned host memory (:mod:`asyncrl_torch.offload`) and frees the gradients; the
parameters stay (the refit reads them). :meth:`~DistributedTrainer.begin_step` and
:meth:`~DistributedTrainer.load_state` bring them back first if
:meth:`~DistributedTrainer.state_to_device` was not called. On the CPU nothing moves.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import structlog
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.plugin.backend import (
    AnyBatch,
    ChunkResult,
    Layout,
    NonFiniteError,
    StepResult,
    TokenBatch,
    TrainBatch,
    WeightTensor,
    WorkerContext,
    check_packed,
)
from asyncrl.plugin.common import ConfigError

from asyncrl_torch.adapters import add_adapter, saved_name
from asyncrl_torch.batches import (
    MicroBatch,
    dummy_micro_batch,
    make_micro_batch,
    PACKING_TOLERANCE,
    packing_check,
    plan_micro_batches,
    response_logprobs,
    restore_order,
    to_device,
)
from asyncrl_torch.kv_calibration import all_reduce_max, calibrate_kv_scales
from asyncrl_torch.job_adapters import (
    Job,
    TrainerJobs,
    adapter_parameters,
    add_job_slots,
    fresh_adapter,
    run_adapter,
)
from asyncrl_torch.loss import kl_to_reference, ppo_clip_loss
from asyncrl_torch.offload import HostCopies, local_nbytes
from asyncrl_torch.options import TrainerOptions

__all__ = ["ChunkSums", "DistributedTrainer", "full_numel", "full_shape"]

_PER_TOKEN_INPUTS = ("behaviour_logprobs", "proximal_logprobs", "reference_logprobs")

log = structlog.get_logger()


class ChunkSums(NamedTuple):
    """What one chunk's micro-batches add up to on this rank (its :class:`ChunkResult`)."""

    loss_sum: float
    clipped_tokens: float
    is_weight_sum: float
    abs_logprob_diff_sum: float
    masked_tokens: float
    mismatch_k3_sum: float
    abs_logprob_diff_max: float
    """The largest, not a sum."""
    kl_sum: float


_SUMMED = ChunkSums._fields.index("abs_logprob_diff_max")
"""The fields before it are sums of each micro-batch's loss statistics, stacked in this order."""
_MAX = _SUMMED
_KL = ChunkSums._fields.index("kl_sum")


class DistributedTrainer:
    """Base of a :class:`~asyncrl.plugin.backend.TrainingBackend` over an HF causal LM.

    Subclasses implement :meth:`_wrap`, :meth:`_backward`, :meth:`_apply_step`,
    :meth:`_zero_grad`, :meth:`iter_weights`, :meth:`_save_state` and :meth:`_load_state`;
    they may override :meth:`_forward`, :meth:`_local_parameters`, :meth:`_close_engine`,
    :meth:`_torch_optimizer` (what :meth:`state_to_host` moves), or :meth:`_state_to_host`
    and :meth:`_state_to_device` (an engine with state of its own).
    """

    name = "trainer"
    """Used in log events and errors."""

    loss_inputs = frozenset({"proximal_logprobs", "reference_logprobs"})
    """The optional :class:`~asyncrl.plugin.backend.TrainBatch` fields the loss reads (the
    worker runtime refuses a run whose loss needs one a backend does not list)."""

    def __init__(self, ctx: WorkerContext, options: TrainerOptions) -> None:
        self._ctx = ctx
        self._opts = options
        self._log = log.bind(group=ctx.group, rank=ctx.rank, backend=self.name)
        self._module: torch.nn.Module | None = None
        self._reference: torch.nn.Module | None = None
        """The frozen reference policy, loaded only when ``loss.kl_coef > 0`` without
        ``[lora]`` (with it the reference is the base: the model with its adapter disabled)."""
        self._device = torch.device("cpu")
        self._vocab_size = 0
        self._owns_process_group = False
        self._jobs = TrainerJobs(0, options.lr)
        """The jobs this rank trains: the run's own (``""``) and, with ``job_slots``, more
        (:mod:`asyncrl_torch.job_adapters`); each with its open step."""
        self._closed = False
        self._state_on_host = False
        """:meth:`state_to_host` ran, :meth:`state_to_device` not yet."""
        self._host_copies = HostCopies()
        """The optimizer state :meth:`_state_to_host` moved (:mod:`asyncrl_torch.offload`)."""

    @property
    def _lora(self) -> bool:
        """``[lora]``: the module is a PEFT model whose adapter alone trains, is sent and is
        saved."""
        return self._ctx.config.lora.enabled

    # ------------------------------------------------------------------ engine hooks
    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` (float32, on this rank's device) and build the optimizer; return
        the module that forwards."""
        raise NotImplementedError

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        """Logits ``[b, L, V]`` of a micro-batch."""
        assert self._module is not None
        return self._module(**mb.model_inputs(), use_cache=False).logits

    def _wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place the frozen reference policy (float32 or the compute dtype, no gradient): on
        this rank's device, or in host memory with ``trainer.options.reference_offload``
        (:meth:`reference_logprobs` then moves it for each forward). A sharding engine may
        shard it instead."""
        model.requires_grad_(False).eval()
        return model if self._opts.reference_offload else model.to(self._device)

    def _hf_model(self) -> torch.nn.Module:
        """The transformers model inside the forwarding module (its ``config``, its attention
        modules); the same object unless the engine wraps it."""
        return self._started()

    def _backward(self, loss_sum: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss_sum`` (a raw sum; no scaling of any kind)."""
        raise NotImplementedError

    def _apply_step(self, num_loss_tokens: float) -> float:
        """Divide the accumulated gradient of the global loss sum by ``num_loss_tokens`` (the
        step's trained tokens, or ``loss.aggregation``'s normalizer), clip
        it to ``max_grad_norm``, step the optimizer unless the norm is not finite, zero the
        gradients. Returns the global gradient 2-norm before clipping (the same on every
        rank)."""
        raise NotImplementedError

    def _zero_grad(self) -> None:
        """Drop the accumulated gradients (a discarded step)."""
        raise NotImplementedError

    def _close_engine(self) -> None:
        """Free the engine's resources (before the process group goes)."""

    def _torch_optimizer(self) -> torch.optim.Optimizer | None:
        """The plain ``torch.optim`` optimizer whose ``state`` the default
        :meth:`_state_to_host` moves (``None``: none)."""
        return None

    def _state_to_host(self) -> int:
        """Free the gradients and move the optimizer state to pinned host memory, queued on
        the current stream; the bytes that left the device. By default the gradients of
        :meth:`_hf_model`'s parameters and :meth:`_torch_optimizer`'s state."""
        freed = sum(local_nbytes(p.grad) for p in self._hf_model().parameters()
                    if p.grad is not None and p.grad.is_cuda)  # fmt: skip
        self._zero_grad()
        return freed + self._host_copies.to_host(self._torch_optimizer())

    def _state_to_device(self) -> int:
        """Bring back what :meth:`_state_to_host` moved (queued); the bytes moved."""
        return self._host_copies.to_device(self._device)

    def iter_weights(self) -> Iterator[WeightTensor]:
        raise NotImplementedError

    def _save_state(self, path: str) -> None:
        """Collective: write model and optimizer state under the directory ``path`` (every
        rank writes its own part; ``path`` is the same on every rank and visible to all)."""
        raise NotImplementedError

    def _load_state(self, path: str) -> None:
        """Collective: restore what :meth:`_save_state` wrote, into a started backend of the
        same model, options and world size."""
        raise NotImplementedError

    def _local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, this rank's part)`` of every parameter (a name may come twice, for two
        copies), the same names in the same order on every rank: what the finite checks
        read."""
        for name, param in self._hf_model().named_parameters():
            data = param.detach()
            yield name, data.to_local() if isinstance(data, DTensor) else data

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        ctx, opts = self._ctx, self._opts
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        torch.manual_seed(ctx.config.run.seed if opts.seed is None else opts.seed)
        if torch.cuda.is_available():
            gpu = ctx.gpu if ctx.gpu is not None else ctx.local_rank  # cluster.trainer_gpus
            self._device = torch.device(f"cuda:{gpu}")
            torch.cuda.set_device(self._device)
        self._init_process_group()
        lora = ctx.config.lora
        # the base of an adapter stays in its storage dtype; full weights train in float32
        dtype = getattr(torch, ctx.config.model.dtype) if lora.enabled else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            ctx.config.model.path, dtype=dtype, attn_implementation=opts.attn_implementation
        ).to(self._device)
        if opts.activation_checkpointing:
            # non-reentrant: works under FSDP2 and ZeRO-3, and with an adapter's frozen inputs
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        num_parameters = sum(p.numel() for p in model.parameters())  # a tied weight once
        self._vocab_size = model.get_input_embeddings().num_embeddings
        if lora.enabled:
            model = add_adapter(model, lora, ctx.config.model.path)
        if opts.job_slots:
            if not lora.enabled:
                raise ConfigError("trainer.options.job_slots: jobs train LoRA adapters; set a "
                                  "[lora] rank, or job_slots = 0")  # fmt: skip
            self._jobs = TrainerJobs(opts.job_slots, opts.lr)
            add_job_slots(model, self._jobs.slot_names)
        self._module = self._wrap(model)
        if ctx.config.loss.kl_coef > 0 and not lora.enabled:  # else no second model
            self._reference = self._load_reference()
        self._check_finite_weights(
            f"the weights of the model at {ctx.config.model.path} (model.path)",
            "its weight files are damaged, or it was saved from diverged training",
            "download or export the model again",
            consequence="the run does not start",
        )
        self._bound_collectives()
        if ctx.config.trainer.pack_sequences:
            self._check_packing()
        caps = {
            "backend_version": self._engine_version(),
            "device": str(self._device),
            "num_parameters": num_parameters,
            "trainable_parameters": sum(
                full_numel(p) for _, p in self._trained_parameters()
            ),
        }
        self._log.info("trainer_backend_started", world_size=ctx.world_size, **caps)
        return caps

    def _check_packing(self) -> None:
        """``trainer.pack_sequences``: refuse to start if a packed sequence's logprobs depend
        on the sequence before it in the row (:func:`~asyncrl_torch.batches.packing_check`).
        If the model's attention ignored the boundaries, every packed step would train on
        wrong logprobs without any error."""
        with torch.no_grad():
            check = packing_check(self._forward, self._vocab_size, self._device)
        self._log.info("packing_checked", swapped_diff=check.swapped, apart_diff=check.apart,
                       attn_implementation=self._opts.attn_implementation)  # fmt: skip
        if not check.separated:
            raise ConfigError(
                f"trainer.pack_sequences: packed sequences change each other's logprobs (a "
                f"sequence's moved by up to {check.swapped:.3g} nats when the one before it "
                f"was replaced, over the {PACKING_TOLERANCE} allowed): the model at "
                f"{self._ctx.config.model.path} with attention "
                f"{self._opts.attn_implementation!r} does not separate sequences by their "
                "position ids. Fix: set trainer.pack_sequences = false, or an attention "
                "implementation that does (trainer.options.attn_implementation: sdpa, eager, "
                "flash_attention_2)"
            )

    def _load_reference(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        config, opts = self._ctx.config, self._opts
        path = config.loss.reference_path or config.model.path
        dtype = torch.bfloat16 if opts.mixed_precision == "bf16" else torch.float32
        started = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=opts.attn_implementation
        )
        if model.get_input_embeddings().num_embeddings != self._vocab_size:
            raise ValueError(
                f"the reference policy at {path} (loss.reference_path) has a vocabulary of "
                f"{model.get_input_embeddings().num_embeddings} tokens, the model "
                f"{self._vocab_size}. Fix: point loss.reference_path at a checkpoint of the "
                "same model (empty: model.path)"
            )
        self._log.info("reference_policy_loaded", path=path, dtype=str(dtype),
                       offload=opts.reference_offload, seconds=time.monotonic() - started)  # fmt: skip
        return self._wrap_reference(model)

    def _engine_version(self) -> str:
        return torch.__version__

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.run.ledger.close()
        try:
            self._close_engine()
        finally:
            self._module = self._reference = None
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()
            self._owns_process_group = False

    def _init_process_group(self) -> None:
        ctx = self._ctx
        if dist.is_initialized():
            # embedded in a process that already joined the group: use it, leave it open
            if (dist.get_rank(), dist.get_world_size()) != (ctx.rank, ctx.world_size):
                raise RuntimeError(
                    f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but this worker is rank {ctx.rank} of "
                    f"{ctx.world_size}"
                )
            return
        backend = "nccl" if self._device.type == "cuda" else "gloo"
        store = ctx.extra.get("dist_store")
        if store is not None:
            dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size)
        else:
            dist.init_process_group(
                backend, init_method="env://", rank=ctx.rank, world_size=ctx.world_size
            )
        self._owns_process_group = True

    def _bound_collectives(self) -> None:
        """From now on, a collective of this rank's process group that waits longer than
        ``failures.collective_timeout_s`` raises (gloo) or aborts the process (NCCL's
        watchdog) instead of waiting torch's default 10 or 30 minutes: the worker's event loop
        answers the heartbeat meanwhile, so nothing else would notice a rank stuck in one.
        Set after the model is loaded, where ranks may legitimately wait long on each other;
        left alone on a process group this backend did not create."""
        seconds = self._ctx.config.failures.collective_timeout()
        if not seconds or not self._owns_process_group:
            return
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds))

    def _started(self) -> torch.nn.Module:
        if self._closed:
            raise RuntimeError(f"the {self.name} backend is closed")
        if self._module is None:
            raise RuntimeError(f"the {self.name} backend is not started; call start() first")
        return self._module

    # ------------------------------------------------------------------ forward passes
    def compute_logprobs(
        self, batch: TokenBatch, temperature: float, *, job: str = ""
    ) -> np.ndarray:
        module = self._started()
        self._run_job(job)
        module.eval()
        return self._logprobs(self._forward, batch, temperature, "compute_logprobs")

    def sent_logprobs(
        self, batch: TokenBatch, temperature: float, dtype: str, *, job: str = ""
    ) -> np.ndarray:
        """:meth:`compute_logprobs` on the weights as :meth:`iter_weights` sends them: each
        local part rounded to ``dtype`` in place for the forward, then put back bit for bit
        (:class:`~asyncrl.plugin.backend.SentWeightsScoring`)."""
        module = self._started()
        self._run_job(job)
        module.eval()
        with self._rounded_weights(getattr(torch, dtype)):
            return self._logprobs(self._forward, batch, temperature, "sent_logprobs")

    @contextlib.contextmanager
    def _rounded_weights(self, dtype: torch.dtype) -> Iterator[None]:
        """Round every local weight part (:meth:`_local_parameters`: what the forward reads)
        to ``dtype`` in place, and restore the originals on exit. The originals wait in device
        memory when twice their size is free there, else in host memory (a 7B model's float32
        shard is 28 GB: seconds over PCIe, every ``refit.verify_every_steps``). Restored in
        reverse order, so that two names over one storage end as they began."""
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        parts = [
            data for _, data in self._local_parameters()
            if data.is_floating_point() and data.dtype != dtype and data.numel()
        ]  # fmt: skip
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        keep_on = self._device
        if self._device.type == "cuda" and torch.cuda.mem_get_info(self._device)[0] < 2 * nbytes:
            keep_on = torch.device("cpu")
        try:
            with torch.no_grad():
                for part in parts:
                    saved.append((part, part.to(keep_on, copy=True)))
                    part.copy_(part.to(dtype))
            yield
        finally:
            with torch.no_grad():
                for part, original in reversed(saved):
                    part.copy_(original)

    def reference_logprobs(self, batch: TokenBatch, temperature: float) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under the frozen reference policy
        (``loss.kl_coef > 0``), like :meth:`compute_logprobs`."""
        self._started()
        if self._lora and self._ctx.config.loss.kl_coef > 0:
            peft_model = self._hf_model()

            def base_forward(mb: MicroBatch) -> torch.Tensor:
                with peft_model.disable_adapter():  # the base: no second copy of the model
                    return self._forward(mb)

            self._module.eval()  # type: ignore[union-attr]
            return self._logprobs(base_forward, batch, temperature, "reference_logprobs")
        if self._reference is None:
            raise RuntimeError(
                f"{self.name}: no reference policy is loaded (loss.kl_coef is 0). Fix: set "
                "loss.kl_coef > 0 to train with a KL term"
            )
        reference = self._reference

        def forward(mb: MicroBatch) -> torch.Tensor:
            return reference(**mb.model_inputs(), use_cache=False).logits

        with self._reference_placed(reference):
            return self._logprobs(forward, batch, temperature, "reference_logprobs")

    @contextlib.contextmanager
    def _reference_placed(self, reference: torch.nn.Module) -> Iterator[None]:
        """Hold the reference on this rank's device for a forward: with
        ``reference_offload`` it is moved in, and back out after (an engine that offloads
        its own way overrides this)."""
        moved = self._opts.reference_offload and self._device.type != "cpu"
        if moved:
            reference.to(self._device)
        try:
            yield
        finally:
            if moved:
                reference.to("cpu")

    def _logprobs(
        self, forward: Any, batch: TokenBatch, temperature: float, what: str
    ) -> np.ndarray:
        """Response logprobs of ``batch`` by ``forward`` (micro-batch -> logits), in lockstep
        with the other ranks, without a gradient; float32 on the host."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        problem = check_packed(
            batch.tokens, batch.seq_lens, batch.prompt_lens, vocab_size=self._vocab_size
        )
        planned, bounds, order = self._plan(batch, problem)
        passes = self._agree(problem, len(bounds), what)
        out: list[torch.Tensor] = []
        with torch.no_grad():
            for i in range(passes):
                mb = self._micro_batch(planned, bounds, i)
                lp = response_logprobs(forward(mb), mb, temperature)
                if i < len(bounds):
                    out.append(lp)
        if not out:
            return np.zeros(0, dtype=np.float32)
        values = torch.cat(out).to("cpu", torch.float32).numpy()
        if order is None:
            return values
        return restore_order(values, Layout.of(planned.seq_lens, planned.prompt_lens), order)

    def calibrate_kv_scales(
        self, batch: TokenBatch, *, percentile: float, margin: float, include_q: bool
    ) -> dict[str, float]:
        """FP8 KV-cache scales of the current weights on this rank's ``batch`` (see
        :mod:`asyncrl_torch.kv_calibration`); every rank returns the same, maxed across
        ranks."""
        self._started()
        problem = check_packed(
            batch.tokens, batch.seq_lens, batch.prompt_lens, vocab_size=self._vocab_size
        )
        planned, bounds, _ = self._plan(batch, problem)
        passes = self._agree(problem, len(bounds), "calibrate_kv_scales")
        return calibrate_kv_scales(
            self._hf_model(),
            (self._micro_batch(planned, bounds, i) for i in range(passes)),
            self._forward,
            percentile=percentile,
            margin=margin,
            include_q=include_q,
            reduce_max=all_reduce_max if self._ctx.world_size > 1 else None,
        )

    def _plan(
        self, batch: AnyBatch, problem: str | None
    ) -> tuple[AnyBatch, list[tuple[int, int]], np.ndarray | None]:
        """:func:`~asyncrl_torch.batches.plan_micro_batches` by ``[trainer]``; no
        micro-batch for a malformed batch."""
        if problem is not None:
            return batch, [], None
        cfg = self._ctx.config.trainer
        return plan_micro_batches(
            batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, packed=cfg.pack_sequences
        )

    def _micro_batch(
        self, batch: TokenBatch | TrainBatch, bounds: list[tuple[int, int]], i: int
    ) -> MicroBatch:
        if i >= len(bounds):
            return dummy_micro_batch(device=self._device)
        start, stop = bounds[i]
        return make_micro_batch(
            batch.tokens, batch.seq_lens, batch.prompt_lens, start, stop, device=self._device,
            packed=self._ctx.config.trainer.pack_sequences,
        )  # fmt: skip

    def _agree(self, problem: str | None, local_passes: int, what: str) -> int:
        """All ranks learn the largest micro-batch count, and whether any rank's batch is
        malformed (then every rank raises, instead of one rank hanging in a collective)."""
        flags = torch.tensor(
            [local_passes, self._ctx.rank + 1 if problem else 0],
            dtype=torch.int64,
            device=self._device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        passes, bad = int(flags[0]), int(flags[1])
        if problem is not None:
            raise ValueError(f"{what}: rank {self._ctx.rank} got a malformed batch: {problem}")
        if bad:
            raise ValueError(f"{what}: rank {bad - 1} got a malformed batch (see its error)")
        return passes

    # ------------------------------------------------------------------ optimizer step
    def begin_step(self, step: int, *, job: str = "") -> None:
        self._started()
        ledger = self._run_job(job).ledger
        if ledger.open is not None:  # the same step (else begin() raises): a retry
            self._log.warning("step_restarted", step=step, job=job)
        self.state_to_device()  # if state_to_host left it on the host
        ledger.begin(step)
        self._zero_grad()

    def train_chunk(self, step: int, batch: TrainBatch, *, job: str = "") -> ChunkResult:
        self._started()
        ledger = self._run_job(job).ledger
        ledger.require(step, "train_chunk")
        problem = check_packed(
            batch.tokens,
            batch.seq_lens,
            batch.prompt_lens,
            vocab_size=self._vocab_size,
            per_token={name: getattr(batch, name) for name in _PER_TOKEN_INPUTS
                       if getattr(batch, name) is not None},
            per_sequence={"advantages": batch.advantages},
            loss_mask=batch.loss_mask,
        )
        planned, bounds, _ = self._plan(batch, problem)
        passes = self._agree(problem, len(bounds), f"train_chunk(step={step})")
        layout = Layout.of(planned.seq_lens, planned.prompt_lens)
        try:
            with torch.enable_grad():
                sums = self._forward_backward(planned, layout, bounds, passes)
        except BaseException:
            self._discard("train_chunk failed")
            raise
        num_tokens = int(np.count_nonzero(batch.loss_mask))  # trained tokens only
        ledger.add_chunk(step, num_tokens, sums.loss_sum)
        return ChunkResult(
            num_sequences=len(batch.seq_lens),
            num_loss_tokens=num_tokens,
            loss_sum=sums.loss_sum,
            clipped_tokens=int(sums.clipped_tokens),
            is_weight_sum=sums.is_weight_sum,
            abs_logprob_diff_sum=sums.abs_logprob_diff_sum,
            masked_tokens=int(sums.masked_tokens),
            mismatch_k3_sum=sums.mismatch_k3_sum,
            abs_logprob_diff_max=sums.abs_logprob_diff_max,
            kl_sum=sums.kl_sum,
        )

    def _forward_backward(
        self, batch: TrainBatch, layout: Layout, bounds: list[tuple[int, int]], passes: int
    ) -> ChunkSums:
        assert self._module is not None
        loss_cfg = self._ctx.config.loss
        temperature = self._ctx.config.grpo.temperature
        # per-token tensors built on the host: no device sync (a repeat_interleave by a device
        # tensor would wait for the GPU before every micro-batch)
        token_adv = np.repeat(batch.advantages.astype(np.float32), layout.response_lens)
        per_token = {
            "beh": batch.behaviour_logprobs, "adv": token_adv,
            "prox": batch.proximal_logprobs, "ref": batch.reference_logprobs,
        }  # fmt: skip
        tensors = {k: to_device(v.astype(np.float32), self._device)
                   for k, v in per_token.items() if v is not None}  # fmt: skip
        trains = to_device(batch.loss_mask.astype(np.bool_), self._device)
        # on the device, in ChunkSums' order: nothing waits for the GPU until the chunk ends
        sums = torch.zeros(len(ChunkSums._fields), dtype=torch.float64, device=self._device)
        self._module.train()
        for i in range(passes):
            mb = self._micro_batch(batch, bounds, i)
            if i < len(bounds):
                part = {k: t[mb.response_slice] for k, t in tensors.items()}
                mask = trains[mb.response_slice]
            else:  # padding pass: same collectives, no loss
                zeros = torch.zeros(len(mb.targets), device=self._device)
                part = {k: zeros for k in tensors}
                mask = torch.zeros_like(zeros, dtype=torch.bool)
            lp = response_logprobs(self._forward(mb), mb, temperature)
            prox = part.get("prox")
            if prox is None and loss_cfg.proximal_policy == "current":
                prox = lp.detach()  # one optimizer step: this forward is the pre-step policy
            loss_sum, stats = ppo_clip_loss(
                lp, part["beh"], part["adv"], mask,
                clip_eps_low=loss_cfg.clip_eps_low, clip_eps_high=loss_cfg.clip_eps_high,
                is_cap=loss_cfg.is_cap, proximal_logprobs=prox, correction=loss_cfg.correction,
                mismatch_low=loss_cfg.mismatch_low, mismatch_high=loss_cfg.mismatch_high,
                ratio_level=loss_cfg.ratio_level, seq_ids=mb.rows,
            )  # fmt: skip
            kl = loss_sum.new_zeros(())
            if "ref" in part:
                kl = kl_to_reference(lp, part["ref"], mask, loss_cfg.kl_estimator)
                loss_sum = loss_sum + loss_cfg.kl_coef * kl
            self._backward(loss_sum)
            masked = loss_sum.new_zeros(()) if stats.masked_tokens is None else stats.masked_tokens
            step_sums = torch.stack([loss_sum.detach(), stats.clipped_tokens, stats.is_weight_sum,
                                     stats.abs_logprob_diff_sum, masked, stats.mismatch_k3_sum])  # fmt: skip
            sums[:_SUMMED] += step_sums.to(torch.float64)
            sums[_MAX] = torch.maximum(sums[_MAX], stats.abs_logprob_diff_max.to(torch.float64))
            sums[_KL] += kl.detach().to(torch.float64)
        return ChunkSums(*sums.tolist())

    def finish_step(
        self, step: int, num_loss_tokens: int, *, normalizer: float | None = None, job: str = ""
    ) -> StepResult:
        self._started()
        running = self._run_job(job)
        open_step = running.ledger.require(step, "finish_step")
        totals = torch.tensor(
            [open_step.loss_tokens, open_step.loss_sum], dtype=torch.float64, device=self._device
        )
        dist.all_reduce(totals)
        counted, loss_sum = int(round(float(totals[0]))), float(totals[1])
        if counted != num_loss_tokens or counted == 0:
            self._discard("bad num_loss_tokens")
            raise ValueError(
                f"finish_step({step}): the controller says the step has {num_loss_tokens} loss "
                f"tokens but the trainer ranks received {counted}"
                + (
                    " (a step without a trained token cannot be normalized: its responses are "
                    "empty or fully masked by loss_mask)"
                    if counted == 0
                    else ""
                )
                + "; the step was discarded (no update)"
            )
        divisor = normalizer or num_loss_tokens  # loss.aggregation's, else the trained tokens
        if not math.isfinite(loss_sum):
            # the same on every rank (all-reduced): every rank drops the step before the
            # engine sees it, so the weights stay as they are
            self._discard("non-finite loss")
            grad_norm = float("nan")  # not computed
        else:
            try:
                grad_norm = self._apply_step(divisor)
            finally:
                running.ledger.close()
        if not (math.isfinite(grad_norm) and math.isfinite(loss_sum)):
            # the norm is all-reduced too, so all ranks skipped the update together
            self._log.warning(
                "step_not_applied_nonfinite", step=step, loss_sum=loss_sum, grad_norm=grad_norm
            )
        allocated, reserved = self._memory_peaks()
        return StepResult(
            step=step,
            loss=loss_sum / divisor,
            grad_norm=grad_norm,
            num_loss_tokens=num_loss_tokens,
            lr=running.lr,
            seconds=time.monotonic() - open_step.started,
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
        )

    def _memory_peaks(self) -> tuple[int, int]:
        """The device memory this rank's tensors and its allocator held at most since the
        previous call (the previous optimizer step: its logprob refreshes, forwards and
        backwards, and this step); ``(0, 0)`` off CUDA. Starts the next interval."""
        if self._device.type != "cuda":
            return 0, 0
        peaks = (torch.cuda.max_memory_allocated(self._device),
                 torch.cuda.max_memory_reserved(self._device))  # fmt: skip
        torch.cuda.reset_peak_memory_stats(self._device)
        return peaks

    def _discard(self, reason: str) -> None:
        running = self._jobs.running()
        open_step = running.ledger.close()
        if open_step is not None:
            self._log.warning("step_discarded", step=open_step.step, reason=reason,
                              job=running.name)  # fmt: skip
        if self._module is not None:
            self._zero_grad()

    # ------------------------------------------------------------------ state
    def save_state(self, path: str, *, job: str = "") -> None:
        """Collective: write model and optimizer state under the directory ``path`` (every
        rank writes its own part; ``path`` is the same on every rank and visible to all). State
        that :meth:`state_to_host` moved is written from the host, and stays there. With
        ``job``: that job's adapter and optimizer state alone, under names of no slot (it may
        come back into another).

        Raises:
            NonFiniteError: a weight holds a NaN or an infinity (nothing is written).
        """
        self._started()
        self._check_no_open_step("save_state", job)
        self._check_finite_weights(
            "the weights to save",
            "a step applied although it was not finite (a backend fault)",
            "resume from the last checkpoint (the previous one is intact)",
            consequence="nothing was written",
        )
        if job:
            self._save_job_state(path, self._jobs.get(job))
        else:
            self._save_state(path)

    def load_state(self, path: str, *, job: str = "") -> None:
        """Collective: restore what :meth:`save_state` wrote, into a started backend of the
        same model, options and world size. State on the host comes back first (the engine
        loads into it where it steps). With ``job`` (opened: :meth:`open_job`): what
        ``save_state(path, job=...)`` wrote of a job, into the slot this job has now.

        Raises:
            NonFiniteError: a loaded weight holds a NaN or an infinity (a corrupted
                checkpoint); the message names ``path``.
        """
        self._started()
        self._check_no_open_step("load_state", job)
        self.state_to_device()
        if job:
            self._load_job_state(path, self._jobs.get(job))
        else:
            self._load_state(path)
        self._check_finite_weights(
            f"the weights loaded from {path}",
            "the checkpoint is corrupted (a damaged file), or it was saved from diverged "
            "training",
            "resume from an older checkpoint (--resume <checkpoint.dir>/step-N)",
            consequence="the run does not go on from them",
        )

    def _nonfinite_parameters(self) -> list[str]:
        """Collective: the names of the parameters that hold a NaN or an infinity on some
        rank, the same list on every rank. One ``aminmax`` per local shard (no copy of it),
        one all-reduce and one wait for the device."""
        self._started()
        names, extremes = [], []
        for name, data in self._local_parameters():
            names.append(name)
            if data.numel() == 0:
                extremes.append(torch.zeros(2, dtype=torch.float64, device=self._device))
            else:
                lo, hi = torch.aminmax(data)
                extremes.append(torch.stack([lo, hi]).to(self._device, torch.float64))
        if not names:
            return []
        bad = (~torch.isfinite(torch.stack(extremes)).all(dim=1)).to(torch.int32)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return list(dict.fromkeys(n for n, flag in zip(names, bad.tolist()) if flag))

    def _check_finite_weights(self, what: str, cause: str, fix: str, *, consequence: str) -> None:
        bad = self._nonfinite_parameters()
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise NonFiniteError(
                f"{what} hold NaN or infinite values ({len(bad)} tensors: {shown}), so "
                f"{consequence}; likely {cause}. Fix: {fix}"
            )

    def _check_no_open_step(self, what: str, job: str | None = None) -> None:
        """Raises: RuntimeError: a step is open (of ``job``; ``None``: of any job). The run's
        own state is saved whole, so any open step counts for it."""
        for open_job, step in self._jobs.open_steps():
            if job and open_job != job:
                continue  # another job's step leaves this job's state alone
            of = f" of job {open_job!r}" if open_job else ""
            raise RuntimeError(f"{what}: step {step}{of} is open; finish it first")

    # ------------------------------------------------------------------ state offload
    def state_to_host(self) -> int:
        """Between steps: move the optimizer state to pinned host memory and free the
        gradients (:class:`~asyncrl.plugin.backend.StateOffload`); returns the bytes that left
        this rank's GPU. The parameters stay. Done when it returns: the copies are complete and
        the freed memory is the driver's again (``empty_cache``), for another process to take.
        Not collective. Off CUDA, or on the host already: 0, and nothing changes.

        Raises:
            RuntimeError: a step is open (nothing moved).
        """
        self._started()
        self._check_no_open_step("state_to_host")
        if self._device.type != "cuda" or self._state_on_host:
            return 0
        started = time.monotonic()
        self._state_on_host = True  # first: what a failed move left on the host comes back too
        moved = self._state_to_host()
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()
        self._log.debug("state_moved_to_host", bytes=moved, seconds=time.monotonic() - started)
        return moved

    def state_to_device(self) -> int:
        """Bring back what :meth:`state_to_host` moved; returns the bytes moved (nothing
        there: 0). The next step equals the step without the round trip, bit for bit.
        :meth:`begin_step` and :meth:`load_state` call it themselves."""
        self._started()
        if not self._state_on_host:
            return 0
        started = time.monotonic()
        moved = self._state_to_device()
        torch.cuda.synchronize(self._device)
        self._state_on_host = False
        self._log.debug("state_moved_to_device", bytes=moved, seconds=time.monotonic() - started)
        return moved

    # ------------------------------------------------------------------ weights
    def weight_specs(self, *, job: str = "") -> list[WeightTensor]:
        """Name, ``model.dtype`` and full shape of every parameter (with ``job``: that job's
        adapter's), in :meth:`iter_weights`' order (no collective)."""
        self._started()
        dtype = self._ctx.config.model.dtype
        return [WeightTensor(n, dtype, full_shape(p)) for n, p in self._sent_parameters(job)]

    def _trained_parameters(self, job: str = "") -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of what ``job``'s optimizer updates: every parameter, or with
        ``[lora]`` its adapter's."""
        if self._jobs.slot_names:
            return adapter_parameters(self._hf_model(), self._jobs.get(job).adapter)
        return [(n, p) for n, p in self._hf_model().named_parameters() if p.requires_grad]

    def _sent_parameters(self, job: str = "") -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of what a refit or an export sends, in order: every
        parameter in HF naming, or with ``[lora]`` ``job``'s adapter alone, under PEFT's
        saved names (:func:`~asyncrl_torch.adapters.saved_name`)."""
        if not self._lora:
            return list(self._hf_model().named_parameters())
        adapter = self._jobs.get(job).adapter
        return [(saved_name(n, adapter), p) for n, p in self._trained_parameters(job)]

    # ------------------------------------------------------------------ jobs
    def open_job(self, job: str, *, seed: int, lr: float) -> None:
        """``job`` (docs/jobs.md) takes a free adapter slot, started afresh from ``seed``
        (its policy is the base), with an optimizer of its own at ``lr``
        (:class:`~asyncrl.plugin.backend.TrainsJobs`). Collective.

        Raises:
            RuntimeError: the trainer has no job slots, every one is taken, or ``job`` is
                open already."""
        self._started()
        if not self._jobs.slot_names:
            raise RuntimeError(f"open_job({job!r}): the trainer has no job slots; start it "
                               "with trainer.options.job_slots > 0 and [lora]")  # fmt: skip
        if not lr > 0:
            raise ValueError(f"open_job({job!r}): lr must be > 0, got {lr}")
        opened = self._jobs.open(job, lr)
        fresh_adapter(self._hf_model(), opened.adapter, seed)
        opened.optimizer = self._build_job_optimizer(
            [p for _, p in self._trained_parameters(job)], lr
        )
        self._log.info("job_opened", job=job, adapter=opened.adapter, lr=lr, seed=seed)

    def close_job(self, job: str) -> None:
        """``job`` ends: its slot is free and its optimizer state dropped."""
        self._started()
        closed = self._jobs.close(job)
        closed.optimizer = None
        if self._jobs.active == closed.adapter:
            self._run_job("")
        self._log.info("job_closed", job=job, adapter=closed.adapter)

    def _build_job_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> Any:
        """An optimizer over a job's adapter ``params`` at ``lr`` (the run's other settings);
        an engine that trains jobs overrides it, and the two below."""
        raise RuntimeError(f"the {self.name} backend does not train jobs")

    def _save_job_state(self, path: str, job: Job) -> None:
        """Collective: ``job``'s adapter and optimizer state under ``path``."""
        raise RuntimeError(f"the {self.name} backend does not train jobs")

    def _load_job_state(self, path: str, job: Job) -> None:
        """Collective: what :meth:`_save_job_state` wrote, into ``job``'s slot."""
        raise RuntimeError(f"the {self.name} backend does not train jobs")

    def _run_job(self, job: str) -> Job:
        """Make ``job``'s adapter the one the model runs; returns the job.

        Raises:
            RuntimeError: ``job`` is not open."""
        running = self._jobs.get(job)
        if self._jobs.slot_names and self._jobs.active != running.adapter:
            run_adapter(self._hf_model(), running.adapter)
            self._jobs.active = running.adapter
        return running

    def _step_optimizer(self) -> Any:
        """The optimizer of the job the model runs now (``None``: the run's own: the
        engine's)."""
        return self._jobs.running().optimizer

    def _step_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of the job the model runs now, that its step updates."""
        return [p for _, p in self._trained_parameters(self._jobs.running().name)]


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's whole shape: ZeRO-3's before partitioning (``ds_shape``), a DTensor's
    global one, else its own."""
    return tuple(getattr(param, "ds_shape", param.shape))


def full_numel(param: torch.nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))

