"""DeepSpeed ZeRO-2/3 training backend.

The call sequence, lockstep micro-batching, the loss and the step ledger are
:class:`asyncrl_torch.DistributedTrainer`'s; this module builds the DeepSpeed engine,
applies the step, gathers weights and saves state.

Gradient accumulation. The engine runs with ``managed_gradient_accumulation = false``: each
``engine.backward`` only accumulates (ZeRO-2/3 reduce-scatter every backward into the rank's
gradient partition), and ``engine.step()`` is the step's one boundary, however many chunks and
micro-batches came before it. ``backward`` is called with ``scale_wrt_gas=False`` and
``gradient_accumulation_steps = 1``, so DeepSpeed's own accumulation scaling never applies.

Normalization. Every micro-batch back-propagates the raw *sum* of its token losses, and
ZeRO's gradient reduction *averages* over the data-parallel ranks, so after all chunks a
partition holds ``(global loss-sum gradient) / world_size``. Before ``engine.step()`` the
backend sets the ZeRO optimizer's loss scale to ``num_loss_tokens / world_size``
(``override_loss_scale``; it is 1 during backward, so no loss is scaled there). DeepSpeed then
divides the gradient by that scale once, reports the gradient norm unscaled and clips with
it: the update equals one big batch normalized by its token count (checked against a float64
single-process reference by :mod:`asyncrl_torch.contract.suite`; measured 0 and 6e-9 relative
grad-norm error for ZeRO-2 and ZeRO-3 on 2 CPU ranks).

State offload (``state_to_host``, ``state_to_device``). DeepSpeed 0.19's
``DeepSpeedEngine.offload_states`` moves ZeRO-1/2 state for any torch optimizer, but ZeRO-3's
AdamW moments and fp32 masters only for its own ``FusedAdam`` (it asserts so), and this backend
steps ``torch.optim.AdamW`` (``torch_adam``). So: ZeRO-2 moves the moments, the fp32 master
partitions and the gradient partitions by ``offload_states`` (never ``lp_params``: the model's
weights stay, the refit's source). ZeRO-3 frees its gradient partitions and reduce buckets by
``offload_states`` and moves the moments itself, as the base class does for FSDP2, and the fp32
master partitions in place (``.data``, as DeepSpeed's own offload does), unless a master is
the weights' own partition (DeepSpeed's float32 shortcut), which stays. With
``zero.offload_param`` DeepSpeed refuses to move any state, so its gradient buffers stay; with
``zero.offload_optimizer`` the moments and masters are on the host already.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import torch

if not torch.cuda.is_available():  # DeepSpeed picks its accelerator once, at import
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.runtime.zero.offload_config import (  # noqa: E402
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)

if not torch.cuda.is_available():
    # On the CPU accelerator DeepSpeed compiles a C++ op when its communication starts (shared-
    # memory all-reduce, ~60 s of CPU with a compiler once per machine, an error without one).
    # Only inference_all_reduce uses it; training reduces through torch.distributed, so the
    # op is not built (as "torch_adam" below avoids the Adam op).
    # (the module by its name: ``deepspeed.comm.torch`` as an attribute is PyTorch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

from asyncrl.plugin.backend import WeightTensor, WorkerContext  # noqa: E402
from asyncrl_torch import DistributedTrainer  # noqa: E402
from asyncrl_torch.trainer import full_numel, full_shape  # noqa: E402
from asyncrl_torch.byte_groups import byte_groups  # noqa: E402

from .options import DeepSpeedOptions, parse_options  # noqa: E402

__all__ = ["DeepSpeedBackend", "deepspeed_config"]

_TAG = "asyncrl"  # the checkpoint tag under a save_state directory

_ZERO2_STATES = (
    OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
    OffloadStateTypeEnum.lp_grads,
)  # fmt: skip
"""What ``state_to_host`` hands to ``offload_states`` under ZeRO-2 (see the module docstring)."""
_ZERO3_STATES = (OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer)
"""The same under ZeRO-3: the gradient buffers alone."""


def deepspeed_config(opts: DeepSpeedOptions, *, micro_batch_size: int, world_size: int) -> dict:
    """The DeepSpeed config dict this backend runs with (see the module docstring)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": opts.max_grad_norm,
        "zero_optimization": {**opts.zero, "stage": opts.zero_stage},
        "bf16": {"enabled": opts.mixed_precision == "bf16"},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opts.lr,
                "betas": list(opts.betas),
                "eps": opts.eps,
                "weight_decay": opts.weight_decay,
                "torch_adam": True,  # torch.optim.AdamW: no DeepSpeed op to compile
                "adam_w_mode": True,
            },
        },
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend(DistributedTrainer):
    """:class:`~asyncrl.plugin.backend.TrainingBackend` over DeepSpeed ZeRO (see the module
    docstring)."""

    name = "deepspeed"
    _opts: DeepSpeedOptions

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, parse_options(dict(ctx.config.trainer.options)))
        self._offloaded_bytes = 0
        """What ``offload_states`` took off the device, which ``reload_states`` brings back."""
        self._host_masters: list[torch.Tensor] = []
        """ZeRO-3's fp32 master partitions that :meth:`_state_to_host` moved."""

    @property
    def _engine(self) -> Any:
        """The ``DeepSpeedEngine`` (the module that forwards)."""
        return self._started()

    def _engine_version(self) -> str:
        return f"deepspeed {deepspeed.__version__}, torch {torch.__version__}"

    # ------------------------------------------------------------------ engine hooks
    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        config = deepspeed_config(
            self._opts,
            micro_batch_size=self._ctx.config.trainer.micro_batch_size,
            world_size=self._ctx.world_size,
        )
        trained = [p for p in model.parameters() if p.requires_grad]  # [lora]: the adapter
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=trained, config=config,
            dist_init_required=False,
        )  # fmt: skip
        engine.optimizer.override_loss_scale(1.0)
        return engine

    def _hf_model(self) -> torch.nn.Module:
        return self._engine.module  # the engine's own .config is DeepSpeed's

    def _close_engine(self) -> None:
        if self._module is not None:
            self._module.destroy()

    def _backward(self, loss_sum: torch.Tensor) -> None:
        self._engine.backward(loss_sum, scale_wrt_gas=False)

    def _zero_grad(self) -> None:
        """Drop everything accumulated since the last step, as DeepSpeed's own skipped
        (overflow) step does."""
        opt = self._engine.optimizer
        opt.zero_grad(set_to_none=True)
        release = getattr(opt, "_release_preflattened_grad_buffers", None)
        if release is not None:
            release()
        if self._opts.zero_stage == 3:
            opt.averaged_gradients = {}
        else:
            for k in list(opt.averaged_gradients):
                opt.averaged_gradients[k] = None
                opt.all_grad_tensors[k] = None

    def _apply_step(self, num_loss_tokens: int) -> float:
        opt = self._engine.optimizer
        opt.override_loss_scale(num_loss_tokens / self._ctx.world_size)
        try:
            self._engine.step()
        finally:
            opt.override_loss_scale(1.0)
        norm = self._engine.get_global_grad_norm()
        # A non-finite norm makes ZeRO skip the update on every rank (its overflow check: on
        # for fp32, and for bf16 by default, bf16.check_grad_overflow); it then reports inf.
        return float(norm) if norm is not None else float("nan")

    # ------------------------------------------------------------------ state offload
    def _state_to_host(self) -> int:
        """See the module docstring; the gradients are dropped first (:meth:`_zero_grad`)."""
        opt = self._engine.optimizer
        self._zero_grad()
        moved = 0
        if self._opts.zero_stage == 2:
            held = [*opt.single_partition_of_fp32_groups, *_state_tensors(opt.optimizer)]
            self._offloaded_bytes = sum(_cuda_nbytes(t) for t in held)
            self._offload_states(_ZERO2_STATES)
        else:
            held = [opt.grad_partitions_flat_buffer, *(b.buffer for b in opt.ipg_buckets.values())]
            self._offloaded_bytes = sum(_cuda_nbytes(t) for t in held if t is not None)
            self._offload_states(_ZERO3_STATES)
            moved = self._host_copies.to_host(opt.optimizer) + self._masters_to_host(opt)
        return self._offloaded_bytes + moved

    def _state_to_device(self) -> int:
        moved = self._host_copies.to_device(self._device)
        for master in self._host_masters:
            master.data = master.data.to(self._device, non_blocking=True)
            moved += _cuda_nbytes(master)
        self._host_masters.clear()
        if self._engine.optimizer.offloaded_states:  # what offload_states marked as moved
            self._engine.reload_states(non_blocking=False)
        moved += self._offloaded_bytes
        self._offloaded_bytes = 0
        return moved

    def _offload_states(self, include: tuple[OffloadStateTypeEnum, ...]) -> None:
        """``offload_states`` of ``include`` into pinned host memory, unless
        ``zero.offload_param`` is set (DeepSpeed asserts then; nothing moves or counts)."""
        param_offload = self._engine.zero_offload_param()
        if param_offload is not None and param_offload.device != OffloadDeviceEnum.none:
            self._offloaded_bytes = 0
            return
        self._engine.offload_states(
            include=include, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False
        )

    def _masters_to_host(self, opt: Any) -> int:
        """ZeRO-3: each fp32 master partition on the device that is not the weights' own
        storage, moved in place to pinned host memory; the bytes. (DeepSpeed 0.19 keeps a
        separate copy in float32 too: its shortcut compares a device string with a
        ``torch.device``.)"""
        weights = {p.ds_tensor.untyped_storage().data_ptr() for p in self._hf_model().parameters()}
        moved = 0
        for master in opt.fp32_partitioned_groups_flat:
            if master.is_cuda and master.untyped_storage().data_ptr() not in weights:
                moved += _cuda_nbytes(master)
                master.data = master.data.to("cpu", non_blocking=True)
                self._host_masters.append(master)
        return moved

    # ------------------------------------------------------------------ state
    def _save_state(self, path: str) -> None:
        """DeepSpeed's own checkpoint (model, ZeRO-partitioned optimizer state per rank);
        with ``[lora]`` the adapter and its optimizer state only (the base is
        ``model.path``'s)."""
        self._engine.save_checkpoint(
            path, tag=_TAG, save_latest=False, exclude_frozen_parameters=self._lora
        )

    def _load_state(self, path: str) -> None:
        if not os.path.isdir(os.path.join(path, _TAG)):
            raise FileNotFoundError(
                f"{path} holds no DeepSpeed state saved by this backend (no {_TAG}/ inside)"
            )
        loaded, _ = self._engine.load_checkpoint(
            path, tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
            load_module_strict=not self._lora,  # [lora]: the base was not saved
        )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the state under {path}")
        self._engine.optimizer.override_loss_scale(1.0)

    def _local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """ZeRO-2 keeps whole parameters. ZeRO-3 keeps a parameter's partition in
        ``ds_tensor`` (without its padding: ZeRO-3 leaves the padding of the last partitions
        uninitialized), and ``data`` is empty between gathers, except for a small parameter
        kept whole on every rank (``stage3_param_persistence_threshold``), which exports and
        refits read from ``data``: both are yielded then."""
        for name, param in self._hf_model().named_parameters():
            part = getattr(param, "ds_tensor", None)
            if part is not None:
                size = part.numel()
                valid = min(max(int(param.ds_numel) - self._ctx.rank * size, 0), size)
                yield name, part.detach().view(-1)[:valid]
            if part is None or param.data.numel():
                yield name, param.detach()

    # ------------------------------------------------------------------ weights
    def iter_weights(self, *, job: str = "") -> Iterator[WeightTensor]:
        """Every parameter in HF naming (with ``[lora]``: the adapter's, under PEFT's saved
        names) and ``model.dtype``, on this rank's device.

        ZeRO-2: every rank holds the whole model, so rank 0 yields its live parameters (no
        collective; ``stable``: they change only at the next step). ZeRO-3: parameters are
        gathered in consecutive groups of about ``export_bucket_mb`` (one all-gather per
        group, :class:`deepspeed.zero.GatheredParameters`), and a group is partitioned again
        when the iteration moves past it; consume a yielded tensor before advancing.
        """
        name_dtype = self._ctx.config.model.dtype
        dtype = getattr(torch, name_dtype)
        sender = self._ctx.rank == 0
        named = self._sent_parameters(job)  # jobs: never opened here (no job slots)
        if self._opts.zero_stage < 3:
            for name, param in named:
                if not sender:
                    yield WeightTensor(name, name_dtype, tuple(param.shape))
                    continue
                out = param.detach().to(dtype).contiguous()
                yield WeightTensor(name, name_dtype, tuple(out.shape), out, stable=True)
            return
        itemsize = torch.empty(0, dtype=dtype).element_size()
        sizes = [full_numel(p) * itemsize for _, p in named]
        for group in byte_groups(sizes, self._opts.export_bucket_mb << 20):
            params = [named[i][1] for i in group]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                for i in group:
                    name, param = named[i]
                    shape = full_shape(param)
                    if not sender:
                        yield WeightTensor(name, name_dtype, shape)
                        continue
                    out = param.detach().to(dtype).contiguous()
                    yield WeightTensor(name, name_dtype, tuple(out.shape), out)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]  # fmt: skip


def _cuda_nbytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` holds on a GPU (0 on the host)."""
    return tensor.numel() * tensor.element_size() if tensor.is_cuda else 0
