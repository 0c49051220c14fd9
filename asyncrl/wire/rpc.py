"""Controller side of the control plane: one ROUTER, one reader task, calls by ``call_id``.

Workers connect DEALER sockets with identity ``group:rank`` and speak
:data:`asyncrl.wire.messages.FromWorker`. The reader task (:meth:`ControlPlane.run`) is the only
task that reads the ROUTER; it answers ``Hello`` with ``Init``, marks ``Ready`` workers, and
hands each ``Reply``/``Failure`` to the call waiting on its ``call_id``. A ``Dead`` message from
a connected worker is fatal: the reader raises, which cancels the controller's task group;
unless ``survivable`` says the worker will be started again, in which case its last words are
kept (:attr:`Peer.last_words`) for whoever watches its process (:meth:`forget`).

Nothing a peer sends can end the run by itself being malformed: an undecodable frame, a
``Hello`` from an identity the run does not expect (or a second one), a ``Ready``/``Dead``
from a peer that never said ``Hello``, a ``Reply`` to a call that is not pending or that went
to another worker are each rejected, logged with a printable peer name and counted
(:class:`~asyncrl.wire.transport.Rejections`, socket ``control``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from asyncrl.wire.codec import Codec
from asyncrl.errors import (
    ProtocolError,
    RemoteCallError,
    WorkerError,
    WorkerRestarting,
    WorkerStartupError,
)
from asyncrl.wire.messages import (
    PROTOCOL_VERSION,
    CASTABLE,
    Call,
    Cast,
    Dead,
    Failure,
    FromWorker,
    Hello,
    Init,
    Ready,
    Reply,
    Request,
    Result,
    Shutdown,
    ToWorker,
    WorkerStamps,
    host_name,
)
from asyncrl.wire.transport import AsyncSocket, PeerGone, Rejections, peer_name

__all__ = ["ControlPlane", "Peer"]

READ_SLICE_S = 0.0005
"""The control reader takes queued messages for at most this long before it gives the loop
back (as the data feeder does, ``asyncrl.run.intake.FEED_SLICE_S``)."""

log = structlog.get_logger("asyncrl.wire.rpc")


@dataclass
class Peer:
    """A connected worker."""

    identity: str
    group: str
    rank: int
    world_size: int
    pid: int
    log_path: str
    ready: anyio.Event = field(default_factory=anyio.Event)
    capabilities: dict[str, Any] = field(default_factory=dict)
    backend: str = ""
    startup: WorkerStamps | None = None
    """How its start went (its ``Ready`` said)."""
    error: BaseException | None = None
    last_words: BaseException | None = None
    """What its ``Dead`` message said, when it was survivable (the run goes on)."""
    host: str = ""
    """Its :func:`~asyncrl.procs.process.host_id`."""
    remote: bool = False
    """On another host than the controller: its ``pid`` means nothing here (it is never
    watched, signalled or waited for by pid)."""
    gone: anyio.Event = field(default_factory=anyio.Event)
    """Set when a remote peer's process is known to be gone although its connection says
    nothing: its last words came (``Dead``, survivable) or its successor said ``Hello``
    (its node's supervisor started it again). Else the heartbeat alone says it is lost."""

    @property
    def host_name(self) -> str:
        """Its host's name, where it is remote (``""`` on this host)."""
        return host_name(self.host) if self.remote else ""


@dataclass
class _Pending:
    peer: str
    method: str
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Result | None = None
    error: BaseException | None = None


class ControlPlane:
    """Owns the controller's ROUTER socket.

    Args:
        sock: a bound ROUTER socket.
        make_init: builds the :class:`Init` answer for a worker's :class:`Hello`.
        expected: the worker identities of the run (``None``: any ``group:rank``).
        rejections: where refused frames are counted (a fresh counter by default).
        survivable: whether a ready peer's death can be outlived (it will be restarted):
            its ``Dead`` message is then kept, not raised.
    """

    def __init__(
        self,
        sock: AsyncSocket,
        make_init: Callable[[Hello], Init],
        *,
        expected: set[str] | None = None,
        rejections: Rejections | None = None,
        survivable: Callable[[Peer], bool] = lambda peer: False,
        host: str = "",
        remote_ok: bool = False,
    ) -> None:
        """``host``: the controller's :func:`~asyncrl.procs.process.host_id`. A worker that
        says another is a remote peer (:attr:`Peer.remote`) with ``remote_ok`` (the run's
        sockets are on TCP), else it fails the start."""
        self._sock = sock
        self.survivable = survivable
        self._gone: dict[str, BaseException] = {}
        """Workers forgotten until their new process says ``Hello``: why calls to them fail."""
        self._successors: dict[str, Hello] = {}
        """The ``Hello`` of a remote worker's new process, said while its old one was still a
        peer: welcomed once the old one is forgotten (:meth:`wait_connected`)."""
        self._make_init = make_init
        self._admit: Callable[[Hello], bool] = lambda hello: True
        self._held: dict[str, Hello] = {}
        """Workers whose ``Init`` waits (:meth:`hold_starts`): their ``Hello`` by name."""
        self._expected = expected
        self._host = host
        self._remote_ok = remote_ok
        self.rejections = rejections if rejections is not None else Rejections()
        self._rx = Codec(FromWorker)
        self._tx = Codec(ToWorker)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.peers: dict[str, Peer] = {}
        self.served: dict[tuple[str, str], float] = {}
        """Seconds each worker spent serving each kind of call (its own account, from
        ``Reply.seconds``), since the last :meth:`take_served`."""
        self._peer_joined = anyio.Event()

    def hold_starts(self, admit: Callable[[Hello], bool]) -> None:
        """From now on a worker that says ``Hello`` gets its ``Init`` (and starts its backend)
        only if ``admit(hello)``; the others wait, connected, for :meth:`admit_held`. (A
        shared GPU taken in turns: an engine restarted in the trainer's turn must not start
        while the trainer steps.)"""
        self._admit = admit

    async def admit_held(self) -> list[str]:
        """Send their ``Init`` to the workers held back by :meth:`hold_starts`; returns their
        names."""
        held, self._held = self._held, {}
        sent = []
        for identity, hello in held.items():
            if identity in self.peers:  # not forgotten meanwhile (its process died)
                log.info("worker_start_admitted", worker=identity)
                await self._send(identity, self._make_init(hello))
                sent.append(identity)
        return sent

    def started(self, group: str) -> list[str]:
        """The workers of ``group`` that got their ``Init`` and are alive (ready or still
        starting their backend), by name."""
        return [name for name, peer in self.peers.items() if peer.group == group
                and peer.error is None and name not in self._held]  # fmt: skip

    def take_served(self) -> dict[tuple[str, str], float]:
        """:attr:`served` so far, and start counting afresh."""
        served, self.served = self.served, {}
        return served

    async def run(self) -> None:
        """Read the ROUTER forever. Raises :class:`WorkerError` on a worker's ``Dead``.

        Cancellation: stops reading; pending calls are left to their own timeouts/cancels.
        """
        slice_end = time.perf_counter() + READ_SLICE_S
        while True:
            if time.perf_counter() > slice_end:
                # recv() returns at once while messages are queued: give the loop back now
                # and then, or a burst of replies (a turn's each) holds it for all of them
                await anyio.lowlevel.checkpoint()
                slice_end = time.perf_counter() + READ_SLICE_S
            frames = await self._sock.recv()
            identity = peer_name(frames[0].buffer)
            try:
                msg = self._rx.decode(frames[1:])
            except ProtocolError as exc:
                self.rejections.reject("control", identity, str(exc))
                continue
            await self._handle(identity, msg)

    def _reject(self, identity: str, reason: str) -> None:
        self.rejections.reject("control", identity, reason)

    async def _handle(self, identity: str, msg: Any) -> None:
        if isinstance(msg, Hello):
            await self._on_hello(identity, msg)
        elif isinstance(msg, Ready):
            peer = self.peers.get(identity)
            if peer is None:
                self._reject(identity, "Ready from a peer that never said Hello")
                return
            if peer.ready.is_set():
                self._reject(identity, "a second Ready")
                return
            peer.capabilities = dict(msg.capabilities)
            peer.backend = msg.backend
            peer.startup = msg.startup
            peer.ready.set()
            log.info("worker_ready", worker=identity, backend=msg.backend, pid=peer.pid)
        elif isinstance(msg, (Reply, Failure)):
            pending = self._pending.get(msg.call_id)
            if pending is None or pending.done.is_set():
                # a late reply to a call that timed out or was cancelled, or a stranger's
                self._reject(identity, f"{type(msg).__name__} to call {msg.call_id}, not pending")
                return
            if pending.peer != identity:
                self._reject(
                    identity, f"{type(msg).__name__} to call {msg.call_id} of {pending.peer}"
                )
                return
            if isinstance(msg, Reply):
                pending.result = msg.result
                key = (identity, pending.method)
                self.served[key] = self.served.get(key, 0.0) + msg.seconds
            else:
                pending.error = RemoteCallError(
                    identity, pending.method, msg.error_type, msg.message, msg.traceback
                )
            pending.done.set()
        elif isinstance(msg, Dead):
            peer = self.peers.get(identity)
            if peer is None:
                self._reject(identity, "Dead from a peer that never said Hello")
                return
            where = f"; its log: {peer.log_path}" if peer and peer.log_path else ""
            # dying before Ready is a start-up failure (the documented error of entering)
            kind = WorkerError if peer is not None and peer.ready.is_set() else WorkerStartupError
            err = kind(
                f"worker {identity} stopped with a fatal error: {msg.reason}{where}\n"
                f"--- remote traceback ---\n{msg.traceback}"
            )
            err.reported_by = identity  # type: ignore[attr-defined]  # its own last words
            if peer.ready.is_set() and self.survivable(peer):
                peer.last_words = err  # its process exits next: its watcher takes it from here
                if peer.remote:
                    peer.gone.set()  # no pid to watch there: these words are its death
                log.warning("worker_dead", worker=identity, reason=msg.reason)
                return
            self.fail_peer(identity, err)
            raise err

    async def _on_hello(self, identity: str, hello: Hello) -> None:
        if identity != f"{hello.group}:{hello.rank}":
            self._reject(identity, f"Hello as {hello.group}:{hello.rank} from another identity")
            return
        if self._expected is not None and identity not in self._expected:
            self._reject(identity, "Hello from a worker this run does not have")
            return
        old = self.peers.get(identity)
        if old is not None:
            if old.remote and hello.host == old.host and hello.pid != old.pid:
                # a new process on the same host: its node's supervisor started it again,
                # so the old one is gone (its pid cannot be watched from here)
                self._successors[identity] = hello
                old.gone.set()
                log.warning("worker_replaced", worker=identity, host=host_name(hello.host),
                            old_pid=old.pid, pid=hello.pid)  # fmt: skip
                return
            self._reject(identity, "a second Hello")
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            raise WorkerStartupError(
                f"worker {identity} speaks protocol {hello.protocol_version}, this controller "
                f"speaks {PROTOCOL_VERSION}; install the same asyncrl version everywhere"
            )
        remote = hello.host != self._host
        if remote and not self._remote_ok:
            # over ipc:// the run is one host's: a pid of another host (or pid namespace)
            # would name some other process here
            raise WorkerStartupError(
                f"worker {identity} (pid {hello.pid}) runs on another host than the controller "
                f"({host_name(hello.host)!r}, the controller on "
                f"{host_name(self._host)!r}) and cluster.network is 'ipc'. Fix: set "
                "cluster.network = \"tcp\" (docs/multi-node.md), or start every rank on the "
                "controller's host"
            )
        self._gone.pop(identity, None)
        self.peers[identity] = Peer(
            identity, hello.group, hello.rank, hello.world_size, hello.pid, hello.log_path,
            host=hello.host, remote=remote,
        )
        self._peer_joined.set()
        self._peer_joined = anyio.Event()
        log.info("worker_connected", worker=identity, pid=hello.pid, log=hello.log_path,
                 **({"host": host_name(hello.host)} if remote else {}))
        if not self._admit(hello):
            self._held[identity] = hello
            log.info("worker_start_held", worker=identity)
            return
        await self._send(identity, self._make_init(hello))

    async def _send(self, identity: str, msg: Any) -> None:
        await self._sock.send([identity.encode(), *self._tx.encode(msg)])

    async def wait_ready(self, group: str, world_size: int) -> list[Peer]:
        """Wait until ranks ``0..world_size-1`` of ``group`` are ready; return them by rank.

        Cancellation: safe; callers bound it with a timeout.
        """
        names = [f"{group}:{r}" for r in range(world_size)]
        while not all(n in self.peers for n in names):
            await self._peer_joined.wait()
        for n in names:
            await self.peers[n].ready.wait()
        return [self.peers[n] for n in names]

    async def wait_connected(self, identity: str) -> None:
        """Wait until ``identity``, forgotten (:meth:`forget`), has said ``Hello`` again (a
        restarted worker's new process; one that said it before the old one was forgotten
        is welcomed now). Cancellation: safe; callers bound it with a timeout."""
        hello = self._successors.pop(identity, None)
        if hello is not None and identity not in self.peers:
            await self._on_hello(identity, hello)
        while identity not in self.peers:
            await self._peer_joined.wait()

    async def wait_peer(self, identity: str) -> Peer:
        """Wait until ``identity`` is connected and ready (a restarted worker: its new
        process). Cancellation: safe; callers bound it with a timeout."""
        await self.wait_connected(identity)
        peer = self.peers[identity]
        await peer.ready.wait()
        return peer

    def serving(self) -> list[Peer]:
        """The workers that take calls now: connected, ready and not marked dead (one being
        restarted is absent until its new process is ready)."""
        return [p for p in self.peers.values() if p.ready.is_set() and p.error is None]

    def pids(self) -> dict[str, int]:
        """The connected workers' processes: pid by name."""
        return {name: peer.pid for name, peer in self.peers.items()}

    def forget(self, identity: str, error: BaseException) -> None:
        """Forget a worker whose process died and will start again: every call waiting on
        it, and every call to it until its new process says ``Hello``, fails with ``error``;
        that ``Hello`` is then welcome."""
        self.fail_peer(identity, error)
        self.peers.pop(identity, None)
        self._held.pop(identity, None)
        self._gone[identity] = error

    def fail_peer(self, identity: str, error: BaseException) -> None:
        """Mark a worker dead: every call waiting on it fails with ``error``."""
        peer = self.peers.get(identity)
        if peer is not None and peer.error is None:
            peer.error = error
        for pending in self._pending.values():
            if pending.peer == identity and not pending.done.is_set():
                pending.error = error
                pending.done.set()

    async def call(self, identity: str, request: Request, *, timeout_s: float) -> Result:
        """Send ``request`` to one worker and wait for its result.

        Raises:
            RemoteCallError: the worker raised (it keeps serving).
            WorkerError: the worker died or did not answer within ``timeout_s``.

        Cancellation: the wait is abandoned; a late reply is dropped.
        """
        peer = self._peer(identity)
        call_id = next(self._ids)
        method = type(request).__name__
        pending = self._pending[call_id] = _Pending(identity, method)
        start = time.perf_counter()
        unreachable = False
        try:
            try:
                await self._send(identity, Call(call_id=call_id, request=request))
            except PeerGone:
                # The worker's socket is gone: its process exited or is exiting. Its watcher
                # reports the death (with the exit code) and ends the run; until then this
                # call waits like any call whose reply never comes.
                unreachable = True
                log.warning("worker_unreachable", worker=identity, method=method)
            with anyio.move_on_after(timeout_s) as scope:
                await pending.done.wait()
            if scope.cancelled_caught:
                if unreachable:
                    raise WorkerError(
                        f"{method}: worker {identity} was unreachable (its socket is closed); "
                        f"its log: {peer.log_path}"
                    )
                raise WorkerError(
                    f"{method} on worker {identity} did not finish within {timeout_s:.0f} s "
                    f"(cluster.call_timeout_s); its log: {peer.log_path}"
                )
        finally:
            del self._pending[call_id]
        if pending.error is not None:
            raise pending.error
        log.debug("call_finished", worker=identity, method=method,
                  seconds=round(time.perf_counter() - start, 4))
        assert pending.result is not None
        return pending.result

    def _peer(self, identity: str) -> Peer:
        """The worker to send to; raises why there is none (see :meth:`call`)."""
        peer = self.peers.get(identity)
        if peer is None:
            if identity in self._gone:
                raise self._gone[identity]
            raise WorkerError(f"no worker {identity} is connected")
        if peer.error is not None:
            raise peer.error
        return peer

    async def cast(self, identity: str, request: Request) -> None:
        """Send ``request`` (one of :data:`~asyncrl.wire.messages.CASTABLE`) to one worker and
        wait for nothing: its work comes back its own way (a ``Generate``'s samples on the data
        socket). Returns once the message is queued on the socket (at once, unless the socket
        is at its high-water mark).

        A worker whose socket is gone is not an error here: its process exited or is exiting,
        and its watcher reports the death; what it was asked for is then lost with it (the
        rollout phase's ``worker_lost``), as for a worker that dies after taking it.

        Raises:
            WorkerError: the worker is not connected or is marked dead.
            WorkerRestarting: it died and is being restarted.
        """
        if not isinstance(request, CASTABLE):
            raise TypeError(f"{type(request).__name__} is not sent without an answer")
        self._peer(identity)
        try:
            await self._send(identity, Cast(request=request))
        except PeerGone:
            log.warning("worker_unreachable", worker=identity, method=type(request).__name__)

    async def cast_unless_restarting(self, identity: str, request: Request) -> bool:
        """:meth:`cast`, but ``False`` (not sent) when the worker died and is being restarted:
        its work goes elsewhere (see :meth:`call_unless_restarting`)."""
        try:
            await self.cast(identity, request)
        except WorkerRestarting:
            return False
        return True

    async def call_unless_restarting(
        self, identity: str, request: Request, *, timeout_s: float
    ) -> Result | None:
        """:meth:`call`, but ``None`` when the worker died and is being restarted
        (:class:`~asyncrl.errors.WorkerRestarting`, at the send or while waiting): its work
        goes elsewhere (its groups are dispatched again, it is refitted once back)."""
        try:
            return await self.call(identity, request, timeout_s=timeout_s)
        except WorkerRestarting:
            return None

    async def call_each(
        self, identities: Sequence[str], requests: Sequence[Request], *, timeout_s: float
    ) -> list[Result]:
        """Send ``requests[i]`` to ``identities[i]`` concurrently; results in the same order."""
        results: list[Any] = [None] * len(identities)

        async def one(i: int) -> None:
            results[i] = await self.call(identities[i], requests[i], timeout_s=timeout_s)

        async with anyio.create_task_group() as tg:
            for i in range(len(identities)):
                tg.start_soon(one, i)
        return results

    async def shutdown_all(self) -> None:
        """Ask every connected worker to exit (best effort, never raises)."""
        for identity, peer in list(self.peers.items()):
            if peer.error is None:
                try:
                    with anyio.move_on_after(1):
                        await self._send(identity, Shutdown())
                except Exception as exc:  # the socket may already be gone
                    log.debug("shutdown_send_failed", worker=identity, error=str(exc))
