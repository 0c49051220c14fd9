"""Collective-group plumbing of the ``nccl`` weight transfer (:mod:`asyncrl_torch.transfers.nccl`):
timeouts, the advertised store host, a standalone process group (NCCL or gloo, built without
``init_process_group``), bounded broadcasts and the sender's broadcast thread. Imports torch
only when a group is made."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from asyncrl.plugin.transfer import IDENTITY_ENV_VAR

HOST_ENV_VAR = "ASYNCRL_NCCL_HOST"
"""The address readers reach the sender's store at (default: this host name's address)."""
TIMEOUT_ENV_VAR = "ASYNCRL_NCCL_TIMEOUT_S"
"""Overrides :data:`TIMEOUT_S`."""
TIMEOUT_S = 300.0
"""Bound on every wait: store, group creation, each broadcast, each buffer reuse."""
CLOSE_GRACE_S = 10.0
"""How long :meth:`NcclStager.close` waits for the sender thread before abandoning it."""

_ROOT = 0
_PREFIX = "asyncrl-weights"


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV_VAR)
    if not raw:
        return TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV_VAR}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV_VAR}={raw!r} must be positive")
    return value


def _advertised_host() -> str:
    host = os.environ.get(HOST_ENV_VAR)
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def fan_out(
    receivers: Sequence[str], hosts: Sequence[str], own_host: str
) -> tuple[list[str], dict[str, list[str]]]:
    """How a gloo broadcast reaches ``receivers`` (on ``hosts``, same order; ``""``: not
    known) from a sender on ``own_host``: once per other host, then within that host.

    Returns ``(cross, fans)``: ``cross`` are the members of the sender's group after it (ranks
    1, 2, …): every receiver on the sender's host or on an unknown one, and the first receiver
    (the leader) of each other host; ``fans`` maps each leader of a host with several
    receivers to the others there, in order (its local group's ranks 1, 2, …), which receive
    the bucket from it. A host with one receiver has no fan. Pure."""
    by_host: dict[str, list[str]] = {}
    cross: list[str] = []
    for receiver, host in zip(receivers, hosts, strict=True):
        if host and host != own_host:
            by_host.setdefault(host, []).append(receiver)
        else:
            cross.append(receiver)
    fans: dict[str, list[str]] = {}
    for leader, *others in by_host.values():
        cross.append(leader)
        if others:
            fans[leader] = others
    return cross, fans


class Place(NamedTuple):
    """Where a reader sits in a group: its rank in the sender's group (``-1``: not in it, it
    gets the buckets from its host's leader), and its host's fan (``leader``: the leader's
    identity, ``local_rank``: 0 for the leader, ``local_size``: 0 without a fan)."""

    rank: int
    leader: str = ""
    local_rank: int = 0
    local_size: int = 0


def place_in(
    identity: str | None, ranks: dict[str, int], fans: dict[str, list[str]], size: int
) -> Place:
    """The place of reader ``identity`` (``IDENTITY_ENV_VAR``) in a group of ``size``
    members with ``ranks`` and ``fans`` (:func:`fan_out`'s, as a handle carries them). Pure.

    Raises:
        RuntimeError: ``identity`` is no receiver of the group, or is needed and missing.
    """
    if not identity:
        if size == 2 and len(ranks) == 1 and not fans:
            return Place(1)
        raise RuntimeError(
            f"the weight broadcast group has {size - 1} receivers; set {IDENTITY_ENV_VAR} to "
            f"this reader's identity (one of {sorted(ranks)})"
        )
    if identity in ranks:
        others = fans.get(identity, [])
        return Place(ranks[identity], identity, 0, 1 + len(others) if others else 0)
    for leader, others in fans.items():
        if identity in others:
            return Place(-1, leader, 1 + others.index(identity), 1 + len(others))
    known = sorted([*ranks, *(o for others in fans.values() for o in others)])
    raise RuntimeError(
        f"{IDENTITY_ENV_VAR}={identity!r} is not a receiver of this weight broadcast group "
        f"({known})"
    )


def _make_group(backend: str, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A standalone process group (a ``torch.distributed`` backend object, used directly)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _broadcast(group: Any, tensor: Any, timeout_s: float) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = _ROOT
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    return group.broadcast([tensor], opts)


def _finish(work: Any, backend: str, timeout_s: float, what: str) -> None:
    """Wait (bounded) until ``work`` is complete on the host.

    Raises:
        RuntimeError: it failed or did not complete within ``timeout_s``.
    """
    try:
        if backend == "gloo":
            work.wait(timedelta(seconds=timeout_s))
            return
        # NCCL: wait() only orders the current stream after the collective; poll its end
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not complete after {timeout_s:.0f} s ({TIMEOUT_ENV_VAR})")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        work.wait()
    except Exception as exc:
        raise RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _run_broadcast(
    group: Any, tensor: Any, backend: str, timeout_s: float, what: str
) -> RuntimeError | None:
    """Broadcast ``tensor`` over ``group`` (bounded); the failure, if any, as an error that
    holds no traceback (its frames would keep ``group`` alive, and gloo closes a group's
    connections only once it is freed: the way its other members' waits end at once)."""
    try:
        work = _broadcast(group, tensor, timeout_s)
        _finish(work, backend, timeout_s, what)
    except Exception as exc:  # noqa: BLE001 - returned, raised by the caller
        return RuntimeError(str(exc))
    return None


def _shutdown(group: Any, graceful: bool) -> None:
    """Tear ``group`` down (its threads and connections); never raises."""
    if group is None:
        return
    try:
        if graceful and hasattr(group, "shutdown"):
            group.shutdown()
        elif hasattr(group, "abort"):
            group.abort()
    except Exception:  # noqa: BLE001, S110 - already broken: dropping it is all that is left
        pass


class _Job:
    """One queued broadcast."""

    def __init__(self, seq: int, tensor: Any, nbytes: int) -> None:
        self.seq = seq
        self.tensor = tensor
        self.nbytes = nbytes
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Broadcaster(threading.Thread):
    """The sender's member of the group: builds it (a rendezvous with every reader), then runs
    queued broadcasts in order, each bounded by the timeout."""

    def __init__(self, backend: str, store: Any, size: int, device: Any, timeout_s: float) -> None:
        super().__init__(name="asyncrl-nccl-sender", daemon=True)
        self._backend = backend
        self._store = store
        self._size = size
        self._device = device
        self._timeout_s = timeout_s
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.group: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self._backend == "nccl":
                import torch

                torch.cuda.set_device(self._device)
            self.group = _make_group(self._backend, self._store, _ROOT, self._size, self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - raised to the trainer by seal/reserve
            self.error = RuntimeError(
                f"the weight broadcast group ({self._size} members, {self._backend}) could not "
                f"be formed: {type(exc).__name__}: {exc}"
            )
        clean = self.error is None
        try:
            while (job := self.jobs.get()) is not None:
                if self.error is None and job.nbytes:
                    failed = _run_broadcast(self.group, job.tensor, self._backend,
                                            self._timeout_s, f"weight broadcast {job.seq}")  # fmt: skip
                    if failed is not None:
                        self.error, clean = failed, False
                        # the readers still waiting for its bytes fail now, not at their
                        # timeout: gloo closes a group's connections only when it is freed
                        group, self.group = self.group, None
                        _shutdown(group, graceful=False)
                        del group
                job.error = self.error
                job.tensor = None
                job.done.set()
        finally:
            group, self.group = self.group, None
            _shutdown(group, graceful=clean)
            self._store = None
