"""The plugin API for environments (an ``asyncrl.environments`` entry point), their rewards,
episodes and tools, and tool-call parsers (an ``asyncrl.tool_parsers`` entry point); also what
an agent run outside a run needs to render its conversation token-exact (its tests, supervised
warm-start data). docs/environments.md says how they fit together.

Single-turn environments:

- ``Environment``: the protocol: ``dataset(split)`` and ``score`` (or ``score_async``).
- ``Prompt``: one task instance: ``text`` or chat ``messages``, with an ``answer``.
- ``Score``: a reward, whether it is correct, and its named components.
- ``in_thread``: run blocking code from ``score_async`` on a daemon thread, left behind when
  cancelled.
- ``Overdue``: a call ``in_thread`` ran past its deadline.

Optional capabilities (docs/environments.md, 'Optional capabilities'):

- ``AsyncScoring``: ``async def score_async(prompt, completion)``, awaited instead of ``score``.
- ``ScoresOnLoop``: ``score_on_loop: bool``, ``score`` may run on the event loop while cheap.
- ``StepMetrics``: ``take_metrics()``, the environment's figures for each step record.
- ``HasTools``: ``tools``, the ``@tool`` functions a multi-turn environment's episodes call.
- ``HasRewards``: ``rewards``, the reward functions (fingerprinted for a resume).
- ``check_environment``: check an environment's contract once; what it found, or a
  ``PluginError`` naming it and the member.
- ``EnvironmentParts``: what ``check_environment`` found (bound methods, tools, rewards).

Multi-turn environments (episodes):

- ``EpisodeEnvironment``: the protocol of a multi-turn environment: ``run_episode``.
- ``Episode``: the handle ``run_episode`` gets: generate turns, add observations, call tools.
- ``EpisodeLimit``: raised when the episode can take no further turn (its turns or context).
- ``Limits``: one episode's limits (from ``[episode]``).
- ``Turn``: one generated turn as the episode sees it (text, ids, tool calls found).
- ``Generated``: what the engine answered for one turn request.

Tools:

- ``tool``: make a ``Tool`` of an async function (``@tool``), its schema from the signature.
- ``Tool``: a tool: name, description, JSON schema and the function.
- ``ToolBox``: the run's tools and the rules their calls run under (deadline, concurrency).
- ``blocking``: run a tool's blocking code on a daemon thread.
- ``ToolResult``: the answer to one call, as the model reads it.
- ``tool_message``: a tool's result as the chat message the templates expect.

Tool-call parsers:

- ``ToolCallParser``: the protocol: ``name`` and ``parse(text) -> ParsedTurn``, never raising.
- ``ParsedTurn``: an assistant turn read for tool calls: content, calls and malformed ones.
- ``ToolCall``: one valid call (name, arguments, id, index).
- ``ToolCallError``: one malformed call attempt, with the message the model reads.
- ``make_call_id``: a call id for a call written without one.
- ``load_tool_parser``: the parser registered under a name.

Token-exact conversations:

- ``Trajectory``: one episode's token-exact record, turn by turn.
- ``TrajectoryError``: a trajectory used wrongly or given bad data.
- ``ChatTemplate``: a model's compiled chat template.
- ``Tokenizer``: a model directory's ``tokenizer.json`` (no torch, no transformers).
- ``unlocked``: within it, this thread encodes with the GIL released (a worker thread).
"""

from __future__ import annotations

from asyncrl.data.chat import ChatTemplate
from asyncrl.data.deadlines import Overdue, in_thread
from asyncrl.data.prompts import Tokenizer, unlocked
from asyncrl.env.capabilities import EnvironmentParts, check_environment
from asyncrl.env.episode import (
    Episode,
    EpisodeEnvironment,
    EpisodeLimit,
    Generated,
    Limits,
    Turn,
)
from asyncrl.env.tool_parsers import ParsedTurn, ToolCallParser, load_tool_parser, make_call_id
from asyncrl.env.toolbox import ToolBox, blocking
from asyncrl.env.tools import Tool, ToolCall, ToolCallError, ToolResult, tool, tool_message
from asyncrl.env.trajectory import Trajectory, TrajectoryError
from asyncrl.environment import (
    AsyncScoring,
    Environment,
    HasRewards,
    HasTools,
    Prompt,
    Score,
    ScoresOnLoop,
    StepMetrics,
)

__all__ = [
    "AsyncScoring",
    "ChatTemplate",
    "Environment",
    "EnvironmentParts",
    "Episode",
    "EpisodeEnvironment",
    "EpisodeLimit",
    "Generated",
    "HasRewards",
    "HasTools",
    "Limits",
    "Overdue",
    "ParsedTurn",
    "Prompt",
    "Score",
    "ScoresOnLoop",
    "StepMetrics",
    "Tokenizer",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "ToolResult",
    "Trajectory",
    "TrajectoryError",
    "Turn",
    "blocking",
    "check_environment",
    "in_thread",
    "load_tool_parser",
    "make_call_id",
    "tool",
    "tool_message",
    "unlocked",
]
