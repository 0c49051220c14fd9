"""``[gateway]``: the gateway's section of the run config (docs/gateway.md), which this plugin
owns as every service owns its own (docs/plugins.md, "A service's section").

The loader converts the run's ``[gateway]`` table to :class:`GatewayConfig` (importing this
plugin only when the table is there), resolves its paths (:meth:`GatewayConfig.resolve_paths`)
and gathers its checks (:meth:`GatewayConfig.problems`) with the core's; the section is then
``config.services["gateway"]``, read through :func:`gateway_config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import msgspec

from asyncrl.plugin.common import Config, ConfigError
from asyncrl.plugin.service import Removed, Section, became_constant, fail

__all__ = ["GatewayConfig", "gateway_config"]

_GUARD = "a defence against broken or hostile clients, not a decision of a run"


def gateway_config(config: Config) -> GatewayConfig:
    """The run's ``[gateway]`` section (its defaults, switched off, for a run without the
    table): the one place the plugin looks it up in ``config.services``."""
    section = config.services.get("gateway")
    return section if section is not None else GatewayConfig()


class GatewayConfig(Section):
    """The gateway's settings; ``enabled`` switches the service on."""

    HARMLESS: ClassVar[tuple[str, ...]] = (
        "host", "port", "keep_agent_logs", "idle_timeout_s", "agent_dir", "max_agents",
        "check_agent", "claim_timeout_s", "max_request_tokens",
    )  # fmt: skip
    """What a resumed run may change (docs/checkpointing.md): where the gateway listens, how
    it runs its agents and how it guards itself. What it trains on (the agent's command and
    environment, a session's whole deadline) is not here."""

    REMOVED: ClassVar[Mapping[str, Removed]] = {
        # issue 50: the guards of asyncrl_gateway.server (a test passes its own Guards), named
        # as text: importing the server would pull uvicorn into reading a config
        "max_concurrent_requests": became_constant(
            "asyncrl_gateway.server.MAX_CONCURRENT_REQUESTS", 4096, _GUARD
        ),
        "max_body_bytes": became_constant(
            "asyncrl_gateway.server.MAX_BODY_BYTES", 4 * 1024 * 1024, _GUARD
        ),
        "max_json_values": became_constant(
            "asyncrl_gateway.server.MAX_JSON_VALUES", 131072, _GUARD
        ),
        "max_messages": became_constant("asyncrl_gateway.server.MAX_MESSAGES", 2048, _GUARD),
        "max_tools": became_constant("asyncrl_gateway.server.MAX_TOOLS", 128, _GUARD),
        "request_head_timeout_s": became_constant(
            "asyncrl_gateway.server.REQUEST_HEAD_TIMEOUT_S", 10.0, _GUARD
        ),
        "request_body_timeout_s": became_constant(
            "asyncrl_gateway.server.REQUEST_BODY_TIMEOUT_S", 30.0, _GUARD
        ),
        "keep_alive_timeout_s": became_constant(
            "asyncrl_gateway.server.KEEP_ALIVE_TIMEOUT_S", 30.0, _GUARD
        ),
        "max_connections": became_constant(
            "asyncrl_gateway.server.MAX_CONNECTIONS", 8192, _GUARD
        ),
        "model_name": Removed(
            "", "the model directory's name, in /v1/models and in every response",
            "a request may name any model, so an agent that hard-codes one works as it is",
        ),
    }  # fmt: skip
    """Its keys that are no more (docs/plugins.md, "A service's section"): a config that sets
    one is refused naming what replaced it; a checkpoint that stored one resumes."""

    enabled: bool = False
    """Serve the run's episodes as sessions of an OpenAI-compatible endpoint: each episode is
    one agent's conversation, its calls recorded token-exact and trained with the reward the
    session ends with. Turn it on to train an agent program that calls an OpenAI-compatible API."""
    host: str = "127.0.0.1"
    """The address to listen on. Anything but a loopback address exposes the gateway to the
    network (every call still needs a key). Set another address only for agents on other
    machines."""
    port: int = 0
    """The port (``0``: a free one, written to ``<run.output_dir>/gateway.json``). Set a fixed
    port when agents cannot read ``gateway.json``."""
    agent: list[str] = []
    """The managed agent: a command (argv) the controller runs once per session, with
    ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set for it and the prompt as JSON on its stdin;
    the environment's ``score(prompt, completion)`` scores its last answer when it exits 0.
    Empty: agents call in by themselves (``POST /rl/sessions`` with the admin key). Set it to
    have the controller start an agent per session."""
    agent_env: dict[str, str] = {}
    """More environment variables for the managed agent. Set what your agent needs (its tools'
    keys, its settings)."""
    agent_dir: str = ""
    """The managed agent's working directory (``""``: the config file's directory; a relative
    path is taken from there), and what ``gateway.agent`` is resolved against: a first word
    ``python`` or ``python3`` is the run's own interpreter (the one ``asyncrl`` runs in, its
    virtualenv's, whatever ``PATH`` says); a first word with a ``/`` in it (``./agent.sh``)
    is a path from this directory; any other first word is looked up on ``PATH``. The other
    arguments are passed as written, and a relative path among them (``agent.py``) is found
    from this directory since the agent runs in it: so ``["python", "agent.py"]`` beside the
    config file runs the same whatever directory the run was started from. (Arguments are not
    rewritten into absolute paths: an argument that only looks like a file, a model or a mode
    name, keeps its meaning.)"""
    max_agents: int = 0
    """Managed agents running at once; a session beyond it waits for one to end before its
    agent starts (its deadlines start with its agent). ``0``: 4 per CPU core this process
    may use (``os.sched_getaffinity``; :meth:`agents_at_once`). An agent is a process start
    (about 1 s of CPU for one that imports ``openai``) and then mostly a wait for the model,
    so a few per core keep the cores busy without a long queue for them: 64 sessions of
    such agents on 2 cores held the controller's loop lag p99 at 12 ms with 8 at once,
    against 203 ms (and a load of 55) with all 64, for 30% fewer sessions a second
    (docs/gateway.md, "Managed agents"). Raise it for agents that wait long on the model
    (turns of seconds) or do little of their own."""
    check_agent: bool = True
    """Check the managed agent's command before the run starts (and in ``asyncrl
    check-config``), once, within 30 s: its program is found; a Python agent's script (or
    ``-m`` module) is found and the modules its script imports at the top resolve in the
    interpreter that runs it; any other command must answer ``--help`` with exit code 0.
    Turn it off only for a program that cannot answer ``--help``."""
    keep_agent_logs: bool = False
    """Keep every managed agent's output (``<run.output_dir>/logs/agents/``); by default only
    those of agents that did not exit 0 are kept. Turn it on to read what successful agents did
    too."""
    session_timeout_s: float = 600.0
    """A session's whole deadline, from the moment it is handed out: past it the session
    ends truncated (``episode.on_truncation``) and a managed agent is killed. Raise it for
    agents that run longer."""
    claim_timeout_s: float = 20.0
    """Longest wait for the first model call of a session taken with ``POST /rl/sessions``:
    past it the session is offered again (to the next ``POST /rl/sessions``, under a new id
    and key; the old ones get 410). Nothing was recorded yet, so the group's samples are
    as if the second agent had taken it first, and the group does not run again. 20 s: an
    agent's first call follows the 201 at once (the prompt comes with it), so this leaves a
    loaded machine and a client's retries time while a dropped session holds its group
    (and, under a staleness bound of 1, the pipeline) 20 s rather than
    ``idle_timeout_s``. Raise it for an agent that prepares something (a sandbox, a
    repository) before its first call. Managed agents (``gateway.agent``) are not subject
    to it: their exit is seen at once."""
    idle_timeout_s: float = 120.0
    """Longest wait between two calls of a session, or from its last call to its reward (the
    agent's tools and its own work run in between): past it the session fails (its agent
    went away) and its group runs again under ``[failures]``. Raise it for agents whose tools or
    own work take longer between calls."""
    max_request_tokens: int = 0
    """Most tokens a call's conversation may come to as the engine would get it (templated
    and encoded): past it the call gets 400 (``context_length_exceeded``) and the session
    ends truncated, as when it fills ``episode.max_context_tokens``. Counted once it is
    encoded (off the event loop for a request of 64 KiB or more), before the engine is
    asked; a text completion's prompt of token ids is counted before anything else, and a
    big request's one message far longer than this (or the context) allows is counted on a
    prefix before it is templated (docs/gateway.md). ``0``: no limit but the context. Set it to
    end sessions whose conversation grows beyond what you want to train on."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[gateway]``."""
        out: list[ConfigError] = []
        if self.max_request_tokens < 0:
            out.append(fail("gateway.max_request_tokens",
                            f"must be >= 0, got {self.max_request_tokens}",
                            "use 0 for no limit but episode.max_context_tokens"))  # fmt: skip
        if not 0 <= self.port <= 65535:
            out.append(fail("gateway.port", f"is {self.port}",
                            "use 0 (a free port) or a port number up to 65535"))  # fmt: skip
        if not self.host.strip():
            out.append(fail("gateway.host", "is empty", 'use "127.0.0.1" (this machine only)'))
        for name in ("session_timeout_s", "claim_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                out.append(fail(f"gateway.{name}", f"must be > 0, got {value}",
                                f"set gateway.{name} to a number of seconds"))  # fmt: skip
        if 0 < self.session_timeout_s < self.claim_timeout_s:
            out.append(fail("gateway.claim_timeout_s", f"is {self.claim_timeout_s:g} s, longer "
                            f"than the whole session (gateway.session_timeout_s = "
                            f"{self.session_timeout_s:g} s)", "set it below "
                            "gateway.session_timeout_s"))  # fmt: skip
        if self.agent and not all(isinstance(a, str) and a for a in self.agent):
            out.append(fail("gateway.agent", f"is {self.agent!r}",
                            'give the command as a list of non-empty strings, e.g. '
                            '["python", "agent.py"]'))  # fmt: skip
        if self.max_agents < 0:
            out.append(fail("gateway.max_agents", f"must be >= 0, got {self.max_agents}",
                            "use 0 (4 per CPU core) or a number of agents"))  # fmt: skip
        for key in self.agent_env:
            if key in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
                out.append(fail(f"gateway.agent_env.{key}", "is set by the gateway per session",
                                "leave it out"))  # fmt: skip
        return out

    def resolve_paths(self, base_dir: Path) -> GatewayConfig:
        """``agent_dir`` made absolute against ``base_dir`` (the config file's directory),
        ``""`` meaning that directory: the agent then runs the same whatever directory the run
        was started from. A path already absolute (``~`` expanded) is kept."""
        path = Path(os.path.expanduser(self.agent_dir or "."))
        resolved = path if path.is_absolute() else (base_dir / path).resolve()
        return msgspec.structs.replace(self, agent_dir=str(resolved))

    def agents_at_once(self) -> int:
        """:attr:`max_agents`, its default (``0``) resolved: 4 per CPU core this process may
        use."""
        if self.max_agents:
            return self.max_agents
        return 4 * len(os.sched_getaffinity(0))
