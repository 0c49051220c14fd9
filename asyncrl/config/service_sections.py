"""A service's section of the run config (:mod:`asyncrl.services`): what its struct must have,
checked once as the service loads, and what the loader and the resume rule use of it.

A service owns the top-level table of its entry point's name (``[gateway]``): the loader
(:mod:`asyncrl.config.loading`) imports only the services whose tables a config has, asks each
for its section here (:func:`load_section`), converts the table to it and keeps the result in
``config.services``. This sits with the config, below :mod:`asyncrl.services` (the service's
run-time contract), so that reading a config never needs the controller's side of a service.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, Self

import msgspec

from asyncrl import registry
from asyncrl.config.removed import Removed
from asyncrl.config.section import Section
from asyncrl.errors import ConfigError, PluginError
from asyncrl.registry import check_plugin

__all__ = [
    "GROUP", "NamesHarmless", "NamesRemoved", "ResolvesPaths", "SectionSpec", "ServiceSection",
    "harmless_keys", "load_section", "removed_keys", "section_of",
]  # fmt: skip

GROUP = "asyncrl.services"
"""The entry-point group of services (:mod:`asyncrl.services`)."""


class _HasSection(Protocol):
    section: type
    """The service's section struct (:class:`ServiceSection`)."""


class ServiceSection(Protocol):
    """What a service's section struct has (besides being a frozen msgspec Struct that
    refuses unknown keys, as every :class:`~asyncrl.config.section.Section` is)."""

    enabled: bool
    """A field ``enabled: bool = False``: ``[<name>] enabled = true`` switches the service
    on; a run without the table, or with it off, does not have the service."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of the section, each naming its field as
        ``<name>.<field>`` and the fix; gathered with the core's by
        :func:`asyncrl.config.problems`."""


class ResolvesPaths(Protocol):
    """Optional, for a section that holds paths."""

    def resolve_paths(self, base_dir: Path) -> Self:
        """The section with its relative paths made absolute against ``base_dir`` (the
        config file's directory), as the loader does the core's paths."""


class NamesHarmless(Protocol):
    """Optional: what a resumed run may change of the section."""

    HARMLESS: ClassVar[tuple[str, ...]]
    """Its keys (field names, or ``field.key`` below one) a run resumed from a checkpoint
    may change, each change only logged (:mod:`asyncrl.checkpoints.resume_rule`); every other
    key of an enabled service must match the checkpoint's unless allowed by name."""


class NamesRemoved(Protocol):
    """Optional: the keys the section had once, and what replaced them."""

    REMOVED: ClassVar[Mapping[str, Removed]]
    """By its former key's name (without the section's, ``max_tools`` of ``[gateway]``), what
    replaced it (:class:`asyncrl.config.removed.Removed`, ``became_constant(...)`` for one
    that became a module constant): a config that still sets one is refused naming it and the
    fix, as a removed key of the core's is; a checkpoint that stored one resumes, the key
    dropped, and a value other than its ``default`` logged (:mod:`asyncrl.config.removed`).
    No name of it may be a field's."""


@dataclass(frozen=True)
class SectionSpec:
    """A service's section as checked when the service loaded: what the loader and the resume
    rule use of it, so that neither looks at the plugin's class again."""

    type: type[Section]
    """The struct the service's table is converted to."""
    harmless: tuple[str, ...]
    """Its :attr:`NamesHarmless.HARMLESS` (``()`` without one)."""
    removed: Mapping[str, Removed]
    """Its :attr:`NamesRemoved.REMOVED`, by the key's name without the section's (empty
    without one)."""
    resolve_paths: Callable[[Any, Path], Any] | None
    """Its :meth:`ResolvesPaths.resolve_paths` (unbound: called with the section), or
    ``None`` without one."""


def harmless_keys(config: Any) -> list[str]:
    """``<name>.<key>`` for each key the sections of ``config``'s services name harmless (for
    :func:`asyncrl.checkpoints.resume_rule.compare`); the services are loaded already, the
    config having been built with them."""
    return [f"{name}.{key}" for name in config.services
            for key in load_section(name, name).harmless]  # fmt: skip


