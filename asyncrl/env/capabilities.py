"""An environment's optional capabilities, checked once: :func:`check_environment`.

What an environment may have beyond its protocol (:class:`~asyncrl.environment.Environment`,
:class:`~asyncrl.env.episode.EpisodeEnvironment`) is declared as protocols of its own in
:mod:`asyncrl.environment`: ``score_async`` (:class:`~asyncrl.environment.AsyncScoring`),
``score_on_loop`` (:class:`~asyncrl.environment.ScoresOnLoop`), ``take_metrics``
(:class:`~asyncrl.environment.StepMetrics`), ``tools`` (:class:`~asyncrl.environment.HasTools`)
and ``rewards`` (:class:`~asyncrl.environment.HasRewards`). :func:`check_environment` looks for
each once, where the environment is made (:func:`asyncrl.run.preflight.make_environment`) and
where the parts of a run take it (the scorer, the episode runner, the gateway in front of it),
checks its kind, and returns what it found as :class:`EnvironmentParts`; the run calls those
directly, never probing the environment with ``getattr`` on its way (docs/environments.md,
'Optional capabilities').

It lives here rather than in :mod:`asyncrl.environment` because it knows the tools' and the
rewards' types (:mod:`asyncrl.env.tools`, :mod:`asyncrl.data.rewards`), which stand above it,
and asks the run's :class:`~asyncrl.env.toolbox.ToolBox` whether the tools' names are distinct.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.data.rewards import Reward
from asyncrl.env.episode import EpisodeEnvironment
from asyncrl.env.toolbox import ToolBox
from asyncrl.env.tools import Tool
from asyncrl.environment import (
    AsyncScoring, Environment, HasRewards, HasTools, Prompt, Score, ScoresOnLoop, StepMetrics,
)  # fmt: skip
from asyncrl.errors import PluginError
from asyncrl.registry import check_members, did_you_mean, public_names

__all__ = ["EnvironmentParts", "check_environment", "rewards_of"]

_OPTIONAL = (AsyncScoring, ScoresOnLoop, StepMetrics, HasTools, HasRewards, EpisodeEnvironment)
_PLAIN = {
    "dataset": "the controller calls it as the run starts",
    "score": "it runs on a worker thread; an async one is named score_async",
    "take_metrics": "the controller calls it once a step, on its event loop",
}
"""Why each plain method of the contract is plain (for the message); the async ones
(``score_async``, ``run_episode``) are awaited on the controller's event loop."""
_SCORERS = ("score", "score_async", "run_episode")


@dataclass(frozen=True)
class EnvironmentParts:
    """What :func:`check_environment` found on an environment: each optional method bound (or
    ``None`` without it) and each optional attribute's checked value."""

    name: str
    """The environment's name in messages (``environment.name``)."""
    score: Callable[[Prompt, str], Score] | None = None
    """Its ``score``: plain, run on a worker thread (or on the loop: :attr:`score_on_loop`)."""
    score_async: Callable[[Prompt, str], Awaitable[Score]] | None = None
    """:class:`~asyncrl.environment.AsyncScoring`: awaited instead of ``score``."""
    score_on_loop: bool = False
    """:class:`~asyncrl.environment.ScoresOnLoop`: ``score`` may run on the event loop."""
    run_episode: Callable[..., Awaitable[Score]] | None = None
    """Its ``run_episode`` (:class:`~asyncrl.env.episode.EpisodeEnvironment`): multi-turn."""
    take_metrics: Callable[[], Mapping[str, float]] | None = None
    """:class:`~asyncrl.environment.StepMetrics`: its figures for each step record."""
    tools: tuple[Tool, ...] = ()
    """:class:`~asyncrl.environment.HasTools`: the tools its episodes call."""
    rewards: tuple[Reward, ...] = ()
    """:class:`~asyncrl.environment.HasRewards`: its reward functions (fingerprinted)."""

    @property
    def scores(self) -> bool:
        """Whether it can score a completion (``score`` or ``score_async``)."""
        return self.score is not None or self.score_async is not None


