"""Worker entry point: one per rank. Connects to the controller, loads the backend, serves calls.

::

    controller ROUTER ◄──── DEALER (identity "group:rank") ─── this worker ─── backend plugin
    controller PULL   ◄──── PUSH (rollout ranks: finished samples)
    trainer rank 0 ROUTER ◄─ DEALER (rollout ranks: weight buckets, see asyncrl.worker.weights)

Handshake: ``Hello`` → ``Init`` (the run config) → the backend is created, checked against
its protocol, started → ``Ready``. The worker's group picks its runtime once, here:
:class:`~asyncrl.worker.rollout_runtime.RolloutRuntime` serves every call as its own task
(generation is concurrent); :class:`~asyncrl.worker.trainer_runtime.TrainerRuntime` runs calls
strictly in arrival order on one dedicated thread. Both share
:class:`~asyncrl.worker.base.WorkerRuntime` (calls, ``Health``, the controller and engine
watchers, closing). A backend failure during a call is reported as a ``Failure`` and the
worker keeps serving; a failure outside a call (start-up, a backend that does not implement
its protocol, a dead engine) is reported as ``Dead`` and the process exits non-zero.

After ``Shutdown`` the worker ignores SIGTERM: it is already leaving, and a SIGTERM that lands
while a slow engine shuts down must not turn a clean exit into a failure (SIGKILL still works).
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from typing import Any

import anyio
import msgspec
import structlog

from asyncrl.backend import WorkerContext
from asyncrl.config import Config
from asyncrl.config.hub import localize
from asyncrl.errors import ControllerLostError, ProtocolError
from asyncrl.obs.startup import process_start_time
from asyncrl.procs.process import has_exited, host_id
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import (
    PROTOCOL_VERSION,
    Dead,
    FromWorker,
    Hello,
    Init,
    Ready,
    ToWorker,
    WorkerStamps,
)
from asyncrl.wire.curve import RunKeys
from asyncrl.wire.transport import DEALER, Context, make_private_dir, run_dir_of
from asyncrl.worker.base import WorkerRuntime
from asyncrl.worker.rollout_runtime import RolloutRuntime
from asyncrl.worker.trainer_runtime import TrainerRuntime
from asyncrl.procs.space import shm_dir

__all__ = ["serve"]

log = structlog.get_logger("asyncrl.worker.runtime")

RUNTIMES: dict[str, type[WorkerRuntime]] = {"rollout": RolloutRuntime, "trainer": TrainerRuntime}
"""The runtime of each worker group."""


def _context(
    role: type[WorkerRuntime],
    init: Init,
    hello: Hello,
    local_rank: int,
    control_address: str,
    extra: dict[str, Any] | None,
) -> WorkerContext:
    """What the backend is told about where it runs, from the controller's ``Init``."""
    config = localize(msgspec.convert(init.config, Config))  # its Hub snapshots, found here
    gpus = role.gpus(config)
    return WorkerContext(
        group=hello.group,
        rank=hello.rank,
        world_size=hello.world_size,
        local_rank=local_rank,
        config=config,
        run_dir=_run_dir(control_address, init.run_id),
        extra=dict(extra or {}, run_id=init.run_id),
        gpu=gpus[hello.rank] if gpus else None,
    )