def removed_keys(config: Any) -> dict[str, Removed]:
    """By ``<name>.<key>``, each key the sections of ``config``'s services name removed (for
    :func:`asyncrl.checkpoints.resume_rule.compare`, as :func:`harmless_keys`)."""
    return {f"{name}.{key}": entry for name in config.services
            for key, entry in load_section(name, name).removed.items()}  # fmt: skip


def load_section(name: str, field: str) -> SectionSpec:
    """Import service ``name`` and return its section, checked: its struct, its harmless
    keys, its removed keys and its path resolver. The rest of the service's contract is
    checked when the controller loads it to run it (:func:`asyncrl.services.load_service`).

    Raises:
        PluginError: not installed (naming ``field`` and how to install it), failed to
            import, or a section that is no :class:`~asyncrl.config.section.Section`
            subclass, has no ``enabled: bool = False``, no ``problems()``, a
            ``resolve_paths``, ``HARMLESS`` or ``REMOVED`` of the wrong kind, each naming the
            plugin and the fix.
    """
    return section_of(registry.load(GROUP, name, field), name)


def section_of(service: Any, name: str) -> SectionSpec:
    """``service``'s ``section``, checked against :class:`ServiceSection` (and the optional
    :class:`ResolvesPaths`, :class:`NamesHarmless` and :class:`NamesRemoved`) once, as it
    loads."""
    section = check_plugin(service, _HasSection, plugin=name, group=GROUP,
                           may_lack=("section",))["section"]
    cls = service if isinstance(service, type) else type(service)
    where = f"{registry.GROUPS[GROUP]} {name!r} ({GROUP}: {cls.__module__}.{cls.__qualname__})"
    if not (isinstance(section, type) and issubclass(section, Section)):
        raise PluginError(
            f"{where} has no config section: its `section` is {section!r}. Fix: set the "
            "class attribute `section` to the struct of its settings, a subclass of "
            "asyncrl.plugin.service.Section with a field `enabled: bool = False` "
            "(docs/plugins.md, \"A service's section\")"
        )
    fields = {f.name: f for f in msgspec.structs.fields(section)}
    enabled = fields.get("enabled")
    if enabled is None or enabled.type is not bool or enabled.default is not False:
        got = "has no field `enabled`" if enabled is None else (
            f"has `enabled: {getattr(enabled.type, '__name__', enabled.type)} = "
            f"{enabled.default!r}`")  # fmt: skip
        raise PluginError(
            f"{where}: its section {section.__module__}.{section.__qualname__} {got}. Fix: "
            f"give it the field `enabled: bool = False` ([{name}] enabled = true switches the "
            "service on; a run without the table must not have it)"
        )
    found = check_plugin(section, ServiceSection, plugin=name, group=GROUP,
                          optional=(ResolvesPaths, NamesHarmless, NamesRemoved),
                          awaited="the loader calls it as it reads the config",
                          plain="the loader calls it as it reads the config")  # fmt: skip
    harmless = found["HARMLESS"] if found["HARMLESS"] is not None else ()
    if not (isinstance(harmless, tuple) and all(
        isinstance(key, str) and key.partition(".")[0] in fields for key in harmless
    )):
        raise PluginError(
            f"{where}: its section's HARMLESS is {harmless!r}, not a tuple of its keys. Fix: "
            f"list the field names of {section.__qualname__} a resumed run may change "
            f"(keys: {', '.join(fields)})"
        )
    removed = found["REMOVED"] if found["REMOVED"] is not None else {}
    if not (isinstance(removed, Mapping) and all(
        isinstance(key, str) and key and "." not in key and key not in fields
        and isinstance(entry, Removed) for key, entry in removed.items()
    )):
        raise PluginError(
            f"{where}: its section's REMOVED is {removed!r}, not a mapping of keys it no longer "
            "has to what replaced them. Fix: map each former key's name (no field of "
            f"{section.__qualname__}, without the section's name) to an "
            "asyncrl.plugin.service.Removed (docs/plugins.md, \"A service's section\")"
        )
    return SectionSpec(section, harmless, MappingProxyType(dict(removed)),
                       found["resolve_paths"])  # fmt: skip
