"""What both worker roles share: the backend's loading, calls in and replies out, the watchers.

::

    control DEALER ─► serve_calls ─┬─ Health ──────► answer, at once (a task of its own)
                                   ├─ Cast ────────► served at once, in order, no answer
                                   ├─ another Call ─► the role's _submit ─► answer
                                   │                    rollout: a task each (concurrent)
                                   │                    trainer: a bounded queue (in order)
                                   └─ Shutdown ────► stop serving; SIGTERM ignored from now
    answer: the role's call table (request type → method) → Reply, or Failure if it raised

While it serves, watchers run beside the calls::

    controller watch   pidfd of Init.controller_pid (this host) → ControllerLostError: stop
                       the engine, remove the run's socket and shm directories, exit non-zero
    controller silence nothing heard from the controller for heartbeat_interval_s +
                       heartbeat_timeout_s, time this loop did not run taken out (any host;
                       asyncrl.worker.controller_watch) → ControllerLostError, as above
    engine watch       the backend's watch() (a rollout backend that has one)
                       → EngineDeadError → Dead

A call or a generation that raised is reported (``Failure``, ``GroupFailed``) unless the
engine's death caused it (:meth:`WorkerRuntime._own_failure`): a backend raises
``EngineDeadError`` itself for a failure its engine's death caused (the ``EngineWatch``
contract); then the worker dies and its ``Dead`` says why.

A role (:class:`~asyncrl.worker.rollout_runtime.RolloutRuntime`,
:class:`~asyncrl.worker.trainer_runtime.TrainerRuntime`) names its backend's entry-point group
and protocol, and says how its backend is created, started and closed and how its calls are
served. :func:`asyncrl.worker.runtime.serve` picks the role once, from the worker's group;
nothing here asks which role it is.
"""

from __future__ import annotations

import abc
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import anyio.abc
import structlog

from asyncrl import registry
from asyncrl.backend import BackendPlugin, WorkerContext
from asyncrl.registry import check_plugin
from asyncrl.config import Config
from asyncrl.errors import ControllerLostError, ProtocolError, WorkerError, flatten
from asyncrl.procs.process import host_id, wait_pid_exit
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import (
    CASTABLE,
    Call,
    Cast,
    Failure,
    FromWorker,
    Health,
    HealthResult,
    Init,
    Reply,
    Result,
    Shutdown,
    ToWorker,
    host_name,
)
from asyncrl.worker.controller_watch import ControllerSilence

__all__ = ["Handler", "WorkerRuntime"]

log = structlog.get_logger("asyncrl.worker.runtime")

Handler = Callable[[Any], Awaitable[Result]]
"""One entry of a role's call table: serves one request, returns its result."""


