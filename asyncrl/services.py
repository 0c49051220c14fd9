"""Services: optional parts served on the controller's loop beside the run's own loops, found
through the entry-point group ``asyncrl.services`` like every other plugin. The
OpenAI-compatible gateway (``plugins/asyncrl-gateway``, ``[gateway] enabled = true``) is one.

A service owns its section of the run config: the top-level table of its entry point's name
(``[gateway]``), which the loader converts to the service's :attr:`Service.section` struct,
checks with the core's sections and keeps in ``config.services`` (docs/plugins.md, "A
service's section"). The core names no service: a run without the table never imports it.

A service may stand in front of the run's environment: the gateway's sessions are the run's
episodes, their turns the calls of an agent program. The controller asks a service three
things, in this order::

    service = load_service("gateway", "gateway.enabled")  # imported and checked once
    await service.check(config, environment, tokenizer)    # preflight: before any process
    served = service.build(config, environment, tokenizer) # when the run's loops are built
    environment = served.environment                       # the episodes come from here
    await task_group.start(served.serve)                   # lives as long as the run

Which services a run has is read from its config (:func:`enabled_services`): those whose
section's ``enabled`` is true.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self

import msgspec

from asyncrl import plugins
from asyncrl.plugins import check_plugin
from asyncrl.config.section import Section
from asyncrl.environment import Environment
from asyncrl.errors import ConfigError, PluginError

__all__ = [
    "GROUP", "NamesHarmless", "ResolvesPaths", "SectionSpec", "Served", "Service",
    "ServiceSection", "enabled_services", "harmless_keys", "load_section", "load_service",
]  # fmt: skip

GROUP = "asyncrl.services"


class Served(Protocol):
    """A service built for one run."""

    environment: Environment
    """Where the run's episodes come from: the run's environment, or one the service puts in
    front of it (the gateway's sessions)."""
    episode_deadline_s: float | None
    """Each episode's deadline, in place of ``episode.deadline_s`` (``None``: that one). The
    gateway's is infinite: a session waits on an agent program, which has deadlines of its own."""

    async def serve(self, *, task_status: Any = ...) -> None:
        """Serve until cancelled; ``task_status.started()`` once clients can connect."""


class Service(Protocol):
    """What an entry point of ``asyncrl.services`` names."""

    section: type
    """The service's config section: a :class:`~asyncrl.config.section.Section` subclass with
    what :class:`ServiceSection` declares (and optionally :class:`ResolvesPaths` and
    :class:`NamesHarmless`). The run's table named as the entry point (``[gateway]``) is
    converted to it; ``config.services[name]`` holds the result."""

    async def check(self, config: Any, environment: Environment, tokenizer: Any) -> None:
        """Everything the service needs of the run, checked before any process or file
        exists; a mistake is a ``ConfigError`` naming its field."""

    def build(self, config: Any, environment: Environment, tokenizer: Any) -> Served:
        """The service for this run, around the run's ``environment``; not yet serving."""


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


@dataclass(frozen=True)
class SectionSpec:
    """A service's section as checked when the service loaded: what the loader and the resume
    rule use of it, so that neither looks at the plugin's class again."""

    type: type[Section]
    """The struct the service's table is converted to."""
    harmless: tuple[str, ...]
    """Its :attr:`NamesHarmless.HARMLESS` (``()`` without one)."""
    resolve_paths: Callable[[Any, Path], Any] | None
    """Its :meth:`ResolvesPaths.resolve_paths` (unbound: called with the section), or
    ``None`` without one."""


def enabled_services(config: Any) -> list[str]:
    """The services ``config`` switches on, by entry point name (their section's name)."""
    return [name for name, section in config.services.items() if section.enabled]


def harmless_keys(config: Any) -> list[str]:
    """``<name>.<key>`` for each key the sections of ``config``'s services name harmless (for
    :func:`asyncrl.checkpoints.resume_rule.compare`); the services are loaded already, the
    config having been built with them."""
    return [f"{name}.{key}" for name in config.services
            for key in load_section(name, name).harmless]  # fmt: skip


def load_service(name: str, field: str) -> Service:
    """Import service ``name`` and check it against :class:`Service`, once.

    Raises:
        PluginError: not installed (naming ``field`` and how to install it), failed to import,
            a method missing or of the wrong kind (naming the plugin and the method), or a
            section that is not one (:func:`load_section`).
    """
    return _load(name, field)[0]


def load_section(name: str, field: str) -> SectionSpec:
    """Import service ``name`` (checked as :func:`load_service` does) and return its
    section: its struct, its harmless keys and its path resolver.

    Raises:
        PluginError: as :func:`load_service`; and a section that is no
            :class:`~asyncrl.config.section.Section` subclass, has no ``enabled: bool =
            False``, no ``problems()``, a ``resolve_paths`` or ``HARMLESS`` of the wrong
            kind, each naming the plugin and the fix.
    """
    return _load(name, field)[1]


def _load(name: str, field: str) -> tuple[Service, SectionSpec]:
    service = plugins.load(GROUP, name, field)
    found = check_plugin(service, Service, plugin=name, group=GROUP, may_lack=("section",),
                          awaited="the controller awaits it on its event loop",
                          plain="the controller calls it as it builds the run's loops")  # fmt: skip
    return service, _check_section(service, found["section"], name)


def _check_section(service: Any, section: Any, name: str) -> SectionSpec:
    """``service``'s ``section``, checked against :class:`ServiceSection` (and the optional
    :class:`ResolvesPaths` and :class:`NamesHarmless`) once, as it loads."""
    cls = service if isinstance(service, type) else type(service)
    where = f"{plugins.GROUPS[GROUP]} {name!r} ({GROUP}: {cls.__module__}.{cls.__qualname__})"
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
                          optional=(ResolvesPaths, NamesHarmless),
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
    return SectionSpec(section, harmless, found["resolve_paths"])
