"""``[pipeline.sampler]``: from the config's table to a sampler (its plugin, its knobs).

The core config carries the table opaquely: its ``name`` picks a plugin of the
``asyncrl.samplers`` group, which converts the other keys to its own struct and builds the
sampler; the config asks the sampler for its capacities and the mode line
(:attr:`asyncrl.config.Config.sampler`). :mod:`asyncrl.config` re-exports :func:`make_sampler`
and :func:`resolve_sampler`.
"""

from __future__ import annotations

import difflib
from typing import Any

import msgspec

from asyncrl import registry

from asyncrl.policy import samplers
from asyncrl.errors import ConfigError, PluginError
from asyncrl.errors import config_error as _fail
from asyncrl.explain import explain

__all__ = ["default_table", "make_sampler", "resolve_sampler"]


def default_table() -> dict[str, Any]:
    """``[pipeline.sampler]`` when a config has none: ``in_order`` with its defaults (async,
    one version of lookahead)."""
    return msgspec.to_builtins(samplers.InOrderConfig())


def _sampler_plugin(name: Any) -> samplers.SamplerPlugin:
    if not isinstance(name, str) or not name:
        raise _fail(
            "pipeline.sampler.name",
            "required but missing" if name is None else f"must be a string, got {name!r}",
            'add it, e.g. name = "in_order" (or "gated", "oversampled", "ready_first"; '
            "docs/modes.md)",
        )
    try:
        plugin = registry.load("asyncrl.samplers", name, "pipeline.sampler.name")
    except PluginError as exc:
        close = difflib.get_close_matches(name, list(registry.available("asyncrl.samplers")), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{exc}. Fix: pick an installed sampler{hint}; docs/modes.md") from None
    if not isinstance(plugin, samplers.SamplerPlugin):
        raise ConfigError(
            f"pipeline.sampler.name: the sampler {name!r} is registered as {plugin!r}, not an "
            "asyncrl.policy.samplers.SamplerPlugin. Fix: point its entry point at a SamplerPlugin"
        )
    return plugin


def resolve_sampler(table: Any) -> msgspec.Struct:
    """``[pipeline.sampler]`` as its sampler's own config struct (a struct passes through).

    Raises:
        ConfigError: no ``name``, an unknown sampler, or a knob it does not have or of the
            wrong type (named as ``pipeline.sampler.<knob>``).
    """
    if isinstance(table, msgspec.Struct):
        return table
    if not isinstance(table, dict):
        raise _fail(
            "pipeline.sampler",
            f"must be a table, got {table!r}",
            'write [pipeline.sampler] with name = "in_order" and its knobs',
        )
    plugin = _sampler_plugin(table.get("name"))
    try:
        return msgspec.convert(table, plugin.config)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, plugin.config, "pipeline.sampler")) from None


def make_sampler(table: Any) -> Any:
    """Build the sampler ``[pipeline.sampler]`` names (a :class:`~asyncrl.policy.samplers.Sampler`).

    Raises:
        ConfigError: as :func:`resolve_sampler`, a knob value the sampler refuses, or a
            sampler that does not implement the protocol (:func:`_check_sampler`).
    """
    struct = resolve_sampler(table)
    tag = msgspec.inspect.type_info(type(struct)).tag
    plugin = _sampler_plugin(tag)
    try:
        sampler = plugin.create(struct)
    except ValueError as exc:
        raise ConfigError(f"pipeline.sampler.{exc}") from None
    _check_sampler(sampler, str(tag))
    return sampler


_ATTRIBUTE_KINDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "max_staleness": (int,),
    "over_dispatch": (int, float),
}
"""What each attribute :class:`~asyncrl.policy.samplers.Sampler` declares must be."""


def _check_sampler(sampler: Any, name: str) -> None:
    """Check a just-made sampler against :class:`~asyncrl.policy.samplers.Sampler` and its
    optional protocols (:class:`~asyncrl.policy.samplers.DescribesMode`,
    :class:`~asyncrl.policy.samplers.DecidesInFlight`), once, when it is made
    (:func:`asyncrl.registry.check_members`): every method present, callable and a plain
    method; every attribute of its kind; the optional ones, when present, the same (the
    in-flight choice one of the known ones).

    Raises:
        ConfigError: naming ``pipeline.sampler.name``, the sampler and every member that is
            missing (with a did-you-mean), not callable, or of the wrong kind.
    """
    why = "the scheduler calls it on the controller's event loop"
    _, problems = registry.check_members(
        sampler, samplers.Sampler, optional=(samplers.DescribesMode, samplers.DecidesInFlight),
        awaited=why, plain=why, kinds=dict.fromkeys(_ATTRIBUTE_KINDS, _kind_problem),
    )  # fmt: skip
    cls = type(sampler)
    if problems:
        raise ConfigError(
            f"pipeline.sampler.name: the sampler {name!r} ({cls.__module__}.{cls.__qualname__}) "
            f"does not implement asyncrl.policy.samplers.Sampler: {'; '.join(problems)}. Fix: "
            f"define {'them' if len(problems) > 1 else 'it'} as the protocol says"
        )
    samplers.in_flight_at_refit(sampler)  # DecidesInFlight: a choice it knows, or a ConfigError


def _kind_problem(attr: str, value: Any) -> str:
    kinds = _ATTRIBUTE_KINDS[attr]
    if isinstance(value, bool) or not isinstance(value, kinds):
        return f"{attr!r} must be a {' or '.join(k.__name__ for k in kinds)}, got {value!r}"
    return ""
