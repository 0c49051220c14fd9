"""Where a benchmark writes its results (shared by ``episodes.py`` and ``gateway.py``):
``--out`` if given, else ``benchmarks/results/<name>-<machine>.json`` with ``--machine`` (a
figure to keep), else ``runs/benchmarks/<name>.json`` (a look)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def write_results(results: dict[str, Any], name: str, out: Path | None, machine: str) -> Path:
    """Write ``results`` as indented JSON where the module docstring says; the path."""
    if out is None:
        out = (ROOT / "benchmarks" / "results" / f"{name}-{machine}.json" if machine
               else ROOT / "runs" / "benchmarks" / f"{name}.json")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return out
