"""Shipped mode configs (examples/modes/*.toml) run end to end with the real engines (vLLM CPU
build + FSDP2) for a few steps, and their staleness metrics match their mode: the on-policy
one, here with the engine and the trainer taking turns (``cluster.placement = "take_turns"``:
the engine sleeps while the trainer steps, the refit wakes it), and the one that aborts
requests in the engine (over-sampling), here with LoRA and its requests moved to each new
adapter version (the same mode with full weights runs in ``test_modes_benchmark.py``). Every shipped mode config's settings are run on the bigram
engine by ``tests/integration/test_modes.py::test_each_shipped_mode_config_keeps_its_bound``;
the modes between these two differ from them in the controller's scheduling only, which does
not depend on the engine."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from asyncrl import Controller
from asyncrl.config import load_config
from asyncrl.config.modes import describe
from asyncrl.policy import verify

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from integration_support import assert_nothing_left, mark_test_start, read_metrics, worker_pids  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

EXAMPLES = Path(__file__).parents[2] / "examples" / "modes"
# config -> (staleness bound, wastes nothing)
EXPECTED = {
    "sync.toml+turns": (0, True),
    "oversampled.toml+lora": (1, False),
}
TURNS = {"cluster.placement": "take_turns", "cluster.trainer_offload": "always"}
"""The ``+turns`` case: the engine sleeps before each step trains and the refit wakes it; the
trainer's optimizer state is asked to leave the GPU (on the CPU nothing moves)."""
LORA = {"lora.rank": 16, "trainer.options.lr": 1e-3, "run.num_steps": 5,
        "pipeline.sampler.in_flight_at_refit": "reprefill"}  # fmt: skip
"""The ``+lora`` case: adapters, and the requests in flight at each refit move to the new
adapter version (docs/lora.md) while the staleness policy aborts the too stale ones. Five
steps: in three, no request was in flight at a refit (2 cores)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen") / "model", seed=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_example_mode_runs_with_real_engines(
    tmp_path: Path, model_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound, waste_free = EXPECTED[name]
    monkeypatch.setattr(verify, "VERIFY_FIRST_STEPS", 1)  # the first refit's check is enough
    toml, _, variant = name.partition("+")
    config = load_config(
        EXAMPLES / toml,
        {
            "model.path": str(model_dir),
            "run.output_dir": str(tmp_path / "out"),
            "run.num_steps": 3,
            "eval.num_prompts": 0,
            **{"lora": LORA, "turns": TURNS}.get(variant, {}),
        },
    )
    report = describe(config)
    assert f"staleness <= {bound}" in report.mode or (bound == 0 and "on-policy" in report.mode)
    mark_test_start()
    async with Controller(config) as ctl:
        pids = worker_pids(ctl).values()
        summary = await ctl.train()
    assert_nothing_left(ctl, pids)
    steps = [r for r in read_metrics(config) if r["kind"] == "train"]
    assert len(steps) == len(summary.steps) == config.run.num_steps
    P = config.grpo.prompts_per_step
    for r in steps:
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        assert sum(hist.values()) == P and max(hist) <= bound, (name, hist)
        assert math.isfinite(r["grad_norm"])  # a random-init model may earn no reward yet
        if waste_free:
            assert r["wasted_samples"] == 0
    if bound == 0:
        assert all(r["inflight_at_refit"] == 0 for r in steps)  # nothing spans a refit
    if name == "async_in_order.toml":
        assert steps[1]["staleness_max"] == 1  # batch 2 was generated while step 1 trained
    assert steps[0]["refit_verify_mean_abs"] <= steps[0]["refit_verify_bound"]
    if variant == "turns":  # each step: the engine slept, the trainer's state moved, woke
        log = (Path(config.run.output_dir) / "logs" / "rollout-0.log").read_text().splitlines()
        woke = [json.loads(x)["woke"] for x in log if '"weights_loaded"' in x]
        assert sum('"engine_asleep"' in line for line in log) == config.run.num_steps
        assert woke == [True] * config.run.num_steps, woke
        assert all(r["turn_held_requests"] == 0 and "turn_state_to_host_s" in r for r in steps)
    if variant == "lora":  # each refit installed an adapter and moved the requests in flight
        log = (Path(config.run.output_dir) / "logs" / "rollout-0.log").read_text().splitlines()
        assert sum('"adapter_installed"' in line for line in log) == config.run.num_steps
        moved = sum(json.loads(x)["moved"] for x in log if '"requests_moved"' in x)
        inflight = sum(r["inflight_at_refit"] for r in steps)
        print(f"{name}: {inflight} samples in flight at the refits, {moved} moved")
        assert moved <= inflight and (moved > 0 or inflight < 16)  # some end before the move
