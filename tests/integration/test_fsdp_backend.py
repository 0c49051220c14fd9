"""The fsdp2 training backend under real ``torchrun --nproc-per-node 2`` (gloo, CPU).

``_fsdp_driver.py`` runs the backend on a tiny random Qwen2 and, on rank 0, an independent
single-process float64 reference (plain transformers, one sequence per forward, one big
batch). Each rank writes its observations as JSON; the tests below assert on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncrl.backend import WorkerContext  # noqa: E402
from asyncrl.config import from_dict  # noqa: E402
from asyncrl.errors import ConfigError  # noqa: E402
from asyncrl.procs.spawn import torchrun_log_args  # noqa: E402
from integration_support import run_torchrun_driver  # noqa: E402

DRIVER = Path(__file__).with_name("_fsdp_driver.py")
NUM_RANKS = 2


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from asyncrl_arith.model import build_model

    return str(build_model(tmp_path_factory.mktemp("fsdp") / "model", seed=0))


@pytest.fixture(scope="module")
def ranks(qwen_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_out")
    run_torchrun_driver(DRIVER, [qwen_dir, str(out)], NUM_RANKS)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(NUM_RANKS)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# --------------------------------------------------------------------------- (a) exactness
def test_streamed_step_equals_one_big_batch_adamw(ranks):
    r0 = ranks[0]
    for step in ("step0", "step1"):
        got, ref = r0[f"A_{step}"], r0[f"A_ref_{step}"]
        assert got["num_loss_tokens"] == ref["num_tokens"]
        assert _rel(got["grad_norm"], ref["grad_norm"]) < 1e-6, (got, ref)
        assert _rel(got["loss"], ref["loss"]) < 1e-6, (got, ref)
        # the clip was active (grad norm above max_grad_norm = 0.5), and so was the PPO clip
        assert ref["grad_norm"] > 0.5 and ref["clipped"] > 0
        # per-chunk sums of all ranks add up to the big batch's
        chunks = [c for r in ranks for c in r[f"A_{step}"]["chunks"]]
        assert sum(c["clipped_tokens"] for c in chunks) == ref["clipped"]
        assert sum(c["num_loss_tokens"] for c in chunks) == ref["num_tokens"]
        assert _rel(sum(c["loss_sum"] for c in chunks) / ref["num_tokens"], ref["loss"]) < 1e-6
    # every rank reports the same step result
    for key in ("loss", "grad_norm", "num_loss_tokens"):
        assert ranks[0]["A_step0"][key] == ranks[1]["A_step0"][key]
    # weights after one and two AdamW steps (updates of ~2e-3 per step)
    assert r0["A_update1_max_abs"] > 1e-3
    assert r0["A_w1_vs_ref_max_abs"] < 1e-5
    assert r0["A_w2_vs_ref_max_abs"] < 1e-5


def test_streamed_step_gradient_is_exact_elementwise_sgd(ranks):
    """SGD without clipping: the weight delta is -lr * gradient, element by element."""
    r0 = ranks[0]
    got, ref = r0["B_step0"], r0["B_ref_step0"]
    assert _rel(got["grad_norm"], ref["grad_norm"]) < 1e-6
    assert _rel(got["loss"], ref["loss"]) < 1e-6
    assert r0["B_ref_delta_max_abs"] > 0.1
    assert r0["B_delta_vs_ref_max_abs"] < 1e-6
    # proximal = current: the truncated IS weights were active and match the reference
    assert ref["capped"] > 0
    chunks = [c for r in ranks for c in r["B_step0"]["chunks"]]
    assert _rel(sum(c["is_weight_sum"] for c in chunks), ref["is_weight_sum"]) < 1e-6


def test_uneven_chunks_reached_every_rank(ranks):
    """The layout that forces padding passes: a rank with no sequences in a chunk."""
    counts = [[c["num_sequences"] for c in r["A_step0"]["chunks"]] for r in ranks]
    assert counts == [[3, 0, 2], [1, 5, 1]]


def test_bf16_mixed_precision_is_close(ranks):
    for r in ranks:
        assert r["C_logprobs_max_abs"] < 0.05
    got, ref = ranks[0]["C_step0"], ranks[0]["A_ref_step0"]
    assert _rel(got["grad_norm"], ref["grad_norm"]) < 0.02
    assert _rel(got["loss"], ref["loss"]) < 0.02


# --------------------------------------------------------------------------- (b) logprobs
def test_compute_logprobs_matches_plain_hf_forward(ranks):
    for r in ranks:
        assert r["A_logprobs_max_abs"] < 2e-5


# --------------------------------------------------------------------------- (c) weights
def test_iter_weights_full_tensors_in_hf_naming(ranks):
    r0, r1 = ranks
    assert r0["A_w0_names_equal_checkpoint"] is True
    assert r0["A_w0_vs_checkpoint_max_abs"] == 0.0
    assert "lm_head.weight" not in r0["A_weights_info"]["names"]
    assert r0["A_weights_info"]["names"] == r1["A_weights_info"]["names"]
    assert r0["A_weights_info"]["dtypes"] == ["float32"]
    assert r0["A_weights_info"]["contiguous"] is True
    assert r0["A_weights_info"]["specs_match"] is True and r1["A_weights_info"]["specs_match"]
    assert not any(r0["A_weights_info"]["data_is_none"])
    assert all(r1["A_weights_info"]["data_is_none"])
    # after two steps: equal to the live (gathered) parameters, bit for bit
    assert r0["A_w2_vs_own_params_max_abs"] == 0.0
    # bfloat16 export: the float32 checkpoint rounded to bf16, bit for bit
    assert r0["C_weights_info"]["dtypes"] == ["bfloat16"]
    assert r0["C_w0_equals_checkpoint_bf16"] is True


def test_one_rank_exports_its_local_shards_bit_for_bit(qwen_dir, tmp_path):
    """With one rank every shard is the whole tensor: iter_weights yields it without gathering
    FSDP units, and the result is the same."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", *torchrun_log_args(str(tmp_path / "torchrun")), str(DRIVER), qwen_dir,
           str(tmp_path), "solo"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rec = json.loads((tmp_path / "solo.json").read_text())
    assert rec["weights_info"]["specs_match"] is True
    assert rec["weights_info"]["contiguous"] is True
    assert "lm_head.weight" not in rec["weights_info"]["names"]
    assert rec["w0_vs_checkpoint_max_abs"] == 0.0
    assert rec["w1_moved"] is True and rec["w1_vs_live_max_abs"] == 0.0
    assert rec["bf16_dtypes"] == ["bfloat16"] and rec["bf16_equals_checkpoint"] is True


