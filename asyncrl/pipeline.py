"""The rollout pump, the buffer feeder and the train pump, on one event loop.

::

    dataloader ──► rollout pump ──Generate──► rollout workers ──GroupDone (ZMQ PUSH)──┐
                     │ waits: sampler.admit (trainer version), buffered-groups       │
                     │        semaphore, in-flight semaphore, rollout gate            │
                     ▼ reserve slot (start = generator version, target step)         ▼
                 replay buffer ◄──── commit by group id ◄──── buffer feeder (PULL + rewards)
                     │
                     ▼ waits: sampler.select finds >= min groups (buffer changed)
                 train pump ──TrainChunk──► trainer ranks (one open optimizer step)
                     │ step's groups consumed → FinishStep → trainer version += 1
                     ▼ close gate → SendWeights ∥ ReceiveWeights → generator version = v → open gate

Who unblocks whom: a commit wakes the train pump (``changed``); a finished step wakes the
rollout pump's ``admit``; a finished refit reopens the gate; training or evicting a group
releases its buffered-groups permit; a commit releases its in-flight permit.

All of this state has one writer, the event loop; nothing here blocks it (tokenizing and
scoring run in worker threads).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import structlog

from .buffer import CompletedSample, Group, ReplayBuffer
from .codec import Codec
from .config import Config
from .environment import Environment, Prompt
from .errors import ProtocolError, RunError
from .grpo import pack_groups, pack_tokens, shard_batch, shard_tokens
from .messages import (
    BeginStep,
    ComputeLogprobs,
    DataMessage,
    FinishStep,
    Generate,
    GenRequest,
    GroupDone,
    GroupFailed,
    LogprobsResult,
    ReceiveWeights,
    Score,
    SendWeights,
    StepResult,
    TokenBatch,
    TrainChunk,
    WeightsResult,
)
from .prompts import Tokenizer, prompt_batches, sample_seed
from .rpc import ControlPlane
from .samplers import Sampler
from .steps import StepRecord
from .transport import AsyncSocket, Rejections, peer_name
from .verify import Agreement, compare, probe_sequences, verification_due

__all__ = ["Pipeline"]

log = structlog.get_logger("asyncrl.pipeline")


class Signal:
    """Wake every waiter on the next :meth:`notify` (an event re-armed after each use)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(frozen=True)
class _InFlight:
    """A group that is generating: its prompt, the worker it went to, how many samples."""

    prompt: Prompt
    worker: str
    n: int


def _malformed(msg: GroupDone, n: int) -> str:
    """What is wrong with a group's samples ("" when nothing): the count, the arrays'
    shapes, dtypes and alignment, the logprobs' values."""
    if len(msg.samples) != n:
        return f"{len(msg.samples)} samples, {n} were asked for"
    for i, s in enumerate(msg.samples):
        tokens, lps = np.asarray(s.token_ids), np.asarray(s.logprobs)
        if tokens.ndim != 1 or lps.ndim != 1 or tokens.size != lps.size:
            return f"sample {i}: {tokens.shape} tokens but {lps.shape} logprobs"
        if tokens.dtype.kind not in "iu" or lps.dtype.kind != "f":
            return f"sample {i}: token dtype {tokens.dtype}, logprob dtype {lps.dtype}"
        if tokens.size and (tokens.min() < 0 or not np.isfinite(lps).all() or lps.max() > 1e-3):
            return f"sample {i}: negative token ids, or logprobs that are not finite and <= 0"
    return ""


