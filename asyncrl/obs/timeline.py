"""A run's timeline, read back from its ``metrics.jsonl`` (pure: no plotting here).

Every time in the records is seconds on the run's clock (``time.perf_counter()`` since the
controller started; :class:`~asyncrl.obs.log.MetricsWriter` stamps each record's writing time as
``t``). The spans, one lane each::

    generation   a step's groups: first dispatch to last commit   (train: gen_start, gen_end)
    generation W rollout worker W generating that step's groups   (train: gen_by_worker[W])
    tool T       tool T running for episodes since the last step  (train: tool_busy[T])
    training     the step open on the trainers to its FinishStep   (train: train_start, train_end)
    waiting      the trainers waiting for a step's data (no chunk     (train: wait_spans)
                 ready) or for a validation before its FinishStep
    refit        the version bump to the generators serving it     (train: refit_start, refit_end)
    evaluation   a held-out evaluation                             (eval: start, end)
    checkpoint   a save, from its snapshot to its commit           (checkpoint: t - seconds, t)
    restart      a dead rollout worker until it serves again       (worker_restarted: idem)
    start-up     the launch up to step 1 (before the run clock's 0:  (startup: phases,
                 the launch, then each worker's imports, plugin and    workers)
                 backend start; after it, the workers, the first
                 evaluation and step 1)

:func:`chrome_trace` writes them as a Chrome trace (``chrome://tracing``, Perfetto's UI);
:func:`overlap` says how much of the training time generation ran beside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LANES",
    "Span",
    "chrome_trace",
    "lanes",
    "last_run",
    "overlap",
    "read_records",
    "spans",
    "worker_spans",
]

LANES = (
    "start-up", "generation", "tool", "training", "waiting", "refit", "evaluation",
    "checkpoint", "restart",
)  # fmt: skip


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    args: dict[str, Any]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a run directory, or the file), in order; a last
    line cut short by a run that is still writing, or was killed, is left out.

    Raises:
        FileNotFoundError: no metrics file there.
        ValueError: a line that is not JSON before the last one.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
    return records


def last_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the file's last run: from its last fresh start (a ``config`` record
    whose life has no ``resume`` record), through every resumed life after it. A new run into
    the same output directory appends to the file; its steps start from 1 again."""
    lives = [i for i, r in enumerate(records) if r.get("kind") == "config"]
    start = 0
    for n, i in enumerate(lives):
        end = lives[n + 1] if n + 1 < len(lives) else len(records)
        if not any(r.get("kind") == "resume" for r in records[i:end]):
            start = i
    return records[start:]


def spans(records: list[dict[str, Any]]) -> list[Span]:
    """The timeline's spans, by lane then time. A run that resumed appends to the same file
    on a new clock: only the records after the last ``config`` record (the last life) count."""
    last = max((i for i, r in enumerate(records) if r.get("kind") == "config"), default=-1)
    out: list[Span] = []
    for r in records[last + 1 :]:
        kind = r.get("kind")
        if kind == "train":
            step = r["step"]
            for lane, a, b in (
                ("generation", "gen_start", "gen_end"),
                ("training", "train_start", "train_end"),
                ("refit", "refit_start", "refit_end"),
            ):
                if r.get(a) is not None and r.get(b) is not None:
                    args = {"step": step}
                    if lane == "training":
                        args.update(wait_s=r.get("wait_s"), reward=r.get("reward"))
                    if lane == "generation":
                        args.update(staleness_max=r.get("staleness_max"))
                    out.append(Span(lane, f"step {step}", r[a], r[b], args))
            for a, b in r.get("wait_spans") or []:
                out.append(Span("waiting", f"step {step}", a, b, {"step": step}))
            for worker, intervals in (r.get("gen_by_worker") or {}).items():
                for a, b in intervals:
                    out.append(Span(f"generation {worker}", f"step {step}", a, b,
                                    {"step": step}))
            for tool, intervals in (r.get("tool_busy") or {}).items():
                for a, b in intervals:
                    out.append(Span(f"tool {tool}", f"step {step}", a, b, {"step": step}))
        elif kind == "eval" and "start" in r and "end" in r:
            out.append(Span("evaluation", f"eval {r['label']}", r["start"], r["end"],
                            {"accuracy": r.get("accuracy")}))
        elif kind == "startup":
            out += _startup_spans(r)
        elif kind in ("checkpoint", "worker_restarted") and "t" in r and "seconds" in r:
            lane = "checkpoint" if kind == "checkpoint" else "restart"
            name = f"step {r.get('step')}" if kind == "checkpoint" else str(r.get("worker"))
            out.append(Span(lane, name, r["t"] - r["seconds"], r["t"], {"seconds": r["seconds"]}))
    return sorted(out, key=lambda s: (_lane_key(s.lane), s.start))


