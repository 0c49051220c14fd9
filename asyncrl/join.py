"""Worker groups started apart from their controller.

An embedded controller that should not start its workers itself (they run on other nodes, or
under a scheduler of their own) attaches them instead: it binds its sockets, writes a *join
file*, and waits for them to connect::

    async with Controller(config, attach=join_file("run/join.json")) as ctl:
        await ctl.train()

and on the workers' nodes, with the same config (its ``[cluster]`` counts every worker: the
join ranks are the run's ranks, trainers first)::

    torchrun --nnodes N --nproc-per-node G ... -m asyncrl.join run/join.json run.toml [--set ...]

The join file (JSON, mode 0600, written whole or not at all) says where the controller listens,
its pid and host, and the run's keys with ``cluster.network = "tcp"``: it is a secret, like a
key file, and travels the same ways (a shared directory only the user reads, a Kubernetes
Secret). The ranks wait for it up to ``cluster.startup_timeout_s``, so either side may start
first; a file whose controller is gone (same host, its pid dead) is refused, and the
controller removes its file when its run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from asyncrl.config import load_config, parse_overrides
from asyncrl.errors import ConfigError, PluginError
from asyncrl.ranks import (
    ControllerAt,
    agent_store,
    env_int,
    node_keys,
    rank_kwargs,
    roles,
    worker_rank,
)
from asyncrl.procs.process import die_with_parent, host_id, pid_exists
from asyncrl.wire.curve import KeysError, RunKeys, check_private

JOIN_VERSION = 1
"""The join file's format; a rank refuses another."""


def join_file(path: str | os.PathLike[str]) -> Any:
    """The ``attach`` hook of a controller whose workers are started elsewhere: writes the
    join file at ``path`` once the sockets are bound, and removes it when the run ends."""
    from asyncrl.run.controller import Addresses

    target = Path(path)

    async def attach(addresses: Addresses, tg: anyio.abc.TaskGroup) -> None:
        assert addresses.keys is not None  # every run has its keys (ipc is CURVE too)
        write_join_file(target, addresses.control, addresses.keys)
        tg.start_soon(_remove_at_end, target, name="join-file")

    return attach


def write_join_file(path: Path, control: str, keys: RunKeys) -> None:
    """``path`` (mode 0600, replaced whole): where the controller listens, this process as
    the controller, and the run's ``keys``."""
    record = {
        "version": JOIN_VERSION, "control": control, "controller_pid": os.getpid(),
        "controller_host": host_id(), "keys": keys.to_json(),
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


async def _remove_at_end(path: Path) -> None:
    try:
        await anyio.sleep_forever()
    finally:
        path.unlink(missing_ok=True)


def read_join_file(path: Path, timeout_s: float, keys_file: str = "") -> ControllerAt:
    """The controller ``path`` names, waited for up to ``timeout_s`` (it may start after its
    workers). ``keys_file``: the run's keys from this file rather than the join file's.

    Raises:
        ConfigError: no file within ``timeout_s``, not a join file, readable by others, its
            controller gone, or the keys in it (or in ``keys_file``) refused."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConfigError(
                f"{path}: no join file within {timeout_s:g} s (cluster.startup_timeout_s). "
                "Fix: start the controller with attach=join_file(...) naming this path, or "
                "give its path here"
            )
        time.sleep(0.2)
    try:
        check_private(str(path), path.stat(), "a join file, which holds the run's keys,")
    except KeysError as exc:
        raise ConfigError(str(exc)) from None
    try:
        record = json.loads(path.read_text())
        if record.get("version") != JOIN_VERSION:
            raise ValueError(f"version {record.get('version')!r}, not {JOIN_VERSION}")
        control, host = record["control"], record["controller_host"]
        pid = int(record["controller_pid"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not an asyncrl join file ({exc}). Fix: give the file "
                          "the controller's join_file(...) wrote") from None  # fmt: skip
    if host != host_id():
        pid = 0  # another host's pid names nothing here: never watched by pid
    elif not pid_exists(pid):
        raise ConfigError(f"{path}: its controller (pid {pid}) is gone: a join file left by "
                          "an earlier run. Fix: start the controller again (it writes a new "
                          "one)")  # fmt: skip
    if keys_file:
        return control, pid, node_keys(keys_file)
    try:
        return control, pid, RunKeys.from_json(record["keys"] or "", str(path))
    except KeysError as exc:
        raise ConfigError(str(exc)) from None


def join_main(join_path: str, config_path: str, set_args: list[str]) -> int:
    """One rank of ``torchrun -m asyncrl.join JOIN CONFIG``: 2 (said by local rank 0) for a
    mistake in the config, the join file or this node's keys."""
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    speaks = int(os.environ.get("LOCAL_RANK", rank)) == 0
    die_with_parent()
    try:
        config = load_config(config_path, parse_overrides(set_args))
        group, group_rank = roles(config, rank, world)
        rollout_restarts = config.rollout_restarts
    except (ConfigError, PluginError) as exc:
        if speaks:
            print(f"asyncrl: error: {exc}", file=sys.stderr, flush=True)
        return 2
    kwargs = rank_kwargs(config, group, group_rank, agent_store())
    path, cluster = Path(join_path), config.cluster

    def find() -> ControllerAt:
        return read_join_file(path, cluster.startup_timeout_s, cluster.keys_file)

    return worker_rank(config, kwargs, rollout_restarts, find, speaks=speaks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.join",
        description="worker ranks (under torchrun) that join a controller started elsewhere",
    )
    parser.add_argument("join_file", help="the file the controller's join_file(...) writes")
    parser.add_argument("config", help="run config (TOML), the controller's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: torchrun --nproc-per-node N -m asyncrl.join ...")
    return join_main(args.join_file, args.config, args.set)


if __name__ == "__main__":
    sys.exit(main())
