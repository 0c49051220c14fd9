"""One optimizer step's timing and counters, and the metrics record made from them (pure).

A step's record (:class:`StepRecord`) is put together from parts, each written only by the
place that measures it and handed over as a value when the step ends (the train pump,
``Pipeline._step`` in :mod:`asyncrl.run.loops`, assembles them), so every counter has one
writer to look for:

- :class:`TrainRecord`: ``StepAssembler`` (run/train_step.py), with what ``Refresher.refresh``
  (run/refresh.py) returns for each chunk; the only part written while the step is open;
- :class:`RefitRecord`: ``Publisher.publish`` (run/refit.py);
- :class:`Verification`: ``Publisher.verify`` (run/refit.py), its baseline's time included;
- :class:`RolloutRecord`: the pipeline at the step's end, from ``Feeder.take_aborted``
  (run/intake.py), the rollout pump's gate wait and ``Scorer.take_spent`` (run/scoring.py);
- :class:`WorkerTimes`: the workers' own accounts (``ControlPlane.take_served``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import structlog

from asyncrl.policy.groups import CompletedSample, Group
from asyncrl.policy.loss_inputs import kl_estimate
from asyncrl.wire.messages import ChunkResult, StepResult, TrainBatch
from asyncrl.policy.counts import StepStats
from asyncrl.obs.timeline import worker_spans
from asyncrl.policy.verify import Agreement

__all__ = [
    "Mismatch", "RefitRecord", "RolloutRecord", "StepRecord", "TrainRecord", "Verification",
    "WorkerTimes", "log_step", "trainer_memory",
]

log = structlog.get_logger("asyncrl.run.loops")


class Mismatch(NamedTuple):
    """The trainer's pre-step logprobs against the generator's over trained tokens (the
    refreshed proximal logprobs: ``d = lp - beh``)."""

    abs_sum: float = 0.0
    """Sum of ``|d|``."""
    abs_max: float = 0.0
    """Largest ``|d|``."""
    k3_sum: float = 0.0
    """Sum of the k3 estimates ``exp(d) - 1 - d``."""
    tokens: int = 0

    @classmethod
    def of(cls, diff: np.ndarray, trained: np.ndarray) -> Mismatch:
        """A chunk's: its differences ``diff`` (per response token) over its ``trained``
        tokens."""
        d = diff[trained.astype(bool)].astype(np.float64)
        k3 = kl_estimate(np.zeros_like(d), d, "k3")  # exp(d) - 1 - d
        return cls(float(np.abs(d).sum()), float(np.abs(d).max(initial=0.0)),
                   float(k3.sum()), d.size)  # fmt: skip

    def merged(self, other: Mismatch) -> Mismatch:
        """This and ``other`` over both their tokens."""
        return Mismatch(self.abs_sum + other.abs_sum, max(self.abs_max, other.abs_max),
                        self.k3_sum + other.k3_sum, self.tokens + other.tokens)  # fmt: skip


@dataclass
class TrainRecord:
    """The training phase of one step: its chunks, the trainer's time and waits.

    Written only by :class:`~asyncrl.run.train_step.StepAssembler`, which keeps it while the
    step is open (a failed step is trained again into the same record: :meth:`restart`) and
    hands it over with the step's results once the optimizer step is taken; nobody writes it
    after that.
    """

    train_start: float | None = None
    train_end: float | None = None
    wait_spans: list[tuple[float, float]] = field(default_factory=list)
    """The trainer's waits in this step (run clock): for data (no chunk ready), or for a
    validation before the step's ``FinishStep``; the timeline's ``waiting`` lane."""
    step_retries: int = 0
    """Times this step was assembled again after a train call failed on a trainer."""
    nonfinite_skipped: bool = False
    """The step's loss or gradient norm was not finite: the trainer did not apply it
    (``failures.max_nonfinite_steps``)."""
    train_busy_s: float = 0.0
    """Time the trainer ranks spent on this step's TrainChunk and FinishStep calls."""
    chunks: int = 0
    groups: list[Group] = field(default_factory=list)
    chunk_results: list[ChunkResult] = field(default_factory=list)
    advantages: list[np.ndarray] = field(default_factory=list)
    """Each chunk's per-sequence advantages (before ``sequence_mean`` scales them)."""
    sequences: int = 0
    """The step's sequences that train a token (``loss.aggregation``'s count)."""
    refresh_s: dict[str, float] = field(default_factory=dict)
    """Time the trainer ranks spent on this step's logprob refreshes, by kind (``proximal``,
    ``reference``): what :class:`~asyncrl.policy.loss_inputs.LossInputs` asked for."""
    kl_sum: float = 0.0
    """With the KL term in the reward: the sum of its estimates over the trained tokens."""
    kl_tokens: int = 0
    mismatch: Mismatch | None = None
    """With refreshed proximal logprobs: the trainer's pre-step logprobs against the
    generator's over the step's trained tokens (else the first forward of each chunk's loss
    measures it)."""
    batches: list[TrainBatch] = field(default_factory=list)
    """The step's packed (and refreshed) chunks, kept for its mini-steps."""
    mini_steps: list[dict[str, Any]] = field(default_factory=list)
    """Each optimizer step of this RL step: its pass, mini-batch, loss, gradient norm,
    clip fraction and tokens (``grpo.mini_steps`` x ``grpo.update_epochs``)."""

    @property
    def wait_s(self) -> float:
        """Trainer time waiting in this step (the sum of :attr:`wait_spans`)."""
        return sum(b - a for a, b in self.wait_spans)

    def waited(self, start: float, end: float) -> None:
        """The trainer waited from ``start`` to ``end`` in this step."""
        if end > start:
            self.wait_spans.append((start, end))

    def restart(self) -> None:
        """The step failed on a trainer and is assembled again: forget its chunks (its
        groups went back to the buffer); its waits, busy time and retries stay."""
        self.groups, self.chunk_results, self.advantages, self.chunks = [], [], [], 0
        self.sequences, self.batches, self.mini_steps, self.refresh_s = 0, [], [], {}
        self.kl_sum, self.kl_tokens, self.mismatch = 0.0, 0, None
        self.train_start = None
        self.step_retries += 1


