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
rewards' types (:mod:`asyncrl.env.tools`, :mod:`asyncrl.data.rewards`), which stand above it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.data.rewards import Reward
from asyncrl.env.tools import Tool
from asyncrl.environment import Prompt, Score
from asyncrl.errors import PluginError
from asyncrl.plugins import did_you_mean, method_problem, public_names

__all__ = ["EnvironmentParts", "check_environment", "rewards_of"]

_ON_LOOP = "the controller awaits it on its event loop"
_METHODS: dict[str, tuple[bool, str]] = {
    "dataset": (False, "the controller calls it as the run starts"),
    "score": (False, "it runs on a worker thread; an async one is named score_async"),
    "score_async": (True, _ON_LOOP),
    "run_episode": (True, _ON_LOOP),
    "take_metrics": (False, "the controller calls it once a step, on its event loop"),
}
"""Each method of the contract: whether it is ``async def``, and why (for the message)."""
_ATTRIBUTES = ("score_on_loop", "tools", "rewards")
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
    known = [*_METHODS, *_ATTRIBUTES]
    spare = public_names(environment, known)
    found = {m: getattr(environment, m, None) for m in known}
    problems = [
        method_problem(environment, m, is_async, spare, awaited=why, plain=why)
        for m, (is_async, why) in _METHODS.items()
        if m == "dataset" or found[m] is not None
    ]
    on_loop = found["score_on_loop"]
    if on_loop is not None and not isinstance(on_loop, bool):
        problems.append(f"'score_on_loop' must be a bool (True or False), got {on_loop!r} "
                        f"(a {type(on_loop).__name__})")  # fmt: skip
    tools, tool_problem = _tools(found["tools"])
    rewards, reward_problem = _rewards(found["rewards"])
    problems += [tool_problem, reward_problem]
    if scored and all(found[m] is None for m in _SCORERS):
        near = "".join(did_you_mean(m, spare) for m in _SCORERS)
        problems.append("no way to score a completion: no method 'score', 'score_async' or "
                        f"'run_episode'{near}")  # fmt: skip
    _raise(environment, name, problems)
    return EnvironmentParts(
        name=name,
        score=found["score"],
        score_async=found["score_async"],
        score_on_loop=bool(on_loop),
        run_episode=found["run_episode"],
        take_metrics=found["take_metrics"],
        tools=tools,
        rewards=rewards,
    )


def rewards_of(environment: Any, name: str) -> tuple[Reward, ...]:
    """``environment``'s reward functions (:class:`~asyncrl.environment.HasRewards`; ``()``
    without), checked as :func:`check_environment` checks them, and nothing else of it.

    Raises:
        PluginError: its ``rewards`` are not a list or tuple of reward functions.
    """
    rewards, problem = _rewards(getattr(environment, "rewards", None))
    _raise(environment, name, [problem])
    return rewards


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


def _tools(value: Any) -> tuple[tuple[Tool, ...], str]:
    """``tools`` as a tuple, and what is wrong with it (``""``: nothing)."""
    if value is None:
        return (), ""
    if not isinstance(value, (list, tuple)):
        return (), ("'tools' must be a list or tuple of @tool functions "
                    f"(asyncrl.plugin.environment.tool), got a {type(value).__name__}")  # fmt: skip
    seen: set[str] = set()
    for i, t in enumerate(value):
        if not isinstance(t, Tool):
            plain = inspect.isfunction(t) or inspect.ismethod(t)
            what = f"the function {t.__name__!r}" if plain else f"a {type(t).__name__}"
            return (), f"'tools'[{i}] is {what}, not a tool: decorate it with @tool"
        if t.name in seen:
            return (), f"'tools' holds two tools named {t.name!r} (rename one: @tool(name=...))"
        seen.add(t.name)
    return tuple(value), ""


def _rewards(value: Any) -> tuple[tuple[Reward, ...], str]:
    """``rewards`` as a tuple, and what is wrong with it (``""``: nothing)."""
    if value is None:
        return (), ""
    if isinstance(value, (list, tuple)) and all(isinstance(r, Reward) for r in value):
        return tuple(value), ""
    got = f"a {type(value).__name__}"
    if isinstance(value, (list, tuple)) and value:
        got += f" of {', '.join(sorted({type(r).__name__ for r in value}))}"
    return (), ("'rewards' must be a list or tuple of reward functions as "
                "asyncrl.data.rewards.load_rewards makes them (their files are fingerprinted "
                f"for a resume), got {got}; name the attribute otherwise if it is something "
                "else")  # fmt: skip
