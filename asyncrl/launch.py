"""Process entry point under torchrun.

Two forms::

    torchrun --nproc-per-node N -m asyncrl.launch run.toml [--set grpo.prompts_per_step=8 ...]
        ranks [0, T) train, ranks [T, T+R) generate (T, R from [cluster]); global rank 0 also
        hosts the controller, and serves its own trainer role inside the controller's task
        group (its compute runs on a worker thread, off the event loop).

    torchrun --standalone --nproc-per-node K -m asyncrl.launch --worker GROUP --control ADDR
        what an embedded Controller spawns: every rank is a worker of GROUP.

Trainer ranks of a mixed launch get a torch.distributed world of their own, built on
torchrun's store under a private prefix; rollout ranks never join torch.distributed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from typing import Any

import anyio
import structlog

from . import log as _log
from .config import Config, load_config
from .errors import AsyncRLError, ConfigError

log = structlog.get_logger("asyncrl.launch")

_STORE_KEY = "asyncrl/control"


def _redirect_output(path: str) -> None:
    """Send this process's stdout/stderr (and its children's) to ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise SystemExit(f"{name} is not set: run this module under torchrun") from None


async def _serve_until_signal(**kwargs: Any) -> None:
    from .worker import serve

    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for sig in signals:
                    log.warning("worker_signalled", signal=sig)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(on_signal)
        await serve(**kwargs)
        tg.cancel_scope.cancel()
    # Leaving the receiver restored SIGTERM's default action; the worker has stopped its
    # engine and is only exiting now, so a late SIGTERM must not turn that into a failure.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_main(group: str, control: str, log_dir: str) -> int:
    """A rank of a group spawned by an embedded controller."""
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    log_path = os.path.join(log_dir, f"{group}-{rank}.log")
    _redirect_output(log_path)
    _log.configure("json")
    try:
        anyio.run(
            lambda: _serve_until_signal(
                control_address=control,
                group=group,
                rank=rank,
                world_size=world,
                local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                log_path=log_path,
            )
        )
    except Exception:
        log.exception("worker_failed")
        return 1
    return 0


def _agent_store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        use_libuv=True,
    )


def _roles(config: Config, rank: int, world: int) -> tuple[str, int]:
    t, r = config.cluster.trainer_ranks, config.cluster.rollout_ranks
    if world != t + r:
        raise ConfigError(
            f"cluster: torchrun started {world} processes but cluster.trainer_ranks + "
            f"cluster.rollout_ranks = {t} + {r} = {t + r}. Fix: run torchrun with "
            f"--nproc-per-node {t + r}, or change [cluster]"
        )
    return ("trainer", rank) if rank < t else ("rollout", rank - t)


def launch_main(config_path: str, overrides: dict[str, Any]) -> int:
    """One rank of ``torchrun -m asyncrl.launch CONFIG``."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    config = load_config(config_path, overrides)
    group, group_rank = _roles(config, rank, world)
    group_size = config.cluster.trainer_ranks if group == "trainer" else config.cluster.rollout_ranks
    log_dir = os.path.join(config.run.output_dir, "logs")
    store = _agent_store()
    extra: dict[str, Any] = {}
    if group == "trainer":
        import torch.distributed as dist

        extra["dist_store"] = dist.PrefixStore("asyncrl/trainer", store)
    worker_kwargs = dict(
        group=group,
        rank=group_rank,
        world_size=group_size,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        extra=extra,
        startup_timeout_s=config.cluster.startup_timeout_s,
    )
    if rank != 0:
        log_path = os.path.join(log_dir, f"{group}-{group_rank}.log")
        _redirect_output(log_path)
        _log.configure("json")
        store.set_timeout(datetime.timedelta(seconds=config.cluster.startup_timeout_s))
        control = store.get(_STORE_KEY).decode()
        try:
            anyio.run(
                lambda: _serve_until_signal(control_address=control, log_path=log_path, **worker_kwargs)
            )
        except Exception:
            log.exception("worker_failed")
            return 1
        return 0

    _log.configure(config.run.log_format)
    from .controller import Addresses, Controller
    from .worker import serve

    async def attach(addresses: Addresses, tg: Any) -> None:
        store.set(_STORE_KEY, addresses.control)
        tg.start_soon(
            lambda: serve(control_address=addresses.control, log_path="(rank 0 console)",
                          **worker_kwargs),
            name="rank0-worker",
        )

    async def run() -> None:
        async with Controller(config, attach=attach) as ctl:
            summary = await ctl.train()
        for e in summary.evals:
            print(f"eval {e['label']}: accuracy {e['accuracy']:.3f} on {e['num_prompts']} prompts")
        print(f"metrics: {summary.metrics_path}")

    try:
        anyio.run(run)
    except AsyncRLError as exc:
        log.error("run_failed", error=str(exc))
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        return 1
    return 0


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are parsed as TOML scalars when possible."""
    import tomllib

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.launch")
    parser.add_argument("config", nargs="?", help="run config (TOML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--worker", choices=["trainer", "rollout"], help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.control, args.log_dir)
    if not args.config:
        parser.error("a config file is required")
    try:
        return launch_main(args.config, parse_overrides(args.set))
    except ConfigError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
