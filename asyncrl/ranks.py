"""A torchrun rank that serves one worker: under ``asyncrl.launch`` (every rank but global
rank 0, and the ranks an embedded controller spawns) and under ``asyncrl.join`` (workers that
join a controller started elsewhere).

The rank's output goes to its log file; it finds its controller (through torchrun's store, a
join file, or the address it was given), then serves until ``Shutdown``, a stop signal, a
failure or the controller's death: 0, 128 + N, or 1. With ``failures.rollout_restarts`` a
rollout rank does not serve itself: it supervises its worker, a child process it starts again
when it dies (:mod:`asyncrl.procs.supervisor`).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from asyncrl.config import Config
from asyncrl.errors import ConfigError, ControllerLostError, WorkerStartupError
from asyncrl.obs import log as _log
from asyncrl.procs.process import die_with_parent, exit_status, host_id, wait_exit_status
from asyncrl.procs.supervisor import CONTROLLER_LOST, last_words_fd
from asyncrl.wire.curve import KEYS_ENV, KeysError, RunKeys
from asyncrl.wire.messages import host_name

log = structlog.get_logger("asyncrl.launch")


def redirect_output(path: str) -> None:
    """Send this process's stdout/stderr (and its children's) to ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise SystemExit(f"{name} is not set: run this module under torchrun") from None


@dataclass
class _Ending:
    """How a worker rank's serving ended."""

    signal: signal.Signals | None = None
    error: Exception | None = None
    controller_exit: str | None = None
    """Set when the controller's process died first: its exit code, or ``unknown``."""


async def _serve_until_signal(controller_pid: int = 0, **kwargs: Any) -> _Ending:
    """Serve as a worker until ``Shutdown``, SIGTERM/SIGINT, a failure or the controller's
    death (``controller_pid`` given). Either way the worker closes its backend first."""
    from asyncrl.worker.runtime import serve

    ending = _Ending()
    async with anyio.create_task_group() as tg:

        async def watch_controller() -> None:
            # the runtime has its own watch that stops the worker; this one only keeps the
            # exit code for the report
            code = await wait_exit_status(controller_pid)
            ending.controller_exit = "unknown" if code is None else str(code)

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for sig in signals:
                    ending.signal = sig
                    break
            # torchrun follows a Ctrl-C with SIGTERM: it must not cut our cleanup short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            log.warning("worker_signalled", signal=sig.name)
            tg.cancel_scope.cancel()

        if controller_pid:
            tg.start_soon(watch_controller)
        tg.start_soon(on_signal)
        try:
            await serve(**kwargs)
        except Exception as exc:  # noqa: BLE001 - reported by _serve_rank
            log.exception("worker_failed")
            ending.error = exc
        tg.cancel_scope.cancel()
    # Leaving the receiver restored SIGTERM's default action; the worker has stopped its
    # engine and is only exiting now, so a late SIGTERM must not turn that into a failure.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lost = ending.error if isinstance(ending.error, ControllerLostError) else None
    if lost is not None and lost.silent_s is None and ending.controller_exit is None:
        code = exit_status(controller_pid) if controller_pid else None
        ending.controller_exit = "unknown" if code is None else str(code)
    return ending


def serve_rank(
    *, console: int | None = None, controller_pid: int = 0, lost_code: int = 1, **kwargs: Any
) -> int:
    """Run one worker rank to its end: 0 after ``Shutdown``, 128 + N after signal N, 1 after a
    failure (logged to the rank's log file, which its ``Dead`` message names), ``lost_code``
    after the controller died or went silent (a supervised worker's
    :data:`~asyncrl.procs.supervisor.CONTROLLER_LOST`).

    ``console``: a descriptor of the launch's stderr, kept by the rank that speaks for the run
    when rank 0 (the controller) dies or falls silent: it prints the one ``asyncrl: error``
    line then (a supervised worker writes it to its supervisor, which decides).
    """
    ending = anyio.run(lambda: _serve_until_signal(controller_pid, **kwargs))
    lost = ending.error if isinstance(ending.error, ControllerLostError) else None
    if lost is not None and lost.silent_s is not None:  # alive, or on another host: silent
        if console is not None:
            os.write(console, silent_controller_line(lost, kwargs.get("log_path", "?")))
        return lost_code
    if ending.controller_exit is not None:
        if console is not None:
            from asyncrl.procs.supervisor import controller_lost_line

            os.write(console, controller_lost_line(
                controller_pid, ending.controller_exit, kwargs.get("log_path", "?")
            ))
        return lost_code
    if ending.error is not None:
        return 1
    return 128 + int(ending.signal) if ending.signal is not None else 0


