"""``benchmarks/modes.py`` on two revisions in one run, interleaved: is a change as fast as before?

    .venv/bin/python benchmarks/ab.py --base a9059ce              # modes + lag, 2 rounds
    .venv/bin/python benchmarks/ab.py --base a9059ce --part lag --rounds 3
    python3 benchmarks/ab.py --base-dir ../old-checkout      # where there is no git

The base revision is checked out into a temporary git worktree (removed at the end); the work
tree is the other side. Rounds run in ABBA order (base, work, work, base, ...) so that a machine
that drifts (thermal, page cache, another job) weighs on both sides alike. Each side runs its
own ``benchmarks/modes.py`` with its own code: ``PYTHONPATH`` puts first a metadata folder
made from the side's ``pyproject.toml`` files (``benchmarks/gpu/register_plugins.py``), so that
``importlib.metadata`` finds the side's entry points (those installed in the venv are the work
tree's, and a restructure moves the modules they name), then the side's tree, plugins and
backends. The worker processes inherit both.

The table gives, per mode, the median over rounds of s/step for each side and work/base; then
the loop-lag p99 (steady state) the same way. Results go to ``--out`` (JSON, default
``runs/benchmarks/ab.json``, ignored by git).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _register() -> Any:
    """``benchmarks/gpu/register_plugins.py``'s ``register`` (the same job on the GPU host)."""
    spec = importlib.util.spec_from_file_location(
        "register_plugins", ROOT / "benchmarks" / "gpu" / "register_plugins.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.register


def side_env(tree: Path, metadata: Path) -> dict[str, str]:
    """``PYTHONPATH`` for one side: its dist-infos (written into ``metadata``), then its tree,
    plugins and backends."""
    paths = [str(metadata), *_register()(tree, metadata)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


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


def _revision(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def compare(base: Path, args: argparse.Namespace, extra: list[str], tmp: Path) -> dict[str, Any]:
    """The ABBA rounds: each side's ``modes.py`` results, in the order they ran."""
    trees = {"base": base, "work": ROOT}
    order = (["base", "work", "work", "base"] * args.rounds)[: 2 * args.rounds]
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "work": []}
    for i, side in enumerate(order):
        print(f"round {i + 1}/{len(order)}: {side}", flush=True)
        out = tmp / "out" / f"{i}-{side}.json"
        out.parent.mkdir(exist_ok=True)
        runs[side].append(run_side(trees[side], tmp / f"meta-{side}", args.part, extra, out))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="the revision to compare against (a git worktree of it)")
    which.add_argument("--base-dir", type=Path, help="a checkout to compare against (no git)")
    parser.add_argument("--part", choices=["modes", "lag", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side (ABBA order)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "ab.json")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-") as tmp_name:
        tmp = Path(tmp_name)
        if args.base_dir is not None:
            base_name, work_name = str(args.base_dir), "work tree"
            runs = compare(args.base_dir.resolve(), args, extra, tmp)
        else:
            base_name = _revision("rev-parse", "--short", args.base)
            work_name = _revision("describe", "--always", "--dirty")
            base = tmp / "base"
            _revision("worktree", "add", "--detach", str(base), base_name)
            try:
                runs = compare(base, args, extra, tmp)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(base)], check=False)
    print(f"\nbase {base_name}, work {work_name}, {args.rounds} round(s) a side, ABBA order\n")
    print(report(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"base": base_name, "work": work_name, "extra": extra, "runs": runs}, indent=2)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
