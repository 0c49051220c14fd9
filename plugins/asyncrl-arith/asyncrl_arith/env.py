"""Single-turn integer arithmetic with an exact-match reward.

A prompt is ``"12+34="``; the expected completion is ``"46"`` (the model then emits EOS).
Problems are drawn without replacement from the space ``a <op> b`` with both operands in
``[min_operand, max_operand]``; one seeded shuffle of that space gives the eval split first
and the train split after it, so the two never share a problem and both are the same for the
same seed and options.

Registered as ``arithmetic`` in the ``asyncrl.environments`` entry point group::

    [environment]
    name = "arithmetic"
    options = { min_operand = 0, max_operand = 99, operators = ["+"] }
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from asyncrl.plugin.common import ConfigError
from asyncrl.plugin.environment import Prompt, Score

__all__ = ["ArithmeticEnv", "ArithmeticOptions", "Problem", "make_environment"]

Operator = Literal["+", "-", "*"]


class ArithmeticOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of the ``arithmetic`` environment (the ``[environment.options]`` table)."""

    operators: tuple[Operator, ...] = ("+",)
    """Operators to draw from; each problem uses one. Any of ``+``, ``-``, ``*``."""
    min_operand: int = 0
    """Smallest operand (inclusive, >= 0)."""
    max_operand: int = 99
    """Largest operand (inclusive)."""
    allow_negative: bool = False
    """Allow ``a - b`` with ``b > a`` (answers such as ``-7``). When false only ``a >= b``
    is drawn for subtraction."""
    num_train: int = 4000
    """Problems in the train split."""
    num_eval: int = 500
    """Problems in the held-out eval split (disjoint from train)."""


def _validate(opts: ArithmeticOptions) -> ArithmeticOptions:
    def fail(field: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"environment.options.{field}: {problem}. Fix: {fix}.")

    if not opts.operators:
        raise fail("operators", "is empty", 'list at least one of "+", "-", "*"')
    if len(set(opts.operators)) != len(opts.operators):
        raise fail("operators", f"has duplicates {list(opts.operators)}", "list each once")
    if opts.min_operand < 0:
        raise fail("min_operand", f"is {opts.min_operand}", "use a value >= 0")
    if opts.max_operand < opts.min_operand:
        raise fail(
            "max_operand",
            f"{opts.max_operand} is below min_operand {opts.min_operand}",
            "raise max_operand or lower min_operand",
        )
    if opts.num_train < 1:
        raise fail("num_train", f"is {opts.num_train}", "use a value >= 1")
    if opts.num_eval < 0:
        raise fail("num_eval", f"is {opts.num_eval}", "use a value >= 0")
    space = _space_size(opts)
    if opts.num_train + opts.num_eval > space:
        raise fail(
            "num_train",
            f"num_train + num_eval = {opts.num_train + opts.num_eval} exceeds the "
            f"{space} distinct problems these operators and operand range allow",
            "lower num_train/num_eval or widen the operand range",
        )
    return opts


def _op_size(op: str, n: int, allow_negative: bool) -> int:
    # subtraction without negatives only has the pairs a >= b: a triangle of the n x n square
    return n * (n + 1) // 2 if op == "-" and not allow_negative else n * n


def _space_size(opts: ArithmeticOptions) -> int:
    n = opts.max_operand - opts.min_operand + 1
    return sum(_op_size(op, n, opts.allow_negative) for op in opts.operators)


class Problem(msgspec.Struct, frozen=True):
    """``a <op> b``; its prompt text and answer string."""

    a: int
    op: str
    b: int

    @property
    def text(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        if self.op == "+":
            return str(self.a + self.b)
        if self.op == "-":
            return str(self.a - self.b)
        return str(self.a * self.b)


def _decode(index: int, opts: ArithmeticOptions) -> Problem:
    """Map ``index`` in ``[0, space size)`` to its problem (a bijection)."""
    lo = opts.min_operand
    n = opts.max_operand - lo + 1
    for op in opts.operators:
        size = _op_size(op, n, opts.allow_negative)
        if index >= size:
            index -= size
            continue
        if op == "-" and not opts.allow_negative:
            row = (math.isqrt(8 * index + 1) - 1) // 2  # largest row with row(row+1)/2 <= index
            col = index - row * (row + 1) // 2
            return Problem(lo + row, op, lo + col)
        return Problem(lo + index // n, op, lo + index % n)
    raise AssertionError("index out of range")  # pragma: no cover


class ArithmeticEnv:
    """The arithmetic environment; see the module docstring."""

    score_on_loop = True
    """``score`` is one string comparison: the controller may call it on its event loop."""

    def __init__(self, options: ArithmeticOptions, seed: int) -> None:
        self.options = options
        self.seed = seed
        # random.sample on a range draws without materialising it
        rng = random.Random(f"asyncrl-arith:{seed}")
        picks = rng.sample(range(_space_size(options)), options.num_eval + options.num_train)
        problems = [_decode(i, options) for i in picks]
        self._splits = {
            "eval": tuple(self._prompt("eval", p) for p in problems[: options.num_eval]),
            "train": tuple(self._prompt("train", p) for p in problems[options.num_eval :]),
        }

    @staticmethod
    def _prompt(split: str, problem: Problem) -> Prompt:
        text = problem.text
        return Prompt(id=f"{split}:{text}", text=text, answer=problem.answer)

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split`` (a fixed tuple; same order on every call)."""
        try:
            return self._splits[split]
        except KeyError:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'") from None

    def score(self, prompt: Prompt, completion: str) -> Score:
        """Exact match of the completion (trailing whitespace ignored) with the answer.

        ``" 46"``, ``"046"``, ``"46+1"`` and ``"4"`` all score 0; ``"46"`` and ``"46 \\n"``
        score 1.
        """
        ok = completion.rstrip() == prompt.answer
        return Score(reward=1.0 if ok else 0.0, correct=ok)


def make_environment(options: dict[str, Any], seed: int) -> ArithmeticEnv:
    """Entry point ``asyncrl.environments:arithmetic``.

    Raises:
        ConfigError: an option is unknown, mistyped or out of range (the message names it).
    """
    try:
        opts = msgspec.convert(dict(options), ArithmeticOptions)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.max_operand`"
        raise ConfigError(f"environment.options: {exc}") from None
    return ArithmeticEnv(_validate(opts), seed)
