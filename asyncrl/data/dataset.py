"""The built-in ``dataset`` environment: prompts from a data file, rewards from your functions.

No package to write: point it at a JSONL file, a Parquet file or a Hugging Face ``datasets``
directory (``save_to_disk``), and at reward functions in a ``.py`` file::

    [environment]
    name = "dataset"

    [environment.options]
    train = "data/train.jsonl"          # or .parquet, or a save_to_disk directory
    eval_size = 200                     # held out of train (seeded), or: eval = "data/test.jsonl"
    prompt_field = "question"
    prompt_template = "{question}\\nAnswer with a number."
    system_prompt = "You are a careful solver."   # optional: makes chat messages
    answer_fields = ["solution"]        # the Prompt's answer: {"solution": ...}
    rewards = [
        { function = "my_rewards:exact", weight = 1.0 },        # my_rewards.py beside the config
        { function = "rewards/format.py:tagged", weight = 0.1, name = "format" },
    ]

Each row becomes a :class:`~asyncrl.environment.Prompt`: its text is ``prompt_field`` (through
``prompt_template`` when given; a ``[system, user]`` chat when ``system_prompt`` is given), or
its chat messages are ``messages_field``; its ``answer`` is a dict of ``answer_fields`` (default:
every other field); its id is ``id_field``'s value, else ``<split>-<row>``: the file it was
read from (``train`` or ``eval``) and its 0-based row there, so an ``eval_size`` row held out
of train keeps its ``train-<row>`` id. A ``DatasetDict`` directory's split is picked by
``train_split`` / ``eval_split`` (default ``"train"`` / ``"test"``); the same directory may be
given as ``train`` and ``eval``.

The reward is ``sum(weight_i * value_i)`` over the reward functions (see
:mod:`asyncrl.data.rewards` for what a function may take and return); ``Score.components`` holds the
raw values by name and ``correct`` is whether the value of ``correct_reward`` (default: the
first) is > 0. When a reward function is ``async def`` the environment has ``score_async``
(the controller awaits it, a group's samples concurrently, with the sync rewards in worker
threads); its ``score`` then raises ``TypeError`` (the library never starts an event loop of
its own: await ``score_async``). Under the controller every call has a deadline
(``failures.reward_timeout_s``): a reward function that does not return by then fails its
group, and the error names it (``reward 'exact' (my_rewards:exact)``), the prompt and the
deadline.

Parquet files and ``datasets`` directories are read with pyarrow alone (the ``datasets``
library is not needed: a ``save_to_disk`` directory is a ``state.json`` listing Arrow stream
files, or a ``dataset_dict.json`` listing split directories); install it with
``pip install 'asyncrl[data]'``. Every row is read when the environment is made
(:mod:`asyncrl.data.files`), so a missing file, an empty split, a row lacking a field or a
file that does not decode (named with its line or row and the byte offset in the file) is a
``ConfigError`` before any process starts.
"""

from __future__ import annotations

import os
import random
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec

from asyncrl.data.files import OPT, Source, read_source
from asyncrl.environment import Prompt, Score
from asyncrl.errors import ConfigError, config_error
from asyncrl.explain import explain
from asyncrl.data.rewards import Reward, RewardSpec, load_rewards

__all__ = [
    "AsyncDatasetEnvironment",
    "DatasetEnvironment",
    "DatasetOptions",
    "make_environment",
]


class DatasetOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of the ``dataset`` environment (the ``[environment.options]`` table)."""

    train: str
    """The train split: a ``.jsonl`` or ``.parquet`` file or a ``datasets`` ``save_to_disk``
    directory, relative to the config file's directory (or ``environment.base_dir``)."""
    eval: str | None = None
    """The eval split, of the same kinds (without it, see ``eval_size``)."""
    eval_size: int = 0
    """Without ``eval``: rows held out of train for the eval split by a shuffle seeded with
    ``run.seed`` (0: no eval split)."""
    train_split: str | None = None
    """The split of a ``DatasetDict`` directory given as ``train`` (default ``"train"``)."""
    eval_split: str | None = None
    """The split of a ``DatasetDict`` directory given as ``eval`` (default ``"test"``)."""
    prompt_field: str | None = None
    """The field holding the prompt text (give this or ``messages_field``)."""
    messages_field: str | None = None
    """The field holding chat messages, a list of ``{role, content}``."""
    system_prompt: str | None = None
    """With ``prompt_field``: send ``[system, user]`` chat messages, this as the system's."""
    prompt_template: str | None = None
    """With ``prompt_field``: the text is this ``str.format`` template over the row's fields,
    e.g. ``"{question}\\nAnswer with a number."``."""
    answer_fields: tuple[str, ...] | None = None
    """The fields passed as the Prompt's ``answer`` dict (default: all but the prompt's)."""
    id_field: str | None = None
    """The field holding each row's unique id (default: ``<split>-<row>``)."""
    rewards: tuple[RewardSpec, ...]
    """The reward functions: ``{ function = "module:attr" | "file.py:attr", weight = 1.0,
    name = "..." }``; the reward is their weighted sum."""
    correct_reward: str | None = None
    """The reward (by name) whose value > 0 makes a completion correct (default: the first)."""


