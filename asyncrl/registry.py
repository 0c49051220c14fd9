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

What a loaded plugin made is checked against its protocol once, when it loads (a backend by
:func:`check_plugin`, an environment by
:func:`asyncrl.env.capabilities.check_environment`, a sampler by
:func:`asyncrl.policy.sampler_choice.make_sampler`), each with :func:`check_members` and an
error in its own words, so that the run calls what it found directly and never probes a
plugin object with ``getattr`` afterwards.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Any

from asyncrl.errors import PluginError

__all__ = [
    "GROUPS",
    "PluginInfo",
    "available",
    "check_members",
    "check_plugin",
    "did_you_mean",
    "install_hint",
    "load",
    "public_names",
    "require",
]

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


def install_hint(group: str, name: str) -> str:
    """The command that installs first-party plugin ``name`` of ``group`` (``""``: not a
    first-party one): what an error about it missing tells the user to run."""
    return _HINTS.get((group, name), "")


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
    hint = install_hint(group, name)
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


# ------------------------------------------------------------------ a plugin object's members
def check_members(
    obj: Any,
    protocol: type,
    *,
    optional: Sequence[type] = (),
    may_lack: Collection[str] = (),
    awaited: str | Mapping[str, str],
    plain: str | Mapping[str, str],
    kinds: Mapping[str, Callable[[str, Any], str]] = MappingProxyType({}),
) -> tuple[dict[str, Any], list[str]]:
    """Check ``obj`` against ``protocol`` and the ``optional`` protocols, once, as it loads.

    Every method and attribute ``protocol`` declares must be present (not ``None``), but those
    named in ``may_lack``; those of ``optional`` may be absent. A missing one gets a
    did-you-mean for the nearest public name ``obj`` has. A method present must be callable
    and ``async def`` exactly where its protocol's is; an attribute present must be what
    ``kinds`` says of it, or without an entry there, not a method.

    Args:
        awaited, plain: why a method must be ``async def``, or must not be, for the message:
            one reason for every method, or one per method name.
        kinds: by attribute name, ``kinds[name](name, value)``: what is wrong with the value
            of a present one (``""``: nothing).

    Returns:
        What may be absent (the members of ``optional`` and ``may_lack``), by name: the bound
        method or the value, ``None`` without one; and what is wrong, each naming the member,
        for the caller's error (which names the plugin and the fix).
    """
    protocols = (protocol, *optional)
    methods = {n: is_async for p in protocols for n, is_async in _methods(p).items()}
    attributes = dict.fromkeys(n for p in protocols for n in _attributes(p))
    needed = {*_methods(protocol), *_attributes(protocol)} - set(may_lack)
    values = {n: getattr(obj, n, None) for n in [*methods, *attributes]}
    spare = public_names(obj, list(values))
    problems = [f"no {'method' if n in methods else 'attribute'} {n!r}{did_you_mean(n, spare)}"
                for n, value in values.items() if value is None and n in needed]  # fmt: skip
    for name, is_async in methods.items():
        method, why = values[name], awaited if is_async else plain
        why = why if isinstance(why, str) else why[name]
        if method is not None and not callable(method):
            problems.append(f"{name!r} is not callable (it is a {type(method).__name__})")
        elif method is not None and is_async != inspect.iscoroutinefunction(method):
            kind = "`async def`" if is_async else "a plain method, not `async def`"
            problems.append(f"{name!r} must be {kind} ({why})")
    for name in attributes:
        value = values[name]
        if value is not None and name in kinds:
            problems.append(kinds[name](name, value))
        elif inspect.ismethod(value) or inspect.isfunction(value):
            problems.append(f"{name!r} must be an attribute, not a method")
    found = {n: v for n, v in values.items() if n not in needed}
    return found, [p for p in problems if p]


def check_plugin(
    backend: Any,
    protocol: type,
    *,
    plugin: str,
    group: str,
    optional: Sequence[type] = (),
    may_lack: Collection[str] = (),
    awaited: str = "the worker awaits it on its event loop",
    plain: str = "it runs in the trainer's thread",
) -> dict[str, Any]:
    """Check a just-created plugin object (a backend, a service) against the protocol of its
    group, once, before it starts (:func:`check_members`): every method ``protocol`` declares present,
    callable, and ``async def`` exactly where the protocol's is; those of the ``optional``
    protocols the same when present, their attributes (:class:`ReadsLossInputs`'s) not methods.
    Checked here rather than on first use, a misspelt method is one error at start-up instead
    of a failed call in the middle of a run, and the runtime calls methods directly instead of
    probing with ``getattr`` on every call.

    Args:
        backend: what the plugin's factory returned.
        protocol: :class:`GenerationBackend` or :class:`TrainingBackend`.
        plugin: the backend's entry point name (``generator.backend`` / ``trainer.backend``).
        group: its entry point group, e.g. ``asyncrl.generation_backends``.
        optional: protocols whose methods the backend may have (:class:`EngineWatch`,
            :class:`KVCalibration`, :class:`ReadsLossInputs`).
        may_lack: members of ``protocol`` it may lack, which the caller checks in its own
            words (a service's ``section``).
        awaited, plain: why a method must be ``async def``, or must not be, in the message
            (a worker's backend's, by default; a service's are the controller's).

    Returns:
        Each optional member by name: the backend's bound method or the attribute's value, or
        ``None`` without one.

    Raises:
        PluginError: naming the plugin, its group and every method that is missing (with a
            did-you-mean for a near name the backend has), not callable, or of the wrong kind.
    """
    found, wrong = check_members(backend, protocol, optional=optional, may_lack=may_lack,
                                 awaited=awaited, plain=plain)  # fmt: skip
    if wrong:
        cls = backend if isinstance(backend, type) else type(backend)
        raise PluginError(
            f"{GROUPS.get(group, group)} {plugin!r} ({group}: {cls.__module__}.{cls.__qualname__})"
            f" does not implement {protocol.__name__}: {'; '.join(wrong)}. Fix: define "
            f"{'them' if len(wrong) > 1 else 'it'} as "
            f"{protocol.__module__}.{protocol.__name__} says"
        )
    return found


def _methods(protocol: type) -> dict[str, bool]:
    """The public methods ``protocol`` declares, each with whether it is ``async def``."""
    return {n: inspect.iscoroutinefunction(fn) for n, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not n.startswith("_")}  # fmt: skip


def _attributes(protocol: type) -> list[str]:
    """The public attributes ``protocol`` declares (annotated names, not methods)."""
    return [n for n in vars(protocol).get("__annotations__", {}) if not n.startswith("_")]


def public_names(obj: Any, known: Sequence[str] = ()) -> list[str]:
    """``obj``'s public names other than ``known``: where a misspelt member would be."""
    return [n for n in dir(obj) if not n.startswith("_") and n not in known]


def did_you_mean(name: str, spare: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the name of ``spare`` nearest ``name``; ``""`` for none."""
    near = difflib.get_close_matches(name, list(spare), n=1, cutoff=0.7)
    return f" (did you mean {near[0]!r}?)" if near else ""
