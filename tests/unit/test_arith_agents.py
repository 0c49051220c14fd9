"""The agent examples of ``asyncrl-arith``: the compact tool-call parser, the ``calc`` tool,
the two environments' scoring, and the tiny chat template's prefix property.

References are independent of the code under test: hand-written expectations, Python's own
integer arithmetic, and the conversation rendered whole by Jinja (the template source through
``jinja2`` directly) against the :class:`~asyncrl.env.trajectory.Trajectory` record.
"""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import jinja2
import numpy as np
import pytest

from asyncrl.data.chat import ChatTemplate
from asyncrl.env.episode import Episode, Generated, Limits
from asyncrl.env.tool_parsers import load_tool_parser
from asyncrl.env.toolbox import ToolBox
from asyncrl.env.trajectory import Trajectory
from asyncrl.environment import Prompt
from asyncrl.errors import ConfigError
from asyncrl_arith.calc_env import calc, evaluate_expression, make_environment as make_calc
from asyncrl_arith.chat import PARSER, TEMPLATE, CompactParser
from asyncrl_arith.feedback_env import FEEDBACK, make_environment as make_feedback, score_turns
from asyncrl_arith.model import CHARS

# ---------------------------------------------------------------- the parser


def test_the_parser_is_the_compact_entry_point() -> None:
    assert isinstance(load_tool_parser("compact"), CompactParser)


@pytest.mark.parametrize(
    ("text", "calls", "errors", "content"),
    [
        ("424", [], [], "424"),
        ("calc(12+345+67)", [("calc", "12+345+67")], [], ""),
        ("calc((1+2)*3)", [("calc", "(1+2)*3")], [], ""),
        ("calc(1+2)calc(3+4)", [("calc", "1+2"), ("calc", "3+4")], [], ""),
        ("see calc(1+2) and calc(3", [("calc", "1+2")], [2], "see  and"),
        ("calc(12+3", [], [1], ""),
        ("calc()", [], [1], ""),
        ("calc(  )x", [], [1], "x"),
        ("(12+3)", [], [], "(12+3)"),
        (")))calc(1))", [("calc", "1")], [], "))))"),
        ("xcalc(1)", [("xcalc", "1")], [], ""),  # an unknown tool: the box answers it
        ("1368calc(1)", [("calc", "1")], [], "1368"),
        ("Calc(1)", [], [], "Calc(1)"),  # upper case is not a name
        ("<eos>calc(1)", [("calc", "1")], [], "<eos>"),
        ("", [], [], ""),
    ],
)
def test_parse(text: str, calls: list, errors: list, content: str) -> None:
    turn = PARSER.parse(text)
    assert [(c.name, c.arguments["expression"]) for c in turn.calls] == calls
    assert [e.index for e in turn.errors] == errors
    assert turn.content == content
    # numbered together, in the order written, from 1
    assert sorted([c.index for c in turn.calls] + [e.index for e in turn.errors]) == list(
        range(1, len(calls) + len(errors) + 1)
    )


def test_parse_error_messages_use_the_vocabulary() -> None:
    for text in ("calc(12+3", "calc()", "calc(1)calc("):
        for error in PARSER.parse(text).errors:
            assert error.message.startswith(f"error: tool call {error.index} ")
            assert set(error.message) <= set(CHARS), error.message


def test_parse_never_raises_on_junk() -> None:
    rng = random.Random(0)
    alphabet = "calc()+-*0123456789 xyz_<>{}\"\\\n\u00e9\U0001f600"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        turn = PARSER.parse(text)
        for c in turn.calls:  # every call's text is in the turn as written
            assert f"{c.name}({c.arguments['expression']})" in text


# ---------------------------------------------------------------- the calc tool


def _call(expression: str) -> str:
    async def go() -> str:
        return await calc(expression=expression)

    return anyio.run(go)


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12+345+67", 424), ("2*3+4", 10), ("2*(3+4)", 14), ("10-2-3", 5), ("-5+2", -3),
     (" 1 + 2 ", 3), ("007", 7)],
)  # fmt: skip
def test_calc_values(expression: str, value: int) -> None:
    assert evaluate_expression(expression) == value
    assert _call(expression) == str(value)


