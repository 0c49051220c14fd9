"""The memory plan: what each process of a run holds on its GPU at its peak, against the GPUs
it will run on, computed before anything starts (docs/one-gpu.md).

Each backend plugin says what one of its processes holds (``BackendPlugin.gpu_memory``: the
trainer's weights, gradients, optimizer state and the activations of its longest
micro-batch, an engine's reservation); the core places the processes on GPUs as the workers
will (``cluster.trainer_gpus``, ``cluster.rollout_gpus``) and adds them up per GPU. A GPU
whose processes need more than it has refuses the run, naming the processes, their parts and
the fixes. The activations need the run's longest sequence
(:attr:`ModelShape.longest_sequence`, from the prompts the preflight measured); where it is
not known, only a token budget bounds them, and the plan says so. Each step's record shows
the trainer's measured peaks (``trainer_peak_allocated_gib``) beside the plan's figure
(``trainer_plan_gib``).

Nothing here imports torch or an engine: the sizes come from ``config.json`` and the
safetensors headers, the GPUs' memory from ``nvidia-smi``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.errors import config_error as fail
from asyncrl.procs.space import model_size

__all__ = ["GiB", "MemoryNeed", "MemoryPlan", "ModelShape", "gpu_totals", "plan_memory"]

GiB = 1 << 30

CUDA_CONTEXT_BYTES = GiB // 2
"""What each process's CUDA context takes on its GPU, outside what torch's allocator counts:
an assumption (a few hundred MiB with lazy module loading), not a measurement of this code."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of the model, from its directory, and of the run's sequences."""

    parameters: int
    """Elements in its weight files (a tied weight counted once)."""
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0
    """The MLP's width (``intermediate_size``; 4 x hidden where the config has none)."""
    longest_sequence: int = 0
    """Tokens in the longest sequence the run trains: its longest prompt plus
    ``grpo.max_new_tokens``, or ``episode.max_context_tokens`` for multi-turn episodes (0: not
    known here, and activations are counted only to ``trainer.max_tokens_per_micro_batch``)."""

    @classmethod
    def of(cls, model_dir: str) -> ModelShape | None:
        """The shape of the model at ``model_dir``; ``None`` when ``config.json`` or the
        safetensors headers cannot tell it."""
        size = model_size(model_dir)
        try:
            hf = json.loads((Path(model_dir) / "config.json").read_text())
            hf = hf.get("text_config", hf)
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            return cls(
                parameters=size.elements if size else 0,
                layers=int(hf["num_hidden_layers"]),
                hidden=hidden,
                kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                vocab=int(hf["vocab_size"]),
                intermediate=int(hf.get("intermediate_size") or 4 * hidden),
            ) if size and size.elements else None  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, AttributeError):
            return None


@dataclass(frozen=True)
class MemoryNeed:
    """What one process of a backend holds on its GPU at its peak."""

    parts: tuple[tuple[str, int], ...]
    """``(what, bytes)``, e.g. ``("AdamW moments, float32, 1/2 shard", 3.9e9)``."""
    fixes: tuple[str, ...] = ()
    """What would lower it, for a plan that does not fit (the settings named)."""
    movable: int = 0
    """Of the parts, the bytes a trainer moves to host memory (or frees) between steps when it
    takes turns with an engine: its optimizer state and gradients (docs/one-gpu.md)."""
    transient: int = 0
    """Of the parts, the bytes held only while a step runs (a trainer's activations): none of
    them while engines that take turns with it generate."""

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)


GpuMemory = Callable[[Any, ModelShape, "int | None"], MemoryNeed]
"""``BackendPlugin.gpu_memory``: ``(config, shape, gpu_bytes) -> MemoryNeed`` for one process
of the backend on a GPU of ``gpu_bytes`` (``None``: not known here)."""


