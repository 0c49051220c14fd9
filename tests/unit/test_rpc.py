"""The controller's control plane against scripted fake workers (real ZeroMQ over ipc://;
the fake workers are in fake_workers.py): each test decides exactly what the worker says and
when.
"""

from __future__ import annotations

import os

import anyio
import msgspec
import pytest

from asyncrl.errors import (
    RemoteCallError,
    WorkerError,
    WorkerRestarting,
    WorkerStartupError,
)
from asyncrl.wire.messages import (
    PROTOCOL_VERSION,
    Cast,
    Dead,
    Empty,
    Failure,
    Generate,
    GenRequest,
    Health,
    HealthResult,
    Hello,
    Init,
    Ready,
    Reply,
    Shutdown,
)
from asyncrl.wire.transport import DEALER
from fake_workers import FakeWorker, bind_plane, control_plane

pytestmark = pytest.mark.asyncio


async def test_handshake_and_calls(run_dir: str) -> None:
    async with control_plane(run_dir) as (control, ctx, address, _):
        w0 = FakeWorker(ctx, address, "rollout", 0)
        w1 = FakeWorker(ctx, address, "rollout", 1)
        inits = [await w0.handshake(), await w1.handshake()]
        assert [i.config for i in inits] == [{"who": "rollout"}] * 2
        with anyio.fail_after(5):
            peers = await control.wait_ready("rollout", 2)
        assert [p.identity for p in peers] == ["rollout:0", "rollout:1"]
        assert peers[0].pid == os.getpid() and peers[0].log_path == "/logs/rollout-0.log"
        assert peers[0].capabilities == {"x": 1} and peers[0].backend == "fake"

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: w0.answer_health(2, pid=w0.rank))
            tg.start_soon(lambda: w1.answer_health(1, pid=w1.rank))
            results = await control.call_each(["rollout:1", "rollout:0"], [Health(), Health()],
                                              timeout_s=5)
            assert [r.pid for r in results] == [1, 0]  # in the order asked, not answered
            assert (await control.call("rollout:0", Health(), timeout_s=5)) == HealthResult(pid=0)


