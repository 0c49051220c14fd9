"""Malformed and foreign frames on every socket of a live run change nothing but a counter.

While a run trains, two processes connect to the controller's control socket (ROUTER), its
data socket (PULL) and trainer rank 0's weight-transfer socket (ROUTER), and send truncated
msgpack, unknown tags, frames that name missing array frames, and well-formed messages they
have no business sending (a Hello for a worker the run does not have, a Dead, replies to no
call, results for groups that are not generating, weight pulls and acks from a non-receiver):

* a **stranger** (this user's, without the run's keys; also posing as ``rollout:0`` and
  ``trainer:0``): every connection is refused at the CURVE handshake, so not one of its
  frames is read (``refused_peers``, and no rejected frame);
* an **insider** with the run's keys (a worker gone wrong): each frame is read, refused and
  counted, per socket.

The run must finish exactly as an undisturbed run with the same seed does (synchronous mode, so
both see the same samples: same rewards, same losses, same evaluation).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)

import asyncrl  # noqa: E402
from asyncrl.wire.codec import Codec  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.wire.messages import (  # noqa: E402
    PROTOCOL_VERSION,
    BucketAck,
    DataBatch,
    DataMessage,
    Dead,
    Empty,
    FromWorker,
    GroupFailed,
    Hello,
    Reply,
    Sample,
    SampleDone,
    WeightMessage,
    WeightsPull,
)
from asyncrl.wire.transport import DEALER, PUSH, Context  # noqa: E402
from integration_support import (  # noqa: E402
    assert_nothing_left, read_metrics, training, worker_pids,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]


async def _attack(ctl: asyncrl.Controller, *, keys: bool) -> dict[str, int]:
    """Send the hostile frames, with the run's keys or without; returns how many each socket
    must refuse (with them)."""
    addr = ctl.addresses
    assert addr is not None
    ctx = Context(addr.keys if keys else None)
    try:
        if not keys:  # posing as the run's workers, and a forged Dead in their name
            for who, frames in (("rollout:0", [b"\x92\x01"]), ("trainer:0",
                                Codec(FromWorker).encode(Dead(reason="forged")))):
                await ctx.socket(DEALER, connect=addr.control, identity=who).send(frames)
                await ctx.socket(DEALER, connect=addr.transfer, identity=who).send(frames)
        control = ctx.socket(DEALER, connect=addr.control, identity="intruder")
        anonymous = ctx.socket(DEALER, connect=addr.control)  # a binary identity
        tx = Codec(FromWorker)
        for frames in (
            [b"\x92\x01"],  # truncated msgpack (the frame that used to end a run)
            [b""],  # empty body
            [msgspec.msgpack.encode({"k": "zzz"})],  # an unknown tag
            tx.encode(Hello(protocol_version=PROTOCOL_VERSION, group="rollout", rank=7,
                            world_size=8, pid=1)),
            tx.encode(Dead(reason="not really")),
            tx.encode(Reply(call_id=10**9, result=Empty())),
        ):
            await control.send(frames)
        await anonymous.send([b"\xff\xfe garbage"])

        data = ctx.socket(PUSH, connect=addr.data)
        dx = Codec(DataMessage)
        sample = Sample(np.array([4, 5], np.int32), np.array([-0.1, -0.2], np.float32), "stop")
        missing_frame = dx.encode(SampleDone("g0", "rollout:0", 0, sample))[:1]  # arrays gone
        for frames in (
            [b"\x92\x01"],
            [b"abc", b"def"],
            missing_frame,
            dx.encode(SampleDone("nope", "rollout:0", 0, sample)),  # not generating
            dx.encode(GroupFailed("nope-2", "rollout:0", "ValueError", "forged")),
            # a batch is taken item by item: each foreign item is one refusal
            dx.encode(DataBatch([SampleDone("nope-3", "rollout:0", 0, sample),
                                 GroupFailed("nope-4", "rollout:0", "ValueError", "forged")])),
            # a batch inside a batch does not decode (one refusal for the whole message)
            dx.encode(DataBatch([DataBatch([])])),  # type: ignore[list-item]
        ):
            await data.send(frames)

        weights = ctx.socket(DEALER, connect=addr.transfer, identity="intruder")
        stranger = ctx.socket(DEALER, connect=addr.transfer)
        wx = Codec(WeightMessage)
        await weights.send([b"\x92\x01"])
        await weights.send(wx.encode(WeightsPull(10**6, "intruder")))
        await stranger.send(wx.encode(BucketAck(1, 0, "rollout:0")))
        await anyio.sleep(0.5)  # let ZeroMQ deliver before the sockets close (linger 0)
    finally:
        ctx.close()
    return {"control": 7, "data": 8, "weights": 3}


async def test_hostile_frames_change_nothing_but_a_counter(
    make_config: Callable[..., Config],
) -> None:
    def config(name: str) -> Config:
        return make_config(
            name,
            # the attacks (about 1.5 s from step 2) must end inside the run: a send to the
            # sockets of a run that has ended waits forever (6 steps were too few at times)
            run={"num_steps": 12},
            pipeline={"sampler": {"name": "in_order", "max_lookahead_versions": 0}},
            trainer={"options": {"step_delay_s": 0.2}},
            eval={"num_prompts": 8},
        )

    clean = config("clean")
    async with asyncrl.Controller(clean) as ctl:
        reference = await ctl.train()
    assert reference.rejected_frames == {}

    hostile = config("hostile")
    async with asyncrl.Controller(hostile) as ctl:
        pids = worker_pids(ctl)
        async with training(ctl) as result:
            with anyio.fail_after(60):
                while ctl.status().step < 2:
                    await anyio.sleep(0.02)
            await _attack(ctl, keys=False)
            sent = await _attack(ctl, keys=True)
    assert_nothing_left(ctl, pids.values())
    (summary,) = result

    assert summary.rejected_frames == sent  # the insider's, each read and refused
    # the stranger's 4 connections to the controller's sockets (2 posing as workers, the
    # intruder, an anonymous one) and its data socket: refused before a frame, retried by
    # ZeroMQ meanwhile (each retry refused again)
    assert summary.refused_peers >= 5, summary.refused_peers
    # trainer rank 0's weights socket refused the stranger's 4 connections there, likewise
    trainer_log = Path(hostile.run.output_dir, "logs", "trainer-0.log").read_text()
    assert trainer_log.count("peer_refused") >= 4, trainer_log[-2000:]
    records = read_metrics(hostile)
    (sockets,) = [r for r in records if r["kind"] == "sockets"]
    assert sockets == {**sockets, "rejected_frames": sent, "refused_peers": summary.refused_peers}
    # the run is the undisturbed run: same samples, same updates, same evaluation
    keys = ("reward", "accuracy", "loss", "grad_norm", "groups", "staleness_max")
    assert [{k: s[k] for k in keys} for s in summary.steps] == [
        {k: s[k] for k in keys} for s in reference.steps
    ]
    assert [e["accuracy"] for e in summary.evals] == [e["accuracy"] for e in reference.evals]
