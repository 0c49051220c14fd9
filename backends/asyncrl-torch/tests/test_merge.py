"""``python -m asyncrl_torch.merge``: a LoRA adapter merged into its base, against the merge
written out in float64 (``W + (alpha / r) B A``), and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from asyncrl_torch.contract.suite import build_tiny_qwen2, write_adapter  # noqa: E402
from asyncrl_torch.merge import main, merge_adapter  # noqa: E402

LORA = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "down_proj"]}


def test_the_merged_model_is_the_base_plus_the_adapter(tmp_path: Path) -> None:
    """Every adapted weight equals the float64 merge to float32 rounding (measured 4.8e-8), every
    other weight is the base's bit for bit, and the directory loads with the base's
    tokenizer beside it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = build_tiny_qwen2(tmp_path / "base")
    adapter = write_adapter(base, tmp_path / "adapter", LORA)
    out = merge_adapter(adapter, tmp_path / "merged", dtype="float32")
    merged = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    original = dict(AutoModelForCausalLM.from_pretrained(base).named_parameters())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    scale = LORA["alpha"] / LORA["rank"]
    adapted = 0
    for name, weight in original.items():
        a = lora.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        want = weight.detach().double()
        if a is not None:
            b = lora[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            want = want + scale * (b.double() @ a.double())
            adapted += 1
            err = float((merged[name].detach().double() - want).abs().max())
            assert err < 1.5e-7, (name, err)  # measured 4.8e-8 at most
        else:
            assert torch.equal(merged[name].detach(), weight.detach()), name
    assert adapted == 2 * 2  # two layers, two targets
    assert (out / "tokenizer.json").is_file() and not (tmp_path / ".tmp-merged").exists()


def test_refusals_name_the_fix(tmp_path: Path, capsys) -> None:
    base = build_tiny_qwen2(tmp_path / "base")
    adapter = write_adapter(base, tmp_path / "adapter", LORA)
    assert main([str(base), str(tmp_path / "o")]) == 2
    assert "not a PEFT adapter" in capsys.readouterr().err
    assert main([str(adapter), str(tmp_path / "o"), "--base", str(tmp_path)]) == 2
    assert "Fix: pass --base" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert main([str(adapter), str(tmp_path / "taken")]) == 2
    assert "exists" in capsys.readouterr().err


def test_the_module_runs_as_users_run_it(tmp_path: Path) -> None:
    base = build_tiny_qwen2(tmp_path / "base")
    adapter = write_adapter(base, tmp_path / "adapter", LORA)
    proc = subprocess.run([sys.executable, "-m", "asyncrl_torch.merge", str(adapter),
                           str(tmp_path / "m")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert np.any([p.suffix == ".safetensors" for p in (tmp_path / "m").iterdir()])
