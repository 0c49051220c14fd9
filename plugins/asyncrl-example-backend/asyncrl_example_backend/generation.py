"""The ``bigram`` generation backend (entry point ``asyncrl.generation_backends:bigram``).

A rollout worker calls these coroutines on its event loop; several :meth:`generate` calls run
at once (one per prompt group), interleaved at every generated token. With ``token_delay_s``
the engine works in steps of that length, as an LLM engine's decode steps: every sample in
flight makes its next token at the end of the engine's next step (one timer for them all, not
one per sample: at a thousand samples in flight this engine's own cost would otherwise crowd
out the controller it is there to exercise). Weight updates pause
sampling between tokens (``begin_weight_update``) and resume it with the new table
(``finish_weight_update``), as vLLM pauses its scheduler: a sample that spans a refit is
generated partly by each version, and its per-token logprobs and versions say exactly which.

Jobs (docs/jobs.md; ``ServesJobs``): each job's requests sample from its own table, the base
(the model's initial table, version 0) until its first refit installs one; a refit that names a
job installs that job's table only. The run's own table is the job ``""``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import structlog

from asyncrl.plugin.backend import (
    GenRequest,
    RequestError,
    Sample,
    SampleSink,
    TensorEntry,
    TokenBatch,
    WeightBucketView,
    WorkerContext,
)
from asyncrl.plugin.transfer import read_bytes

from . import __version__
from .model import (
    TENSOR_NAME,
    ModelSpec,
    initial_table,
    log_softmax,
    response_tokens,
    token_logprobs,
)
from .options import GeneratorOptions, mark_phase, parse_options

__all__ = ["BigramGenerator"]

log = structlog.get_logger("asyncrl_example_backend.generation")



class _Served:
    """One job's table as the engine serves it: its version, and its rows' log-probabilities
    and CDFs by temperature (computed once per refit and temperature)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.version = 0
        self.rows: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def distributions(self, temperature: float) -> tuple[np.ndarray, np.ndarray]:
        """``log_softmax(table / T)`` and its row-wise CDFs (row by row they equal what one
        row's own computation gives: the same float64 operations along each row)."""
        rows = self.rows.get(temperature)
        if rows is None:
            logp = log_softmax(self.table / temperature)
            rows = self.rows[temperature] = (logp, np.cumsum(np.exp(logp), axis=-1))
        return rows


