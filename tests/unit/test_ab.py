"""``benchmarks/ab.py``: each side runs its own code (a sibling directory or another tree's
package is refused), the rounds run in ABBA order, and the report's medians and ratios."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def ab() -> Any:
    spec = importlib.util.spec_from_file_location("ab", ROOT / "benchmarks" / "ab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODES_PY = """
import argparse, json
import asyncrl, asyncrl_example_backend
parser = argparse.ArgumentParser()
parser.add_argument("--part")
parser.add_argument("--out")
args = parser.parse_args()
with open(args.out, "w") as f:
    json.dump({"asyncrl": asyncrl.__file__, "backend": asyncrl_example_backend.__file__,
               "part": args.part}, f)
"""


def _project(root: Path, name: str, package: str) -> None:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.0.1"\n')
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")


def _tree(path: Path) -> Path:
    """A checkout in miniature: ``asyncrl``, one plugin, and a ``benchmarks/modes.py`` that
    says where its imports came from."""
    _project(path, "asyncrl", "asyncrl")
    _project(path / "plugins" / "example", "asyncrl-example-backend", "asyncrl_example_backend")
    (path / "benchmarks").mkdir()
    (path / "benchmarks" / "modes.py").write_text(MODES_PY)
    return path


def test_a_side_runs_its_own_code(ab: Any, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    out = tmp_path / "out" / "0-base.json"
    out.parent.mkdir()
    got = ab.run_side(tree, tmp_path / "meta", "modes", [], out)
    assert got == {
        "asyncrl": str(tree / "asyncrl" / "__init__.py"),
        "backend": str(tree / "plugins" / "example" / "asyncrl_example_backend" / "__init__.py"),
        "part": "modes",
    }


def test_a_package_from_a_sibling_directory_is_refused(ab: Any, tmp_path: Path) -> None:
    """``/x/main-old`` starts with ``/x/main`` but is not inside it: a side whose plugin
    package comes from there (put first on ``PYTHONPATH`` here) is stopped before it runs."""
    tree = _tree(tmp_path / "main")
    sibling = tmp_path / "main-old"
    (sibling / "asyncrl_example_backend").mkdir(parents=True)
    (sibling / "asyncrl_example_backend" / "__init__.py").write_text("")
    env, packages = ab.side_env(tree, tmp_path / "meta")
    assert packages == ["asyncrl", "asyncrl_example_backend"]
    env["PYTHONPATH"] = f"{sibling}:{env['PYTHONPATH']}"
    foreign = ab.foreign_imports(tree, tmp_path / "meta", env, packages, tmp_path)
    assert foreign == {
        "asyncrl_example_backend": str(sibling / "asyncrl_example_backend" / "__init__.py")
    }
    assert ab.foreign_imports(tree, tmp_path / "meta", ab.side_env(tree, tmp_path / "meta")[0],
                              packages, tmp_path) == {}  # fmt: skip


def _result(s_per_step: dict[str, float], lag_p99: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": [{"mode": m, "s_per_step": v} for m, v in s_per_step.items()]}
    if lag_p99 is not None:
        keys = ("loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_p99_median_step_ms",
                "samples_per_s")  # fmt: skip
        out["lag"] = {k: lag_p99 for k in keys}
    return out


def test_rounds_run_abba_and_each_round_is_saved(
    ab: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[Path] = []
    results = iter([
        _result({"sync": 1.0}), _result({"sync": 2.0}), _result({"sync": 4.0}),
        _result({"sync": 3.0}), _result({"sync": 5.0}), _result({"sync": 6.0}),
    ])  # fmt: skip

    def run_side(tree: Path, metadata: Path, part: str, extra: list[str], out: Path) -> Any:
        ran.append(tree)
        return next(results)

    monkeypatch.setattr(ab, "run_side", run_side)
    saved: list[list[int]] = []
    trees = {"base": tmp_path / "b", "work": tmp_path / "w"}
    args = argparse.Namespace(rounds=3, part="modes")
    runs = ab.compare(trees, args, [], tmp_path,
                      lambda r: saved.append([len(r["base"]), len(r["work"])]))  # fmt: skip
    b, w = trees["base"], trees["work"]
    assert ran == [b, w, w, b, b, w]
    assert saved == [[1, 0], [1, 1], [1, 2], [2, 2], [3, 2], [3, 3]]
    # base ran 1.0, 3.0, 5.0 (median 3.0); work 2.0, 4.0, 6.0 (median 4.0): 4/3
    assert "| sync | 3.000 | 4.000 | 1.333 |" in ab.report(runs)


def test_a_mode_or_a_figure_one_side_lacks_is_a_dash(ab: Any) -> None:
    runs = {
        "base": [_result({"sync": 2.0, "gated W=1": 1.0}, lag_p99=4.0)],
        "work": [_result({"sync": 1.0, "ready_first W=1": 0.5})],
    }
    table = ab.report(runs)
    assert "| sync | 2.000 | 1.000 | 0.500 |" in table
    assert "| gated W=1 | 1.000 | - | - |" in table
    assert "| ready_first W=1 | - | 0.500 | - |" in table
    assert "| p99 ms | 4.00 | - | - |" in table