@dataclass(frozen=True)
class RefitRecord:
    """The refit after one step, from the version bump to the generators serving the new
    weights: what :meth:`Publisher.publish <asyncrl.run.refit.Publisher.publish>` measured
    and what the refit's workers reported."""

    refit_start: float | None = None
    refit_end: float | None = None
    refit_s: float = 0.0
    """From the version bump to the generators serving the new weights."""
    drain_s: float = 0.0
    drain_timeouts: int = 0
    inflight_at_refit: int = 0
    """Samples still generating when the weights were swapped (0 after a complete drain)."""
    engine_busy_s: float = 0.0
    """Time the generators were generating since the previous refit (slowest rank), as they
    reported it with this refit."""
    refit_pack_s: float = 0.0
    """Trainer rank 0's time producing and packing this refit's buckets (gathers included):
    the part of ``refit_work_s`` spent on the trainer's side of the transfer."""


@dataclass(frozen=True)
class Verification:
    """The refit check of one step (:meth:`Publisher.verify
    <asyncrl.run.refit.Publisher.verify>`): each generator's agreement with the trainer when
    the refit was verified, and the time spent on it (the baseline's too, when this step
    measured it)."""

    agreements: tuple[Agreement, ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True)
class RolloutRecord:
    """The rollout side's counters of one step, each taken from the one place that counts
    it when the step's record is made."""

    aborted_samples: int = 0
    """Samples the engines cut short (finish reason ``abort``) while this step was open
    (:meth:`Feeder.take_aborted <asyncrl.run.intake.Feeder.take_aborted>`)."""
    gate_wait_s: float = 0.0
    """Rollout pump time waiting for the gate (a refit) since the previous step's record."""
    score_s: float = 0.0
    """The controller's time scoring samples (the environment's ``score``, on threads or
    inline) since the previous step (:meth:`Scorer.take_spent
    <asyncrl.run.scoring.Scorer.take_spent>`)."""


