"""The whole system with real engines: vLLM CPU build + FSDP2 or DeepSpeed, spawned as torchrun
groups.

For lookahead 0 (sync) and 1 (async): before training, vLLM's and the trainer's logprobs of
fixed token sequences agree within bf16 noise; after two steps (two refits) they agree again
and differ from before (the generator really serves the new weights); every trained group
respects the staleness bound; with lookahead 1 the generation of step k+1 overlaps training of
step k; nothing is left behind.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl import Controller
from asyncrl.config import Config, from_dict, to_dict
from asyncrl.procs.spawn import torchrun_log_args
from asyncrl.policy.grpo import pack_tokens
from asyncrl.run import refit as refit_module

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from integration_support import (  # noqa: E402
    assert_nothing_left,
    mark_test_start,
    read_metrics,
    worker_pids,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    # vLLM's front end leaves a pyzmq context to the garbage collector
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

BF16_TOL = 0.05  # measured worst case 0.011 after a refit (docs/backends/vllm.md)
FP8_TOL = 0.15  # measured 0.046 after two refits with an FP8 KV cache (2-core AVX-512 host)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncrl_arith.model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen") / "model", seed=0)


def fixed_sequences(rng: np.random.Generator, vocab: int = 40) -> object:
    prompts = [[1, *rng.integers(4, vocab, size=int(n)).tolist()] for n in (3, 5, 7, 4)]
    responses = [rng.integers(4, vocab, size=int(n)).tolist() for n in (6, 3, 5, 8)]
    return pack_tokens(prompts, responses)


def two_steps(
    tmp_path: Path, qwen_dir: Path, *, lookahead: int, ranks: int, trainer: dict
) -> Config:
    """Two steps of 8 prompts x 4 samples on the tiny model, vLLM CPU build."""
    return from_dict(
        {
            "run": {"output_dir": str(tmp_path / "out"), "seed": 3, "num_steps": 2},
            "model": {"path": str(qwen_dir)},
            "environment": {"name": "repeat-digit"},
            "cluster": {"trainer_ranks": ranks, "rollout_ranks": 1, "startup_timeout_s": 400},
            "grpo": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 6},
            "pipeline": {
                "sampler": {"name": "in_order", "max_lookahead_versions": lookahead},
                "min_groups_for_streaming_train": 4,
            },
            "trainer": trainer,
            "generator": {
                "backend": "vllm",
                "options": {"cpu_kvcache_space_gib": 1, "enforce_eager": True},
            },
        }
    )


async def logprobs_around_training(config: Config) -> tuple:
    """Run ``config``: the fixed sequences' logprobs (generator, trainer) before and after
    training, and the run's summary; nothing is left behind."""
    batch = fixed_sequences(np.random.default_rng(0))
    mark_test_start()
    async with Controller(config) as ctl:
        pids = worker_pids(ctl).values()
        before = (await ctl.generator_logprobs(batch), await ctl.trainer_logprobs(batch))
        summary = await ctl.train()
        after = (await ctl.generator_logprobs(batch), await ctl.trainer_logprobs(batch))
    assert_nothing_left(ctl, pids)
    return batch, before, summary, after


