"""The real :class:`asyncrl.run.restarts.Restarts` around real processes: a rollout worker's
death, its restart in place, a death of the new process before its sync task has run, the
sync task's end with the run, and the one error a spent budget raises. The control plane and
the run's loops are small fakes that record what was asked of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from asyncrl.errors import (
    WorkerDiedError,
    WorkerHungError,
    WorkerLostError,
    WorkerOrphanedError,
)
from asyncrl.run.restarts import Restarts
from asyncrl.wire.rpc import Peer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

WORKER = "rollout:0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def killed() -> Iterator[int]:
    """A child process killed with SIGKILL and not reaped (a zombie: its exit code is read
    from /proc, as the controller reads a dead worker's)."""
    proc = subprocess.Popen(["sleep", "60"])
    os.kill(proc.pid, signal.SIGKILL)
    yield proc.pid
    proc.wait()


@pytest.fixture
def reaped() -> int:
    """The pid of a process already gone and reaped: watching it ends at once, without
    yielding to the event loop."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


class _Control:
    """The control plane: forgets the dead worker, then hands out its new processes."""

    def __init__(self, *back: Peer) -> None:
        self.back = list(back)
        self.forgotten: list[str] = []

    def forget(self, identity: str, error: BaseException) -> None:
        self.forgotten.append(identity)

    async def wait_peer(self, identity: str) -> Peer:
        return self.back.pop(0)


class _Loops:
    """The run's loops; a refit waits until ``release`` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refitting = anyio.Event()
        self.release = anyio.Event()

    async def worker_lost(self, worker: str) -> None:
        self.calls.append(("lost", worker))

    async def refit_worker(self, worker: str) -> int:
        self.calls.append(("refit", worker))
        self.refitting.set()
        await self.release.wait()
        return 3

    async def worker_serves(self, worker: str) -> None:
        self.calls.append(("serves", worker))


async def _never(peer: Peer) -> WorkerDiedError:
    """The heartbeat's verdict on a remote worker that never goes silent."""
    await anyio.sleep_forever()
    raise AssertionError


def _restarts(loops: _Loops, rollout_restarts: int, heartbeat_timeout_s: float = 1.0) -> Restarts:
    config = SimpleNamespace(
        cluster=SimpleNamespace(rollout_ranks=1, startup_timeout_s=5.0),
        failures=SimpleNamespace(heartbeat_timeout_s=heartbeat_timeout_s),
        rollout_restarts=rollout_restarts,
    )
    restarts = Restarts(config)  # type: ignore[arg-type]  # what Restarts reads of a Config
    restarts.bind(loops)
    return restarts


def _peer(pid: int) -> Peer:
    return Peer(WORKER, "rollout", 0, 1, pid, "/logs/rollout-0.log")


def _watching(restarts: Restarts, control: _Control, peer: Peer, tg: Any) -> Any:
    """``restarts.watch(...)`` of ``peer`` as a task (deaths named as they are)."""

    async def watch() -> None:
        await restarts.watch(control, peer, None, tg, named=lambda p, d: d, fatal=lambda d: None,
                             lost=_never)

    return watch


async def test_a_new_process_dead_before_its_sync_started_is_a_death_not_a_crash(
    killed: int, reaped: int
) -> None:
    """The restarted worker's new process is gone before its sync task first ran (its pid
    already reaped: watching it returns at once). That death is handled as a death: here the
    budget (one restart) is spent, so the run stops with the worker's WorkerDiedError naming
    the budget, not with an internal error about the pool's states. The sync task still
    waiting in its refit ends when the restarts are closed (the run is over)."""
    loops, deaths = _Loops(), []
    restarts = _restarts(loops, rollout_restarts=1)
    control = _Control(_peer(reaped))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            with pytest.raises(WorkerDiedError) as info:
                await restarts.watch(control, _peer(killed), None, tg,
                                     named=lambda peer, died: died, fatal=deaths.append,
                                     lost=_never)  # fmt: skip
            await loops.refitting.wait()  # the first restart's sync: the run is not over yet
            assert restarts.serving == []
            restarts.close()  # the run is over: the sync task waiting in its refit ends
    err = info.value
    assert type(err) is WorkerDiedError and (err.group, err.rank) == ("rollout", 0)
    assert str(err).endswith(
        "\nrollout workers were restarted 1 times in this run, all that "
        "failures.rollout_restarts allows"
    )
    assert deaths == [err] and control.forgotten == [WORKER]
    assert loops.calls == [("lost", WORKER), ("refit", WORKER)]  # never took work again


async def test_a_restarted_worker_is_refitted_then_serves(killed: int) -> None:
    """One death, one restart: its groups go elsewhere, its new process is refitted, then it
    serves again; its watcher watches the new process meanwhile."""
    loops = _Loops()
    restarts = _restarts(loops, rollout_restarts=1)
    new = subprocess.Popen(["sleep", "60"])
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watching(restarts, _Control(_peer(new.pid)), _peer(killed), tg))
            with anyio.fail_after(10):
                await loops.refitting.wait()
                assert restarts.serving == []
                loops.release.set()
                while restarts.serving != [WORKER]:
                    await anyio.sleep(0.01)
            assert loops.calls == [("lost", WORKER), ("refit", WORKER), ("serves", WORKER)]
            tg.cancel_scope.cancel()
    finally:
        new.kill()
        new.wait()