def make_environment(
    options: dict[str, Any], seed: int, *, base_dir: str | os.PathLike[str] | None = None
) -> DatasetEnvironment:
    """Entry point ``asyncrl.environments:dataset``: read both splits and import the reward
    functions (``base_dir``: where relative paths start, default the working directory).

    Returns an :class:`AsyncDatasetEnvironment` when a reward function is ``async def``.

    Raises:
        ConfigError: an option is unknown, mistyped or inconsistent; a file is missing,
            unreadable or empty; a row lacks a field; a reward function does not import
            (each naming ``environment.options.<key>`` and the fix).
    """
    try:
        opts = msgspec.convert(dict(options), DatasetOptions)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, DatasetOptions, OPT)) from None
    _validate(opts)
    base = Path(base_dir or ".").resolve()
    rewards = load_rewards(opts.rewards, base, f"{OPT}.rewards")
    names = [r.name for r in rewards]
    correct = opts.correct_reward if opts.correct_reward is not None else names[0]
    if correct not in names:
        raise _fail("correct_reward", f"{correct!r} names no reward",
                    f"use one of {', '.join(map(repr, names))}")
    train_rows = read_source(opts.train, base, "train", opts.train_split, "train")
    train = _prompts(train_rows, "train", opts)
    if opts.eval is not None:
        eval_rows = read_source(opts.eval, base, "eval", opts.eval_split, "test")
        evals = _prompts(eval_rows, "eval", opts)
    else:
        train, evals = _hold_out(train, opts.eval_size, seed)
    cls = AsyncDatasetEnvironment if any(r.is_async for r in rewards) else DatasetEnvironment
    return cls(train, evals, rewards, names.index(correct))


def _fail(key: str, problem: str, fix: str) -> ConfigError:
    return config_error(f"{OPT}.{key}", problem, fix)


def _validate(opts: DatasetOptions) -> None:
    if (opts.prompt_field is None) == (opts.messages_field is None):
        raise _fail(
            "prompt_field",
            "give exactly one of prompt_field and messages_field",
            'prompt_field = "question" (text) or messages_field = "messages" (chat)',
        )
    for key in ("system_prompt", "prompt_template"):
        if opts.messages_field is not None and getattr(opts, key) is not None:
            raise _fail(key, "applies to prompt_field only", f"remove {key} or use prompt_field")
    if opts.prompt_template is not None:
        _template_fields(opts.prompt_template)
    if opts.eval_size < 0:
        raise _fail("eval_size", f"is {opts.eval_size}", "use a value >= 0")
    if opts.eval is not None and opts.eval_size:
        raise _fail(
            "eval_size", "is set together with eval", "give eval (a file) or eval_size, not both"
        )
    if opts.eval is None and opts.eval_split is not None:
        raise _fail("eval_split", "is set without eval", "name the eval directory: eval = ...")


