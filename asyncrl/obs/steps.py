"""One optimizer step's timing and counters, and the metrics record made from them (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from asyncrl.policy.groups import CompletedSample, Group
from asyncrl.policy.loss_inputs import kl_estimate
from asyncrl.wire.messages import ChunkResult, StepResult, TrainBatch
from asyncrl.policy.schedule import StepStats
from asyncrl.obs.timeline import worker_spans
from asyncrl.policy.verify import Agreement

__all__ = ["StepRecord", "log_step"]

log = structlog.get_logger("asyncrl.run.loops")


@dataclass
class StepRecord:
    """Timing and counters of one step (one batch: generation, training, refit)."""

    step: int
    train_start: float | None = None
    train_end: float | None = None
    wait_spans: list[tuple[float, float]] = field(default_factory=list)
    """The trainer's waits in this step (run clock): for data (no chunk ready), or for a
    validation before the step's ``FinishStep``; the timeline's ``waiting`` lane."""
    gate_wait_s: float = 0.0
    """Rollout pump time waiting for the gate (a refit) since the previous step's record."""
    drain_s: float = 0.0
    drain_timeouts: int = 0
    refit_s: float = 0.0
    """From the version bump to the generators serving the new weights."""
    refit_start: float | None = None
    refit_end: float | None = None
    step_retries: int = 0
    """Times this step was assembled again after a train call failed on a trainer."""
    nonfinite_skipped: bool = False
    """The step's loss or gradient norm was not finite: the trainer did not apply it
    (``failures.max_nonfinite_steps``)."""
    aborted_samples: int = 0
    """Samples the engines cut short (finish reason ``abort``) while this step was open."""
    trainer_compute_s: float = 0.0
    """The trainer's own time serving this step's TrainChunk and FinishStep calls (slowest
    rank), as the worker measured it."""
    engine_busy_s: float = 0.0
    """Time the generators were generating since the previous refit (slowest rank)."""
    score_s: float = 0.0
    """The controller's time scoring samples (the environment's ``score``, on threads or
    inline) since the previous step."""
    refit_work_s: float = 0.0
    """The workers' own time in this step's refit (the longest SendWeights/ReceiveWeights)."""
    refit_pack_s: float = 0.0
    """Trainer rank 0's time producing and packing this step's refit buckets (gathers
    included): the part of ``refit_work_s`` spent on the trainer's side of the transfer."""
    train_busy_s: float = 0.0
    """Time the trainer ranks spent on this step's TrainChunk and FinishStep calls."""
    inflight_at_refit: int = 0
    """Samples still generating when the weights were swapped (0 after a complete drain)."""
    chunks: int = 0
    groups: list[Group] = field(default_factory=list)
    chunk_results: list[ChunkResult] = field(default_factory=list)
    advantages: list[np.ndarray] = field(default_factory=list)
    """Each chunk's per-sequence advantages (before ``sequence_mean`` scales them)."""
    sequences: int = 0
    """The step's sequences that train a token (``loss.aggregation``'s count)."""
    verify: list[Agreement] = field(default_factory=list)
    verify_s: float = 0.0
    refresh_s: dict[str, float] = field(default_factory=dict)
    """Time the trainer ranks spent on this step's logprob refreshes, by kind (``proximal``,
    ``reference``): what :class:`~asyncrl.policy.loss_inputs.LossInputs` asked for."""
    kl_sum: float = 0.0
    """With the KL term in the reward: the sum of its estimates over the trained tokens."""
    kl_tokens: int = 0
    mismatch: tuple[float, float, float, int] | None = None
    """With refreshed proximal logprobs: the trainer's pre-step logprobs against the
    generator's over the step's trained tokens: sum of ``|d|``, max ``|d|``, sum of k3,
    tokens (else the first forward of each chunk's loss measures it)."""
    batches: list[TrainBatch] = field(default_factory=list)
    """The step's packed (and refreshed) chunks, kept for its mini-steps."""
    mini_steps: list[dict[str, Any]] = field(default_factory=list)
    """Each optimizer step of this RL step: its pass, mini-batch, loss, gradient norm,
    clip fraction and tokens (``grpo.mini_steps`` x ``grpo.update_epochs``)."""

    def refreshed(self, kind: str, seconds: float) -> None:
        self.refresh_s[kind] = self.refresh_s.get(kind, 0.0) + seconds

    def measured_mismatch(self, diff: np.ndarray, trained: np.ndarray) -> None:
        """Add a chunk's pre-step trainer/generator differences ``diff`` (per response
        token) over its ``trained`` tokens to :attr:`mismatch`."""
        d = diff[trained.astype(bool)].astype(np.float64)
        k3 = kl_estimate(np.zeros_like(d), d, "k3")  # exp(d) - 1 - d
        old = self.mismatch or (0.0, 0.0, 0.0, 0)
        self.mismatch = (old[0] + float(np.abs(d).sum()),
                         max(old[1], float(np.abs(d).max(initial=0.0))),
                         old[2] + float(k3.sum()), old[3] + d.size)  # fmt: skip

    def take_served(self, served: dict[tuple[str, str], float], trainers: list[str]) -> None:
        """The workers' own time serving this step's calls (``ControlPlane.take_served``):
        the slowest trainer's train calls, the longest refit call."""
        self.trainer_compute_s = max(
            served.get((t, "TrainChunk"), 0.0) + served.get((t, "FinishStep"), 0.0)
            for t in trainers
        )
        self.refit_work_s = max(
            [v for (_, m), v in served.items() if m in ("SendWeights", "ReceiveWeights")],
            default=0.0,
        )

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
        groups went back to the buffer)."""
        self.groups, self.chunk_results, self.advantages, self.chunks = [], [], [], 0
        self.sequences, self.batches, self.mini_steps, self.refresh_s = 0, [], [], {}
        self.kl_sum, self.kl_tokens, self.mismatch = 0.0, 0, None
        self.train_start = None
        self.step_retries += 1

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
        samples = [s for g in self.groups for s in g.samples]
        gen_start = min(g.dispatched_at for g in self.groups)
        gen_end = max(g.committed_at or g.dispatched_at for g in self.groups)
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
        if self.verify:
            record.update(self._verify_metrics())
        record.update(_reward_components(samples))
        return record

    def _learning(self, result: StepResult, samples: list[CompletedSample]) -> dict[str, Any]:
        """What the step learned from: rewards, staleness, the trainer's loss and ratios."""
        stale = [self.step - g.start_version for g in self.groups]
        n_tok = max(1, sum(r.num_loss_tokens for r in self.chunk_results))
        return {
            "reward": float(np.mean([s.reward for s in samples])),
            "accuracy": float(np.mean([s.correct for s in samples])),
            "staleness_max": int(max(stale)),
            "staleness_mean": float(np.mean(stale)),
            **self._token_staleness(),
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "clip_frac": sum(r.clipped_tokens for r in self.chunk_results) / n_tok,
            **self._mismatch(n_tok),
            "masked_tokens": sum(r.masked_tokens for r in self.chunk_results),
            **self._objective_terms(n_tok),
            **self._advantage_stats(),
            "response_len": float(np.mean([len(s.token_ids) for s in samples])),
            "response_tokens": sum(len(s.token_ids) for s in samples),
            "chunks": self.chunks,
            "groups": len(self.groups),
        }

    def _mismatch(self, n_tok: int) -> dict[str, float]:
        """Trainer vs generator logprobs over the trained tokens: mean and max ``|d|``, mean
        k3. Measured on the pre-step weights: the refreshed proximal logprobs when there
        are, else each chunk's loss forward (the same weights with one optimizer step)."""
        if self.mismatch is not None:
            abs_sum, abs_max, k3_sum, tokens = self.mismatch
            tokens = max(tokens, 1)
            return {"logprob_diff": abs_sum / tokens, "logprob_diff_max": abs_max,
                    "mismatch_k3": k3_sum / tokens}  # fmt: skip
        results = self.chunk_results
        return {
            "logprob_diff": sum(r.abs_logprob_diff_sum for r in results) / n_tok,
            "logprob_diff_max": max((r.abs_logprob_diff_max for r in results), default=0.0),
            "mismatch_k3": sum(r.mismatch_k3_sum for r in results) / n_tok,
        }

    def _objective_terms(self, n_tok: int) -> dict[str, Any]:
        """The KL to the reference per trained token (in the loss, or in the reward), the
        refreshes' times and the mini-steps, when the run has them."""
        out: dict[str, Any] = {}
        if self.kl_tokens:  # in the reward: over the sampled tokens
            out["kl_ref"] = self.kl_sum / self.kl_tokens
        elif "reference" in self.refresh_s:  # in the loss: over every trained forward
            out["kl_ref"] = sum(r.kl_sum for r in self.chunk_results) / n_tok
        for kind, seconds in sorted(self.refresh_s.items()):
            out[f"refresh_{kind}_s"] = seconds
        if self.mini_steps:
            out["mini_steps"] = self.mini_steps
        return out

    def _advantage_stats(self) -> dict[str, float]:
        """The step's per-sequence advantages (``grpo.advantage_estimator``): mean, std, min
        and max over every sequence it trained."""
        a = np.concatenate(self.advantages) if self.advantages else np.zeros(1, np.float32)
        a = a.astype(np.float64)
        return {"advantage_mean": float(a.mean()), "advantage_std": float(a.std()),
                "advantage_min": float(a.min()), "advantage_max": float(a.max())}  # fmt: skip

    def _token_staleness(self) -> dict[str, Any]:
        """Staleness per trained token: the step minus the version that generated it (a
        sequence in flight during a refit has tokens of several versions; a group's
        ``staleness`` counts from its dispatch, the oldest its tokens can be)."""
        versions = [s.trained_versions(g.start_version) for g in self.groups for s in g.samples]
        starts = [g.start_version for g in self.groups for _ in g.samples]
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
        return {
            # the generation span of this step's own groups: first dispatch to last commit
            "gen_s": gen_end - gen_start,
            "train_s": (self.train_end or 0.0) - (self.train_start or 0.0),
            "refit_s": refit_s,
            "wait_s": self.wait_s,
            "wait_spans": [[round(a, 6), round(b, 6)] for a, b in self.wait_spans],
            "gen_by_worker": worker_spans(self.groups),
            "gate_wait_s": self.gate_wait_s,
        }

    def _flow(
        self, stats: StepStats, *, buffer_ready: int, buffer_live: int, inflight_samples: int
    ) -> dict[str, Any]:
        """The scheduler's counters, the buffer's fill, the drain and the failures."""
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
            "drain_s": self.drain_s,
            "drain_timeouts": self.drain_timeouts,
            "aborted_samples": self.aborted_samples,
            "failed_groups": stats.failed_groups,
            "step_retries": self.step_retries,
            "nonfinite_skipped": self.nonfinite_skipped,
            "generation_retries": stats.generation_retries,
            "inflight_at_refit": self.inflight_at_refit,
        }

    def _where_time_went(self, gen_start: float, gen_end: float) -> dict[str, Any]:
        """Each side's own busy time and the phases' timestamps (run clock)."""
        return {
            "train_busy_s": self.train_busy_s,
            "trainer_compute_s": self.trainer_compute_s,
            "engine_busy_s": self.engine_busy_s,
            "score_s": self.score_s,
            "refit_work_s": self.refit_work_s,
            "refit_pack_s": self.refit_pack_s,
            "gen_start": gen_start,
            "gen_end": gen_end,
            "train_start": self.train_start,
            "train_end": self.train_end,
            "refit_start": self.refit_start,
            "refit_end": self.refit_end,
        }

    def _verify_metrics(self) -> dict[str, Any]:
        """The worst generator's agreement with the trainer after this step's refit."""
        return {
            "refit_verify_mean_abs": max(a.mean_abs for a in self.verify),
            "refit_verify_max_abs": max(a.max_abs for a in self.verify),
            "refit_verify_mult_prob_error": max(a.mult_prob_error for a in self.verify),
            "refit_verify_bound": min(a.bound for a in self.verify),
            "verify_s": self.verify_s,
        }


def _reward_components(samples: list[CompletedSample]) -> dict[str, float]:
    """``reward/<name>``: each reward component's mean over the samples that have it (a
    group restored from a checkpoint carries none), in name order."""
    record: dict[str, float] = {}
    for name in sorted({k for s in samples for k in s.components}):
        values = [s.components[name] for s in samples if name in s.components]
        record[f"reward/{name}"] = float(np.mean(values))
    return record

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
        wait_s=round(rec.wait_s, 3),
        **({"refit_verify": round(record["refit_verify_mean_abs"], 4)} if rec.verify else {}),
        **({"step_retries": rec.step_retries} if rec.step_retries else {}),
        **({"failed_groups": record["failed_groups"]} if record["failed_groups"] else {}),
    )
