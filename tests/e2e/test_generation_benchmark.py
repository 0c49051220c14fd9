"""``benchmarks/generation.py`` in CI size on the vLLM CPU build, run as users run it: vLLM
alone (on vLLM's scheduler and on asyncrl's) against asyncrl (frozen trainer) with its defaults
at one in-flight level of two steps, and every request-shape row (:data:`ROWS`).

Each engine the benchmark builds costs this test about 14 s on 2 cores (its start and its
stop), so it builds three: the in-flight level of one step (K = all samples) runs the same
code with one step less; a ``--tuned`` column is another asyncrl run with other engine
options; the engine rows differ from the option rows only in the engine arguments they pass,
which the benchmark hands to vLLM as they are (asyncrl's scheduler, the option row left out,
is the side part's second vLLM-alone engine); and ``--share-engines`` runs the option rows and
the vLLM-alone column on vLLM's scheduler on one engine (the same engine arguments).

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
ROWS = "no per-sample seed,no logprobs,n per prompt,DELTA"
"""The request-shape rows."""


def test_generation_benchmark_runs_both_ways_on_the_cpu_build(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from generation import OPTIONS, SHARED, selected

    out = tmp_path / "generation.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--size", "tiny",
         "--prompts", str(PROMPTS), "--samples", str(SAMPLES), "--max-tokens", str(TOKENS),
         "--in-flight", "4", "--options-prompts", "8", "--rows", ROWS, "--share-engines",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| in flight |" in proc.stdout and "| request shape or engine option |" in proc.stdout
    # the vLLM-alone column on vLLM's scheduler ran on the options' engine: three engines built
    assert proc.stdout.count(SHARED) == 1, proc.stdout[-3000:]
    results = json.loads(out.read_text())

    rows = list(selected(ROWS))
    assert [r["option"] for r in results["options"]] == rows
    # every request shape, no engine row
    assert {n for n, c in OPTIONS.items() if "engine" not in c} <= set(rows)
    assert not [n for n in rows if "engine" in OPTIONS[n]]
    for row in results["options"]:
        # a random model rarely samples EOS (token 2 of 512): nearly every sample runs to the end
        assert 0.8 * 8 * SAMPLES * TOKENS <= row["tokens"] <= 8 * SAMPLES * TOKENS, row
        assert row["tok_s"] > 0 and math.isfinite(row["vs_asyncrl_shape"])

    side = {r["in_flight"]: r for r in results["side"]}
    # K = 4: two measured steps of 4 prompts x 4 samples
    assert list(side) == [4] and side[4]["samples"] == 32
    row = side[4]
    # vLLM alone twice: on vLLM's scheduler and on the one asyncrl's backend gives it
    alone, held, through = row["alone"], row["alone_held"], row["asyncrl"]
    for figures in (alone, held, through):
        assert 0.8 * row["samples"] * TOKENS <= figures["tokens"] <= row["samples"] * TOKENS
    assert through["steps"] == 2
    assert through["ratio"] == pytest.approx(through["tok_s"] / alone["tok_s"])
    assert through["ratio_held"] == pytest.approx(through["tok_s"] / held["tok_s"])
    # the worker's engine time lies within the controller's generation spans
    assert 0 < through["engine_s"] <= through["seconds"] * 1.05
    other = max(0.0, through["seconds"] - through["engine_s"])
    assert through["other_s"] == pytest.approx(other)
    assert through["score_s"] > 0
