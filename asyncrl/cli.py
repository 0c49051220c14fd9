"""The ``asyncrl`` command (also ``python -m asyncrl``).

::

    asyncrl check-config run.toml [--set key=value ...]

``check-config`` loads and validates the config without starting anything: it prints the
resolved asynchrony mode in one line, the derived capacities, advice, and every broken
invariant with its fix. Exit codes: 0 valid, 2 invalid (as ``asyncrl.launch`` uses for a
config mistake).
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
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return check_config(args.config, args.set, sys.stdout)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
