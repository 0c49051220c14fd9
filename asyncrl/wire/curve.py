"""ZeroMQ CURVE for the run's TCP sockets: its keys, and the guard that checks every peer.

Within a host asyncrl talks over ``ipc://`` in a 0700 directory: the file system keeps other
users out. Across hosts it talks over ``tcp://``, and there every socket is CURVE (the
connection encrypted and both ends authenticated), with keys made for the run:

* the **server key pair**: every bound socket (the controller's control and data sockets,
  trainer rank 0's weights socket) proves it with its secret key; a peer that does not
  know its public key cannot finish a handshake;
* the **client key pair**: every connecting socket presents it, and a bound socket accepts
  only that public key (ZAP, below). A process without the run's keys can neither connect
  nor inject a frame: its handshake fails before any frame is read.

:class:`RunKeys` holds them as Z85 text; they travel in a JSON file of mode 0600 (made with
``os.open(..., 0o600)``, by ``python -m asyncrl.wire.curve FILE``; one of looser mode is
refused) named by ``cluster.keys_file``, or are made for the run and handed to the workers'
processes in :data:`KEYS_ENV` (``asyncrl.launch``: through torchrun's store; see
docs/multi-node.md for what each trusts).

:class:`Guard` is one thread per :class:`zmq.Context` with bound TCP sockets. It answers the
context's ZAP requests (RFC 27: ``inproc://zeromq.zap.01``), accepting the run's client key
and refusing any other with a log line that names the peer's address, and it watches each
bound socket's monitor for handshakes that failed before ZAP (a wrong server key, random
bytes, another protocol), logged with the socket. Why not pyzmq's ``ThreadAuthenticator``:
its key callback is not given the peer's address, and a second thread would still be needed
for the monitors. Every refusal is counted (:meth:`Guard.refusals`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = structlog.get_logger("asyncrl.wire.curve")

__all__ = ["Guard", "KeysError", "Refusal", "RunKeys"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"asyncrl"
_FAILED_HANDSHAKE = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
KEYS_ENV = "ASYNCRL_RUN_KEYS"
"""The environment variable that hands a worker process the run's keys (JSON): set only for
the workers' own processes (never the controller's, whose children include agents), and
taken out of the environment by the worker that reads it."""
RECENT = 100
"""Refusals kept for :meth:`Guard.refusals` (all are counted and logged)."""
_KEY_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


class KeysError(ValueError):
    """The run's keys are missing, malformed, or readable by others."""


