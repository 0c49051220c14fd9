"""``[episode]``: multi-turn episodes (an environment with ``run_episode``; docs/environments.md).

Its checks sit with it; :func:`asyncrl.config.problems` gathers them. A single-turn environment
ignores the section.
"""

from __future__ import annotations

from typing import Literal

from asyncrl.config.section import Section, at_least_one, fail
from asyncrl.errors import ConfigError

__all__ = ["EpisodeConfig"]


class EpisodeConfig(Section):
    max_turns: int = 8
    """Turns (engine requests) one episode may take; ``generate()`` past them raises
    ``EpisodeLimit("turns")``. Set it to what the task needs (tool calls plus the answer)."""
    max_context_tokens: int = 4096
    """Tokens in one episode's whole conversation (prompt, turns, observations); a turn is cut
    to what is left, and ``generate()`` with nothing left raises ``EpisodeLimit("context")``.
    At most the engine's context (vLLM's ``max_model_len``). Raise it for long conversations, up
    to the engine's context."""
    max_turn_tokens: int = 0
    """Tokens one turn may generate (``0``: ``grpo.max_new_tokens``). Set it when one turn
    should be shorter than ``grpo.max_new_tokens``."""
    deadline_s: float = 600.0
    """Wall-clock deadline of one episode (turns, tools and the environment's own awaits); an
    episode past it is cancelled and truncated (``"deadline"``). Raise it for slow tools or long
    episodes."""
    on_truncation: Literal["zero", "mask"] = "zero"
    """A truncated episode (a limit hit, or the deadline): ``zero`` trains it with reward 0;
    ``mask`` gives it reward 0 in its group's baseline but trains none of its tokens (as DAPO's
    overlong filtering). An episode that catches ``EpisodeLimit`` scores itself. Set ``mask``
    when cut-off episodes should not count as wrong answers."""
    tool_parser: str = "hermes"
    """The tool-call parser (``asyncrl.tool_parsers`` entry point) that reads tool calls from
    generated text: ``hermes`` (Qwen2.5/Qwen3 ``<tool_call>``), ``llama3_json``, ``mistral``.
    Set it to the parser of the model's tool-call format."""
    tool_timeout_s: float = 30.0
    """Deadline of one tool call; a tool past it is cancelled and the model reads a timeout.
    Raise it for slow tools."""

    def problems(self) -> list[ConfigError]:
        """Every broken invariant of ``[episode]``."""
        out = at_least_one({"episode.max_turns": self.max_turns,
                            "episode.max_context_tokens": self.max_context_tokens})  # fmt: skip
        if self.max_turn_tokens < 0:
            out.append(fail("episode.max_turn_tokens", f"must be >= 0, got {self.max_turn_tokens}",
                            "use 0 for grpo.max_new_tokens"))  # fmt: skip
        for name, value in (("deadline_s", self.deadline_s), ("tool_timeout_s",
                                                               self.tool_timeout_s)):
            if not value > 0:
                out.append(fail(f"episode.{name}", f"must be > 0, got {value}",
                                f"set episode.{name} to a number of seconds"))  # fmt: skip
        return out
