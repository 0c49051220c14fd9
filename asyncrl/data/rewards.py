"""Reward functions named in a config: imported once, called with the keywords they take.

A reward is named ``"module:attr"`` (imported with the config's directory first on
``sys.path``, so ``my_rewards.py`` beside the config works) or ``"path/to/file.py:attr"``
(relative to the config's directory). It may be a plain or an ``async def`` function; it is
called with the keyword arguments its signature names among ``completion`` (the decoded
text), ``answer`` (the prompt's answer) and ``prompt`` (the :class:`~asyncrl.environment.Prompt`),
and returns a number or a bool::

    def exact(completion: str, answer: dict) -> bool:
        return completion.strip() == str(answer["solution"])

    async def judged(completion: str, prompt) -> float:
        return await my_judge(prompt.display, completion)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from asyncrl.data.deadlines import AbandonedThreadsError, in_thread, running
from asyncrl.environment import Prompt
from asyncrl.errors import ConfigError, config_error

__all__ = ["ARGUMENTS", "Reward", "RewardError", "RewardSpec", "load_rewards"]

ARGUMENTS = ("completion", "answer", "prompt")
"""The keyword arguments a reward function may take."""


class RewardSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One reward function of a weighted sum (an item of ``rewards``)."""

    function: str
    """``"module:attr"`` or ``"path/to/file.py:attr"`` (relative to the config's directory)."""
    weight: float = 1.0
    """Its weight in the reward (the reward is the weighted sum of the raw values)."""
    name: str | None = None
    """Its name in ``Score.components`` and the ``reward/<name>`` metric (default: ``attr``)."""


class RewardError(Exception):
    """A reward function raised, or returned something other than a finite number or a bool
    (the message names the reward)."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward function, ready to call."""

    name: str
    weight: float
    fn: Callable[..., Any]
    takes: tuple[str, ...]
    """The keywords of :data:`ARGUMENTS` it is called with."""
    is_async: bool
    origin: str
    """The ``function`` string it was loaded from (named in errors)."""
    module_file: str | None = None
    """The source file of the module ``origin`` names (``None``: it has none, e.g. a
    built-in module): hashed into the checkpoint's fingerprints of the reward code
    (:func:`asyncrl.checkpoints.resume_rule.code_fingerprints`)."""

    def _kwargs(self, prompt: Prompt, completion: str) -> dict[str, Any]:
        given = {"completion": completion, "answer": prompt.answer, "prompt": prompt}
        return {k: given[k] for k in self.takes}

    def _value(self, value: Any) -> float:
        if isinstance(value, (bool, np.bool_, numbers.Real)) and math.isfinite(float(value)):
            return float(value)
        raise RewardError(
            f"reward {self.name!r} ({self.origin}) returned {value!r}; a reward function "
            "returns a finite number or a bool"
        )

    def _raised(self, exc: Exception) -> RewardError:
        return RewardError(f"{self.label} raised {type(exc).__name__}: {exc}")

    @property
    def label(self) -> str:
        """``reward 'name' (origin)``: how errors name it."""
        return f"reward {self.name!r} ({self.origin})"

    def call(self, prompt: Prompt, completion: str) -> float:
        """The raw value for one completion (a sync reward only). Under the controller's
        deadline (:mod:`asyncrl.data.deadlines`) a timeout names this reward.

        Raises:
            RewardError: the function raised or returned a bad value.
        """
        assert not self.is_async, "await acall() for an async reward"
        try:
            with running(self.label):
                value = self.fn(**self._kwargs(prompt, completion))
        except Exception as exc:
            raise self._raised(exc) from exc
        return self._value(value)

    async def acall(self, prompt: Prompt, completion: str) -> float:
        """The raw value for one completion: awaited for an async reward, run on a daemon
        thread for a sync one (:func:`asyncrl.data.deadlines.in_thread`). Cancellation: an awaited
        reward is cancelled; a sync one's thread is abandoned (it cannot be stopped; it runs
        on until the function returns, and never holds up the process's exit).

        Raises:
            RewardError: the function raised or returned a bad value.
            AbandonedThreadsError: too many abandoned reward threads still run.
        """
        kwargs = self._kwargs(prompt, completion)
        try:
            with running(self.label):
                if self.is_async:
                    value = await self.fn(**kwargs)
                else:
                    value = await in_thread(lambda: self.fn(**kwargs))
        except AbandonedThreadsError:
            raise  # not the reward's own error
        except Exception as exc:
            raise self._raised(exc) from exc
        return self._value(value)


