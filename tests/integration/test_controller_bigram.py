"""Embedded controller runs end to end with the bigram backends (real processes and sockets).

What each run must show: the requested number of steps (one metrics record each), the hard
staleness bound, evaluations at start and end, generators serving exactly the trainer's
weights after the last refit (and not the initial ones), the trained samples' files
(``run.save_samples``) holding exactly what the trainer got, and nothing left behind.
"""

from __future__ import annotations

import json
import os

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.procs.space import shm_dir  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.obs import sample_export  # noqa: E402
from asyncrl.obs.sample_export import sample_files  # noqa: E402
from asyncrl.policy import verify  # noqa: E402
from asyncrl.config import modes  # noqa: E402
from asyncrl.policy.grpo import pack_tokens  # noqa: E402
from asyncrl_example_backend.model import (  # noqa: E402
    initial_table,
    response_tokens,
    token_logprobs,
)
from integration_support import assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]

# every digit prompt followed by a few completions: covers many rows of the table
PROMPTS = [[1, 4 + d] for d in range(10)]
RESPONSES = [[4 + d, 4 + (d + 3) % 10, 2] for d in range(10)]


def _trained_by_step(record: Path) -> dict[int, list[tuple[Any, ...]]]:
    """What trainer:0 trained (``trainer.options.batch_record_dir``), by step from 1: each
    sequence's (tokens, prompt length, loss mask, behaviour logprobs, advantage)."""
    out: dict[int, list[tuple[Any, ...]]] = {}
    for text in (record / "trainer-0.jsonl").read_text().splitlines():
        b = json.loads(text)
        starts = np.cumsum([0, *b["seq_lens"]]).tolist()
        responses = np.subtract(b["seq_lens"], b["prompt_lens"])
        r_starts = np.cumsum([0, *responses]).tolist()
        for i in range(len(b["seq_lens"])):
            tokens, response = slice(starts[i], starts[i + 1]), slice(r_starts[i], r_starts[i + 1])
            out.setdefault(b["step"] + 1, []).append((
                b["tokens"][tokens], b["prompt_lens"][i], b["loss_mask"][response],
                b["behaviour_logprobs"][response], b["advantages"][i],
            ))  # fmt: skip
    return out


def _exported_by_step(cfg: Config) -> dict[int, list[tuple[Any, ...]]]:
    """The run's samples files (``run.save_samples``), by step, as :func:`_trained_by_step`."""
    out: dict[int, list[tuple[Any, ...]]] = {}
    for path in sample_files(cfg.run.output_dir):
        for text in path.read_text().splitlines():
            x = json.loads(text)
            out.setdefault(x["step"], []).append((
                x["prompt_ids"] + x["token_ids"], len(x["prompt_ids"]), x["loss_mask"],
                x["logprobs"], x["advantage"],
            ))  # fmt: skip
    return out


async def _logprobs_everywhere(ctl: asyncrl.Controller, rollouts: int) -> dict[str, np.ndarray]:
    batch = pack_tokens(PROMPTS, RESPONSES)
    out = {f"rollout:{r}": await ctl.generator_logprobs(batch, rank=r) for r in range(rollouts)}
    out["trainer:0"] = await ctl.trainer_logprobs(batch)
    return out


