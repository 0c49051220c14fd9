"""Deadlines on reward calls (``failures.reward_timeout_s``): a hanging ``score()``,
``score_async()`` or reward function of the ``dataset`` environment fails its group with a
``ScoreTimeout`` naming the function, the prompt and the deadline; an async call is cancelled,
a sync one's thread abandoned (on a daemon thread: the process still exits); abandoned threads
are bounded; only an environment that says so is scored on the event loop.

The hanging functions wait on an event the test sets at its end, so no thread outlives it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncrl.data import deadlines

from asyncrl.run import scoring
from asyncrl.data.dataset import AsyncDatasetEnvironment, make_environment
from asyncrl.data.deadlines import AbandonedThreadsError, abandoned_threads
from asyncrl.environment import Prompt, Score
from asyncrl.run.scoring import ScoreError, ScoreTimeout, Scorer
from scoring_support import DigitsTokenizer, group_of

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

REWARDS = """
import threading
import anyio

RELEASE = threading.Event()
CANCELLED = []

def exact(completion, answer):
    return completion.strip() == str(answer["solution"])

def hang(completion):
    RELEASE.wait()
    return 0.0

async def ahang(completion):
    try:
        await anyio.sleep_forever()
    finally:
        CANCELLED.append(completion)

async def quick(completion):
    return 1.0
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def rewards(tmp_path: Path) -> Iterator[Any]:
    """``REWARDS`` as a uniquely named module beside the data; at the end its hanging
    functions are released and their abandoned threads seen gone."""
    name = f"rwd_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    (tmp_path / "t.jsonl").write_text('{"question": "1+1", "solution": 2}\n')
    assert abandoned_threads() == 0, "an earlier test left a reward thread running"
    sys.path.insert(0, str(tmp_path))
    try:
        module = __import__(name)
    finally:
        sys.path.remove(str(tmp_path))
    yield module
    module.RELEASE.set()
    _wait_for(lambda: abandoned_threads() == 0, "the abandoned threads to return")
    sys.modules.pop(name, None)