TRAINERS = {
    "fsdp2": ("fsdp2", 1, {}),
    # two ZeRO-3 ranks: every forward and every refit export gathers the partitions
    "deepspeed-zero3-2ranks": ("deepspeed", 2, {"zero_stage": 3, "export_bucket_mb": 1}),
    "deepspeed-zero2-2ranks": ("deepspeed", 2, {"zero_stage": 2}),
}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("lookahead", "trainer"),
    [(1, "fsdp2"), (1, "deepspeed-zero3-2ranks")],
)  # lookahead 0 schedules no differently at a refit: tests/integration/test_modes.py
async def test_refit_keeps_generator_and_trainer_in_sync(
    tmp_path: Path, qwen_dir: Path, lookahead: int, trainer: str
) -> None:
    backend, ranks, options = TRAINERS[trainer]
    config = two_steps(
        tmp_path, qwen_dir, lookahead=lookahead, ranks=ranks,
        trainer={"backend": backend, "options": {"lr": 0.02, **options}},
    )  # fmt: skip
    batch, (gen0, trn0), summary, (gen1, trn1) = await logprobs_around_training(config)
    assert gen0.shape == trn0.shape == (int((batch.seq_lens - batch.prompt_lens).sum()),)
    assert np.abs(gen0 - trn0).max() < BF16_TOL
    assert np.abs(gen1 - trn1).max() < BF16_TOL
    assert np.abs(trn1 - trn0).max() > 4 * BF16_TOL, "the trainer did not move"
    assert np.abs(gen1 - gen0).max() > 4 * BF16_TOL, "the generator still serves old weights"

    steps = [r for r in read_metrics(config) if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2] == [s["step"] for s in summary.steps]
    assert all(r["staleness_max"] <= lookahead for r in steps)
    assert all(r["grad_norm"] > 0 for r in steps)
    if lookahead == 1:
        # batch 2 was generated while step 1 trained: its generation started before step 1's
        # training ended
        assert steps[1]["gen_start"] < steps[0]["train_end"]
        assert steps[1]["staleness_max"] == 1
    else:
        assert steps[1]["gen_start"] >= steps[0]["train_end"]
        assert all(r["staleness_max"] == 0 for r in steps)


@pytest.mark.asyncio
async def test_a_lora_run_keeps_generator_and_trainer_in_sync(tmp_path: Path, qwen_dir: Path) -> None:
    """``[lora]`` through the whole system: the trainer trains an adapter on the frozen base
    (with a KL to the base, the adapter disabled), each refit moves the adapter alone and the
    engine serves it as a new version; before and after training the two sides agree, the
    engine really serves the trained adapter, and the checkpoint and the export are the
    adapter's (a PEFT directory)."""
    config = two_steps(
        tmp_path, qwen_dir, lookahead=1, ranks=1,
        trainer={"backend": "fsdp2", "options": {"lr": 0.05}},
    )  # fmt: skip
    config = from_dict({**to_dict(config), "lora": {"rank": 8}, "loss": {"kl_coef": 0.01}})
    batch, (gen0, trn0), summary, (gen1, trn1) = await logprobs_around_training(config)
    assert np.abs(gen0 - trn0).max() < BF16_TOL
    assert np.abs(gen1 - trn1).max() < BF16_TOL
    assert np.abs(trn1 - trn0).max() > 4 * BF16_TOL, "the adapter did not move the trainer"
    assert np.abs(gen1 - gen0).max() > 4 * BF16_TOL, "the generator still serves the old adapter"
    steps = [r for r in read_metrics(config) if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2] and all(r["grad_norm"] > 0 for r in steps)
    assert steps[1]["kl_ref"] > 0  # the base (the adapter disabled) is the reference
    export = Path(config.export.dir) / "final"
    assert sorted(p.name for p in export.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]


