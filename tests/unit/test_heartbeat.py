"""The heartbeat: the pure tracker under a fake clock, checked against a reference computed
from the answer times alone; then the heartbeat task against a real control plane whose fake
workers (fake_workers.py) name real processes (``sleep``), one answering, one silent."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import structlog

from asyncrl.config import FailuresConfig
from asyncrl.errors import WorkerDiedError, WorkerHungError, WorkerLostError
from asyncrl.run.heartbeat import Heartbeat, HeartbeatTracker, Watched
from fake_workers import FakeWorker, control_plane


def _who(name: str = "rollout:0", pid: int = 100) -> Watched:
    group, rank = name.split(":")
    return Watched(name, group, int(rank), pid, f"/logs/{group}-{rank}.log")


# --------------------------------------------------------------------------- the tracker
def test_an_answering_worker_is_never_hung_and_a_silent_one_is_reported_once() -> None:
    t = HeartbeatTracker(interval_s=1.0, timeout_s=3.0)
    a, b = _who("rollout:0", 10), _who("trainer:0", 20)
    assert t.sync([a, b], now=0.0) == ([a, b], [])
    for step in range(10):
        now = float(step)
        probe, hung = t.tick(now)
        if step < 3:
            assert hung == []
        if step == 3:  # b silent since it was watched at 0: 3 s, the timeout
            assert [(h.who, h.silent_s, h.answered) for h in hung] == [(b, 3.0, False)]
            assert "never answered" in hung[0].reason()
            assert "failures.heartbeat_timeout_s = 3 s" in hung[0].reason()
        if step > 3:
            assert hung == [] and b not in probe  # once, and never probed again
        if a in probe:
            t.answered(a, now + 0.2)
    assert t.silent_s("rollout:0", 9.5) == pytest.approx(0.3)


def test_the_silence_counts_from_the_last_answer() -> None:
    t = HeartbeatTracker(interval_s=0.5, timeout_s=3.0)
    a = _who()
    t.sync([a], 0.0)
    assert t.tick(0.0) == ([a], [])
    t.answered(a, 0.1)
    assert t.tick(0.5) == ([a], [])
    t.answered(a, 1.2)  # the last answer; the probes after it go unanswered
    now = 1.5
    while True:
        probe, hung = t.tick(now)
        if hung:
            break
        for who in probe:
            t.unanswered(who)
        now += 0.5
    assert now == 4.5  # the first tick at least 3 s after 1.2
    assert hung[0].silent_s == pytest.approx(3.3) and hung[0].answered
    assert "since its last answer" in hung[0].reason()


def test_a_probe_in_flight_is_not_sent_again() -> None:
    t = HeartbeatTracker(interval_s=1.0, timeout_s=10.0)
    a = _who()
    t.sync([a], 0.0)
    assert t.tick(0.0)[0] == [a]
    assert t.tick(1.0)[0] == []  # still waiting for its answer
    t.unanswered(a)  # timed out, or failed
    assert t.tick(2.0)[0] == [a]
    t.answered(a, 2.5)
    assert t.tick(3.0)[0] == [a]


def test_a_new_process_under_the_same_name_starts_afresh() -> None:
    t = HeartbeatTracker(interval_s=1.0, timeout_s=3.0)
    old, new = _who(pid=10), _who(pid=11)
    t.sync([old], 0.0)
    t.tick(0.0)
    t.tick(1.0)
    assert t.sync([], 2.0) == ([], [old])  # died: restarting, not probed meanwhile
    assert t.tick(2.0) == ([], [])
    assert t.tick(3.0) == ([], [])
    assert t.sync([new], 4.0) == ([new], [])
    assert t.tick(4.0) == ([new], [])
    t.answered(old, 4.1)  # a late answer of the old process does not count for the new one
    for now in (5.0, 6.0):
        assert t.tick(now) == ([], [])  # its probe is still in flight
    probe, hung = t.tick(7.0)
    assert [h.who for h in hung] == [new] and not hung[0].answered
    assert t.sync([_who(pid=12)], 8.0) == ([_who(pid=12)], [new])


def test_silence_the_controller_could_not_hear_is_not_counted() -> None:
    """Ticks 20 s late (the controller's loop was blocked): the answers queued meanwhile were
    not read, so no worker is hung for it; silence after it counts again."""
    t = HeartbeatTracker(interval_s=1.0, timeout_s=5.0)
    a = _who()
    t.sync([a], 0.0)
    t.tick(0.0)
    t.answered(a, 0.5)
    assert t.tick(21.0)[1] == []  # 20 s lost: a tick was due at 1
    for now in (22.0, 23.0, 24.0, 25.0):
        probe, hung = t.tick(now)
        assert hung == []
        for who in probe:
            t.unanswered(who)
    (hung,) = t.tick(26.0)[1]
    # heard at 0.5, silent 0.5 s until the tick due at 1, then from 21 on: 5.5 s at 26
    assert hung.silent_s == pytest.approx(5.5)


@pytest.mark.parametrize(("interval", "timeout"), [(0.0, 1.0), (2.0, 1.0), (1.0, 1.0)])
def test_a_bad_interval_is_refused(interval: float, timeout: float) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        HeartbeatTracker(interval_s=interval, timeout_s=timeout)


def _reference_hung_tick(answers: list[float], ticks: list[float], timeout: float) -> int | None:
    """The first tick at which the last answer before it (or the start, 0) is ``timeout``
    or more behind: computed from the times alone."""
    for k, t in enumerate(ticks):
        last = max([a for a in answers if a <= t], default=0.0)
        if t - last >= timeout:
            return k
    return None


@pytest.mark.parametrize("seed", range(200))
def test_random_answer_times_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    interval, timeout = 0.5, rng.choice([1.0, 2.0, 3.0])
    ticks = [k * interval for k in range(60)]
    answers = sorted(rng.uniform(0, 30) for _ in range(rng.randint(0, 60)))
    t = HeartbeatTracker(interval_s=interval, timeout_s=timeout)
    a = _who()
    t.sync([a], 0.0)
    pending = list(answers)
    found = None
    for k, now in enumerate(ticks):
        while pending and pending[0] <= now:
            t.answered(a, pending.pop(0))
        probe, hung = t.tick(now)
        for who in probe:
            t.unanswered(who)  # answers come in by time, not per probe
        if hung:
            assert found is None, "reported twice"
            found = k
            expected_silence = now - max([x for x in answers if x <= now], default=0.0)
            assert hung[0].silent_s == pytest.approx(expected_silence)
    assert found == _reference_hung_tick(answers, ticks, timeout)


# --------------------------------------------------------------------------- the task
@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.asyncio
async def test_the_silent_worker_is_killed_and_named_and_the_answering_one_lives(
    run_dir: str, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    beat = Heartbeat(FailuresConfig(heartbeat_timeout_s=0.6))
    talker, silent = sleepers
    async with control_plane(run_dir) as (control, ctx, address, tg):
        good = FakeWorker(ctx, address, "rollout", 0, talker.pid)
        bad = FakeWorker(ctx, address, "trainer", 0, silent.pid)
        await good.handshake()
        await bad.handshake()
        with anyio.fail_after(5):
            await control.wait_peer("rollout:0")
            await control.wait_peer("trainer:0")
        tg.start_soon(good.answer_health)
        with structlog.testing.capture_logs() as logs:
            start = time.monotonic()
            tg.start_soon(beat.run, control)
            with anyio.fail_after(5):
                while silent.poll() is None:
                    await anyio.sleep(0.02)
            waited = time.monotonic() - start
            await anyio.sleep(0.5)  # the answering one survives more beats
    assert silent.returncode == -signal.SIGKILL
    assert talker.poll() is None
    # killed once the timeout passed, not before; the first tick after it is the one that
    # finds it (the tracker's tests above, on a fake clock): on a busy machine the wall clock
    # can add any delay, which fail_after(5) bounds
    assert waited >= 0.6, waited
    (hung,) = [e for e in logs if e["event"] == "worker_hung"]
    assert (hung["worker"], hung["group"], hung["rank"], hung["pid"]) == (
        "trainer:0", "trainer", 0, silent.pid)
    assert hung["log"] == "/logs/trainer-0.log"
    # the silence it was found with, on the heartbeat's clock: past the timeout, by less than
    # two intervals (a tick more than an interval late is forgiven), however busy the machine
    assert beat.interval_s == pytest.approx(0.05)  # the timeout / PROBES_PER_TIMEOUT
    assert 0.6 <= hung["silent_s"] <= 0.6 + 2 * beat.interval_s, hung
    assert hung["action"] == "killed (SIGKILL)" and hung["last_answer"] is None

    peers = {p.identity: p for p in control.peers.values()}
    died = WorkerDiedError("trainer", 0, -9, "/logs/trainer-0.log", "and more")
    named = beat.named(peers["trainer:0"], died)
    assert isinstance(named, WorkerHungError) and named.pid == silent.pid
    text = str(named)
    assert text.startswith("worker trainer:0 hung: it answered no health probe for ")
    assert "it never answered one" in text and "its log: /logs/trainer-0.log" in text
    assert text.endswith("\nand more") and "exit code" not in text
    assert (named.group, named.rank, named.exit_code) == ("trainer", 0, -9)
    other = WorkerDiedError("rollout", 0, -9, "/logs/rollout-0.log")
    assert beat.named(peers["rollout:0"], other) is other  # not killed by the heartbeat


@pytest.mark.asyncio
async def test_the_controllers_own_process_is_not_probed(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of a launch serves trainer rank 0 in the controller's process: never killed."""
    sent: list[Any] = []
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda *args: sent.append(args))
    beat = Heartbeat(FailuresConfig(heartbeat_timeout_s=0.2))
    async with control_plane(run_dir) as (control, ctx, address, tg):
        await FakeWorker(ctx, address, "trainer", 0, os.getpid()).handshake()
        with anyio.fail_after(5):
            await control.wait_peer("trainer:0")
        with structlog.testing.capture_logs() as logs:
            tg.start_soon(beat.run, control)
            await anyio.sleep(0.6)
    assert sent == [] and not [e for e in logs if e["event"] == "worker_hung"]