class Pipeline:
    """The run's shared state and its loops. The :class:`~asyncrl.controller.Controller`
    builds it once the workers are ready and owns the tasks that run it."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        data_socket: AsyncSocket,
        environment: Environment,
        tokenizer: Tokenizer,
        sampler: Sampler,
        trainers: list[str],
        rollouts: list[str],
        transfer_address: str,
        metrics: Any,
        clock_origin: float,
        rejections: Rejections | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.data = data_socket
        self.env = environment
        self.tok = tokenizer
        self.sampler = sampler
        self.trainers = trainers
        self.rollouts = rollouts
        self.transfer_address = transfer_address
        self.metrics = metrics
        self.t0 = clock_origin
        self.buffer = ReplayBuffer(config.max_buffered_groups)
        self.buffered = anyio.Semaphore(config.max_buffered_groups)
        self.inflight = anyio.Semaphore(config.max_inflight_groups)
        self.score_limiter = anyio.CapacityLimiter(4)
        self.trainer_version = 0
        self.generator_version = 0
        self.gate_open = True
        self.changed = Signal()
        self.steps: dict[int, StepRecord] = {}
        self._eval_results: dict[str, tuple[anyio.Event, list[CompletedSample]]] = {}
        self._prompts: dict[str, _InFlight] = {}
        """Groups generating now, by group id: what the data socket may deliver."""
        self.rejections = rejections if rejections is not None else Rejections()
        self._next_rollout = 0
        self.loop_lag_max_s = 0.0
        self.history: list[dict[str, Any]] = []
        self.probe: TokenBatch | None = None
        """The refit-verification probe batch, frozen from the first trained step."""

    # ------------------------------------------------------------------ helpers
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _record(self, step: int) -> StepRecord:
        return self.steps.setdefault(step, StepRecord(step))

    def _pick_rollout(self) -> str:
        worker = self.rollouts[self._next_rollout % len(self.rollouts)]
        self._next_rollout += 1
        return worker

    async def _dispatch(self, worker: str, requests: list[GenRequest]) -> None:
        timeout = self.config.cluster.call_timeout_s
        await self.control.call(worker, Generate(requests=requests), timeout_s=timeout)

    # ------------------------------------------------------------------ rollout pump
    async def rollout_pump(self) -> None:
        """Dispatch batches of prompts as the sampler admits them, until the last step's batch.

        Cancellation: stops dispatching; groups already dispatched keep their permits until
        the controller shuts down.
        """
        cfg = self.config
        prompts = self.env.dataset("train")
        batches = prompt_batches(prompts, cfg.grpo.prompts_per_step, cfg.run.seed)
        while True:
            while (step := self.sampler.admit(self.trainer_version)) is None:
                await self.changed.wait()
            if step >= cfg.run.num_steps:
                return
            batch = next(batches)
            ids = await anyio.to_thread.run_sync(self.tok.encode_batch, [p.text for p in batch])
            rec = self._record(step)
            for i, (prompt, prompt_ids) in enumerate(zip(batch, ids)):
                await self.buffered.acquire()
                await self.inflight.acquire()
                while not self.gate_open:
                    await self.changed.wait()
                group_id = f"s{step}-{i}"
                worker = self._pick_rollout()
                self._prompts[group_id] = _InFlight(prompt, worker, cfg.grpo.samples_per_prompt)
                self.buffer.reserve(
                    group_id,
                    prompt_id=prompt.id,
                    prompt_ids=prompt_ids,
                    start_version=self.generator_version,
                    target_step=step,
                    now=self.now(),
                )
                if rec.gen_start is None:
                    rec.gen_start = self.now()
                rec.dispatched += 1
                await self._dispatch(
                    worker,
                    [
                        GenRequest(
                            group_id=group_id,
                            prompt_ids=prompt_ids,
                            n=cfg.grpo.samples_per_prompt,
                            max_tokens=cfg.grpo.max_new_tokens,
                            temperature=cfg.grpo.temperature,
                            seed=sample_seed(cfg.run.seed, group_id),
                        )
                    ]
                )

    # ------------------------------------------------------------------ feeder
    async def feed_buffer(self) -> None:
        """Read finished groups from the data socket, score them off-loop, commit them.

        A frame that does not decode, or a result for a group that is not generating (a late
        duplicate, a stranger's), is rejected and counted (socket ``data``); it never ends the
        run. A malformed result from the worker the group was sent to, a generation failure,
        or an environment whose ``score()`` raises or returns a non-finite reward ends it with
        a :class:`~asyncrl.errors.RunError` naming the culprit.

        Cancellation: stops reading; scoring tasks in flight are cancelled with it.
        """
        codec = Codec(DataMessage)
        async with anyio.create_task_group() as tg:
            while True:
                frames = await self.data.recv()
                try:
                    msg = codec.decode(frames)
                except ProtocolError as exc:
                    self.rejections.reject("data", "?", str(exc))
                    continue
                pending = self._prompts.get(msg.group_id)
                if pending is None or pending.worker != msg.worker:
                    self.rejections.reject(
                        "data",
                        peer_name(msg.worker),
                        f"{type(msg).__name__} for group {msg.group_id!r}, which is not "
                        "generating" + ("" if pending is None else f" on {msg.worker!r}"),
                    )
                    continue
                if isinstance(msg, GroupFailed):
                    raise RunError(
                        f"generation of group {msg.group_id} failed on {msg.worker}: "
                        f"{msg.error_type}: {msg.message} (see that worker's log)"
                    )
                problem = _malformed(msg, pending.n)
                if problem:
                    raise RunError(
                        f"{msg.worker} returned a malformed result for group {msg.group_id}: "
                        f"{problem}; the generation backend "
                        f"{self.config.generator.backend!r} broke its contract"
                    )
                del self._prompts[msg.group_id]
                tg.start_soon(self._score_and_commit, pending.prompt, msg)

    def _score(self, prompt: Prompt, group: GroupDone) -> list[CompletedSample]:
        name = self.config.environment.name
        out = []
        for s in group.samples:
            completion = self.tok.decode(s.token_ids)
            try:
                score = self.env.score(prompt, completion)
                reward = float(score.reward)
            except Exception as exc:
                raise RunError(
                    f"environment {name!r} (environment.name): score() raised "
                    f"{type(exc).__name__}: {exc} for prompt {prompt.id!r} and completion "
                    f"{completion[:80]!r}"
                ) from exc
            if not math.isfinite(reward):
                raise RunError(
                    f"environment {name!r} (environment.name): score() returned a non-finite "
                    f"reward ({reward}) for prompt {prompt.id!r} and completion "
                    f"{completion[:80]!r}; rewards must be finite numbers"
                )
            out.append(
                CompletedSample(s.token_ids, s.logprobs, s.finish_reason, reward, bool(score.correct))
            )
        return out

    async def _score_and_commit(self, prompt: Prompt, msg: GroupDone) -> None:
        samples = await anyio.to_thread.run_sync(
            self._score, prompt, msg, limiter=self.score_limiter
        )
        if msg.group_id in self._eval_results:
            done, out = self._eval_results[msg.group_id]
            out.extend(samples)
            done.set()
            return
        group = self.buffer.commit(
            msg.group_id, samples, end_version=self.generator_version, now=self.now()
        )
        self.inflight.release()
        if group.target_step is not None:
            rec = self._record(group.target_step)
            rec.gen_end = max(rec.gen_end or 0.0, self.now())
        self.changed.notify()

    # ------------------------------------------------------------------ train pump
    async def train_pump(self) -> None:
        """Assemble each step from chunks of complete groups, train it, refit, publish.

        Cancellation: an open optimizer step is abandoned (the run is over).
        """
        cfg = self.config
        timeout = cfg.cluster.call_timeout_s
        while self.trainer_version < cfg.run.num_steps:
            step = self.trainer_version
            rec = self._record(step)
            remaining = cfg.grpo.prompts_per_step
            opened = False
            while remaining > 0:
                for g in self.sampler.evict(self.buffer, step):
                    self.buffer.remove([g.group_id])
                    self.buffered.release()
                    log.warning("group_evicted", group_id=g.group_id, step=step)
                chunk = self.sampler.select(
                    self.buffer, step, min(cfg.min_groups_for_streaming_train, remaining), remaining
                )
                if not chunk:
                    t = self.now()
                    await self.changed.wait()
                    rec.wait_s += self.now() - t
                    continue
                self.buffer.remove([g.group_id for g in chunk])
                if not opened:
                    rec.train_start = self.now()
                    await self.control.call_each(
                        self.trainers, [BeginStep(step=step)] * len(self.trainers), timeout_s=timeout
                    )
                    opened = True
                batch = pack_groups(chunk, normalize=cfg.grpo.normalize_advantages)
                shards = shard_batch(batch, len(self.trainers))
                results = await self.control.call_each(
                    self.trainers, [TrainChunk(step=step, batch=s) for s in shards], timeout_s=timeout
                )
                rec.chunk_results += results  # type: ignore[arg-type]
                rec.groups += chunk
                rec.chunks += 1
                for _ in chunk:
                    self.buffered.release()
                remaining -= len(chunk)
            num_tokens = sum(r.num_loss_tokens for r in rec.chunk_results)
            finish = await self.control.call_each(
                self.trainers,
                [FinishStep(step=step, num_loss_tokens=num_tokens)] * len(self.trainers),
                timeout_s=timeout,
            )
            rec.train_end = self.now()
            # version bump and gate close happen together: no dispatch can see v+1 unrefit
            self.trainer_version = step + 1
            self.gate_open = False
            self.changed.notify()
            refit_start = self.now()
            await self.refit(step + 1)
            refit_s = self.now() - refit_start
            self.generator_version = step + 1
            self.gate_open = True
            self.changed.notify()
            if self.probe is None:
                self.probe = self._make_probe(rec.groups)
            if self.probe is not None and verification_due(
                step + 1, cfg.refit.verify_first_steps, cfg.refit.verify_every_steps
            ):
                start = self.now()
                rec.verify = await self.verify_refit(step + 1)
                rec.verify_s = self.now() - start
            self._log_step(rec, finish[0], refit_s)  # type: ignore[arg-type]
            del self.steps[step]
            for agreement in rec.verify:
                agreement.check(cfg.refit.verify_tolerance)

    async def refit(self, version: int) -> None:
        """Send weights ``version`` from the trainers to every generator; return when all
        generators serve them. Cancellation: abandons the transfer."""
        cfg = self.config
        timeout = cfg.cluster.call_timeout_s
        send = SendWeights(
            version=version,
            receivers=list(self.rollouts),
            transport=cfg.refit.transport,
            bucket_size_bytes=cfg.refit.bucket_size_mb << 20,
            timeout_s=cfg.refit.timeout_s,
        )
        recv = ReceiveWeights(
            version=version,
            address=self.transfer_address,
            transport=cfg.refit.transport,
            reset_prefix_cache=cfg.refit.reset_prefix_cache,
            timeout_s=cfg.refit.timeout_s,
        )
        sent: list[Any] = []

        async def send_all() -> None:
            sent.extend(
                await self.control.call_each(
                    self.trainers, [send] * len(self.trainers), timeout_s=timeout
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_all)
            tg.start_soon(self._call_each, self.rollouts, recv, timeout)
        refused = max((r.rejected_frames for r in sent if isinstance(r, WeightsResult)), default=0)
        if refused:  # the sender's count covers the whole run
            self.rejections.counts["weights"] = refused

    # ------------------------------------------------------------------ refit verification
    def _make_probe(self, groups: list[Group]) -> TokenBatch | None:
        """Freeze the verification probe from a trained step's samples (None: no tokens)."""
        ordered = sorted(groups, key=lambda g: g.group_id)
        prompts, responses = probe_sequences(
            [(g.prompt_ids, [s.token_ids for s in g.samples]) for g in ordered],
            self.config.refit.verify_num_sequences,
        )
        return pack_tokens(prompts, responses) if prompts else None

    async def verify_refit(self, version: int) -> list[Agreement]:
        """Score the probe batch on every generator and on the trainer; one
        :class:`~asyncrl.verify.Agreement` per generator (written to the metrics file).
        Cancellation: the outstanding calls are abandoned."""
        assert self.probe is not None
        results: dict[str, np.ndarray] = {}

        async def generator(worker: str) -> None:
            results[worker] = await self.generator_logprobs(self.probe, worker=worker)

        async def trainer() -> None:
            results[""] = await self.trainer_logprobs(self.probe)

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            for worker in self.rollouts:
                tg.start_soon(generator, worker)
        agreements = [compare(w, version, results[w], results[""]) for w in self.rollouts]
        for a in agreements:
            if self.metrics is not None:
                self.metrics.write({"kind": "refit_verify", **a.metrics(), "time": self.now()})
            log.info("refit_verified", **a.metrics())
        return agreements

    async def generator_logprobs(
        self, batch: TokenBatch, *, worker: str, temperature: float = 1.0
    ) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under one generator's current weights."""
        result = await self.control.call(
            worker,
            Score(batch=batch, temperature=temperature),
            timeout_s=self.config.cluster.call_timeout_s,
        )
        assert isinstance(result, LogprobsResult)
        return np.asarray(result.logprobs, np.float32)

    async def trainer_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> np.ndarray:
        """Logprobs of ``batch``'s response tokens under the trainer's current weights
        (sequences are sharded over the trainer ranks and reassembled in order)."""
        results = await self.control.call_each(
            self.trainers,
            [
                ComputeLogprobs(batch=shard, temperature=temperature)
                for shard in shard_tokens(batch, len(self.trainers))
            ],
            timeout_s=self.config.cluster.call_timeout_s,
        )
        return np.concatenate([np.asarray(r.logprobs, np.float32) for r in results])  # type: ignore[union-attr]

    async def _call_each(self, workers: list[str], request: Any, timeout: float) -> None:
        await self.control.call_each(workers, [request] * len(workers), timeout_s=timeout)

    def _log_step(self, rec: StepRecord, result: StepResult, refit_s: float) -> None:
        record = rec.metrics(
            result,
            refit_s,
            loop_lag_max_s=self.loop_lag_max_s,
            rejected_frames=self.rejections.total,
            now=self.now(),
        )
        self.loop_lag_max_s = 0.0
        self.history.append(record)
        if self.metrics is not None:
            self.metrics.write({"kind": "train", **record})
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
            **(
                {"refit_verify": round(record["refit_verify_mean_abs"], 4)}
                if rec.verify
                else {}
            ),
        )

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, label: str) -> dict[str, Any]:
        """Greedy held-out accuracy of the generators' current weights (nothing else may be
        generating). Cancellation: outstanding eval groups are abandoned."""
        n = self.config.eval.num_prompts
        prompts = list(self.env.dataset("eval"))[:n]
        ids = await anyio.to_thread.run_sync(self.tok.encode_batch, [p.text for p in prompts])
        waits = []
        requests: dict[str, list[GenRequest]] = {w: [] for w in self.rollouts}
        for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
            gid = f"eval-{label}-{i}"
            worker = self.rollouts[i % len(self.rollouts)]
            self._prompts[gid] = _InFlight(prompt, worker, 1)
            slot: tuple[anyio.Event, list[CompletedSample]] = (anyio.Event(), [])
            self._eval_results[gid] = slot
            waits.append(slot)
            requests[worker].append(
                GenRequest(
                    group_id=gid,
                    prompt_ids=prompt_ids,
                    n=1,
                    max_tokens=self.config.grpo.max_new_tokens,
                    temperature=0.0,
                    greedy=True,
                )
            )
        start = self.now()
        timeout = self.config.cluster.call_timeout_s
        try:
            for worker, reqs in requests.items():
                if reqs:
                    await self.control.call(worker, Generate(requests=reqs), timeout_s=timeout)
            with anyio.fail_after(timeout):
                for done, _ in waits:
                    await done.wait()
        finally:
            for i in range(len(prompts)):
                self._eval_results.pop(f"eval-{label}-{i}", None)
        correct = [s.correct for _, out in waits for s in out]
        record = {
            "kind": "eval",
            "label": label,
            "version": self.generator_version,
            "accuracy": float(np.mean(correct)) if correct else 0.0,
            "num_prompts": len(prompts),
            "seconds": self.now() - start,
        }
        if self.metrics is not None:
            self.metrics.write(record)
        log.info("eval_finished", **{k: v for k, v in record.items() if k != "kind"})
        return record

    # ------------------------------------------------------------------ loop health
    async def watch_loop_lag(self, interval_s: float = 0.25) -> None:
        """Measure how late the event loop wakes up (a blocked loop starves both pumps)."""
        while True:
            t = time.perf_counter()
            await anyio.sleep(interval_s)
            self.loop_lag_max_s = max(self.loop_lag_max_s, time.perf_counter() - t - interval_s)
