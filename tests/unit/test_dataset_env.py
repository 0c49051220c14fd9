"""The built-in ``dataset`` environment: every file kind, splits, prompt shapes, reward
functions (module and file, sync and async), the errors naming their option, the Scorer with
an async environment, and the ``reward/<name>`` step metrics. Expected values are written out
by hand from the rows below."""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.run import preflight
from asyncrl.policy.groups import CompletedSample, Group
from asyncrl.data.dataset import AsyncDatasetEnvironment, DatasetEnvironment, make_environment
from asyncrl.environment import Prompt, Score
from asyncrl.errors import ConfigError
from asyncrl.run.scoring import ASYNC_SCORE_CONCURRENCY, ScoreError, Scorer
from asyncrl.wire.messages import StepResult
from asyncrl.data.rewards import RewardError
from asyncrl.policy.counts import StepStats
from asyncrl.obs.steps import StepRecord, TrainRecord
from scoring_support import DigitsTokenizer, group_of

pytestmark = pytest.mark.timeout(60)

datasets.disable_progress_bars()  # save_to_disk's bars would only clutter the test output


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


ROWS: list[dict[str, Any]] = [
    {"question": "1+1", "solution": 2, "topic": "add", "note": None, "chat": chat("one")},
    {"question": "2*3", "solution": 6, "topic": "mul", "note": "x", "chat": chat("two")},
    {"question": "5-4", "solution": 1, "topic": "sub", "note": "y", "chat": chat("three")},
    {"question": "3+4", "solution": 7, "topic": "add", "note": None, "chat": chat("four")},
    {"question": "9-2", "solution": 7, "topic": "sub", "note": "z", "chat": chat("five")},
    {"question": "2*2", "solution": 4, "topic": "mul", "note": None, "chat": chat("six")},
    {"question": "8+1", "solution": 9, "topic": "add", "note": "w", "chat": chat("seven")},
    {"question": "6-6", "solution": 0, "topic": "sub", "note": None, "chat": chat("eight")},
    {"question": "1*7", "solution": 7, "topic": "mul", "note": "v", "chat": chat("nine")},
    {"question": "4+4", "solution": 8, "topic": "add", "note": None, "chat": chat("ten")},
]
TEST_ROWS = [
    {"question": "7+7", "solution": 14, "topic": "add", "note": None, "chat": chat("t1")},
    {"question": "3*3", "solution": 9, "topic": "mul", "note": "q", "chat": chat("t2")},
]

REWARDS = """
import anyio

def exact(completion, answer):
    return completion.strip() == str(answer["solution"])

def length(completion):
    return len(completion)

async def topic(prompt, completion):
    await anyio.sleep(0)
    return 1.0 if prompt.answer["topic"] == "add" else -1.0

async def slow_a(completion):
    await anyio.sleep(0.2)
    return 1

async def slow_b(completion):
    await anyio.sleep(0.2)
    return 2

def everything(**kwargs):
    return float(sorted(kwargs) == ["answer", "completion", "prompt"])

def boom(completion):
    raise ZeroDivisionError("no reward today")

def words(completion):
    return "yes"

def needs_x(completion, x):
    return 0

def takes_nothing():
    return 0

NOT_CALLABLE = 3
"""


# ------------------------------------------------------------------------------- writers
def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    # a blank line between rows: skipped, and line numbers in errors still count it
    path.write_text("\n\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_dataset(path: Path, rows: list[dict[str, Any]], shards: int = 1) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=shards)
    return path


def write_dataset_dict(path: Path, **splits: list[dict[str, Any]]) -> Path:
    datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    ).save_to_disk(str(path))
    return path


@pytest.fixture
def rewards_module(tmp_path: Path) -> Any:
    """``REWARDS`` as a uniquely named module beside the "config" (forgotten afterwards)."""
    name = f"rw_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    yield name
    sys.modules.pop(name, None)


def env_of(tmp_path: Path, seed: int = 0, **options: Any) -> Any:
    return make_environment(options, seed, base_dir=tmp_path)