class BigramGenerator:
    """Samples from ``softmax(table[prev] / T)`` with one numpy Generator per request."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.options = parse_options(
            ctx.config.generator.options, GeneratorOptions, "generator.options"
        )
        self.spec = ModelSpec.read(ctx.config.model.path)
        self._base = np.zeros((0, 0), np.float32)
        """The model's initial table: every job's version 0."""
        self._served: dict[str, _Served] = {}
        """The table each job's requests sample from (the run's own: ``""``)."""
        self._closed: set[str] = set()
        self._staged: np.ndarray | None = None
        self._staging_job = ""
        self._resumed: anyio.Event | None = None  # unset while a weight update is going on
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._groups_done = 0
        self._failed: dict[str, int] = {}  # testing knob fail_groups: failures so far
        self._slots: anyio.Semaphore | None = None
        self._step_ends: anyio.Event | None = None
        """Set when the engine's current step ends (``None``: no step is running)."""
        self._opener: Any = None
        """The reader of a transfer other than ``shm`` (made at its first bucket)."""

    async def start(self) -> dict[str, Any]:
        if self.options.fail_at_start:
            raise RuntimeError("generator.options.fail_at_start is set (a testing knob)")
        self._base = await anyio.to_thread.run_sync(
            initial_table, self.ctx.config.model.path, self.ctx.config.run.seed
        )
        self._served[""] = _Served(self._base)
        self._resumed = anyio.Event()
        self._resumed.set()
        if self.options.max_concurrent_samples:
            self._slots = anyio.Semaphore(self.options.max_concurrent_samples)
        return {"backend_version": __version__, "vocab_size": self.spec.vocab_size}

    @property
    def table(self) -> np.ndarray:
        """The run's own table."""
        return self._served[""].table

    @property
    def version(self) -> int:
        """The run's own weight version being served (0 until the first refit)."""
        return self._served[""].version

    def _serving(self, job: str) -> _Served:
        """``job``'s table (the base, version 0, before its first refit).

        Raises:
            RequestError: ``job`` was closed."""
        if job in self._closed:
            raise RequestError(f"job {job!r} was closed on this engine")
        served = self._served.get(job)
        if served is None:
            served = self._served[job] = _Served(self._base)
        return served

    async def close_job(self, job: str) -> None:
        """``job`` ended (``ServesJobs``): its table is dropped and its requests refused."""
        self._closed.add(job)
        self._served.pop(job, None)

    # ------------------------------------------------------------------ sampling
    async def generate(self, request: GenRequest, emit: SampleSink) -> None:
        """``request.n`` samples generated concurrently (each takes an engine slot when
        ``max_concurrent_samples`` is set), each emitted as soon as it finishes. Sample ``i``
        draws from its own Generator seeded with ``(request.seed, i)`` (fresh entropy when
        the seed is ``None``).

        Cancellation: stops between tokens and propagates (nothing to clean up).
        """
        if not request.prompt_ids:
            raise ValueError(f"group {request.group_id}: empty prompt")
        self._serving(request.job)  # a closed job's request is refused here
        opts = self.options
        if opts.request_error_token in request.prompt_ids:  # testing knob
            raise RequestError(
                f"group {request.group_id}: token {opts.request_error_token} is refused "
                "(generator.options.request_error_token, a testing knob)"
            )
        if request.group_id in opts.fail_groups:  # testing knob: an engine failure
            done = self._failed.get(request.group_id, 0)
            if done < opts.fail_times:
                self._failed[request.group_id] = done + 1
                await self._one(request, 0, emit)
                raise RuntimeError(
                    f"injected engine failure {done + 1} of group {request.group_id} "
                    "(generator.options.fail_groups, a testing knob)"
                )
        mark_phase(self.options.phase_marker_dir, self.ctx, "generate")
        self._running.add(request.group_id)
        try:
            async with anyio.create_task_group() as tg:
                for i in range(request.n):
                    tg.start_soon(self._one, request, i, emit)
        finally:
            self._running.discard(request.group_id)
            self._aborted.discard(request.group_id)
        self._groups_done += 1
        if self.options.crash_after_groups and self._groups_done >= self.options.crash_after_groups:
            log.warning("crashing_on_purpose", groups=self._groups_done)  # testing knob
            os.kill(os.getpid(), signal.SIGKILL)

    async def _one(self, req: GenRequest, i: int, emit: SampleSink) -> None:
        rng = np.random.default_rng(None if req.seed is None else [req.seed, i])
        if self._slots is None:
            sample = await self._sample(req, rng)
        else:
            async with self._slots:
                sample = await self._sample(req, rng)
        await emit(i, sample)

    async def _sample(self, req: GenRequest, rng: np.random.Generator) -> Sample:
        greedy = req.greedy or req.temperature == 0
        temperature = 1.0 if greedy else req.temperature
        prev = int(req.prompt_ids[-1])
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason = "length"
        length = req.max_tokens
        if self.options.length_median > 0:  # workload knob: a drawn length, EOS ignored
            draw = rng.lognormal(np.log(self.options.length_median), self.options.length_sigma)
            length = int(min(req.max_tokens, max(1, round(draw))))
        for _ in range(length):
            if req.group_id in self._aborted:
                reason = "abort"
                break
            assert self._resumed is not None, "start() was not called"
            await self._resumed.wait()  # paused while weights are being replaced
            served = self._serving(req.job)
            logps, cdfs = served.distributions(temperature)
            logp = logps[prev]
            if greedy:
                tok = int(np.argmax(logp))
            else:  # inverse-CDF draw: one uniform per token
                cdf = cdfs[prev]
                tok = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
                tok = min(tok, cdf.size - 1)
            tokens.append(tok)
            logprobs.append(float(logp[tok]))
            versions.append(served.version)
            if tok == self.spec.eos_token_id and self.options.length_median <= 0:
                reason = "stop"
                break
            prev = tok
            if self.options.token_delay_s:
                await self._next_step()
            else:
                await anyio.lowlevel.checkpoint()  # let other groups (and cancellation) in
        else:
            if self.options.length_median > 0 and length < req.max_tokens:
                reason = "stop"
        return Sample(
            np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), reason,
            np.asarray(versions, np.int32),
        )  # fmt: skip

    async def _next_step(self) -> None:
        """Wait for the end of the engine's step (``token_delay_s``): the first sample to ask
        starts one, the others join it. A step whose starter is cancelled (an aborted
        group) ends there for all, early; the next asker starts a new one."""
        ends = self._step_ends
        if ends is not None:
            await ends.wait()
            return
        self._step_ends = ends = anyio.Event()
        try:
            await anyio.sleep(self.options.token_delay_s)
        finally:
            self._step_ends = None
            ends.set()

    async def abort(self, group_ids: list[str]) -> None:
        """Running groups among ``group_ids`` stop at their next token (or before their first,
        when waiting for a slot): every sample not yet emitted is emitted with
        ``finish_reason == "abort"``."""
        self._aborted.update(g for g in group_ids if g in self._running)

    async def score(self, batch: TokenBatch, temperature: float, *, job: str = "") -> np.ndarray:
        prev, tok, _ = response_tokens(batch)
        table = self._serving(job).table
        return token_logprobs(table, prev, tok, temperature).astype(np.float32)

    # ------------------------------------------------------------------ refit
    async def begin_weight_update(
        self,
        version: int,
        manifest: list[TensorEntry],
        *,
        kv_scales: dict[str, float] | None = None,
        job: str = "",
    ) -> None:
        """Refuse any manifest but the one float32 [V, V] table, before pausing. A bigram has
        no KV cache: ``kv_scales`` have nothing to act on. With ``job``, the table is that
        job's."""
        self._serving(job)  # a closed job's refit is refused
        v = self.spec.vocab_size
        shapes = {e.name: (e.dtype, list(e.shape)) for e in manifest}
        if shapes != {TENSOR_NAME: ("float32", [v, v])}:
            raise ValueError(
                f"the bigram engine takes exactly {TENSOR_NAME} float32 [{v}, {v}]; the manifest "
                f"has {shapes}"
            )
        mark_phase(self.options.phase_marker_dir, self.ctx, "refit")
        if self._resumed is None or self._resumed.is_set():  # asleep: paused already
            self._resumed = anyio.Event()  # sampling waits between tokens until finish
        self._staged, self._staging_job = None, job

    async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
        """Copy ``bigram.logits`` out of the bucket (the sender reuses it as soon as this
        returns). ``shm`` is read with numpy alone; any other transfer (``nccl``: gloo
        between hosts) through its opener, on the CPU, which needs torch."""
        v = self.spec.vocab_size
        if bucket.transport == "cuda_ipc":
            raise ValueError("the bigram engine reads host memory (shm, or nccl's gloo "
                             "broadcasts), not cuda_ipc buckets")  # fmt: skip
        if self.options.load_delay_s:
            await anyio.sleep(self.options.load_delay_s)  # testing knob: a slow refit
        for entry in bucket.entries:
            if bucket.transport == "shm":
                data = await anyio.to_thread.run_sync(
                    read_bytes, bucket.handle, entry.offset, entry.nbytes
                )
            else:
                data = await anyio.to_thread.run_sync(self._read, bucket, entry)
            self._staged = data.view(np.float32).reshape(v, v)

    def _read(self, bucket: WeightBucketView, entry: TensorEntry) -> np.ndarray:
        """``entry``'s bytes of a bucket of another transfer, copied to numpy."""
        if self._opener is None:
            from asyncrl.plugin.transfer import IDENTITY_ENV_VAR, load_transfer

            os.environ.setdefault(IDENTITY_ENV_VAR, f"{self.ctx.group}:{self.ctx.rank}")
            self._opener = load_transfer(bucket.transport).opener()
        memory = self._opener.open(bucket.handle, "cpu")
        return memory[entry.offset : entry.offset + entry.nbytes].numpy().copy()

    async def abort_weight_update(self, version: int, *, loaded_any: bool, job: str = "") -> None:
        """Drop what was staged and go on sampling with the current table (a bigram installs
        a table only at finish, so it never holds mixed weights)."""
        self._staged = None
        if self._resumed is not None:
            self._resumed.set()
        log.warning("weight_update_aborted", version=version)

    async def sleep(self) -> dict[str, Any]:
        """``cluster.placement = "take_turns"``: stop sampling between tokens until the next
        refit resumes it (``finish_weight_update``). A bigram's table is all it holds, in host
        memory, so nothing is released; the samples in flight wait where they are and go on
        with the new table, their tokens labelled with the version that drew them."""
        assert self._resumed is not None, "start() was not called"
        if not self._resumed.is_set():
            return {"held": 0}
        self._resumed = anyio.Event()
        mark_phase(self.options.phase_marker_dir, self.ctx, "sleep")
        return {"held": sum(1 for g in self._running if g not in self._aborted)}

    async def reprefill_in_flight(self) -> None:
        """Nothing to recompute: a bigram keeps no KV cache, its next token depends on the
        previous one and the table alone (the sampler's choice is accepted, and the same as
        continuing)."""

    async def finish_weight_update(
        self, version: int, *, reset_prefix_cache: bool, job: str = ""
    ) -> None:
        """Install the staged table (``job``'s) and resume sampling. A bigram has no KV
        cache, so ``reset_prefix_cache`` has nothing to act on."""
        if self._staged is None or self._staging_job != job:
            raise RuntimeError(f"weight update to v{version} of job {job!r} carried no "
                               f"{TENSOR_NAME}")  # fmt: skip
        served = self._serving(job)
        stale = self.options.stale_from_version
        if stale and version >= stale:  # testing knob: pretend, keep the old table
            log.warning("weights_ignored_on_purpose", version=version)
            self._staged = None
        else:
            served.table, self._staged = self._staged, None
            served.rows.clear()
        served.version = version
        assert self._resumed is not None
        self._resumed.set()
        log.info("weights_loaded", version=version, **({"job": job} if job else {}))

    async def close(self) -> None:
        if self._resumed is not None:
            self._resumed.set()
        if self._opener is not None:
            self._opener.close()
        if self.options.close_delay_s:
            await anyio.sleep(self.options.close_delay_s)  # testing knob: a slow shutdown
