"""The ``asyncrl`` command (also ``python -m asyncrl``).

::

    asyncrl check-config run.toml [--set key=value ...]
    asyncrl export CHECKPOINT OUT [--force]

``check-config`` loads and validates the config without starting anything: it prints the
resolved asynchrony mode in one line, the derived capacities, advice, and every broken
invariant with its fix. Exit codes: 0 valid, 2 invalid (as ``asyncrl.launch`` uses for a
config mistake).

``export`` writes the policy of a checkpoint (a ``step-*`` directory, or a directory of them:
its newest) as a Hugging Face model directory that transformers and vLLM load as they are.
Exit codes: 0 done, 2 a checkpoint that cannot be exported or an existing OUT.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from .errors import ConfigError, PluginError

__all__ = ["main"]


def check_config(path: str, set_args: list[str], out: TextIO) -> int:
    from . import config as cfgmod
    from .launch import parse_overrides
    from .modes import describe

    try:
        overrides = parse_overrides(set_args)
        raw = cfgmod.load_unvalidated(path, overrides)
    except (ConfigError, PluginError) as exc:
        print(f"invalid: {exc}", file=out)
        return 2
    found = cfgmod.problems(raw)
    if found:
        print(f"{path}: {len(found)} problem{'s' * (len(found) > 1)}:", file=out)
        for exc in found:
            print(f"  - {exc}", file=out)
        return 2
    config = cfgmod.validate(raw)
    report = describe(config)
    print(f"mode: {report.mode}", file=out)
    print("capacities:", file=out)
    width = max(len(k) for k in report.capacities)
    for key, value in report.capacities.items():
        print(f"  {key:<{width}}  {value}", file=out)
    for line in report.advice:
        print(f"advice: {line}", file=out)
    print("ok: no invariant is broken", file=out)
    return 0


def export(spec: str, out: str, force: bool, stream: TextIO) -> int:
    import shutil
    from pathlib import Path

    from . import checkpoint as ckpt

    try:
        checkpoint = ckpt.open_checkpoint(ckpt.resolve(spec, spec))
    except ckpt.CheckpointError as exc:
        print(f"asyncrl: error: {exc}", file=stream)
        return 2
    model = checkpoint.model_dir
    if model is None:
        print(
            f"asyncrl: error: checkpoint {checkpoint.path} holds no model (it was saved with "
            "checkpoint.save_model = false). Fix: resume from it with save_model = true and "
            "checkpoint.every_steps = 1 for one step, or export at the end of a run "
            "(export.at_end = true)",
            file=stream,
        )
        return 2
    dest = Path(out).expanduser().resolve()
    if dest.exists() and not force:
        print(f"asyncrl: error: {dest} exists. Fix: pick another OUT or pass --force", file=stream)
        return 2
    tmp = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model, tmp)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    print(f"exported step {checkpoint.step} of {checkpoint.path} to {dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check-config",
        help="validate a run config and print its mode, capacities and broken invariants",
    )
    check.add_argument("config", help="the run's TOML file")
    check.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set grpo.prompts_per_step=8",
    )
    exp = sub.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model directory",
        description="Copy the Hugging Face model saved in a checkpoint (safetensors, config, "
        "tokenizer) to OUT, ready for transformers' from_pretrained or vLLM.",
    )
    exp.add_argument("checkpoint", help="a step-* checkpoint directory, or the directory of them")
    exp.add_argument("out", help="the model directory to create")
    exp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return check_config(args.config, args.set, sys.stdout)
    if args.command == "export":
        return export(args.checkpoint, args.out, args.force, sys.stderr)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
