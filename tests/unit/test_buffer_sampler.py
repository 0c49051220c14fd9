"""Replay buffer and in_order sampler state machine, including the staleness bound."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncrl.buffer import BufferError, CompletedSample, ReplayBuffer
from asyncrl.samplers import InOrderSampler, Sampler


def sample(reward: float = 1.0) -> CompletedSample:
    return CompletedSample(np.array([1], np.int32), np.array([-0.1], np.float32), "stop", reward, reward > 0)


def reserve(buf: ReplayBuffer, gid: str, version: int = 0, target: int | None = 0):
    return buf.reserve(gid, prompt_id=gid, prompt_ids=[1, 2], start_version=version, target_step=target, now=0.0)


def test_reserve_commit_remove_cycle() -> None:
    buf = ReplayBuffer(capacity=3)
    reserve(buf, "a")
    reserve(buf, "b")
    assert (len(buf), buf.num_ready, buf.num_reserved) == (2, 0, 2)
    buf.commit("b", [sample()], end_version=0, now=1.0)  # out of dispatch order is fine
    assert [g.group_id for g in buf.ready_groups()] == ["b"]
    assert [g.group_id for g in buf] == ["a", "b"]  # dispatch order kept
    removed = buf.remove(["b"])
    assert removed[0].samples and len(buf) == 1


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda b: reserve(b, "a"), "already in the buffer"),
        (lambda b: b.commit("zzz", [sample()], end_version=0, now=0), "unknown group"),
        (lambda b: b.commit("a", [], end_version=0, now=0), "without samples"),
        (lambda b: b.remove(["a", "zzz"]), "unknown group"),
        (lambda b: reserve(b, "old", version=-1), "start version"),
    ],
)
def test_illegal_transitions_raise(action, match) -> None:
    buf = ReplayBuffer(capacity=4)
    reserve(buf, "a")
    with pytest.raises(BufferError, match=match):
        action(buf)
    assert [g.group_id for g in buf] == ["a"]  # nothing half-done


def test_double_commit_and_capacity() -> None:
    buf = ReplayBuffer(capacity=1)
    reserve(buf, "a")
    buf.commit("a", [sample()], end_version=0, now=0)
    with pytest.raises(BufferError, match="already committed"):
        buf.commit("a", [sample()], end_version=0, now=0)
    with pytest.raises(BufferError, match="full"):
        reserve(buf, "b")


def test_in_order_admission_with_lookahead() -> None:
    s = InOrderSampler(1)
    assert isinstance(s, Sampler)
    assert s.admit(trainer_version=0) == 0
    assert s.admit(trainer_version=0) == 1
    assert s.admit(trainer_version=0) is None  # step 2 would be 2 versions ahead
    assert s.admit(trainer_version=1) == 2
    sync = InOrderSampler(0)
    assert sync.admit(0) == 0 and sync.admit(0) is None and sync.admit(1) == 1


def test_in_order_select_takes_only_the_current_step() -> None:
    s = InOrderSampler(1)
    buf = ReplayBuffer(capacity=8)
    for i in range(3):
        reserve(buf, f"s0-{i}", target=0)
    for i in range(2):
        reserve(buf, f"s1-{i}", target=1)
    for gid in ["s1-0", "s1-1", "s0-2"]:
        buf.commit(gid, [sample()], end_version=0, now=0)
    assert s.select(buf, 0, min_groups=2, max_groups=3) == []  # only one step-0 group ready
    chosen = s.select(buf, 0, min_groups=1, max_groups=3)
    assert [g.group_id for g in chosen] == ["s0-2"]
    assert [g.group_id for g in s.select(buf, 1, 2, 2)] == ["s1-0", "s1-1"]
    with pytest.raises(ValueError):
        s.select(buf, 0, 0, 1)


def test_evict_only_ready_groups_of_past_steps() -> None:
    s = InOrderSampler(1)
    buf = ReplayBuffer(capacity=8)
    reserve(buf, "past-ready", target=0)
    reserve(buf, "past-running", target=0)
    reserve(buf, "now", target=1)
    buf.commit("past-ready", [sample()], end_version=0, now=0)
    buf.commit("now", [sample()], end_version=0, now=0)
    assert [g.group_id for g in s.evict(buf, trainer_version=1)] == ["past-ready"]
    assert s.required_buffer_capacity(16) == 32


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_staleness_bound_holds_under_random_schedules(lookahead: int) -> None:
    """Simulate the two pumps with random interleavings and random completion order.

    Invariants: a trained group is never more than ``lookahead`` versions stale, every step
    trains exactly P groups, and the buffer never exceeds P * (lookahead + 1).
    """
    P, steps = 3, 12
    for seed in range(30):
        rng = random.Random(seed)
        s = InOrderSampler(lookahead)
        cap = s.required_buffer_capacity(P)
        buf = ReplayBuffer(cap)
        trainer_v = gen_v = 0
        gate = True
        pending_step: int | None = None
        dispatched_in_batch = P
        batch_step = -1
        running: list[str] = []
        trained: dict[int, int] = {}
        while trainer_v < steps:
            move = rng.random()
            if move < 0.4:  # rollout pump tries to progress
                if dispatched_in_batch == P:
                    t = s.admit(trainer_v)
                    if t is not None and t < steps:
                        batch_step, dispatched_in_batch = t, 0
                elif gate and len(buf) < cap:
                    gid = f"{batch_step}-{dispatched_in_batch}"
                    reserve(buf, gid, version=gen_v, target=batch_step)
                    running.append(gid)
                    dispatched_in_batch += 1
            elif move < 0.7 and running:  # a generation finishes (any order)
                gid = running.pop(rng.randrange(len(running)))
                buf.commit(gid, [sample()], end_version=gen_v, now=0)
            elif move < 0.9:  # train pump
                if pending_step is not None:  # refit completes
                    gen_v, gate, pending_step = trainer_v, True, None
                    continue
                chunk = s.select(buf, trainer_v, 1, P - trained.get(trainer_v, 0))
                for g in chunk:
                    assert trainer_v - g.start_version <= lookahead
                buf.remove([g.group_id for g in chunk])
                trained[trainer_v] = trained.get(trainer_v, 0) + len(chunk)
                if trained[trainer_v] == P:
                    trainer_v += 1
                    gate, pending_step = False, trainer_v
            assert len(buf) <= cap
        assert all(trained[k] == P for k in range(steps))
