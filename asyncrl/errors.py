"""The asyncrl error tree.

Catch at the level you can handle::

    AsyncRLError
    ├── ConfigError                 bad or inconsistent configuration (raised before any spawn)
    │   └── RunDirectoryInUseError  a live run holds run.output_dir, checkpoint.dir or export.dir
    ├── PluginError                 an entry point is missing, duplicated or fails to load
    ├── ProtocolError               a peer spoke a different protocol version or sent garbage
    ├── RemoteCallError             one RPC failed on a worker; the worker is still alive
    ├── RequestError                (backend side) a request that its own data makes unservable
    ├── WorkerError                 a worker group can no longer serve (fatal for the run)
    │   ├── WorkerStartupError      a worker died or timed out before it was ready
    │   ├── WorkerDiedError         a worker process exited while the run was going
    │   │   ├── WorkerHungError     it answered no health probe, alive, and was killed
    │   │   └── WorkerOrphanedError its owner (a supervisor) died first; it only followed
    │   ├── EngineDeadError         (worker side) the backend's engine processes died
    │   └── ControllerLostError     (worker side) the controller exited, or fell silent
    ├── RefitError                  a weight transfer did not complete
    ├── NoSpaceError                a file system the run writes to is full (ENOSPC)
    └── RunError                    the run cannot go on (e.g. rollouts exhausted mid-step)
        └── NonFiniteError          a reward, loss, gradient or weight that is not finite

``RemoteCallError`` is the recoverable kind ("a call failed"), ``WorkerError`` the fatal kind
("a worker died"), as vLLM separates ``EngineGenerateError`` from ``EngineDeadError``.
"""

from __future__ import annotations

import signal
import time

__all__ = [
    "AsyncRLError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ControllerLostError",
    "EngineDeadError",
    "NoSpaceError",
    "NonFiniteError",
    "PluginError",
    "ProtocolError",
    "RefitError",
    "RemoteCallError",
    "RequestError",
    "RunDirectoryInUseError",
    "RunError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerHungError",
    "WorkerLostError",
    "WorkerOrphanedError",
    "WorkerRestarting",
    "WorkerStartupError",
    "config_error",
    "flatten",
]


class AsyncRLError(Exception):
    """Base class of every error raised by asyncrl."""


class ConfigError(AsyncRLError):
    """The configuration is invalid. The message names the field and the fix."""


class RunDirectoryInUseError(ConfigError):
    """Another live run holds the run's ``run.output_dir``, ``checkpoint.dir`` or ``export.dir``
    (one writer per directory: :mod:`asyncrl.run.runlock`). The message names its pid, host and
    start time, and the fix; raised before anything of this run is started or written."""


class PluginError(AsyncRLError):
    """A plugin entry point is missing, ambiguous or failed to import, or the backend it made
    does not implement its protocol (:func:`asyncrl.registry.check_plugin`)."""


class ProtocolError(AsyncRLError):
    """A peer sent a message this side cannot accept (version mismatch, bad frame)."""


class RemoteCallError(AsyncRLError):
    """An RPC raised on the worker. The worker stays up; the call may be retried.

    Attributes:
        worker: ``group:rank`` of the worker that raised.
        method: the request kind that failed.
        remote_type: the exception class name on the worker.
        remote_traceback: the formatted traceback text from the worker.
    """

    def __init__(
        self, worker: str, method: str, remote_type: str, message: str, remote_traceback: str
    ) -> None:
        super().__init__(
            f"{method} failed on worker {worker}: {remote_type}: {message}\n"
            f"--- remote traceback ---\n{remote_traceback}"
        )
        self.worker = worker
        self.method = method
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback


class RequestError(AsyncRLError):
    """Raised by a generation backend for a request that cannot be served because of its own
    data (a prompt longer than the engine's context, a token id outside the vocabulary):
    retrying it would fail the same way, so the controller drops its group at once (counted
    against ``failures.max_failed_groups``) instead of retrying it. Any other exception from
    ``generate`` is taken for an engine or infrastructure failure and retried."""


class WorkerError(AsyncRLError):
    """A worker group can no longer serve; the run must stop."""


class WorkerStartupError(WorkerError):
    """A worker failed, died or timed out before the handshake completed."""


