"""ZeroMQ under anyio. With :mod:`asyncrl.wire.curve` (the run's keys), the only modules of
asyncrl that import ``zmq``.

pyzmq's own asyncio sockets work on asyncio only, so this is a small adapter over plain
non-blocking sockets: a task that would block waits with :func:`anyio.wait_readable` on the
socket's file descriptor. That descriptor is edge-triggered and shared by reads and writes, so:

* only one task at a time waits on it; others wait on an event that every wake-up sets;
* after every send or receive the state may have changed without a new edge, so each operation
  wakes the waiters, which re-check ``EVENTS`` before sleeping again.

Each socket is meant to have exactly one reading task; sends are serialized by a lock.
Every socket gets a finite high-water mark and ``LINGER=0`` (the process must never hang on
exit waiting to flush), except where a caller asks for a bounded linger.
"""

from __future__ import annotations

import errno
import getpass
import os
import socket
import stat
import string
from collections.abc import Sequence
from typing import Any

import anyio
import structlog
import zmq

from asyncrl.wire.curve import Guard, RunKeys

log = structlog.get_logger("asyncrl.wire.transport")

__all__ = [
    "AsyncSocket",
    "Context",
    "PeerGone",
    "Rejections",
    "ipc_address",
    "make_private_dir",
    "peer_name",
    "run_dir_of",
    "tcp_address",
]

ROUTER, DEALER, PUSH, PULL = zmq.ROUTER, zmq.DEALER, zmq.PUSH, zmq.PULL
RUNS_BASE_DIR = "/tmp"