def expected(rows: list[dict[str, Any]], split: str = "train") -> list[Prompt]:
    """The prompts written out by hand: text = question, answer = every other field."""
    return [
        Prompt(
            id=f"{split}-{i}",
            text=r["question"],
            answer={k: v for k, v in r.items() if k != "question"},
        )
        for i, r in enumerate(rows)
    ]


# ------------------------------------------------------------------------------ file kinds
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset", "dataset-2-shards", "dict"])
def test_every_file_kind_gives_the_same_prompts(
    tmp_path: Path, rewards_module: str, kind: str
) -> None:
    if kind == "jsonl":
        train = write_jsonl(tmp_path / "t.jsonl", ROWS)
    elif kind == "parquet":
        train = write_parquet(tmp_path / "t.parquet", ROWS)
    elif kind == "dataset":
        train = write_dataset(tmp_path / "ds", ROWS)
    elif kind == "dataset-2-shards":
        train = write_dataset(tmp_path / "ds", ROWS, shards=2)
    else:
        train = write_dataset_dict(tmp_path / "dd", train=ROWS, test=TEST_ROWS)
    env = env_of(
        tmp_path,
        train=train.name,
        prompt_field="question",
        rewards=[{"function": f"{rewards_module}:exact"}],
    )
    assert isinstance(env, DatasetEnvironment) and not isinstance(env, AsyncDatasetEnvironment)
    assert list(env.dataset("train")) == expected(ROWS)
    assert list(env.dataset("eval")) == []
    assert env.dataset("train") is env.dataset("train")  # read once
    with pytest.raises(ValueError, match="unknown split"):
        env.dataset("test")  # type: ignore[arg-type]


def test_dataset_dict_splits_are_picked_by_name(tmp_path: Path, rewards_module: str) -> None:
    write_dataset_dict(tmp_path / "dd", train=ROWS, test=TEST_ROWS, validation=ROWS[:2])
    base = {"prompt_field": "question", "rewards": [{"function": f"{rewards_module}:exact"}]}
    env = env_of(tmp_path, train="dd", eval="dd", **base)
    assert list(env.dataset("train")) == expected(ROWS)
    assert list(env.dataset("eval")) == expected(TEST_ROWS, "eval")
    env = env_of(
        tmp_path, train="dd", train_split="test", eval="dd", eval_split="validation", **base
    )
    assert list(env.dataset("train")) == expected(TEST_ROWS)
    assert list(env.dataset("eval")) == expected(ROWS[:2], "eval")


