"""Where a test run's time went, from the JUnit XML files pytest wrote (``--junitxml``): each
stage's wall time against its budget and its test counts, each suite's (``tests/<suite>``; a
distribution's own tests as ``backends/<name>`` or ``plugins/<name>``) test time summed over
its tests, and the slowest tests of the whole run (setup, call and teardown together), so
that a change that slows the suite is seen in the log of the run it slowed. A stage on two
workers shows about twice its wall time in test time.

    python scripts/suite_report.py DIR [--slowest 10]

``DIR`` holds ``<stage>.xml`` files and a ``stages.tsv`` (name, budget in minutes, wall
seconds, exit code; one line per stage run, in order), as ``scripts/test.sh`` writes them.
Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def testcases(path: Path) -> list[tuple[str, float, str]]:
    """``(test id, seconds, outcome)`` of every test case in a JUnit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, test = case.get("classname", ""), case.get("name", "")
        if classname:
            name = f"{classname.replace('.', '/')}.py::{test}"
        else:  # a module skipped whole (pytest.importorskip at its top)
            name = f"{test.replace('.', '/')}.py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        out.append((name, float(case.get("time") or 0.0), outcome))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args(argv)
    stages = [line.split("\t") for line in (args.dir / "stages.tsv").read_text().splitlines()]
    every: list[tuple[str, float, str]] = []
    print("\n== the suite's time")
    print(f"{'stage':<14} {'wall':>8} {'budget':>8}  {'passed':>6} {'skipped':>7} {'failed':>6}")
    total = 0.0
    over: list[str] = []
    for name, budget, wall, code in stages:
        xml = args.dir / f"{name}.xml"
        cases = testcases(xml) if xml.exists() else []
        every += cases
        count = {k: sum(1 for c in cases if c[2] == k) for k in ("passed", "skipped")}
        failed = sum(1 for c in cases if c[2] in ("failure", "error"))
        total += float(wall)
        mark = "" if code == "0" else f"  exit {code}"
        if float(wall) > 60 * float(budget):
            mark += "  over budget"
            over.append(f"{name} took {float(wall):.0f} s, past its budget of {budget} min")
        print(f"{name:<14} {float(wall):>7.0f}s {float(budget):>6.1f}m  {count['passed']:>6} "
              f"{count['skipped']:>7} {failed:>6}{mark}")
    print(f"{'all stages':<14} {total:>7.0f}s")
    suites: dict[str, list[tuple[str, float, str]]] = {}
    for case in every:
        suites.setdefault("/".join(case[0].split("/")[:2]), []).append(case)
    print(f"\n{'suite':<26} {'tests':>6} {'test time':>10}")
    for suite, cases in sorted(suites.items()):
        print(f"{suite:<26} {len(cases):>6} {sum(c[1] for c in cases):>9.0f}s")
    for line in over:
        print(f"OVER BUDGET: {line}. Find what slowed it (the slowest tests below, the stage's "
              "--durations) or, if it had to grow, raise its budget in scripts/test.sh with "
              "the measured figure in docs/testing.md")
    print(f"\n== the {args.slowest} slowest tests")
    for name, seconds, outcome in sorted(every, key=lambda c: -c[1])[: args.slowest]:
        print(f"{seconds:8.1f}s  {name}{'' if outcome == 'passed' else f'  ({outcome})'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
