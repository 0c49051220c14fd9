"""The episode runner (:mod:`asyncrl.run.episodes`) with the real rollout phase, train phase
and live groups.

The test plays the rollout workers (each turn request is answered by a task that feeds the
rollout phase's ``sample_arrived`` and hands an ``ANSWER`` to the asker, as the feeder does)
and a record that stands for the token-exact trajectory (its own tests: test_trajectory.py).
After every answer the rollout phase's own invariants (and the live groups') must hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

from asyncrl.env.episode import Limits
from asyncrl.env.segments import TrajectorySample
from asyncrl.env.trajectory import TemplateMismatch
from asyncrl.environment import Prompt, Score
from asyncrl.policy.groups import CompletedSample

from asyncrl.run.arrivals import ArrivalKind
from asyncrl.run.arrivals import Sent
from asyncrl.run.asking import Asker
from asyncrl.run.episodes import EpisodeRunner
from asyncrl.run.rollout_phase import RolloutPhase
from asyncrl.run.train_phase import TrainPhase
from asyncrl.run.wake import Signal
from asyncrl.wire.messages import GenRequest, GroupFailed, Sample, SampleDone
from schedule_support import SAMPLERS, live_groups

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

WORKERS = ["rollout:0", "rollout:1"]
PROMPT = Prompt(id="p0", messages=[{"role": "user", "content": "2+2?"}], answer="4")
OBS = 900  # the token an observation inserts


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeRecord:
    """The conversation as ids: the prompt [1, 2], generated turns as they came, and one
    ``OBS`` token per observation message."""

    def __init__(self, prompt: Prompt) -> None:
        self.ids: list[int] = [1, 2]
        self.prompt_len = 2
        self.splits = 0
        self.mask: list[int] = []
        self.lps: list[float] = []
        self.msgs: list[dict[str, Any]] = [dict(m) for m in prompt.messages or ()]

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.ids)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.msgs

    def add_turn(self, token_ids: Any, logprobs: Any, version: int, finish_reason: str) -> str:
        self.ids += [int(t) for t in token_ids]
        self.mask += [1] * len(token_ids)
        self.lps += [float(x) for x in logprobs]
        text = " ".join(str(int(t)) for t in token_ids)
        self.msgs.append({"role": "assistant", "content": text})
        return text

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        for m in messages:
            self.msgs.append(dict(m))
            self.add_tokens([OBS])

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        self.ids += list(token_ids)
        self.mask += [0] * len(token_ids)
        self.lps += [0.0] * len(token_ids)

    def samples(self) -> list[TrajectorySample]:
        if not self.mask:
            return []
        last = max(i for i, m in enumerate(self.mask) if m) + 1  # ends at the last turn
        n = self.prompt_len + last
        return [TrajectorySample(
            token_ids=np.asarray(self.ids[:n], np.int32), prompt_len=self.prompt_len,
            loss_mask=np.asarray(self.mask[:last], np.uint8),
            logprobs=np.asarray(self.lps[:last], np.float32),
            versions=np.zeros(last, np.int32), turns=1, finish_reason="stop",
        )]  # fmt: skip


class Engines:
    """The rollout workers: each request is answered with ``[len(prompt), 7]`` (stop) after
    ``delay`` seconds, unless the worker is ``dead`` (then nothing comes) or told to fail it."""

    def __init__(self, rollout: RolloutPhase) -> None:
        self.rollout = rollout
        self.asker: Asker | None = None
        self.sent: list[tuple[str, GenRequest]] = []
        self.aborted: list[tuple[str, list[str]]] = []
        self.dead: set[str] = set()
        self.fail_next = 0
        self.delay = 0.0
        self.hold = anyio.Event()  # set: answer; while unset, held requests wait
        self.hold.set()
        self.held: Any = lambda request: True  # which requests a hold holds
        self.tg: Any = None

    async def send(self, worker: str, request: GenRequest) -> None:
        self.sent.append((worker, request))
        if worker not in self.dead:
            self.tg.start_soon(self._answer, worker, request)

    async def abort(self, worker: str, turn_ids: list[str]) -> None:
        self.aborted.append((worker, turn_ids))

    async def _answer(self, worker: str, request: GenRequest) -> None:
        if self.held(request):
            await self.hold.wait()
        await anyio.sleep(self.delay)
        if worker in self.dead:
            return
        if self.fail_next:
            self.fail_next -= 1
            self.deliver_failure(GroupFailed(request.group_id, worker, "EngineError", "boom"))
            return
        tokens = np.array([len(request.prompt_ids), 7][: request.max_tokens], np.int32)
        sample = Sample(tokens, np.full(len(tokens), -0.25, np.float32), "stop")
        self.deliver(SampleDone(request.group_id, worker, 0, sample))

    def deliver(self, msg: SampleDone) -> None:
        """What the feeder does with a sample."""
        arrival = self.rollout.sample_arrived(msg)
        assert self.asker is not None
        if arrival.kind == ArrivalKind.ANSWER:
            self.asker.answered(arrival.request, arrival.sample)
        assert self.rollout.problems() == []

    def deliver_failure(self, msg: GroupFailed) -> None:
        arrival = self.rollout.check_failure(msg)
        assert self.asker is not None
        if arrival.kind == ArrivalKind.ANSWER_FAILED:
            self.asker.failed(arrival.request, f"{msg.error_type}: {msg.message}", True)
        assert self.rollout.problems() == []


class Env:
    """Two turns with a tool observation between (``turns`` of them), scored by the last
    turn's first token; ``raise_in`` makes episode 1 raise; ``catch`` scores a limit itself."""

    def __init__(self, turns: int = 2, raise_in: bool | Exception = False,
                 sleep: float = 0.0) -> None:  # fmt: skip
        self.turns, self.raise_in, self.sleep = turns, raise_in, sleep

    def dataset(self, split: str) -> list[Prompt]:
        return [PROMPT]

    async def run_episode(self, prompt: Prompt, episode: Any) -> Score:
        turn = None
        for t in range(self.turns):
            turn = await episode.generate()
            if self.raise_in and episode.id.endswith("/1"):
                if isinstance(self.raise_in, Exception):
                    raise self.raise_in
                raise ValueError("the agent broke")
            if t < self.turns - 1:
                episode.add_messages({"role": "tool", "content": "42"})
        await anyio.sleep(self.sleep)
        assert turn is not None
        return Score(reward=float(turn.token_ids[0]), correct=True, components={"len": 1.0})


