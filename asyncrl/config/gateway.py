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
    """A session's whole deadline, from the moment it is handed out: past it the session
    ends truncated (``episode.on_truncation``) and a managed agent is killed."""
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
    went away) and its group runs again under ``[failures]``."""
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
        for key in self.agent_env:
            if key in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
                out.append(fail(f"gateway.agent_env.{key}", "is set by the gateway per session",
                                "leave it out"))  # fmt: skip
        return out