def _wait_for(condition: Any, what: str, bound_s: float = 10.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {bound_s} s for {what}"
        time.sleep(0.01)


def env_with(tmp_path: Path, module: Any, *functions: str) -> Any:
    specs = [{"function": f"{module.__name__}:{f}"} for f in functions]
    return make_environment(
        {"train": "t.jsonl", "prompt_field": "question", "rewards": specs}, 0, base_dir=tmp_path
    )


# ----------------------------------------------------------------- the dataset environment
async def test_a_hanging_sync_reward_fails_its_group_naming_it(
    tmp_path: Path, rewards: Any
) -> None:
    env = env_with(tmp_path, rewards, "exact", "hang")
    scorer = Scorer(env, DigitsTokenizer(), "dataset", timeout_s=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScoreTimeout) as err:
        await scorer.threaded(group_of(env.dataset("train")[0], [[2], [3]]))
    assert str(err.value) == (
        "environment 'dataset' (environment.name): score() did not return within 0.2 s "
        "(failures.reward_timeout_s) for prompt 'train-0' and completion '2', stuck in "
        f"reward 'hang' ({rewards.__name__}:hang); its thread was abandoned (a thread cannot "
        "be stopped). Fix: make it return (a timeout on its network calls, a bound on its "
        "loops), or raise failures.reward_timeout_s"
    )
    assert isinstance(err.value, ScoreError)  # failures.on_reward_error applies
    assert abandoned_threads() == 1
    assert not scorer.cheap  # the dataset environment never scores on the loop


async def test_a_hanging_async_reward_is_cancelled(tmp_path: Path, rewards: Any) -> None:
    env = env_with(tmp_path, rewards, "quick", "ahang")
    assert isinstance(env, AsyncDatasetEnvironment)
    scorer = Scorer(env, DigitsTokenizer(), "dataset", timeout_s=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScoreTimeout) as err:
        await scorer.threaded(group_of(env.dataset("train")[0], [[2], [3], [4]]))
    message = str(err.value)
    assert message.startswith(
        "environment 'dataset' (environment.name): score_async() did not return within 0.2 s "
        "(failures.reward_timeout_s) for prompt 'train-0' and completion '2', stuck in "
        f"reward 'ahang' ({rewards.__name__}:ahang); it was cancelled. Fix: "
    )
    assert "quick" not in message  # it returned
    assert sorted(rewards.CANCELLED) == ["2", "3", "4"]  # every sample's call was cancelled
    assert abandoned_threads() == 0


async def test_a_hanging_sync_reward_beside_async_ones_is_abandoned(
    tmp_path: Path, rewards: Any
) -> None:
    """In the async environment a sync reward runs in a thread: at the deadline the awaiter
    leaves it (anyio's worker thread would hold the cancellation until the call returned)."""
    env = env_with(tmp_path, rewards, "quick", "hang")
    scorer = Scorer(env, DigitsTokenizer(), "dataset", timeout_s=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScoreTimeout, match=rf"stuck in reward 'hang' \({rewards.__name__}:hang\)"):
        await scorer.threaded(group_of(env.dataset("train")[0], [[2], [3]]))
    assert abandoned_threads() == 2  # one per sample


# ------------------------------------------------------------------- any environment
class HangingEnv:
    """``score`` sleeps ``delay_s`` per call, or hangs on completion "9" until released."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.release = threading.Event()

    def dataset(self, split: str) -> list[Prompt]:
        return []

    def score(self, prompt: Prompt, completion: str) -> Score:
        if completion == "9":
            self.release.wait()
        time.sleep(self.delay_s)
        return Score(1.0)


class HangingAsyncEnv(HangingEnv):
    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def score_async(self, prompt: Prompt, completion: str) -> Score:
        if completion == "9":
            try:
                await anyio.sleep_forever()
            finally:
                self.cancelled += 1
        return Score(2.0)


@pytest.fixture
def hanging() -> Iterator[HangingEnv]:
    assert abandoned_threads() == 0, "an earlier test left a reward thread running"
    env = HangingEnv()
    yield env
    env.release.set()
    _wait_for(lambda: abandoned_threads() == 0, "the abandoned threads to return")


async def test_a_hanging_score_names_the_environment_and_the_sample(hanging: HangingEnv) -> None:
    scorer = Scorer(hanging, DigitsTokenizer(), "judge", timeout_s=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScoreTimeout) as err:
        await scorer.threaded(group_of(Prompt(id="p-1", text="x"), [[1], [9], [2]]))
    assert str(err.value).startswith(
        "environment 'judge' (environment.name): score() did not return within 0.2 s "
        "(failures.reward_timeout_s) for prompt 'p-1' and completion '9'; its thread was "
        "abandoned"
    )


async def test_a_hanging_score_async_is_cancelled() -> None:
    env = HangingAsyncEnv()
    scorer = Scorer(env, DigitsTokenizer(), "judge", timeout_s=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScoreTimeout) as err:
        await scorer.threaded(group_of(Prompt(id="p-2", text="x"), [[1], [9]]))
    assert str(err.value).startswith(
        "environment 'judge' (environment.name): score_async() did not return within 0.2 s "
        "(failures.reward_timeout_s) for prompt 'p-2' and completion '9'; it was cancelled."
    )
    assert env.cancelled == 1


class BlockingPartEnv(HangingEnv):
    """``score_async`` whose blocking part (on completion "9") hangs in ``in_thread``."""

    async def score_async(self, prompt: Prompt, completion: str) -> Score:
        if completion == "9":
            await deadlines.in_thread(self.release.wait)
        return Score(3.0)


async def test_score_async_leaves_its_blocking_part_behind_at_the_deadline() -> None:
    env = BlockingPartEnv()
    scorer = Scorer(env, DigitsTokenizer(), "judge", timeout_s=0.2)  # type: ignore[arg-type]
    try:
        with pytest.raises(ScoreTimeout, match=r"score_async\(\) did not return within 0.2 s"):
            await scorer.threaded(group_of(Prompt(id="p", text="x"), [[1], [9]]))
        assert abandoned_threads() == 1
    finally:
        env.release.set()
        _wait_for(lambda: abandoned_threads() == 0, "the abandoned thread to return")


async def test_each_call_has_its_own_deadline() -> None:
    """Four calls of 0.3 s each (1.2 s for the group) under a 0.6 s deadline: each call is
    within it, so the group is scored."""
    env = HangingEnv(delay_s=0.3)
    scorer = Scorer(env, DigitsTokenizer(), "slow", timeout_s=0.6)  # type: ignore[arg-type]
    samples = await scorer.threaded(group_of(Prompt(id="p", text="x"), [[1], [2], [3], [4]]))
    assert [s.reward for s in samples] == [1.0] * 4


async def test_cancelling_the_scorer_abandons_a_hanging_thread(hanging: HangingEnv) -> None:
    """The run ends (its task group is cancelled) while ``score()`` hangs: the scorer leaves
    at once, under its own long deadline."""
    scorer = Scorer(hanging, DigitsTokenizer(), "judge", timeout_s=3600)  # type: ignore[arg-type]
    with anyio.move_on_after(0.2) as scope:
        await scorer.threaded(group_of(Prompt(id="p", text="x"), [[9]]))
    assert scope.cancelled_caught
    assert abandoned_threads() == 1


async def test_abandoned_threads_are_bounded(
    hanging: HangingEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deadlines, "MAX_ABANDONED_THREADS", 2)
    scorer = Scorer(hanging, DigitsTokenizer(), "judge", timeout_s=0.1)  # type: ignore[arg-type]
    group = group_of(Prompt(id="p", text="x"), [[9]])
    for _ in range(2):
        with pytest.raises(ScoreTimeout):
            await scorer.threaded(group)
    with pytest.raises(AbandonedThreadsError) as err:
        await scorer.threaded(group)
    assert not isinstance(err.value, ScoreError)  # the run stops: no group is dropped for it
    assert "reward calls abandoned past their deadline (failures.reward_timeout_s) are " \
        "still running in their threads" in str(err.value)
    assert "Fix: " in str(err.value)


async def test_only_an_environment_that_allows_it_scores_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cheap ``score()`` runs on the event loop only with ``score_on_loop = True`` (where a
    hang could not be stopped); its first group goes to a thread all the same."""
    monkeypatch.setattr(scoring, "INLINE_SCORE_MAX_S", 60.0)  # any measured cost is cheap
    plain = HangingEnv()
    scorer = Scorer(plain, DigitsTokenizer(), "plain", timeout_s=60)  # type: ignore[arg-type]
    group = group_of(Prompt(id="p", text="x"), [[1]])
    await scorer.threaded(group)
    assert not scorer.cheap  # measured cheap, but it did not say it is safe
    allowed = HangingEnv()
    allowed.score_on_loop = True  # type: ignore[attr-defined]
    scorer = Scorer(allowed, DigitsTokenizer(), "arith", timeout_s=60)  # type: ignore[arg-type]
    assert not scorer.cheap  # not measured yet
    await scorer.threaded(group)
    assert scorer.cheap


def test_a_process_with_an_abandoned_thread_exits(tmp_path: Path) -> None:
    """A reward that never returns, abandoned at its deadline: the process still exits when
    its work is done (a stuck non-daemon thread, as anyio's workers are, would hang the
    interpreter's exit forever)."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import threading, anyio, numpy as np
        from asyncrl.environment import Prompt, Score
        from asyncrl.policy.groups import Group
        from asyncrl.run.scoring import ScoreTimeout, Scorer
        from asyncrl.wire.messages import Sample

        class Env:
            def dataset(self, split): return []
            def score(self, prompt, completion):
                threading.Event().wait()  # never returns

        class Tok:
            def decode(self, ids): return "x"

        async def main():
            pending = Group("g0", "p", [1], 0, None, 0.0, index=0, prompt=Prompt(id="p", text="x"))
            pending.samples = [Sample(np.array([1]), np.array([-0.5]), "stop")]
            try:
                await Scorer(Env(), Tok(), "env", timeout_s=0.2).threaded(pending)
            except ScoreTimeout as exc:
                print("timed out:", exc)

        anyio.run(main)
    """))
    # it exits, or never does (the call on an anyio worker thread): the timeout is no bound
    # on how fast, only the hang guard; it raises TimeoutExpired
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    assert "timed out: environment 'env'" in proc.stdout


async def test_the_scorer_reports_its_time_once_per_take() -> None:
    """``take_spent`` (a step record's ``score_s``): the time ``score`` took since the last
    take, inline and on threads, then zero."""
    env = HangingEnv(delay_s=0.05)
    scorer = Scorer(env, DigitsTokenizer(), "slow", timeout_s=5)  # type: ignore[arg-type]
    assert scorer.take_spent() == 0.0
    await scorer.threaded(group_of(Prompt(id="p", text="x"), [[1], [2]]))  # 2 x 0.05 s
    scorer.inline(group_of(Prompt(id="q", text="x"), [[3]]))  # 0.05 s
    spent = scorer.take_spent()
    assert 0.15 <= spent < 1.0
    assert scorer.take_spent() == 0.0
