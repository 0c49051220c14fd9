"""Held-out evaluations end to end on the controller's side: the real :class:`Evaluator`,
:class:`Asker`, :class:`RolloutPhase` (on the live groups) and :class:`Feeder` (its samples
arrive through a fake data socket, encoded as a worker would send them), around a fake control
plane that records each ``Generate`` and fake scoring.

* every prompt is asked at once: one worker slow to take its requests holds up no other;
* an evaluation not done in time stops the run naming the evaluation, what is missing, who
  serves and the setting (not a bare ``TimeoutError``);
* a prompt whose scoring fails counts as incorrect under ``on_reward_error = "drop_group"``
  (the evaluation goes on), and stops the run under ``"fail_run"``;
* a worker lost mid-evaluation: its prompts are asked again of one that serves;
* two evaluations at once keep their results apart.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
import numpy as np
import pytest

from asyncrl.environment import Prompt
from asyncrl.errors import RunError, flatten
from asyncrl.policy.groups import CompletedSample, Group
from asyncrl.run.asking import build_asker
from asyncrl.run.evaluation import Evaluator
from asyncrl.run.context import RunContext
from asyncrl.run.intake import DataRouter, Feeder
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.scoring import ScoreError
from asyncrl.run.train_phase import TrainPhase
from asyncrl.run.wake import Signal
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import DataMessage, Generate, Sample, SampleDone
from asyncrl.wire.transport import Rejections
from schedule_support import SAMPLERS, live_groups

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

WORKERS = ["rollout:0", "rollout:1"]
PROMPTS = [Prompt(id=f"eval:{i}", text=f"prompt {i}") for i in range(4)]
SAMPLE = Sample(np.array([3, 1], np.int32), np.array([-0.5, -0.25], np.float32), "stop")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _config(on_reward_error: str = "fail_run", call_timeout_s: float = 10.0) -> Any:
    return SimpleNamespace(
        eval=SimpleNamespace(num_prompts=len(PROMPTS)),
        cluster=SimpleNamespace(call_timeout_s=call_timeout_s),
        grpo=SimpleNamespace(max_new_tokens=8),
        failures=SimpleNamespace(on_reward_error=on_reward_error),
        generator=SimpleNamespace(backend="fake"),
        run=SimpleNamespace(seed=0),
    )


class _Control:
    """Records each ``Generate``; a send to a worker in ``hold`` waits until every worker
    in ``hold`` has been sent to (sent one after the other, it would wait forever)."""

    def __init__(self, hold: tuple[str, ...] = ()) -> None:
        self.sent: dict[str, list[str]] = {}
        self.hold = set(hold)
        self.all_called = anyio.Event()

    async def cast_unless_restarting(self, worker: str, request: Any) -> bool:
        assert isinstance(request, Generate) and request.requests
        assert all(r.greedy and r.temperature == 0.0 for r in request.requests)
        self.sent.setdefault(worker, []).extend(r.group_id for r in request.requests)
        if self.hold <= self.sent.keys():
            self.all_called.set()
        if worker in self.hold:
            await self.all_called.wait()
        return True

    async def call_unless_restarting(self, worker: str, request: Any, **kw: Any) -> Any:
        return None  # an Abort of a cancelled evaluation's requests


class _Socket:
    """The data socket: what the test sends, encoded as a worker would send it."""

    def __init__(self) -> None:
        self.tx, self.rx = anyio.create_memory_object_stream[list[Any]](16)
        self.codec = Codec(DataMessage)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()

    def send(self, msg: SampleDone) -> None:
        self.tx.send_nowait(self.codec.encode(msg))

    async def recv(self) -> list[Any]:
        return await self.rx.receive()

    def recv_nowait(self) -> list[Any] | None:
        try:
            return self.rx.receive_nowait()
        except anyio.WouldBlock:
            return None


class _Scorer:
    """Scores on the loop: ``eval:0`` correct, ``eval:3``'s reward raises, the rest wrong."""

    cheap = True

    async def score(self, group: Group) -> list[CompletedSample]:
        return self.inline(group)

    def inline(self, group: Group) -> list[CompletedSample]:
        if group.prompt_id == "eval:3":
            raise ScoreError(f"score() raised ValueError for prompt {group.prompt_id!r}")
        right = group.prompt_id == "eval:0"
        return [CompletedSample(s.token_ids, s.logprobs, "stop", float(right), right)
                for s in group.samples]  # fmt: skip


class _Run:
    """An evaluator, the rollout phase (on the live groups) and the feeder as a pipeline
    builds them."""

    def __init__(self, config: Any, control: _Control, serving: list[str]) -> None:
        self.groups = live_groups(SAMPLERS["gated"](1, 1.0), P=2, N=2, steps=1)
        self.rollout = RolloutPhase(self.groups, WORKERS)
        self.changed = Signal()
        env = SimpleNamespace(dataset=lambda split: PROMPTS)
        tok = SimpleNamespace(encode_prompts=lambda ps: [[7, i] for i, _ in enumerate(ps)])
        ctx = RunContext(
            config, control, [], self.groups, self.rollout, TrainPhase(self.groups),  # type: ignore[arg-type]
            serving=lambda: serving, changed=self.changed,
            committed=Signal(), failures=None, probes=None, metrics=None, now=time.perf_counter,  # type: ignore[arg-type]
        )  # fmt: skip
        self.asker = build_asker(ctx)
        self.evaluator = Evaluator(ctx, environment=env, tokenizer=tok, asker=self.asker,
                                   scorer=_Scorer())  # type: ignore[arg-type]  # fmt: skip
        self.socket = _Socket()
        self.router = DataRouter(self.socket, Rejections())  # type: ignore[arg-type]
        self.feeder = Feeder(
            ctx, intake=self.router.intake(""), scorer=_Scorer(),  # type: ignore[arg-type]
            asker=self.asker,
            redispatch=None, rejections=Rejections(),  # type: ignore[arg-type]
        )  # fmt: skip
        self.control = control

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.socket.close()
        self.router.__exit__()

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """The data router and the feeder, in ``tg``."""
        tg.start_soon(self.router.run)
        tg.start_soon(self.feeder.run)

    def answer(self) -> None:
        """Each worker sends the sample of every request it was sent."""
        for worker, gids in self.control.sent.items():
            for gid in gids:
                self.socket.send(SampleDone(gid, worker, 0, SAMPLE))
        self.control.sent.clear()


