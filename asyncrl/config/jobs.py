"""A run's jobs (docs/jobs.md): ``[jobs.<name>]`` tables, each a job's settings over the run's.

A job is one training run on the shared base model, engines and trainer ranks: its own
environment and data, ``[lora]`` adapter, optimizer, sampler, loss, evaluation, checkpoints,
metrics and seed. Its table sets what differs from the run's config, in the sections a job may
own (:data:`JOB_SECTIONS`), and two keys of its own: ``weight`` (its share of the engines'
request slots) and ``lr`` (its adapter's learning rate; by default the trainer's
``trainer.options.lr``)::

    [jobs.math]
    weight = 2.0
    lr = 1e-4
    [jobs.math.environment]
    name = "gsm8k"
    [jobs.math.run]
    seed = 3

The tables are kept as they were written (``Config.jobs``, plain data: a checkpoint stores them
and ``to_dict`` writes them back); :func:`merged_table` makes each job's whole config of them
(the run's, with the job's tables merged over it, its output under
``<run.output_dir>/jobs/<name>`` and its checkpoints under ``<checkpoint.dir>/jobs/<name>``),
which :func:`asyncrl.config.root.derive_job` converts and checks. This module is plain data and
checks on it; it imports no other part of the config.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.errors import config_error as fail

__all__ = ["JOB_KEYS", "JOB_SECTIONS", "learning_rate", "merged_table", "resolve_paths",
           "table_problems"]

JOB_SECTIONS = ("environment", "run", "grpo", "loss", "pipeline", "eval", "checkpoint",
                "failures", "episode")  # fmt: skip
"""The sections a job may set: what makes one experiment differ from another on the same base.
The others (the model, the cluster, the engines, ``[lora]``, the refit, the export) are the
run's: the jobs share them."""

SHARED_SECTIONS = ("model", "cluster", "refit", "trainer", "lora", "generator", "export",
                   "metrics")  # fmt: skip
"""The sections the jobs share: the run's alone."""

JOB_KEYS = ("weight", "lr")
"""A job table's keys of its own, beside its sections."""

SHARED_FIELDS = {
    "run.output_dir": "a job writes under <run.output_dir>/jobs/<name>",
    "checkpoint.dir": "a job's checkpoints go under <checkpoint.dir>/jobs/<name>",
    "run.log_format": "the run's processes log one way",
}
"""Fields of a job's sections that stay the run's, and why."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A job's name: it starts its group and request ids (``<name>:g12``) and names its
directory, so letters, digits, ``_``, ``.`` and ``-``, at most 64."""


def table_problems(name: str, table: Any) -> list[ConfigError]:
    """What is wrong with ``[jobs.<name>]`` as written: its name, a key that is no job's, a
    field that stays the run's, ``weight`` and ``lr`` (each naming its field and the fix)."""
    where = f"jobs.{name}"
    if not NAME.fullmatch(name):
        return [fail(where, f"{name!r} is not a job name (it starts the job's ids and names "
                     "its directory)", "use letters, digits, '_', '.' and '-', at most 64, "
                     "starting with a letter or digit")]  # fmt: skip
    if not isinstance(table, dict):
        return [fail(where, f"is {table!r}, not a table", f"write the job as a [{where}] table")]
    out = []
    for key, value in table.items():
        if key in JOB_KEYS:
            continue
        if key not in JOB_SECTIONS:
            out.append(fail(f"{where}.{key}", "is not a job's: the jobs share the run's "
                            f"[{key}]" if key in SHARED_SECTIONS else "is not a job's key",
                            f"set it at the top level, or remove it (a job sets "
                            f"{', '.join(JOB_KEYS)} and the sections "
                            f"{', '.join(JOB_SECTIONS)})"))  # fmt: skip
            continue
        if not isinstance(value, dict):
            out.append(fail(f"{where}.{key}", f"is {value!r}, not a table",
                            f"write it as a [{where}.{key}] table"))  # fmt: skip
            continue
        for field, why in SHARED_FIELDS.items():
            section, leaf = field.split(".")
            if key == section and leaf in value:
                out.append(fail(f"{where}.{field}", f"is the run's: {why}",
                                f"remove it from [{where}.{section}]"))  # fmt: skip
    for key in JOB_KEYS:
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not value > 0):  # fmt: skip
            out.append(fail(f"{where}.{key}", f"must be a number > 0, got {value!r}",
                            f"set {where}.{key} to a positive number, or remove it"))  # fmt: skip
    return out


def merged_table(run: dict[str, Any], name: str, table: dict[str, Any]) -> dict[str, Any]:
    """Job ``name``'s whole config as plain data: ``run`` (the run's config as builtins, its
    paths absolute, without ``jobs`` and services) with ``table``'s sections merged over it,
    its output, checkpoints and exports under ``jobs/<name>`` of the run's, and its tracker
    name ``<run.name>.<name>`` unless it sets one. What :func:`asyncrl.config.root.derive_job`
    converts and checks."""
    merged = copy.deepcopy(run)
    for section in JOB_SECTIONS:
        if section in table:
            merged[section] = _merge(merged.get(section, {}), table[section])
    if "name" not in table.get("run", {}):  # trackers tell the jobs apart
        merged["run"]["name"] = f"{run['run']['name']}.{name}"
    if "base_dir" not in table.get("environment", {}):  # the run's, whatever the name
        merged["environment"]["base_dir"] = run["environment"]["base_dir"]
    for section, field in (("run", "output_dir"), ("checkpoint", "dir"), ("export", "dir")):
        merged[section][field] = os.path.join(run[section][field], "jobs", name)
    return merged


def learning_rate(name: str, table: dict[str, Any], trainer_options: dict[str, Any]) -> float:
    """Job ``name``'s ``lr``: its own, else ``trainer.options.lr``.

    Raises:
        ConfigError: neither is set."""
    lr = table.get("lr", trainer_options.get("lr"))
    if lr is None:
        raise fail(f"jobs.{name}.lr", "is not set, and neither is trainer.options.lr",
                   f"set jobs.{name}.lr to the adapter's learning rate")  # fmt: skip
    return float(lr)


def resolve_paths(jobs: dict[str, Any], resolve: Any) -> dict[str, Any]:
    """``jobs`` as written, with each job's ``environment.base_dir`` made absolute by
    ``resolve`` (the loader's: against the config file's directory), the one path a job's
    sections hold."""
    out = {}
    for name, table in jobs.items():
        env = table.get("environment") if isinstance(table, dict) else None
        if isinstance(env, dict) and isinstance(env.get("base_dir"), str):
            table = {**table, "environment": {**env, "base_dir": resolve(env["base_dir"])}}
        out[name] = table
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``, table by table. A table that names another
    ``name`` (another environment, another sampler) replaces the run's: its keys were the old
    name's."""
    if "name" in over and over["name"] != base.get("name"):
        return copy.deepcopy(over)
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
