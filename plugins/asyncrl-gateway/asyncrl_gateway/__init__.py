"""The OpenAI-compatible gateway as an asyncrl service (entry point ``asyncrl.services:gateway``,
switched on by ``[gateway] enabled = true``): each session is one of the run's episodes, its
turns the chat-completion calls of an agent program (docs/gateway.md).

The rooms: ``config`` (``[gateway]``, the plugin's own section of the run config),
``gateway`` (the sessions as the run's multi-turn environment), ``sessions`` (keys, the
lobby, what passes between an HTTP call and its episode), ``conversation`` (a session as the
agent sees it against what was recorded), ``schema`` and ``replies`` (the OpenAI wire
format), ``server`` and ``connections`` (HTTP: Starlette on uvicorn, as a task of the
controller, and what one connection may hold), ``agents``, ``agent_command`` and
``agent_shim`` (managed agent programs, one per session).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import anyio

from asyncrl.plugin.environment import Environment
from asyncrl_gateway.config import GatewayConfig, gateway_config

__all__ = ["SERVICE", "GatewayService", "ServedGateway"]


@dataclass(frozen=True)
class ServedGateway:
    """The gateway built for one run (:class:`asyncrl.plugin.service.Served`)."""

    environment: Any
    """The :class:`~asyncrl_gateway.gateway.Gateway`: the run's episodes are its sessions."""
    server: Any
    """Its :class:`~asyncrl_gateway.server.GatewayServer`."""
    episode_deadline_s: float | None = math.inf
    """A session waits on its agent program, which keeps deadlines of its own."""

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        await self.server.serve(task_status=task_status)


class GatewayService:
    """:class:`asyncrl.plugin.service.Service` for the gateway."""

    section = GatewayConfig
    """``[gateway]``, the plugin's own section of the run config."""

    async def check(self, config: Any, environment: Environment, tokenizer: Any) -> None:
        from asyncrl_gateway.agent_command import check_agent
        from asyncrl_gateway.gateway import check_gateway

        check_gateway(config, environment, tokenizer)
        # runs it once (bounded): a broken command stops here
        await check_agent(gateway_config(config))

    def build(self, config: Any, environment: Environment, tokenizer: Any) -> ServedGateway:
        from asyncrl_gateway.server import build_gateway

        gateway, server = build_gateway(config, environment, tokenizer=tokenizer)
        return ServedGateway(environment=gateway, server=server)


SERVICE = GatewayService()
"""The entry point ``asyncrl.services:gateway``."""
