"""Jobs on one trainer (docs/jobs.md): each job's LoRA adapter, optimizer and open step, on the
same ranks and the same frozen base.

A ``[lora]`` trainer started with ``trainer.options.job_slots = N`` holds, beside the run's own
adapter (PEFT's ``default``: the job ``""``), N more adapters in the same PEFT model, named
``job0`` ... ``job<N-1>``. They are made before the engine shards the model (a sharded model
takes no new parameters), so N bounds the jobs open at once; a job opened takes a free slot,
whose adapter starts afresh (``lora_A`` random from the job's seed, ``lora_B`` zero: the policy
is the base), with an optimizer of its own. A forward runs one job's adapter (PEFT's active
adapter): the others take no part in it and get no gradient, so two jobs' steps may be open at
once and their chunks interleave; each step clips, updates and zeroes its own job's adapter
only.

:class:`TrainerJobs` owns which jobs are open, their slots and open steps, and which adapter
the model runs now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl_torch.adapters import ADAPTER
from asyncrl_torch.step_ledger import StepLedger

__all__ = ["Job", "TrainerJobs"]


@dataclass
class Job:
    """One job on this rank."""

    name: str
    adapter: str
    """Its adapter's name in the PEFT model (``default``: the run's own, the job ``""``)."""
    ledger: StepLedger
    """Its open optimizer step."""
    lr: float
    optimizer: Any = None
    """Its optimizer (the engine's kind); the run's own job uses the engine's optimizer."""


class TrainerJobs:
    """The jobs open on one trainer rank, their adapter slots, and the adapter the model runs.

    Args:
        slots: adapters made for jobs beside the run's own (``trainer.options.job_slots``).
        lr: the run's learning rate (the job ``""``'s).
    """

    def __init__(self, slots: int, lr: float) -> None:
        self.slot_names = tuple(f"job{k}" for k in range(slots))
        self._free = list(self.slot_names)
        self._jobs = {"": Job("", ADAPTER, StepLedger(), lr)}
        self.active = ADAPTER
        """The adapter the model runs now."""

    @property
    def run(self) -> Job:
        """The run's own job (``""``)."""
        return self._jobs[""]

    def get(self, job: str) -> Job:
        """Raises: RuntimeError: ``job`` is not open on this trainer."""
        found = self._jobs.get(job)
        if found is None:
            raise RuntimeError(
                f"job {job!r} is not open on this trainer (open: "
                f"{sorted(j for j in self._jobs if j) or 'none'}); open_job first"
            )
        return found

    def open(self, job: str, lr: float) -> Job:
        """``job`` takes a free slot.

        Raises:
            RuntimeError: it is open already, or every slot is taken (the fix named)."""
        if not job:
            raise RuntimeError('the job "" is the run\'s own: it is always open')
        if job in self._jobs:
            raise RuntimeError(f"job {job!r} is open already")
        if not self._free:
            raise RuntimeError(
                f"job {job!r} cannot open: all {len(self.slot_names)} job slots of the trainer "
                f"are taken ({sorted(j for j in self._jobs if j)}). Fix: stop a job first, or "
                "start the run with more trainer.options.job_slots"
            )
        opened = Job(job, self._free.pop(0), StepLedger(), lr)
        self._jobs[job] = opened
        return opened

    def close(self, job: str) -> Job:
        """``job`` ends; its slot is free again. A step of it still open is abandoned (a job
        that failed mid-step): the slot's next job starts its own from zeroed gradients.

        Raises:
            RuntimeError: not open, or the run's own."""
        closing = self.get(job)
        if not job:
            raise RuntimeError('the job "" is the run\'s own: it cannot be closed')
        del self._jobs[job]
        self._free.append(closing.adapter)
        return closing

    def running(self) -> Job:
        """The job whose adapter the model runs now."""
        return next(j for j in self._jobs.values() if j.adapter == self.active)

    def open_steps(self) -> list[tuple[str, int]]:
        """``(job, step)`` of every open step."""
        return [(j.name, j.ledger.open.step) for j in self._jobs.values() if j.ledger.open]


def add_job_slots(peft_model: Any, names: tuple[str, ...]) -> None:
    """Add an adapter named each of ``names`` to ``peft_model``, with its ``default``
    adapter's config, float32 and trainable (before the model is sharded)."""
    config = peft_model.peft_config[ADAPTER]
    for name in names:
        peft_model.add_adapter(name, config)
    for pname, param in peft_model.named_parameters():
        if "lora_" in pname:
            param.requires_grad_(True)
            param.data = param.data.float()


def adapter_parameters(
    model: torch.nn.Module, adapter: str
) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of ``adapter``'s tensors in ``model``."""
    return [(n, p) for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n]


def run_adapter(peft_model: Any, adapter: str) -> None:
    """Make ``adapter`` the one the model runs; every adapter stays trainable (the sharding
    engine's parameter groups never change; an adapter out of the forward gets no
    gradient)."""
    peft_model.base_model.set_adapter(adapter)
    for name, param in peft_model.named_parameters():
        if "lora_" in name and not param.requires_grad:
            param.requires_grad_(True)


@torch.no_grad()
def fresh_adapter(model: torch.nn.Module, adapter: str, seed: int) -> None:
    """Start ``adapter`` afresh as PEFT initializes one (``lora_A`` Kaiming-uniform with
    ``a = sqrt(5)``, ``lora_B`` zero), from ``seed``: the same on every rank, whatever the
    sharding (each rank draws the whole tensor and keeps its part)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for name, param in adapter_parameters(model, adapter):
        full = torch.zeros(tuple(param.shape), dtype=torch.float32)
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
            full.uniform_(-bound, bound, generator=gen)
        if isinstance(param.data, DTensor):
            part = distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
            param.data.copy_(part)
        else:
            param.data.copy_(full.to(param.device))
