"""The run timeline (asyncrl.obs.timeline) from hand-written records, and ``asyncrl plot``
through the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.obs.timeline import (
    chrome_trace,
    lanes,
    last_run,
    overlap,
    read_records,
    spans,
    worker_spans,
)

# two steps of an asynchronous run: step 2's groups generate while step 1 trains
RECORDS = [
    {"kind": "config", "run_id": "old", "config": {}},
    {"kind": "train", "step": 1, "gen_start": 100.0, "gen_end": 101.0,
     "train_start": 100.0, "train_end": 101.0},  # a previous life: ignored
    {"kind": "config", "run_id": "r", "config": {}},
    {"kind": "eval", "label": "start", "version": 0, "accuracy": 0.25, "start": 0.0, "end": 1.0},
    {"kind": "train", "step": 1, "gen_start": 1.0, "gen_end": 3.0, "train_start": 2.5,
     "train_end": 4.0, "refit_start": 4.0, "refit_end": 4.5, "wait_s": 0.5, "reward": 0.1,
     "staleness_max": 0},
    {"kind": "train", "step": 2, "gen_start": 3.5, "gen_end": 5.0, "train_start": 4.5,
     "train_end": 6.0, "refit_start": 6.0, "refit_end": 6.25, "wait_s": 0.0, "reward": 0.2,
     "staleness_max": 1},
    {"kind": "checkpoint", "step": 2, "seconds": 0.5, "t": 7.0},
    {"kind": "worker_restarted", "worker": "rollout:1", "seconds": 2.0, "t": 9.0},
]  # fmt: skip


def test_spans_take_the_last_life_and_every_lane() -> None:
    got = [(s.lane, s.name, s.start, s.end) for s in spans(RECORDS)]
    assert got == [
        ("generation", "step 1", 1.0, 3.0),
        ("generation", "step 2", 3.5, 5.0),
        ("training", "step 1", 2.5, 4.0),
        ("training", "step 2", 4.5, 6.0),
        ("refit", "step 1", 4.0, 4.5),
        ("refit", "step 2", 6.0, 6.25),
        ("evaluation", "eval start", 0.0, 1.0),
        ("checkpoint", "step 2", 6.5, 7.0),
        ("restart", "rollout:1", 7.0, 9.0),
    ]


def test_overlap_by_hand() -> None:
    # generation [1, 3] and [3.5, 5]; training [2.5, 4] and [4.5, 6]:
    # overlaps [2.5, 3] + [3.5, 4] + [4.5, 5] = 1.5 s of 3.0 s of training
    figures = overlap(spans(RECORDS))
    assert figures == {"training_s": 3.0, "generation_s": 3.5, "overlap_s": 1.5,
                       "overlap_frac": 0.5}


def test_chrome_trace_has_one_thread_per_lane_and_microseconds() -> None:
    trace = chrome_trace(spans(RECORDS))
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names[1] == "generation" and names[3] == "refit"
    refits = [e for e in events if e["ph"] == "X" and e["cat"] == "refit"]
    assert [(e["ts"], e["dur"], e["tid"]) for e in refits] == [(4e6, 5e5, 3), (6e6, 2.5e5, 3)]
    json.dumps(trace)  # plain JSON


def test_a_cut_last_line_is_left_out_and_a_bad_one_before_is_named(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "config"}\n{"kind": "tra')
    assert read_records(tmp_path) == [{"kind": "config"}]
    path.write_text('{"kind": "config"}\nnot json\n{"kind": "x"}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON record"):
        read_records(path)


def test_asyncrl_plot_through_the_console_script(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="pip install 'asyncrl[plot]'")
    run = tmp_path / "run"
    run.mkdir()
    records = [dict(r) for r in RECORDS[2:]]
    for r in records:
        if r["kind"] == "train":
            r.update(accuracy=r["reward"], staleness_mean=r["staleness_max"] / 2)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    exe = str(Path(sys.executable).parent / "asyncrl")
    proc = subprocess.run([exe, "plot", str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = run / "plots"
    assert proc.stdout.splitlines()[-1] == (
        "training 3.0 s; generation ran beside it 1.5 s (50%)"
    )
    for name in ("reward.png", "staleness.png", "timeline.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "timeline.json").read_text())["traceEvents"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"kind": "config"}\n')
    proc = subprocess.run([exe, "plot", str(empty)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no trained step in metrics.jsonl yet" in proc.stderr


def test_last_run_starts_at_the_last_fresh_start_and_keeps_its_resumed_lives() -> None:
    records = [
        {"kind": "config", "n": 1}, {"kind": "train", "step": 1},  # an older run
        {"kind": "config", "n": 2}, {"kind": "train", "step": 1},  # the last fresh start
        {"kind": "config", "n": 3}, {"kind": "resume", "step": 1}, {"kind": "train", "step": 2},
    ]  # fmt: skip
    assert last_run(records) == records[2:]
    assert last_run(records[:2]) == records[:2]
    assert last_run([]) == []


def test_worker_spans_union_each_workers_groups_and_skip_restored_ones() -> None:
    from types import SimpleNamespace as G

    groups = [
        G(worker="rollout:0", dispatched_at=1.0, committed_at=2.0),
        G(worker="rollout:1", dispatched_at=1.0, committed_at=1.5),
        G(worker="rollout:0", dispatched_at=1.5, committed_at=3.0),  # overlaps the first
        G(worker="rollout:0", dispatched_at=4.0, committed_at=4.25),
        G(worker="", dispatched_at=0.0, committed_at=None),  # restored from a checkpoint
    ]
    assert worker_spans(groups) == {
        "rollout:0": [[1.0, 3.0], [4.0, 4.25]],
        "rollout:1": [[1.0, 1.5]],
    }


def test_each_worker_gets_its_lane_after_the_runs_generation_lane() -> None:
    records = [
        {"kind": "config", "run_id": "r", "config": {}},
        {"kind": "train", "step": 1, "gen_start": 1.0, "gen_end": 3.0, "train_start": 3.0,
         "train_end": 4.0, "gen_by_worker": {"rollout:1": [[1.0, 2.0]],
                                             "rollout:0": [[1.0, 3.0]]},
         "wait_spans": [[3.0, 3.25], [3.5, 3.75]]},
    ]  # fmt: skip
    timeline = spans(records)
    assert lanes(timeline) == [
        "generation", "generation rollout:0", "generation rollout:1", "training", "waiting"
    ]
    assert [(s.start, s.end) for s in timeline if s.lane == "waiting"] == [(3.0, 3.25),
                                                                             (3.5, 3.75)]
    assert [(s.lane, s.start, s.end) for s in timeline if s.lane.startswith("generation ")] == [
        ("generation rollout:0", 1.0, 3.0), ("generation rollout:1", 1.0, 2.0)
    ]
    trace = chrome_trace(timeline)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert names == {1: "generation", 2: "generation rollout:0", 3: "generation rollout:1",
                     4: "training", 5: "waiting"}
    # the overlap figures count the run's generation lane only (not each worker again)
    assert overlap(timeline)["generation_s"] == 2.0


def test_each_tool_gets_its_lane_after_generation() -> None:
    """A multi-turn run's step records carry each tool's busy time (``tool_busy``, the tool
    box's merged spans): one lane per tool, between generation and training."""
    records = [
        {"kind": "config", "run_id": "r", "config": {}},
        {"kind": "train", "step": 1, "gen_start": 1.0, "gen_end": 3.0, "train_start": 3.0,
         "train_end": 4.0, "tool_busy": {"search": [[1.5, 2.0]], "calc": [[1.2, 1.3],
                                                                          [2.1, 2.4]]}},
    ]  # fmt: skip
    timeline = spans(records)
    assert lanes(timeline) == ["generation", "tool calc", "tool search", "training"]
    assert [(s.start, s.end) for s in timeline if s.lane == "tool calc"] == [(1.2, 1.3),
                                                                             (2.1, 2.4)]