class Harness:
    def __init__(self, env: Env, *, N: int = 2, limits: Limits | None = None,
                 deadline_s: float = 10.0, on_truncation: str = "zero") -> None:
        self.groups = live_groups(SAMPLERS["gated"](1, 1.0), P=1, N=N, steps=1)
        self.rollout = RolloutPhase(self.groups, WORKERS, episodes=True)
        self.training = TrainPhase(self.groups)
        self.engines = Engines(self.rollout)
        self.committed: list[tuple[str, list[CompletedSample]]] = []
        self.failed: list[tuple[str, str, bool]] = []
        self.on_commit = Signal()
        changed = Signal()
        self.asker = Asker(
            self.rollout, self.groups, send=self.engines.send, abort=self.engines.abort,
            serving=lambda: [w for w in WORKERS if w not in self.engines.dead], changed=changed,
            seed=0,
        )  # fmt: skip
        self.runner = EpisodeRunner(
            env, rollout=self.rollout, asker=self.asker, record=FakeRecord, commit=self._commit,
            changed=changed, fail_group=self._fail,
            limits=limits or Limits(max_turns=8, max_context_tokens=100, max_turn_tokens=2),
            deadline_s=deadline_s, on_truncation=on_truncation, temperature=1.0,
        )  # fmt: skip
        self.engines.asker = self.asker

    def _commit(self, gid: str, samples: list[Any]) -> None:
        if self.rollout.commit(gid, samples, 0.0):
            self.on_commit.notify()

    @property
    def in_flight(self) -> int:
        """Turns the engines still owe."""
        return sum(self.rollout.load(w) for w in WORKERS)

    async def _collect(self) -> None:
        """What the train pump does: take the ready groups."""
        while True:
            await self.on_commit.wait()
            for group in self.training.next_chunk().groups:
                self.committed.append((group.group_id, group.samples))

    def _fail(self, gid: str, prompt_id: str, error: str, retryable: bool,
              tg: Any) -> dict[str, list[str]]:
        self.failed.append((gid, error, retryable))
        return self.rollout.failed(gid, retry=False)

    def dispatch(self) -> Sent:
        d = self.rollout.dispatch(WORKERS, lambda i: (PROMPT, [1, 2]), 0.0)
        assert isinstance(d, Sent) and d.worker == "" and d.prompt == PROMPT
        return d

    async def run(self, body: Any) -> None:
        async with anyio.create_task_group() as tg:
            self.engines.tg = tg
            await tg.start(self.runner.run)
            tg.start_soon(self._collect)
            await body(self)
            tg.cancel_scope.cancel()


