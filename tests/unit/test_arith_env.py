"""The arithmetic environment: splits, scoring and option errors (pure Python, no torch)."""

from __future__ import annotations

import re

import pytest

from asyncrl.environment import Environment, Prompt, Score
from asyncrl.errors import ConfigError
from asyncrl_arith.env import ArithmeticEnv, make_environment

PROBLEM = re.compile(r"^(\d+)([-+*])(\d+)=$")


def _solve(text: str) -> str:
    a, op, b = PROBLEM.match(text).groups()  # type: ignore[union-attr]
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


def test_factory_returns_an_environment():
    env = make_environment({}, 0)
    assert isinstance(env, ArithmeticEnv)
    assert isinstance(env, Environment)
    assert len(env.dataset("train")) == 4000
    assert len(env.dataset("eval")) == 500


def test_splits_are_disjoint_and_free_of_duplicates():
    env = make_environment({"num_train": 6000, "num_eval": 1000}, 3)
    train = [p.text for p in env.dataset("train")]
    evals = [p.text for p in env.dataset("eval")]
    assert len(set(train)) == len(train) == 6000
    assert len(set(evals)) == len(evals) == 1000
    assert not set(train) & set(evals)
    ids = [p.id for p in env.dataset("train")] + [p.id for p in env.dataset("eval")]
    assert len(set(ids)) == len(ids)


def test_the_whole_space_can_be_split():
    # 0..9 with + is exactly 100 problems: every one lands in exactly one split
    env = make_environment({"max_operand": 9, "num_train": 80, "num_eval": 20}, 0)
    texts = {p.text for s in ("train", "eval") for p in env.dataset(s)}
    assert texts == {f"{a}+{b}=" for a in range(10) for b in range(10)}


def test_splits_are_deterministic_per_seed():
    a = make_environment({"operators": ["+", "-"]}, 7)
    b = make_environment({"operators": ["+", "-"]}, 7)
    c = make_environment({"operators": ["+", "-"]}, 8)
    for split in ("train", "eval"):
        assert a.dataset(split) == b.dataset(split)
    assert a.dataset("eval") != c.dataset("eval")


def test_answers_match_an_independent_solver_and_respect_options():
    env = make_environment(
        {"operators": ["+", "-", "*"], "min_operand": 3, "max_operand": 40, "num_train": 2000}, 1
    )
    ops = set()
    for p in list(env.dataset("train")) + list(env.dataset("eval")):
        a, op, b = PROBLEM.match(p.text).groups()  # type: ignore[union-attr]
        ops.add(op)
        assert 3 <= int(a) <= 40 and 3 <= int(b) <= 40
        assert p.answer == _solve(p.text)
        if op == "-":
            assert int(a) >= int(b)  # allow_negative defaults to false
        assert p.id.endswith(p.text)
    assert ops == {"+", "-", "*"}


def test_negative_answers_when_allowed():
    env = make_environment(
        {"operators": ["-"], "max_operand": 9, "allow_negative": True, "num_train": 90,
         "num_eval": 10},
        0,
    )
    answers = [p.answer for p in env.dataset("train")] + [p.answer for p in env.dataset("eval")]
    assert any(a.startswith("-") for a in answers)
    # without negatives the 0..9 subtraction space is the 55 pairs a >= b
    with pytest.raises(ConfigError, match="55 distinct problems"):
        make_environment({"operators": ["-"], "max_operand": 9, "num_train": 50,
                          "num_eval": 10}, 0)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("46", 1.0),
        ("46 ", 1.0),
        ("46\n", 1.0),
        ("46 \t\n", 1.0),
        (" 46", 0.0),
        ("046", 0.0),
        ("4", 0.0),
        ("47", 0.0),
        ("46+1", 0.0),
        ("46.", 0.0),
        ("", 0.0),
        ("464", 0.0),
    ],
)
def test_score_is_strict_exact_match(completion: str, reward: float):
    env = make_environment({}, 0)
    prompt = Prompt(id="x", text="12+34=", answer="46")
    score = env.score(prompt, completion)
    assert score == Score(reward=reward, correct=reward == 1.0)


def test_score_on_dataset_prompts():
    env = make_environment({"operators": ["-"], "allow_negative": True}, 0)
    for p in env.dataset("eval")[:50]:
        assert env.score(p, _solve(p.text)).correct
        assert not env.score(p, str(int(_solve(p.text)) + 1)).correct


def test_unknown_split_is_an_error():
    with pytest.raises(ValueError, match="unknown split"):
        make_environment({}, 0).dataset("test")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_operands": 9}, "max_operands"),
        ({"max_operand": "99"}, "max_operand"),
        ({"operators": ["/"]}, "operators"),
        ({"operators": []}, "operators"),
        ({"operators": ["+", "+"]}, "operators"),
        ({"min_operand": -1}, "min_operand"),
        ({"min_operand": 50, "max_operand": 10}, "max_operand"),
        ({"num_train": 0}, "num_train"),
        ({"num_eval": -1}, "num_eval"),
        ({"num_train": 9000, "num_eval": 1001}, "num_train"),
        ({"allow_negative": "yes"}, "allow_negative"),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str):
    with pytest.raises(ConfigError, match=rf"\b{field}\b"):
        make_environment(options, 0)


@pytest.mark.parametrize(
    ("text", "slipped"),
    [
        ("38+45=", "73"),  # 83 without the units carry
        ("95+18=", "103"),  # 113: the tens overflow is still written in full
        ("7+8=", "5"),  # 15
        ("12+34=", None),  # no carry: the sloppy teacher gets it right
        ("52-18=", "44"),  # 34 without the units borrow
        ("58-12=", None),
        ("5-7=", None),  # negative results are left alone
        ("3*4=", None),
    ],
)
def test_sloppy_teacher_forgets_only_the_units_carry(text: str, slipped: str | None):
    from asyncrl_arith.sft import forgot_carry  # imports no torch

    assert forgot_carry(Prompt(id="x", text=text)) == slipped
    if slipped is not None:
        assert slipped != _solve(text)