@pytest.mark.parametrize(
    ("rollout_ranks", "lookahead"),
    # the everyday tier's embedded run: two rollout ranks, lookahead 1
    [(1, 0), (1, 1), (2, 0), pytest.param(2, 1, marks=pytest.mark.fast)],
    ids=lambda v: str(v),
)
async def test_train_completes_and_cleans_up(
    make_config: Callable[..., Config], tmp_path: Path, rollout_ranks: int, lookahead: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    num_steps = 3
    record = tmp_path / "trainer-record"
    monkeypatch.setattr(sample_export, "SAMPLES_FILE_MB", 0.001)  # a file a step
    cfg = make_config(
        run={"num_steps": num_steps, "save_samples": True},
        cluster={"rollout_ranks": rollout_ranks},
        pipeline={"sampler": {"max_lookahead_versions": lookahead}},
        trainer={"options": {"batch_record_dir": str(record)}},
    )
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        assert set(pids) == {"trainer:0", *(f"rollout:{r}" for r in range(rollout_ranks))}
        summary = await ctl.train()
        logprobs = await _logprobs_everywhere(ctl, rollout_ranks)

    # steps and metrics
    assert [s["step"] for s in summary.steps] == list(range(1, num_steps + 1))
    records = read_metrics(cfg)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    for r in train:
        assert 0 <= r["staleness_max"] <= lookahead, r  # the hard bound
        assert r["groups"] == cfg.grpo.prompts_per_step
    assert train[0]["staleness_max"] == 0  # step 1 can only be generated by version 0
    # the run learned something: at least one step had a non-zero gradient
    assert any(r["grad_norm"] > 0 for r in train)

    # the samples files (run.save_samples) hold exactly what the trainer got, step by step,
    # a file a step (each step is over SAMPLES_FILE_MB's 1 KiB)
    trained = _trained_by_step(record)
    assert sorted(trained) == list(range(1, num_steps + 1))
    assert _exported_by_step(cfg) == trained
    assert len(sample_files(cfg.run.output_dir)) == num_steps
    per_step = cfg.grpo.prompts_per_step * cfg.grpo.samples_per_prompt
    assert all(len(v) == per_step for v in trained.values())

    # evaluations at start (version 0) and end (the last version)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(e["label"], e["version"]) for e in evals] == [("start", 0), ("end", num_steps)]
    assert [e["label"] for e in summary.evals] == ["start", "end"]
    assert all(e["num_prompts"] == cfg.eval.num_prompts for e in evals)

    # where the time to step 1 went: one record, after step 1's, every worker in it, phases
    # that follow each other and add up, on the wall clock of the records around it
    kinds = [r["kind"] for r in records]
    assert kinds.count("startup") == 1 and kinds.index("startup") == kinds.index("train") + 1
    (startup,) = [r for r in records if r["kind"] == "startup"]
    assert set(startup["workers"]) == set(pids)
    assert all(v >= 0 for v in startup["phases"].values()), startup
    assert sum(startup["phases"].values()) == pytest.approx(startup["first_step_s"], abs=0.01)
    first_eval = evals[0]["end"] - evals[0]["start"]
    assert startup["phases"]["first_eval"] >= first_eval - 0.01
    launch = startup["controller_s"]  # the run clock's 0, seconds after entering the block
    assert startup["first_step_s"] - launch == pytest.approx(train[0]["time"], abs=0.05)
    for w in startup["workers"].values():
        # each figure is rounded to the millisecond: a sum of two may fall 1 ms short
        assert 0 <= w["process_s"] <= w["ready_s"] <= launch + startup["phases"]["workers"] + 0.002
        assert w["imports"] > 0 and w["backend"] >= 0

    # every generator serves the trainer's weights, which are no longer the initial ones
    prev, tok, _ = response_tokens(pack_tokens(PROMPTS, RESPONSES))
    initial = token_logprobs(initial_table(cfg.model.path, cfg.run.seed), prev, tok, 1.0)
    for name, lp in logprobs.items():
        np.testing.assert_allclose(lp, logprobs["trainer:0"], rtol=0, atol=1e-5, err_msg=name)
    assert np.max(np.abs(logprobs["trainer:0"] - initial)) > 1e-3

    assert_nothing_left(ctl, pids.values())


async def test_lookahead_one_overlaps_generation_with_training(
    make_config: Callable[..., Config],
) -> None:
    """With lookahead 1, the batch of step k+1 is generated while step k trains; with the
    trainer slowed down (step_delay_s) and generation slowed down (token_delay_s) the overlap
    shows in the recorded intervals. The lookahead-0 run of the same setup never overlaps."""
    num_steps = 4
    overlap = {}
    for lookahead in (0, 1):
        cfg = make_config(
            f"la{lookahead}",
            run={"num_steps": num_steps},
            grpo={"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 6},
            pipeline={"sampler": {"name": "in_order", "max_lookahead_versions": lookahead}},
            trainer={"options": {"step_delay_s": 0.3}},
            generator={"options": {"token_delay_s": 0.01}},
            eval={"num_prompts": 0},
        )
        async with asyncrl.Controller(cfg) as ctl:
            pids = worker_pids(ctl)
            await ctl.train()
        assert_nothing_left(ctl, pids.values())
        train = {r["step"]: r for r in read_metrics(cfg) if r["kind"] == "train"}
        assert sorted(train) == list(range(1, num_steps + 1))
        # steps 1 and 2 are both generated at the start (nothing to overlap with yet); from
        # step 2 on, batch k+1 is dispatched when refit k-1 ends, just as step k starts
        overlap[lookahead] = [
            train[k + 1]["gen_start"] < train[k]["train_end"]
            and train[k + 1]["gen_end"] > train[k]["train_start"]
            for k in range(2, num_steps)
        ]
        if lookahead == 0:
            for k in range(1, num_steps):  # synchronous: generate k+1 only after step k
                assert train[k + 1]["gen_start"] >= train[k]["train_end"]
        else:  # every batch after the first was generated by the previous version
            assert [train[k]["staleness_max"] for k in sorted(train)] == [0] + [1] * (num_steps - 1)
    assert overlap[0] == [False] * (num_steps - 2)
    assert overlap[1] == [True] * (num_steps - 2)


async def test_refit_verification_is_logged_on_schedule(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Versions 1-3 (the first refits: ``asyncrl.policy.verify.VERIFY_FIRST_STEPS``) and every
    3rd after are verified; each check is a metrics record per generator, and a right refit
    agrees to float32 rounding. (The trainer keeps the ``asyncrl.transfers.STAGING_BUFFERS``
    shm files, two.)"""
    monkeypatch.setattr(verify, "PROBE_SEQUENCES", 5)
    cfg = make_config(
        run={"num_steps": 7},
        cluster={"rollout_ranks": 2},
        refit={"verify_every_steps": 3},
        eval={"num_prompts": 0},
    )
    async with asyncrl.Controller(cfg) as ctl:
        await ctl.train()
        assert ctl.addresses is not None
        staged = sorted(os.listdir(shm_dir(ctl.addresses.run_id)))
        assert staged == ["w0-0.bin", "w0-1.bin"]
        # torchrun's own directories live in the run's private one (gone with it), not /tmp
        scratch = sorted(os.listdir(ctl.addresses.run_dir))
        assert {"torchelastic-trainer", "torchelastic-rollout"} <= set(scratch), scratch
    baseline = [r for r in read_metrics(cfg) if r["kind"] == "refit_baseline"]
    checks = [r for r in read_metrics(cfg) if r["kind"] == "refit_verify"]
    # the baseline: both generators before the first update (weight version 0)
    assert sorted((r["version"], r["worker"]) for r in baseline) == [
        (0, "rollout:0"), (0, "rollout:1")]
    assert sorted({r["version"] for r in checks}) == [1, 2, 3, 6]
    assert sorted(r["worker"] for r in checks if r["version"] == 6) == ["rollout:0", "rollout:1"]
    for r in checks:
        # numpy float32 on both sides; differences are rounding of the same table
        assert r["mean_abs"] < 1e-6 and r["num_tokens"] > 5, r
        assert r["baseline"] < 1e-6 and r["bound"] == r["baseline"] + 0.001, r
        assert r["previous"] == {1: 0, 2: 1, 3: 2, 6: 3}[r["version"]] and r["moved_abs"] > 0
    train = {r["step"]: r for r in read_metrics(cfg) if r["kind"] == "train"}
    assert "refit_verify_mean_abs" in train[6] and "refit_verify_mean_abs" not in train[5]


async def test_a_generator_that_misses_a_refit_stops_the_run(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout:0 silently keeps its old weights from version 2 on: the verification after
    refit 2 stops the run with a RefitError naming the generator, the version, that it still
    serves version 1's weights, and the fix. The bigram's two sides agree to < 1e-6 before
    any update (the baseline) and one SGD step moves its logprobs by 2e-4 to 8e-4 (measured),
    so the floor above the baseline is 1e-4 here (1e-3 by default: NOISE_FLOOR)."""
    monkeypatch.setattr(verify, "NOISE_FLOOR", 1e-4)
    cfg = make_config(
        run={"num_steps": 50},
        generator={"options": {"stale_from_version": 2}},
        eval={"num_prompts": 0},
    )
    ctl = asyncrl.Controller(cfg)
    with pytest.raises(asyncrl.RefitError) as info:
        async with ctl:
            pids = worker_pids(ctl)
            await ctl.train()
    message = str(info.value)
    assert "weight version 2" in message and "rollout:0" in message
    assert "closer to the trainer's at version 1" in message and "older weights" in message
    assert "NOISE_FLOOR" in message
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]  # stopped right at the first bad refit
    assert train[1]["refit_verify_mean_abs"] > train[1]["refit_verify_bound"]
    assert_nothing_left(ctl, pids.values())


async def test_two_trainer_ranks_match_one(make_config: Callable[..., Config]) -> None:
    """Data-parallel over two trainer ranks (each gets its share of every chunk, gradients are
    summed over gloo, normalized by the step's global token count) ends with the same weights
    as one rank: synchronous mode, same seeds, so both runs see the same samples. Chunks of
    at least 2 groups (how many depends on arrival timing, which the result must not)."""
    final = {}
    for ranks in (1, 2):
        cfg = make_config(
            f"ranks{ranks}",
            run={"num_steps": 3},
            cluster={"trainer_ranks": ranks},
            grpo={"prompts_per_step": 6},
            pipeline={
                "sampler": {"name": "in_order", "max_lookahead_versions": 0},
                "min_groups_for_streaming_train": 2,
            },
            eval={"num_prompts": 0},
        )
        async with asyncrl.Controller(cfg) as ctl:
            pids = worker_pids(ctl)
            assert len([p for p in pids if p.startswith("trainer:")]) == ranks
            summary = await ctl.train()
            final[ranks] = await _logprobs_everywhere(ctl, 1)
        assert_nothing_left(ctl, pids.values())
        assert all(1 <= s["chunks"] <= 3 for s in summary.steps)
        assert all(s["grad_norm"] > 0 for s in summary.steps)
    # float64 sums in a different order: equal to rounding
    np.testing.assert_allclose(final[2]["trainer:0"], final[1]["trainer:0"], rtol=0, atol=1e-6)
    prev, tok, _ = response_tokens(pack_tokens(PROMPTS, RESPONSES))
    initial = token_logprobs(initial_table(cfg.model.path, cfg.run.seed), prev, tok, 1.0)
    assert np.abs(final[2]["trainer:0"] - initial).max() > 1e-3  # it trained


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
async def test_each_advantage_estimator_trains(
    make_config: Callable[..., Config], estimator: str
) -> None:
    """The estimator reaches the train pump's packing (its math: tests/unit/test_advantages.py)."""
    cfg = make_config(run={"num_steps": 2}, grpo={"advantage_estimator": estimator})
    async with asyncrl.Controller(cfg) as ctl:
        summary = await ctl.train()
    assert len(summary.steps) == 2
    for r in summary.steps:
        assert np.isfinite(r["loss"]) and r["advantage_min"] <= r["advantage_max"], r
        if estimator == "reinforce_pp" and r["advantage_max"] > r["advantage_min"]:
            # one chunk a step (no streaming): normalized over the step's sequences. Measured:
            # mean 3.7e-9 (float32 on the wire), std 1 - 3.0e-6 (eps 1e-6 in the divisor)
            assert abs(r["advantage_mean"]) < 1e-8 and abs(r["advantage_std"] - 1) < 9e-6, r


async def test_mini_steps_and_epochs_take_several_optimizer_steps_per_rl_step(
    make_config: Callable[..., Config],
) -> None:
    """2 passes x 2 mini-batches: four optimizer steps per RL step, in order, each over half
    the step's sequences; one refit per RL step (the weight version counts RL steps)."""
    cfg = make_config(run={"num_steps": 2}, grpo={"mini_steps": 2, "update_epochs": 2},
                      pipeline={"min_groups_for_streaming_train": 2})  # fmt: skip
    async with asyncrl.Controller(cfg) as ctl:
        summary = await ctl.train()
    assert len(summary.steps) == 2
    # one refit per RL step: the end evaluation ran on weight version 2
    assert [e["version"] for e in summary.evals] == [0, 2]
    for r in summary.steps:
        minis = r["mini_steps"]
        assert [(m["epoch"], m["mini_batch"]) for m in minis] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [m["tokens"] for m in minis[:2]] == [m["tokens"] for m in minis[2:]]
        assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in minis)
        assert r["loss"] == pytest.approx(np.mean([m["loss"] for m in minis]))
        assert "refresh_proximal_s" not in r  # behaviour as proximal: nothing to refresh
        assert "refresh_reference_s" not in r and "kl_ref" not in r  # no KL: no reference


async def test_a_loss_input_the_backend_cannot_read_is_refused_before_it_starts(
    make_config: Callable[..., Config],
) -> None:
    cfg = make_config(run={"num_steps": 1}, loss={"kl_coef": 0.1})
    with pytest.raises(Exception, match="does not read reference_logprobs.*loss.kl_coef = 0.1"):
        async with asyncrl.Controller(cfg) as ctl:
            await ctl.train()


async def test_dynamic_sampling_drops_groups_up_to_its_cap_and_the_run_goes_on(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spread threshold no group passes: each step drops exactly its cap of 2 groups (one
    per prompt of the step; fresh prompts refill it), then trains the rest as they are, and
    says so."""
    monkeypatch.setattr(modes, "DYNAMIC_SAMPLING_MIN_STD", 10.0)
    monkeypatch.setattr(modes, "DYNAMIC_SAMPLING_DROPS_PER_PROMPT", 1)
    cfg = make_config(run={"num_steps": 2}, eval={"num_prompts": 0},
                      grpo={"prompts_per_step": 2, "dynamic_sampling": True})  # fmt: skip
    async with asyncrl.Controller(cfg) as ctl:
        summary = await ctl.train()
    assert [(r["filtered_groups"], r["filter_cap_reached"]) for r in summary.steps] == [
        (2, True), (2, True)]
    assert all(r["groups"] == 2 for r in summary.steps)
    dropped = {e["epoch"]: e["dropped"] for e in summary.ledger}
    assert sum(d.get("zero_variance", 0) for d in dropped.values()) == 4


async def test_a_mini_step_failing_before_any_update_gives_the_step_back(
    make_config: Callable[..., Config],
) -> None:
    """The first mini-step's TrainChunk fails once: nothing was applied, so the step is
    assembled again and trained whole (two mini-steps recorded, not three)."""
    cfg = make_config(run={"num_steps": 2}, eval={"num_prompts": 0}, grpo={"mini_steps": 2},
                      trainer={"options": {"lr": 0.5, "fail_chunk_at_step": 1,
                                           "fail_chunk_times": 1}})  # fmt: skip
    async with asyncrl.Controller(cfg) as ctl:
        summary = await ctl.train()
    assert [r["step_retries"] for r in summary.steps] == [0, 1]
    assert [len(r["mini_steps"]) for r in summary.steps] == [2, 2]


async def test_a_launchers_pid_in_the_environment_does_not_reach_spawned_workers(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ASYNCRL_PARENT_PID`` names the launcher of *this* process's ranks (``asyncrl run``
    sets it); a worker the embedded controller spawns that inherited it took the launcher
    for gone (its parent is torchrun) and stopped at once."""
    from asyncrl.procs.process import PARENT_ENV

    monkeypatch.setenv(PARENT_ENV, "1")
    cfg = make_config(run={"num_steps": 1})
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        await ctl.train()
    assert_nothing_left(ctl, pids.values())
    assert [r["step"] for r in read_metrics(cfg) if r["kind"] == "train"] == [1]