def silent_controller_line(lost: ControllerLostError, log_path: str) -> bytes:
    """The one line a worker rank prints when it took the controller for gone on its
    silence (its process may live on: stopped, its event loop blocked, another host's)."""
    return (
        f"asyncrl: error: {lost}; the workers stop their engines and remove the run's files "
        f"(this rank's log: {log_path})\n"
    ).encode()


def worker_main(
    group: str,
    control: str,
    log_dir: str,
    *,
    max_restarts: int = 0,
    rank: int | None = None,
    world: int | None = None,
    controller_pid: int = 0,
) -> int:
    """A rank of a group spawned by an embedded controller, or (``rank`` given) a rollout
    worker its supervisor started. With ``max_restarts``, this rank supervises its worker
    (:mod:`asyncrl.procs.supervisor`) instead of serving itself."""
    supervised = rank is not None
    rank = env_int("RANK") if rank is None else rank
    world = env_int("WORLD_SIZE") if world is None else world
    log_path = os.path.join(log_dir, f"{group}-{rank}.log")
    redirect_output(log_path)
    _log.configure("json")
    # stop with the torchrun agent or the supervisor, and with the embedding controller even
    # before Init names it (the runtime's own watch starts after the handshake)
    die_with_parent(also=controller_pid)
    if max_restarts:
        return _supervise(group, rank, world, control, log_dir, max_restarts,
                          controller_pid=controller_pid, log_path=log_path)
    return serve_rank(
        console=last_words_fd() if supervised else None,  # its supervisor decides
        lost_code=CONTROLLER_LOST if supervised else 1,
        control_address=control,
        group=group,
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        log_path=log_path,
    )


def _supervise(
    group: str, rank: int, world: int, control: str, log_dir: str, max_restarts: int,
    **kwargs: Any,
) -> int:
    from asyncrl.procs.supervisor import supervise

    cmd = [
        sys.executable, "-m", "asyncrl.launch", "--worker", group, "--control", control,
        "--log-dir", log_dir, "--rank", str(rank), "--world-size", str(world),
    ]  # fmt: skip
    return supervise(cmd, max_restarts=max_restarts, **kwargs)


FAILED_KEY = "asyncrl/failed"
"""In torchrun's store: how many worker ranks could not start (``<FAILED_KEY>/<rank>``: what
each said), so that rank 0 stops at once instead of at ``cluster.startup_timeout_s``."""
FAILED_POLL_S = 0.5


def say_failed(store: Any, rank: int, message: str) -> None:
    """Tell rank 0, through torchrun's ``store``, that global ``rank`` could not start and
    why. Best effort: the rank exits 2 whatever happens here."""
    try:
        store.set(f"{FAILED_KEY}/{rank}", message)
        store.add(FAILED_KEY, 1)
    except Exception:  # noqa: BLE001, S110 - the store gone: rank 0 times out as before
        pass


async def watch_failed(store: Any, world: int, within_s: float) -> None:
    """Rank 0, while the workers start (``within_s``): raise once a worker rank said in
    ``store`` that it could not start (:func:`say_failed`), with what it said. Returns at the
    end of the window, or as soon as the store is gone: its server is torchrun's agent, and
    when the agent dies the owner watch (``procs.process``) stops the run in order.

    Raises:
        WorkerStartupError: naming the rank and its message.

    Cancellation: stops watching (a store call under way ends in its thread).
    """
    def count() -> int | None:
        try:
            return int(store.add(FAILED_KEY, 0))  # adding 0 reads it without waiting
        except RuntimeError:  # torch's DistError: the store's server closed the connection
            return None

    with anyio.move_on_after(within_s):
        while not (failed := await anyio.to_thread.run_sync(count)):
            if failed is None:
                return
            await anyio.sleep(FAILED_POLL_S)
        ranks = [r for r in range(1, world) if store.check([f"{FAILED_KEY}/{r}"])]
        said = [f"global rank {r}: {store.get(f'{FAILED_KEY}/{r}').decode()}" for r in ranks]
        raise WorkerStartupError("a worker rank could not start; " + "; ".join(said))


def agent_store() -> Any:
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(addr, port, is_master=False, use_libuv=True)