async def test_remote_failure_is_recoverable(run_dir: str) -> None:
    async with control_plane(run_dir) as (control, ctx, address, _):
        w = FakeWorker(ctx, address, "trainer", 0)
        await w.handshake()

        async def serve() -> None:
            call = await w.hear()
            await w.say(Failure(call_id=call.call_id, error_type="ValueError",
                                message="bad chunk", traceback="Traceback: line 1"))
            call = await w.hear()
            await w.say(Reply(call_id=call.call_id, result=Empty()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            with pytest.raises(RemoteCallError) as info:
                await control.call("trainer:0", Health(), timeout_s=5)
            err = info.value
            assert (err.worker, err.method) == ("trainer:0", "Health")
            assert err.remote_type == "ValueError"
            assert "bad chunk" in str(err) and "Traceback: line 1" in str(err)
            assert await control.call("trainer:0", Health(), timeout_s=5) == Empty()


async def test_call_timeout_is_a_worker_error(run_dir: str) -> None:
    async with control_plane(run_dir) as (control, ctx, address, _):
        w = FakeWorker(ctx, address, "trainer", 0)
        await w.handshake()
        with pytest.raises(WorkerError, match=r"Health on worker trainer:0 did not finish within"):
            await control.call("trainer:0", Health(), timeout_s=0.2)
        with pytest.raises(WorkerError, match="no worker rollout:7"):
            await control.call("rollout:7", Health(), timeout_s=1)


async def test_late_reply_is_dropped(run_dir: str) -> None:
    async with control_plane(run_dir) as (control, ctx, address, _):
        w = FakeWorker(ctx, address, "trainer", 0)
        await w.handshake()
        with pytest.raises(WorkerError):
            await control.call("trainer:0", Health(), timeout_s=0.1)
        late = await w.hear()
        await w.say(Reply(call_id=late.call_id, result=Empty()))  # nobody waits any more
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: w.answer_health(1, pid=7))
            assert await control.call("trainer:0", Health(), timeout_s=5) == HealthResult(pid=7)


@pytest.mark.parametrize(("ready", "expected"), [(False, WorkerStartupError), (True, WorkerError)])
async def test_dead_worker_fails_the_reader_and_pending_calls(
    run_dir: str, ready: bool, expected: type[Exception]
) -> None:
    control, ctx, address = bind_plane(run_dir, router_mandatory=False)
    pending_error: list[BaseException] = []
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                tg.start_soon(control.run)
                w = FakeWorker(ctx, address, "rollout", 0)
                await w.handshake(ready=ready)

                async def caller() -> None:
                    try:
                        await control.call("rollout:0", Health(), timeout_s=10)
                    except WorkerError as exc:
                        pending_error.append(exc)

                if ready:
                    with anyio.fail_after(5):
                        await control.wait_ready("rollout", 1)
                    tg.start_soon(caller)
                    await w.hear()  # the call reached the worker; it dies instead of answering
                await w.say(Dead(reason="RuntimeError: engine exploded", traceback="tb text"))
                await anyio.sleep_forever()
        (err,) = info.value.exceptions
        assert type(err) is expected
        assert "rollout:0" in str(err) and "engine exploded" in str(err)
        assert "/logs/rollout-0.log" in str(err) and "tb text" in str(err)
        if ready:
            assert pending_error and pending_error[0] is err
            assert control.peers["rollout:0"].error is err
            with pytest.raises(WorkerError):  # later calls fail fast
                await control.call("rollout:0", Health(), timeout_s=1)
    finally:
        ctx.close()


async def test_protocol_version_mismatch_is_refused(run_dir: str) -> None:
    control, ctx, address = bind_plane(run_dir, router_mandatory=False)
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                tg.start_soon(control.run)
                w = FakeWorker(ctx, address, "trainer", 0)
                await w.say(Hello(protocol_version=PROTOCOL_VERSION + 1, group="trainer", rank=0,
                                  world_size=1, pid=1))
                await anyio.sleep_forever()
        (err,) = info.value.exceptions
        assert isinstance(err, WorkerStartupError)
        assert f"protocol {PROTOCOL_VERSION + 1}" in str(err)
    finally:
        ctx.close()


async def test_a_worker_on_another_host_is_refused_naming_both_hosts(run_dir: str) -> None:
    """Its pid would name another process here: the start fails before any Init."""
    control, ctx, address = bind_plane(run_dir, router_mandatory=False, host="node-a/boot/1")
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                tg.start_soon(control.run)
                w = FakeWorker(ctx, address, "rollout", 0)
                await w.say(Hello(protocol_version=PROTOCOL_VERSION, group="rollout", rank=0,
                                  world_size=1, pid=7, host="node-b/boot/2"))  # fmt: skip
                await anyio.sleep_forever()
        (err,) = info.value.exceptions
        assert isinstance(err, WorkerStartupError)
        assert "'node-b'" in str(err) and "'node-a'" in str(err) and "pid 7" in str(err)
        assert "rollout:0" not in control.peers
    finally:
        ctx.close()


async def test_hostile_control_messages_are_rejected_and_counted(run_dir: str) -> None:
    """Every message a stranger (or a confused worker) can send is refused without ending
    the reader: the real worker still completes its handshake and calls afterwards."""
    hello = dict(protocol_version=PROTOCOL_VERSION, world_size=1, pid=1)
    plane = control_plane(run_dir, expected={"trainer:0"})
    async with plane as (control, ctx, address, tg):
        liar = FakeWorker(ctx, address, "rollout", 0)
        stranger = FakeWorker(ctx, address, "rollout", 9)
        anonymous = ctx.socket(DEALER, connect=address)  # ZeroMQ gives it a binary id
        await liar.say(Hello(group="trainer", rank=0, **hello))  # identity mismatch
        await stranger.say(Hello(group="rollout", rank=9, **hello))  # not in this run
        await stranger.say(Ready(backend="x"))  # no Hello accepted
        await stranger.say(Dead(reason="I am not here"))  # a stranger's Dead
        await stranger.say(Reply(call_id=1, result=Empty()))  # no such call
        await anonymous.send([b"\x92\x01"])  # truncated msgpack
        real = FakeWorker(ctx, address, "trainer", 0)
        await real.handshake()
        await real.say(Hello(group="trainer", rank=0, **hello))  # a second Hello
        await real.say(Ready(backend="fake"))  # a second Ready
        with anyio.fail_after(5):
            await control.wait_ready("trainer", 1)
            while control.rejections.total < 8:
                await anyio.sleep(0.01)
        assert control.rejections.counts == {"control": 8}
        assert set(control.peers) == {"trainer:0"}
        tg.start_soon(lambda: real.answer_health(1, pid=7))
        result = await control.call("trainer:0", Health(), timeout_s=5)
        assert isinstance(result, HealthResult) and result.pid == 7


async def test_garbage_is_rejected_and_reading_goes_on(run_dir: str) -> None:
    async with control_plane(run_dir) as (control, ctx, address, _):
        w = FakeWorker(ctx, address, "trainer", 0)
        await w.sock.send([b"\x93not a message"])
        await w.sock.send([msgspec.msgpack.encode({"k": "pickle", "data": "..."})])
        await w.handshake()
        with anyio.fail_after(5):
            assert [p.identity for p in await control.wait_ready("trainer", 1)] == ["trainer:0"]


async def test_shutdown_all_reaches_live_workers_only(run_dir: str) -> None:
    async with control_plane(run_dir) as (control, ctx, address, _):
        live = FakeWorker(ctx, address, "rollout", 0)
        dead = FakeWorker(ctx, address, "rollout", 1)
        await live.handshake()
        await dead.handshake()
        with anyio.fail_after(5):
            await control.wait_ready("rollout", 2)
        control.fail_peer("rollout:1", WorkerError("gone"))
        await control.shutdown_all()
        assert isinstance(await live.hear(), Shutdown)
        with anyio.move_on_after(0.2) as scope:
            await dead.sock.recv()
        assert scope.cancelled_caught, "a worker marked dead was sent Shutdown"


async def test_unreachable_worker_is_a_worker_error_not_a_zmq_error(run_dir: str) -> None:
    """A worker whose socket is gone (its process died) makes the ROUTER refuse the send.
    The call then waits for the death to be reported (here: nobody reports it) and ends as a
    WorkerError, never as a raw ZeroMQ error."""
    async with control_plane(run_dir) as (control, ctx, address, _):
        w = FakeWorker(ctx, address, "trainer", 0)
        await w.handshake()
        with anyio.fail_after(5):
            await control.wait_ready("trainer", 1)
        w.sock.close()
        await anyio.sleep(0.2)  # the ROUTER notices the disconnect
        with pytest.raises(WorkerError, match="trainer:0 was unreachable"):
            await control.call("trainer:0", Health(), timeout_s=0.3)
        # the reported death, when it comes, is what a waiting call raises
        died = WorkerError("trainer:0 died")

        async def report() -> None:
            await anyio.sleep(0.1)
            control.fail_peer("trainer:0", died)

        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            with pytest.raises(WorkerError) as info:
                await control.call("trainer:0", Health(), timeout_s=5)
        assert info.value is died


async def test_a_survivable_death_is_kept_and_its_restart_is_welcome(run_dir: str) -> None:
    """A ready worker the run can restart says Dead: the reader goes on and keeps its last
    words. forget() fails its pending call and later calls with the given error, until its
    new process (same identity, a new socket) says Hello, which is welcome then."""
    plane = control_plane(run_dir, survivable=lambda peer: peer.group == "rollout")
    async with plane as (control, ctx, address, tg):
        old = FakeWorker(ctx, address, "rollout", 0)
        await old.handshake()
        with anyio.fail_after(5):
            await control.wait_peer("rollout:0")
        await old.say(Dead(reason="EngineDeadError: engine core exited", traceback="tb"))
        with anyio.fail_after(5):
            while control.peers["rollout:0"].last_words is None:
                await anyio.sleep(0.01)
        assert "engine core exited" in str(control.peers["rollout:0"].last_words)
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await control.call("rollout:0", Health(), timeout_s=10)
            except WorkerRestarting as exc:
                errors.append(exc)

        async with anyio.create_task_group() as calls:
            calls.start_soon(caller)
            await old.hear()  # the call reached the dying worker
            control.forget("rollout:0", WorkerRestarting("rollout:0 is restarting"))
        assert [str(e) for e in errors] == ["rollout:0 is restarting"]
        with pytest.raises(WorkerRestarting):
            await control.call("rollout:0", Health(), timeout_s=1)
        assert await control.call_unless_restarting("rollout:0", Health(), timeout_s=1) is None
        old.sock.close()
        new = FakeWorker(ctx, address, "rollout", 0)
        await new.handshake()
        with anyio.fail_after(5):
            peer = await control.wait_peer("rollout:0")
        assert peer.ready.is_set() and peer.last_words is None
        tg.start_soon(lambda: new.answer_health(1, pid=7))
        assert await control.call("rollout:0", Health(), timeout_s=5) == HealthResult(pid=7)
        assert control.rejections.total == 0


async def test_a_cast_waits_for_nothing_and_fails_only_where_a_call_would_at_once(
    run_dir: str,
) -> None:
    """A Generate goes out as a Cast: the worker hears it, nothing is pending, and no reply
    is expected. Sending to a worker being restarted is refused as a call is (and
    cast_unless_restarting says False); a request that wants its answer cannot be cast; a
    worker whose socket is gone is not an error at the send (its watcher reports the death)."""
    generate = Generate(requests=[GenRequest(group_id="g#0", prompt_ids=[1], n=1, max_tokens=2)])
    async with control_plane(run_dir) as (control, ctx, address, _):
        w = FakeWorker(ctx, address, "rollout", 0)
        await w.handshake()
        with anyio.fail_after(5):
            await control.wait_ready("rollout", 1)
        assert await control.cast_unless_restarting("rollout:0", generate) is True
        assert await w.hear() == Cast(request=generate)
        assert control._pending == {}
        with pytest.raises(TypeError, match="Health is not sent without an answer"):
            await control.cast("rollout:0", Health())
        with pytest.raises(WorkerError, match="no worker rollout:1 is connected"):
            await control.cast("rollout:1", generate)
        w.sock.close()
        await anyio.sleep(0.2)  # the ROUTER notices the disconnect
        await control.cast("rollout:0", generate)  # logged, not raised
        control.forget("rollout:0", WorkerRestarting("rollout:0 is restarting"))
        with pytest.raises(WorkerRestarting):
            await control.cast("rollout:0", generate)
        assert await control.cast_unless_restarting("rollout:0", generate) is False
        assert control.rejections.total == 0


async def test_a_remote_workers_successor_marks_it_gone_and_is_welcomed_once_forgotten(
    run_dir: str,
) -> None:
    """A worker on another host is started again by its node (SIGKILL there: no Dead, and
    its pid cannot be watched from here). Its new process's Hello, from the same host with
    another pid, sets the old peer's ``gone``; the new one gets its Init once the old one is
    forgotten. A second Hello from another host, or from a worker on this host, is refused."""
    plane = control_plane(run_dir, survivable=lambda peer: True, host="node0/b/1",
                          remote_ok=True, router_mandatory=False)  # fmt: skip
    async with plane as (control, ctx, address, _):
        old = FakeWorker(ctx, address, "rollout", 0, pid=100)
        local = FakeWorker(ctx, address, "rollout", 1, pid=os.getpid())
        await old.handshake(host="node1/b/1")
        await local.handshake(host="node0/b/1")
        with anyio.fail_after(5):
            await control.wait_ready("rollout", 2)
        peer = control.peers["rollout:0"]
        assert peer.remote and not peer.gone.is_set()
        hello = dict(protocol_version=PROTOCOL_VERSION, world_size=1)
        await local.say(Hello(group="rollout", rank=1, pid=5, host="node0/b/1", **hello))
        await old.say(Hello(group="rollout", rank=0, pid=101, host="node2/b/1", **hello))
        with anyio.fail_after(5):
            while control.rejections.total < 2:
                await anyio.sleep(0.01)
        assert not peer.gone.is_set()  # another host: not its successor
        old.sock.close()
        new = FakeWorker(ctx, address, "rollout", 0, pid=200)
        await new.say(Hello(group="rollout", rank=0, pid=200, host="node1/b/1",
                            log_path="/logs/rollout-0.log", **hello))  # fmt: skip
        with anyio.fail_after(5):
            await peer.gone.wait()
        assert control.peers["rollout:0"] is peer  # still the old one until forgotten
        control.forget("rollout:0", WorkerRestarting("rollout:0 is restarting"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(control.wait_peer, "rollout:0")
            assert isinstance(await new.hear(), Init)
            await new.say(Ready(backend="fake"))
        back = control.peers["rollout:0"]
        assert back.pid == 200 and back.remote and back.ready.is_set() and not back.gone.is_set()
        assert control.rejections.total == 2


async def test_held_starts_wait_for_their_admission(run_dir: str) -> None:
    """``hold_starts`` (a GPU taken in turns): a worker that says Hello while its group is
    held gets no Init, so its backend does not start, until ``admit_held``; one forgotten
    meanwhile gets none. Other groups, and workers once admitted, start at once."""
    held = {"rollout"}
    async with control_plane(run_dir) as (control, ctx, address, _):
        control.hold_starts(lambda hello: hello.group not in held)
        trainer = FakeWorker(ctx, address, "trainer", 0)
        await trainer.handshake()  # not held
        rollout = FakeWorker(ctx, address, "rollout", 0)
        hello = Hello(protocol_version=PROTOCOL_VERSION, group="rollout", rank=0, world_size=1,
                      pid=rollout.pid, log_path="/logs/rollout-0.log")  # fmt: skip
        await rollout.say(hello)
        with anyio.fail_after(5):
            while "rollout:0" not in control.peers:
                await anyio.sleep(0.01)
        with anyio.move_on_after(0.3) as waited:
            await rollout.hear()  # no Init while held
        assert waited.cancelled_caught
        assert control.started("rollout") == [] and control.started("trainer") == ["trainer:0"]
        held.clear()
        assert await control.admit_held() == ["rollout:0"]
        assert isinstance(await rollout.hear(), Init)
        assert control.started("rollout") == ["rollout:0"]  # starting: Init sent, not ready
        await rollout.say(Ready(backend="fake"))
        with anyio.fail_after(5):
            await control.wait_peer("rollout:0")
        assert await control.admit_held() == []  # nothing is held any more

        held.add("rollout")  # a worker forgotten while held gets no Init
        control.forget("rollout:0", WorkerRestarting("rollout:0 is restarting"))
        again = FakeWorker(ctx, address, "rollout", 0)
        await again.say(hello)
        with anyio.fail_after(5):
            while "rollout:0" not in control.peers:
                await anyio.sleep(0.01)
        control.forget("rollout:0", WorkerRestarting("rollout:0 is restarting"))
        assert await control.admit_held() == []
