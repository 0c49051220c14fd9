"""``[lora]`` as users write it: its checks, the initial adapter, what ``check-config`` says of
it, the PEFT export, and the refusal of a backend that does not handle adapters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncrl.cli import main
from asyncrl.config import LoraConfig, ModelConfig, from_dict, problems
from asyncrl.config.adapters import DEFAULT_TARGETS, MemoryEstimate
from asyncrl.errors import ConfigError

QWEN2 = {
    "model_type": "qwen2", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


@pytest.fixture
def qwen_dir(model_dir: Path) -> Path:
    (model_dir / "config.json").write_text(json.dumps(QWEN2))
    return model_dir


def config(model: Path, **lora: Any) -> dict[str, Any]:
    return {"model": {"path": str(model)}, "environment": {"name": "x"}, "lora": lora}


def unvalidated(data: dict[str, Any]) -> Any:
    """The config as loaded, before :func:`~asyncrl.config.validate` raises its first problem."""
    from asyncrl.config.loading import _convert

    return _convert(data, ".")


def test_full_weights_by_default_and_an_adapter_with_a_rank(qwen_dir: Path) -> None:
    assert not from_dict(config(qwen_dir)).lora.enabled
    lora = from_dict(config(qwen_dir, rank=8)).lora
    assert lora.enabled and lora.targets(str(qwen_dir)) == DEFAULT_TARGETS["qwen2"]
    assert "lm_head" not in DEFAULT_TARGETS["qwen2"] and "embed_tokens" not in DEFAULT_TARGETS["qwen2"]


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"rank": -1}, "lora.rank"),
        ({"rank": 8, "alpha": 0}, "lora.alpha"),
        ({"rank": 8, "dropout": 1.0}, "lora.dropout"),
        ({"rank": 8, "target_modules": ["q_proj", "lm_head"]}, "lora.target_modules"),
        ({"rank": 0, "init_path": "/nowhere"}, "lora.init_path"),
        ({"rank": 8, "init_path": "/nowhere"}, "lora.init_path"),
    ],
)
def test_each_broken_setting_is_named(qwen_dir: Path, lora: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        from_dict(config(qwen_dir, **lora))
    assert "Fix:" in str(info.value)


def test_a_reference_model_is_refused_with_an_adapter(qwen_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"loss\.reference_path.*adapter disabled"):
        from_dict({**config(qwen_dir, rank=8),
                   "loss": {"reference_path": str(qwen_dir), "kl_coef": 0.1}})


def test_a_family_without_defaults_asks_for_target_modules(model_dir: Path) -> None:
    (model_dir / "config.json").write_text(json.dumps({**QWEN2, "model_type": "mamba"}))
    with pytest.raises(ConfigError, match="lora.target_modules.*'mamba'"):
        from_dict(config(model_dir, rank=8))
    assert from_dict(config(model_dir, rank=8, target_modules=["x_proj"])).lora.enabled


def peft_adapter(path: Path, **over: Any) -> Path:
    path.mkdir()
    adapter = {"peft_type": "LORA", "r": 8, "lora_alpha": 32.0,
               "target_modules": list(DEFAULT_TARGETS["qwen2"]), "bias": "none", **over}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    return path


def test_an_initial_adapter_must_have_the_sections_shape(qwen_dir: Path, tmp_path: Path) -> None:
    good = peft_adapter(tmp_path / "good")
    assert from_dict(config(qwen_dir, rank=8, init_path=str(good))).lora.init_path == str(good)
    other = peft_adapter(tmp_path / "other", r=16, target_modules=["q_proj"])
    with pytest.raises(ConfigError) as info:
        from_dict(config(qwen_dir, rank=8, init_path=str(other)))
    assert "lora.rank" in str(info.value) and "set lora.rank = 16" in str(info.value)
    found = problems(unvalidated(config(qwen_dir, rank=8, init_path=str(other))))
    assert {str(e).split(":")[0] for e in found} == {"lora.rank", "lora.target_modules"}


@pytest.mark.parametrize("feature", [{"use_dora": True}, {"bias": "all"},
                                     {"modules_to_save": ["lm_head"]},
                                     {"rank_pattern": {"q_proj": 4}}, {"peft_type": "IA3"}])  # fmt: skip
def test_an_initial_adapter_asyncrl_cannot_serve_is_refused(
    qwen_dir: Path, tmp_path: Path, feature: dict[str, Any]
) -> None:
    adapter = peft_adapter(tmp_path / "a", **feature)
    with pytest.raises(ConfigError, match=f"lora.init_path.*{next(iter(feature))}"):
        from_dict(config(qwen_dir, rank=8, init_path=str(adapter)))


def test_a_relative_init_path_is_the_config_files(qwen_dir: Path, tmp_path: Path) -> None:
    peft_adapter(tmp_path / "sft")
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\npath = "{qwen_dir}"\n[environment]\nname = "x"\n'
                    '[lora]\nrank = 8\ninit_path = "sft"\n')  # fmt: skip
    from asyncrl.config import load_config

    assert load_config(toml).lora.init_path == str(tmp_path / "sft")


def test_the_estimate_counts_the_adapters_parameters(qwen_dir: Path) -> None:
    """Hand count for the fixture's shapes (hidden 64, MLP 160, 4 heads of 16, 2 KV heads):
    per layer q 64+64, k 64+32, v 64+32, o 64+64, gate and up 64+160 each, down 160+64 = 1,120
    inputs and outputs, times rank 8 and 3 layers (PEFT's own count on the demo model agreed:
    65,536 at rank 16)."""
    from safetensors.numpy import save_file

    save_file({"a": np.zeros((10, 3), np.float32), "b": np.zeros(5, np.float32)},
              str(qwen_dir / "model.safetensors"))  # fmt: skip
    from asyncrl.procs.space import model_size

    elements = model_size(str(qwen_dir)).elements
    model = ModelConfig(path=str(qwen_dir), dtype="bfloat16")
    estimate = MemoryEstimate.of(LoraConfig(rank=8), model, elements)
    assert estimate is not None
    assert estimate.trainable_parameters == 3 * 8 * 1120 == 26_880
    assert estimate.model_parameters == 35
    assert (estimate.base_bytes, estimate.adapter_bytes, estimate.full_bytes) == (70, 26_880 * 16, 560)
    assert MemoryEstimate.of(LoraConfig(rank=8, target_modules=["x"]), model, elements) is None


def test_the_space_checks_count_the_adapter_not_the_model(qwen_dir: Path) -> None:
    """A LoRA checkpoint, export and refit hold the adapter alone (the hand count above); with
    full weights, or targets whose size ``config.json`` cannot give, the whole model."""
    from safetensors.numpy import save_file

    from asyncrl.procs.space import checkpoint_need, trained_size

    save_file({"a": np.zeros((100, 1000), np.float32)}, str(qwen_dir / "model.safetensors"))
    full = trained_size(from_dict(config(qwen_dir)))
    lora = trained_size(from_dict(config(qwen_dir, rank=8)))
    unknown = trained_size(from_dict(config(qwen_dir, rank=8, target_modules=["x_proj"])))
    assert full is not None and lora is not None and unknown is not None
    assert (full.elements, lora.elements, unknown.elements) == (100_000, 26_880, 100_000)
    cfg = from_dict(config(qwen_dir, rank=8))
    assert checkpoint_need(cfg, lora) == 26_880 * (4 + 2)  # float32 state + the bf16 export


def test_check_config_prints_the_trainable_count(qwen_dir: Path, tmp_path: Path, capsys) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\npath = "{qwen_dir}"\n[environment]\nname = "x"\n[lora]\nrank = 8\n')
    assert main(["check-config", str(toml), "--config-only"]) == 0
    out = capsys.readouterr().out
    assert "lora: rank 8 on q_proj, k_proj" in out
    assert "sizes not readable" in out  # no safetensors in the fixture


def test_the_adapter_export_is_a_peft_directory(tmp_path: Path) -> None:
    """:func:`write_hf_model` with an adapter config writes ``adapter_model.safetensors`` (one
    file, whatever the shard size) and ``adapter_config.json``, and copies nothing of the
    model."""
    from safetensors.numpy import load_file

    from asyncrl.backend import WeightTensor
    from asyncrl.worker.export import write_hf_model

    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.arange(8, dtype=np.float32).reshape(2, 4),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.ones((4, 2), np.float32),
    }  # fmt: skip
    specs = [WeightTensor(n, "float32", a.shape) for n, a in tensors.items()]
    data = [WeightTensor(n, "float32", a.shape, a) for n, a in tensors.items()]
    adapter = LoraConfig(rank=2, target_modules=["q_proj"]).peft_config(str(source))
    out = write_hf_model(tmp_path / "out", specs, data, source_dir=source, shard_bytes=16,
                         adapter_config=adapter)  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert all(np.array_equal(saved[n], a) for n, a in tensors.items())
    written = json.loads((out / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["target_modules"]) == (2, 32.0, ["q_proj"])


def test_a_backend_that_does_not_handle_adapters_is_refused_before_the_run(
    tmp_path: Path, capsys
) -> None:
    """``BackendPlugin.adapters``: the trainer must train adapters and the generator serve them;
    each refusal names its backend, before any worker starts (``check-config`` as ``run``)."""
    from asyncrl_example_backend.model import write_model_dir

    model = write_model_dir(tmp_path / "model")
    path = tmp_path / "run.toml"
    path.write_text(
        f'[model]\npath = "{model}"\n[environment]\nname = "repeat-digit"\n'
        '[trainer]\nbackend = "bigram"\n[generator]\nbackend = "bigram"\n'
        '[grpo]\nprompts_per_step = 4\n[lora]\nrank = 8\ntarget_modules = ["q_proj"]\n'
    )
    assert main(["check-config", str(path)]) == 2
    out = capsys.readouterr().out
    assert "trainer.backend: the trainer backend 'bigram' does not train LoRA adapters" in out
    assert main(["check-config", str(path), "--set", "trainer.backend=fsdp2"]) == 2
    out = capsys.readouterr().out
    assert "generator.backend: the generator backend 'bigram' does not serve LoRA" in out
    assert main(["check-config", str(path), "--set", "lora.rank=0"]) == 0


def test_jobs_need_adapters_and_slots_enough_on_both_engines(qwen_dir: Path) -> None:
    """A run of jobs (docs/jobs.md) on vLLM and fsdp2: each job an adapter, so ``[lora]``;
    the trainer a slot per job; the engine each job's newest version and those its requests
    may hold (its staleness bound + 1) and one for a refit, over every job."""
    import asyncrl_fsdp
    import asyncrl_vllm

    jobs = {"a": {}, "b": {"pipeline": {"sampler": {"name": "in_order",
                                                     "max_lookahead_versions": 2}}}}
    data = {**config(qwen_dir), "trainer": {"options": {"lr": 1e-4}}, "jobs": jobs}
    full = from_dict(data)
    for plugin in (asyncrl_fsdp.plugin, asyncrl_vllm.plugin):
        with pytest.raises(ConfigError, match=r"^lora\.rank: is 0, but the run has jobs"):
            plugin.check_config(full, max_prompt_tokens=8)
    cfg = from_dict({**data, "lora": {"rank": 8}})
    with pytest.raises(ConfigError, match=r"job_slots: is 0, fewer than the run's 2 jobs"):
        asyncrl_fsdp.plugin.check_config(cfg, max_prompt_tokens=8)
    # a's bound is the run's default sampler's, b's 2: (a + 1) + (2 + 1) + 1 slots
    need = cfg.sampler.max_staleness + 1 + 3 + 1
    with pytest.raises(ConfigError, match=rf"lora_slots = {need} "):
        asyncrl_vllm.plugin.check_config(cfg, max_prompt_tokens=8)
    ok = from_dict({**data, "lora": {"rank": 8},
                    "trainer": {"options": {"lr": 1e-4, "job_slots": 2}},
                    "generator": {"options": {"lora_slots": need}}})  # fmt: skip
    asyncrl_fsdp.plugin.check_config(ok, max_prompt_tokens=8)
    asyncrl_vllm.plugin.check_config(ok, max_prompt_tokens=8)