@pytest.mark.asyncio
async def test_a_silent_worker_on_another_host_is_declared_lost_not_signalled(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pid (here the test's own, as a pid of another host may be any process here) is
    never opened nor signalled; after the timeout it is named lost, with its host."""
    sent: list[Any] = []
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda *args: sent.append(args))
    opened: list[int] = []
    real_open = os.pidfd_open
    monkeypatch.setattr(os, "pidfd_open", lambda pid, *a: opened.append(pid) or real_open(pid, *a))
    beat = Heartbeat(FailuresConfig(heartbeat_timeout_s=0.6))
    async with control_plane(run_dir, host="node0/b/1", remote_ok=True) as (control, ctx, address, tg):
        far = FakeWorker(ctx, address, "rollout", 0, os.getpid() + 1)
        await far.handshake(host="node1/b/2")
        with anyio.fail_after(5):
            peer = await control.wait_peer("rollout:0")
        assert peer.remote and peer.host == "node1/b/2"
        with structlog.testing.capture_logs() as logs:
            start = time.monotonic()
            tg.start_soon(beat.run, control)
            with anyio.fail_after(5):
                lost = await beat.lost(peer)
            waited = time.monotonic() - start
    assert waited >= 0.6, waited  # the timeout; when after it: as above
    assert sent == [] and opened == []
    assert isinstance(lost, WorkerLostError) and (lost.host, lost.pid) == ("node1", os.getpid() + 1)
    assert str(lost).startswith("worker rollout:0 on host 'node1' (pid ")
    assert "went away or was cut off" in str(lost) and "/logs/rollout-0.log" in str(lost)
    (event,) = [e for e in logs if e["event"] == "worker_lost"]
    assert event["host"] == "node1" and not [e for e in logs if e["event"] == "worker_hung"]


@pytest.mark.asyncio
async def test_a_timeout_of_zero_turns_it_off(run_dir: str) -> None:
    beat = Heartbeat(FailuresConfig(heartbeat_timeout_s=0.0))
    async with control_plane(run_dir) as (control, _, _, _):
        with anyio.fail_after(1):
            await beat.run(control)  # returns at once