async def wait_until(cond: Any) -> None:
    with anyio.fail_after(5):
        while not cond():
            await anyio.sleep(0.005)


async def test_a_group_of_episodes_trains_generated_tokens_only() -> None:
    h = Harness(Env(turns=2))

    async def body(h: Harness) -> None:
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.committed)

    await h.run(body)
    ((gid, samples),) = h.committed
    assert len(samples) == 2 and h.rollout.problems() == []
    for s in samples:
        # prompt [1, 2]; turn 1 answers [2, 7]; the tool inserts OBS; turn 2 answers [5, 7]
        np.testing.assert_array_equal(s.token_ids, [2, 7, OBS, 5, 7])
        np.testing.assert_array_equal(s.loss_mask, [1, 1, 0, 1, 1])
        np.testing.assert_array_equal(s.logprobs, [-0.25, -0.25, 0.0, -0.25, -0.25])
        assert (s.reward, s.correct, s.finish_reason) == (5.0, True, "stop")
    stats = h.runner.take_stats()
    assert (stats.episodes, stats.turns, stats.failed) == (2, 4, 0)
    # each turn is its own request; an episode's turns stay on one worker (its prefix cache)
    by_episode: dict[str, set[str]] = {}
    for worker, req in h.engines.sent:
        by_episode.setdefault(req.group_id.split("#")[0], set()).add(worker)
    assert len(h.engines.sent) == 4 and all(len(w) == 1 for w in by_episode.values())


async def test_a_lost_worker_sends_the_turn_elsewhere_not_counted() -> None:
    h = Harness(Env(turns=1))

    async def body(h: Harness) -> None:
        h.engines.hold = anyio.Event()  # requests wait
        h.runner.start(h.dispatch())
        await wait_until(lambda: len(h.engines.sent) == 2)
        victim = h.engines.sent[0][0]
        h.engines.dead.add(victim)
        # what the controller does when a worker dies (Pipeline.worker_lost)
        lost = h.rollout.worker_lost(victim)
        assert len(lost.answered) == 1 and lost.answered[0].worker == victim
        h.asker.lost(lost.answered)
        assert h.rollout.problems() == []
        h.engines.hold.set()
        await wait_until(lambda: h.committed)

    await h.run(body)
    assert not h.failed and len(h.committed[0][1]) == 2
    assert len(h.engines.sent) >= 3  # the lost turn went again, to the worker alive


async def test_engine_failures_are_retried_then_fail_the_group() -> None:
    h = Harness(Env(turns=1))

    async def body(h: Harness) -> None:
        h.engines.fail_next = 1  # one failure: retried
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.committed)

    await h.run(body)
    assert not h.failed and h.runner.take_stats().failed == 0

    h = Harness(Env(turns=1), N=1)

    async def body2(h: Harness) -> None:
        h.engines.fail_next = 10  # every attempt fails
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.failed)

    await h.run(body2)
    ((gid, error, retryable),) = h.failed
    assert "EngineError: boom" in error and retryable
    assert h.rollout.problems() == [] and h.in_flight == 0


async def test_an_agent_that_raises_fails_its_group_and_cancels_the_others() -> None:
    h = Harness(Env(turns=2, raise_in=True, sleep=5.0))

    async def body(h: Harness) -> None:
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.failed)
        await wait_until(lambda: not h.runner._runs)  # noqa: SLF001 - every episode ended

    await h.run(body)
    ((gid, error, retryable),) = h.failed
    assert "run_episode raised ValueError: the agent broke" in error and retryable
    assert not h.committed and h.rollout.problems() == []


def test_the_first_template_splits_of_a_run_are_logged_with_why() -> None:
    """Each split is told to the run's split log; the first ``SPLITS_LOGGED`` are warnings
    naming the episode, the turn and the first difference, the rest only counted (the step's
    ``episode_splits``)."""
    import structlog

    from asyncrl.run import episodes

    split = episodes._SplitLog()  # noqa: SLF001 - what build_runner gives every Trajectory
    why = TemplateMismatch(episode="g/1", turn=2, position=31, where="turn 1's generated "
                           "text, which starts at character 31, token 9", recorded="<think>",
                           rendered="A1<|im_end|>")  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        for _ in range(episodes.SPLITS_LOGGED + 3):
            split(why)
    assert split.seen == episodes.SPLITS_LOGGED + 3
    assert [e["event"] for e in logs] == ["episode_split"] * episodes.SPLITS_LOGGED
    first = logs[0]
    assert first["log_level"] == "warning"
    assert (first["episode"], first["turn"], first["position"]) == ("g/1", 2, 31)
    assert (first["recorded"], first["rendered"]) == ("<think>", "A1<|im_end|>")
    assert first["where"].startswith("turn 1's generated text")


