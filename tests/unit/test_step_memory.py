"""The step record's trainer memory: the largest peak of the trainer ranks', in GiB, beside
what the memory plan said."""

from __future__ import annotations

from asyncrl.obs.steps import trainer_memory
from asyncrl.wire.messages import StepResult


def result(allocated: int, reserved: int) -> StepResult:
    return StepResult(step=0, loss=0.0, grad_norm=0.0, num_loss_tokens=1, lr=0.0, seconds=0.0,
                      peak_allocated_bytes=allocated, peak_reserved_bytes=reserved)  # fmt: skip


def test_the_largest_rank_is_the_steps_peak() -> None:
    gib = 2**30
    ranks = [result(3 * gib, 4 * gib), result(5 * gib + gib // 2, 6 * gib), result(gib, 8 * gib)]
    assert trainer_memory(ranks) == {"trainer_peak_allocated_gib": 5.5,
                                     "trainer_peak_reserved_gib": 8.0}  # fmt: skip


def test_ranks_that_measured_nothing_add_no_keys() -> None:
    assert trainer_memory([result(0, 0), result(0, 0)]) == {}
    assert trainer_memory([StepResult(step=0, loss=0.0, grad_norm=0.0, num_loss_tokens=1, lr=0.0,
                                      seconds=0.0)]) == {}  # fmt: skip


def test_the_plan_stands_beside_measured_peaks_only() -> None:
    gib = 2**30
    assert trainer_memory([result(3 * gib, 4 * gib)], planned=gib + gib // 4) == {
        "trainer_peak_allocated_gib": 3.0, "trainer_peak_reserved_gib": 4.0,
        "trainer_plan_gib": 1.25,
    }  # fmt: skip
    assert trainer_memory([result(0, 0)], planned=gib) == {}  # CPU: nothing to compare
    assert "trainer_plan_gib" not in trainer_memory([result(gib, gib)], planned=None)
