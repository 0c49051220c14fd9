"""Both ends of a refit in one process, over the real protocol (asyncrl.worker.weights) and a real
weight transfer: the trainer's tensors are staged here, the engine's worker process opens
them. Used by the GPU tests and benchmarks/refit.py."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from asyncrl.backend import WeightTensor
from asyncrl.worker.weights import WeightReceiver, WeightSender
from asyncrl.transfers import StagingSpec, load_transfer
from asyncrl.procs.space import shm_dir
from asyncrl.wire.transport import Context, ipc_address


def dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class LocalRefit:
    """A trainer's sender (staging on ``device``) and a generator's receiver, kept across
    refits like a run keeps them (a transfer's staging buffers are reused)."""

    def __init__(
        self, transport: str, device: str, *, bucket_size: int = 256 << 20, buffers: int = 2
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="asyncrl-lr-")
        os.chmod(self._dir, 0o700)
        self.run_id = uuid.uuid4().hex[:8]
        self.ctx = Context()
        address = ipc_address(self._dir, "w")
        spec = StagingSpec(self.run_id, 0, device, buffers=buffers)
        self.transport = transport
        self.sender = WeightSender(self.ctx, address, load_transfer(transport), spec)
        self.receiver = WeightReceiver(self.ctx, address, "rollout:0")
        self.bucket_size = bucket_size

    async def push(
        self,
        backend: Any,
        version: int,
        tensors: Callable[[], Iterable[tuple[str, Any]]] | Callable[[], Iterable[WeightTensor]],
        *,
        specs: list[WeightTensor] | None = None,
        kv_scales: dict[str, float] | None = None,
        timeout_s: float = 120.0,
    ) -> tuple[Any, Any]:
        """Refit ``backend`` to ``version`` with what ``tensors()`` yields: ``(name, tensor)``
        pairs (a state dict's items), or :class:`WeightTensor`s with ``specs`` (a trainer
        backend's ``iter_weights`` / ``weight_specs``). Returns the sender's and the
        receiver's ``WeightsResult``."""

        def stream() -> Iterable[WeightTensor]:
            for item in tensors():
                if isinstance(item, WeightTensor):
                    yield item
                else:
                    n, t = item
                    yield WeightTensor(n, dtype_name(t), tuple(t.shape), t, stable=True)

        if specs is None:
            specs = [WeightTensor(t.name, t.dtype, t.shape) for t in stream()]
        out: dict[str, Any] = {}

        async def send() -> None:
            out["sent"] = await self.sender.send(
                version, ["rollout:0"], specs, stream(), bucket_size=self.bucket_size,
                timeout_s=timeout_s,
            )

        async def receive() -> None:
            out["received"] = await self.receiver.receive(
                version, backend, transport=self.transport, reset_prefix_cache=True,
                kv_scales=kv_scales, timeout_s=timeout_s,
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(receive)
        return out["sent"], out["received"]

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.ctx.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        shutil.rmtree(shm_dir(self.run_id), ignore_errors=True)