def test_eval_file_of_another_kind(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    write_parquet(tmp_path / "e.parquet", TEST_ROWS)
    env = env_of(
        tmp_path,
        train="t.jsonl",
        eval="e.parquet",
        prompt_field="question",
        rewards=[{"function": f"{rewards_module}:exact"}],
    )
    assert list(env.dataset("eval")) == expected(TEST_ROWS, "eval")


def test_eval_held_out_is_disjoint_and_seeded(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS)

    def split(seed: int) -> tuple[list[Prompt], list[Prompt]]:
        env = env_of(
            tmp_path,
            seed,
            train="t.jsonl",
            eval_size=3,
            prompt_field="question",
            rewards=[{"function": f"{rewards_module}:exact"}],
        )
        return list(env.dataset("train")), list(env.dataset("eval"))

    train, evals = split(7)
    assert len(evals) == 3 and len(train) == 7
    assert not {p.id for p in train} & {p.id for p in evals}
    # together they are the file, each row as read (held-out rows keep their train-<row> id)
    assert sorted(train + evals, key=lambda p: int(p.id.split("-")[1])) == expected(ROWS)
    # both keep the file's order
    assert [p.id for p in train] == sorted((p.id for p in train), key=lambda s: int(s[6:]))
    assert [p.id for p in evals] == sorted((p.id for p in evals), key=lambda s: int(s[6:]))
    assert split(7) == (train, evals)  # the same seed: the same split
    held = {tuple(p.id for p in split(s)[1]) for s in range(8)}
    assert len(held) > 1  # the seed decides (8 seeds, 120 possible 3-subsets)


# ---------------------------------------------------------------------------- prompt shapes
def test_template_and_system_prompt(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    common = {"train": "t.jsonl", "rewards": [{"function": f"{rewards_module}:exact"}]}
    env = env_of(
        tmp_path,
        prompt_field="question",
        prompt_template="[{topic}] {question}\nAnswer with a number.",
        **common,
    )
    assert [p.text for p in env.dataset("train")] == [
        "[add] 1+1\nAnswer with a number.",
        "[mul] 2*3\nAnswer with a number.",
    ]
    env = env_of(
        tmp_path,
        prompt_field="question",
        prompt_template="Q: {question}",
        system_prompt="Be brief.",
        **common,
    )
    p = env.dataset("train")[1]
    assert p.text == ""
    assert p.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2*3"},
    ]


def test_messages_field_answer_fields_and_id_field(tmp_path: Path, rewards_module: str) -> None:
    rows = [dict(r, uid=f"u{i}") for i, r in enumerate(ROWS[:3])]
    write_parquet(tmp_path / "t.parquet", rows)
    env = env_of(
        tmp_path,
        train="t.parquet",
        messages_field="chat",
        answer_fields=["solution", "note"],
        id_field="uid",
        rewards=[{"function": f"{rewards_module}:exact"}],
    )
    assert list(env.dataset("train")) == [
        Prompt(
            id="u0",
            messages=[{"role": "user", "content": "one"}],
            answer={"solution": 2, "note": None},
        ),
        Prompt(
            id="u1",
            messages=[{"role": "user", "content": "two"}],
            answer={"solution": 6, "note": "x"},
        ),
        Prompt(
            id="u2",
            messages=[{"role": "user", "content": "three"}],
            answer={"solution": 1, "note": "y"},
        ),
    ]


# -------------------------------------------------------------------------------- rewards
def sub_file(tmp_path: Path) -> str:
    """A reward file in a sub-directory that imports a neighbour module."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / f"helper_{tmp_path.name}.py").write_text("SIGN = -1.0\n")
    (tmp_path / "sub" / "more.py").write_text(
        f"from helper_{tmp_path.name} import SIGN\n\n"
        "async def signed(completion):\n"
        "    return SIGN * len(completion)\n\n"
        "def mentions(prompt, completion):\n"
        "    return prompt.text in completion\n"
    )
    return "sub/more.py"


def test_sync_rewards_by_module_and_file(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    path = sub_file(tmp_path)
    env = env_of(
        tmp_path,
        train="t.jsonl",
        prompt_field="question",
        rewards=[
            {"function": f"{rewards_module}:exact", "weight": 2.0},
            {"function": f"{rewards_module}:length", "weight": 0.5, "name": "len"},
            {"function": f"{path}:mentions", "weight": 3.0},
            {"function": f"{rewards_module}:everything", "weight": 0.25},
        ],
    )
    assert not isinstance(env, AsyncDatasetEnvironment)
    p = env.dataset("train")[0]  # 1+1 = 2
    # exact 1, len 2, mentions 0, everything 1 -> 2*1 + 0.5*2 + 3*0 + 0.25*1 = 3.25
    assert env.score(p, " 2") == Score(
        3.25, True, {"exact": 1.0, "len": 2.0, "mentions": 0.0, "everything": 1.0}
    )
    # exact 0, len 7, mentions 1, everything 1 -> 0 + 3.5 + 3 + 0.25 = 6.75
    assert env.score(p, "1+1 = 3") == Score(
        6.75, False, {"exact": 0.0, "len": 7.0, "mentions": 1.0, "everything": 1.0}
    )


@pytest.mark.anyio
async def test_async_rewards_weights_components_and_correct_reward(
    tmp_path: Path, rewards_module: str
) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    path = sub_file(tmp_path)
    rewards = [
        {"function": f"{rewards_module}:exact", "weight": 2.0},
        {"function": f"{rewards_module}:topic", "weight": -1.0},
        {"function": f"{path}:signed", "weight": 0.5},
    ]
    env = env_of(tmp_path, train="t.jsonl", prompt_field="question", rewards=rewards)
    assert isinstance(env, AsyncDatasetEnvironment)
    add, mul = env.dataset("train")
    # exact 1, topic +1 (add), signed -2 -> 2 - 1 - 1 = 0
    assert await env.score_async(add, " 2") == Score(
        0.0, True, {"exact": 1.0, "topic": 1.0, "signed": -2.0}
    )
    # exact 0, topic -1 (mul), signed -1 -> 0 + 1 - 0.5 = 0.5
    assert await env.score_async(mul, "5") == Score(
        0.5, False, {"exact": 0.0, "topic": -1.0, "signed": -1.0}
    )
    env = env_of(
        tmp_path, train="t.jsonl", prompt_field="question", rewards=rewards, correct_reward="topic"
    )
    assert (await env.score_async(add, "5")).correct is True  # topic +1 > 0, exact 0
    assert (await env.score_async(mul, "6")).correct is False  # topic -1, exact 1
    # score() does not start an event loop of its own
    with pytest.raises(
        TypeError, match=r"async reward functions \(topic, signed\).*await score_async"
    ):
        env.score(add, " 2")


@pytest.mark.anyio
async def test_reward_errors_name_the_reward(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    for fn, problem in [
        ("boom", "raised ZeroDivisionError: no reward today"),
        ("words", "returned 'yes'"),
    ]:
        env = env_of(
            tmp_path,
            train="t.jsonl",
            prompt_field="question",
            rewards=[{"function": f"{rewards_module}:{fn}", "name": "mine"}],
        )
        p = env.dataset("train")[0]
        with pytest.raises(
            RewardError, match=f"reward 'mine' \\({rewards_module}:{fn}\\) {problem}"
        ):
            env.score(p, "2")
        env = env_of(
            tmp_path,
            train="t.jsonl",
            prompt_field="question",
            rewards=[
                {"function": f"{rewards_module}:topic"},
                {"function": f"{rewards_module}:{fn}", "name": "mine"},
            ],
        )
        with pytest.raises(RewardError, match=f"reward 'mine' .*{problem}"):
            await env.score_async(p, "2")


# --------------------------------------------------------------------------------- errors
def bad_rows(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "notjson.jsonl").write_text('{"question": "a"}\n{"question": \n')
    (tmp_path / "list.jsonl").write_text('{"question": "a"}\n[1, 2]\n')
    write_jsonl(tmp_path / "noq.jsonl", [ROWS[0], {"solution": 3}])
    write_jsonl(tmp_path / "intq.jsonl", [ROWS[0], {"question": 5}])
    write_jsonl(tmp_path / "dup.jsonl", [dict(ROWS[0], uid="a"), dict(ROWS[1], uid="a")])
    write_jsonl(tmp_path / "badchat.jsonl", [{"chat": [{"role": "user"}]}])
    (tmp_path / "t.csv").write_text("question\n1+1\n")
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\n")


ERRORS = [
    (
        {"promt_field": "q"},
        "environment.options.promt_field: unknown key",
        "did you mean 'prompt_field'",
    ),
    ({"messages_field": "chat"}, "environment.options.prompt_field", "exactly one"),
    ({"prompt_field": None}, "environment.options.prompt_field", "exactly one"),
    (
        {"prompt_field": None, "messages_field": "chat", "system_prompt": "s"},
        "environment.options.system_prompt",
        "prompt_field only",
    ),
    ({"prompt_template": "{} and {question}"}, "environment.options.prompt_template", "positional"),
    ({"prompt_template": "{question"}, "environment.options.prompt_template", "not a str.format"),
    ({"prompt_template": "{nope}"}, "environment.options.train", "line 1 has no field 'nope'"),
    ({"prompt_template": "{solution:.2q}"}, "environment.options.prompt_template", "line 1"),
    ({"eval_size": -1}, "environment.options.eval_size", ">= 0"),
    ({"eval_size": 10}, "environment.options.eval_size", "only 10 rows"),
    ({"eval": "t.jsonl", "eval_size": 2}, "environment.options.eval_size", "not both"),
    ({"eval_split": "test"}, "environment.options.eval_split", "without eval"),
    ({"train": "missing.jsonl"}, "environment.options.train", "missing.jsonl"),
    ({"eval": "missing.parquet"}, "environment.options.eval", "missing.parquet"),
    ({"train": "t.csv"}, "environment.options.train", "not a .jsonl or .parquet"),
    ({"train": "empty.jsonl"}, "environment.options.train", "empty.jsonl has no rows"),
    ({"train": "notjson.jsonl"}, "environment.options.train", "notjson.jsonl line 2 is not JSON"),
    ({"train": "list.jsonl"}, "environment.options.train", "line 2 is a JSON list"),
    (
        {"train": "noq.jsonl"},
        "environment.options.train",
        "noq.jsonl line 3 has no field 'question' (named by environment.options.prompt_field",
    ),
    (
        {"answer_fields": ["solution", "level"]},
        "environment.options.train",
        "no field 'level' (named by environment.options.answer_fields",
    ),
    ({"train": "intq.jsonl"}, "environment.options.train", "line 3 field 'question' is 5"),
    (
        {"train": "dup.jsonl", "id_field": "uid"},
        "environment.options.id_field",
        "line 3 repeats the id 'a' of",
    ),
    ({"id_field": "uid"}, "environment.options.train", "no field 'uid'"),
    (
        {"train": "badchat.jsonl", "prompt_field": None, "messages_field": "chat"},
        "environment.options.train",
        "field 'chat' is",
    ),
    ({"train_split": "train"}, "environment.options.train_split", "DatasetDict"),
    ({"train": "plain_dir"}, "environment.options.train", "without state.json"),
    ({"rewards": []}, "environment.options.rewards: is empty", "list at least one"),
    (
        {"rewards": [{"function": "exact"}]},
        "environment.options.rewards[0].function",
        "not 'module:attr'",
    ),
    (
        {"rewards": [{"function": "no_such_module_xyz:f"}]},
        "environment.options.rewards[0].function",
        "ModuleNotFoundError",
    ),
    (
        {"rewards": [{"function": "broken.py:f"}]},
        "environment.options.rewards[0].function",
        "No module named 'no_such_module_anywhere'",
    ),
    (
        {"rewards": [{"function": "nowhere/r.py:f"}]},
        "environment.options.rewards[0].function",
        "no file",
    ),
    (
        {"rewards": [{"function": "MOD:exact"}, {"function": "MOD:nope"}]},
        "environment.options.rewards[1].function",
        "has no attribute 'nope'",
    ),
    (
        {"rewards": [{"function": "MOD:NOT_CALLABLE"}]},
        "environment.options.rewards[0].function",
        "is of type 'int', not a function",
    ),
    (
        {"rewards": [{"function": "MOD:needs_x"}]},
        "environment.options.rewards[0].function",
        "requires parameter(s) x",
    ),
    (
        {"rewards": [{"function": "MOD:takes_nothing"}]},
        "environment.options.rewards[0].function",
        "takes none of them",
    ),
    (
        {"rewards": [{"function": "MOD:exact"}, {"function": "MOD:length", "name": "exact"}]},
        "environment.options.rewards[1].name",
        "distinct name",
    ),
    (
        {"rewards": [{"function": "MOD:exact", "weight": math.nan}]},
        "environment.options.rewards[0].weight",
        "finite",
    ),
    (
        {"rewards": [{"function": "MOD:exact", "wieght": 2}]},
        "environment.options.rewards[0].wieght: unknown key",
        "remove or rename",
    ),
    ({"correct_reward": "length"}, "environment.options.correct_reward", "'exact'"),
    ({"train": 3}, "environment.options.train", "expected str"),
]


@pytest.mark.parametrize(("change", "field", "detail"), ERRORS, ids=[e[1] for e in ERRORS])
def test_every_mistake_names_its_option(
    tmp_path: Path, rewards_module: str, change: dict[str, Any], field: str, detail: str
) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    bad_rows(tmp_path)
    options: dict[str, Any] = {
        "train": "t.jsonl",
        "prompt_field": "question",
        "rewards": [{"function": f"{rewards_module}:exact"}],
    }
    options.update(json.loads(json.dumps(change).replace("MOD:", f"{rewards_module}:")))
    options = {k: v for k, v in options.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        env_of(tmp_path, **options)
    message = str(err.value)
    assert message.startswith(field), message
    assert detail in message, message
    assert "Fix:" in message, message


def test_dataset_dict_without_the_split(tmp_path: Path, rewards_module: str) -> None:
    write_dataset_dict(tmp_path / "dd", train=ROWS, validation=TEST_ROWS)
    with pytest.raises(ConfigError) as err:
        env_of(
            tmp_path,
            train="dd",
            eval="dd",
            prompt_field="question",
            rewards=[{"function": f"{rewards_module}:exact"}],
        )
    assert str(err.value).startswith("environment.options.eval_split: ")
    assert "has no split 'test' (its splits: train, validation)" in str(err.value)


def test_without_pyarrow_the_error_says_how_to_install_it(
    tmp_path: Path, rewards_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_parquet(tmp_path / "t.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(ConfigError) as err:
        env_of(
            tmp_path,
            train="t.parquet",
            prompt_field="question",
            rewards=[{"function": f"{rewards_module}:exact"}],
        )
    assert str(err.value).startswith("environment.options.train: ")
    assert "pip install 'asyncrl[data]'" in str(err.value)


def test_entry_point_gets_base_dir(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    options = {
        "train": "t.jsonl",
        "prompt_field": "question",
        "rewards": [{"function": f"{rewards_module}:exact"}],
    }
    cfg = SimpleNamespace(
        environment=SimpleNamespace(name="dataset", options=options, base_dir=str(tmp_path)),
        run=SimpleNamespace(seed=0),
    )
    env = preflight.make_environment(cfg)  # type: ignore[arg-type]
    assert list(env.dataset("train")) == expected(ROWS[:2])


# --------------------------------------------------------------------------------- Scorer
@pytest.mark.anyio
async def test_scorer_awaits_score_async_concurrently(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    env = env_of(
        tmp_path,
        train="t.jsonl",
        prompt_field="question",
        rewards=[
            {"function": f"{rewards_module}:slow_a", "weight": 1.0},
            {"function": f"{rewards_module}:slow_b", "weight": 0.5},
            {"function": f"{rewards_module}:exact", "weight": 3.0},  # sync: in a thread
        ],
        correct_reward="exact",
    )
    scorer = Scorer(env, DigitsTokenizer(), "dataset", timeout_s=60.0)  # type: ignore[arg-type]
    assert not scorer.cheap  # an async environment never scores inline
    pending = group_of(env.dataset("train")[0], [[2], [3], [2], [1, 2]])
    start = time.perf_counter()
    samples = await scorer.threaded(pending)
    elapsed = time.perf_counter() - start
    # 4 samples x 2 rewards of 0.2 s: 1.6 s one after another, 0.2 s all at once
    assert 0.2 <= elapsed < 0.4, elapsed
    # slow_a 1 + 0.5 * slow_b 2 = 2, plus 3 when the completion is "2"
    assert [s.reward for s in samples] == [5.0, 2.0, 5.0, 2.0]
    assert [s.correct for s in samples] == [True, False, True, False]
    assert samples[0].components == {"slow_a": 1.0, "slow_b": 2.0, "exact": 1.0}
    assert samples[1].components == {"slow_a": 1.0, "slow_b": 2.0, "exact": 0.0}
    assert samples[3].token_ids.tolist() == [1, 2] and samples[3].finish_reason == "stop"


class CountingEnv:
    """An async environment that counts the score_async calls in flight (and whose score()
    must never be called)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.inflight = self.most = 0
        self.fail_on = fail_on

    def dataset(self, split: str) -> list[Prompt]:
        return []

    def score(self, prompt: Prompt, completion: str) -> Score:
        raise AssertionError("score() called for an environment with score_async")

    async def score_async(self, prompt: Prompt, completion: str) -> Score:
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            await anyio.sleep(0.05)
            if completion == self.fail_on:
                raise KeyError("judge unreachable")
            if completion == "999":
                return Score(math.inf)
            return Score(float(completion), components={"len": len(completion)})
        finally:
            self.inflight -= 1


@pytest.mark.anyio
async def test_scorer_bounds_concurrency() -> None:
    env = CountingEnv()
    scorer = Scorer(env, DigitsTokenizer(), "judge", timeout_s=60.0)  # type: ignore[arg-type]
    prompt = Prompt(id="p", text="x")
    groups = [group_of(prompt, [[i % 10]] * 50) for i in range(3)]
    results: list[list[CompletedSample]] = []

    async def score(g: Group) -> None:
        results.append(await scorer.threaded(g))

    async with anyio.create_task_group() as tg:
        for g in groups:
            tg.start_soon(score, g)
    assert env.most == ASYNC_SCORE_CONCURRENCY == 64  # 150 samples, 64 at a time
    assert sorted(s.reward for r in results for s in r) == sorted([0.0, 1.0, 2.0] * 50)
    assert all(s.components == {"len": 1.0} for r in results for s in r)


@pytest.mark.anyio
async def test_scorer_errors_name_environment_prompt_and_completion() -> None:
    env = CountingEnv(fail_on="7")
    scorer = Scorer(env, DigitsTokenizer(), "judge", timeout_s=60.0)  # type: ignore[arg-type]
    prompt = Prompt(id="p-3", text="x")
    with pytest.raises(ScoreError) as err:
        await scorer.threaded(group_of(prompt, [[1], [7], [2]]))
    assert str(err.value) == (
        "environment 'judge' (environment.name): score_async() raised KeyError: "
        "'judge unreachable' for prompt 'p-3' and completion '7'"
    )
    with pytest.raises(ScoreError, match=r"score_async\(\) returned a non-finite reward \(inf\)"):
        await scorer.threaded(group_of(prompt, [[1], [9, 9, 9]]))


@pytest.mark.anyio
async def test_sync_scorer_carries_components(tmp_path: Path, rewards_module: str) -> None:
    write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    env = env_of(
        tmp_path,
        train="t.jsonl",
        prompt_field="question",
        rewards=[{"function": f"{rewards_module}:exact"}, {"function": f"{rewards_module}:length"}],
    )
    scorer = Scorer(env, DigitsTokenizer(), "dataset", timeout_s=60.0)  # type: ignore[arg-type]
    pending = group_of(env.dataset("train")[0], [[2], [2, 2]])
    threaded = await scorer.threaded(pending)
    inline = scorer.inline(pending)
    for samples in (threaded, inline):
        assert [s.reward for s in samples] == [2.0, 2.0]  # exact 1 + len 1; exact 0 + len 2
        assert [s.components for s in samples] == [
            {"exact": 1.0, "length": 1.0},
            {"exact": 0.0, "length": 2.0},
        ]


# ---------------------------------------------------------------------------- step metrics
def test_step_metrics_average_each_component() -> None:
    def sample(reward: float, **components: float) -> CompletedSample:
        return CompletedSample(
            np.array([1], np.int32),
            np.array([-0.1], np.float32),
            "stop",
            reward,
            reward > 0,
            components,
        )

    groups = [
        Group(
            "g0",
            "p0",
            [1],
            3,
            None,
            0.0,
            [sample(1.0, a=1.0, b=0.5), sample(0.0, a=0.0)],
            committed_at=1.0,
            index=0,
        ),
        Group(
            "g1",
            "p1",
            [1],
            4,
            None,
            0.5,
            [sample(2.0, a=4.0, b=1.5), sample(0.0)],
            committed_at=2.0,
            index=1,
        ),
    ]
    record = StepRecord(step=4, train=TrainRecord(groups=groups)).metrics(
        StepResult(step=4, loss=0.1, grad_norm=1.0, num_loss_tokens=4, lr=1e-6, seconds=1.0),
        0.0,
        StepStats(),
        buffer_ready=0,
        buffer_live=0,
        inflight_samples=0,
        loop_lags=[],
        rejected_frames=0,
        now=3.0,
    )
    assert record["reward"] == 0.75  # (1 + 0 + 2 + 0) / 4
    assert record["reward/a"] == pytest.approx((1.0 + 0.0 + 4.0) / 3)  # the 4th lacks it
    assert record["reward/b"] == pytest.approx((0.5 + 1.5) / 2)
    assert sorted(k for k in record if k.startswith("reward/")) == ["reward/a", "reward/b"]
