"""``benchmarks/modes.py`` on two revisions in one run, interleaved: is a change as fast as before?

    .venv/bin/python benchmarks/ab.py --base a9059ce              # modes + lag, 2 rounds
    .venv/bin/python benchmarks/ab.py --base a9059ce --part lag --rounds 3

The base revision is checked out into a temporary git worktree (removed at the end); the work
tree is the other side. Rounds run in ABBA order (base, work, work, base, ...) so that a machine
that drifts (thermal, page cache, another job) weighs on both sides alike. Each side runs its
own ``benchmarks/modes.py`` with its own code: ``PYTHONPATH`` puts the side's tree and its
plugins and backends first, and a metadata folder made from the side's ``pyproject.toml`` files,
so ``importlib.metadata`` finds the side's entry points (those installed in the venv are the work
tree's, and a restructure moves the modules they name). The worker processes inherit both.

The table gives, per mode, the median over rounds of s/step for each side and work/base; then
the loop-lag p99 (steady state) the same way. Results go to ``--out`` (JSON, default
``runs/benchmarks/ab.json``, ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _projects(tree: Path) -> list[Path]:
    """The tree's ``pyproject.toml`` files: the core, then each plugin and backend."""
    return [tree / "pyproject.toml"] + sorted(tree.glob("plugins/*/pyproject.toml")) + sorted(
        tree.glob("backends/*/pyproject.toml")
    )


def write_metadata(tree: Path, into: Path) -> None:
    """One ``<name>-<version>.dist-info`` per project of ``tree`` with its entry points."""
    for pyproject in _projects(tree):
        project = tomllib.loads(pyproject.read_text())["project"]
        name = project["name"].replace("-", "_")
        info = into / f"{name}-{project.get('version', '0')}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project.get('version', '0')}\n"
        )
        groups = dict(project.get("entry-points", {}))
        if project.get("scripts"):
            groups["console_scripts"] = project["scripts"]
        lines = []
        for group, entries in groups.items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in entries.items()]
            lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))


def side_env(tree: Path, metadata: Path) -> dict[str, str]:
    paths = [metadata, tree] + [p.parent for p in _projects(tree)[1:]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


def run_side(tree: Path, metadata: Path, part: str, extra: list[str], out: Path) -> dict[str, Any]:
    """One run of ``tree``'s ``benchmarks/modes.py`` (from a neutral directory, so the current
    directory on ``sys.path`` cannot pick the other side's package)."""
    env = side_env(tree, metadata)
    probe = "import asyncrl, importlib.metadata as m; print(asyncrl.__file__); " \
        "print(m.distribution('asyncrl')._path)"
    found = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=out.parent, capture_output=True, text=True,
        check=True,
    ).stdout.split()
    if not (found[0].startswith(str(tree)) and found[1].startswith(str(metadata))):
        raise SystemExit(f"{tree}: this side would import {found} (not its own code): stopping")
    cmd = [sys.executable, str(tree / "benchmarks" / "modes.py"), "--part", part, "--out", str(out)]
    subprocess.run(cmd + extra, env=env, cwd=out.parent, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _ratio(work: float, base: float) -> str:
    return f"{work / base:.3f}" if base else "-"


def report(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| mode | base s/step | work s/step | work/base |", "| --- | --- | --- | --- |"]
    modes = [r["mode"] for r in runs["base"][0].get("modes", [])]
    for mode in modes:
        per = {
            side: statistics.median(
                next(r["s_per_step"] for r in run["modes"] if r["mode"] == mode) for run in rs
            )
            for side, rs in runs.items()
        }
        lines.append(
            f"| {mode} | {per['base']:.3f} | {per['work']:.3f} | "
            f"{_ratio(per['work'], per['base'])} |"
        )
    if "lag" in runs["base"][0]:
        lag = {s: [run["lag"] for run in rs] for s, rs in runs.items()}
        lines.append("")
        lines.append("| loop lag (steady state) | base | work | work/base |")
        lines.append("| --- | --- | --- | --- |")
        for key, label in (
            ("loop_lag_p50_ms", "p50 ms"),
            ("loop_lag_p99_ms", "p99 ms"),
            ("loop_lag_p99_median_step_ms", "per-step p99, median ms"),
            ("samples_per_s", "samples/s"),
        ):
            b = statistics.median(x[key] for x in lag["base"])
            w = statistics.median(x[key] for x in lag["work"])
            lines.append(f"| {label} | {b:.2f} | {w:.2f} | {_ratio(w, b)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--part", choices=["modes", "lag", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side (ABBA order)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "ab.json")
    args, extra = parser.parse_known_args()
    base_rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    work_rev = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-") as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), base_rev],
            check=True, capture_output=True,
        )
        try:
            trees = {"base": base, "work": ROOT}
            for side, tree in trees.items():
                write_metadata(tree, tmp / f"meta-{side}")
            order = (["base", "work", "work", "base"] * args.rounds)[: 2 * args.rounds]
            runs: dict[str, list[dict[str, Any]]] = {"base": [], "work": []}
            for i, side in enumerate(order):
                print(f"round {i + 1}/{len(order)}: {side}", flush=True)
                out = tmp / "out" / f"{i}-{side}.json"
                out.parent.mkdir(exist_ok=True)
                runs[side].append(run_side(trees[side], tmp / f"meta-{side}", args.part, extra, out))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
            )
            shutil.rmtree(base, ignore_errors=True)
    print(f"\nbase {base_rev}, work {work_rev}, {args.rounds} round(s) a side, ABBA order\n")
    print(report(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"base": base_rev, "work": work_rev, "extra": extra, "runs": runs}, indent=2)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