# --------------------------------------------------------------------------- (d) errors
def test_out_of_order_calls_are_refused_on_every_rank(ranks):
    for r in ranks:
        errs = r["A_errors"]
        for key in ("chunk_without_step", "finish_without_step"):
            assert errs[key]["type"] == "StepStateError"
            assert "no optimizer step is open" in errs[key]["message"]
        assert errs["second_begin"]["type"] == "StepStateError"
        assert "step 0 is still open" in errs["second_begin"]["message"]
        assert errs["wrong_step_id"]["type"] == "StepStateError"
        assert errs["zero_temperature"]["type"] == "ValueError"
        assert errs["after_close"]["type"] == "RuntimeError"
        assert r["A_pg_destroyed"] is True


def test_malformed_batch_on_one_rank_fails_all_ranks_without_hanging(ranks):
    msg0 = ranks[0]["A_errors"]["malformed_on_rank1"]["message"]
    msg1 = ranks[1]["A_errors"]["malformed_on_rank1"]["message"]
    assert "rank 1 got a malformed batch" in msg0
    assert "behaviour_logprobs has shape (8,)" in msg1


def test_wrong_num_loss_tokens_discards_the_step(ranks):
    for r in ranks:
        err = r["A_errors"]["wrong_num_loss_tokens"]
        assert err["type"] == "ValueError"
        assert "step has 20 loss tokens but the trainer ranks received 19" in err["message"]
    assert ranks[0]["A_discarded_step_changed_weights"] == 0.0


def _ctx(qwen_dir: str, options: dict) -> WorkerContext:
    config = from_dict(
        {"model": {"path": qwen_dir}, "environment": {"name": "arithmetic"},
         "trainer": {"options": options}}
    )  # fmt: skip
    return WorkerContext("trainer", 0, 1, 0, config, run_dir=".")


@pytest.mark.parametrize(
    "options, field",
    [
        ({"lrr": 1e-3}, "lrr"),
        ({"lr": "fast"}, "lr"),
        ({"lr": 0.0}, "trainer.options.lr"),
        ({"betas": [0.9, 1.5]}, "trainer.options.betas"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        ({"max_grad_norm": -1.0}, "trainer.options.max_grad_norm"),
    ],
)
def test_bad_options_raise_config_error_naming_the_field(qwen_dir, options, field):
    from asyncrl.registry import load

    factory = load("asyncrl.training_backends", "fsdp2")
    with pytest.raises(ConfigError, match=field):
        factory(_ctx(qwen_dir, options))
    assert factory(_ctx(qwen_dir, {"lr": 3e-4, "optimizer": "sgd"})) is not None