def reference_logprobs(model_dir: Path, batch: object) -> np.ndarray:
    """The response tokens' logprobs under ``model_dir``'s weights: plain transformers in
    float64, one sequence per forward (independent of every backend)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out, start = [], 0
    for n, p in zip(batch.seq_lens.tolist(), batch.prompt_lens.tolist()):
        ids = torch.as_tensor(batch.tokens[start : start + n], dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
        out.append(logp[p - 1 : n - 1].gather(1, ids[0, p:, None])[:, 0].numpy())
        start += n
    return np.concatenate(out)


@pytest.mark.asyncio
async def test_a_frozen_trainer_serves_the_checkpoint_unchanged(
    tmp_path: Path, qwen_dir: Path
) -> None:
    """``trainer.backend = "frozen"``: a generation-only run through the whole pipeline. Every
    step is generated, scored, taken by the trainer and refitted, and nothing moves."""
    config = two_steps(tmp_path, qwen_dir, lookahead=1, ranks=1, trainer={"backend": "frozen"})
    batch, (gen0, trn0), summary, (gen1, trn1) = await logprobs_around_training(config)

    # the trainer's forward is the checkpoint's (float32 against float64: measured 2.8e-7)
    assert np.abs(trn0 - reference_logprobs(qwen_dir, batch)).max() < 1e-6
    assert np.array_equal(trn1, trn0), "a frozen trainer changed its weights"
    # two refits of the same weights later, the engine still serves them (measured: gen1 ==
    # gen0 exactly, 0.0029 from the trainer's float32)
    assert np.abs(gen1 - gen0).max() < 1e-6 and np.abs(gen1 - trn1).max() < BF16_TOL
    steps = [r for r in read_metrics(config) if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2] == [s["step"] for s in summary.steps]
    assert all(r["loss"] == 0 and r["grad_norm"] == 0 for r in steps)
    assert all(r["groups"] == 8 and 8 * 4 <= r["response_tokens"] <= 8 * 4 * 6 for r in steps)


@pytest.mark.skipif(
    not __import__("torch").cpu._is_avx512_supported(),
    reason="vLLM's CPU FP8 KV cache needs AVX-512 (the GPU run covers FP8 elsewhere)",
)
@pytest.mark.asyncio
@pytest.mark.parametrize("trainer", ["fsdp2"])  # the calibration is asyncrl_torch's, shared
async def test_fp8_kv_cache_scales_are_calibrated_and_forwarded(
    tmp_path: Path, qwen_dir: Path, trainer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FP8 KV-cache engine with two trainer ranks: the trainers calibrate scales before the
    first dispatch (v0) and after every step, every refit carries them, they change as the
    weights do, and the generator still agrees with the trainer."""
    backend, _, options = TRAINERS[trainer]
    config = from_dict(
        {
            "run": {"output_dir": str(tmp_path / "out"), "seed": 3, "num_steps": 2},
            "model": {"path": str(qwen_dir)},
            "environment": {"name": "repeat-digit"},
            "cluster": {"trainer_ranks": 2, "rollout_ranks": 1, "startup_timeout_s": 400},
            "grpo": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 6},
            "pipeline": {"sampler": {"name": "in_order", "max_lookahead_versions": 0}},
            "trainer": {"backend": backend, "options": {"lr": 0.02, **options}},
            "generator": {
                "backend": "vllm",
                "options": {
                    "cpu_kvcache_space_gib": 1, "enforce_eager": True, "kv_cache_dtype": "fp8"
                },
            },
        }
    )
    monkeypatch.setattr(refit_module, "KV_CALIBRATION_SEQUENCES", 16)  # the CPU engine's time
    batch = fixed_sequences(np.random.default_rng(0))
    mark_test_start()
    async with Controller(config) as ctl:
        pids = worker_pids(ctl).values()
        summary = await ctl.train()
        gen = await ctl.generator_logprobs(batch)
        trn = await ctl.trainer_logprobs(batch)
    assert_nothing_left(ctl, pids)
    records = read_metrics(config)
    kinds = [r.get("kind") for r in records]
    scales = [r for r in records if r.get("kind") == "kv_scales"]
    assert [r["version"] for r in scales] == [0, 1, 2]
    assert kinds.index("kv_scales") < kinds.index("train")  # before the first step
    k_means = [r["k"]["mean"] for r in scales]
    print(f"fp8 kv: k-scale means {k_means}, max |gen - trainer| {np.abs(gen - trn).max():.4f}")
    assert all(r["k"]["min"] > 0 and r["v"]["min"] > 0 for r in scales)
    assert len(set(k_means)) == 3, "scales did not follow the weights"
    assert len(summary.steps) == 2
    assert np.abs(gen - trn).max() < FP8_TOL


def _launch_config(tmp_path: Path, qwen_dir: Path, num_steps: int, **more: dict) -> dict:
    """FSDP2 + vLLM (CPU), one rank each, for the launch's fault tests."""
    return {
        "run": {"output_dir": str(tmp_path / "out"), "seed": 1, "num_steps": num_steps},
        "model": {"path": str(qwen_dir)},
        "environment": {"name": "repeat-digit"},
        "cluster": {"trainer_ranks": 1, "rollout_ranks": 1, "startup_timeout_s": 400},
        "grpo": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 6},
        "trainer": {"backend": "fsdp2", "options": {"lr": 1e-3}},
        "generator": {"backend": "vllm",
                      "options": {"cpu_kvcache_space_gib": 1, "enforce_eager": True}},
        **more,
    }