@pytest.mark.parametrize(
    "bad", ["", "1+", "(1+2", "1+2)", "1/2", "abc", "1" * 61, "9" * 30 + "*" + "9" * 31]
)
def test_calc_refuses_with_a_readable_error(bad: str) -> None:
    with pytest.raises(ValueError):
        evaluate_expression(bad)
    answer = _call(bad)
    assert answer.startswith("error: ") and set(answer) <= set(CHARS), answer


def test_calc_against_python_on_random_sums() -> None:
    rng = random.Random(1)
    for _ in range(500):
        terms = [rng.randint(0, 99_999) for _ in range(rng.randint(1, 6))]
        ops = [rng.choice("+-*") for _ in terms[1:]]
        text = str(terms[0]) + "".join(o + str(t) for o, t in zip(ops, terms[1:]))
        assert evaluate_expression(text) == eval(text)  # noqa: S307 - the reference, digits only


# ---------------------------------------------------------------- the environments


def test_calc_splits() -> None:
    env = make_calc({"num_train": 300, "num_eval": 50}, seed=0)
    train, evals = env.dataset("train"), env.dataset("eval")
    assert (len(train), len(evals)) == (300, 50)
    texts = [p.messages[0]["content"] for p in [*train, *evals]]
    assert len(set(texts)) == 350  # disjoint, no repeats
    for p, text in zip([*train, *evals], texts):
        terms = [int(t) for t in text.split("+")]
        assert len(terms) == 3 and all(10 <= t <= 999 for t in terms)
        assert p.answer == str(sum(terms))
    assert [p.id for p in make_calc({"num_train": 300, "num_eval": 50}, 0).dataset("eval")] == [
        p.id for p in evals
    ]
    assert set(CHARS) >= set("".join(texts))


@pytest.mark.parametrize(
    "options", [{"num_terms": 1}, {"min_digits": 0}, {"min_digits": 3, "max_digits": 2},
                {"num_terms": 2, "max_digits": 1, "num_train": 30}, {"bogus": 1}],
)  # fmt: skip
def test_calc_options_are_checked(options: dict) -> None:
    with pytest.raises(ConfigError, match="environment.options"):
        make_calc(options, 0)


def test_feedback_scoring() -> None:
    p = Prompt(id="p", messages=[{"role": "user", "content": "38+45"}], answer="83")
    cases = [(["83"], 1.0, True, 1, 0), (["83 "], 1.0, True, 1, 0), (["73", "83"], 0.5, True, 0, 1),
             (["73", "73"], 0.0, False, 0, 0), (["083", "84"], 0.0, False, 0, 0)]  # fmt: skip
    for answers, reward, correct, first, second in cases:
        s = score_turns(p, answers)
        assert (s.reward, s.correct) == (reward, correct), answers
        assert s.components == {"first": first, "second": second,
                                "retried": float(len(answers) > 1)}  # fmt: skip
    assert score_turns(p, ["1", "83"], retry_reward=0.25).reward == 0.25


def test_feedback_splits_are_the_arithmetic_demos() -> None:
    from asyncrl_arith.env import make_environment as make_arith

    fb, ar = make_feedback({}, 0), make_arith({}, 0)
    for split in ("train", "eval"):
        assert [p.messages[0]["content"] + "=" for p in fb.dataset(split)] == [
            p.text for p in ar.dataset(split)
        ]
    with pytest.raises(ConfigError, match="retry_reward"):
        make_feedback({"retry_reward": 1.5}, 0)


# ---------------------------------------------------------------- episodes, scripted


def _tiny_dir(tmp_path: Path) -> Path:
    from asyncrl_arith.chat import write_chat_template
    from asyncrl_arith.model import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    write_chat_template(tmp_path)
    return tmp_path