async def test_a_hang_that_spends_the_budget_is_named_once_and_says_both(
    killed: int, reaped: int
) -> None:
    """The heartbeat's name for a death (a hang) is asked once per death, and the error
    raised is that WorkerHungError with the spent budget added as its last line."""
    loops, asked = _Loops(), []

    def named(peer: Peer, died: WorkerDiedError) -> WorkerDiedError:
        asked.append(peer.pid)
        return WorkerHungError(peer.group, peer.rank, peer.log_path, pid=peer.pid, silent_s=2.0,
                               last_answer=None, timeout_s=1.0, exit_code=died.exit_code)  # fmt: skip

    restarts = _restarts(loops, rollout_restarts=1)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            with pytest.raises(WorkerHungError) as info:
                await restarts.watch(_Control(_peer(reaped)), _peer(killed), None, tg,
                                     named=named, fatal=lambda d: None, lost=_never)  # fmt: skip
            restarts.close()
    text = str(info.value)
    assert asked == [killed, reaped]
    assert text.startswith("worker rollout:0 hung: it answered no health probe for 2.0 s")
    assert "exit code" not in text and text.count("\n") == 1
    assert text.endswith("restarted 1 times in this run, all that failures.rollout_restarts allows")
    assert info.value.pid == reaped and info.value.log_path == "/logs/rollout-0.log"


def _remote(pid: int) -> Peer:
    return Peer(WORKER, "rollout", 0, 1, pid, "/logs/rollout-0.log", host="node1/b/1",
                remote=True)  # fmt: skip


def _lost_after(seconds: float, found: list[Peer]) -> Any:
    """The heartbeat's verdict: every remote process it is asked about is lost after
    ``seconds`` (each asked one recorded in ``found``)."""

    async def lost(peer: Peer) -> WorkerDiedError:
        found.append(peer)
        await anyio.sleep(seconds)
        return WorkerLostError(peer.group, peer.rank, peer.log_path, host="node1", pid=peer.pid,
                               silent_s=seconds, last_answer=None, timeout_s=seconds)  # fmt: skip

    return lost


async def test_a_remote_worker_whose_successor_said_hello_is_restarted() -> None:
    """A worker on another host is gone once its node's new process said Hello (its old
    peer's ``gone``): no pid is watched, its groups go elsewhere, the new process (another
    remote peer) is refitted and serves, and is watched in turn."""
    loops, asked = _Loops(), []
    restarts = _restarts(loops, rollout_restarts=1)
    old, new = _remote(100), _remote(200)
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await restarts.watch(_Control(new), old, None, tg, named=lambda p, d: d,
                                 fatal=lambda d: None, lost=_lost_after(60, asked))  # fmt: skip

        tg.start_soon(watch)
        await anyio.sleep(0.05)
        assert loops.calls == []
        old.gone.set()
        with anyio.fail_after(5):
            await loops.refitting.wait()
            loops.release.set()
            while restarts.serving != [WORKER]:
                await anyio.sleep(0.01)
        assert loops.calls == [("lost", WORKER), ("refit", WORKER), ("serves", WORKER)]
        assert [p.pid for p in asked] == [100, 200]  # the new process is watched too
        tg.cancel_scope.cancel()


async def test_a_remote_worker_lost_without_successor_stops_the_run_naming_why() -> None:
    """Silent past the heartbeat's timeout and no new process from its node within that
    time again (its node is gone or cut off, or it hangs there): not restarted, the run
    stops with the WorkerLostError, which says so; nothing was handed elsewhere."""
    loops, deaths = _Loops(), []
    restarts = _restarts(loops, rollout_restarts=2, heartbeat_timeout_s=0.3)
    start = anyio.current_time()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with pytest.raises(WorkerLostError) as info:
                await restarts.watch(_Control(), _remote(100), None, tg, named=lambda p, d: d,
                                     fatal=deaths.append, lost=_lost_after(0.2, []))  # fmt: skip
    # the verdict (0.2 s), then the grace (0.3 s), not before; fail_after(5) is the hang guard
    assert anyio.current_time() - start >= 0.5
    assert str(info.value).endswith(
        "no new process of rollout:0 came from 'node1' within 0.3 s more: not restarted"
    )
    assert deaths == [info.value] and loops.calls == []


