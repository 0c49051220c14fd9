"""The plugin API for every kind of plugin: the run config, the errors a check raises, options
checking, loading a plugin by name, and process helpers for a plugin with processes of its own.

- ``Config``: the whole run config a ``check_config``/``check`` receives (read your table from
  ``config.generator.options``, ``config.trainer.options``, ...).
- ``from_dict``: build and validate a ``Config`` from a plain mapping (a plugin's own tests).
- ``LoraConfig``: ``[lora]`` (``config.lora``): the adapter's rank, alpha, targets, and its
  ``adapter_config.json``.
- ``ConfigError``: a config mistake, ``<field>: <problem>. Fix: <fix>.``; refuses a run before
  anything starts.
- ``PluginError``: a plugin that is missing, fails to import or breaks its contract.
- ``config_error``: make a ``ConfigError`` of the shape every config error has.
- ``explain``: msgspec's ``ValidationError`` on an options struct as a ``ConfigError`` message,
  with a did-you-mean.
- ``flatten``: the exceptions inside an exception group, nested groups flattened.
- ``load``: import the plugin registered as a name in an entry-point group.
- ``ProcessExit``: watch a process's exit (not necessarily a child) through a pidfd.
- ``host_id``: this host as process ids see it (name, boot, pid namespace).
- ``is_dying``: whether a process has exited or begun to.
- ``kill_process_group``: signal a process group (``False`` when it is already gone).
- ``parent_pid``: the parent of a process.
- ``process_name``: a process's name (``comm``).
- ``wait_exit_status``: wait for a process's exit and return its status.
- ``wait_pid_exit``: wait for a process's exit.
"""

from __future__ import annotations

from asyncrl.config import Config, LoraConfig, from_dict
from asyncrl.errors import ConfigError, PluginError, config_error, flatten
from asyncrl.explain import explain
from asyncrl.registry import load
from asyncrl.procs.process import (
    ProcessExit,
    host_id,
    is_dying,
    kill_process_group,
    parent_pid,
    process_name,
    wait_exit_status,
    wait_pid_exit,
)

__all__ = [
    "Config",
    "ConfigError",
    "LoraConfig",
    "PluginError",
    "ProcessExit",
    "config_error",
    "explain",
    "flatten",
    "from_dict",
    "host_id",
    "is_dying",
    "kill_process_group",
    "load",
    "parent_pid",
    "process_name",
    "wait_exit_status",
    "wait_pid_exit",
]
