"""``arithmetic-calc``: sums of several multi-digit numbers, with a ``calc`` tool.

A prompt is one user message, ``"12+345+67"``; the answer is the sum, ``"424"``. The model may
answer at once, or call the calculator first (``calc(12+345+67)``, read by
:class:`asyncrl_arith.chat.CompactParser`), read its result (a tool message, ``424``) and
answer then::

    <bos>12+345+67=calc(12+345+67)<eos>r:424=424<eos>

Reward 1 when the final answer (the first turn without a call) is the sum, else 0; a tool
call costs nothing, and an episode that runs out of turns (``episode.max_turns``) scores 0.
The tiny demo model cannot add three numbers of up to three digits reliably by itself (its
direct answers are nearly all wrong, docs/agent-examples.md); with the tool it only has to
copy: the sum into the call, the result into the answer. The score's components:
``tool_call`` (1 when the episode made at least
one valid call: its mean is the tool-call rate) and ``exact`` (the reward).

Problems: ``num_terms`` numbers, each of ``min_digits``..``max_digits`` digits (the digit count
drawn first, then the number), drawn with a seeded generator; the eval split first, then the
train split, with no problem in both. Registered as ``arithmetic-calc``::

    [environment]
    name = "arithmetic-calc"
    options = { num_terms = 3, min_digits = 2, max_digits = 3 }
    [episode]
    tool_parser = "compact"
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from asyncrl.plugin.common import ConfigError
from asyncrl.plugin.environment import Prompt, Score, tool

__all__ = ["CalcEnv", "CalcOptions", "calc", "evaluate_expression", "make_environment"]

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 60


class CalcOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of ``arithmetic-calc`` (the ``[environment.options]`` table)."""

    num_terms: int = 3
    """Numbers in each sum (>= 2)."""
    min_digits: int = 2
    """Fewest digits of a number (>= 1)."""
    max_digits: int = 3
    """Most digits of a number."""
    num_train: int = 4000
    """Problems in the train split."""
    num_eval: int = 500
    """Problems in the held-out eval split (disjoint from train)."""
    question: str = "{expression}"
    """The user message; ``{expression}`` is replaced by the sum (``12+345+67``). The tiny
    model reads the bare sum; an instruct model wants words (docs/recipes/qwen25-tools.md)."""
    match: Literal["exact", "last_number"] = "exact"
    """How the final answer is read: ``exact`` (the whole turn, trailing whitespace
    ignored) or ``last_number`` (the last integer in it, ``,`` separators allowed: an
    instruct model's "The sum is 1,368.")."""


def _validate(o: CalcOptions) -> CalcOptions:
    def fail(field: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"environment.options.{field}: {problem}. Fix: {fix}.")

    if o.num_terms < 2:
        raise fail("num_terms", f"is {o.num_terms}", "use 2 or more (a sum needs two numbers)")
    if not 1 <= o.min_digits <= o.max_digits:
        raise fail("min_digits", f"is {o.min_digits} with max_digits {o.max_digits}",
                   "use 1 <= min_digits <= max_digits")  # fmt: skip
    if "{expression}" not in o.question:
        raise fail("question", f"{o.question!r} has no {{expression}}",
                   "write {expression} where the sum goes")  # fmt: skip
    if o.num_train < 1 or o.num_eval < 0:
        raise fail("num_train", f"is {o.num_train} (num_eval {o.num_eval})",
                   "use num_train >= 1 and num_eval >= 0")  # fmt: skip
    # a few duplicates are redrawn; ask for at most a quarter of the space
    space = sum(9 * 10 ** (d - 1) for d in range(o.min_digits, o.max_digits + 1)) ** o.num_terms
    if 4 * (o.num_train + o.num_eval) > space:
        raise fail("num_train", f"num_train + num_eval = {o.num_train + o.num_eval} is more than"
                   f" a quarter of the {space} possible sums",
                   "lower num_train/num_eval, or raise num_terms or max_digits")  # fmt: skip
    return o


def evaluate_expression(expression: str) -> int:
    """The value of an integer expression of digits, ``+``, ``-``, ``*`` and parentheses
    (spaces ignored), evaluated with the usual precedence; no ``eval``.

    Raises:
        ValueError: anything else, an expression over ``MAX_EXPRESSION_CHARS`` characters, or
            a value over ``MAX_RESULT_DIGITS`` digits (the message uses the tiny model's
            characters).
    """
    text = expression.replace(" ", "")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    value, pos = _sum(text, 0)
    if pos != len(text):
        raise ValueError(f"cannot read the expression from character {pos + 1}")
    return value


def _sum(text: str, pos: int) -> tuple[int, int]:
    value, pos = _product(text, pos)
    while pos < len(text) and text[pos] in "+-":
        op = text[pos]
        rhs, pos = _product(text, pos + 1)
        value = value + rhs if op == "+" else value - rhs
    return value, pos


