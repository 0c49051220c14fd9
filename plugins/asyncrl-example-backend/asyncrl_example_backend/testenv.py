"""``repeat-digit``: a *testing* environment (entry point ``asyncrl.environments:repeat-digit``).

Not a benchmark. It exists so that integration tests get a dense, learnable reward from a
bigram model: the prompt is one digit (``"7"``, so the prompt's last token is the digit) and
the reward is 1 when the completion contains that digit, else 0. Even a random bigram hits it
often enough that rewards differ within a group from the first step on, so GRPO's advantages
are non-zero and the weights really move; a bigram can learn it (``d -> d`` transitions).
``correct`` means a non-empty completion made only of that digit.

Options (``[environment.options]``): ``num_train`` (default 64), ``num_eval`` (default 8);
testing knobs ``score_fault`` and ``score_fault_after`` make ``score()`` misbehave (raise, return
NaN, or hang). The eval
split has its own ids; with ten possible prompts the texts necessarily repeat.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from asyncrl.plugin.common import ConfigError, explain
from asyncrl.plugin.environment import Prompt, Score

__all__ = ["RepeatDigitEnv", "RepeatDigitTurnsEnv", "make_environment", "make_turns_environment"]


class RepeatDigitOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    num_train: int = 64
    """Prompts in the train split."""
    num_eval: int = 8
    """Prompts in the eval split."""
    score_fault: Literal["", "raise", "nan", "hang"] = ""
    """Testing knob: after ``score_fault_after`` scores, ``score()`` raises a ``ValueError``
    (``raise``), returns a NaN reward (``nan``) or hangs (``hang``: blocks for
    ``score_fault_hang_s``), as a buggy reward function would."""
    score_fault_hang_s: float = 3600.0
    """Testing knob: how long ``score_fault = "hang"`` blocks ``score()`` (by default longer
    than any test run: the call never returns in it)."""
    score_fault_after: int = 0
    """Testing knob: how many scores come out right before ``score_fault`` strikes."""
    score_fault_prompts: list[str] = []
    """Testing knob: when set, ``score_fault`` strikes only for these prompt ids."""


class RepeatDigitEnv:
    def __init__(self, options: RepeatDigitOptions, seed: int) -> None:
        rng = random.Random(f"repeat-digit:{seed}")

        def split(name: str, n: int) -> tuple[Prompt, ...]:
            return tuple(
                Prompt(id=f"{name}:{i}", text=d, answer=d)
                for i, d in enumerate(str(rng.randrange(10)) for _ in range(n))
            )

        self._splits = {
            "eval": split("eval", options.num_eval),
            "train": split("train", options.num_train),
        }
        self._options = options
        self._scored = 0
        # Arithmetic on the completion, safe on the controller's event loop, unless it is
        # told to hang (the loop would stop, and no deadline could end the call there).
        self.score_on_loop = options.score_fault != "hang"

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        return self._splits[split]

    def score(self, prompt: Prompt, completion: str) -> Score:
        self._scored += 1
        fault = self._options.score_fault
        targets = self._options.score_fault_prompts
        if targets and prompt.id not in targets:
            fault = ""
        if fault and self._scored > self._options.score_fault_after:
            if fault == "raise":
                raise ValueError(f"cannot parse {completion!r} (a testing knob)")
            if fault == "hang":
                time.sleep(self._options.score_fault_hang_s)
            return Score(reward=float("nan"))
        text = completion.strip()
        correct = bool(text) and set(text) == {prompt.answer}
        return Score(reward=1.0 if prompt.answer in text else 0.0, correct=correct)


def _options(options: dict[str, Any], kind: type[Any]) -> Any:
    """``[environment.options]`` as ``kind`` (either task's options), its split sizes checked.

    Raises:
        ConfigError: a field's type or a split size is wrong (naming it).
    """
    try:
        opts = msgspec.convert(dict(options), kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, kind, "environment.options")) from None
    if opts.num_train < 1 or opts.num_eval < 0:
        raise ConfigError("environment.options: num_train must be >= 1 and num_eval >= 0")
    return opts


def make_environment(options: dict[str, Any], seed: int) -> RepeatDigitEnv:
    return RepeatDigitEnv(_options(options, RepeatDigitOptions), seed)


class RepeatDigitTurnsEnv:
    """``repeat-digit-turns``: the same task as ``turns`` turns, two by default (a *testing*
    multi-turn environment, entry point ``asyncrl.environments:repeat-digit-turns``). The
    prompt is one chat message, the digit; the model answers; the environment says the digit
    again (a user turn: the feedback); the model answers again; and so on, a user turn between
    each two. The reward is the share of the turns that contain the digit; ``correct``: all are
    made only of it; the components ``first``, ``second``... (``turn<k>`` from the eleventh) say
    which turns hit. The bigram model directory's chat template writes a message's content as
    it is and an assistant's followed by ``<eos>``
    (:func:`asyncrl_example_backend.model.write_model_dir`), so each turn's context ends with
    the digit, as the single-turn task's does.

    Options: ``num_train``, ``num_eval`` (as ``repeat-digit``); ``turns`` (default 2; the
    episode benchmark, ``benchmarks/episodes.py``, runs 4); ``fail_digits``: the digits whose
    episodes raise after their first turn (a testing knob: a broken agent)."""

    def __init__(self, options: RepeatDigitTurnsOptions, seed: int) -> None:
        base = RepeatDigitEnv(RepeatDigitOptions(num_train=options.num_train,
                                                 num_eval=options.num_eval), seed)  # fmt: skip
        self._splits = {
            split: tuple(Prompt(id=p.id, messages=[{"role": "user", "content": p.text}],
                                answer=p.answer) for p in base.dataset(split))  # fmt: skip
            for split in ("train", "eval")
        }
        self._fail = set(options.fail_digits)
        self._turns = options.turns

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        return self._splits[split]

    async def run_episode(self, prompt: Prompt, episode: Any) -> Score:
        texts = [(await episode.generate()).text.strip()]
        if prompt.answer in self._fail:
            raise RuntimeError(f"a broken agent (fail_digits: {prompt.answer})")
        while len(texts) < self._turns:
            episode.add_messages({"role": "user", "content": prompt.answer})
            texts.append((await episode.generate()).text.strip())
        hits = [prompt.answer in t for t in texts]
        correct = all(t and set(t) == {prompt.answer} for t in texts)
        names = [*_ORDINALS, *(f"turn{k}" for k in range(len(_ORDINALS) + 1, len(hits) + 1))]
        return Score(reward=sum(hits) / len(hits), correct=correct,
                     components={name: float(hit) for name, hit in zip(names, hits)})


_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
             "ninth", "tenth")  # fmt: skip


class RepeatDigitTurnsOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    num_train: int = 64
    """Prompts in the train split."""
    num_eval: int = 8
    """Prompts in the eval split."""
    turns: int = 2
    """Assistant turns per episode (a user turn, the digit, between each two)."""
    fail_digits: list[str] = []
    """Testing knob: the digits whose episodes raise after their first turn."""


def make_turns_environment(options: dict[str, Any], seed: int) -> RepeatDigitTurnsEnv:
    opts = _options(options, RepeatDigitTurnsOptions)
    if opts.turns < 1:
        raise ConfigError(f"environment.options.turns: must be >= 1, got {opts.turns} "
                          "(the assistant turns per episode)")  # fmt: skip
    return RepeatDigitTurnsEnv(opts, seed)
