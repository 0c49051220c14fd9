"""The training-backend contract (asyncrl_torch.contract.suite) on every first-party backend.

Each class runs the backend under real ``torchrun`` (gloo, CPU) and compares it with the
suite's float64 single-process reference. DeepSpeed runs on two ranks only here: its one-rank
classes (about 70 s each on 2 cores, mostly DeepSpeed's start) ran the same asyncrl code minus
the collectives the two-rank ones check; the GPU run (tests/gpu) keeps one rank.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncrl_torch.contract.suite import TrainingBackendContract  # noqa: E402


class TestFSDP2OneRank(TrainingBackendContract):
    backend = "fsdp2"
    world_size = 1


class TestFSDP2TwoRanks(TrainingBackendContract):
    backend = "fsdp2"
    world_size = 2


class TestFSDP2TwoRanksTokenBudget(TrainingBackendContract):
    """Micro-batches cut by tokens after sorting by length (the contract's sequences are 1-14
    tokens: ranges of one to several sequences, and shards whose order changes), each decoder
    layer's activations recomputed in the backward (``activation_checkpointing``)."""

    backend = "fsdp2"
    world_size = 2
    trainer = {"max_tokens_per_micro_batch": 24}
    options = {"activation_checkpointing": True}
    collective_timeout = False  # TestFSDP2TwoRanks runs the same stuck scenario


class TestFSDP2TwoRanksPacked(TrainingBackendContract):
    """Micro-batches packed end to end in rows of 24 tokens (``trainer.pack_sequences``):
    rows of one to several sequences, positions restarting in each, against the float64
    reference that runs every sequence alone."""

    backend = "fsdp2"
    world_size = 2
    trainer = {"max_tokens_per_micro_batch": 24, "pack_sequences": True}
    collective_timeout = False  # TestFSDP2TwoRanks runs the same stuck scenario


class TestDeepSpeedZero2TwoRanks(TrainingBackendContract):
    backend = "deepspeed"
    world_size = 2
    options = {"zero_stage": 2}


class TestDeepSpeedZero3TwoRanks(TrainingBackendContract):
    backend = "deepspeed"
    world_size = 2
    # small export groups: several all-gathers per export
    options = {"zero_stage": 3, "export_bucket_mb": 1}


LORA = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
"""Attention and MLP layers, some of each: the shapes differ (v_proj is narrower)."""
LORA_CLIP = {"max_grad_norm": 0.1}
"""Below the adapter's gradient norm in the first step (0.24; the whole model's is ~1.5), so
the clip is active there too."""


class TestFSDP2TwoRanksLoRA(TrainingBackendContract):
    """An adapter on a frozen base, sharded with it over two ranks."""

    backend = "fsdp2"
    world_size = 2
    options = LORA_CLIP
    lora = LORA
    collective_timeout = False  # TestFSDP2TwoRanks runs the same stuck scenario


class TestDeepSpeedZero2TwoRanksLoRA(TrainingBackendContract):
    backend = "deepspeed"
    world_size = 2
    options = {"zero_stage": 2, "activation_checkpointing": True, **LORA_CLIP}
    lora = LORA
    collective_timeout = False  # TestDeepSpeedZero2TwoRanks runs the same stuck scenario


class TestDeepSpeedZero3TwoRanksLoRA(TrainingBackendContract):
    backend = "deepspeed"
    world_size = 2
    options = {"zero_stage": 3, "export_bucket_mb": 1, **LORA_CLIP}
    lora = LORA
    collective_timeout = False  # TestDeepSpeedZero3TwoRanks runs the same stuck scenario


def test_deepspeed_on_the_cpu_compiles_no_op(tmp_path) -> None:
    """DeepSpeed started as the backend starts it, on the CPU accelerator, builds no C++ op:
    not its Adam (``torch_adam``) and not the shared-memory all-reduce its communication would
    compile at start (inference only; ~60 s of CPU, and an error without a compiler)."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist\n"
        "from asyncrl_deepspeed.backend import deepspeed, deepspeed_config\n"
        "from asyncrl_deepspeed.options import parse_options\n"
        f"dist.init_process_group('gloo', store=dist.FileStore({str(tmp_path / 'store')!r}, 1),"
        " rank=0, world_size=1)\n"
        "model = torch.nn.Linear(4, 4)\n"
        "config = deepspeed_config(parse_options({'zero_stage': 2}), micro_batch_size=1,"
        " world_size=1)\n"
        "engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),"
        " config=config, dist_init_required=False)\n"
        "engine.backward(engine(torch.ones(1, 4)).sum()); engine.step()\n"
        "dist.destroy_process_group()\n"
        "print('stepped')\n"
    )
    ext = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "CUDA_VISIBLE_DEVICES": "",
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0 and "stepped" in proc.stdout, proc.stderr[-3000:]
    built = [str(p.relative_to(ext)) for p in ext.rglob("*")] if ext.exists() else []
    assert built == [], f"DeepSpeed built ops on the CPU: {built}"
