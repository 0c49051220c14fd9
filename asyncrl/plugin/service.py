"""The plugin API for services (an ``asyncrl.services`` entry point): parts served on the
controller's loop beside the run's own, which may stand in front of the run's environment
(the OpenAI-compatible gateway, ``plugins/asyncrl-gateway``). A service in front of the
environment also imports :mod:`asyncrl.plugin.environment`.

- ``Service``: the protocol: ``check`` (the preflight) and ``build`` (one run's service).
- ``Served``: a service built for one run: the environment episodes come from, their deadline,
  and ``serve``.
- ``GatewayConfig``: the run config's ``[gateway]`` section (``config.gateway``).
"""

from __future__ import annotations

from asyncrl.config.gateway import GatewayConfig
from asyncrl.services import Served, Service

__all__ = ["GatewayConfig", "Served", "Service"]