def check_environment(environment: Any, name: str, *, scored: bool = False) -> EnvironmentParts:
    """Check ``environment`` against the environment contract, once, as it is made or taken.

    ``dataset`` must be a plain method. Every optional member may be absent (or ``None``);
    present, it must be of its kind: ``score``, ``take_metrics`` plain methods;
    ``score_async``, ``run_episode`` ``async def``; ``score_on_loop`` a bool; ``tools`` a list
    or tuple of :func:`~asyncrl.env.tools.tool` functions with distinct names; ``rewards`` a
    list or tuple of :class:`~asyncrl.data.rewards.Reward`. Cheap: no method is called.

    Args:
        environment: what the ``asyncrl.environments`` factory returned, or what a service
            put in front of it (the gateway).
        name: its name in messages (``environment.name``).
        scored: it must also have a way to score (``score``, ``score_async`` or
            ``run_episode``): the environment the run trains on (not one a service stands
            in front of, whose agents may post the rewards themselves).

    Raises:
        PluginError: naming the environment, its class and every member that is missing (with
            a did-you-mean for a near name it has), not callable, or of the wrong kind.
    """
    found, problems = check_members(
        environment, Environment, optional=_OPTIONAL, may_lack=("score",), plain=_PLAIN,
        awaited="the controller awaits it on its event loop",
        kinds={"score_on_loop": _on_loop, "tools": _tools, "rewards": _rewards},
    )  # fmt: skip
    if scored and all(found[m] is None for m in _SCORERS):
        spare = public_names(environment, [*found, "dataset"])
        near = "".join(did_you_mean(m, spare) for m in _SCORERS)
        problems.append("no way to score a completion: no method 'score', 'score_async' or "
                        f"'run_episode'{near}")  # fmt: skip
    _raise(environment, name, problems)
    return EnvironmentParts(
        name=name,
        score=found["score"],
        score_async=found["score_async"],
        score_on_loop=bool(found["score_on_loop"]),
        run_episode=found["run_episode"],
        take_metrics=found["take_metrics"],
        tools=tuple(found["tools"] or ()),
        rewards=tuple(found["rewards"] or ()),
    )


def rewards_of(environment: Any, name: str) -> tuple[Reward, ...]:
    """``environment``'s reward functions (:class:`~asyncrl.environment.HasRewards`; ``()``
    without), checked as :func:`check_environment` checks them, and nothing else of it.

    Raises:
        PluginError: its ``rewards`` are not a list or tuple of reward functions.
    """
    rewards = getattr(environment, "rewards", None)
    _raise(environment, name, [] if rewards is None else [_rewards("rewards", rewards)])
    return tuple(rewards or ())


def _raise(environment: Any, name: str, problems: list[str]) -> None:
    wrong = [p for p in problems if p]
    if not wrong:
        return
    cls = environment if isinstance(environment, type) else type(environment)
    raise PluginError(
        f"environment {name!r} ({cls.__module__}.{cls.__qualname__}) does not keep the "
        f"environment contract: {'; '.join(wrong)}. Fix: define "
        f"{'them' if len(wrong) > 1 else 'it'} as asyncrl.plugin.environment says "
        "(docs/environments.md, 'Optional capabilities')"
    )


def _on_loop(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return ""
    return f"{name!r} must be a bool (True or False), got {value!r} (a {type(value).__name__})"


def _tools(name: str, value: Any) -> str:
    """What is wrong with ``tools`` (``""``: nothing); distinct names are the run's
    :class:`~asyncrl.env.toolbox.ToolBox`'s rule, asked of it here."""
    if not isinstance(value, (list, tuple)):
        return (f"{name!r} must be a list or tuple of @tool functions "
                f"(asyncrl.plugin.environment.tool), got a {type(value).__name__}")  # fmt: skip
    for i, t in enumerate(value):
        if not isinstance(t, Tool):
            plain = inspect.isfunction(t) or inspect.ismethod(t)
            what = f"the function {t.__name__!r}" if plain else f"a {type(t).__name__}"
            return f"{name!r}[{i}] is {what}, not a tool: decorate it with @tool"
    try:
        ToolBox(value)
    except ValueError as exc:
        return f"{name!r}: {exc}"
    return ""


def _rewards(name: str, value: Any) -> str:
    """What is wrong with ``rewards`` (``""``: nothing)."""
    if isinstance(value, (list, tuple)) and all(isinstance(r, Reward) for r in value):
        return ""
    got = f"a {type(value).__name__}"
    if isinstance(value, (list, tuple)) and value:
        got += f" of {', '.join(sorted({type(r).__name__ for r in value}))}"
    return (f"{name!r} must be a list or tuple of reward functions as "
            "asyncrl.data.rewards.load_rewards makes them (their files are fingerprinted "
            f"for a resume), got {got}; name the attribute otherwise if it is something "
            "else")  # fmt: skip
