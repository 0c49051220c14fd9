"""The ``bigram`` training backend (entry point ``asyncrl.training_backends:bigram``).

Exact GRPO/PPO gradients of the bigram table in float64, written out by hand. Per response
token, with ``lp = log softmax(W[prev] / T)[tok]`` and ``b`` the generator's logprob::

    r    = exp(lp - b)
    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)        (summed over tokens)

which is :func:`asyncrl_torch.loss.ppo_clip_loss` with the behaviour policy as proximal
policy (so its importance weight is 1). Only the tokens the batch's ``loss_mask`` selects
train: the others (observations inserted into a multi-turn sequence, with placeholder
behaviour logprobs) are left out before any arithmetic, and the step is normalized by the
count of trained tokens. Where the clip is inactive ``d loss / d lp = -A * r``; where it
binds (``A > 0, r > 1 + eps_high`` or ``A < 0, r < 1 - eps_low``) the gradient is 0; and
``d lp / d W[prev, j] = (onehot(tok)_j - softmax(W[prev] / T)_j) / T``.

``train_chunk`` adds the *sum* over the chunk's tokens into one gradient buffer;
``finish_step`` divides by the step's token count, clips the norm and updates: streaming a step
in chunks equals one big batch. The runtime calls these methods on one thread, in order. A
step whose loss or gradient norm is not finite is not applied (the weights and Adam's moments
stay as they were), and weights that are not finite are never saved nor taken from a
checkpoint (:class:`~asyncrl.plugin.backend.NonFiniteError`).

Jobs (docs/jobs.md; ``TrainsJobs``): each job trains a table of its own, started from the
base (the model's initial table), with its own gradient buffer, Adam state, learning rate and
open step, on the same ranks; the run's own table is the job ``""``. A bigram has no adapter to
keep apart from a base, so a job's policy is its whole table: the reference shows the
protocol's calls, not LoRA's memory savings.

Several ranks (``cluster.trainer_ranks > 1``) train data-parallel: each rank gets its share of
every chunk, and ``finish_step`` sums the gradient buffers over ranks (one gloo all-reduce)
before the identical update on every rank. Only then is torch imported: it shows how a backend
joins its group (``ctx.extra["dist_store"]`` under ``asyncrl.launch``, torchrun's ``env://``
when the controller spawned the group) while a one-rank run stays numpy only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from asyncrl.plugin.backend import (
    ChunkResult,
    NonFiniteError,
    StepResult,
    TokenBatch,
    TrainBatch,
    WeightTensor,
    WorkerContext,
    check_packed,
)

from . import __version__
from .model import TENSOR_NAME, ModelSpec, initial_table, log_softmax, response_tokens
from .model import token_logprobs
from .options import TrainerOptions, mark_phase, parse_options

__all__ = ["BigramTrainer", "ppo_gradient"]

_STATE_FILE = "bigram-state.npz"



def ppo_gradient(
    table: np.ndarray,
    batch: TrainBatch,
    *,
    temperature: float,
    eps_low: float,
    eps_high: float,
) -> tuple[np.ndarray, dict[str, float]]:
    """The summed clipped-surrogate loss of ``batch``'s trained tokens (``loss_mask`` 1) and
    its gradient w.r.t. ``table``.

    Returns ``(grad [V, V] float64, stats)`` with ``stats`` holding ``loss_sum``,
    ``num_loss_tokens`` (the trained tokens), ``clipped_tokens``, ``abs_logprob_diff_sum``,
    ``abs_logprob_diff_max`` and ``mismatch_k3_sum`` (as
    :class:`~asyncrl.plugin.backend.ChunkResult`).
    """
    w = np.asarray(table, dtype=np.float64)
    prev, tok, seq = response_tokens(batch)
    trains = np.asarray(batch.loss_mask) == 1
    prev, tok, seq = prev[trains], tok[trains], seq[trains]
    logp = log_softmax(w[prev] / temperature)  # [n, V]
    lp = logp[np.arange(tok.size), tok]
    behaviour = np.asarray(batch.behaviour_logprobs, dtype=np.float64)[trains]
    adv = np.asarray(batch.advantages, dtype=np.float64)[seq]
    r = np.exp(lp - behaviour)
    surrogate = np.minimum(r * adv, np.clip(r, 1 - eps_low, 1 + eps_high) * adv)
    clipped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    dlp = np.where(clipped, 0.0, -adv * r)  # d loss / d lp per token
    # d lp / d logits = onehot(tok) - softmax; d logits / d W[prev] = 1 / T
    dlogits = -np.exp(logp) * dlp[:, None]
    dlogits[np.arange(tok.size), tok] += dlp
    grad = np.zeros_like(w)
    np.add.at(grad, prev, dlogits / temperature)
    stats = {
        "loss_sum": float(-surrogate.sum()),
        "num_loss_tokens": int(tok.size),
        "clipped_tokens": int(clipped.sum()),
        "abs_logprob_diff_sum": float(np.abs(lp - behaviour).sum()),
        "abs_logprob_diff_max": float(np.abs(lp - behaviour).max(initial=0.0)),
        "mismatch_k3_sum": float((np.expm1(lp - behaviour) - (lp - behaviour)).sum()),
    }
    return grad, stats


_LOADED = "the run does not go on from them; likely a corrupted checkpoint"
_SAVED = "nothing was written; likely a step applied although it was not finite (a bug)"


def _check_finite(weights: np.ndarray, what: str, why: str) -> None:
    bad = int(np.count_nonzero(~np.isfinite(weights)))
    if bad:
        raise NonFiniteError(
            f"{what} hold NaN or infinite values ({bad} of {weights.size} entries of "
            f"{TENSOR_NAME}), so {why}. Fix: resume from an older checkpoint "
            "(--resume <checkpoint.dir>/step-N)"
        )


class _Policy:
    """One job's table on this rank: float64 master weights, a gradient buffer, Adam's
    moments, its learning rate and its open step."""

    def __init__(self, weights: np.ndarray, lr: float) -> None:
        self.weights = weights
        self.grad = np.zeros_like(weights)
        self.m, self.v = np.zeros_like(weights), np.zeros_like(weights)
        self.adam_t = 0
        self.lr = lr
        self.open_step: int | None = None
        self.loss_sum = 0.0

    def check_open(self, step: int) -> None:
        if step != self.open_step:
            raise RuntimeError(f"a call for step {step}, but the open step is {self.open_step}")


class BigramTrainer:
    """Holds, per job (the run's own is ``""``), float64 master weights, a gradient buffer
    and (for Adam) its moments."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.options = parse_options(ctx.config.trainer.options, TrainerOptions, "trainer.options")
        self.spec = ModelSpec.read(ctx.config.model.path)
        self.temperature = ctx.config.grpo.temperature
        self._base = np.zeros((0, 0))
        """The model's initial table: where every job starts."""
        self._jobs: dict[str, _Policy] = {}
        self._dist: Any = None  # torch.distributed, once a group of several ranks is joined
        self._chunk_failures = 0  # testing knob fail_chunk_at_step

    @property
    def weights(self) -> np.ndarray:
        """The run's own table."""
        return self._jobs[""].weights

    def _job(self, job: str) -> _Policy:
        found = self._jobs.get(job)
        if found is None:
            raise RuntimeError(f"job {job!r} is not open on this trainer; open_job first")
        return found

    def start(self) -> dict[str, Any]:
        if self.options.fail_at_start:
            raise RuntimeError("trainer.options.fail_at_start is set (a testing knob)")
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            store = self.ctx.extra.get("dist_store")
            kwargs = {"store": store} if store is not None else {"init_method": "env://"}
            dist.init_process_group(
                "gloo", rank=self.ctx.rank, world_size=self.ctx.world_size, **kwargs
            )
            self._dist = dist
        self._base = initial_table(self.ctx.config.model.path, self.ctx.config.run.seed).astype(
            np.float64
        )
        self._jobs[""] = _Policy(self._base.copy(), self.options.lr)
        return {"backend_version": __version__, "vocab_size": self.spec.vocab_size}

    # ------------------------------------------------------------------ jobs (TrainsJobs)
    def open_job(self, job: str, *, seed: int, lr: float) -> None:
        """``job`` starts from the base table (a bigram job has no random part: ``seed`` is
        unused), with its own Adam state at ``lr``.

        Raises:
            RuntimeError: ``job`` is open already, or is the run's own."""
        if not job or job in self._jobs:
            raise RuntimeError(f"job {job!r} is open already")
        if not lr > 0:
            raise ValueError(f"open_job({job!r}): lr must be > 0, got {lr}")
        self._jobs[job] = _Policy(self._base.copy(), lr)

    def close_job(self, job: str) -> None:
        """``job`` ends: its table and state are dropped (with a step of it still open: a job
        that failed mid-step)."""
        self._job(job)  # raises for a job not open
        if not job:
            raise RuntimeError("close_job(''): the run's own cannot be closed")
        del self._jobs[job]

    # ------------------------------------------------------------------ training
    def compute_logprobs(
        self, batch: TokenBatch, temperature: float, *, job: str = ""
    ) -> np.ndarray:
        prev, tok, _ = response_tokens(batch)
        weights = self._job(job).weights
        return token_logprobs(weights, prev, tok, temperature).astype(np.float32)

    def begin_step(self, step: int, *, job: str = "") -> None:
        """Open ``step`` (again, from zero gradients, if it is the open one: a retry)."""
        policy = self._job(job)
        if policy.open_step is not None and policy.open_step != step:
            raise RuntimeError(f"begin_step({step}): step {policy.open_step} is still open")
        mark_phase(self.options.phase_marker_dir, self.ctx, "train")
        policy.grad[...] = 0.0
        policy.loss_sum = 0.0
        policy.open_step = step

    def train_chunk(self, step: int, batch: TrainBatch, *, job: str = "") -> ChunkResult:
        policy = self._job(job)
        policy.check_open(step)
        if step == self.options.fail_chunk_at_step and self._chunk_failures < (
            self.options.fail_chunk_times
        ):  # testing knob: a recoverable failure (the controller restarts the step)
            self._chunk_failures += 1
            raise RuntimeError(
                f"injected train_chunk failure {self._chunk_failures} at step {step} "
                "(trainer.options.fail_chunk_at_step, a testing knob)"
            )
        if self.options.sequence_delay_s:  # workload knob: time proportional to the data
            time.sleep(self.options.sequence_delay_s * int(batch.seq_lens.size))
        problem = check_packed(
            batch.tokens, batch.seq_lens, batch.prompt_lens, vocab_size=self.spec.vocab_size,
            per_token={"behaviour_logprobs": batch.behaviour_logprobs},
            per_sequence={"advantages": batch.advantages}, loss_mask=batch.loss_mask,
        )  # fmt: skip
        if problem is not None:
            raise ValueError(f"train_chunk(step={step}): a malformed batch: {problem}")
        if self.options.batch_record_dir:  # testing knob: what this rank trained
            self._record_batch(step, batch)
        loss = self.ctx.config.loss
        grad, stats = ppo_gradient(
            policy.weights,
            batch,
            temperature=self.temperature,
            eps_low=loss.clip_eps_low,
            eps_high=loss.clip_eps_high,
        )
        policy.grad += grad
        policy.loss_sum += stats["loss_sum"]
        return ChunkResult(
            num_sequences=int(batch.seq_lens.size),
            num_loss_tokens=stats["num_loss_tokens"],
            loss_sum=stats["loss_sum"],
            clipped_tokens=stats["clipped_tokens"],
            is_weight_sum=float(stats["num_loss_tokens"]),  # proximal = behaviour: weight 1
            abs_logprob_diff_sum=stats["abs_logprob_diff_sum"],
            abs_logprob_diff_max=stats["abs_logprob_diff_max"],
            mismatch_k3_sum=stats["mismatch_k3_sum"],
        )

    def finish_step(
        self, step: int, num_loss_tokens: int, *, normalizer: float | None = None, job: str = ""
    ) -> StepResult:
        policy = self._job(job)
        policy.check_open(step)
        divisor = normalizer or max(1, num_loss_tokens)  # loss.aggregation's, else the tokens
        start = time.perf_counter()
        opts = self.options
        if opts.step_delay_s:
            time.sleep(opts.step_delay_s)  # testing knob: a slow trainer
        if self._dist is not None:
            self._all_reduce_grad(policy)
        g = policy.grad / divisor
        if step in opts.nan_grad_at_steps:  # testing knob: an overflow in the backward
            g[0, 0] = np.nan
        with np.errstate(over="ignore", invalid="ignore"):
            norm = float(np.sqrt(np.sum(g * g)))
        loss = policy.loss_sum / divisor
        if np.isfinite(norm) and np.isfinite(loss):  # else the step is not applied
            self._update(policy, g, norm)
        policy.open_step = None
        return StepResult(
            step=step,
            loss=loss,
            grad_norm=norm,
            num_loss_tokens=num_loss_tokens,
            lr=policy.lr,
            seconds=time.perf_counter() - start,
        )

    def _update(self, p: _Policy, g: np.ndarray, norm: float) -> None:
        opts = self.options
        if opts.max_grad_norm and norm > opts.max_grad_norm:
            g = g * (opts.max_grad_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        if opts.optimizer == "sgd":
            p.weights -= p.lr * g
        else:
            b1, b2 = opts.betas
            p.adam_t += 1
            p.m = b1 * p.m + (1 - b1) * g
            p.v = b2 * p.v + (1 - b2) * g * g
            m_hat = p.m / (1 - b1**p.adam_t)
            v_hat = p.v / (1 - b2**p.adam_t)
            p.weights -= p.lr * m_hat / (np.sqrt(v_hat) + opts.eps)

    def _record_batch(self, step: int, batch: TrainBatch) -> None:
        fields = ("tokens", "seq_lens", "prompt_lens", "loss_mask", "behaviour_logprobs",
                  "advantages")  # fmt: skip
        line = {"step": step, **{f: getattr(batch, f).tolist() for f in fields}}
        os.makedirs(self.options.batch_record_dir, exist_ok=True)
        path = os.path.join(self.options.batch_record_dir, f"trainer-{self.ctx.rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _all_reduce_grad(self, p: _Policy) -> None:
        """Sum the gradient buffers and loss sums of all ranks (every rank holds the result)."""
        import torch

        packed = torch.from_numpy(np.append(p.grad.reshape(-1), p.loss_sum))
        self._dist.all_reduce(packed)
        flat = packed.numpy()
        p.grad = flat[:-1].reshape(p.grad.shape).copy()
        p.loss_sum = float(flat[-1])

    def weight_specs(self, *, job: str = "") -> list[WeightTensor]:
        """The one table, float32 [V, V] (a job's: its own)."""
        self._job(job)
        v = self.spec.vocab_size
        return [WeightTensor(TENSOR_NAME, "float32", (v, v))]

    def iter_weights(self, *, job: str = "") -> Iterator[WeightTensor]:
        """The table as float32 bytes (the generators serve float32). Every rank holds the
        same table; the runtime sends rank 0's."""
        mark_phase(self.options.phase_marker_dir, self.ctx, "refit")
        table = np.ascontiguousarray(self._job(job).weights, dtype=np.float32)
        yield WeightTensor(TENSOR_NAME, "float32", table.shape, table.reshape(-1).view(np.uint8))

    def save_state(self, path: str, *, job: str = "") -> None:
        """Weights, Adam state and learning rate to ``path/bigram-state.npz`` (every rank holds
        the same, so rank 0 writes it; written under a temporary name and renamed)."""
        p = self._job(job)
        for name, policy in self._jobs.items():
            if policy.open_step is not None and (name == job or not job):
                raise RuntimeError(f"save_state: step {policy.open_step} is open; finish it "
                                   "first")  # fmt: skip
        _check_finite(p.weights, "the weights to save", _SAVED)
        if self.ctx.rank == 0:
            os.makedirs(path, exist_ok=True)
            tmp = os.path.join(path, ".bigram-state.tmp.npz")
            np.savez(tmp, weights=p.weights, m=p.m, v=p.v, adam_t=p.adam_t, lr=p.lr)
            os.replace(tmp, os.path.join(path, _STATE_FILE))
        if self._dist is not None:
            self._dist.barrier()  # the file exists before any rank moves on

    def load_state(self, path: str, *, job: str = "") -> None:
        p = self._job(job)
        if p.open_step is not None:
            raise RuntimeError(f"load_state: step {p.open_step} is open; finish it first")
        with np.load(os.path.join(path, _STATE_FILE)) as f:
            if f["weights"].shape != p.weights.shape:
                raise ValueError(
                    f"{path}: a {f['weights'].shape} table, but this model's is "
                    f"{p.weights.shape}"
                )
            weights = f["weights"].copy()
            _check_finite(weights, f"the weights loaded from {path}", _LOADED)
            p.weights, p.m, p.v = weights, f["m"].copy(), f["v"].copy()
            p.adam_t = int(f["adam_t"])
            if "lr" in f.files and job:  # a job's own learning rate; the run's is the option's
                p.lr = float(f["lr"])

    def state_to_host(self) -> int:
        """``cluster.placement = "take_turns"``: the optimizer state is in host memory already
        (numpy); nothing moves."""
        mark_phase(self.options.phase_marker_dir, self.ctx, "offload")
        return 0

    def state_to_device(self) -> int:
        """Nothing moved out, nothing to bring back."""
        return 0

    def close(self) -> None:
        """Leave the process group, if one was joined (no device memory to free)."""
        dist, self._dist = self._dist, None
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()