async def test_an_aborted_group_cancels_its_episodes_and_aborts_their_turns() -> None:
    h = Harness(Env(turns=2))

    async def body(h: Harness) -> None:
        h.engines.hold = anyio.Event()
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.in_flight == 2)
        aborts = h.rollout.close()
        assert len(aborts.episodes) == 1 and aborts.turns == 2 and aborts.count == 1
        h.runner.cancel(aborts.episodes)
        await wait_until(lambda: not h.runner._runs)  # noqa: SLF001
        assert h.in_flight == 2  # abandoned: their samples still come back
        h.engines.hold.set()
        await wait_until(lambda: h.in_flight == 0)

    await h.run(body)
    assert not h.committed and not h.failed and h.rollout.problems() == []
    assert h.groups.drained


async def test_limits_truncate_and_the_config_says_how_it_trains() -> None:
    limits = Limits(max_turns=1, max_context_tokens=100, max_turn_tokens=2)
    for on_truncation, trained in (("zero", [1, 1]), ("mask", [0, 0])):
        h = Harness(Env(turns=3), N=1, limits=limits, on_truncation=on_truncation)

        async def body(h: Harness) -> None:
            h.runner.start(h.dispatch())
            await wait_until(lambda: h.committed)

        await h.run(body)
        (sample,) = h.committed[0][1]
        assert (sample.reward, sample.finish_reason) == (0.0, "turns")
        np.testing.assert_array_equal(sample.loss_mask, trained)  # the observation after it: left out
        assert h.runner.take_stats().truncated == {"turns": 1}


async def test_an_episode_past_its_deadline_is_truncated() -> None:
    h = Harness(Env(turns=1, sleep=10.0), N=1, deadline_s=0.2)

    async def body(h: Harness) -> None:
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.committed)

    await h.run(body)
    (sample,) = h.committed[0][1]
    assert sample.finish_reason == "deadline" and sample.reward == 0.0


def test_limits_cut_the_turn_to_the_context_left() -> None:
    async def main() -> int:
        h = Harness(Env(turns=1), N=1,
                    limits=Limits(max_turns=4, max_context_tokens=3, max_turn_tokens=8))

        async def body(h: Harness) -> None:
            h.runner.start(h.dispatch())
            await wait_until(lambda: h.committed)

        await h.run(body)
        return h.engines.sent[0][1].max_tokens

    assert anyio.run(main) == 1  # 3 tokens of context, the prompt holds 2


# ---------------------------------------------------------------------- cancellation latency
CANCEL_BOUND_S = 1.0
"""Issue 24's requirement: an evicted episode has its engine request aborted, and its running
tool cancelled, within 1 s (p99). The latencies themselves are measured by
``benchmarks/cancellation.py``: with 2 spinning processes on 2 cores, request abort p99 14 ms
(max 117 ms), tool p99 0.5 ms, over 1,000 trials each."""
CANCEL_TRIALS = 20
"""Each trial is held to the bound, which is stricter than a p99 over them. A cancellation
that is not at once (a request nobody aborts, a tool left to its timeout) fails the first
trial; 20 also catch a race that loses one cancellation in ten (88%). A statistical p99 claim
needs hundreds of trials (300 without a miss for 95% confidence): the benchmark's 1,000."""


async def request_abort_latency() -> float:
    """Seconds from an episode's deadline, which strikes while its turn is in flight, to the
    abort of that turn's request (the rollout phase abandons the turn and its worker is told). The
    deadline is counted from before the episode starts: the figure errs high, never low."""
    h = Harness(Env(turns=1), N=1, deadline_s=0.05)
    aborted_after: list[float] = []

    async def waiting(h: Harness) -> None:
        h.engines.hold = anyio.Event()  # the engine never answers
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.engines.aborted)

    async def timed_abort(worker: str, ids: list[str]) -> None:
        h.engines.aborted.append((worker, ids))
        aborted_after.append(anyio.current_time() - deadline)

    h.asker._abort = timed_abort  # noqa: SLF001 - the clock stops when the abort is sent
    deadline = anyio.current_time() + 0.05
    await h.run(waiting)
    assert h.in_flight == 1 and h.rollout.problems() == []  # abandoned, owed
    return aborted_after[0]