def _product(text: str, pos: int) -> tuple[int, int]:
    value, pos = _atom(text, pos)
    while pos < len(text) and text[pos] == "*":
        rhs, pos = _atom(text, pos + 1)
        value *= rhs
        if len(str(abs(value))) > MAX_RESULT_DIGITS:
            raise ValueError(f"the value has more than {MAX_RESULT_DIGITS} digits")
    return value, pos


def _atom(text: str, pos: int) -> tuple[int, int]:
    if pos < len(text) and text[pos] == "-":
        value, pos = _atom(text, pos + 1)
        return -value, pos
    if pos < len(text) and text[pos] == "(":
        value, pos = _sum(text, pos + 1)
        if pos >= len(text) or text[pos] != ")":
            raise ValueError("a parenthesis is not closed")
        return value, pos + 1
    end = pos
    while end < len(text) and text[end].isascii() and text[end].isdigit():
        end += 1
    if end == pos:
        raise ValueError(f"a number is missing at character {pos + 1}")
    if end - pos > MAX_RESULT_DIGITS:
        raise ValueError(f"a number has more than {MAX_RESULT_DIGITS} digits")
    return int(text[pos:end]), end


@tool
async def calc(expression: str) -> str:
    """Evaluate an integer expression: digits, + - * and parentheses.

    Args:
        expression: The expression, e.g. 12+345+67.
    """
    try:
        return str(evaluate_expression(expression))
    except ValueError as exc:
        # an answer the model reads, in its own characters (a raise would quote the
        # exception's type with characters the tiny vocabulary lacks)
        return f"error: {exc}"


class CalcEnv:
    """The environment; see the module docstring."""

    tools = [calc]

    def __init__(self, options: CalcOptions, seed: int) -> None:
        self.options = options
        rng = random.Random(f"asyncrl-arith-calc:{seed}")
        seen: set[str] = set()
        problems: list[tuple[str, str]] = []
        while len(problems) < options.num_eval + options.num_train:
            terms = [self._number(rng) for _ in range(options.num_terms)]
            text = "+".join(map(str, terms))
            if text not in seen:
                seen.add(text)
                problems.append((text, str(sum(terms))))
        split, q = options.num_eval, options.question
        self._splits = {
            "eval": tuple(_prompt("eval", t, a, q) for t, a in problems[:split]),
            "train": tuple(_prompt("train", t, a, q) for t, a in problems[split:]),
        }

    def _number(self, rng: random.Random) -> int:
        digits = rng.randint(self.options.min_digits, self.options.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def dataset(self, split: Literal["train", "eval"]) -> Sequence[Prompt]:
        """The prompts of ``split`` (a fixed tuple; the same on every call)."""
        try:
            return self._splits[split]
        except KeyError:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'") from None

    async def run_episode(self, prompt: Prompt, episode: Any) -> Score:
        """Turns until one has no tool call (the answer), the tools answered in between.

        Raises:
            EpisodeLimit: out of turns or context (the run scores the episode 0).

        Cancellation: the turn's request is aborted, a running ``calc`` cancelled.
        """
        called = False
        while True:
            turn = await episode.generate()
            if not turn.calls and not turn.errors:
                break
            called = called or bool(turn.calls)
            await episode.call_tools(turn)
        return score_answer(prompt, turn.text, called, self.options.match)

    def score(self, prompt: Prompt, completion: str) -> Score:
        """A final answer alone: how the gateway scores a session that ends without a reward
        (a managed agent's last answer, docs/gateway.md). Whether a tool was called is not
        known here, so the score's only component is ``exact``."""
        full = score_answer(prompt, completion, False, self.options.match)
        return Score(reward=full.reward, correct=full.correct,
                     components={"exact": full.components["exact"]})  # fmt: skip


_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")


def score_answer(prompt: Prompt, answer: str, called: bool, match: str = "exact") -> Score:
    """Reward 1 for ``answer`` equal to the sum, else 0: the whole of it, trailing whitespace
    ignored (``exact``), or its last integer (``last_number``)."""
    if match == "exact":
        right = answer.rstrip() == prompt.answer
    else:
        numbers = _NUMBER.findall(answer)
        right = bool(numbers) and numbers[-1].replace(",", "") == prompt.answer
    return Score(reward=float(right), correct=right,
                 components={"exact": float(right), "tool_call": float(called)})  # fmt: skip


def _prompt(split: str, text: str, answer: str, question: str) -> Prompt:
    content = question.replace("{expression}", text)
    return Prompt(id=f"{split}:{text}", messages=[{"role": "user", "content": content}],
                  answer=answer)  # fmt: skip


def make_environment(options: dict[str, Any], seed: int) -> CalcEnv:
    """Entry point ``asyncrl.environments:arithmetic-calc``.

    Raises:
        ConfigError: an option is unknown, mistyped or out of range (the message names it).
    """
    try:
        opts = msgspec.convert(dict(options), CalcOptions)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"environment.options: {exc}") from None
    return CalcEnv(_validate(opts), seed)
