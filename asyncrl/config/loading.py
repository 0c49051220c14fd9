"""From a TOML file (or a mapping) to a validated :class:`~asyncrl.config.Config`, and back to
plain builtins.

Loading is two steps: the typed struct (a key that was removed says what replaced it:
:mod:`asyncrl.config.removed`; other unknown keys and wrong types are named by
:func:`~asyncrl.explain.explain`; relative paths resolved against the config file's
directory), then :func:`~asyncrl.config.root.validate` (cross-field invariants).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.explain import explain
from asyncrl.config.removed import refuse_removed
from asyncrl.config.root import Config, validate
from asyncrl.errors import ConfigError

__all__ = ["from_dict", "load_config", "load_unvalidated", "parse_overrides", "to_dict"]


def _resolve(base: Path, value: str) -> str:
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path).resolve())


def from_dict(data: dict[str, Any], *, base_dir: str | os.PathLike[str] = ".") -> Config:
    """Build and validate a :class:`Config` from a plain mapping (e.g. parsed TOML).

    Relative ``model.path``, ``run.output_dir`` and the other paths are resolved against
    ``base_dir`` (``environment.base_dir`` and ``gateway.agent_dir`` default to it).
    """
    return validate(_convert(data, base_dir))


def _convert(data: dict[str, Any], base_dir: str | os.PathLike[str]) -> Config:
    refuse_removed(data)
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, Config)) from None
    base = Path(base_dir)
    output_dir = _resolve(base, config.run.output_dir)
    template = config.model.chat_template
    if template != "auto":
        template = _resolve(base, template)
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(
            config.model, path=_resolve(base, config.model.path), chat_template=template
        ),
        run=msgspec.structs.replace(config.run, output_dir=output_dir),
        environment=msgspec.structs.replace(
            config.environment, base_dir=_resolve(base, config.environment.base_dir or ".")
        ),
        gateway=msgspec.structs.replace(
            config.gateway, agent_dir=_resolve(base, config.gateway.agent_dir or ".")
        ),
        checkpoint=msgspec.structs.replace(
            config.checkpoint,
            dir=_resolve(base, config.checkpoint.dir or os.path.join(output_dir, "checkpoints")),
        ),
        export=msgspec.structs.replace(
            config.export, dir=_resolve(base, config.export.dir or os.path.join(output_dir, "hf"))
        ),
    )
    if config.cluster.keys_file:
        keys_file = _resolve(base, config.cluster.keys_file)
        config = msgspec.structs.replace(
            config, cluster=msgspec.structs.replace(config.cluster, keys_file=keys_file)
        )
    return config


def load_config(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> Config:
    """Load a TOML config file, apply dotted ``overrides`` and validate it.

    Args:
        path: the TOML file.
        overrides: ``{"grpo.prompts_per_step": 8, ...}`` applied on top of the file.

    Raises:
        ConfigError: the file is missing, not TOML, or fails validation.
    """
    config = load_unvalidated(path, overrides)
    try:
        return validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_unvalidated(
    path: str | os.PathLike[str], overrides: dict[str, Any] | None = None
) -> Config:
    """:func:`load_config` up to the typed struct, before the cross-field checks (for
    :func:`problems`, which lists every broken invariant instead of raising the first).

    Raises:
        ConfigError: the file is missing, not TOML, or a field is unknown or mistyped.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {key} is not a table")
        node[leaf] = value
    try:
        return _convert(data, path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain builtins (for logging and for handing to workers)."""
    return msgspec.to_builtins(config)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` pairs as overrides for :func:`load_config`; values are parsed as
    TOML scalars when possible (``8``, ``true``, ``"x"``), else kept as strings."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. grpo.prompts_per_step=8")
        key, value = item.split("=", 1)
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    return out
