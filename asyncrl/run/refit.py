"""Where a refit is ordered: after each optimizer step the :class:`Publisher` closes the
rollout gate, aborts or drains what the mode says, calibrates FP8 KV-cache scales when the
generators serve an FP8 KV cache, has trainer rank 0 send while every generator receives, at
once (the bytes go straight from trainer to generators: :mod:`asyncrl.worker.weights`),
verifies the refit when due, and reopens the gate on the new version.

::

    Publisher.publish():  training.finish_step() (gate closes) ─► Abort hopeless groups ─► drain
                          (optional) ─► KV scales ─► SendWeights ∥ ReceiveWeights ─►
                          training.end_refit() (gate reopens)

Every method that refits runs under the pipeline's weights lock (:mod:`asyncrl.run.loops`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import msgspec
import numpy as np
import structlog

from asyncrl.config import RefitConfig
from asyncrl.config.engines import DRAIN_TIMEOUT_S
from asyncrl.data.prompts import PromptStream, Tokenizer
from asyncrl.errors import RefitError, WorkerError, flatten
from asyncrl.obs.steps import RefitRecord, Verification
from asyncrl.policy.grpo import shard_tokens
from asyncrl.policy.samplers import in_flight_at_refit
from asyncrl.policy.counts import StepStats
from asyncrl.policy import verify
from asyncrl.policy.verify import Agreement, RefitCheck, make_probe, verification_due
from asyncrl.run.arrivals import Aborts
from asyncrl.run.context import RunContext
from asyncrl.wire.messages import (
    Abort,
    CalibrateKV,
    KVScalesResult,
    ReceiveWeights,
    ReceiverGone,
    SendWeights,
    TokenBatch,
    WeightsResult,
)
from asyncrl.wire.rpc import ControlPlane
from asyncrl.wire.transport import Rejections

__all__ = [
    "KV_CALIBRATION_MARGIN", "KV_CALIBRATION_PERCENTILE",
    "KV_CALIBRATION_SEQUENCES", "KVScales", "Publisher", "RefitReport", "calibrate_kv",
    "fp8_kv_cache", "fp8_query", "refit_generators",
]

# FP8 KV-cache calibration (docs/refit.md, "FP8 KV cache"); config keys
# ``refit.kv_calibration_sequences``, ``_percentile`` and ``_margin`` until issue 50, and
# ``refit.kv_calibrate_q`` (query scales for an engine that did not report
# ``kv_quantized_query``: such an engine's plugin should report it).
KV_CALIBRATION_SEQUENCES = 64
"""Sequences the trainers calibrate FP8 KV-cache scales on after every step (of the step's,
one per group first), and before the first step (training prompts)."""
KV_CALIBRATION_PERCENTILE = 99.9
"""Percentile, across micro-batches, of each layer's per-micro-batch amax (then the max across
trainer ranks): one outlier micro-batch does not set the scale alone."""
KV_CALIBRATION_MARGIN = 1.05
"""Head-room for the next step's data: ``scale = amax * margin / 448`` (448: FP8 E4M3's
largest value)."""

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
    *,
    timeout_s: float,
    include_q: bool = False,
) -> dict[str, float]:
    """FP8 KV-cache scales of the trainers' current weights on ``batch`` (dealt over the
    ranks, which max their amaxes together), with query scales if ``include_q`` (a generator
    reported ``kv_quantized_query``: :func:`fp8_query`).

    Raises:
        RefitError: the ranks disagree (they must have reduced to the same scales).
    """
    requests = [
        CalibrateKV(
            batch=part,
            percentile=KV_CALIBRATION_PERCENTILE,
            margin=KV_CALIBRATION_MARGIN,
            include_q=include_q,
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
        *,
        timeout_s: float,
        metrics: Any = None,
    ) -> None:
        caps = [control.peers[w].capabilities for w in rollouts]
        self.enabled = fp8_kv_cache(caps)
        self.include_q = fp8_query(caps)
        self._control, self._trainers = control, trainers
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
            self._control, self._trainers, batch, timeout_s=self._timeout_s,
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
        n = KV_CALIBRATION_SEQUENCES
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
        return await self.calibrate(make_probe(groups, KV_CALIBRATION_SEQUENCES), version)


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


class Publisher:
    """Publishes the trainer's weights to the generators. Every method that refits
    (:meth:`publish`, :meth:`first`, :meth:`refit_worker`) expects the caller to hold the
    weights lock: the trainer's weights are those sent, and the generators serve them when
    it returns. :meth:`abort` (engines told to drop groups), :meth:`verify` and
    :meth:`check_verified` need no lock.

    ``serving()``: the rollout workers that serve now (a refit goes to them; one that dies
    meanwhile is left out, it is restarted: :meth:`receiver_gone`).
    """

    def __init__(
        self,
        ctx: RunContext,
        *,
        kv: KVScales,
        transfer_address: str,
        rejections: Rejections,
        cancel_episodes: Callable[[list[str]], None] | None = None,
    ) -> None:
        config = self.config = ctx.config
        self.control, self.trainers = ctx.control, ctx.trainers
        self.groups, self.rollout, self.training = ctx.groups, ctx.rollout, ctx.training
        self.serving, self.probes, self.changed = ctx.serving, ctx.probes, ctx.changed
        self.metrics, self.now = ctx.metrics, ctx.now
        self._cancel_episodes = cancel_episodes
        """Cancels the episodes of aborted groups (a multi-turn environment's runner)."""
        self.kv = kv
        self.transfer_address = transfer_address
        self.rejections = rejections
        self._kv_scales: dict[str, float] | None = None
        """The FP8 KV-cache scales of the last refit (a restarted worker gets them too)."""
        self._probe: TokenBatch | None = None
        """The refit-verification probe batch, frozen from the first trained step."""
        self.check = RefitCheck.measured()
        """Judges verified refits against the baseline measured before the first update."""
        self._baseline_s = 0.0
        """Time the baseline took, not yet reported: the step it was measured in reports it
        with its verification (:meth:`verify`)."""
        self._reprefill = in_flight_at_refit(config.sampler) == "reprefill"
        """Requests in flight at a step's refit recompute their KV cache (the sampler's
        choice; docs/modes.md)."""

    async def publish(self, step: int, groups: Sequence[Any]) -> tuple[StepStats, RefitRecord]:
        """Step ``step`` (trained on ``groups``) took its optimizer step: bump the version,
        abort what became hopeless, refit. Returns the step's counters and what its refit
        measured. Cancellation: the refit is abandoned (the run is over)."""
        # the version bump and the gate's closing are one event of the live groups: no
        # dispatch can see version v+1 before the generators serve it
        self.training.finish_step()
        self.changed.notify()
        refit_start = self.now()
        log.debug("refit_started", version=step + 1)
        await self.abort(self.rollout.begin_refit())
        # taking turns, the engines sleep now: a drain came before the sleep (asyncrl.run.turns)
        drain = self.config.refit.drain and self.config.cluster.placement != "take_turns"
        drain_s, drain_timeouts = await self.drain() if drain else (0.0, 0)
        inflight_at_refit = self.groups.inflight_samples
        kv_scales = await self.kv.after_step(groups, step + 1)
        report = await self._refit(step + 1, kv_scales, self.serving(), reprefill=self._reprefill)
        self._kv_scales = kv_scales
        refit_end = self.now()
        refit = RefitRecord(
            refit_start=refit_start, refit_end=refit_end, refit_s=refit_end - refit_start,
            drain_s=drain_s, drain_timeouts=drain_timeouts, inflight_at_refit=inflight_at_refit,
            engine_busy_s=report.busy_s, refit_pack_s=report.pack_s,
        )  # fmt: skip
        stats = self.training.end_refit()
        self.changed.notify()
        return stats, refit

    async def abort(self, aborts: Aborts) -> None:
        """Tell each engine to abort its groups and episodes' turns (their samples still come
        back, cut short, and free their slots), and cancel the aborted groups' episodes."""
        if aborts.count:
            log.info("groups_aborted", count=aborts.count,
                     trainer_version=self.groups.trainer_version)  # fmt: skip
        if aborts.episodes:
            assert self._cancel_episodes is not None
            self._cancel_episodes(aborts.episodes)
        async with anyio.create_task_group() as tg:
            for worker, gids in aborts.by_worker.items():
                tg.start_soon(self._abort_on, worker, gids)

    async def _abort_on(self, worker: str, group_ids: list[str]) -> None:
        # a worker that died: its groups were dispatched again (worker_lost)
        await self.control.call_unless_restarting(
            worker, Abort(group_ids=group_ids), timeout_s=self.config.cluster.call_timeout_s
        )

    async def drain(self) -> tuple[float, int]:
        """Wait until no sample is generating, at most :data:`DRAIN_TIMEOUT_S`; returns the
        seconds waited and 1 if the wait timed out (else 0)."""
        start = self.now()
        with anyio.move_on_after(DRAIN_TIMEOUT_S) as scope:
            while not self.groups.drained:
                await self.changed.wait()
        drain_s = self.now() - start
        if not scope.cancelled_caught:
            return drain_s, 0
        log.warning(
            "drain_timed_out",
            inflight_samples=self.groups.inflight_samples,
            timeout_s=DRAIN_TIMEOUT_S,
        )
        return drain_s, 1

    async def first(self, resumed: bool, prompts: PromptStream, tokenizer: Tokenizer) -> None:
        """Before the first dispatch: a resumed run refits the generators from the restored
        weights (the engines start from ``model.path``); with an FP8 KV cache, every run
        refits with calibrated scales, so no step runs on scales of 1.0."""
        if resumed or self.kv.enabled:
            kv_scales = await self.kv.initial(prompts, tokenizer)
            await self._refit(self.groups.trainer_version, kv_scales, self.serving())
            self._kv_scales = kv_scales

    async def receiver_gone(self, worker: str) -> None:
        """Rollout ``worker`` died: tell trainer rank 0, so a refit under way leaves it out
        now (its own pid watch sees nothing of another host's process). Needs no lock. A
        trainer that is gone is its own watcher's to report."""
        with contextlib.suppress(WorkerError):
            await self.control.cast(self.trainers[0], ReceiverGone(receiver=worker))

    async def refit_worker(self, worker: str) -> int:
        """Refit restarted ``worker`` alone to the trainer's weights, with the last FP8
        KV-cache scales; returns their version."""
        version = self.groups.trainer_version
        await self._refit(version, self._kv_scales, [worker])
        return version

    async def _refit(
        self, version: int, kv_scales: dict[str, float] | None, receivers: list[str],
        *, reprefill: bool = False,
    ) -> RefitReport:
        """Send weights ``version`` (and FP8 KV-cache scales) from the trainers to
        ``receivers`` (``reprefill``: their requests in flight recompute their KV cache);
        return when they serve them. Cancellation: abandons the transfer."""
        report = await refit_generators(
            self.control,
            self.trainers,
            receivers,
            version=version,
            transfer_address=self.transfer_address,
            refit=self.config.refit,
            timeout_s=self.config.cluster.call_timeout_s,
            kv_scales=kv_scales,
            reprefill=reprefill,
        )
        if report.rejected_frames:  # the sender's count covers the whole run
            self.rejections.counts["weights"] = report.rejected_frames
        return report

    async def baseline(self, step: int, groups: Sequence[Any]) -> None:
        """Before the trainers train any of step ``step`` (its first chunk's ``groups`` are
        in), until the refit check has its baseline: freeze the probe batch from the groups
        and score it on both sides, which hold the same weights now (docs/refit.md, 'Refit
        verification'). Before any backward pass: a forward between a backward and its
        optimizer step left FSDP2 (one rank, float32) unable to free a gathered parameter at
        the next backward.

        Raises:
            RefitError: the two sides disagree beyond ``asyncrl.policy.verify.MAX_NOISE``
                already.
        """
        cfg = self.config.refit
        if self.check.started or not cfg.verify_every_steps:
            return
        if self._probe is None:
            self._probe = make_probe(groups, verify.PROBE_SEQUENCES)
        if self._probe is None:
            return  # no tokens to probe with yet: the next step's
        start = self.now()
        agreements = self.check.baseline(step, *await self.probes.scores(self._probe))
        self._record_verified(agreements, baseline=True)
        self._baseline_s += self.now() - start

    async def verify(self, step: int) -> Verification:
        """After step ``step``'s refit, when due (``VERIFY_FIRST_STEPS``,
        ``refit.verify_every_steps``) and once the baseline was measured: every generator's
        logprobs of the probe batch against the trainer's, judged. Returns the judgements
        (none when not due) and the time spent on them, with the baseline's when this step
        measured it. Cancellation: the check is abandoned (the run is over)."""
        cfg = self.config.refit
        seconds, self._baseline_s = self._baseline_s, 0.0
        agreements: list[Agreement] = []
        if self.check.started and verification_due(step + 1, cfg.verify_every_steps):
            start = self.now()
            assert self._probe is not None
            agreements = self.check.judge(step + 1, *await self.probes.scores(self._probe))
            self._record_verified(agreements)
            seconds += self.now() - start
        return Verification(tuple(agreements), seconds)

    def _record_verified(self, agreements: list[Agreement], *, baseline: bool = False) -> None:
        """A record per generator, ``refit_verify`` (a judged refit) or ``refit_baseline``
        (before any update), and a log line."""
        kind = "refit_baseline" if baseline else "refit_verify"
        for a in agreements:
            if self.metrics is not None:
                self.metrics.write({"kind": kind, **a.metrics(), "time": self.now()})
            log.info("refit_baseline" if baseline else "refit_verified", **a.metrics())

    @staticmethod
    def check_verified(verification: Verification) -> None:
        """Stop the run if a generator disagreed with the trainer in ``verification``."""
        for agreement in verification.agreements:
            agreement.check()