def check_private(path: str, st: os.stat_result, what: str) -> None:
    """A file that holds the run's keys (``st``: its stat; ``what``: how to name it) must be
    this user's, with no group or other permission bit.

    Raises:
        KeysError: it is not, with the ``chmod`` that mends it."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 or st.st_uid != os.getuid():
        raise KeysError(f"{path}: {what} must be this user's with mode 0600, not {mode:o}. "
                        f"Fix: chmod 600 {path}")


@dataclass(frozen=True, repr=False)
class RunKeys:
    """The run's two CURVE key pairs, Z85 (40 characters each). Never logged: its ``repr``
    shows :attr:`fingerprint` alone (a dataclass holding it, say ``Addresses``, can be
    printed)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> RunKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def __repr__(self) -> str:
        return f"RunKeys(fingerprint={self.fingerprint!r})"

    @property
    def fingerprint(self) -> str:
        """A short name for the key set (of its public keys), for logs."""
        digest = hashlib.sha256(self.server_public + self.client_public).hexdigest()
        return digest[:12]

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k).decode("ascii") for k in _KEY_FIELDS})

    @classmethod
    def from_json(cls, text: str, source: str) -> RunKeys:
        """Raises:
        KeysError: not the four Z85 keys (``source`` names where they came from)."""
        try:
            data = json.loads(text)
            keys = [str(data[k]).encode("ascii") for k in _KEY_FIELDS]
        except (ValueError, KeyError, TypeError, UnicodeEncodeError) as exc:
            raise KeysError(f"{source}: not an asyncrl key file ({type(exc).__name__}: {exc}). "
                            "Fix: write it with `python -m asyncrl.wire.curve FILE`") from None  # fmt: skip
        for name, key in zip(_KEY_FIELDS, keys):
            if len(key) != 40:
                raise KeysError(f"{source}: {name} is {len(key)} characters, not a 40-character "
                                "Z85 CURVE key. Fix: write the file again with "
                                "`python -m asyncrl.wire.curve FILE`")  # fmt: skip
        if zmq.curve_public(keys[1]) != keys[0] or zmq.curve_public(keys[3]) != keys[2]:
            raise KeysError(f"{source}: a public key does not belong to its secret key. Fix: "
                            "write the file again with `python -m asyncrl.wire.curve FILE`")  # fmt: skip
        return cls(*keys)

    @classmethod
    def from_env(cls) -> RunKeys | None:
        """The keys in :data:`KEYS_ENV`, removed from the environment (the engine's own
        subprocesses do not inherit them); ``None`` when it is not set.

        Raises:
            KeysError: it is set but malformed."""
        text = os.environ.pop(KEYS_ENV, None)
        return None if text is None else cls.from_json(text, f"${KEYS_ENV}")

    def write(self, path: str) -> None:
        """Write a new file of mode 0600 (refuses to overwrite one)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def read(cls, path: str) -> RunKeys:
        """Raises:
        KeysError: missing, readable by others, or malformed."""
        try:
            st = os.stat(path)
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise KeysError(f"{path}: cannot read the run's keys ({exc.strerror}). Fix: give "
                            "the path of a key file this user can read (written with "
                            "`python -m asyncrl.wire.curve FILE`)") from None  # fmt: skip
        check_private(path, st, "the run's keys")
        return cls.from_json(text, path)

    def server_options(self) -> dict[int, Any]:
        return {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: self.server_secret,
                zmq.ZAP_DOMAIN: ZAP_DOMAIN}  # fmt: skip

    def client_options(self) -> dict[int, Any]:
        return {zmq.CURVE_SERVERKEY: self.server_public, zmq.CURVE_PUBLICKEY: self.client_public,
                zmq.CURVE_SECRETKEY: self.client_secret}  # fmt: skip


@dataclass(frozen=True)
class Refusal:
    """A peer a bound socket turned away: where (``socket``: its endpoint, or ``zap``), who
    (``peer``: an address when known) and why."""

    socket: str
    peer: str
    reason: str


class Guard:
    """The ZAP handler and handshake watcher of one :class:`zmq.Context` (see the module).

    Start it before the context's first CURVE bind; :meth:`close` before the context's
    ``term``. Thread-safe: :meth:`watch` from the sockets' thread, :meth:`refusals` from any.
    """

    def __init__(self, ctx: zmq.Context, keys: RunKeys) -> None:
        self._ctx, self._keys = ctx, keys
        self._control = f"inproc://asyncrl-guard-{id(self):x}"
        self._lock = threading.Lock()
        self._recent: deque[Refusal] = deque(maxlen=RECENT)
        self._total = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncrl-curve-guard", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        self._tell = ctx.socket(zmq.PAIR)
        self._tell.connect(self._control)
        self._watched = 0

    def watch(self, sock: zmq.Socket, name: str) -> None:
        """Log ``sock``'s failed handshakes (``name``: its endpoint)."""
        self._watched += 1
        address = f"{self._control}-monitor-{self._watched}"
        sock.monitor(address, _FAILED_HANDSHAKE)
        self._tell.send_multipart([b"watch", address.encode(), name.encode()])

    def refusals(self) -> tuple[int, list[Refusal]]:
        """How many peers were refused, and the last :data:`RECENT` of them."""
        with self._lock:
            return self._total, list(self._recent)

    def close(self) -> None:
        """Stop the thread (its sockets closed). Idempotent."""
        if self._thread.is_alive():
            self._tell.send_multipart([b"stop"])
            self._thread.join()
        self._tell.close(linger=0)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        zap = self._ctx.socket(zmq.ROUTER)
        control = self._ctx.socket(zmq.PAIR)
        monitors: dict[zmq.Socket, str] = {}
        try:
            zap.bind(ZAP_ENDPOINT)
            control.bind(self._control)
        except zmq.ZMQError as exc:
            self._error = RuntimeError(f"the CURVE guard could not start: {exc}")
            zap.close(linger=0)
            control.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is zap:
                        self._answer(zap)
                    elif sock is control:
                        frames = control.recv_multipart()
                        if frames[0] == b"stop":
                            return
                        monitor = self._ctx.socket(zmq.PAIR)
                        monitor.connect(frames[1].decode())
                        monitors[monitor] = frames[2].decode()
                        poller.register(monitor, zmq.POLLIN)
                    else:
                        self._failed_handshake(sock, monitors[sock])
        finally:
            for sock in (zap, control, *monitors):
                sock.close(linger=0)

    def _answer(self, zap: zmq.Socket) -> None:
        """One ZAP request (RFC 27): 200 for the run's client key, 400 for anything else."""
        frames = zap.recv_multipart()
        envelope, delimiter = frames[:1], frames[1]
        version, request_id, _domain, address, _identity, mechanism, *credentials = frames[2:]
        ok = mechanism == b"CURVE" and credentials == [z85.decode(self._keys.client_public)]
        if not ok:
            reason = (f"mechanism {mechanism.decode(errors='replace')} (not CURVE)"
                      if mechanism != b"CURVE" else "its client key is not this run's")  # fmt: skip
            self._refuse("zap", address.decode(errors="replace"), reason)
        status = [b"200", b"OK"] if ok else [b"400", b"not this run's key"]
        zap.send_multipart([*envelope, delimiter, version, request_id, *status, b"", b""])

    def _failed_handshake(self, monitor: zmq.Socket, name: str) -> None:
        event = parse_monitor_message(monitor.recv_multipart())
        if not event["event"] & _FAILED_HANDSHAKE:
            return  # the monitor's own end (its socket closed)
        kind = {
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE handshake with this run's "
            "server key (a wrong key, random bytes, or another protocol)",
            zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by ZAP",
        }.get(event["event"], f"event {event['event']}")
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # counted once, by _answer, with the peer's address
        self._refuse(name, "", f"{kind} (code {event['value']:#x})")

    def _refuse(self, socket: str, peer: str, reason: str) -> None:
        with self._lock:
            self._recent.append(Refusal(socket, peer, reason))
            self._total += 1
            total = self._total
        log.warning("peer_refused", socket=socket, peer=peer or "(unknown)", reason=reason,
                    run_keys=self._keys.fingerprint, total=total)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncrl.wire.curve FILE``: write a new key file (mode 0600) for
    ``cluster.keys_file``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m asyncrl.wire.curve",
                                     description=main.__doc__)  # fmt: skip
    parser.add_argument("file", help="the key file to create (refused if it exists)")
    args = parser.parse_args(argv)
    try:
        keys = RunKeys.generate()
        keys.write(args.file)
    except FileExistsError:
        print(f"error: {args.file} exists (a run's keys are never overwritten); remove it "
              "first", file=sys.stderr)  # fmt: skip
        return 2
    print(f"wrote {args.file} (mode 0600), keys {keys.fingerprint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
