"""``[gateway]``: the OpenAI-compatible gateway that trains agent programs (docs/gateway.md).

Its checks sit with it; :func:`asyncrl.config.problems` gathers them.
"""

from __future__ import annotations

from asyncrl.config.section import Section, at_least_one, fail
from asyncrl.errors import ConfigError

__all__ = ["GatewayConfig"]


class GatewayConfig(Section):
    enabled: bool = False
    """Serve the run's episodes as sessions of an OpenAI-compatible endpoint: each episode is
    one agent's conversation, its calls recorded token-exact and trained with the reward the
    session ends with."""
    host: str = "127.0.0.1"
    """The address to listen on. Anything but a loopback address exposes the gateway to the
    network (every call still needs a key)."""
    port: int = 0
    """The port (``0``: a free one, written to ``<run.output_dir>/gateway.json``)."""
    agent: list[str] = []
    """The managed agent: a command (argv) the controller runs once per session, with
    ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set for it and the prompt as JSON on its stdin;
    the environment's ``score(prompt, completion)`` scores its last answer when it exits 0.
    Empty: agents call in by themselves (``POST /rl/sessions`` with the admin key)."""
    agent_env: dict[str, str] = {}
    """More environment variables for the managed agent."""
    keep_agent_logs: bool = False
    """Keep every managed agent's output (``<run.output_dir>/logs/agents/``); by default only
    those of agents that did not exit 0 are kept."""
    session_timeout_s: float = 600.0
    """A session's deadline, from the moment it is handed out: past it the session ends
    truncated (``episode.on_truncation``) and a managed agent is killed."""
    idle_timeout_s: float = 120.0
    """Longest wait for a session's next call or its reward once handed out: past it the
    session fails (its agent went away) and its group runs again under ``[failures]``."""
    max_concurrent_requests: int = 4096
    """HTTP requests served at once; more get 429 (with ``Retry-After``)."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body; a larger one gets 413."""
    model_name: str = ""
    """The model's name in ``/v1/models`` and in responses (``""``: the model directory's
    name). A request may name any model: agents often hard-code one."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[gateway]``."""
        out = at_least_one({"gateway.max_concurrent_requests": self.max_concurrent_requests,
                            "gateway.max_body_bytes": self.max_body_bytes})  # fmt: skip
        if not 0 <= self.port <= 65535:
            out.append(fail("gateway.port", f"is {self.port}",
                            "use 0 (a free port) or a port number up to 65535"))  # fmt: skip
        if not self.host.strip():
            out.append(fail("gateway.host", "is empty", 'use "127.0.0.1" (this machine only)'))
        for name in ("session_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                out.append(fail(f"gateway.{name}", f"must be > 0, got {value}",
                                f"set gateway.{name} to a number of seconds"))  # fmt: skip
        if self.agent and not all(isinstance(a, str) and a for a in self.agent):
            out.append(fail("gateway.agent", f"is {self.agent!r}",
                            'give the command as a list of non-empty strings, e.g. '
                            '["python", "agent.py"]'))  # fmt: skip
        for key in self.agent_env:
            if key in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
                out.append(fail(f"gateway.agent_env.{key}", "is set by the gateway per session",
                                "leave it out"))  # fmt: skip
        return out