def _template_fields(template: str) -> list[str]:
    """The row fields ``template`` refers to (a ConfigError for a malformed template)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise _fail(
            "prompt_template", f"is not a str.format template ({exc})", "write {field}; {{ for {"
        ) from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if not base or base.isdigit():
            raise _fail(
                "prompt_template",
                f"has a positional field {{{name}}}",
                "name the row's field, e.g. {question}",
            )
        fields.append(base)
    return fields


# ---------------------------------------------------------------------------------- prompts
def _prompts(src: Source, split: str, opts: DatasetOptions) -> list[Prompt]:
    """One Prompt per row of ``src`` (each row checked for the fields the options name)."""
    if not src.rows:
        raise _fail(src.key, f"{src.label} has no rows", "give a file with at least one row")
    main = opts.prompt_field or opts.messages_field
    main_key = "prompt_field" if opts.prompt_field else "messages_field"
    assert main is not None
    needed = [(main, main_key)]
    needed += [(f, "prompt_template") for f in _template_fields(opts.prompt_template or "")]
    needed += [(f, "answer_fields") for f in opts.answer_fields or ()]
    needed += [(opts.id_field, "id_field")] if opts.id_field else []
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(src.rows):
        for field, key in needed:
            if field not in row:
                raise _fail(
                    src.key,
                    f"{src.at(i)} has no field {field!r} (named by {OPT}.{key}; its fields: "
                    f"{', '.join(sorted(row))})",
                    f"add {field!r} to every row or change {OPT}.{key}",
                )
        pid = str(row[opts.id_field]) if opts.id_field else f"{split}-{i}"
        if pid in seen:
            raise _fail(
                "id_field",
                f"{src.at(i)} repeats the id {pid!r} of {src.at(seen[pid])}",
                "name a field whose values are unique, or remove id_field",
            )
        seen[pid] = i
        fields = opts.answer_fields if opts.answer_fields is not None else tuple(row)
        answer = {k: row[k] for k in fields if opts.answer_fields is not None or k != main}
        if opts.messages_field is not None:
            messages = _messages(row[main], src, i, main)
            prompts.append(Prompt(id=pid, messages=messages, answer=answer))
            continue
        text = row[main]
        if not isinstance(text, str) or not text:
            raise _fail(
                src.key,
                f"{src.at(i)} field {main!r} is {text!r}, not a non-empty string",
                f"fix that row, or point {OPT}.prompt_field at a text field",
            )
        if opts.prompt_template is not None:
            try:
                text = opts.prompt_template.format_map(row)
            except (ValueError, KeyError, IndexError, AttributeError, TypeError) as exc:
                raise _fail(
                    "prompt_template",
                    f"does not format {src.at(i)} ({type(exc).__name__}: {exc})",
                    "refer to the row's fields as {name}, with format specs their values fit",
                ) from None
        if opts.system_prompt is not None:
            chat = [
                {"role": "system", "content": opts.system_prompt},
                {"role": "user", "content": text},
            ]
            prompts.append(Prompt(id=pid, messages=chat, answer=answer))
        else:
            prompts.append(Prompt(id=pid, text=text, answer=answer))
    return prompts


def _messages(value: Any, src: Source, i: int, field: str) -> list[dict[str, Any]]:
    ok = isinstance(value, list) and value
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise _fail(
            src.key,
            f"{src.at(i)} field {field!r} is {str(value)[:120]}, not a non-empty list of "
            "{role, content} objects with string values",
            f"fix that row, or point {OPT}.messages_field at a chat-messages field",
        )
    return [dict(m) for m in value]


def _hold_out(train: list[Prompt], size: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Split ``size`` prompts off ``train`` by a shuffle seeded with ``seed`` (both parts keep
    the file's order)."""
    if not size:
        return train, []
    if size >= len(train):
        raise _fail(
            "eval_size",
            f"is {size} but train has only {len(train)} rows",
            "hold out fewer rows (train keeps at least one), or give an eval file",
        )
    order = list(range(len(train)))
    random.Random(f"asyncrl-dataset:{seed}").shuffle(order)
    held = set(order[:size])
    return (
        [p for i, p in enumerate(train) if i not in held],
        [p for i, p in enumerate(train) if i in held],
    )


# ------------------------------------------------------------------------------ environment
class DatasetEnvironment:
    """The ``dataset`` environment with sync reward functions only; see the module
    docstring."""

    def __init__(
        self,
        train: Sequence[Prompt],
        evals: Sequence[Prompt],
        rewards: Sequence[Reward],
        correct_index: int = 0,
    ) -> None:
        self._splits = {"train": tuple(train), "eval": tuple(evals)}
        self.rewards = tuple(rewards)
        self._correct = correct_index

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split`` (a fixed tuple; the same on every call)."""
        try:
            return self._splits[split]
        except KeyError:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'") from None

    def score(self, prompt: Prompt, completion: str) -> Score:
        """The weighted sum of the reward functions' values (thread-safe when they are).

        Raises:
            RewardError: a reward function raised or returned a bad value (named).
            TypeError: a reward function is ``async def``: await
                :meth:`AsyncDatasetEnvironment.score_async` instead (the library never starts
                an event loop of its own; the controller awaits it).
        """
        if any(r.is_async for r in self.rewards):
            names = ", ".join(r.name for r in self.rewards if r.is_async)
            raise TypeError(
                f"the dataset environment has async reward functions ({names}): score() "
                "cannot run them; await score_async() instead"
            )
        return self._combine([r.call(prompt, completion) for r in self.rewards])

    def _combine(self, values: Sequence[float]) -> Score:
        reward = sum(r.weight * v for r, v in zip(self.rewards, values))
        components = {r.name: v for r, v in zip(self.rewards, values)}
        return Score(reward=reward, correct=values[self._correct] > 0, components=components)

    async def _score_async(self, prompt: Prompt, completion: str) -> Score:
        values = [0.0] * len(self.rewards)
        failed: list[tuple[int, Exception]] = []

        async def one(i: int, reward: Reward) -> None:
            try:
                values[i] = await reward.acall(prompt, completion)
            except Exception as exc:  # the first failure (by reward order) is raised below
                failed.append((i, exc))
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for i, reward in enumerate(self.rewards):
                tg.start_soon(one, i, reward)
        if failed:
            raise min(failed, key=lambda f: f[0])[1]
        return self._combine(values)


class AsyncDatasetEnvironment(DatasetEnvironment):
    """The ``dataset`` environment when a reward function is ``async def``: it also has
    :meth:`score_async`, which the controller awaits instead of calling ``score``."""

    async def score_async(self, prompt: Prompt, completion: str) -> Score:
        """The weighted sum of the reward functions' values, all of them at once (sync ones
        in worker threads). Cancellation: the async rewards are cancelled; a sync one's
        thread is abandoned (a thread cannot be stopped; it never holds up the process's
        exit).

        Raises:
            RewardError: a reward function raised or returned a bad value (named).
        """
        return await self._score_async(prompt, completion)
