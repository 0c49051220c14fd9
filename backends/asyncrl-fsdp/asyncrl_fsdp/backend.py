"""FSDP2 (``torch.distributed.fsdp.fully_shard``) training backend.

One object per rank of a torch.distributed group; the worker runtime calls its blocking
methods from one thread, the same sequence on every rank::

    start -> (compute_logprobs | begin_step -> train_chunk* -> finish_step | iter_weights)* -> close

Gradient normalization. A step's chunks stream in one by one and nobody knows the step's
token count until :meth:`finish_step`, so every micro-batch back-propagates the raw *sum* of
its token losses. FSDP2 reduce-scatters after every backward and by default *averages* over
ranks (``ReduceOp.AVG``: a factor 1/world_size, measured); we switch every FSDP module to a
plain sum (gradient divide factor 1, sum-only collectives), so after all chunks each rank's
gradient shard holds the gradient of the global loss sum. :meth:`finish_step` multiplies it
by ``1 / num_loss_tokens``: the update equals one big batch normalized by its token count.

Lockstep. FSDP's all-gathers and reduce-scatters must line up across ranks, so every rank
runs the same number of forwards (and backwards) per call: ranks agree on the largest local
micro-batch count (one all-reduce, which also tells every rank whether some rank's batch is
malformed) and pad with fully masked dummy micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from asyncrl.backend import WeightTensor, WorkerContext
from asyncrl.loss import ppo_clip_loss
from asyncrl.messages import ChunkResult, StepResult, TokenBatch, TrainBatch
from asyncrl.torch_utils import (
    MicroBatch,
    check_packed,
    dummy_micro_batch,
    make_micro_batch,
    micro_batch_bounds,
    response_logprobs,
)

from .kv_calibration import all_reduce_max, calibrate_kv_scales
from .options import FSDPOptions, parse_options

__all__ = ["FSDPBackend", "StepStateError"]

log = structlog.get_logger()


class StepStateError(RuntimeError):
    """A call arrived out of order (no open step, a second open step, a wrong step id)."""


@dataclass
class _OpenStep:
    step: int
    started: float
    loss_tokens: int = 0
    loss_sum: float = 0.0



def _fsdp_owners(model: torch.nn.Module) -> dict[str, FSDPModule]:
    """For each parameter name, the innermost FSDP unit that gathers it."""
    owners: dict[str, FSDPModule] = {}
    units = sorted(
        ((prefix, m) for prefix, m in model.named_modules() if isinstance(m, FSDPModule)),
        key=lambda item: len(item[0]),
    )
    for prefix, unit in units:  # outer first, so inner units overwrite
        for name, _ in unit.named_parameters():
            owners[f"{prefix}.{name}" if prefix else name] = unit
    return owners


class FSDPBackend:
    """:class:`~asyncrl.backend.TrainingBackend` over FSDP2 (see the module docstring)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._opts: FSDPOptions = parse_options(dict(ctx.config.trainer.options))
        self._log = log.bind(group=ctx.group, rank=ctx.rank)
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._device = torch.device("cpu")
        self._vocab_size = 0
        self._owns_process_group = False
        self._open: _OpenStep | None = None
        self._closed = False

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

        model = AutoModelForCausalLM.from_pretrained(
            ctx.config.model.path,
            dtype=torch.float32,
            attn_implementation=opts.attn_implementation,
        ).to(self._device)
        # parameters() counts a tied embedding once
        num_parameters = sum(p.numel() for p in model.parameters())
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._shard(model)
        self._model = model
        self._optimizer = self._build_optimizer(model)
        caps = {
            "backend_version": torch.__version__,
            "device": str(self._device),
            "num_parameters": num_parameters,
        }
        self._log.info("fsdp_backend_started", world_size=ctx.world_size, **caps)
        return caps

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._open = None
        self._optimizer = None
        self._model = None
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
            dist.init_process_group(
                backend, store=store, rank=ctx.rank, world_size=ctx.world_size
            )
        else:
            dist.init_process_group(
                backend, init_method="env://", rank=ctx.rank, world_size=ctx.world_size
            )
        self._owns_process_group = True

    def _shard(self, model: torch.nn.Module) -> None:
        opts = self._opts
        mesh = init_device_mesh(self._device.type, (self._ctx.world_size,))
        if opts.mixed_precision == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        layer_types = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in layer_types]
        for layer in layers:
            fully_shard(
                layer, mesh=mesh, mp_policy=mp, reshard_after_forward=opts.reshard_after_forward
            )
        # The root group owns the embedding, the final norm and lm_head; a tied lm_head is the
        # same Parameter as the embedding, and FSDP2 shards it once for both modules.
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # reduce-scatter sums instead of averaging over ranks (see module docstring)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def _build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        opts = self._opts
        if opts.optimizer == "sgd":
            return torch.optim.SGD(
                model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay
            )
        return torch.optim.AdamW(
            model.parameters(),
            lr=opts.lr,
            betas=opts.betas,
            eps=opts.eps,
            weight_decay=opts.weight_decay,
        )

    # ------------------------------------------------------------------ forward passes
    def compute_logprobs(self, batch: TokenBatch, temperature: float) -> np.ndarray:
        model = self._started()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        problem = check_packed(
            batch.tokens, batch.seq_lens, batch.prompt_lens, vocab_size=self._vocab_size
        )
        bounds = self._bounds(batch, problem)
        passes = self._agree(problem, len(bounds), "compute_logprobs")
        out: list[torch.Tensor] = []
        model.eval()
        with torch.no_grad():
            for i in range(passes):
                mb = self._micro_batch(batch, bounds, i)
                lp = response_logprobs(self._logits(mb), mb, temperature)
                if i < len(bounds):
                    out.append(lp)
        if not out:
            return np.zeros(0, dtype=np.float32)
        return torch.cat(out).to("cpu", torch.float32).numpy()

    def calibrate_kv_scales(
        self, batch: TokenBatch, *, percentile: float, margin: float, include_q: bool
    ) -> dict[str, float]:
        """FP8 KV-cache scales of the current weights on this rank's ``batch`` (see
        :mod:`asyncrl_fsdp.kv_calibration`); every rank returns the same, maxed across ranks."""
        model = self._started()
        problem = check_packed(
            batch.tokens, batch.seq_lens, batch.prompt_lens, vocab_size=self._vocab_size
        )
        bounds = self._bounds(batch, problem)
        passes = self._agree(problem, len(bounds), "calibrate_kv_scales")
        return calibrate_kv_scales(
            model,
            (self._micro_batch(batch, bounds, i) for i in range(passes)),
            self._logits,
            percentile=percentile,
            margin=margin,
            include_q=include_q,
            reduce_max=all_reduce_max if self._ctx.world_size > 1 else None,
        )

    def _logits(self, mb: MicroBatch) -> torch.Tensor:
        assert self._model is not None
        return self._model(input_ids=mb.input_ids, use_cache=False).logits

    def _bounds(self, batch: TokenBatch | TrainBatch, problem: str | None) -> list[tuple[int, int]]:
        if problem is not None:
            return []
        return micro_batch_bounds(len(batch.seq_lens), self._ctx.config.trainer.micro_batch_size)

    def _micro_batch(
        self, batch: TokenBatch | TrainBatch, bounds: list[tuple[int, int]], i: int
    ) -> MicroBatch:
        if i >= len(bounds):
            return dummy_micro_batch(device=self._device)
        start, stop = bounds[i]
        return make_micro_batch(
            batch.tokens, batch.seq_lens, batch.prompt_lens, start, stop, device=self._device
        )

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
    def begin_step(self, step: int) -> None:
        self._started()
        if self._open is not None:
            raise StepStateError(
                f"begin_step({step}): step {self._open.step} is still open; finish it first"
            )
        assert self._optimizer is not None
        self._optimizer.zero_grad(set_to_none=True)
        self._open = _OpenStep(step=step, started=time.monotonic())

    def train_chunk(self, step: int, batch: TrainBatch) -> ChunkResult:
        model = self._started()
        open_step = self._require_open(step, "train_chunk")
        problem = check_packed(
            batch.tokens,
            batch.seq_lens,
            batch.prompt_lens,
            vocab_size=self._vocab_size,
            per_token={"behaviour_logprobs": batch.behaviour_logprobs},
            per_sequence={"advantages": batch.advantages},
        )
        bounds = self._bounds(batch, problem)
        passes = self._agree(problem, len(bounds), f"train_chunk(step={step})")
        try:
            with torch.enable_grad():
                sums = self._forward_backward(model, batch, bounds, passes)
        except BaseException:
            self._discard("train_chunk failed")
            raise
        num_tokens = int((batch.seq_lens.astype(np.int64) - batch.prompt_lens).sum())
        open_step.loss_tokens += num_tokens
        open_step.loss_sum += sums[0]
        return ChunkResult(
            num_sequences=len(batch.seq_lens),
            num_loss_tokens=num_tokens,
            loss_sum=sums[0],
            clipped_tokens=int(sums[1]),
            is_weight_sum=sums[2],
            abs_logprob_diff_sum=sums[3],
        )

    def _forward_backward(
        self,
        model: torch.nn.Module,
        batch: TrainBatch,
        bounds: list[tuple[int, int]],
        passes: int,
    ) -> list[float]:
        loss_cfg = self._ctx.config.loss
        temperature = self._ctx.config.grpo.temperature
        behaviour = torch.tensor(batch.behaviour_logprobs, dtype=torch.float32).to(self._device)
        seq_adv = torch.tensor(batch.advantages, dtype=torch.float32).to(self._device)
        sums = torch.zeros(4, dtype=torch.float64, device=self._device)
        model.train()
        for i in range(passes):
            mb = self._micro_batch(batch, bounds, i)
            if i < len(bounds):
                start, stop = bounds[i]
                beh = behaviour[mb.response_slice]
                adv = torch.repeat_interleave(seq_adv[start:stop], mb.response_lens)
                mask = torch.ones_like(beh, dtype=torch.bool)
            else:  # padding pass: same collectives, no loss
                beh = torch.zeros(len(mb.targets), device=self._device)
                adv, mask = torch.zeros_like(beh), torch.zeros_like(beh, dtype=torch.bool)
            lp = response_logprobs(self._logits(mb), mb, temperature)
            prox = lp.detach() if self._opts.proximal_policy == "current" else None
            loss_sum, stats = ppo_clip_loss(
                lp,
                beh,
                adv,
                mask,
                clip_eps_low=loss_cfg.clip_eps_low,
                clip_eps_high=loss_cfg.clip_eps_high,
                is_cap=loss_cfg.is_cap,
                proximal_logprobs=prox,
            )
            loss_sum.backward()
            sums += torch.stack(
                [
                    loss_sum.detach(),
                    stats.clipped_tokens,
                    stats.is_weight_sum,
                    stats.abs_logprob_diff_sum,
                ]
            ).to(torch.float64)
        return sums.tolist()

    def finish_step(self, step: int, num_loss_tokens: int) -> StepResult:
        model = self._started()
        open_step = self._require_open(step, "finish_step")
        assert self._optimizer is not None
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
                + (" (an empty step cannot be normalized)" if counted == 0 else "")
                + "; the step was discarded (no update)"
            )
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        for grad in grads:  # sums of the whole step on every shard -> the step's mean
            grad.mul_(1.0 / num_loss_tokens)
        total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()
        grad_norm = float(total_norm)
        if not np.isfinite(grad_norm):
            # the same on every rank (the norm is all-reduced), so all ranks skip together
            self._log.warning("step_skipped_nonfinite_grad_norm", step=step, grad_norm=grad_norm)
        else:
            if self._opts.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self._opts.max_grad_norm, total_norm)
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._open = None
        return StepResult(
            step=step,
            loss=loss_sum / num_loss_tokens,
            grad_norm=grad_norm,
            num_loss_tokens=num_loss_tokens,
            lr=float(self._optimizer.param_groups[0]["lr"]),
            seconds=time.monotonic() - open_step.started,
        )

    def _require_open(self, step: int, what: str) -> _OpenStep:
        if self._open is None:
            raise StepStateError(f"{what}({step}): no optimizer step is open; call begin_step")
        if self._open.step != step:
            raise StepStateError(f"{what}({step}): the open step is {self._open.step}")
        return self._open

    def _discard(self, reason: str) -> None:
        if self._open is not None:
            self._log.warning("step_discarded", step=self._open.step, reason=reason)
        self._open = None
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ weights
    def weight_specs(self) -> list[WeightTensor]:
        """Name, ``model.dtype`` and full shape of every parameter, in :meth:`iter_weights`'
        order (no collective: a DTensor knows its global shape)."""
        model = self._started()
        dtype = self._ctx.config.model.dtype
        return [WeightTensor(n, dtype, tuple(p.shape)) for n, p in model.named_parameters()]

    def iter_weights(self) -> Iterator[WeightTensor]:
        """Yield every parameter, gathered, in HF naming and ``model.dtype``, on this rank's
        device.

        One all-gather per FSDP unit (a decoder layer, or the root's embedding/norm/head), not
        one per parameter: each unit is unsharded once (``FSDPModule.unshard``), its
        parameters are yielded, and it is resharded when the iteration moves past it. The
        next unit's all-gather is started (``async_op``) when a unit opens, so it runs while
        this unit's tensors are packed and sent. A
        yielded tensor may alias the unit's gathered memory: consume it (the transfer packs it)
        before advancing. A tied ``lm_head.weight`` is not yielded: ``named_parameters`` lists
        a shared Parameter once, under its first name (the input embedding), and vLLM ties it
        itself.
        """
        model = self._started()
        dtype = getattr(torch, self._ctx.config.model.dtype)
        if self._ctx.world_size == 1:
            yield from self._iter_local(model, dtype)
            return
        sender = self._ctx.rank == 0
        names = [n for n, _ in model.named_parameters()]
        owner = _fsdp_owners(model)
        order: list[FSDPModule] = []  # the non-root units, in the order their tensors come
        for name in names:
            unit = owner.get(name)
            if unit is not None and unit is not model and unit not in order:
                order.append(unit)
        prefetched: dict[int, Any] = {}  # unit index -> its pending all-gather
        root_open = False
        opened = -1  # index in `order` of the non-root unit gathered now
        try:
            for name in names:
                unit = owner.get(name)
                if unit is model:
                    if not root_open:  # the root's few tensors stay gathered until the end
                        model.unshard()
                        root_open = True
                elif unit is not None and (opened < 0 or unit is not order[opened]):
                    if opened >= 0:
                        order[opened].reshard()
                    opened = order.index(unit)
                    handle = prefetched.pop(opened, None)
                    if handle is not None:
                        handle.wait()
                    else:
                        unit.unshard()
                    if opened + 1 < len(order):  # the next unit gathers while this one is sent
                        prefetched[opened + 1] = order[opened + 1].unshard(async_op=True)
                param = model.get_parameter(name).detach()
                # detach() instead of a no_grad() block: grad mode is thread-local and a block
                # would stay entered while the generator is suspended between items.
                if isinstance(param, DTensor):  # not gathered by its unit: gather it alone
                    param = param.full_tensor()
                if not sender:
                    yield WeightTensor(name, self._ctx.config.model.dtype, tuple(param.shape))
                    continue
                out = param.to(dtype).contiguous()
                yield WeightTensor(name, self._ctx.config.model.dtype, tuple(out.shape), out)
        finally:
            for index, handle in prefetched.items():  # abandoned before reaching them
                if handle is not None:
                    handle.wait()
                order[index].reshard()
            if opened >= 0:
                order[opened].reshard()
            if root_open:
                model.reshard()  # type: ignore[operator]

    def _iter_local(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterator[WeightTensor]:
        """One rank holds every parameter whole (its shard is the tensor): no unit is gathered.
        The same bits as a gather: FSDP casts the shard to the unit's param dtype before its
        all-gather, as ``.to(dtype)`` does here. Skipping the unshards saved ~0.12 ms per
        unit on the CPU (24 layers: 10.3 -> 7.4 ms per iteration)."""
        name_dtype = self._ctx.config.model.dtype
        for name, param in model.named_parameters():
            data = param.detach()
            local = data.to_local() if isinstance(data, DTensor) else data
            if tuple(local.shape) != tuple(param.shape):  # padded or not whole: gather it
                local = data.full_tensor()
            out = local.to(dtype).contiguous()
            # the live parameter (or a cast of its own): valid until the next step
            yield WeightTensor(name, name_dtype, tuple(out.shape), out, stable=True)

    def _started(self) -> torch.nn.Module:
        if self._closed:
            raise RuntimeError("the FSDP backend is closed")
        if self._model is None:
            raise RuntimeError("the FSDP backend is not started; call start() first")
        return self._model
