"""The environment contract (single-turn, verifiable reward).

An environment distribution registers a factory under ``asyncrl.environments``::

    [project.entry-points."asyncrl.environments"]
    arithmetic = "asyncrl_arith.env:make_environment"

The factory is called as ``factory(options: dict, seed: int)`` in the controller process (with
``base_dir=``, the config file's directory, too when its signature takes it) and returns an
object implementing :class:`Environment`. ``score`` is a plain blocking callable; the
controller runs it on a worker thread, each call under a deadline
(``failures.reward_timeout_s``: a call past it fails its group, and its thread is abandoned).
An environment whose ``score`` is pure arithmetic on the completion and always returns at once
(no I/O, no locks, no user code) may set ``score_on_loop = True`` (:class:`ScoresOnLoop`):
the controller then calls it on its event loop while it measures cheap (under 0.5 ms a group),
saving a thread hop per group, where no deadline can stop it and a hang stops the controller.

An environment whose rewards wait on I/O (a judge model, a sandbox) may also define
``async def score_async(prompt, completion) -> Score`` (:class:`AsyncScoring`, an optional
capability). When it does, the controller awaits ``score_async`` on its event loop, for all the
samples of a group at once (at most 64 calls in flight), and never calls ``score``; it must
not block (run blocking parts with :func:`asyncrl.data.deadlines.in_thread`, which a cancellation
does not wait for, as it waits for ``anyio.to_thread.run_sync``), and it is cancelled when the
run stops, or past its deadline. Errors are reported as for ``score``. Evaluation groups are
scored the same way. The built-in ``dataset`` environment (:mod:`asyncrl.data.dataset`) needs
no package at all.

Optional capabilities: what an environment may have beyond its protocol is declared here as
protocols of its own (:class:`AsyncScoring`, :class:`ScoresOnLoop`, :class:`StepMetrics`,
:class:`HasTools`, :class:`HasRewards`; docs/environments.md, 'Optional capabilities'). They
are checked once, when the environment is made (and again for an environment a service puts in
front of it), by :func:`asyncrl.env.capabilities.check_environment`: one of the wrong kind (a
``score_async`` that is not ``async def``, a ``score_on_loop`` that is not a bool, ``tools``
that are not :func:`~asyncrl.env.tools.tool` functions) is a
:class:`~asyncrl.errors.PluginError` naming the environment and the member, and the run then
calls what was found directly.

Multi-turn environments have their own protocol (:class:`asyncrl.env.episode.EpisodeEnvironment`);
a single-turn environment keeps working unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "AsyncScoring",
    "Environment",
    "HasRewards",
    "HasTools",
    "Prompt",
    "Score",
    "ScoresOnLoop",
    "StepMetrics",
]


@dataclass(frozen=True)
class Prompt:
    """One task instance: plain ``text``, or chat ``messages``."""

    id: str
    """Stable across runs with the same seed and options (used for resume and logs)."""
    text: str = ""
    """The prompt text, encoded as it is with the model's tokenizer (its special tokens, e.g.
    a BOS, added as the tokenizer's post-processor says)."""
    answer: Any = None
    """Whatever the reward needs (JSON-like)."""
    messages: Sequence[Mapping[str, Any]] | None = None
    """Chat messages (``{"role": "system" | "user" | "assistant", "content": str}``, ...)
    instead of ``text``: rendered once in the controller with the model's chat template
    (``model.chat_template``) and a generation prompt, then encoded without adding special
    tokens, exactly as transformers' ``apply_chat_template(..., tokenize=True)`` does."""

    def __post_init__(self) -> None:
        if (self.messages is None) == (not self.text):
            raise ValueError(
                f"prompt {self.id!r}: give exactly one of text (a non-empty string) and "
                "messages (a list of chat messages)"
            )
        if self.messages is not None:
            if not self.messages or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in self.messages
            ):
                raise ValueError(
                    f"prompt {self.id!r}: messages must be a non-empty list of mappings with a "
                    "'role' and a 'content'"
                )

    def chat(self) -> list[dict[str, Any]]:
        """The prompt as chat messages: its ``messages``, or its ``text`` as one user
        message (copies)."""
        if self.messages is None:
            return [{"role": "user", "content": self.text}]
        return [dict(m) for m in self.messages]

    @property
    def display(self) -> str:
        """The prompt as one line of text for logs and completion tables (the last message
        for a chat prompt)."""
        if self.messages is None:
            return self.text
        return str(self.messages[-1].get("content", ""))


@dataclass(frozen=True)
class Score:
    reward: float
    """The scalar reward used for advantages."""
    correct: bool = False
    """Whether the completion solved the task (for accuracy metrics)."""
    components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of ``reward`` (e.g. each weighted reward function's raw value), averaged
    per step into the ``train`` record as ``reward/<name>`` and sent to the metrics sinks."""


@runtime_checkable
class Environment(Protocol):
    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split``; deterministic for a given seed and options. The eval
        split must be disjoint from the train split."""

    def score(self, prompt: Prompt, completion: str) -> Score:
        """Score one completion (blocking is fine: it runs in a worker thread, up to four at
        once, so keep it thread-safe; or, with ``score_on_loop = True``, inline on the event
        loop while it proves cheap). A call that runs past ``failures.reward_timeout_s`` is
        abandoned and fails its group.
        Not called when the environment has ``score_async`` (see the module docstring).

        ``completion`` is the generated token ids decoded with the model's tokenizer, EOS
        tokens dropped and special tokens skipped; nothing else is stripped. An exception here,
        or a reward that is not a finite number, ends the run with a ``RunError`` naming the
        environment, the prompt id and the completion."""


# ------------------------------------------------------------------ optional capabilities
class AsyncScoring(Protocol):
    """Optional: rewards that wait on I/O (a judge model, a sandbox)."""

    async def score_async(self, prompt: Prompt, completion: str) -> Score:
        """Score one completion on the controller's event loop (see the module docstring):
        awaited for all the samples of a group at once, each under
        ``failures.reward_timeout_s``; ``score`` is then never called. Must be ``async def``."""


class ScoresOnLoop(Protocol):
    """Optional: an environment whose ``score`` is pure arithmetic on the completion."""

    score_on_loop: bool
    """``True``: ``score`` is called on the controller's event loop while it measures cheap
    (no deadline can stop it there). A bool."""


class StepMetrics(Protocol):
    """Optional: figures of the environment's own for each step record (the gateway's
    ``gateway_*``)."""

    def take_metrics(self) -> Mapping[str, float]:
        """The figures since the last call, by name; merged into the step's record. A plain
        method, called on the controller's event loop once a step: keep it cheap."""


class HasTools(Protocol):
    """Optional for a multi-turn environment: the tools its episodes call."""

    tools: Sequence[Any]
    """The :func:`~asyncrl.env.tools.tool` functions (:class:`~asyncrl.env.tools.Tool`), a
    list or a tuple, their names distinct: the run puts them in one
    :class:`~asyncrl.env.toolbox.ToolBox` and shows their definitions to the chat template."""


class HasRewards(Protocol):
    """Optional: the reward functions the environment scores with, as the built-in ``dataset``
    environment loads them (:func:`asyncrl.data.rewards.load_rewards`)."""

    rewards: Sequence[Any]
    """A list or tuple of :class:`~asyncrl.data.rewards.Reward`: each one's source file is
    fingerprinted when the run starts, and a resume compares them
    (:func:`asyncrl.checkpoints.resume_rule.code_fingerprints`)."""