async def serve(
    *,
    control_address: str,
    group: str,
    rank: int,
    world_size: int,
    local_rank: int,
    log_path: str = "",
    extra: dict[str, Any] | None = None,
    startup_timeout_s: float = 600.0,
    keys: RunKeys | None = None,
) -> None:
    """Run one worker until the controller says ``Shutdown``.

    ``keys``: the run's CURVE keys for a ``tcp://`` controller (default: those in
    ``$ASYNCRL_RUN_KEYS``, taken out of the environment).

    Raises:
        ValueError: ``group`` is neither ``rollout`` nor ``trainer`` (nothing is started).
        Exception: whatever made the worker unable to serve, after telling the controller
            (``Dead``); a backend that does not implement its protocol is a ``PluginError``.

    Cancellation: the backend is closed (shielded) and the cancellation propagates.
    """
    serving = time.time()
    role = RUNTIMES.get(group)
    if role is None:
        raise ValueError(f"unknown worker group {group!r}; expected one of {sorted(RUNTIMES)}")
    identity = f"{group}:{rank}"
    ctx = Context(keys if keys is not None else RunKeys.from_env())
    runtime: WorkerRuntime | None = None
    lost = False
    control = ctx.socket(DEALER, connect=control_address, identity=identity)
    tx = Codec(FromWorker)
    try:
        hello = Hello(protocol_version=PROTOCOL_VERSION, group=group, rank=rank,
                      world_size=world_size, pid=os.getpid(), log_path=log_path, host=host_id())
        init = await _handshake(control, tx, hello, startup_timeout_s)
        init_at = time.time()
        wctx = _context(role, init, hello, local_rank, control_address, extra)
        runtime = role(ctx, control, init, wctx)
        structlog.contextvars.bind_contextvars(worker=identity)
        caps = await runtime.load()
        stamps = WorkerStamps(
            process=min(process_start_time() or serving, serving), serving=serving,
            init=init_at, created=runtime.created_at or init_at, started=time.time(),
        )  # fmt: skip
        await _ready(control, tx, role.backend_name(wctx.config), caps, stamps)
        await runtime.run()
    except ControllerLostError as exc:
        log.error("controller_lost", worker=identity, silent_s=exc.silent_s, reason=str(exc))
        lost = True
        raise
    except Exception as exc:
        _say_dead(control, tx, exc)
        raise
    finally:
        if runtime is not None:
            await runtime.close()
        if runtime is not None and not lost and not runtime.controller_remote:
            lost = _controller_gone(runtime.init.controller_pid)
        control.close(linger_ms=0 if lost else 2000)
        ctx.close()
        if lost and runtime is not None:
            _remove_run_files(runtime.wctx.run_dir, runtime.init.run_id)


async def _handshake(control: Any, tx: Codec, hello: Hello, timeout_s: float) -> Init:
    """Say ``Hello`` and wait for the controller's ``Init``.

    Raises:
        TimeoutError: no answer within ``timeout_s``.
        ProtocolError: the answer is not an ``Init``.
    """
    await control.send(tx.encode(hello))
    with anyio.fail_after(timeout_s):
        init = Codec(ToWorker).decode(await control.recv())
    if not isinstance(init, Init):
        raise ProtocolError(f"expected Init, got {type(init).__name__}")
    return init


async def _ready(
    control: Any, tx: Codec, backend: str, caps: dict[str, Any], stamps: WorkerStamps
) -> None:
    """Tell the controller the backend started, with its capabilities and how long it took."""
    version = str(caps.get("backend_version", ""))
    ready = Ready(backend=backend, backend_version=version, capabilities=caps, startup=stamps)
    await control.send(tx.encode(ready))
    log.info("worker_ready", backend=backend,
             **{f"{k}_s": round(v, 3) for k, v in stamps.phases().items()})  # fmt: skip


def _say_dead(control: Any, tx: Codec, exc: Exception) -> None:
    """Tell the controller why this worker cannot serve (``Dead``), without waiting: the
    controller may be gone already. Called in the ``except`` block (the traceback is
    ``exc``'s)."""
    dead = Dead(reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    try:
        control.send_nowait(tx.encode(dead))
    except Exception:  # noqa: BLE001 - the controller may be gone already
        pass


def _controller_gone(pid: int) -> bool:
    """Whether the controller's process (another process than this one) has exited."""
    return bool(pid) and pid != os.getpid() and has_exited(pid)


def _run_dir(control_address: str, run_id: str) -> str:
    """The run's private directory on this host: the controller's (its ipc sockets' home),
    or over ``tcp://`` (perhaps on another host) one of the same name made here."""
    if control_address.startswith("ipc://"):
        return os.path.dirname(control_address.removeprefix("ipc://"))
    return make_private_dir(run_dir_of(run_id))


def _remove_run_files(run_dir: str, run_id: str) -> None:
    """What a dead controller would have removed: the run's ipc socket directory and the
    shared-memory bucket directory (whoever removes them first wins; both may be gone)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(shm_dir(run_id), ignore_errors=True)
    log.info("run_files_removed", run_dir=run_dir)
