"""The worker's watch of its controller's silence (asyncrl.worker.controller_watch), pure,
under fake clocks: hand-worked timelines, then random ones (hypothesis) checked against a
reference computed from the timeline alone: the time since the controller's last message
during which the worker's own loop ran (whole-run suspensions taken out)."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncrl.worker.controller_watch import ControllerSilence


def _watch(*, startup_s: float = 10.0, now: float = 0.0) -> ControllerSilence:
    """Probes every 1 s, timeout 3 s: the limit is 4 s (14 s before the first probe)."""
    return ControllerSilence(interval_s=1.0, timeout_s=3.0, startup_s=startup_s, tick_s=1.0,
                             now=now)  # fmt: skip


def test_a_controller_that_falls_silent_is_named_at_the_first_tick_past_the_limit() -> None:
    w = _watch()
    for t in (0.5, 1.5, 2.5):  # its last probe at 2.5
        w.heard(t, probe=True)
    assert [w.tick(float(t)) for t in range(1, 7)] == [None] * 6  # 3.5 s silent at 6
    assert w.tick(7.0) == pytest.approx(4.5)  # 4.5 > 4


def test_a_suspend_of_every_process_is_not_blamed_on_the_controller() -> None:
    """Probes every second until 9.5, ticks every second until 10; then the whole run is
    stopped until 100. The tick at 100 comes 89 s late: that time does not count (1.5 s of
    silence, not 90.5 s). The controller, resumed, probes at 100.3; once it stops for good
    it is named 4.7 s later, at 105."""
    w = _watch()
    for t in range(10):
        w.heard(t + 0.5, probe=True)
        assert w.tick(t + 1.0) is None
    assert w.tick(100.0) is None
    assert w.slept_s == w.slept_in_silence_s == pytest.approx(89.0)
    w.heard(100.3, probe=True)
    assert (w.slept_s, w.slept_in_silence_s) == (pytest.approx(89.0), 0.0)
    assert [w.tick(t) for t in (101.0, 102.0, 103.0, 104.0)] == [None] * 4
    assert w.tick(105.0) == pytest.approx(4.7)


def test_a_worker_stopped_after_its_controller_counts_only_its_own_waking_time() -> None:
    """The controller's last probe at 2.5; the worker itself stops from 3 to 50. Silence it
    was awake for: 0.5 s before its tick at 3, the tick's own second, then from 50: named
    at 53 (4.5 s), not at 50 (47.5 s)."""
    w = _watch()
    for t in (0.5, 1.5, 2.5):
        w.heard(t, probe=True)
    assert [w.tick(t) for t in (1.0, 2.0, 3.0, 50.0, 51.0, 52.0)] == [None] * 6
    assert w.tick(53.0) == pytest.approx(4.5)
    assert w.slept_in_silence_s == pytest.approx(46.0)  # 50 - 3 - 1: the tick due at 4 came at 50


def test_ticks_merely_late_under_load_are_not_forgiven() -> None:
    """Each tick 0.9 s late (less than a tick): every second of silence counts."""
    w = _watch()
    w.heard(0.0, probe=True)
    assert [w.tick(t) for t in (1.9, 3.8)] == [None, None]
    assert w.tick(5.7) == pytest.approx(5.7)
    assert w.slept_s == 0.0


def test_a_loop_always_late_still_names_the_controller_later() -> None:
    """Ticks 2.5 s apart: 1.5 s of each gap forgiven, 1 s counted; 5 s counted at 12.5."""
    w = _watch()
    w.heard(0.0, probe=True)
    assert [w.tick(t) for t in (2.5, 5.0, 7.5, 10.0)] == [None] * 4  # 4 s at 10: not past
    assert w.tick(12.5) == pytest.approx(5.0)
    assert w.slept_s == pytest.approx(7.5)


def test_before_the_first_probe_the_limit_waits_for_the_start_up_too() -> None:
    """The heartbeat starts once every worker is ready: until a probe comes the limit is
    4 + 10 s; a call (not a probe) restarts the silence but not the short limit."""
    w = _watch()
    assert [w.tick(float(t)) for t in range(1, 15)] == [None] * 14  # 14 s: not past 14
    w.heard(14.5)  # a call
    assert w.limit_s == 14.0 and not w.probed
    assert [w.tick(float(t)) for t in range(15, 29)] == [None] * 14
    assert w.tick(29.0) == pytest.approx(14.5)
    w2 = _watch()
    w2.heard(3.0, probe=True)
    assert w2.limit_s == 4.0
    assert [w2.tick(float(t)) for t in range(1, 8)] == [None] * 7
    assert w2.tick(8.0) == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("interval", "timeout", "tick", "startup"),
    [(0.0, 1.0, 1.0, 0.0), (2.0, 1.0, 1.0, 0.0), (1.0, 2.0, 0.0, 0.0), (1.0, 2.0, 1.0, -1.0)],
)
def test_bad_settings_are_refused_naming_them(
    interval: float, timeout: float, tick: float, startup: float
) -> None:
    with pytest.raises(ValueError, match=r"need 0 < interval_s .* < timeout_s .*tick_s"):
        ControllerSilence(interval_s=interval, timeout_s=timeout, startup_s=startup,
                          tick_s=tick, now=0.0)  # fmt: skip


# --------------------------------------------------------------------------- random timelines
JITTER_TICK = 0.5
"""A worker's tick comes up to half a tick late (load), never a whole tick."""
JITTER_PROBE = 0.2
"""The controller's probes come up to a fifth of an interval late."""
RESUME_S = 0.05
"""After a suspension each process's first event comes up to this much after the resume."""


