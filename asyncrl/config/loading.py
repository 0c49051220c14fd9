"""From a TOML file (or a mapping) to a validated :class:`~asyncrl.config.Config`, and back to
plain builtins.

Loading is two steps: the typed struct (a key that was removed says what replaced it:
:mod:`asyncrl.config.removed`, or the ``REMOVED`` of a service's section; other unknown keys and
wrong types are named by :func:`~asyncrl.explain.explain`; relative paths resolved against the
config file's directory), then :func:`~asyncrl.config.root.validate` (cross-field invariants).

A top-level table that is not one of the core's (:data:`~asyncrl.config.root.CORE_SECTIONS`)
is a service's section (:mod:`asyncrl.services`): the service of that name is imported (only
then), the table converted to its ``section`` struct and its paths resolved, and the result
kept in ``Config.services``; :func:`to_dict` writes it back as the same table.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.explain import explain
from asyncrl.config.hub import hub_id, resolve_hub
from asyncrl.config.jobs import resolve_paths
from asyncrl.config.removed import refuse_removed
from asyncrl.config.root import CORE_SECTIONS, Config, validate
from asyncrl.config.service_sections import GROUP, SectionSpec, load_section
from asyncrl.errors import ConfigError
from asyncrl.errors import config_error as fail
from asyncrl.registry import GROUPS, available, install_hint

__all__ = ["apply_overrides", "from_dict", "load_config", "load_unvalidated", "parse_overrides",
           "to_dict"]


def _resolve(base: Path, value: str) -> str:
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else (base / path).resolve())


def _resolve_source(field: str, base: Path, value: str, revision: str = "") -> str:
    """A model or adapter: the directory ``value`` names relative to ``base``, else, when
    ``value`` reads as a Hugging Face Hub id, its snapshot in the local cache
    (:mod:`asyncrl.config.hub`)."""
    path = _resolve(base, value)
    if Path(path).exists() or not hub_id(value):
        return path
    return resolve_hub(field, value, revision)


def from_dict(data: dict[str, Any], *, base_dir: str | os.PathLike[str] = ".") -> Config:
    """Build and validate a :class:`Config` from a plain mapping (e.g. parsed TOML).

    Relative ``model.path``, ``run.output_dir`` and the other paths are resolved against
    ``base_dir`` (``environment.base_dir`` defaults to it; a service's section resolves its
    own, e.g. ``gateway.agent_dir``).

    Raises:
        ConfigError: a key unknown, removed or mistyped, a table that is neither a core
            section nor an installed service's, or a broken invariant.
        PluginError: a service named by a table fails to import or to keep its contract.
    """
    return validate(_convert(data, base_dir))


def _convert(data: dict[str, Any], base_dir: str | os.PathLike[str]) -> Config:
    refuse_removed(data)
    tables = {name: value for name, value in data.items() if name not in CORE_SECTIONS}
    try:
        config = msgspec.convert(
            {k: v for k, v in data.items() if k in CORE_SECTIONS}, Config
        )
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, Config)) from None
    base = Path(base_dir)
    if tables:
        config = msgspec.structs.replace(config, services=_services(tables, base))
    output_dir = _resolve(base, config.run.output_dir)
    template = config.model.chat_template
    if template != "auto":
        template = _resolve(base, template)
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(
            config.model,
            path=_resolve_source("model.path", base, config.model.path, config.model.revision),
            chat_template=template,
        ),
        run=msgspec.structs.replace(config.run, output_dir=output_dir),
        environment=msgspec.structs.replace(
            config.environment, base_dir=_resolve(base, config.environment.base_dir or ".")
        ),
        checkpoint=msgspec.structs.replace(
            config.checkpoint,
            dir=_resolve(base, config.checkpoint.dir or os.path.join(output_dir, "checkpoints")),
        ),
        export=msgspec.structs.replace(
            config.export, dir=_resolve(base, config.export.dir or os.path.join(output_dir, "hf"))
        ),
    )
    if config.lora.init_path:
        config = msgspec.structs.replace(config, lora=msgspec.structs.replace(
            config.lora, init_path=_resolve_source("lora.init_path", base,
                                                   config.lora.init_path)))  # fmt: skip
    if config.jobs:
        config = msgspec.structs.replace(
            config, jobs=resolve_paths(config.jobs, lambda path: _resolve(base, path))
        )
    if config.cluster.keys_file:
        keys_file = _resolve(base, config.cluster.keys_file)
        config = msgspec.structs.replace(
            config, cluster=msgspec.structs.replace(config.cluster, keys_file=keys_file)
        )
    return config


def _services(tables: dict[str, Any], base: Path) -> dict[str, Any]:
    """Each table as the section of the service of its name, converted, its paths resolved.

    Raises:
        ConfigError: a table that names no installed service (the first-party one not
            installed: how to install it; else the core's sections and the installed
            services), one that is not a table, a key its section names removed (every one
            the tables set, what replaced it), or a key unknown or mistyped in it.
        PluginError: the service fails to import or its section breaks the contract.
    """
    installed = available(GROUP)
    specs: dict[str, SectionSpec] = {}
    for name, table in tables.items():
        if name not in installed:
            raise _unknown_table(name, GROUP, list(installed))
        if not isinstance(table, dict):
            raise fail(name, f"is {table!r}, not a table",
                       f"write the service's settings as a [{name}] table")  # fmt: skip
        specs[name] = load_section(name, name)
    refuse_removed(tables, {f"{name}.{key}": entry for name, spec in specs.items()
                            for key, entry in spec.removed.items()})  # fmt: skip
    services: dict[str, Any] = {}
    for name, table in tables.items():
        spec = specs[name]
        try:
            section = msgspec.convert(table, spec.type)
        except msgspec.ValidationError as exc:
            raise ConfigError(explain(exc, spec.type, prefix=name)) from None
        if spec.resolve_paths is not None:
            section = spec.resolve_paths(section, base)
        services[name] = section
    return services


def _unknown_table(name: str, group: str, installed: list[str]) -> ConfigError:
    """The error for top-level table ``name``, neither a core section nor the section of an
    installed service (of ``group``): for a first-party service, how to install it (as
    :func:`asyncrl.registry.require` says it); else what the tables may be."""
    hint = install_hint(group, name)
    if hint:
        return fail(name, f"is the section of the {GROUPS[group]} {name!r}, which is not "
                    "installed", f"install it with: {hint} (or remove the [{name}] "
                    "table)")  # fmt: skip
    near = difflib.get_close_matches(name, [*CORE_SECTIONS, *installed], n=1)
    return fail(name, "is neither a section of the config nor an installed service's",
                f"{f'did you mean {near[0]!r}? ' if near else ''}rename or remove it "
                f"(sections: {', '.join(CORE_SECTIONS)}; installed services: "
                f"{', '.join(sorted(installed)) or 'none'})")  # fmt: skip


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
    apply_overrides(data, overrides or {})
    try:
        return _convert(data, path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set each of ``overrides`` (``{"grpo.prompts_per_step": 8}``) in ``data``, a config's
    tables as plain data, making the tables on the way.

    Raises:
        ConfigError: a key on the way holds a value, not a table."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {key} is not a table")
        node[leaf] = value


def to_dict(config: Config, *, services: bool = True) -> dict[str, Any]:
    """The config as plain builtins, as a TOML file would hold it: what a checkpoint stores
    and a resume compares, each service's section back as its top-level table
    (``from_dict(to_dict(c)) == c``). ``services=False``: the core's sections alone, what a
    worker is handed (it serves no service, and converts them without loading any)."""
    data = msgspec.to_builtins(config)
    sections = data.pop("services")
    return {**data, **sections} if services else data


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