async def test_a_remote_worker_lost_whose_successor_comes_in_the_grace_is_restarted() -> None:
    """Found silent first (its new process was slow to start), then its successor's Hello
    within the grace: a restart like any other."""
    loops = _Loops()
    restarts = _restarts(loops, rollout_restarts=1, heartbeat_timeout_s=5.0)
    old = _remote(100)
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await restarts.watch(_Control(_remote(200)), old, None, tg, named=lambda p, d: d,
                                 fatal=lambda d: None, lost=_lost_after(0.1, []))  # fmt: skip

        tg.start_soon(watch)
        await anyio.sleep(0.4)
        assert loops.calls == []  # lost, waiting for a successor
        old.gone.set()
        with anyio.fail_after(5):
            await loops.refitting.wait()
        assert loops.calls == [("lost", WORKER), ("refit", WORKER)]
        tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- a dead owner
_STOPS_WITH_ITS_OWNER = """
import os, sys, time
parent = os.getppid()
while os.getppid() == parent:  # its owner watch: it stops once its owner is gone
    time.sleep(0.02)
sys.exit(143)  # as after the SIGTERM the owner watch sends
"""


def _owner_of(worker: str) -> tuple[subprocess.Popen, int]:
    """A supervisor stand-in that starts ``worker`` and waits; it, and the worker's pid."""
    owner = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"w = subprocess.Popen([sys.executable, '-c', {worker!r}])\n"
         "print(w.pid, flush=True)\n"
         "w.wait()\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    return owner, int(owner.stdout.readline())


def _end(owner: subprocess.Popen) -> None:
    owner.kill()
    owner.wait()
    assert owner.stdout is not None
    owner.stdout.close()


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
async def test_a_worker_whose_supervisor_was_killed_is_reported_as_that(reaped: bool) -> None:
    """SIGKILL of the supervisor: the worker stops on its owner watch (143). The run stops
    naming the supervisor's death, with the worker's code beside it, not as "died with exit
    code 143"; nothing restarts it (its supervisor is gone). ``reaped``: the supervisor's
    zombie was reaped first (torchrun's agent polls its ranks), as on a real launch: the
    status comes from the pidfd (Linux 6.15 and later)."""
    if reaped and tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 15):
        pytest.skip("a reaped process's exit status needs Linux 6.15 (PIDFD_GET_INFO)")
    loops, deaths = _Loops(), []
    restarts = _restarts(loops, rollout_restarts=3)
    owner, worker = _owner_of(_STOPS_WITH_ITS_OWNER)
    caught: list[WorkerDiedError] = []
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    try:
                        await restarts.watch(_Control(), _peer(worker), None, tg,
                                             named=lambda p, d: d, fatal=deaths.append,
                                             lost=_never)  # fmt: skip
                    except WorkerDiedError as exc:
                        caught.append(exc)

                tg.start_soon(watch)
                await anyio.sleep(0.2)  # watching: the owner's pidfd is open
                owner.kill()
                if reaped:
                    owner.wait()
            restarts.close()
    finally:
        _end(owner)
    (err,) = caught
    assert isinstance(err, WorkerOrphanedError)
    assert str(err) == (
        f"worker rollout:0's supervisor (pid {owner.pid}) was killed (SIGKILL); the worker "
        "then ended on its owner watch (exit code 143); its log: /logs/rollout-0.log"
    )
    assert (err.exit_code, err.owner_pid, err.owner_status) == (143, owner.pid, -signal.SIGKILL)
    assert deaths == [err] and loops.calls == []  # not restarted


async def test_a_supervisor_that_ends_after_its_worker_is_not_named(tmp_path: Path) -> None:
    """The worker stops by itself (143) and its supervisor exits 0 after reaping it, both
    before the controller looks (its loop is held up meanwhile): the worker's death is
    reported as it was."""
    go = tmp_path / "go"
    loops, deaths, caught = _Loops(), [], []
    restarts = _restarts(loops, rollout_restarts=3)
    owner, worker = _owner_of(
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "sys.exit(143)\n"
    )
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    try:
                        await restarts.watch(_Control(), _peer(worker), None, tg,
                                             named=lambda p, d: d, fatal=deaths.append,
                                             lost=_never)  # fmt: skip
                    except WorkerDiedError as exc:
                        caught.append(exc)

                tg.start_soon(watch)
                await anyio.sleep(0.2)  # watching
                go.write_text("")
                deadline = time.monotonic() + 10
                while owner.poll() is None:  # the loop is held: nothing is looked at yet
                    assert time.monotonic() < deadline
                    time.sleep(0.01)  # noqa: ASYNC251
            restarts.close()
    finally:
        _end(owner)
    assert owner.returncode == 0
    (err,) = caught
    assert type(err) is WorkerDiedError
    assert str(err) == "worker rollout:0 died with exit code 143; its log: /logs/rollout-0.log"