async def tool_cancel_latency() -> float:
    """Seconds from the abort of a group whose episode is in a tool call to the tool's
    ``finally``."""
    from asyncrl.env.episode import Turn
    from asyncrl.env.toolbox import ToolBox
    from asyncrl.env.tools import ToolCall, tool

    ended: list[float] = []

    @tool
    async def wait() -> str:
        """Wait for ever."""
        try:
            await anyio.sleep_forever()
        finally:
            ended.append(anyio.current_time())
        return ""

    class InTool(Env):
        async def run_episode(self, prompt: Prompt, episode: Any) -> Score:
            call = ToolCall(name="wait", arguments={}, id="c1", index=1)
            turn = Turn("", np.zeros(0, np.int32), "stop", 0, calls=(call,))
            await episode.generate()
            await episode.call_tools(turn)
            return Score(reward=0.0)

    h = Harness(InTool(), N=1)
    h.runner._tools = ToolBox([wait], timeout_s=60.0)  # noqa: SLF001
    begun: list[float] = []

    async def in_tool(h: Harness) -> None:
        h.runner.start(h.dispatch())
        await wait_until(lambda: h.runner._tools.in_flight() == 1)  # noqa: SLF001
        aborts = h.rollout.close()
        begun.append(anyio.current_time())
        h.runner.cancel(aborts.episodes)
        await wait_until(lambda: ended)

    await h.run(in_tool)
    return ended[0] - begun[0]


async def test_cancelling_an_episode_aborts_its_request_and_its_tool_at_once() -> None:
    """An episode past its deadline while a turn is in flight has that request aborted (the
    rollout phase abandons it, its worker is told); one cancelled while a tool runs has the tool
    cancelled (its ``finally`` runs). Both within the issue's 1 s, every time."""
    request_s = [await request_abort_latency() for _ in range(CANCEL_TRIALS)]
    tool_s = [await tool_cancel_latency() for _ in range(CANCEL_TRIALS)]
    assert max(request_s) < CANCEL_BOUND_S and max(tool_s) < CANCEL_BOUND_S, (request_s, tool_s)


async def test_a_group_aborted_before_its_episodes_start_still_ends() -> None:
    """The abort comes before the episodes' tasks ran: each starts cancelled, ends with no
    sample, and the group is gone (none waits for ever on a group that is not generating)."""
    h = Harness(Env(turns=2))

    async def body(h: Harness) -> None:
        h.runner.start(h.dispatch())
        aborts = h.rollout.close()  # nothing has run yet
        h.runner.cancel(aborts.episodes)
        await wait_until(lambda: not h.runner._runs)  # noqa: SLF001

    await h.run(body)
    assert h.groups.drained and h.in_flight == 0 and h.rollout.problems() == []
    assert not h.engines.sent


async def test_a_retried_group_never_reuses_a_turn_id_still_in_flight() -> None:
    """Episode 1 raises; its group fails and is dispatched again at once, while episode 0's
    abandoned turn is still on its engine (held). The new dispatch's turns get ids of their
    own (``@1``): before, its first turn repeated ``g0/0#0`` and the rollout phase refused it."""
    h = Harness(Env(turns=2, raise_in=True))
    retried: list[Sent] = []

    def fail_and_retry(gid: str, prompt_id: str, error: str, retryable: bool,
                       tg: Any) -> dict[str, list[str]]:
        turns = h.rollout.failed(gid, retry=True)
        h.rollout.retry(gid)
        retried.append(h.dispatch())
        h.runner.start(retried[-1])
        return turns

    h.runner._fail_group = fail_and_retry  # noqa: SLF001

    async def body(h: Harness) -> None:
        h.engines.hold = anyio.Event()
        h.engines.held = lambda request: request.group_id.startswith("g0/0#")
        h.runner.start(h.dispatch())
        await wait_until(lambda: len(retried) >= 1)
        await wait_until(lambda: any("@1#" in r.group_id for _, r in h.engines.sent))
        h.engines.hold.set()

    await h.run(body)
    ids = [r.group_id for _, r in h.engines.sent]
    assert "g0/0#0" in ids and "g0/0@1#0" in ids and len(ids) == len(set(ids))