def _awake_at(t: float, windows: list[tuple[float, float]], rng: random.Random) -> float:
    """When an event due at ``t`` happens: then, or just after the suspension holding it."""
    for a, b in windows:
        if a <= t < b:
            return b + rng.uniform(0, RESUME_S)
    return t


def _timeline(
    interval: float, tick: float, windows: list[tuple[float, float]], stop_at: float | None,
    end: float, seed: int,
) -> list[tuple[float, str]]:
    """The controller's probes (until ``stop_at``, when it is stopped alone) and the worker's
    ticks, both held up by the whole-run suspensions ``windows``, in time order."""
    rng = random.Random(seed)
    events, t = [], 0.0
    while t < end:
        t = _awake_at(t, windows, rng)
        if stop_at is not None and t >= stop_at:
            break
        events.append((t, "probe"))
        t += interval * (1 + rng.uniform(0, JITTER_PROBE))
    t = tick
    while t < end:
        t = _awake_at(t, windows, rng)
        events.append((t, "tick"))
        t += tick * (1 + rng.uniform(0, JITTER_TICK))
    return sorted(events)


def _awake_silence(t: float, probes: list[float], windows: list[tuple[float, float]]) -> float:
    """Reference: the time since the last probe before ``t`` during which the worker ran."""
    last = max(p for p in probes if p <= t)
    slept = sum(max(0.0, min(b, t) - max(a, last)) for a, b in windows)
    return t - last - slept


def _windows_between(lo: float, hi: float, windows: list[tuple[float, float]]) -> int:
    return sum(1 for a, b in windows if b > lo and a < hi)


@st.composite
def _runs(draw: st.DrawFn) -> tuple[float, float, list[tuple[float, float]], float | None, int]:
    interval = draw(st.sampled_from([0.5, 1.0, 5.0]))
    tick = min(1.0, interval)
    least = max(interval * 1.01, JITTER_PROBE * interval + 3 * tick)
    timeout = least * draw(st.floats(1.0, 10.0))
    limit = interval + timeout
    gap = 2 * interval + 2 * tick  # a probe comes between two suspensions
    windows, t = [], draw(st.floats(0.0, 3 * limit))
    for _ in range(draw(st.integers(0, 4))):
        start = t + gap + draw(st.floats(0.0, 2 * limit))
        windows.append((start, start + draw(st.floats(0.05, 10 * limit))))
        t = windows[-1][1]
    stop_at = draw(st.none() | st.floats(interval, t + 2 * limit))
    if stop_at is not None and any(a <= stop_at < b for a, b in windows):
        stop_at = None  # stopped alone means while the run was not suspended
    return interval, timeout, windows, stop_at, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=300, deadline=None)
@given(_runs())
# a probe heard just after a resume: forgiving the sleep must not move the silence's start
# past it (the watch then named 1.3 ms late, found by CI)
@example((5.0, 20.515625, [(97.0, 99.0), (111.0, 112.0), (148.0, 148.5), (183.5, 186.5)],
          187.0, 812))
def test_random_suspensions_and_stops_match_the_reference(
    run: tuple[float, float, list[tuple[float, float]], float | None, int],
) -> None:
    """Never named while it probes on every waking moment, however long the run was
    suspended; once stopped alone, named at the first tick where the silence the worker was
    awake for passes the limit (within what a suspension's edges can shift: up to two
    ticks early, per suspension, and half a tick plus the resume's delay late)."""
    interval, timeout, windows, stop_at, seed = run
    tick = min(1.0, interval)
    limit = interval + timeout
    last_window = windows[-1][1] if windows else 0.0
    end = max(last_window, stop_at or 0.0) + 2 * limit + 10 * tick + sum(b - a for a, b in windows)
    events = _timeline(interval, tick, windows, stop_at, end, seed)
    probes = [t for t, what in events if what == "probe"]
    w = ControllerSilence(interval_s=interval, timeout_s=timeout, startup_s=0.0, tick_s=tick,
                          now=0.0)  # fmt: skip
    named: tuple[float, float] | None = None
    checked = []
    for t, what in events:
        if what == "probe":
            w.heard(t, probe=True)
            continue
        silent = w.tick(t)
        if silent is not None:
            named = (t, silent)
            break
        checked.append(t)
    if stop_at is None:
        assert named is None, (named, windows)
        return
    assert named is not None, (stop_at, windows)
    named_at, silent = named
    assert silent > limit
    last = max(p for p in probes if p <= named_at)
    n = _windows_between(last, named_at, windows)
    assert _awake_silence(named_at, probes, windows) > limit - n * 2.5 * tick - 1e-9
    for t in checked:
        late = _windows_between(max(p for p in probes if p <= t), t, windows)
        assert _awake_silence(t, probes, windows) <= limit + late * (
            JITTER_TICK * tick + RESUME_S) + 1e-9, t