@dataclass(frozen=True)
class WorkerTimes:
    """The workers' own time serving one step's calls, as they measured it."""

    trainer_compute_s: float = 0.0
    """The trainer's own time serving this step's TrainChunk and FinishStep calls (slowest
    rank)."""
    refit_work_s: float = 0.0
    """The workers' own time in this step's refit (the longest SendWeights/ReceiveWeights)."""

    @classmethod
    def of(cls, served: dict[tuple[str, str], float], trainers: list[str]) -> WorkerTimes:
        """From ``ControlPlane.take_served``'s seconds by (worker, method): the slowest
        trainer's train calls, the longest refit call."""
        return cls(
            trainer_compute_s=max(
                served.get((t, "TrainChunk"), 0.0) + served.get((t, "FinishStep"), 0.0)
                for t in trainers
            ),
            refit_work_s=max(
                [v for (_, m), v in served.items() if m in ("SendWeights", "ReceiveWeights")],
                default=0.0,
            ),
        )


@dataclass(frozen=True)
class StepRecord:
    """One step (one batch: generation, training, refit) as its parts measured it: what
    its metrics record is made from."""

    step: int
    train: TrainRecord = field(default_factory=TrainRecord)
    refit: RefitRecord = field(default_factory=RefitRecord)
    verification: Verification = field(default_factory=Verification)
    rollout: RolloutRecord = field(default_factory=RolloutRecord)
    workers: WorkerTimes = field(default_factory=WorkerTimes)

    def metrics(
        self,
        result: StepResult,
        refit_s: float,
        stats: StepStats,
        *,
        buffer_ready: int,
        buffer_live: int,
        inflight_samples: int,
        loop_lags: list[float],
        rejected_frames: int,
        now: float,
    ) -> dict[str, Any]:
        """The step's metrics record (one JSON line of ``metrics.jsonl``, kind ``train``),
        with ``reward/<name>`` the mean of each ``Score.components`` entry.

        Built from the parts below in a fixed key order (the line's column order).

        Raises:
            ValueError: The step has no groups (a record is made only after a step trained).
        """
        groups = self.train.groups
        samples = [s for g in groups for s in g.samples]
        gen_start = min(g.dispatched_at for g in groups)
        gen_end = max(g.committed_at or g.dispatched_at for g in groups)
        record: dict[str, Any] = {
            "step": self.step + 1,
            **self._learning(result, samples),
            **self._durations(refit_s, gen_start, gen_end),
            **self._flow(
                stats,
                buffer_ready=buffer_ready,
                buffer_live=buffer_live,
                inflight_samples=inflight_samples,
            ),
            **self._where_time_went(gen_start, gen_end),
            "loop_lag_p99_s": float(np.quantile(loop_lags, 0.99)) if loop_lags else 0.0,
            "loop_lag_max_s": max(loop_lags, default=0.0),
            "rejected_frames": rejected_frames,
            "time": now,
        }
        if self.verification.agreements:
            record.update(self._verify_metrics())
        record.update(_reward_components(samples))
        return record

    def _learning(self, result: StepResult, samples: list[CompletedSample]) -> dict[str, Any]:
        """What the step learned from: rewards, staleness, the trainer's loss and ratios."""
        train = self.train
        stale = [self.step - g.start_version for g in train.groups]
        n_tok = max(1, sum(r.num_loss_tokens for r in train.chunk_results))
        return {
            "reward": float(np.mean([s.reward for s in samples])),
            "accuracy": float(np.mean([s.correct for s in samples])),
            "staleness_max": int(max(stale)),
            "staleness_mean": float(np.mean(stale)),
            **self._token_staleness(),
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "clip_frac": sum(r.clipped_tokens for r in train.chunk_results) / n_tok,
            **self._mismatch(n_tok),
            "masked_tokens": sum(r.masked_tokens for r in train.chunk_results),
            **self._objective_terms(n_tok),
            **self._advantage_stats(),
            "response_len": float(np.mean([len(s.token_ids) for s in samples])),
            "response_tokens": sum(len(s.token_ids) for s in samples),
            "chunks": train.chunks,
            "groups": len(train.groups),
        }

    def _mismatch(self, n_tok: int) -> dict[str, float]:
        """Trainer vs generator logprobs over the trained tokens: mean and max ``|d|``, mean
        k3. Measured on the pre-step weights: the refreshed proximal logprobs when there
        are, else each chunk's loss forward (the same weights with one optimizer step)."""
        mismatch = self.train.mismatch
        if mismatch is not None:
            tokens = max(mismatch.tokens, 1)
            return {"logprob_diff": mismatch.abs_sum / tokens,
                    "logprob_diff_max": mismatch.abs_max,
                    "mismatch_k3": mismatch.k3_sum / tokens}  # fmt: skip
        results = self.train.chunk_results
        return {
            "logprob_diff": sum(r.abs_logprob_diff_sum for r in results) / n_tok,
            "logprob_diff_max": max((r.abs_logprob_diff_max for r in results), default=0.0),
            "mismatch_k3": sum(r.mismatch_k3_sum for r in results) / n_tok,
        }

    def _objective_terms(self, n_tok: int) -> dict[str, Any]:
        """The KL to the reference per trained token (in the loss, or in the reward), the
        refreshes' times and the mini-steps, when the run has them."""
        train = self.train
        out: dict[str, Any] = {}
        if train.kl_tokens:  # in the reward: over the sampled tokens
            out["kl_ref"] = train.kl_sum / train.kl_tokens
        elif "reference" in train.refresh_s:  # in the loss: over every trained forward
            out["kl_ref"] = sum(r.kl_sum for r in train.chunk_results) / n_tok
        for kind, seconds in sorted(train.refresh_s.items()):
            out[f"refresh_{kind}_s"] = seconds
        if train.mini_steps:
            out["mini_steps"] = train.mini_steps
        return out

    def _advantage_stats(self) -> dict[str, float]:
        """The step's per-sequence advantages (``grpo.advantage_estimator``): mean, std, min
        and max over every sequence it trained."""
        advantages = self.train.advantages
        a = np.concatenate(advantages) if advantages else np.zeros(1, np.float32)
        a = a.astype(np.float64)
        return {"advantage_mean": float(a.mean()), "advantage_std": float(a.std()),
                "advantage_min": float(a.min()), "advantage_max": float(a.max())}  # fmt: skip

    def _token_staleness(self) -> dict[str, Any]:
        """Staleness per trained token: the step minus the version that generated it (a
        sequence in flight during a refit has tokens of several versions; a group's
        ``staleness`` counts from its dispatch, the oldest its tokens can be)."""
        groups = self.train.groups
        versions = [s.trained_versions(g.start_version) for g in groups for s in g.samples]
        starts = [g.start_version for g in groups for _ in g.samples]
        trained = np.concatenate(versions) if versions else np.zeros(0, np.int32)
        # each token's group start beside it: one comparison for the step, not one a sample
        later = int((trained > np.repeat(starts, [v.size for v in versions])).sum())
        stale = self.step - trained.astype(np.int64)
        if not stale.size:
            return {"token_staleness_max": 0, "token_staleness_mean": 0.0,
                    "token_staleness_hist": {}, "tokens_after_refit": 0}  # fmt: skip
        values, counts = np.unique(stale, return_counts=True)
        return {
            "token_staleness_max": int(stale.max()),
            "token_staleness_mean": float(stale.mean()),
            "token_staleness_hist": {str(int(v)): int(c) for v, c in zip(values, counts)},
            # generated after a refit that came while their request was in flight
            "tokens_after_refit": later,
        }

    def _durations(self, refit_s: float, gen_start: float, gen_end: float) -> dict[str, Any]:
        """How long each phase took, and the trainer's and the pump's waits."""
        train = self.train
        return {
            # the generation span of this step's own groups: first dispatch to last commit
            "gen_s": gen_end - gen_start,
            "train_s": (train.train_end or 0.0) - (train.train_start or 0.0),
            "refit_s": refit_s,
            "wait_s": train.wait_s,
            "wait_spans": [[round(a, 6), round(b, 6)] for a, b in train.wait_spans],
            "gen_by_worker": worker_spans(train.groups),
            "gate_wait_s": self.rollout.gate_wait_s,
        }

    def _flow(
        self, stats: StepStats, *, buffer_ready: int, buffer_live: int, inflight_samples: int
    ) -> dict[str, Any]:
        """The scheduler's counters, the buffer's fill, the drain and the failures."""
        train, refit = self.train, self.refit
        return {
            "staleness_hist": {str(k): v for k, v in sorted(stats.staleness.items())},
            "evicted_groups": stats.evicted_groups,
            "filtered_groups": stats.filtered_groups,
            "filter_cap_reached": stats.filter_cap_reached,
            "aborted_groups": stats.aborted_groups,
            "wasted_samples": stats.wasted_samples,
            "buffer_ready": buffer_ready,
            "buffer_live": buffer_live,
            "inflight_samples": inflight_samples,
            "inflight_samples_max": stats.inflight_samples_max,
            "drain_s": refit.drain_s,
            "drain_timeouts": refit.drain_timeouts,
            "aborted_samples": self.rollout.aborted_samples,
            "failed_groups": stats.failed_groups,
            "step_retries": train.step_retries,
            "nonfinite_skipped": train.nonfinite_skipped,
            "generation_retries": stats.generation_retries,
            "inflight_at_refit": refit.inflight_at_refit,
        }

    def _where_time_went(self, gen_start: float, gen_end: float) -> dict[str, Any]:
        """Each side's own busy time and the phases' timestamps (run clock)."""
        train, refit = self.train, self.refit
        return {
            "train_busy_s": train.train_busy_s,
            "trainer_compute_s": self.workers.trainer_compute_s,
            "engine_busy_s": refit.engine_busy_s,
            "score_s": self.rollout.score_s,
            "refit_work_s": self.workers.refit_work_s,
            "refit_pack_s": refit.refit_pack_s,
            "gen_start": gen_start,
            "gen_end": gen_end,
            "train_start": train.train_start,
            "train_end": train.train_end,
            "refit_start": refit.refit_start,
            "refit_end": refit.refit_end,
        }

    def _verify_metrics(self) -> dict[str, Any]:
        """The worst generator's agreement with the trainer after this step's refit."""
        agreements = self.verification.agreements
        return {
            "refit_verify_mean_abs": max(a.mean_abs for a in agreements),
            "refit_verify_max_abs": max(a.max_abs for a in agreements),
            "refit_verify_mult_prob_error": max(a.mult_prob_error for a in agreements),
            "refit_verify_bound": min(a.bound for a in agreements),
            "verify_s": self.verification.seconds,
        }