def test_launch_vllm_engine_death_is_outlived(tmp_path: Path, qwen_dir: Path) -> None:
    """``torchrun -m asyncrl.launch`` with vLLM + FSDP2 and ``failures.rollout_restarts`` (the
    default), and two faults of the engine in one run: vLLM's EngineCore is SIGKILLed after
    the first step (the worker sees it at once, its engine watch, and names the engine
    process and its exit code); once its worker is
    back, the new EngineCore is SIGSTOPped (a hung engine behind a rollout worker whose own
    loop still answers the heartbeat: the engine watch's liveness probe names it after
    ``failures.heartbeat_timeout_s``). Each time the worker says why and exits, its rank (the
    supervisor) kills what the engine left and starts a new worker, which is refitted to the
    trainer's weights; the run trains every step and exits 0, leaving no process of any
    session."""
    import glob
    import json
    import signal
    import subprocess
    import time

    import psutil
    from integration_support import (
        run_files,
        run_processes,
        session_processes,
        to_toml,
    )

    ipc_before = set(glob.glob("/tmp/asyncrl-vllm-*"))
    shm_before = set(os.listdir("/dev/shm"))
    num_steps = 5
    beat = {"heartbeat_timeout_s": 5.0}  # probes every 5 / 12 s
    config = _launch_config(tmp_path, qwen_dir, num_steps, eval={"num_prompts": 8},
                            failures=beat)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config) + "\n")
    log = tmp_path / "console.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             *torchrun_log_args(str(tmp_path / "torchrun")),  # not a /tmp/torchelastic_*
             "--standalone", "-m", "asyncrl.launch", str(path)],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    metrics = tmp_path / "out" / "metrics.jsonl"
    sessions = {proc.pid}

    def records() -> list[dict]:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_for(kind: str, count: int) -> None:
        while len([r for r in records() if r["kind"] == kind]) < count:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    sessions.add(os.getsid(p.pid))
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def strike(how: signal.Signals) -> None:
        engine = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if "EngineCore" in p.name()]  # fmt: skip
        assert len(engine) == 1, engine
        engine[0].send_signal(how)

    try:
        deadline = time.monotonic() + 600
        wait_for("train", 1)
        run_id = records()[0]["run_id"]
        strike(signal.SIGKILL)
        wait_for("worker_restarted", 1)
        strike(signal.SIGSTOP)
        wait_for("worker_restarted", 2)
        while proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while [s for s in sessions if session_processes(s)] or run_processes(run_id) \
                or run_files(run_id):
            assert time.monotonic() < deadline, [session_processes(s) for s in sessions]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    done = records()
    assert len([r for r in done if r["kind"] == "train"]) == num_steps
    killed, stopped = [r for r in done if r["kind"] == "worker_restarted"]
    for restart in (killed, stopped):
        assert restart["worker"] == "rollout:0" and "EngineDeadError" in restart["error"], restart
    assert "answered no liveness probe" not in killed["error"], killed
    assert "vLLM engine process VLLM::" in killed["error"], killed
    assert "exited with code" in killed["error"], killed
    assert "answered no liveness probe in 5 s" in stopped["error"], stopped
    assert [r["label"] for r in done if r["kind"] == "eval"] == ["start", "end"]
    # what the engines left machine-wide: nothing (the killed and the stopped one's too)
    assert set(glob.glob("/tmp/asyncrl-vllm-*")) == ipc_before, "vLLM ipc directory left"
    leaked = [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("psm_")]
    assert leaked == [], f"vLLM shared memory left: {leaked}"
    print(f"\nRESTART | launch | vllm EngineCore SIGKILL, then SIGSTOP | back in "
          f"{killed['seconds']:.1f} s, {stopped['seconds']:.1f} s")