async def test_each_worker_gets_its_requests_at_once_and_scoring_failures_count_as_wrong() -> None:
    """Under ``drop_group``: rollout:0 takes its ``Generate`` only once rollout:1 got one
    (asked one prompt after the other, the evaluation would never start); a prompt whose
    reward raised counts as incorrect, and the evaluation finishes."""
    control = _Control(hold=("rollout:0",))
    with _Run(_config("drop_group"), control, WORKERS) as run, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            run.start(tg)
            records: list[dict[str, Any]] = []

            async def evaluate() -> None:
                records.append(await run.evaluator.evaluate("start", 0))

            tg.start_soon(evaluate)
            await control.all_called.wait()
            assert sorted(control.sent) == WORKERS
            run.answer()
            while not records:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    (record,) = records
    assert record["label"] == "start" and record["num_prompts"] == 4
    assert record["accuracy"] == 0.25  # eval:0 right; eval:1, eval:2 wrong; eval:3 failed
    assert record["failed_groups"] == 1


async def test_a_reward_error_in_an_evaluation_stops_the_run_under_fail_run() -> None:
    control = _Control()
    with _Run(_config("fail_run"), control, WORKERS) as run, anyio.fail_after(10):
        with pytest.raises(ExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                run.start(tg)
                tg.start_soon(run.evaluator.evaluate, "start", 0)
                while len(control.sent) < 2:
                    await anyio.sleep(0.01)
                run.answer()
                await anyio.sleep(5)  # the feeder raises first
    (error,) = flatten(info.value)  # the feeder's own task group, then this one's
    assert isinstance(error, ScoreError) and "'eval:3'" in str(error)


async def test_an_evaluation_not_done_in_time_names_what_is_missing() -> None:
    """No worker serves (both restarting): the prompts wait, and the evaluation stops the run
    with an error naming the evaluation, its outstanding prompts, who serves and the
    setting."""
    with _Run(_config(call_timeout_s=0.2), _Control(), serving=[]) as run:
        with pytest.raises(RunError) as info, anyio.fail_after(5):
            await run.evaluator.evaluate("step-4", 4)
    text = str(info.value)
    assert text.startswith("evaluation 'step-4': 4 of its 4 prompts were not generated and "
                           "scored within 0.2 s (cluster.call_timeout_s)")  # fmt: skip
    assert "outstanding: eval:0, eval:1, eval:2, eval:3;" in text
    assert "rollout workers serving: none (every one is restarting)" in text
    assert run.rollout.requests_in_flight == 0  # nothing was placed


async def test_a_worker_lost_mid_evaluation_has_its_prompts_asked_again_elsewhere() -> None:
    """rollout:0 dies with its requests unanswered (what the controller does then:
    ``asker.lost(rollout.worker_lost(w).answered)``): they go to rollout:1, and the evaluation
    ends with every prompt scored."""
    control, serving = _Control(), list(WORKERS)
    records: list[dict[str, Any]] = []
    with _Run(_config("drop_group"), control, serving) as run, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            run.start(tg)

            async def evaluate() -> None:
                records.append(await run.evaluator.evaluate("start", 0))

            tg.start_soon(evaluate)
            while sum(map(len, control.sent.values())) < 4:
                await anyio.sleep(0.01)
            lost = control.sent.pop("rollout:0")
            serving.remove("rollout:0")
            run.asker.lost(run.rollout.worker_lost("rollout:0").answered)
            while sum(map(len, control.sent.values())) < 4:
                await anyio.sleep(0.01)
            assert sorted(control.sent) == ["rollout:1"]
            # a fresh request id for each prompt asked again
            assert not set(lost) & set(control.sent["rollout:1"])
            run.answer()
            while not records:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert (records[0]["accuracy"], records[0]["failed_groups"]) == (0.25, 1)
    assert run.rollout.requests_in_flight == 0


async def test_two_evaluations_at_once_keep_their_results_apart() -> None:
    control = _Control()
    records: dict[str, dict[str, Any]] = {}

    async def evaluate(label: str) -> None:
        records[label] = await run.evaluator.evaluate(label, 1)

    with _Run(_config("drop_group"), control, WORKERS) as run, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            run.start(tg)
            tg.start_soon(evaluate, "a")
            tg.start_soon(evaluate, "b")
            while sum(map(len, control.sent.values())) < 8:
                await anyio.sleep(0.01)
            run.answer()
            while len(records) < 2:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert sorted(records) == ["a", "b"]
    assert [(r["accuracy"], r["failed_groups"]) for r in records.values()] == [(0.25, 1)] * 2
