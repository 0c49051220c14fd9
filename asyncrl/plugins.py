"""Plugin registry over Python entry points.

=============================== ===================== ===========================================
group                           loaded in             the entry point names
=============================== ===================== ===========================================
``asyncrl.generation_backends`` controller (check) +  a :class:`~asyncrl.backend.BackendPlugin`
                                rollout workers       (or a bare factory) making a
                                                      :class:`~asyncrl.backend.GenerationBackend`
``asyncrl.training_backends``   controller (check) +  a :class:`~asyncrl.backend.BackendPlugin`
                                trainer workers       (or a bare factory) making a
                                                      :class:`~asyncrl.backend.TrainingBackend`
``asyncrl.environments``        controller            ``factory(options: dict, seed: int)``
                                                      returning an
                                                      :class:`~asyncrl.environment.Environment`
``asyncrl.samplers``            controller (config    a :class:`~asyncrl.policy.samplers.SamplerPlugin`
                                validation + run)     (its config struct and a factory)
``asyncrl.weight_transfers``    trainer rank 0 +      a :class:`~asyncrl.transfers.WeightTransfer`
                                the process that      (the sender's staging buffers and the
                                loads weights         reader's opener)
``asyncrl.metrics_sinks``       controller (check +   a :class:`~asyncrl.sinks.SinkPlugin` (or a
                                the run's metrics     bare factory ``make(options, *, run_dir,
                                writer)               run_name, run_id)``) making a
                                                      :class:`~asyncrl.sinks.Sink`
``asyncrl.tool_parsers``        controller (the       a :class:`~asyncrl.env.tool_parsers.ToolCallParser`
                                episodes that parse   (or a class making one with no arguments)
                                tool calls)           reading the tool calls in a turn's text
``asyncrl.services``            controller (check +   a :class:`~asyncrl.services.Service`: a part
                                served beside the     served on the controller's loop, which may
                                run's loops)          stand in front of the environment (the
                                                      gateway)
=============================== ===================== ===========================================

Only groups something loads are listed; reward functions get their group when they become
plugins.

Names are discovered from installed distributions' metadata; the target is imported only on
first use. A missing name, a name registered twice, or a target that fails to import raises
:class:`~asyncrl.errors.PluginError` with an install hint: a missing backend must never
silently change a run. ``ASYNCRL_PLUGINS`` (comma-separated ``group:name`` or ``name``) is an
optional allowlist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Any

from asyncrl.errors import PluginError

__all__ = ["GROUPS", "PluginInfo", "available", "load", "require"]

GROUPS = MappingProxyType(
    {
        "asyncrl.generation_backends": "generation backend",
        "asyncrl.training_backends": "training backend",
        "asyncrl.environments": "environment",
        "asyncrl.samplers": "sampler",
        "asyncrl.weight_transfers": "weight transfer",
        "asyncrl.metrics_sinks": "metrics sink",
        "asyncrl.tool_parsers": "tool-call parser",
        "asyncrl.services": "service",
    }
)

_HINTS = {
    ("asyncrl.generation_backends", "vllm"): "pip install -e backends/asyncrl-vllm[cpu]",
    ("asyncrl.training_backends", "fsdp2"): "pip install -e backends/asyncrl-fsdp",
    ("asyncrl.training_backends", "deepspeed"): "pip install -e backends/asyncrl-deepspeed",
    ("asyncrl.weight_transfers", "cuda_ipc"): "pip install -e backends/asyncrl-torch",
    ("asyncrl.weight_transfers", "nccl"): "pip install -e backends/asyncrl-torch",
    ("asyncrl.environments", "arithmetic"): "pip install -e plugins/asyncrl-arith",
    ("asyncrl.services", "gateway"): "pip install -e plugins/asyncrl-gateway",
    ("asyncrl.metrics_sinks", "tensorboard"): "pip install -e 'plugins/asyncrl-trackers[tensorboard]'",
    ("asyncrl.metrics_sinks", "wandb"): "pip install -e 'plugins/asyncrl-trackers[wandb]'",
    ("asyncrl.metrics_sinks", "mlflow"): "pip install -e 'plugins/asyncrl-trackers[mlflow]'",
}


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    value: str
    distribution: str
    version: str


def _allowed(group: str, name: str) -> bool:
    allow = os.environ.get("ASYNCRL_PLUGINS")
    if not allow:
        return True
    items = {item.strip() for item in allow.split(",") if item.strip()}
    return name in items or f"{group}:{name}" in items


def _entry_points(group: str) -> list[EntryPoint]:
    if group not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; known groups: {', '.join(GROUPS)}")
    return [ep for ep in entry_points(group=group) if _allowed(group, ep.name)]


def available(group: str) -> dict[str, PluginInfo]:
    """Every plugin registered in ``group``, by name (nothing is imported)."""
    found: dict[str, PluginInfo] = {}
    for ep in _entry_points(group):
        dist = ep.dist
        info = PluginInfo(
            group, ep.name, ep.value, dist.name if dist else "?", dist.version if dist else "?"
        )
        if ep.name in found and found[ep.name].value != ep.value:
            other = found[ep.name]
            raise PluginError(
                f"{GROUPS[group]} {ep.name!r} is registered twice: by {other.distribution} "
                f"({other.value}) and by {info.distribution} ({info.value}); uninstall one"
            )
        found[ep.name] = info
    return found


def require(group: str, name: str, field: str | None = None) -> PluginInfo:
    """Check that ``name`` is installed in ``group`` without importing it (used before any
    worker is spawned, so a typo in ``field`` fails fast).

    Raises:
        PluginError: naming ``field`` (when given), what is installed, and how to install
            ``name``.
    """
    plugins = available(group)
    if name in plugins:
        return plugins[name]
    hint = _HINTS.get((group, name))
    known = ", ".join(sorted(plugins)) or "none"
    msg = f"no {GROUPS[group]} named {name!r} is installed (installed: {known})"
    if field:
        msg = f"{field}: {msg}"
    raise PluginError(msg + (f"; install it with: {hint}" if hint else ""))


def load(group: str, name: str, field: str | None = None) -> Any:
    """Import and return the object registered as ``name`` in ``group``.

    Raises:
        PluginError: not registered (naming ``field`` and with an install hint), registered
            twice, or the import failed (the original error is chained).
    """
    require(group, name, field)
    for ep in _entry_points(group):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as exc:
                where = f"{field}: " if field else ""
                raise PluginError(
                    f"{where}{GROUPS[group]} {name!r} ({ep.value}) failed to import: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
    raise AssertionError("unreachable")
