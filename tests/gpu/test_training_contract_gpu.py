"""The training-backend contract on a GPU (NCCL, one rank per GPU; skipped without CUDA).

The same suite as tests/contract, where the backends pick CUDA and NCCL themselves: cuBLAS and
cuDNN kernels instead of the CPU's, the fused AdamW of the FSDP2 backend, pinned host copies.
Two-rank classes run when the host has two GPUs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncrl_torch.contract.suite import TrainingBackendContract  # noqa: E402

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


class TestFSDP2OneGPU(TrainingBackendContract):
    backend = "fsdp2"


class TestDeepSpeedZero2OneGPU(TrainingBackendContract):
    backend = "deepspeed"
    options = {"zero_stage": 2}


class TestDeepSpeedZero3OneGPU(TrainingBackendContract):
    backend = "deepspeed"
    options = {"zero_stage": 3}


class TestFSDP2OneGPULoRA(TrainingBackendContract):
    """``[lora]`` on CUDA: the adapter against the float64 LoRA math (tests/contract's
    scenario)."""

    backend = "fsdp2"
    options = {"max_grad_norm": 0.1}  # below the adapter's first gradient norm (0.24)
    lora = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


class TestDeepSpeedZero2OneGPULoRA(TrainingBackendContract):
    backend = "deepspeed"
    options = {"zero_stage": 2, **TestFSDP2OneGPULoRA.options}
    lora = TestFSDP2OneGPULoRA.lora


class TestDeepSpeedZero3OneGPULoRA(TrainingBackendContract):
    backend = "deepspeed"
    options = {"zero_stage": 3, **TestFSDP2OneGPULoRA.options}
    lora = TestFSDP2OneGPULoRA.lora


@two_gpus
class TestFSDP2TwoGPUs(TrainingBackendContract):
    backend = "fsdp2"
    world_size = 2


@two_gpus
class TestDeepSpeedZero3TwoGPUs(TrainingBackendContract):
    backend = "deepspeed"
    world_size = 2
    options = {"zero_stage": 3, "export_bucket_mb": 1}
