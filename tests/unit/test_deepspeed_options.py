"""The deepspeed backend's options and the DeepSpeed config it builds (no DeepSpeed import)."""

from __future__ import annotations

import pytest

from asyncrl.errors import ConfigError
from asyncrl_deepspeed.options import parse_options


def test_defaults() -> None:
    opts = parse_options({})
    assert (opts.zero_stage, opts.mixed_precision, opts.max_grad_norm) == (2, "none", 1.0)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"zero_stage": 1}, r"trainer.options.zero_stage"),
        ({"zero": {"stage": 3}}, r"trainer.options.zero.stage: is set by the backend; use "
                                 r"trainer.options.zero_stage"),  # fmt: skip
        ({"export_bucket_mb": 0}, r"trainer.options.export_bucket_mb: must be >= 1"),
        ({"lr": 0}, r"trainer.options.lr: must be > 0"),
        ({"optimizer": "sgd"}, r"trainer.options.*optimizer.*docs/backends/deepspeed.md"),
        ({"mixed_precision": "fp16"}, r"trainer.options.mixed_precision"),
    ],
)
def test_bad_options_name_the_field(raw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_options(raw)


def test_zero_section_passes_through() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    from asyncrl_deepspeed.backend import deepspeed_config

    opts = parse_options(
        {"zero_stage": 3, "zero": {"reduce_bucket_size": 1000}, "mixed_precision": "bf16"}
    )
    cfg = deepspeed_config(opts, micro_batch_size=4, world_size=2)
    assert cfg["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 3}
    assert cfg["bf16"] == {"enabled": True}
    # the step is the only accumulation boundary, and DeepSpeed never scales by GAS
    assert cfg["managed_gradient_accumulation"] is False
    assert cfg["gradient_accumulation_steps"] == 1
    assert cfg["train_batch_size"] == 8
