"""The plugin API for services (an ``asyncrl.services`` entry point): parts served on the
controller's loop beside the run's own, which may stand in front of the run's environment
(the OpenAI-compatible gateway, ``plugins/asyncrl-gateway``). A service in front of the
environment also imports :mod:`asyncrl.plugin.environment`.

- ``Service``: the protocol: its config ``section``, ``check`` (the preflight) and ``build``
  (one run's service).
- ``Served``: a service built for one run: the environment episodes come from, their deadline,
  and ``serve``.
- ``Section``: the base of a service's config section (frozen, keyword-only, unknown keys
  refused): subclass it with ``enabled: bool = False`` and ``problems()``, and optionally
  ``resolve_paths(base_dir)``, ``HARMLESS`` and ``REMOVED`` (docs/plugins.md, "A service's
  section").
- ``Removed``: what replaced a key the section no longer has, an entry of its ``REMOVED``
  (the key's default, what replaced it, why).
- ``became_constant``: the ``Removed`` of a key that became a module constant, named by its
  dotted path (``became_constant("pkg.mod.NAME", default, why)``).
- ``fail``: a ``ConfigError`` for one of the section's fields, ``<field>: <problem>. Fix:
  <fix>.``, what ``problems()`` returns.
"""

from __future__ import annotations

from asyncrl.config.removed import Removed, became_constant
from asyncrl.config.section import Section, fail
from asyncrl.services import Served, Service

__all__ = ["Removed", "Section", "Served", "Service", "became_constant", "fail"]