def _startup_spans(r: dict[str, Any]) -> list[Span]:
    """A ``startup`` record's spans on the run clock (its times count from the launch, which
    is ``-controller_s`` on the run clock): the launch, each worker's phases on a lane of its
    own, the workers until all were ready, the first evaluation's wait and step 1."""
    zero = r["controller_s"]  # the launch -> run clock
    p = r["phases"]
    out = [Span("start-up", "launch", -zero, 0.0, {"seconds": p["launch"]})]
    for worker, w in r["workers"].items():
        t = w["process_s"] - zero
        for phase in ("imports", "handshake", "plugin", "backend"):
            out.append(Span(f"start-up {worker}", phase, t, t + w[phase], {"seconds": w[phase]}))
            t += w[phase]
    t = 0.0
    for phase in ("workers", "first_eval", "first_step"):
        out.append(Span("start-up", phase, t, t + p[phase], {"seconds": p[phase]}))
        t += p[phase]
    return out


def _lane_key(lane: str) -> tuple[int, str]:
    return LANES.index(lane.split(" ", 1)[0]), lane


def lanes(timeline: list[Span]) -> list[str]:
    """The lanes that have spans, in display order: the run's generation, each worker's,
    training, refit, evaluation, checkpoint, restart."""
    return sorted({s.lane for s in timeline}, key=_lane_key)


def worker_spans(groups: Iterable[Any]) -> dict[str, list[list[float]]]:
    """Each rollout worker's generation time for a step's groups (a step record's
    ``gen_by_worker``): the union of its groups' spans from dispatch to commit, in seconds on
    the run's clock (microsecond precision). Groups restored from a checkpoint (no worker,
    no commit time) are left out."""
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for g in groups:
        if g.worker and g.committed_at is not None:
            by_worker.setdefault(g.worker, []).append((g.dispatched_at, g.committed_at))
    return {
        w: [[round(a, 6), round(b, 6)] for a, b in _union(intervals)]
        for w, intervals in sorted(by_worker.items())
    }


def chrome_trace(timeline: list[Span]) -> dict[str, Any]:
    """The spans as Chrome trace events (complete events, microseconds; one thread per
    lane), which Perfetto and ``chrome://tracing`` open. Times are the run clock's, moved
    later by the start-up's launch where there is one (trace times are not negative)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "asyncrl run"}}
    ]
    order = lanes(timeline)
    origin = min([0.0, *(s.start for s in timeline)])
    for tid, lane in enumerate(order, start=1):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                       "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                       "args": {"sort_index": tid}})
    for s in timeline:
        events.append({
            "ph": "X", "name": s.name, "cat": s.lane, "pid": 1, "tid": order.index(s.lane) + 1,
            "ts": round((s.start - origin) * 1e6, 1), "dur": round(max(0.0, s.end - s.start) * 1e6, 1),
            "args": s.args,
        })  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap(timeline: list[Span]) -> dict[str, float]:
    """Seconds of training, of generation, and of training during which generation ran too
    (its share: ``overlap_frac``; 0 in a synchronous run, near 1 when generation never stops
    for training)."""
    gen = _union([(s.start, s.end) for s in timeline if s.lane == "generation"])
    train = _union([(s.start, s.end) for s in timeline if s.lane == "training"])
    both = 0.0
    for a, b in train:
        for c, d in gen:
            both += max(0.0, min(b, d) - max(a, c))
    train_s = sum(b - a for a, b in train)
    return {
        "training_s": train_s,
        "generation_s": sum(b - a for a, b in gen),
        "overlap_s": both,
        "overlap_frac": both / train_s if train_s else 0.0,
    }