def _reward_components(samples: list[CompletedSample]) -> dict[str, float]:
    """``reward/<name>``: each reward component's mean over the samples that have it (a
    group restored from a checkpoint carries none), in name order."""
    record: dict[str, float] = {}
    for name in sorted({k for s in samples for k in s.components}):
        values = [s.components[name] for s in samples if name in s.components]
        record[f"reward/{name}"] = float(np.mean(values))
    return record


def trainer_memory(results: list[StepResult], planned: int | None = None) -> dict[str, float]:
    """The step's accelerator memory peaks, the largest of the trainer ranks', in GiB
    (``trainer_peak_allocated_gib``: its tensors; ``trainer_peak_reserved_gib``: its
    allocator's hold on the device), and beside them ``trainer_plan_gib``, what the memory plan
    said a rank holds at its peak (``planned`` bytes, when known); nothing where the
    ranks did not measure them (CPU)."""
    allocated = max(r.peak_allocated_bytes for r in results)
    if not allocated:
        return {}
    reserved = max(r.peak_reserved_bytes for r in results)
    out = {"trainer_peak_allocated_gib": round(allocated / 2**30, 3),
           "trainer_peak_reserved_gib": round(reserved / 2**30, 3)}  # fmt: skip
    if planned:
        out["trainer_plan_gib"] = round(planned / 2**30, 3)
    return out


def log_step(record: dict[str, Any], result: StepResult, refit_s: float, rec: StepRecord) -> None:
    """The ``step_finished`` log line of a step's record."""
    log.info(
        "step_finished",
        step=record["step"],
        reward=round(record["reward"], 4),
        accuracy=round(record["accuracy"], 4),
        staleness=record["staleness_max"],
        loss=round(result.loss, 5),
        grad_norm=round(result.grad_norm, 4),
        gen_s=round(record["gen_s"], 3),
        train_s=round(record["train_s"], 3),
        refit_s=round(refit_s, 3),
        wait_s=round(rec.train.wait_s, 3),
        **({"refit_verify": round(record["refit_verify_mean_abs"], 4)}
           if rec.verification.agreements else {}),
        **({"step_retries": rec.train.step_retries} if rec.train.step_retries else {}),
        **({"failed_groups": record["failed_groups"]} if record["failed_groups"] else {}),
    )
