"""LoRA in the trainer: the adapter PEFT builds on the frozen base, and its names on the wire.

``[lora]`` with a rank turns a :class:`~asyncrl_torch.DistributedTrainer` into an adapter
trainer. The model is wrapped by PEFT (``get_peft_model``, or ``PeftModel.from_pretrained``
for ``lora.init_path``) on the rank's device *before* the engine shards it: PEFT sizes
``lora_B`` from the weight it sees, so wrapping a shard would give shard-shaped adapters.
PEFT leaves ``requires_grad`` on the adapter only; the base keeps ``model.dtype`` (its storage
dtype) and the adapter is float32, so the optimizer holds float32 state for the adapter alone.

The adapter's tensors travel (refit, export) under PEFT's saved names: the parameter's name
without the adapter's own name (``...q_proj.lora_A.default.weight`` ->
``...q_proj.lora_A.weight``), which is what ``adapter_model.safetensors`` holds and what vLLM
and PEFT load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from asyncrl.plugin.common import ConfigError

if TYPE_CHECKING:
    from asyncrl.plugin.common import LoraConfig

__all__ = ["ADAPTER", "add_adapter", "saved_name"]

ADAPTER = "default"
"""The one adapter's name inside the PEFT model (PEFT's default)."""


def add_adapter(model: torch.nn.Module, lora: LoraConfig, model_dir: str) -> Any:
    """``model`` (the base, in its storage dtype) wrapped by PEFT with ``lora``'s adapter,
    float32 and trainable, everything else frozen.

    Raises:
        ConfigError: a target module that matches no linear layer of the model (PEFT itself
            only refuses a list that matches nothing).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    targets = lora.targets(model_dir)
    missing = [t for t in targets if not _matches(model, t)]
    if missing:
        raise ConfigError(
            f"lora.target_modules: {missing} match no linear layer of the model at {model_dir}. "
            f"Fix: name linear layers of its decoder (e.g. {_linear_names(model)[:8]})"
        )
    if lora.init_path:
        peft_model = PeftModel.from_pretrained(model, lora.init_path, is_trainable=True)
    else:
        config = PeftLoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(targets), bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip
        peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if param.requires_grad != ("lora_" in name):
            state = "trainable" if param.requires_grad else "frozen"
            raise RuntimeError(f"PEFT left {name} {state}")
        if param.requires_grad:
            param.data = param.data.float()
    return peft_model


def saved_name(name: str, adapter: str = ADAPTER) -> str:
    """PEFT's saved name of a parameter of ``adapter`` (the adapter's name dropped)."""
    return name.replace(f".{adapter}.", ".")


def _matches(model: torch.nn.Module, target: str) -> bool:
    return any(
        isinstance(m, torch.nn.Linear) and (name == target or name.endswith(f".{target}"))
        for name, m in model.named_modules()
    )


def _linear_names(model: torch.nn.Module) -> list[str]:
    names = {
        name.rsplit(".", 1)[-1] for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }  # fmt: skip
    return sorted(names - {"lm_head"})