def roles(config: Config, rank: int, world: int) -> tuple[str, int]:
    """Global ``rank`` of ``world`` torchrun ranks as (group, rank in the group): ranks
    ``[0, trainer_ranks)`` train, the rest generate.

    Raises:
        ConfigError: ``world`` is not ``trainer_ranks + rollout_ranks``."""
    t, r = config.cluster.trainer_ranks, config.cluster.rollout_ranks
    if world != t + r:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)  # torchrun's nodes
        if nodes == 1:
            fix = f"run torchrun with --nproc-per-node {t + r}"
        else:
            fix = (f"--nnodes x --nproc-per-node must be {t + r}: with {nodes} nodes, "
                   f"--nproc-per-node {(t + r) // nodes}" if (t + r) % nodes == 0 else
                   f"--nnodes x --nproc-per-node must be {t + r}, which {nodes} nodes "
                   f"cannot share evenly")  # fmt: skip
        raise ConfigError(
            f"cluster: torchrun started {world} processes but cluster.trainer_ranks + "
            f"cluster.rollout_ranks = {t} + {r} = {t + r}. Fix: {fix}, or change [cluster]"
        )
    return ("trainer", rank) if rank < t else ("rollout", rank - t)


def rank_kwargs(config: Config, group: str, group_rank: int, store: Any) -> dict[str, Any]:
    """What :func:`asyncrl.worker.runtime.serve` takes for this rank, besides the controller's
    address and keys. ``store``: torchrun's agent store, on which the trainer ranks build
    their process group."""
    extra: dict[str, Any] = {}
    if group == "trainer":
        import torch.distributed as dist

        extra["dist_store"] = dist.PrefixStore("asyncrl/trainer", store)
    c = config.cluster
    return dict(
        group=group,
        rank=group_rank,
        world_size=c.trainer_ranks if group == "trainer" else c.rollout_ranks,
        local_rank=int(os.environ.get("LOCAL_RANK", group_rank)),
        extra=extra,
        startup_timeout_s=c.startup_timeout_s,
    )


ControllerAt = tuple[str, int, RunKeys | None]
"""Where a worker rank finds its controller: its control address, its pid (0: not on this
host, never watched by pid) and the run's keys (``None`` over ``ipc://``)."""


def worker_rank(
    config: Config, worker_kwargs: dict[str, Any], rollout_restarts: int,
    find: Callable[[], ControllerAt], *, speaks: bool,
    failed: Callable[[str], None] = lambda message: None,
) -> int:
    """A worker rank (not the controller's): its output to its log file (``speaks``: it keeps
    the console, to speak if the controller dies), the controller found by ``find`` (which
    may wait for it), then serve (a rollout rank with restarts under its supervisor). 2 when
    ``find`` raises :class:`ConfigError` (this node's key file refused, say), said in one
    line, and told to ``failed`` (rank 0 hears of it through torchrun's store)."""
    group, group_rank = worker_kwargs["group"], worker_kwargs["rank"]
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the controller's signal, not ours
    log_dir = os.path.join(config.run.output_dir, "logs")
    log_path = os.path.join(log_dir, f"{group}-{group_rank}.log")
    console = os.dup(2) if speaks else None
    redirect_output(log_path)
    _log.configure("json")
    try:
        control, controller_pid, keys = find()
    except ConfigError as exc:
        failed(str(exc))
        said = f"asyncrl: error: {exc}\n"
        for fd in [2] if console is None else [2, console]:
            os.write(fd, said.encode())
        return 2
    if group == "rollout" and rollout_restarts:
        if keys is not None:  # the supervised worker's (this process serves nothing)
            os.environ[KEYS_ENV] = keys.to_json()
        return _supervise(
            group, group_rank, worker_kwargs["world_size"], control, log_dir, rollout_restarts,
            controller_pid=controller_pid, console=console, log_path=log_path,
        )
    return serve_rank(console=console, controller_pid=controller_pid, control_address=control,
                       log_path=log_path, keys=keys, **worker_kwargs)  # fmt: skip


def node_keys(keys_file: str) -> RunKeys:
    """The run's keys from this node's ``keys_file``.

    Raises:
        ConfigError: refused here (the controller read its own copy), naming this host."""
    try:
        return RunKeys.read(keys_file)
    except KeysError as exc:
        raise ConfigError(f"cluster.keys_file on {host_name(host_id())!r}: {exc}") from None
