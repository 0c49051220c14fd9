"""``asyncrl plot RUN_DIR``: pictures of a run from its ``metrics.jsonl``.

Draws the file's last run (with its resumed lives; a new run into the same directory starts
over). Writes into ``OUT`` (default ``RUN_DIR/plots``):

* ``reward.png``: reward and accuracy of each step's samples, and the held-out accuracy of
  each evaluation;
* ``staleness.png``: the most and the mean staleness of each step's groups (versions between
  the weights that generated a sample and those it trains), with the sampler's bound;
* ``timeline.png``: generation (the run's, and each rollout worker's), training, the
  trainers' waits inside a step, refit,
  evaluation, checkpoints and restarts over the run's wall time, one lane each
  (:mod:`asyncrl.obs.timeline`), so overlap, or its absence, and an idle worker show at a glance;
* ``timeline.json``: the same timeline as a Chrome trace (open it in https://ui.perfetto.dev).

The PNGs need matplotlib (``pip install 'asyncrl[plot]'``); the trace does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.obs.timeline import Span, chrome_trace, lanes, last_run, overlap, read_records, spans

__all__ = ["plot_run"]

_COLORS = {
    "start-up": "#8C8C8C", "generation": "#4C72B0", "tool": "#64B5CD", "training": "#DD8452",
    "waiting": "#BBBBBB", "refit": "#55A868", "evaluation": "#8172B3", "checkpoint": "#937860",
    "restart": "#C44E52",
}  # fmt: skip


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write the trace and (with matplotlib) the PNGs; returns what was written and the
    timeline's overlap figures.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        ValueError: a run with no trained step yet, or an unreadable record.
        ImportError: matplotlib is missing (after the trace was written).
    """
    records = last_run(read_records(run_dir))
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError(f"{run_dir}: no trained step in metrics.jsonl yet")
    dest = Path(out) if out is not None else Path(run_dir) / "plots"
    dest.mkdir(parents=True, exist_ok=True)
    timeline = spans(records)
    (dest / "timeline.json").write_text(json.dumps(chrome_trace(timeline)))
    result: dict[str, Any] = {"trace": str(dest / "timeline.json"), **overlap(timeline)}
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            f"the PNGs need matplotlib: pip install 'asyncrl[plot]' (the trace is written: "
            f"{dest / 'timeline.json'})"
        ) from exc
    matplotlib.use("Agg")
    result["pngs"] = [
        _reward(records, train, dest / "reward.png"),
        _staleness(records, train, dest / "staleness.png"),
        _timeline(timeline, dest / "timeline.png"),
    ]
    return result


def _reward(records: list[dict[str, Any]], train: list[dict[str, Any]], path: Path) -> str:
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [r["reward"] for r in train], label="reward (train samples)", lw=1.2)
    ax.plot(steps, [r["accuracy"] for r in train], ":", label="accuracy (train samples)", lw=1.6)
    for name in sorted({k for r in train for k in r if k.startswith("reward/")}):
        points = [(r["step"], r[name]) for r in train if name in r]
        ax.plot(*zip(*points), "--", label=f"{name} (component)", lw=1.0)
    evals = [r for r in records if r.get("kind") == "eval" and "version" in r]
    if evals:
        ax.plot([e["version"] for e in evals], [e["accuracy"] for e in evals], "o--",
                label="held-out accuracy (greedy)", color="black")
    return _per_step(fig, ax, "mean over the step's samples", path)


def _staleness(records: list[dict[str, Any]], train: list[dict[str, Any]], path: Path) -> str:
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(steps, [r["staleness_max"] for r in train], where="mid", label="max")
    ax.plot(steps, [r["staleness_mean"] for r in train], label="mean", lw=1.2)
    bound = _bound(records)
    if bound is not None:
        ax.axhline(bound, color="red", ls=":", label=f"bound ({bound})")
    return _per_step(fig, ax, "staleness (versions)", path)


def _per_step(fig: Any, ax: Any, ylabel: str, path: Path) -> str:
    """Label a per-step chart, save it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _bound(records: list[dict[str, Any]]) -> int | None:
    """The sampler's staleness bound, from the run's config record (``None``: unknown)."""
    config = next((r["config"] for r in reversed(records) if r.get("kind") == "config"), None)
    if not config:
        return None
    try:
        from asyncrl.config import CORE_SECTIONS, from_dict
        from asyncrl.config.removed import without_removed

        core = {k: v for k, v in config.items() if k in CORE_SECTIONS}  # no service's plugin
        return int(from_dict(without_removed(core)).sampler.max_staleness)
    except Exception:  # noqa: BLE001 - a config of another version, a missing sampler plugin
        return None


def _timeline(timeline: list[Span], path: Path) -> str:
    import matplotlib.pyplot as plt

    rows = lanes(timeline)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(rows)))
    for row, lane in enumerate(reversed(rows)):
        mine = [s for s in timeline if s.lane == lane]
        for i, s in enumerate(mine):
            # consecutive steps' generation spans overlap: alternate the shade to tell them apart
            ax.broken_barh([(s.start, max(s.end - s.start, 1e-4))], (row - 0.35, 0.7),
                           color=_COLORS[lane.split(" ", 1)[0]], alpha=0.55 if i % 2 else 0.9,
                           lw=0)
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_xlabel("seconds since the run started (the start-up before 0)")
    ax.grid(axis="x", alpha=0.3)
    figures = overlap(timeline)
    ax.set_title(
        f"training {figures['training_s']:.1f} s, generation beside it "
        f"{figures['overlap_frac']:.0%} of that time", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
