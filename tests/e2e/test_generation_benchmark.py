"""``benchmarks/generation.py`` in CI size on the vLLM CPU build, run as users run it: vLLM
alone (on vLLM's scheduler and on asyncrl's) against asyncrl (frozen trainer) with its defaults
and tuned (``--tuned``: the CPU build's idle spin, docs/backends/vllm.md) at two in-flight
levels, and every request-shape row.

The figures are not checked against a target here (a 2-core CI machine shares its cores
between the engine, the trainer and the controller; the GPU figures are in
docs/backends/vllm.md). What is checked: both sides generated the whole workload, the
through-asyncrl figures add up, and every option row ran.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).parents[2]
PROMPTS, SAMPLES, TOKENS = 16, 4, 16


def test_generation_benchmark_runs_both_ways_on_the_cpu_build(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from generation import OPTIONS

    out = tmp_path / "generation.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--size", "tiny",
         "--prompts", str(PROMPTS), "--samples", str(SAMPLES), "--max-tokens", str(TOKENS),
         "--in-flight", "64,4", "--options-prompts", "8", "--work", str(tmp_path / "work"),
         "--tuned", "cpu_idle_spin_s=0.01", "--out", str(out)],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| in flight |" in proc.stdout and "| request shape or engine option |" in proc.stdout
    results = json.loads(out.read_text())

    assert [r["option"] for r in results["options"]] == list(OPTIONS)
    for row in results["options"]:
        # a random model rarely samples EOS (token 2 of 512): nearly every sample runs to the end
        assert 0.8 * 8 * SAMPLES * TOKENS <= row["tokens"] <= 8 * SAMPLES * TOKENS, row
        assert row["tok_s"] > 0 and math.isfinite(row["vs_asyncrl_shape"])

    side = {r["in_flight"]: r for r in results["side"]}
    # K = 64 = all samples of a step: one measured step; K = 4: two steps of 4 prompts x 4
    assert side[64]["samples"] == 64 and side[4]["samples"] == 32
    for k, row in side.items():
        # vLLM alone twice: on vLLM's scheduler and on the one asyncrl's backend gives it
        alone, held = row["alone"], row["alone_held"]
        for figures in (alone, held, row["asyncrl"], row["tuned"]):
            assert 0.8 * row["samples"] * TOKENS <= figures["tokens"] <= row["samples"] * TOKENS
        for through in (row["asyncrl"], row["tuned"]):  # defaults, then --tuned's options
            assert through["steps"] == (1 if k == 64 else 2)
            assert through["ratio"] == pytest.approx(through["tok_s"] / alone["tok_s"])
            assert through["ratio_held"] == pytest.approx(through["tok_s"] / held["tok_s"])
            # the worker's engine time lies within the controller's generation spans
            assert 0 < through["engine_s"] <= through["seconds"] * 1.05
            other = max(0.0, through["seconds"] - through["engine_s"])
            assert through["other_s"] == pytest.approx(other)
            assert through["score_s"] > 0
    assert "| tuned tok/s (GPU busy) |" in proc.stdout
