"""The controller's side of a refit: trainer rank 0 sends, every generator receives, at once
(the bytes themselves go straight from trainer to generators; see :mod:`asyncrl.refit`)."""

from __future__ import annotations

from typing import Any

import anyio

from .config import RefitConfig
from .messages import ReceiveWeights, SendWeights, WeightsResult
from .rpc import ControlPlane

__all__ = ["refit_generators"]


async def refit_generators(
    control: ControlPlane,
    trainers: list[str],
    rollouts: list[str],
    *,
    version: int,
    transfer_address: str,
    refit: RefitConfig,
    timeout_s: float,
) -> tuple[float, int]:
    """Weights ``version`` from the trainers to every generator, with a prefix-cache reset
    (always: cached KV of old weights is stale). Returns the generators' busy time since their
    previous refit (the slowest) and the frames the sender's socket refused so far.

    Cancellation: abandons the transfer.
    """
    send = SendWeights(
        version=version,
        receivers=list(rollouts),
        transport=refit.transport,
        bucket_size_bytes=refit.bucket_size_mb << 20,
        timeout_s=refit.timeout_s,
    )
    recv = ReceiveWeights(
        version=version,
        address=transfer_address,
        transport=refit.transport,
        reset_prefix_cache=True,
        timeout_s=refit.timeout_s,
    )
    sent: list[Any] = []
    received: list[Any] = []

    async def call_all(workers: list[str], request: Any, out: list[Any]) -> None:
        out.extend(await control.call_each(workers, [request] * len(workers), timeout_s=timeout_s))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call_all, trainers, send, sent)
        tg.start_soon(call_all, rollouts, recv, received)
    busy = max((r.busy_s for r in received if isinstance(r, WeightsResult)), default=0.0)
    refused = max((r.rejected_frames for r in sent if isinstance(r, WeightsResult)), default=0)
    return busy, refused