def _tools(tmp_path: Path):
    from asyncrl.data.prompts import Tokenizer

    template = ChatTemplate.from_model(str(tmp_path))
    assert template is not None
    return template, Tokenizer(str(tmp_path / "tokenizer.json"), 2, template)


def _play(tmp_path: Path, env, prompt: Prompt, replies: list[str]):
    """Run ``env``'s episode with scripted turns; the score and the trajectory."""
    template, tok = _tools(tmp_path)
    record = Trajectory(template, tok, list(prompt.messages), episode="e", end_token_ids=[2])
    queue = list(replies)

    async def source(prompt_ids: list[int], max_tokens: int) -> Generated:
        ids = tok._tok.encode(queue.pop(0), add_special_tokens=False).ids + [2]
        return Generated(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop", 0)

    box = ToolBox(getattr(env, "tools", []), timeout_s=5.0) if getattr(env, "tools", None) else None
    episode = Episode(episode_id="e", prompt=prompt, record=record, source=source,
                      limits=Limits(4, 160, 24), tools=box,
                      parser=PARSER if box else None)  # fmt: skip
    score = anyio.run(env.run_episode, prompt, episode)
    return score, record


def test_calc_episode_with_a_call(tmp_path: Path) -> None:
    env = make_calc({"num_train": 10, "num_eval": 2}, 0)
    prompt = env.dataset("eval")[0]
    q = prompt.messages[0]["content"]
    score, record = _play(_tiny_dir(tmp_path), env, prompt, [f"calc({q})", prompt.answer])
    assert (score.reward, score.correct, score.components["tool_call"]) == (1.0, True, 1.0)
    (sample,) = record.samples()
    text = tok_decode(tmp_path, sample.token_ids)
    assert text == f"<bos>{q}=calc({q})<eos>r:{prompt.answer}={prompt.answer}<eos>"
    # generated: the call and its <eos>, the answer and its <eos>; inserted: "r:<sum>="
    assert sample.loss_mask.tolist() == [1] * (len(q) + 7) + [0] * (len(prompt.answer) + 3) + [
        1
    ] * (len(prompt.answer) + 1)


def test_calc_episode_scores(tmp_path: Path) -> None:
    env = make_calc({"num_train": 10, "num_eval": 2}, 0)
    prompt = env.dataset("eval")[0]
    d = _tiny_dir(tmp_path)
    wrong = str(int(prompt.answer) + 1)
    assert _play(d, env, prompt, [prompt.answer])[0].components == {"exact": 1.0, "tool_call": 0.0}
    assert _play(d, env, prompt, [wrong])[0].reward == 0.0
    # a malformed call is answered, and the next turn is the answer
    score, record = _play(d, env, prompt, ["calc(1+", prompt.answer])
    assert (score.reward, score.components["tool_call"]) == (1.0, 0.0)
    assert record.messages[2]["content"].startswith("error: tool call 1 is not closed")


def test_feedback_episode(tmp_path: Path) -> None:
    env = make_feedback({"num_train": 10, "num_eval": 2}, 0)
    prompt = env.dataset("eval")[0]
    d = _tiny_dir(tmp_path)
    score, record = _play(d, env, prompt, ["0", prompt.answer])
    assert (score.reward, score.correct) == (0.5, True)
    assert [m["role"] for m in record.messages] == ["user", "assistant", "user", "assistant"]
    assert record.messages[2]["content"] == FEEDBACK
    score, record = _play(d, env, prompt, [prompt.answer])
    assert (score.reward, len(record.messages)) == (1.0, 2)


def tok_decode(model_dir: Path, ids) -> str:
    """Token by token (a character vocabulary: each token is its text)."""
    _, tok = _tools(model_dir)
    return "".join(tok._tok.id_to_token(int(i)) for i in ids)


# ---------------------------------------------------------------- the template


def test_template_uses_the_vocabulary_only() -> None:
    rendered = ChatTemplate(TEMPLATE).render(
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
         {"role": "tool", "content": ""}], add_generation_prompt=True,
    )  # fmt: skip
    assert rendered == "<bos>=<eos>r:="
    assert set(rendered.replace("<bos>", "").replace("<eos>", "")) <= set(CHARS)
    with pytest.raises(ConfigError, match="not bot"):
        ChatTemplate(TEMPLATE).render([{"role": "bot", "content": "1"}])