def load_rewards(
    specs: Sequence[RewardSpec], base_dir: str | os.PathLike[str], field: str
) -> list[Reward]:
    """Import each reward function of ``specs`` (``field`` is the option's name in errors,
    e.g. ``environment.options.rewards``).

    Raises:
        ConfigError: an empty list, a malformed ``function``, an import failure, a missing
            attribute, a signature asyncrl cannot call, a non-finite weight or two rewards
            with one name (each naming ``<field>[i].<key>``).
    """
    if not specs:
        raise config_error(
            field,
            "is empty",
            'list at least one reward function, e.g. rewards = [{ function = "my_rewards:exact" }]',
        )
    rewards: list[Reward] = []
    for i, spec in enumerate(specs):
        where = f"{field}[{i}]"
        module, fn = _resolve(spec.function, Path(base_dir), f"{where}.function")
        takes = _arguments(fn, spec.function, f"{where}.function")
        if not math.isfinite(spec.weight):
            raise config_error(f"{where}.weight", f"is {spec.weight}", "use a finite number")
        name = spec.name if spec.name is not None else spec.function.rpartition(":")[2]
        if not name:
            raise config_error(f"{where}.name", "is empty", "give the reward a name")
        if any(r.name == name for r in rewards):
            raise config_error(
                f"{where}.name",
                f"a reward named {name!r} comes earlier in the list",
                "give each reward a distinct name (name = ...)",
            )
        rewards.append(Reward(name, spec.weight, fn, takes, _is_async(fn), spec.function,
                              getattr(module, "__file__", None)))  # fmt: skip
    return rewards


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # an instance with an async __call__
    )


def _arguments(fn: Callable[..., Any], origin: str, where: str) -> tuple[str, ...]:
    """Which of :data:`ARGUMENTS` ``fn`` takes (all of them for ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as exc:
        raise config_error(
            where,
            f"{origin!r} has no signature asyncrl can read ({exc})",
            "wrap it in a Python function taking completion, answer and/or prompt",
        ) from None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return ARGUMENTS
    takes = tuple(a for a in ARGUMENTS if any(p.name == a and p.kind in keyword for p in params))
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    unfilled = [
        p.name
        for p in params
        if p.name not in takes and p.default is inspect.Parameter.empty and p.kind not in variadic
    ]
    if unfilled or not takes:
        problem = (
            f"requires parameter(s) {', '.join(unfilled)}" if unfilled else "takes none of them"
        )
        raise config_error(
            where,
            f"{origin!r} {problem}; a reward function is called with keyword arguments "
            f"chosen among {', '.join(ARGUMENTS)}",
            "take some of those (by name) and give any other parameter a default",
        )
    return takes


def _resolve(target: str, base_dir: Path, where: str) -> tuple[ModuleType, Callable[..., Any]]:
    """The module ``target`` names and the callable in it (``module:attr`` or
    ``file.py:attr``)."""
    source, _, attr = target.rpartition(":")
    if not source or not attr:
        raise config_error(
            where,
            f"{target!r} is not 'module:attr' or 'path/to/file.py:attr'",
            'write e.g. "my_rewards:exact" (my_rewards.py beside the config) or '
            '"rewards/math.py:exact"',
        )
    if source.endswith(".py") or "/" in source or os.sep in source:
        module = _import_file(base_dir / source, where)
    else:
        module = _import_module(source, base_dir, where)
    obj: Any = module
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise config_error(
            where,
            f"{source!r} has no attribute {attr!r}",
            f"name a function defined in it (it defines: "
            f"{', '.join(_public(module)) or 'nothing public'})",
        ) from None
    if not callable(obj):
        raise config_error(
            where,
            f"{target!r} is of type {type(obj).__name__!r}, not a function",
            "name a function (or a callable object)",
        )
    return module, obj


def _public(module: ModuleType) -> list[str]:
    return sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))


def _import_failed(where: str, what: str, exc: BaseException) -> ConfigError:
    return config_error(
        where,
        f"importing {what} failed: {type(exc).__name__}: {exc}",
        "correct the module (or the name), or install what it imports into the controller's "
        "environment",
    )


def _import_module(name: str, base_dir: Path, where: str) -> ModuleType:
    """Import module ``name`` with ``base_dir`` first on ``sys.path`` for the import."""
    entry = str(base_dir)
    sys.path.insert(0, entry)
    try:
        importlib.invalidate_caches()  # a file written since the last import is seen
        return importlib.import_module(name)
    except Exception as exc:
        raise _import_failed(where, f"module {name!r} (searched {entry} first)", exc) from exc
    finally:
        sys.path.remove(entry)  # the first occurrence: ours


def _import_file(path: Path, where: str) -> ModuleType:
    """Run ``path`` as a module (once per file: a second reward from it reuses it), its
    directory first on ``sys.path`` so that it can import its neighbours."""
    path = path.resolve()
    if not path.is_file():
        raise config_error(
            where,
            f"no file {str(path)!r}",
            "give a path to a .py file, relative to the config file's directory (or "
            "environment.base_dir)",
        )
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    name = f"asyncrl_rewards_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise config_error(where, f"{str(path)!r} cannot be imported", "name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing look a module up by name while it runs
    entry = str(path.parent)
    sys.path.insert(0, entry)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _import_failed(where, str(path), exc) from exc
    finally:
        sys.path.remove(entry)
    return module
