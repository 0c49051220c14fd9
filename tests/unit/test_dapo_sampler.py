"""The example sampler plugin (plugins/asyncrl-sampler-dapo) through the real table of live
groups, its two real phases (``schedule_support.Phases``) and the real entry point."""

from __future__ import annotations

from asyncrl_sampler_dapo import DynamicConfig, DynamicSampler

from asyncrl.config import make_sampler
from schedule_support import Dispatch, Phases, phases


def run(rewards_of: dict[int, list[float]], fraction: float = 0.9) -> tuple[Phases, list[str]]:
    sampler = DynamicSampler(
        DynamicConfig(over_sampling_ratio=2.0, max_filtered_fraction=fraction, window_groups=4)
    )
    s = phases(sampler, P=2, N=2, steps=1, cap=8, inflight=16, min_chunk=2)
    trained: list[str] = []
    while not s.finished:
        d = s.dispatch()
        if isinstance(d, Dispatch):
            s.sample_finished(d.group_id)
            s.sample_finished(d.group_id)
            s.committed(d.group_id, rewards_of.get(d.index, [1.0, 1.0]))
            continue
        chunk = s.next_chunk()
        trained += chunk.groups
        if s.taken == 2:
            s.finish_step()
    return s, trained


def test_groups_without_reward_variance_are_dropped_and_counted() -> None:
    # only prompts 2 and 4 get different rewards; the scheduler dispatches more while the
    # filtered groups leave (over-sampling ratio 2: up to 4 live groups for the 2 needed)
    s, trained = run({2: [0.0, 1.0], 4: [1.0, 0.0]}, fraction=0.99)
    assert trained == ["g2", "g4"]
    assert s.evicted == s.sampler.filtered >= 3  # g0, g1, g3 at least
    assert s.wasted_samples == 2 * (s.evicted + s.unused + s.aborted)


def test_a_solved_task_does_not_stall_the_run() -> None:
    s, trained = run({}, fraction=0.5)  # every group uninformative
    assert len(trained) == 2  # trained anyway once the filtered share passed 0.5
    assert s.evicted <= 4


def test_the_entry_point_and_its_knobs() -> None:
    sampler = make_sampler({"name": "dynamic", "min_reward_std": 0.1})
    assert isinstance(sampler, DynamicSampler) and sampler.min_std == 0.1
    assert sampler.required_buffer_capacity(16) == 48  # ceil(1.5 * 16 * 2)
