"""The torch trainers (fsdp2, DeepSpeed ZeRO-2/3) never commit non-finite values, under real
``torchrun`` (gloo, CPU): ``_nonfinite_driver.py`` runs the scenario (see its docstring) and
each rank records what it saw; the weights are compared as ``iter_weights`` gathers them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from integration_support import run_torchrun_driver  # noqa: E402

DRIVER = Path(__file__).with_name("_nonfinite_driver.py")
BASE = {"lr": 1e-3, "num_threads": 1}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from asyncrl_arith.model import build_model

    return str(build_model(tmp_path_factory.mktemp("nonfinite") / "model", seed=0))


def _run(backend: str, options: dict, ranks: int, model: str, out: Path) -> list[dict]:
    run_torchrun_driver(DRIVER, [backend, json.dumps(options), model, str(out)], ranks)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize(
    ("backend", "options", "ranks"),
    [
        # measured alone on 2 cores: 14 s, 18 s, 36 s (once DeepSpeed's CPU op is built)
        ("fsdp2", {}, 2),
        ("deepspeed", {"zero_stage": 2}, 1),
        ("deepspeed", {"zero_stage": 3}, 2),
    ],
    ids=["fsdp2-2ranks", "deepspeed-zero2-1rank", "deepspeed-zero3-2ranks"],
)
def test_no_nonfinite_step_save_export_or_load(
    qwen_dir: str, tmp_path: Path, backend: str, options: dict, ranks: int
) -> None:
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    recs = _run(backend, {**BASE, **options}, ranks, qwen_dir, tmp_path)
    for r in recs:
        assert "crash" not in r, r.get("crash")
        # 1: the loss overflowed: dropped before the engine saw it
        assert r["inf_loss"]["loss"] == float("-inf")
        # 2: the loss is finite, the gradient is not: the engine did not apply it
        assert math.isfinite(r["inf_grad"]["loss"])
        assert not math.isfinite(r["inf_grad"]["grad_norm"])
        assert r["ordinary"]["grad_norm"] < 100 and abs(r["ordinary"]["loss"]) < 100
        # 4, 5: every rank refuses to save the poisoned weights (only rank 0's shard holds
        # the NaN), and nothing is left behind
        assert r["save_good"] is None
        assert r["save_poisoned"]["type"] == "NonFiniteError"
        assert f"(1 tensors: {r['poisoned']}), so nothing was written" in (
            r["save_poisoned"]["message"]
        )
        assert r["bad_dir_exists"] is False and r["export_left"] == []
        # 6, 7: the saved state loads back; once corrupted, every rank refuses it
        assert r["load_good"] is None
        assert r["load_corrupted"]["type"] == "NonFiniteError"
        message = r["load_corrupted"]["message"]
        assert message.startswith(f"the weights loaded from {r['load_corrupted_path']} hold NaN")
        assert "model.embed_tokens.weight" in message
        assert message.endswith("Fix: resume from an older checkpoint (--resume "
                                "<checkpoint.dir>/step-N)")  # fmt: skip
        assert r["lockstep_after"] is True
        # 8: a starting model that holds a NaN is refused on every rank
        if backend != "fsdp2":
            continue
        assert r["start_nan_model"]["type"] == "NonFiniteError"
        assert r["start_nan_model"]["message"].startswith(
            f"the weights of the model at {r['nan_model_path']} (model.path) hold NaN or infinite "
            "values (1 tensors: model.norm.weight), so the run does not start"
        )
    r0 = recs[0]
    assert r0["unchanged_after_inf_loss"] is True and r0["unchanged_after_inf_grad"] is True
    assert r0["changed_after_ordinary"] is True and r0["finite_after_ordinary"] is True
    assert r0["export_poisoned"]["type"] == "NonFiniteError"  # the writing rank
    assert f"{r0['poisoned']} holds 1 NaN or infinite values, so nothing was exported" in (
        r0["export_poisoned"]["message"]
    )
    assert r0["loaded_equals_saved"] is True
    assert r0["corrupted_files"]  # the probe's bytes were found in the saved state
