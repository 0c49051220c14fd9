"""A LoRA adapter merged into its base: one Hugging Face model directory (docs/lora.md).

    python -m asyncrl_torch.merge ADAPTER OUT [--base DIR] [--dtype bfloat16|float32]

``ADAPTER`` is a PEFT adapter directory: a LoRA run's export (``export.dir``), a checkpoint's
``model/`` or ``asyncrl export``'s copy of it. The base is the adapter's
``base_model_name_or_path`` (the run's ``model.path``) unless ``--base`` names another copy.
PEFT merges ``W + (alpha / r) B A`` into each adapted layer in float32, and the result is
saved in ``--dtype`` (default: the base's) with the base's tokenizer, chat template and
generation config beside it, under a temporary name renamed at the end. This is the one
export that loads the whole model, so it lives here, with torch, and not in ``asyncrl
export``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

__all__ = ["merge_adapter"]

_MODEL_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def merge_adapter(
    adapter: str | Path, out: str | Path, *, base: str | Path | None = None,
    dtype: str | None = None,
) -> Path:  # fmt: skip
    """Merge the PEFT adapter at ``adapter`` into its base and save the model at ``out``.

    Raises:
        FileNotFoundError: ``adapter`` holds no ``adapter_config.json``, or the base is not a
            model directory (``--base`` names it).
        FileExistsError: ``out`` exists.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, out = Path(adapter), Path(out)
    config_file = adapter / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{adapter} holds no adapter_config.json: not a PEFT adapter "
                                "(a LoRA run's export or a checkpoint's model/)")  # fmt: skip
    base = Path(base or json.loads(config_file.read_text()).get("base_model_name_or_path", ""))
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"the base model {str(base) or '(none named)'} is not a model "
                                "directory. Fix: pass --base with the run's model.path")  # fmt: skip
    if out.exists():
        raise FileExistsError(f"{out} exists. Fix: pick another OUT, or remove it")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    saved_dtype = dtype or json.loads((base / "config.json").read_text()).get("torch_dtype")
    if saved_dtype:
        merged = merged.to(getattr(torch, str(saved_dtype)))
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        for path in base.iterdir():  # tokenizer, chat template, generation config...
            if path.is_file() and not path.name.endswith(_MODEL_FILES) and not (
                tmp / path.name
            ).exists():
                shutil.copy2(path, tmp / path.name)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl_torch.merge",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("adapter", help="a PEFT adapter directory")
    parser.add_argument("out", help="the merged model's directory (must not exist)")
    parser.add_argument("--base", default=None, help="the base model (default: the adapter's "
                        "base_model_name_or_path)")  # fmt: skip
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="the saved weights' dtype (default: the base's)")
    args = parser.parse_args(argv)
    try:
        path = merge_adapter(args.adapter, args.out, base=args.base, dtype=args.dtype)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"asyncrl_torch.merge: error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