class WorkerDiedError(WorkerError):
    """A worker process exited while the run was going.

    Attributes:
        group: the worker group (``trainer`` or ``rollout``).
        rank: the rank within the group, or ``None`` when it could not be attributed.
        exit_code: the exit status (negative: killed by that signal), ``None`` if unknown.
        log_path: the file holding that worker's output.

    Args (besides the attributes):
        detail: further lines of the message (what else is known: a spent restart budget).
        message: the first line, instead of "worker ... died with exit code ...; its log:
            ..." (a subclass that knows more about the death).
    """

    def __init__(
        self,
        group: str,
        rank: int | None,
        exit_code: int | None,
        log_path: str | None,
        detail: str = "",
        *,
        message: str | None = None,
    ) -> None:
        if message is None:
            who = f"{group}:{rank}" if rank is not None else f"{group} (rank unknown)"
            code = "unknown" if exit_code is None else str(exit_code)
            message = f"worker {who} died with exit code {code}; its log: {log_path or 'n/a'}"
        super().__init__(message + (f"\n{detail}" if detail else ""))
        self.group = group
        self.rank = rank
        self.exit_code = exit_code
        self.log_path = log_path

    def add_detail(self, line: str) -> None:
        """Append ``line`` to the message: something learnt about the death after it was
        raised (the restart budget it spent)."""
        self.args = (f"{self.args[0]}\n{line}", *self.args[1:])


def _last_answer(at: float | None) -> str:
    """When a silent worker last answered a health probe, for its error's message."""
    if at is None:
        return "it never answered one since it was ready"
    return f"its last answer came at {time.strftime('%H:%M:%S', time.localtime(at))}"


class WorkerHungError(WorkerDiedError):
    """A worker answered no health probe for ``failures.heartbeat_timeout_s`` while its
    process lived (stopped, deadlocked, its event loop blocked), so the controller killed it
    (SIGKILL) and handled it as a death: a rollout worker is restarted under
    ``failures.rollout_restarts``, a trainer stops the run (docs/failures.md, "Hung
    workers"). The message names the worker, its pid, how long it was silent, when it last
    answered and its log file.

    Attributes (besides :class:`WorkerDiedError`'s):
        pid: the process that was killed.
        silent_s: seconds from its last answer (from when it was first probed, if it never
            answered) to the kill.
        last_answer: when it last answered (seconds since the epoch; ``None``: never).
        timeout_s: the ``failures.heartbeat_timeout_s`` it outlasted.
    """

    def __init__(
        self,
        group: str,
        rank: int,
        log_path: str | None,
        *,
        pid: int,
        silent_s: float,
        last_answer: float | None,
        timeout_s: float,
        exit_code: int | None = -9,
        detail: str = "",
    ) -> None:
        last = _last_answer(last_answer)
        text = (
            f"worker {group}:{rank} hung: it answered no health probe for {silent_s:.1f} s "
            f"(failures.heartbeat_timeout_s = {timeout_s:g} s) and {last}; its process (pid "
            f"{pid}) lived on (stopped, deadlocked or its event loop blocked), so it was "
            f"killed (SIGKILL); its log: {log_path or 'n/a'}"
        )
        # not WorkerDiedError's "died with exit code -9": the kill is ours, the hang the cause
        super().__init__(group, rank, exit_code, log_path, detail, message=text)
        self.pid = pid
        self.silent_s = silent_s
        self.last_answer = last_answer
        self.timeout_s = timeout_s


class WorkerLostError(WorkerDiedError):
    """A worker on another host (``cluster.network = "tcp"``) answered no health probe for
    ``failures.heartbeat_timeout_s``: its node went away or was cut off, or the worker hangs.
    Its process is on that host, so it is not killed from here; the run handles it as a death
    (docs/multi-node.md).

    Attributes (besides :class:`WorkerDiedError`'s): ``host`` (the worker's host name),
    ``pid`` (its process id there), ``silent_s``, ``last_answer``, ``timeout_s`` (as
    :class:`WorkerHungError`'s).
    """

    def __init__(
        self,
        group: str,
        rank: int,
        log_path: str | None,
        *,
        host: str,
        pid: int,
        silent_s: float,
        last_answer: float | None,
        timeout_s: float,
    ) -> None:
        last = _last_answer(last_answer)
        text = (
            f"worker {group}:{rank} on host {host!r} (pid {pid} there) is lost: it answered no "
            f"health probe for {silent_s:.1f} s (failures.heartbeat_timeout_s = {timeout_s:g} "
            f"s) and {last}; its node went away or was cut off from this one, or the worker "
            f"hangs (not killed from here: it is on another host); its log, on {host!r}: "
            f"{log_path or 'n/a'}"
        )
        super().__init__(group, rank, None, log_path, "", message=text)
        self.host, self.pid = host, pid
        self.silent_s, self.last_answer, self.timeout_s = silent_s, last_answer, timeout_s


