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

from typing import Any, Protocol

from asyncrl import registry
from asyncrl.config.service_sections import GROUP, section_of
from asyncrl.environment import Environment
from asyncrl.registry import check_plugin

__all__ = ["GROUP", "Served", "Service", "enabled_services", "load_service"]


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
    what :class:`~asyncrl.config.service_sections.ServiceSection` declares (and optionally
    ``ResolvesPaths`` and ``NamesHarmless`` there). The run's table named as the entry point (``[gateway]``) is
    converted to it; ``config.services[name]`` holds the result."""

    async def check(self, config: Any, environment: Environment, tokenizer: Any) -> None:
        """Everything the service needs of the run, checked before any process or file
        exists; a mistake is a ``ConfigError`` naming its field."""

    def build(self, config: Any, environment: Environment, tokenizer: Any) -> Served:
        """The service for this run, around the run's ``environment``; not yet serving."""


def enabled_services(config: Any) -> list[str]:
    """The services ``config`` switches on, by entry point name (their section's name)."""
    return [name for name, section in config.services.items() if section.enabled]


def load_service(name: str, field: str) -> Service:
    """Import service ``name`` and check it against :class:`Service`, once.

    Raises:
        PluginError: not installed (naming ``field`` and how to install it), failed to import,
            a method missing or of the wrong kind (naming the plugin and the method), or a
            section that is not one
            (:func:`~asyncrl.config.service_sections.section_of`).
    """
    service = registry.load(GROUP, name, field)
    check_plugin(service, Service, plugin=name, group=GROUP, may_lack=("section",),
                 awaited="the controller awaits it on its event loop",
                 plain="the controller calls it as it builds the run's loops")  # fmt: skip
    section_of(service, name)
    return service