class WorkerRuntime(abc.ABC):
    """One worker after the handshake: its backend, its calls, its watchers.

    A role subclass sets the class attributes and implements the hooks (the abstract
    methods); the base never branches on the role.
    """

    ROLE: ClassVar[str]
    """The worker group this role serves (``rollout`` / ``trainer``)."""
    PLUGIN_GROUP: ClassVar[str]
    """The entry-point group its backends come from."""
    PROTOCOL: ClassVar[type]
    """The protocol its backend is checked against when it loads."""
    OPTIONAL: ClassVar[tuple[type, ...]] = ()
    """Protocols of optional backend methods, resolved once when the backend loads."""

    def __init__(self, ctx: Any, control: Any, init: Init, wctx: WorkerContext) -> None:
        self.ctx = ctx
        self.control = control
        self.init = init
        self.wctx = wctx
        self.identity = f"{wctx.group}:{wctx.rank}"
        self.tx = Codec(FromWorker)
        self._silence: ControllerSilence | None = None
        """What this worker heard of the controller, while it watches its silence."""
        self.backend: Any = None
        self.created_at: float | None = None
        """When :meth:`load` had made the backend (wall clock: the start-up record's)."""
        self.engine_gone: anyio.Event | None = None
        """Set when the backend's engine watch raised (``None``: the backend has none)."""
        self._engine_watch: Callable[[], Awaitable[None]] | None = None
        self._calls: dict[type, Handler] = {Health: self._health, **self._call_table()}

    # ----------------------------------------------------------------- role hooks
    @staticmethod
    @abc.abstractmethod
    def backend_name(config: Config) -> str:
        """The backend's entry-point name in ``config``."""

    @staticmethod
    @abc.abstractmethod
    def gpus(config: Config) -> list[int]:
        """The GPU of each rank of the role (empty: the backend's default)."""

    @abc.abstractmethod
    def _call_table(self) -> dict[type, Handler]:
        """Request type → the method that serves it (``Health`` is the base's)."""

    @abc.abstractmethod
    async def _create(self, plugin: BackendPlugin) -> Any:
        """Call the plugin's factory where the role's backend lives."""

    @abc.abstractmethod
    def _use_optional(self, methods: dict[str, Callable[..., Any] | None]) -> None:
        """Keep the optional methods :func:`~asyncrl.registry.check_plugin` resolved."""

    @abc.abstractmethod
    async def _start(self) -> dict[str, Any]:
        """Start the backend (and what the role needs beside it); its capabilities."""

    @abc.abstractmethod
    def _start_serving(self, tg: anyio.abc.TaskGroup) -> None:
        """Serving begins: start the role's helper tasks in ``tg`` (they are cancelled when
        serving ends), with the streams they need."""

    @abc.abstractmethod
    async def _submit(self, call: Call, tg: anyio.abc.TaskGroup) -> None:
        """Hand ``call`` (not a ``Health``) to be answered."""

    @abc.abstractmethod
    async def _close_backend(self) -> None:
        """Close the backend (called shielded, by :meth:`close`). How long it may take is the
        role's to say; nothing here bounds it: the last bound is the controller's SIGKILL
        after ``cluster.shutdown_grace_s`` (:func:`asyncrl.procs.spawn.stop_processes`)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Close what the role opened beside the backend (sockets, threads)."""

    # ----------------------------------------------------------------- loading
    async def load(self) -> dict[str, Any]:
        """Create the backend through its entry point, check it, start it.

        Returns:
            The backend's capabilities as plain JSON values (for ``Ready``).

        Raises:
            PluginError: the plugin is missing, fails to import, or does not implement the
                role's protocol (naming the plugin, its group and each method).
            Exception: whatever the plugin's factory or ``start`` raised.
        """
        name = self.backend_name(self.wctx.config)
        plugin = BackendPlugin.of(registry.load(self.PLUGIN_GROUP, name))
        self.adopt(await self._create(plugin), plugin=name)
        self.created_at = time.time()
        caps = await self._start()
        # backends report whatever they like (e.g. torch's TorchVersion, a str subclass):
        # keep only plain JSON values on the wire
        return json.loads(json.dumps(caps, default=str))

    def adopt(self, backend: Any, *, plugin: str) -> None:
        """Take ``backend`` (just created, not started) as this worker's, once it passed the
        check against :attr:`PROTOCOL`.

        Raises:
            PluginError: it does not implement the protocol (it is not kept).
        """
        optional = check_plugin(
            backend, self.PROTOCOL, plugin=plugin, group=self.PLUGIN_GROUP, optional=self.OPTIONAL
        )
        self.backend = backend
        self._use_optional(optional)

    # ----------------------------------------------------------------- calls
    async def send(self, msg: Any) -> None:
        await self.control.send(self.tx.encode(msg))

    async def _health(self, req: Health) -> Result:
        return HealthResult(pid=os.getpid())

    async def answer(self, call: Call) -> None:
        """Serve one call; send its ``Reply``, or a ``Failure`` if it raised (the worker
        keeps serving), or nothing if the engine died meanwhile (its ``Dead`` says why).

        Raises:
            WorkerError: the engine is gone: this worker is dying.
        """
        try:
            start = time.perf_counter()
            handler = self._calls.get(type(call.request))
            if handler is None:
                raise ProtocolError(
                    f"a {self.ROLE} worker cannot serve {type(call.request).__name__}"
                )
            result = await handler(call.request)
            seconds = time.perf_counter() - start
            await self.send(Reply(call_id=call.call_id, result=result, seconds=seconds))
        except Exception as exc:
            if not self._own_failure(exc):
                return  # the engine is gone: this worker's Dead says why
            log.exception("call_failed", method=type(call.request).__name__)
            await self.send(
                Failure(
                    call_id=call.call_id,
                    error_type=type(exc).__name__,
                    message=str(exc),
                    traceback=traceback.format_exc(),
                )
            )

    async def _perform(self, cast: Cast) -> None:
        """Serve a request that wants no answer, here and now (a ``Generate`` only starts its
        generations): in the order the casts came, and before the next message is read.

        Raises:
            ProtocolError: the request is not castable, or this role has no method for it.
            Exception: what its method raised. Either is fatal for the worker: no caller
                waits to be told, so its ``Dead`` tells the controller, which sends the work
                elsewhere.
        """
        handler = self._calls.get(type(cast.request))
        if not isinstance(cast.request, CASTABLE) or handler is None:
            raise ProtocolError(
                f"a {self.ROLE} worker cannot serve {type(cast.request).__name__} unanswered"
            )
        await handler(cast.request)

    async def serve_calls(self) -> None:
        """Receive calls and hand them on until ``Shutdown``. A ``Health`` probe is answered
        at once, never queued behind a call: its answer says this loop turns (the
        controller's heartbeat).

        Raises:
            ProtocolError: the controller sent something else than a call.

        Cancellation: calls in progress are cancelled (a backend call already running in a
        thread finishes first).
        """
        rx = Codec(ToWorker)
        async with anyio.create_task_group() as tg:
            self._start_serving(tg)
            while True:
                frames = await self.control.recv()
                heard = time.monotonic()
                msg = rx.decode(frames)
                if self._silence is not None:
                    probe = isinstance(msg, Call) and isinstance(msg.request, Health)
                    self._silence.heard(heard, probe=probe)
                if isinstance(msg, Shutdown):
                    log.info("worker_stopping", worker=self.identity)
                    if self.init.controller_pid != os.getpid():  # not the controller's rank
                        _ignore_sigterm()
                    tg.cancel_scope.cancel()
                    return
                if isinstance(msg, Cast):
                    await self._perform(msg)
                    continue
                if not isinstance(msg, Call):
                    raise ProtocolError(f"unexpected {type(msg).__name__} after Init")
                if isinstance(msg.request, Health):
                    tg.start_soon(self.answer, msg)
                else:
                    await self._submit(msg, tg)

    # ----------------------------------------------------------------- watchers
    async def run(self) -> None:
        """Serve calls until ``Shutdown``, with the controller and engine watchers beside.

        Raises:
            ControllerLostError: the controller's process exited, or it sent nothing for
                ``heartbeat_interval_s + heartbeat_timeout_s`` while this loop ran.
            EngineDeadError: the backend's ``watch()`` saw its engine die.
        """
        try:
            async with anyio.create_task_group() as tg:
                pid, remote = self.init.controller_pid, self.controller_remote
                if remote or (pid and pid != os.getpid()):  # not this process (rank 0's)
                    if not remote:  # its pid means something here: its exit, at once
                        tg.start_soon(self._watch_controller, pid, name="controller-watch")
                    self._silence = self._silence_watch()
                if self._silence is not None:  # and its silence, whatever the host
                    tg.start_soon(self._watch_controller_silence, self._silence,
                                  name="controller-silence")  # fmt: skip
                if self._engine_watch is not None:
                    self.engine_gone = anyio.Event()
                    tg.start_soon(self._watch_engine, self._engine_watch, name="engine-watch")
                await self.serve_calls()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # one watcher (or the call loop) failed and the rest were cancelled: report that
            # one error itself, so the Dead message says what happened
            cancelled = anyio.get_cancelled_exc_class()
            leaves = [e for e in flatten(group) if not isinstance(e, cancelled)]
            if len(leaves) == 1 and isinstance(leaves[0], Exception):
                raise leaves[0] from None
            # a dying engine can fail a generation and the engine watch at once: same cause
            fatal = [e for e in leaves if isinstance(e, WorkerError)]
            if fatal and len({str(e) for e in fatal}) == 1:
                raise fatal[0] from None
            raise

    async def _watch_engine(self, watch: Callable[[], Awaitable[None]]) -> None:
        try:
            await watch()
        except Exception:
            assert self.engine_gone is not None
            self.engine_gone.set()
            raise

    def _own_failure(self, exc: Exception) -> bool:
        """Whether ``exc``, raised by a call or a generation, is a failure of that call or
        group, to be reported (``Failure``, ``GroupFailed``) at once; ``False`` when the engine
        watch has already seen the engine die (the worker's ``Dead`` speaks for it, and the
        watch's error cancels the caller).

        The engine's death is not waited for: a backend with an engine watch raises
        ``EngineDeadError`` itself for a failure its engine's death caused (vLLM's does, after
        its own short wait for the verdict), so what else it raises is the call's own.

        Raises:
            WorkerError: ``exc`` itself, or an exception group holding one: the engine is
                gone, this worker is dying.
        """
        if any(isinstance(e, WorkerError) for e in flatten(exc)):
            raise exc
        return self.engine_gone is None or not self.engine_gone.is_set()

    @property
    def controller_remote(self) -> bool:
        """Whether the controller runs on another host (its pid names nothing here)."""
        host = self.init.controller_host
        return bool(host) and host != host_id()

    def _silence_watch(self) -> ControllerSilence | None:
        """The watch of the controller's silence, from now on (``None``: the heartbeat is off,
        so silence says nothing; on another host that leaves the controller unwatched)."""
        failures = self.wctx.config.failures
        if not failures.heartbeat_timeout_s:
            if self.controller_remote:
                log.warning("controller_unwatched", reason="the controller is on another host "
                            "and failures.heartbeat_timeout_s = 0: nothing says when it is gone")  # fmt: skip
            return None
        return ControllerSilence(
            interval_s=failures.heartbeat_interval_s, timeout_s=failures.heartbeat_timeout_s,
            startup_s=self.wctx.config.cluster.startup_timeout_s,
            tick_s=min(1.0, failures.heartbeat_interval_s), now=time.monotonic(),
        )  # fmt: skip

    async def _watch_controller_silence(self, silence: ControllerSilence) -> None:
        """Tick ``silence`` until the controller is found silent past its limit
        (:mod:`asyncrl.worker.controller_watch`): its probes come every
        ``heartbeat_interval_s``, and none came for ``heartbeat_timeout_s`` more, while this
        worker's own loop ran.

        Raises:
            ControllerLostError: naming the controller, the seconds and the settings.
        """
        while True:
            await anyio.sleep(silence.tick_s)
            silent = silence.tick(time.monotonic())
            if silent is not None:
                raise ControllerLostError(self._silent_message(silence, silent), silent_s=silent)

    def _silent_message(self, silence: ControllerSilence, silent: float) -> str:
        """Why the worker takes the controller for gone after ``silent`` seconds of silence."""
        heartbeat = (
            f"its heartbeat probes come every {silence.interval_s:.3g} s; "
            f"failures.heartbeat_timeout_s = {silence.timeout_s:g} s"
        )
        if not silence.probed:  # it probes once every worker is ready
            heartbeat += (f"; its heartbeat had not reached this worker, which waited "
                          f"cluster.startup_timeout_s = {silence.startup_s:g} s more for it")  # fmt: skip
        if silence.slept_in_silence_s:
            heartbeat += (f"; {silence.slept_in_silence_s:.1f} s when this worker itself did "
                          f"not run not counted")  # fmt: skip
        if self.controller_remote:
            host = host_name(self.init.controller_host)
            return (
                f"the controller on host {host!r} sent worker {self.identity} nothing for "
                f"{silent:.1f} s ({heartbeat}): its node went away or was cut off"
            )
        return (
            f"the controller (pid {self.init.controller_pid}) sent worker {self.identity} "
            f"nothing for {silent:.1f} s ({heartbeat}), though its process lives: it is "
            f"stopped (SIGSTOP, a debugger) or its event loop is blocked"
        )

    async def _watch_controller(self, pid: int) -> None:
        await wait_pid_exit(pid)
        raise ControllerLostError(
            f"the controller (pid {pid}) exited without telling worker {self.identity} to stop"
        )

    async def close(self) -> None:
        """Close the backend (an error is logged) and what the role opened.

        Cancellation: shielded; runs to its end.
        """
        with anyio.CancelScope(shield=True):
            if self.backend is not None:
                try:
                    await self._close_backend()
                except Exception:
                    log.exception("backend_close_failed")
            self._release()


def _ignore_sigterm() -> None:
    """From now on SIGTERM cannot kill this process (it is leaving in order already)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