def _random_conversation(rng: random.Random) -> list[dict]:
    pieces = ["12+345+67", "calc(1+2)", "424", "", " ", "wrong, try again", "(", "<eos>",
              "<bos>", ")", "a:b", "=", "r:", "error: x"]  # fmt: skip
    roles = ["user"]
    for _ in range(rng.randint(0, 6)):
        roles.append("assistant")
        roles.extend(rng.choice([["user"], ["tool"], ["tool", "tool"], ["system"]]))
    # an end token inside a turn is not a turn (Trajectory refuses it)
    return [{"role": r, "content": "".join(rng.choice(pieces[:-7] if r == "assistant" else pieces)
                                           for _ in range(rng.randint(0, 3)))}
            for r in roles]  # fmt: skip


def test_the_template_never_splits(tmp_path: Path) -> None:
    """500 random conversations, played turn by turn through a Trajectory that refuses a
    mismatch: every one is one sample whose text is the whole conversation rendered at once
    by plain jinja2 (an independent render), assistant turns trained and nothing else."""
    d = _tiny_dir(tmp_path)
    template, tok = _tools(d)
    reference = jinja2.Environment().from_string(TEMPLATE)
    rng = random.Random(7)
    turns = 0
    for n in range(500):
        conversation = _random_conversation(rng)
        traj = Trajectory(template, tok, conversation[:1], episode=f"c{n}", end_token_ids=[2],
                          on_mismatch="refuse")  # fmt: skip
        k, expected_mask = 1, []
        while k < len(conversation):
            assert conversation[k]["role"] == "assistant"
            text = conversation[k]["content"]
            ids = tok._tok.encode(text, add_special_tokens=False).ids
            cut = rng.random() < 0.2  # a turn cut at the limit: no <eos> generated
            ids = ids if cut and ids else ids + [2]
            traj.add_turn(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), 0,
                          "length" if cut and ids[-1] != 2 else "stop")  # fmt: skip
            turns += 1
            k += 1
            obs = []
            while k < len(conversation) and conversation[k]["role"] != "assistant":
                obs.append(conversation[k])
                k += 1
            if obs:
                traj.add_messages(obs)
                traj.prompt_ids  # noqa: B018 - renders the observation (the prefix check)
        assert traj.splits == 0
        samples = traj.samples()
        if turns and len(conversation) > 1:
            (sample,) = samples
            whole = reference.render(messages=traj.messages, add_generation_prompt=False,
                                     raise_exception=None)  # fmt: skip
            text = "".join(tok._tok.id_to_token(int(i)) for i in sample.token_ids)
            assert whole.startswith(text), (conversation, text, whole)
    assert turns > 1000


def test_calc_question_and_last_number() -> None:
    env = make_calc({"num_train": 5, "num_eval": 1, "question": "What is {expression}? Use calc.",
                     "match": "last_number"}, 0)  # fmt: skip
    p = env.dataset("eval")[0]
    expression = p.id.split(":", 1)[1]
    assert p.messages[0]["content"] == f"What is {expression}? Use calc."
    from asyncrl_arith.calc_env import score_answer

    big = Prompt(id="x", messages=[{"role": "user", "content": "q"}], answer="1368")
    for text, right in [("The sum is 1368.", True), ("1,368", True), ("1368 or 12", False),
                        ("13,68", False), ("no number", False), ("-1368", False),
                        ("21368", False), ("1368", True)]:  # fmt: skip
        assert score_answer(big, text, False, "last_number").correct is right, text
    assert not score_answer(big, "The sum is 1368.", False).correct  # exact
    with pytest.raises(ConfigError, match="question"):
        make_calc({"question": "no placeholder"}, 0)