def make_private_dir(path: str) -> str:
    """Create ``path`` (and parents) with mode 0700 and check nobody else can enter it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be owned by this user with mode 0700")
    return path


def run_dir_of(run_id: str) -> str:
    """The run's private directory on this host (its ipc sockets, the controller's pid):
    ``/tmp/asyncrl-<user>/<run_id>``."""
    return os.path.join(RUNS_BASE_DIR, f"asyncrl-{getpass.getuser()}", run_id)


def tcp_address(host: str) -> str:
    """A ``tcp://`` endpoint on ``host`` with a port the bind picks (read it back from
    :attr:`AsyncSocket.last_endpoint`)."""
    return f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"


def toward(endpoint: str) -> str:
    """For a ``tcp://HOST:PORT`` endpoint (the port may be ``*``), a ``tcp://`` endpoint with
    a port the bind picks where a socket here can be reached by the peers that reach HOST:
    HOST itself when it is an address of this host (the controller's node), else this host's
    address on its route to HOST. No packet is sent (a UDP socket's connect only picks the
    route)."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
            return tcp_address(host)
        except OSError:  # not ours: another node's
            probe.connect((host, 9))
            return tcp_address(probe.getsockname()[0])


def ipc_address(run_dir: str, name: str) -> str:
    """An ``ipc://`` endpoint inside the run's private directory."""
    path = os.path.join(run_dir, f"{name}.sock")
    if len(path) > 100:  # sun_path is 108 bytes on Linux
        raise ValueError(f"ipc socket path too long ({len(path)} chars): {path}")
    return f"ipc://{path}"


_PRINTABLE = frozenset(string.ascii_letters + string.digits + ":-_.@/")


def peer_name(identity: bytes | memoryview | str | None) -> str:
    """A peer's ZeroMQ identity as log-safe text: itself when it is a plain name
    (``rollout:0``), else ``hex:<bytes>`` (ZeroMQ gives anonymous peers binary identities)."""
    if identity is None:
        return "?"
    raw = identity.encode() if isinstance(identity, str) else bytes(identity)
    text = raw.decode("ascii", errors="replace")
    if raw and all(c in _PRINTABLE for c in text):
        return text
    return "hex:" + raw[:32].hex()


class Rejections:
    """Counts frames a socket refused (undecodable, or from a peer that has no business
    sending them), per socket, and logs each with a printable reason. A rejected frame never
    ends the run. ``guard``: the :class:`Guard` of the same sockets, which refuses peers
    without the run's keys before they send a frame (:attr:`refused_peers`)."""

    def __init__(self, guard: Guard | None = None) -> None:
        self.counts: dict[str, int] = {}
        self._guard = guard

    @property
    def refused_peers(self) -> int:
        """Connections refused at the handshake (no run keys): nothing of theirs was read."""
        return 0 if self._guard is None else self._guard.refusals()[0]

    def reject(self, sock: str, peer: str, reason: str) -> None:
        self.counts[sock] = self.counts.get(sock, 0) + 1
        log.warning("frame_rejected", socket=sock, peer=peer, reason=reason[:300],
                    total=self.counts[sock])

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class AsyncSocket:
    """A ZeroMQ socket usable from anyio tasks.

    Cancellation: a cancelled :meth:`recv` or :meth:`send` leaves the socket consistent
    (ZeroMQ sends and receives whole multipart messages atomically).
    """

    def __init__(self, sock: zmq.Socket, copy: bool = False) -> None:
        self._sock = sock
        self._copy = copy
        self._fd = sock.getsockopt(zmq.FD)
        self._send_lock = anyio.Lock()
        self._fd_scope: anyio.CancelScope | None = None
        self._changed: anyio.Event | None = None
        self._closed = False

    @property
    def raw(self) -> zmq.Socket:
        return self._sock

    @property
    def last_endpoint(self) -> str:
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _poke(self) -> None:
        """Wake every waiter so it re-reads ``EVENTS`` (free when nobody waits)."""
        if self._fd_scope is not None:
            self._fd_scope.cancel()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait(self, flag: int) -> None:
        while not self._sock.getsockopt(zmq.EVENTS) & flag:
            if self._fd_scope is None:
                with anyio.CancelScope() as scope:
                    self._fd_scope = scope
                    try:
                        await anyio.wait_readable(self._fd)
                    finally:
                        self._fd_scope = None
                        # also when cancelled from outside: a task parked on _changed must
                        # take over the fd wait
                        self._poke()
            else:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()

    async def recv(self) -> list[Any]:
        """Receive one multipart message: zero-copy frames, or ``bytes`` for a socket made
        with ``copy=True``."""
        while (frames := self.recv_nowait()) is None:
            await self._wait(zmq.POLLIN)
        return frames

    def recv_nowait(self) -> list[Any] | None:
        """One multipart message if one is queued now, else ``None`` (never waits)."""
        try:
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=self._copy)
        except zmq.Again:
            return None
        self._poke()
        return frames

    async def send(self, frames: Sequence[Any]) -> None:
        """Send one multipart message; waits (without blocking the loop) at the HWM. Queued at
        once, it returns without giving the loop back (no checkpoint).

        Raises:
            PeerGone: a ROUTER made with ``router_mandatory`` has no connected peer named by
                the first frame (its socket closed: its process exited or is exiting).
        """
        if not self._send_lock.locked():
            # the common case: nobody waits at the HWM, so nothing to queue behind; the lock
            # (a pass of the loop each time) would double what a small message costs
            try:
                self._send_now(frames)
                return
            except zmq.Again:
                pass
        async with self._send_lock:
            while True:
                try:
                    self._send_now(frames)
                except zmq.Again:
                    await self._wait(zmq.POLLOUT)
                    continue
                return

    def send_nowait(self, frames: Sequence[Any]) -> None:
        """Send without waiting; raises ``zmq.Again`` at the high-water mark, and
        :class:`PeerGone` as :meth:`send` does."""
        self._send_now(frames)

    def _send_now(self, frames: Sequence[Any]) -> None:
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            raise PeerGone(f"peer {peer_name(bytes(frames[0]))!r} is not connected") from None
        self._poke()

    def close(self, linger_ms: int = 0) -> None:
        """Close now (pending messages are dropped unless ``linger_ms`` > 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            anyio.notify_closing(self._fd)
        except RuntimeError:  # no event loop (closing from sync teardown)
            pass
        self._sock.close(linger=linger_ms)


class Context:
    """Owns one ``zmq.Context`` (never the process-global instance) and its sockets.

    ``keys``: the run's CURVE keys (:mod:`asyncrl.wire.curve`). Every socket of the context
    is CURVE with them, ``ipc://`` as well as ``tcp://`` (a bound one checks its peers through
    a :class:`Guard`): the run's 0700 directory keeps other users out of its ipc sockets, and
    the keys keep out this user's other processes (another run, a leftover worker, an agent's
    code). Without keys a ``tcp://`` address is refused and ``ipc://`` sockets are plain (a
    test's two ends in one process)."""

    def __init__(self, keys: RunKeys | None = None) -> None:
        self._ctx = zmq.Context()
        self._sockets: list[AsyncSocket] = []
        self._keys = keys
        self._guard: Guard | None = None

    @property
    def guard(self) -> Guard | None:
        """The guard of the bound sockets (``None`` before the first, and without keys)."""
        return self._guard

    def socket(
        self,
        kind: int,
        *,
        bind: str | None = None,
        connect: str | None = None,
        identity: str | None = None,
        hwm: int = 1000,
        router_mandatory: bool = False,
        copy: bool = False,
    ) -> AsyncSocket:
        """Create a socket of ``kind`` (``ROUTER``, ``DEALER``, ``PUSH``, ``PULL``).

        ``copy=True``: receives return ``bytes`` rather than zero-copy ``zmq.Frame``s. For many
        small messages (samples): a frame costs more to make than a small copy, and every
        array decoded from it keeps a frame, a memoryview and a buffer alive, objects the
        garbage collector then scans (1-2 ms per young collection at 10,000 samples/s)."""
        tcp = [a for a in (bind, connect) if a is not None and a.startswith("tcp://")]
        if tcp and self._keys is None:
            raise ValueError(f"{tcp[0]}: a tcp:// socket needs the run's CURVE keys "
                             "(Context(keys=...)): asyncrl puts nothing on a network without "
                             "a key")  # fmt: skip
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        if router_mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == ROUTER:
            # a restarted worker connects again under its identity: the new connection takes
            # it over, even if the dead one's has not been noticed yet
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            if bind is not None:
                self._secure(sock, bind, server=True)
                sock.bind(bind)
                if self._guard is not None:
                    self._guard.watch(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT))
            if connect is not None:
                self._secure(sock, connect, server=False)
                sock.connect(connect)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        wrapped = AsyncSocket(sock, copy=copy)
        self._sockets.append(wrapped)
        return wrapped

    def _secure(self, sock: zmq.Socket, address: str, *, server: bool) -> None:
        """CURVE options for a socket of a context with keys (the guard started before its
        first bind)."""
        if self._keys is None:
            return
        if server and self._guard is None:
            self._guard = Guard(self._ctx, self._keys)
        options = self._keys.server_options() if server else self._keys.client_options()
        for option, value in options.items():
            sock.setsockopt(option, value)

    def close(self) -> None:
        """Close every socket (linger 0), stop the guard and terminate the context.
        Idempotent."""
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        if self._guard is not None:
            self._guard.close()
        self._ctx.term()


Again = zmq.Again


class PeerGone(Exception):
    """A ROUTER (``router_mandatory``) sent to a peer that is not connected: its socket is
    closed, so its process exited or is exiting."""
