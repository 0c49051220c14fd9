"""scripts/suite_report.py on hand-written JUnit files: stage lines, counts, the slowest tests
across stages, and a stage past its budget named."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _report_module():
    path = ROOT / "scripts" / "suite_report.py"
    spec = importlib.util.spec_from_file_location("suite_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(path: Path, cases: list[tuple[str, str, float, str]]) -> None:
    rows = []
    for classname, name, seconds, outcome in cases:
        inner = "" if outcome == "passed" else f"<{outcome} message='x'/>"
        rows.append(f'<testcase classname="{classname}" name="{name}" time="{seconds}">'
                    f"{inner}</testcase>")
    path.write_text(f"<testsuites><testsuite>{''.join(rows)}</testsuite></testsuites>")


def test_stages_counts_slowest_and_over_budget(tmp_path: Path, capsys) -> None:
    _junit(tmp_path / "unit.xml", [
        ("tests.unit.test_a", "test_one", 1.5, "passed"),
        ("tests.unit.test_a", "test_two", 0.2, "skipped"),
        ("tests.unit.test_b", "test_three", 9.0, "failure"),
    ])  # fmt: skip
    _junit(tmp_path / "e2e.xml", [("tests.e2e.test_c", "test_big[x]", 30.0, "passed")])
    # unit: 130 s against 2 min (over); e2e: 100 s against 3 min
    (tmp_path / "stages.tsv").write_text("unit\t2\t130\t1\ne2e\t3\t100\t0\n")
    assert _report_module().main([str(tmp_path), "--slowest", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    unit = next(line for line in out if line.startswith("unit "))
    assert unit.split()[:6] == ["unit", "130s", "2.0m", "1", "1", "1"], unit
    assert "exit 1" in unit and "over budget" in unit
    e2e = next(line for line in out if line.startswith("e2e "))
    assert "over budget" not in e2e
    assert any(line.startswith("OVER BUDGET: unit took 130 s") for line in out)
    slowest = out[out.index("== the 2 slowest tests") + 1:]
    assert slowest[0].split() == ["30.0s", "tests/e2e/test_c.py::test_big[x]"]
    assert slowest[1].split() == ["9.0s", "tests/unit/test_b.py::test_three", "(failure)"]


def test_suites_summed_and_whole_skipped_modules_named(tmp_path: Path, capsys) -> None:
    """One stage over several suites (the engines stage): each suite's test time is the sum of
    its tests'; a module skipped whole (no class name in the JUnit file) counts in its suite."""
    _junit(tmp_path / "engines.xml", [
        ("tests.e2e.test_c", "test_big[x]", 30.0, "passed"),
        ("tests.e2e.test_c", "test_small", 2.5, "skipped"),
        ("tests.integration.test_d", "test_run[a]", 4.0, "passed"),
        ("", "tests.gpu.test_e", 0.0, "skipped"),
    ])  # fmt: skip
    (tmp_path / "stages.tsv").write_text("engines\t1\t20\t0\n")
    assert _report_module().main([str(tmp_path), "--slowest", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert next(line for line in out if line.startswith("tests/e2e ")).split() == [
        "tests/e2e", "2", "32s"]
    assert next(line for line in out if line.startswith("tests/integration ")).split() == [
        "tests/integration", "1", "4s"]
    assert next(line for line in out if line.startswith("tests/gpu ")).split() == [
        "tests/gpu", "1", "0s"]
    slowest = out[out.index("== the 2 slowest tests") + 1:]
    assert slowest[0].split() == ["30.0s", "tests/e2e/test_c.py::test_big[x]"]
    assert slowest[1].split() == ["4.0s", "tests/integration/test_d.py::test_run[a]"]
