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

Before each run, every package of the side's projects (``asyncrl``, ``asyncrl_example_backend``
that ``modes.py`` runs, the other plugins and backends) and the dist-info of ``asyncrl`` must be
found inside that side's tree and metadata folder, or the comparison stops.

The table gives, per mode, the median over rounds of s/step for each side and work/base; then
the loop-lag p99 (steady state) the same way (``-`` where one side has no figure). Results go to
``--out`` (JSON, default ``runs/benchmarks/ab.json``, ignored by git), rewritten after every
round.
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
import tomllib
from collections.abc import Callable
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


def _project_names(tree: Path) -> set[str]:
    """The distributions of ``tree``: its pyproject.toml files' project names."""
    files = [tree / "pyproject.toml", *tree.glob("backends/*/pyproject.toml"),
             *tree.glob("plugins/*/pyproject.toml")]  # fmt: skip
    return {tomllib.loads(f.read_text())["project"]["name"] for f in files}


def side_env(tree: Path, metadata: Path) -> tuple[dict[str, str], list[str]]:
    """``PYTHONPATH`` for one side: its dist-infos (written into ``metadata``), then its tree,
    plugins and backends, then what ``PYTHONPATH`` held already (dependencies unpacked into a
    folder, as on the GPU host); and the packages those project roots hold (``asyncrl``,
    ``asyncrl_example_backend``...), which the side must import from its own tree."""
    roots = _register()(tree, metadata)
    for name in sorted(_project_names(ROOT) - _project_names(tree)):
        # a distribution the side predates (one split off the core since): an empty
        # dist-info first on the path hides the venv's, whose entry points would name the
        # side's own plugins a second time
        info = metadata / f"{name.replace('-', '_')}-0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    packages = [p.name for root in roots for p in sorted(Path(root).iterdir())
                if (p / "__init__.py").is_file()]  # fmt: skip
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(metadata), *roots, *inherited])
    return {**os.environ, "PYTHONPATH": path}, packages


_PROBE = """
import importlib.metadata, importlib.util, json, sys
specs = {name: importlib.util.find_spec(name) for name in sys.argv[1:]}
found = {name: (s and s.origin) or "(not found)" for name, s in specs.items()}
found["dist-info of asyncrl"] = str(importlib.metadata.distribution("asyncrl")._path)
print(json.dumps(found))
"""


def foreign_imports(tree: Path, metadata: Path, env: dict[str, str], packages: list[str],
                    cwd: Path) -> dict[str, str]:
    """What one side would take from outside its own tree (a package) or its own ``metadata``
    (the dist-info of ``asyncrl``, hence every entry point): ``{what: path}``, empty when all
    is its own. Found without importing anything but ``importlib``."""
    found = json.loads(subprocess.run(
        [sys.executable, "-c", _PROBE, *packages], env=env, cwd=cwd, capture_output=True,
        text=True, check=True,
    ).stdout)  # fmt: skip
    owner = {name: tree for name in packages} | {"dist-info of asyncrl": metadata}
    return {
        name: path for name, path in found.items()
        if not (Path(path).is_absolute()  # else "(not found)"
                and Path(path).resolve().is_relative_to(owner[name].resolve()))
    }  # fmt: skip


def run_side(tree: Path, metadata: Path, part: str, extra: list[str], out: Path) -> dict[str, Any]:
    """One run of ``tree``'s ``benchmarks/modes.py`` (from a neutral directory, so the current
    directory on ``sys.path`` cannot pick the other side's package), once every package and
    the entry points are seen to come from the side itself."""
    env, packages = side_env(tree, metadata)
    foreign = foreign_imports(tree, metadata, env, packages, out.parent)
    if foreign:
        raise SystemExit(f"{tree}: this side would import {foreign} (not its own code): stopping")
    cmd = [sys.executable, str(tree / "benchmarks" / "modes.py"), "--part", part, "--out", str(out)]
    subprocess.run(cmd + extra, env=env, cwd=out.parent, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _ratio(work: float | None, base: float | None) -> str:
    return f"{work / base:.3f}" if work is not None and base else "-"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown tables: per mode, each side's median s/step over its rounds and
    work/base; then the loop lag the same way. A mode or a figure one side lacks is ``-``."""
    lines = ["| mode | base s/step | work s/step | work/base |", "| --- | --- | --- | --- |"]
    modes = list(dict.fromkeys(
        r["mode"] for rs in runs.values() for run in rs for r in run.get("modes", [])
    ))  # fmt: skip
    for mode in modes:
        per = {
            side: _median([r["s_per_step"] for run in rs for r in run.get("modes", [])
                           if r["mode"] == mode])  # fmt: skip
            for side, rs in runs.items()
        }
        lines.append(
            f"| {mode} | {_num(per['base'], 3)} | {_num(per['work'], 3)} | "
            f"{_ratio(per['work'], per['base'])} |"
        )
    if any("lag" in run for rs in runs.values() for run in rs):
        lines += ["", "| loop lag (steady state) | base | work | work/base |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for key, label in (
            ("loop_lag_p50_ms", "p50 ms"),
            ("loop_lag_p99_ms", "p99 ms"),
            ("loop_lag_p99_median_step_ms", "per-step p99, median ms"),
            ("samples_per_s", "samples/s"),
        ):
            b, w = (_median([run["lag"][key] for run in runs[side] if "lag" in run])
                    for side in ("base", "work"))  # fmt: skip
            lines.append(f"| {label} | {_num(b, 2)} | {_num(w, 2)} | {_ratio(w, b)} |")
    return "\n".join(lines)


def _revision(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def abba(rounds: int) -> list[str]:
    """The order the sides run in: base, work, work, base, ... (``rounds`` runs a side)."""
    return (["base", "work", "work", "base"] * rounds)[: 2 * rounds]


def compare(
    trees: dict[str, Path], args: argparse.Namespace, extra: list[str], tmp: Path,
    save: Callable[[dict[str, list[dict[str, Any]]]], None],
) -> dict[str, list[dict[str, Any]]]:
    """The ABBA rounds: each side's ``modes.py`` results, in the order they ran; ``save``
    gets them after every round (a run stopped halfway keeps what it measured)."""
    order = abba(args.rounds)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "work": []}
    for i, side in enumerate(order):
        print(f"round {i + 1}/{len(order)}: {side}", flush=True)
        out = tmp / "out" / f"{i}-{side}.json"
        out.parent.mkdir(exist_ok=True)
        runs[side].append(run_side(trees[side], tmp / f"meta-{side}", args.part, extra, out))
        save(runs)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-") as tmp_name:
        tmp = Path(tmp_name)
        if args.base_dir is not None:
            base_name, work_name = str(args.base_dir), "work tree"
            base = args.base_dir.resolve()
        else:
            base_name = _revision("rev-parse", "--short", args.base)
            work_name = _revision("describe", "--always", "--dirty")
            base = tmp / "base"
            _revision("worktree", "add", "--detach", str(base), base_name)

        def save(runs: dict[str, list[dict[str, Any]]]) -> None:
            record = {"base": base_name, "work": work_name, "extra": extra, "runs": runs}
            args.out.write_text(json.dumps(record, indent=2))

        try:
            runs = compare({"base": base, "work": ROOT}, args, extra, tmp, save)
        finally:
            if args.base_dir is None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(base)], check=False)
    print(f"\nbase {base_name}, work {work_name}, {args.rounds} round(s) a side, ABBA order\n")
    print(report(runs))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