def gpu_totals() -> list[int] | None:
    """The memory of each GPU this process sees (``CUDA_VISIBLE_DEVICES`` honoured), in bytes,
    by ``nvidia-smi``; ``None`` without one (a CPU host)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        totals = [int(float(line)) << 20 for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        try:
            totals = [totals[int(i)] for i in visible.split(",") if i.strip()]
        except (ValueError, IndexError):  # UUIDs or MIG names: not mapped here
            return None
    return totals or None


@dataclass(frozen=True)
class Process:
    label: str
    """``trainer:0``, ``rollout:1``."""
    gpu: int
    need: MemoryNeed | None
    """``None``: its backend says nothing (no ``gpu_memory``)."""


@dataclass(frozen=True)
class MemoryPlan:
    """The processes on each GPU with what they hold, and the GPUs' memory (``gpus``: ``None``
    when not known here: the plan then has no verdict)."""

    processes: list[Process]
    gpus: list[int] | None
    model: str
    shape: ModelShape | None = None
    notes: list[str] = field(default_factory=list)
    take_turns: bool = False
    """``cluster.placement = "take_turns"``: on a GPU with a trainer rank and engines, the
    engines sleep while the trainer steps (holding only their CUDA contexts, an assumption)."""
    offload: bool = False
    """With turns: the trainers' optimizer state and gradients leave the GPU while the engines
    generate (``cluster.trainer_offload``, decided from this plan when ``auto``)."""

    def on(self, gpu: int) -> list[Process]:
        return [p for p in self.processes if p.gpu == gpu]

    def need(self, gpu: int) -> int:
        """What the processes on ``gpu`` hold at most, their CUDA contexts included (with
        turns: in the costlier of the two turns)."""
        return max(self.turns(gpu).values())

    def turns(self, gpu: int) -> dict[str, int]:
        """What ``gpu`` holds in each turn: ``{"resident": ...}`` where nothing takes turns,
        else ``{"generating": ..., "stepping": ...}`` (contexts included)."""
        needs = [(p.label.startswith("trainer:"), p.need) for p in self.on(gpu) if p.need]
        contexts = len(self.on(gpu)) * CUDA_CONTEXT_BYTES
        trainers = [need for trainer, need in needs if trainer]
        engines = [need for trainer, need in needs if not trainer]
        if not (self.take_turns and trainers and engines):
            return {"resident": sum(need.total for _, need in needs) + contexts}
        kept = sum(t.total - t.transient - (t.movable if self.offload else 0) for t in trainers)
        return {"generating": kept + sum(e.total for e in engines) + contexts,
                "stepping": sum(t.total for t in trainers) + contexts}  # fmt: skip

    def trainer_bytes(self) -> int | None:
        """What the largest trainer rank holds at its peak (``None``: its backend says
        nothing): what the step records set beside the measured peaks."""
        needs = [p.need.total for p in self.processes
                 if p.label.startswith("trainer:") and p.need is not None]  # fmt: skip
        return max(needs) if needs else None

    def lines(self) -> list[str]:
        """The plan as ``check-config`` prints it."""
        out = [f"memory plan ({self.model}):"]
        for gpu in sorted({p.gpu for p in self.processes}):
            total = self.gpus[gpu] if self.gpus and gpu < len(self.gpus) else None
            have = f" of {_gib(total)}" if total else ""
            out.append(f"  GPU {gpu}: {_gib(self.need(gpu))}{have}{self._turn_line(gpu)}")
            for p in self.on(gpu):
                if p.need is None:
                    out.append(f"    {p.label}: its backend does not say")
                    continue
                parts = ", ".join(f"{what} {_gib(b)}" for what, b in p.need.parts)
                out.append(f"    {p.label}: {_gib(p.need.total)} ({parts})")
            contexts = len(self.on(gpu)) * CUDA_CONTEXT_BYTES
            out.append(f"    CUDA contexts: {_gib(contexts)} (assumed)")
        out += [f"  {note}" for note in self.notes]
        if self.gpus is None:
            out.append("  no GPU seen here: no verdict (check-config --gpu-memory-gib G plans "
                       "for GPUs of G GiB)")  # fmt: skip
        return out

    def _turn_line(self, gpu: int) -> str:
        turns = self.turns(gpu)
        if "generating" not in turns:
            return ""
        moved = ("optimizer state and gradients in host memory" if self.offload
                 else "the trainer's state kept")  # fmt: skip
        return (f" (taking turns: engines generating {_gib(turns['generating'])}, {moved}; "
                f"trainer stepping {_gib(turns['stepping'])}, engines asleep)")

    def problems(self) -> list[ConfigError]:
        """Each GPU whose processes need more than it has, with the fixes."""
        if self.gpus is None:
            return []
        out = []
        for gpu in sorted({p.gpu for p in self.processes}):
            if gpu >= len(self.gpus):
                out.append(fail(
                    _placement_field(self.on(gpu)), f"places a process on GPU {gpu}, but this "
                    f"node shows {len(self.gpus)}", "use indexes below that",
                ))  # fmt: skip
                continue
            need, total = self.need(gpu), self.gpus[gpu]
            if need <= total:
                continue
            who = "; ".join(f"{p.label} {_gib(p.need.total)}" for p in self.on(gpu) if p.need)
            fixes = [f for p in self.on(gpu) if p.need for f in p.need.fixes]
            turns = self.turns(gpu)
            if turns.get("generating", 0) > total:  # the engines' turn does not fit
                engines = sum(p.need.total for p in self.on(gpu)
                              if p.need and not p.label.startswith("trainer:"))  # fmt: skip
                room = total - (turns["generating"] - engines)
                fixes.insert(0, f"let the engines take at most {_gib(max(room, 0))} "
                                f"({max(room, 0) / total:.2f} of the GPU) beside the trainer's "
                                "resident state (generator.options.gpu_memory_utilization)"
                                + ("" if self.offload else ", or offload the trainer's state "
                                   "(cluster.trainer_offload = \"always\")"))  # fmt: skip
            elif "resident" in turns and len(self.on(gpu)) > 1:
                fixes.append("take turns on the GPU (cluster.placement = \"take_turns\": the "
                             "engines sleep while the trainer steps)")  # fmt: skip
            if len(self.on(gpu)) > 1:
                fixes.append("put the trainer and the engines on different GPUs "
                             "(cluster.trainer_gpus, cluster.rollout_gpus)")  # fmt: skip
            out.append(fail(
                _placement_field(self.on(gpu)),
                f"GPU {gpu} has {_gib(total)}, and its processes hold {_gib(need)} ({who}, "
                "and their CUDA contexts)",
                "; or ".join(dict.fromkeys(fixes)) or "use a GPU with more memory",
            ))  # fmt: skip
        return out


def _placement_field(processes: list[Process]) -> str:
    groups = {p.label.split(":")[0] for p in processes}
    return "cluster.rollout_gpus" if groups == {"rollout"} else (
        "cluster.trainer_gpus" if groups == {"trainer"} else "cluster")  # fmt: skip


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB // 10 else f"{nbytes / (1 << 20):.0f} MiB"


def plan_memory(
    config: Any, trainer: GpuMemory | None, generator: GpuMemory | None,
    gpus: list[int] | None, *, longest_sequence: int = 0,
) -> MemoryPlan:  # fmt: skip
    """The plan of ``config``'s processes (each group's ``gpu_memory``, ``None`` if its plugin
    has none) on ``gpus`` (each GPU's bytes; ``None``: unknown), its sequences at most
    ``longest_sequence`` tokens long (0: not known; activations then counted only to a token
    budget). Trainer rank r runs on ``cluster.trainer_gpus[r]``, else GPU r; rollout rank r on
    ``cluster.rollout_gpus[r]``, else GPU 0 (vLLM's default, the first it sees), as the
    workers place them on one node. A run over TCP (several nodes) gets no verdict: its ranks'
    nodes are not known here."""
    c = config.cluster
    shape = ModelShape.of(config.model.path)
    notes = [] if shape else [f"the model's size cannot be read from {config.model.path}: "
                              "the backends' shares are unknown"]  # fmt: skip
    if shape is not None:
        shape = dataclasses.replace(shape, longest_sequence=longest_sequence)
    if shape is not None and not longest_sequence:
        notes.append("the longest sequence is not known here: a trainer's activations are "
                     "counted only to trainer.max_tokens_per_micro_batch")  # fmt: skip
    if c.network == "tcp" and gpus is not None:
        # ranks on other nodes: which of them share this node's GPUs is not known here
        notes.append("cluster.network = \"tcp\" (ranks on several nodes): each process's "
                     "share is shown, with no verdict")  # fmt: skip
        gpus = None
    processes = []
    for group, ranks, placed, default, estimate in (
        ("trainer", c.trainer_ranks, c.trainer_gpus, None, trainer),
        ("rollout", c.rollout_ranks, c.rollout_gpus, 0, generator),
    ):  # fmt: skip
        for r in range(ranks):
            gpu = placed[r] if placed else (r if default is None else default)
            total = gpus[gpu] if gpus and gpu < len(gpus) else None
            need = estimate(config, shape, total) if estimate and shape else None
            processes.append(Process(f"{group}:{r}", gpu, need))
    plan = MemoryPlan(processes, gpus, config.model.path, shape, notes,
                      take_turns=c.placement == "take_turns")  # fmt: skip
    if not plan.take_turns:
        return plan
    if c.trainer_offload == "auto":  # offload where the whole state does not fit beside
        offload = gpus is not None and any(  # the plan so far keeps the state: offload False
            plan.turns(g).get("generating", 0) > gpus[g] for g in {p.gpu for p in processes}
            if g < len(gpus))  # fmt: skip
    else:
        offload = c.trainer_offload == "always"
    return dataclasses.replace(plan, offload=offload)