class WorkerOrphanedError(WorkerDiedError):
    """A worker whose owner died first: its supervisor (a rollout rank,
    :mod:`asyncrl.procs.supervisor`) or the torchrun agent that started it. Every worker
    stops when its owner does (its owner watch, :func:`asyncrl.procs.process.die_with_parent`,
    sends it SIGTERM: exit code 143), so its exit code says "stopped", not why: the owner's
    death is the cause, and the message names it first. Nothing is left to start it again.

    Attributes (besides :class:`WorkerDiedError`'s):
        owner: what owned it (``supervisor``, ``torchrun agent``).
        owner_pid: the owner's pid.
        owner_status: the owner's exit status (``-N``: killed by signal N; ``None``: unknown).
    """

    def __init__(
        self,
        group: str,
        rank: int,
        exit_code: int | None,
        log_path: str | None,
        *,
        owner: str,
        owner_pid: int,
        owner_status: int | None,
    ) -> None:
        code = "unknown" if exit_code is None else str(exit_code)
        text = (
            f"worker {group}:{rank}'s {owner} (pid {owner_pid}) {_how_it_ended(owner_status)}; "
            f"the worker then ended on its owner watch (exit code {code}); its log: "
            f"{log_path or 'n/a'}"
        )
        super().__init__(group, rank, exit_code, log_path, message=text)
        self.owner, self.owner_pid, self.owner_status = owner, owner_pid, owner_status


def _how_it_ended(status: int | None) -> str:
    """A process's exit status in words: ``was killed (SIGKILL)``, ``exited with code 1``."""
    if status is None:
        return "exited (its exit status is unknown)"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed ({name})"
    return f"exited with code {status}"


class WorkerRestarting(WorkerError):
    """A call to a rollout worker that died and is being started again
    (``failures.rollout_restarts``): the call is abandoned, its work goes elsewhere."""


class EngineDeadError(WorkerError):
    """Raised by a backend's ``watch()`` when its engine can no longer serve (one of the engine's
    processes exited). The worker reports it as ``Dead`` and exits."""


class CollectiveTimeoutError(WorkerError):
    """A trainer rank's torch collective waited longer than ``failures.collective_timeout_s``
    (another rank stuck or gone, or the ranks' calls out of step). The process group cannot
    be used again: the rank reports it as ``Dead`` and exits, and the run stops naming it."""


class ControllerLostError(WorkerError):
    """A worker noticed that its controller is gone: its process exited, or it sent nothing
    for its probe interval + ``failures.heartbeat_timeout_s`` (stopped, its event loop
    blocked, its host gone or cut off; :mod:`asyncrl.worker.controller_watch`). The worker
    stops its engine, removes the run's socket and shared-memory directories the controller
    can no longer remove, and exits.

    Attributes:
        silent_s: how long the controller was silent, when its silence (not its exit) is
            why (``None``: its process exited).
    """

    def __init__(self, message: str, *, silent_s: float | None = None) -> None:
        super().__init__(message)
        self.silent_s = silent_s


class RefitError(AsyncRLError):
    """A weight transfer to the generators did not complete."""


class NoSpaceError(AsyncRLError):
    """A write found its file system full (ENOSPC): shared memory (``/dev/shm``), the
    checkpoint directory, the output directory. The message names the path, the bytes free
    and the bytes needed, and the fix; nothing was left half-written. A worker raises it too
    (the controller reports it as its own, naming the worker).

    Attributes:
        path: the file or directory that could not be written.
        free_bytes: bytes free on its file system when the write failed (``None``: unknown).
        needed_bytes: bytes the write needed (an estimate where the writer could not say).
    """

    def __init__(
        self, message: str, *, path: str = "", free_bytes: int | None = None,
        needed_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.free_bytes = free_bytes
        self.needed_bytes = needed_bytes


class RunError(AsyncRLError):
    """The run cannot continue for a reason that is not a worker failure."""


class NonFiniteError(RunError):
    """A value that must be finite is not, or would overflow: a reward too large for the
    advantage math, a step's loss or gradient norm, the weights loaded from a checkpoint or
    about to be saved. Raised before the value is committed (no optimizer step, checkpoint,
    export or refit is made from it); the message names the likely cause and the fix. A
    trainer raises it too (the controller then sees a ``RemoteCallError`` whose
    ``remote_type`` is ``"NonFiniteError"``)."""


def config_error(field: str, problem: str, fix: str) -> ConfigError:
    """``<field>: <problem>. Fix: <fix>.``: the shape of every config error."""
    return ConfigError(f"{field}: {problem}. Fix: {fix}.")


def flatten(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, nested exception groups flattened (``[exc]`` for a
    plain exception), in order."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in flatten(sub)]
    return [exc]
