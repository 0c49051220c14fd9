"""The controller's side of a refit: trainer rank 0 sends, every generator receives, at once
(the bytes themselves go straight from trainer to generators; see :mod:`asyncrl.worker.weights`), with
FP8 KV-cache scales calibrated by the trainers when the generators serve an FP8 KV cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import anyio
import msgspec
import numpy as np
import structlog

from asyncrl.config import RefitConfig
from asyncrl.errors import RefitError, flatten
from asyncrl.policy.grpo import shard_tokens
from asyncrl.wire.messages import (
    CalibrateKV,
    KVScalesResult,
    ReceiveWeights,
    SendWeights,
    TokenBatch,
    WeightsResult,
)
from asyncrl.data.prompts import PromptStream, Tokenizer
from asyncrl.wire.rpc import ControlPlane
from asyncrl.policy.verify import make_probe

__all__ = [
    "KVScales", "RefitReport", "calibrate_kv", "fp8_kv_cache", "fp8_query", "refit_generators"
]

log = structlog.get_logger("asyncrl.run.refit")


def fp8_kv_cache(capabilities: Sequence[dict[str, Any]]) -> bool:
    """Whether any generator (by the capabilities it reported) serves an FP8 KV cache."""
    return any(str(c.get("kv_cache_dtype", "")).startswith("fp8") for c in capabilities)


def fp8_query(capabilities: Sequence[dict[str, Any]]) -> bool:
    """Whether any generator reported that its attention quantizes the query too
    (``kv_quantized_query``: vLLM's FlashAttention 3 with an FP8 KV cache), so its query
    scales need calibrating like the K and V ones."""
    return any(bool(c.get("kv_quantized_query")) for c in capabilities)


async def calibrate_kv(
    control: ControlPlane,
    trainers: list[str],
    batch: TokenBatch,
    refit: RefitConfig,
    *,
    timeout_s: float,
    include_q: bool = False,
) -> dict[str, float]:
    """FP8 KV-cache scales of the trainers' current weights on ``batch`` (dealt over the
    ranks, which max their amaxes together), with query scales if ``include_q`` or
    ``refit.kv_calibrate_q``.

    Raises:
        RefitError: the ranks disagree (they must have reduced to the same scales).
    """
    requests = [
        CalibrateKV(
            batch=part,
            percentile=refit.kv_calibration_percentile,
            margin=refit.kv_calibration_margin,
            include_q=include_q or refit.kv_calibrate_q,
        )
        for part in shard_tokens(batch, len(trainers))
    ]
    results = await control.call_each(trainers, requests, timeout_s=timeout_s)
    scales = [r.scales for r in results if isinstance(r, KVScalesResult)]
    if len(scales) != len(trainers) or any(s != scales[0] for s in scales):
        raise RefitError("trainer ranks returned different KV-cache scales")
    return scales[0]


class KVScales:
    """The controller's FP8 KV-cache duty, on when a generator reported an FP8 KV cache: the
    trainers calibrate scales before the first dispatch (on training prompts) and after every
    step (on the step's sequences, with the updated weights), and each refit carries them."""

    def __init__(
        self,
        control: ControlPlane,
        trainers: list[str],
        rollouts: list[str],
        refit: RefitConfig,
        *,
        timeout_s: float,
        metrics: Any = None,
    ) -> None:
        caps = [control.peers[w].capabilities for w in rollouts]
        self.enabled = fp8_kv_cache(caps)
        self.include_q = fp8_query(caps)
        self._control, self._trainers, self._refit = control, trainers, refit
        self._timeout_s, self._metrics = timeout_s, metrics

    async def calibrate(self, batch: TokenBatch | None, version: int) -> dict[str, float] | None:
        """Scales for weight ``version`` on ``batch`` (``None`` when off). Written to the
        metrics file as a ``kv_scales`` record (per kind: mean, min, max over layers)."""
        if not self.enabled:
            return None
        if batch is None or batch.seq_lens.size == 0:
            raise RefitError(f"no sequences to calibrate the FP8 KV-cache scales of v{version}")
        start = time.perf_counter()
        scales = await calibrate_kv(
            self._control, self._trainers, batch, self._refit, timeout_s=self._timeout_s,
            include_q=self.include_q,
        )
        if self._metrics is not None:
            record: dict[str, Any] = {"kind": "kv_scales", "version": version}
            for kind in ("k", "v", "q"):
                values = [v for n, v in scales.items() if n.endswith(f".{kind}_scale")]
                if values:
                    record[kind] = {
                        "mean": float(np.mean(values)),
                        "min": min(values),
                        "max": max(values),
                    }
            record["seconds"] = round(time.perf_counter() - start, 4)
            record["sequences"] = int(batch.seq_lens.size)
            self._metrics.write(record)
        return scales

    async def initial(self, prompts: PromptStream, tokenizer: Tokenizer) -> dict[str, float] | None:
        """Scales of the starting (or restored) weights on the first training prompts the run
        will dispatch (each token after the first counts: there are no responses yet)."""
        if not self.enabled:
            return None
        n = self._refit.kv_calibration_sequences
        seqs = [p for p in await prompts.peek_first(n, tokenizer) if len(p) > 1]
        batch = TokenBatch(
            tokens=np.asarray([t for s in seqs for t in s], np.int32),
            seq_lens=np.asarray([len(s) for s in seqs], np.int32),
            prompt_lens=np.ones(len(seqs), np.int32),
        )
        return await self.calibrate(batch, 0)

    async def after_step(self, groups: Sequence[Any], version: int) -> dict[str, float] | None:
        """Scales of the weights a step produced, on (a sample of) that step's sequences."""
        if not self.enabled:
            return None
        return await self.calibrate(
            make_probe(groups, self._refit.kv_calibration_sequences), version
        )


class RefitReport(NamedTuple):
    """What one refit reports back to the pipeline."""

    busy_s: float = 0.0
    """The generators' busy time since their previous refit (the slowest)."""
    rejected_frames: int = 0
    """Frames the sender's socket refused so far in the run."""
    pack_s: float = 0.0
    """The sender's time producing and packing the buckets (``refit_pack_s``)."""


RETRY_GRACE_S = 5.0
"""After a failed refit: how long to wait for one of its receivers to be found dead (its
watcher forgets it: a restart). Then the refit is done again without it; else the failure
stands. A pidfd fires within milliseconds, a remote worker's successor says ``Hello``
within seconds (0.8 s in tests/integration/test_two_nodes.py)."""


async def refit_generators(
    control: ControlPlane,
    trainers: list[str],
    rollouts: list[str],
    *,
    version: int,
    transfer_address: str,
    refit: RefitConfig,
    timeout_s: float,
    kv_scales: dict[str, float] | None = None,
    reprefill: bool = False,
) -> RefitReport:
    """Weights ``version`` (and ``kv_scales``, applied after them) from the trainers to the
    generators ``rollouts``, with a prefix-cache reset (always: cached KV of old weights is
    stale); with ``reprefill`` the requests in flight recompute their KV cache with the new
    weights before they go on (the sampler's ``in_flight_at_refit``). Nothing to do without
    generators.

    A generator that dies meanwhile and is being restarted is left out: the sender watches
    the receivers' processes and goes on without it. A collective transfer (``nccl``) fails
    the whole refit instead (its readers depend on each other): the refit is then done again
    without the receivers found dead within :data:`RETRY_GRACE_S`. Once only; a failure with
    no receiver gone stands.

    Raises:
        Exception: the refit's failure (again: the second's).

    Cancellation: abandons the transfer.
    """
    send = SendWeights(
        version=version,
        receivers=[],
        transport=refit.transport,
        bucket_size_bytes=refit.bucket_size_mb << 20,
        timeout_s=refit.timeout_s,
    )
    recv = ReceiveWeights(
        version=version,
        address=transfer_address,
        transport=refit.transport,
        reset_prefix_cache=True,
        kv_scales=kv_scales,
        timeout_s=refit.timeout_s,
        reprefill=reprefill,
    )
    try:
        return await _refit_once(control, trainers, rollouts, send, recv, timeout_s)
    except Exception as exc:
        left: list[str] = []
        with anyio.move_on_after(RETRY_GRACE_S):
            while not (left := [w for w in rollouts if w not in control.peers]):
                await anyio.sleep(0.05)
        if not left:
            raise
        first = flatten(exc)[0]
        log.warning("refit_again", version=version, without=left,
                    error=f"{type(first).__name__}: {str(first).partition(chr(10))[0]}")  # fmt: skip
    rollouts = [w for w in rollouts if w not in left]
    return await _refit_once(control, trainers, rollouts, send, recv, timeout_s)


async def _refit_once(
    control: ControlPlane, trainers: list[str], rollouts: list[str], send: SendWeights,
    recv: ReceiveWeights, timeout_s: float,
) -> RefitReport:
    """One refit: ``send`` to the trainers for the ``rollouts`` still connected (one
    forgotten is restarting), ``recv`` to each of those."""
    rollouts = [w for w in rollouts if w in control.peers]
    if not rollouts:
        return RefitReport()
    send = msgspec.structs.replace(
        send,
        receivers=list(rollouts),
        # each pid is watched by the sender where it is on the sender's host
        receiver_pids=[control.peers[w].pid for w in rollouts],
        receiver_hosts=[control.peers[w].host for w in rollouts],
    )
    sent: list[Any] = []
    received: list[Any] = []

    async def call_all(workers: list[str], request: Any, out: list[Any]) -> None:
        out.extend(await control.call_each(workers, [request] * len(workers), timeout_s=timeout_s))

    async def receive(worker: str) -> None:  # one that died: refitted on its own once back
        received.append(await control.call_unless_restarting(worker, recv, timeout_s=timeout_s))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call_all, trainers, send, sent)
        for worker in rollouts:
            tg.start_soon(receive, worker)
    senders = [r for r in sent if isinstance(r, WeightsResult)]
    return RefitReport(
        busy_s=max((r.busy_s for r in received if isinstance(r, WeightsResult)), default=0.0),
        rejected_frames=max((r.rejected_frames for r in senders), default=0),
        pack_s=max((r.pack_s for r in senders), default=0.0),
    )
