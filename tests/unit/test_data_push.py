"""A rollout worker pushes what is ready together as one DataBatch (the real
``RolloutRuntime.push_data`` over a real PUSH/PULL pair), and the controller's codec reads it."""

from __future__ import annotations

import types

import anyio
import numpy as np
import pytest

from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import DataBatch, DataMessage, GroupFailed, Sample, SampleDone
from asyncrl.wire.transport import PULL, PUSH, Context
from asyncrl.worker.rollout_runtime import DATA_BATCH, RolloutRuntime

pytestmark = pytest.mark.asyncio


def _sample(i: int) -> SampleDone:
    s = Sample(np.array([i, i + 1], np.int32), np.array([-0.5, -0.25], np.float32), "stop")
    return SampleDone(f"g{i // 4}", "rollout:0", i % 4, s)


async def test_ready_items_go_together_in_order_and_nothing_waits(tmp_path) -> None:
    ctx = Context()
    try:
        address = f"ipc://{tmp_path}/data.sock"
        pull = ctx.socket(PULL, bind=address)
        push = ctx.socket(PUSH, connect=address)
        runtime = types.SimpleNamespace(data=push)
        send, recv = anyio.create_memory_object_stream[object](64)
        rx = Codec(DataMessage)
        items = [_sample(i) for i in range(DATA_BATCH + 4)]
        failed = GroupFailed("g9", "rollout:0", "ValueError", "bad prompt")
        async with anyio.create_task_group() as tg, send:
            for item in items:  # all ready before the pusher runs
                send.send_nowait(item)
            tg.start_soon(RolloutRuntime.push_data, runtime, recv)
            with anyio.fail_after(5):
                first = rx.decode(await pull.recv())
                second = rx.decode(await pull.recv())
                send.send_nowait(failed)  # alone: sent at once, as itself
                third = rx.decode(await pull.recv())
            tg.cancel_scope.cancel()
        assert isinstance(first, DataBatch) and len(first.items) == DATA_BATCH
        assert isinstance(second, DataBatch) and len(second.items) == 4
        got = first.items + second.items
        assert [(m.group_id, m.index) for m in got] == [(m.group_id, m.index) for m in items]
        for m, want in zip(got, items):
            np.testing.assert_array_equal(m.sample.token_ids, want.sample.token_ids)
            np.testing.assert_array_equal(m.sample.logprobs, want.sample.logprobs)
        assert third == failed
    finally:
        ctx.close()
