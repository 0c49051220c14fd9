"""The vLLM backend's side of a refit (mixed into :class:`~asyncrl_vllm.backend.VLLMBackend`).

::

    begin_weight_update(v, manifest, kv_scales)  check the manifest against the checkpoint's
                                      safetensors headers and model.dtype, and that an FP8
                                      cache gets scales (refuse before pausing); pause (keep
                                      in-flight requests), or wake a sleeping engine's weights
    load_weight_bucket(b)             collective_rpc("asyncrl_load_bucket", ...), one per
                                      bucket: the first also opens the reload, the last also
                                      finalizes it and writes the scales (after the weights:
                                      finalizing resets them to 1.0)
    finish_weight_update(v)           wake a sleeping engine's KV cache (and write the scales
                                      again); invalidate the prefix cache (a new cache salt,
                                      or a reset); label the version; resume
    abort_weight_update(v, loaded_any)  close the reload; resume on the old weights if nothing
                                      was loaded, else stay paused

See docs/refit.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.plugin.backend import RefitError, TensorEntry, WeightBucketView

from .manifest import bucket_entries, checkpoint_shapes, manifest_problems

__all__ = ["EngineWeights"]


@dataclass
class _Update:
    version: int
    mode: str
    started: float
    expected: int = 0
    """Tensors in the manifest: a refit that loaded fewer (a bucket skipped) is refused."""
    tensors: int = 0
    nbytes: int = 0
    direct: int = 0
    """Tensors written through the compiled copy plan (the rest went through load_weights)."""
    batched: int = 0
    """Buckets replayed as one batched copy (seen before in the same mapped buffer)."""
    mirrored: int = 0
    """Buckets copied whole into a mirror buffer on the engine's GPU first."""
    failed: bool = False
    finished: bool = False
    """The last bucket loaded: the reload is closed and the scales are set."""
    kv_scales: dict[str, float] | None = None
    redispatched: list[str] = field(default_factory=list)
    pause_s: float = 0.0
    loads_s: float = 0.0
    """From the first bucket's engine call to the last one's answer (calls overlap)."""
    worker_s: float = 0.0
    """Seconds the engine's worker spent in the bucket calls (summed)."""
    first_load: float | None = None
    reprefilled: bool = False
    """The requests in flight dropped their KV cache (``reprefill_in_flight``)."""


class EngineWeights:
    """Refit methods of the vLLM backend. Uses the backend's ``_require``, ``_rpc``,
    ``_bounded``, ``options``, ``ctx``, ``_log`` and its refit state (``version``,
    ``last_refit``, ``_update``, ``_shapes``, ``_tied``, ``_salt``)."""

    _require: Any
    _rpc: Any
    _bounded: Any
    options: Any
    ctx: Any
    _log: Any
    version: int
    last_refit: dict[str, Any]
    _update: _Update | None
    _shapes: dict[str, list[int]] | None
    _tied: bool
    _salt: str | None
    _adapters: Any
    """``[lora]``: the :class:`~asyncrl_vllm.adapters.EngineAdapters` a refit goes to instead."""
    _turn: Any
    """The engine's :class:`~asyncrl_vllm.turns.EngineTurn`: a refit wakes a sleeping engine."""
    _wake_weights: Any
    _wake_cache: Any
    _wake_s: float

    async def _invalidate_prefix_cache(self, version: int) -> None:
        """Make sure no block computed by older weights is reused (see the option
        ``prefix_cache_after_refit``)."""
        if self.options.prefix_cache_after_refit == "salt":
            self._salt = f"asyncrl-w{version}"
            return
        if not await self._reset_prefix_cache():
            raise RefitError(f"vLLM did not reset the prefix cache after loading v{version}")

    async def _reset_prefix_cache(self) -> bool:
        """Drop every cached block, preempting running requests; vLLM's answer (``False``:
        it did not happen). Bounded by ``rpc_timeout_s``."""
        return bool(
            await self._bounded(
                "reset_prefix_cache",
                self._require().reset_prefix_cache(reset_running_requests=True),
            )
        )

    # ------------------------------------------------------------------ refit
    async def begin_weight_update(
        self,
        version: int,
        manifest: list[TensorEntry],
        *,
        kv_scales: dict[str, float] | None = None,
        job: str = "",
    ) -> None:
        """Check ``manifest`` against the checkpoint the engine started from (names, shapes,
        the engine's dtype) and an FP8 cache's need for scales; refuse, touching nothing, if
        either fails. Then freeze scheduling (in-flight requests are kept with their KV). The
        reload opens with the first bucket and closes with the last one, in the same engine
        calls (so a one-bucket refit is one call into the engine's workers). With ``job``
        (``[lora]`` only) the version is that job's adapter.

        Raises:
            RefitError: the manifest does not fit this engine (the message lists what), or an
                FP8 KV cache would get no scales (finalizing resets them to 1.0).

        Cancellation: the engine may stay paused; the next refit resumes it.
        """
        llm = self._require()
        if self._shapes is None:
            self._shapes = checkpoint_shapes(self.ctx.config.model.path)
        if job and self._adapters is None:
            raise RefitError(f"v{version} of job {job!r}: jobs are LoRA adapters, and this "
                             "engine serves full weights (no [lora])")  # fmt: skip
        if self._adapters is not None:  # an adapter version: no pause, the base untouched
            self._adapters.begin(version, manifest, self._shapes, job)
            if self._turn.state == "asleep":
                await self._wake_weights()  # the adapter goes into the woken base's memory
            return
        problems = manifest_problems(
            manifest, self._shapes, dtype=self.ctx.config.model.dtype, tied=self._tied
        )
        if problems:
            raise RefitError(
                f"the weights of v{version} do not fit the engine's model "
                f"({self.ctx.config.model.path}): " + "; ".join(problems)
            )
        if self.options.kv_cache_dtype.startswith("fp8") and not kv_scales:
            raise RefitError(
                f"the refit to v{version} carries no KV-cache scales into an FP8 KV cache "
                f"(kv_cache_dtype={self.options.kv_cache_dtype!r}); loading would leave every "
                "scale at 1.0. The trainer must calibrate them (the controller does when the "
                "generator reports an fp8 kv_cache_dtype)"
            )
        started = time.perf_counter()
        waking = self._turn.state == "asleep"
        if waking:  # nothing runs: the new weights go into the woken memory
            await self._wake_weights()
        elif self._turn.state == "awake":
            # AsyncLLM.pause_generation is the engine core's pause plus a cosmetic 20 ms sleep
            # (vLLM: "not required for correctness"), a fixed cost on every refit
            core = getattr(llm, "engine_core", None)
            pause = (
                core.pause_scheduler_async(mode="keep", clear_cache=False)
                if hasattr(core, "pause_scheduler_async")
                else llm.pause_generation(mode="keep", clear_cache=False)
            )
            await self._bounded("pause_generation", pause)
        paused = time.perf_counter()
        scales = {k: float(v) for k, v in kv_scales.items()} if kv_scales else None
        self._update = _Update(
            version=version, mode="", started=started, kv_scales=scales, pause_s=paused - started,
            expected=len(manifest),
        )

    async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
        """Load every tensor of ``bucket`` (Hugging Face names) in one engine call, which also
        opens the reload (first bucket) and finalizes it and writes the KV-cache scales (last
        bucket). The workers open the bucket through its transfer (:mod:`asyncrl.transfers`)
        and are done reading it when this returns, so the sender may reuse it.

        Raises:
            RefitError: no matching begin, or bad KV-cache scale names (last bucket).
        """
        if self._adapters is not None:
            await self._adapters.load(bucket)
            return
        update = self._update
        if update is None or update.version != bucket.version:
            raise RefitError(
                f"bucket {bucket.index} of v{bucket.version} arrived without "
                f"begin_weight_update({bucket.version})"
            )
        entries = bucket_entries(bucket)
        opening = self.options.weight_load_mode if bucket.index == 0 else None
        if update.first_load is None:
            update.first_load = time.perf_counter()
        try:
            (out,) = await self._rpc(
                "asyncrl_load_bucket", bucket.transport, bucket.handle, entries, opening,
                bucket.last, update.kv_scales if bucket.last else None,
                self.options.refit_mirror,
            )
        except BaseException as exc:
            update.failed = True
            if bucket.last and update.kv_scales and "KV scale" in str(exc):
                raise RefitError(
                    f"setting KV-cache scales for v{bucket.version} failed: {exc}"
                ) from exc
            raise
        if opening is not None:
            update.mode = out["mode"]
        update.tensors += len(entries)
        update.nbytes += sum(e.nbytes for e in bucket.entries)
        update.direct += out["direct"]
        update.batched += out["batched"]
        update.mirrored += out.get("mirrored", 0)
        update.worker_s += float(out.get("seconds", 0.0))
        update.loads_s = time.perf_counter() - update.first_load
        update.finished = bucket.last
        update.redispatched = out.get("redispatched", [])

    async def reprefill_in_flight(self) -> None:
        """Drop the KV cache of every request in flight while the engine is paused for a
        refit (vLLM preempts them; on resume each is prefilled again, prompt and tokens so
        far, by the new weights). Bounded by ``rpc_timeout_s``.

        With ``[lora]`` the requests in flight move to the new adapter version instead, once
        it is installed (:meth:`finish_weight_update`): each sample goes on from its tokens so
        far as a new request on the new version, which prefills them again; the tokens keep
        the versions that generated them.

        Raises:
            RefitError: not during a refit, or vLLM refused the reset.
        """
        if self._adapters is not None:
            self._adapters.move_in_flight()
            return
        update = self._update
        if update is None:
            raise RefitError("reprefill_in_flight() outside a refit (the engine is not paused)")
        if self._turn.state != "awake":
            return  # a refit that wakes the engine: nothing is in it, its cache comes back empty
        if not await self._reset_prefix_cache():
            raise RefitError(f"vLLM did not drop the in-flight KV cache at the refit to "
                             f"v{update.version}")  # fmt: skip
        update.reprefilled = True

    async def abort_weight_update(self, version: int, *, loaded_any: bool, job: str = "") -> None:
        """Close the reload. Without any bucket loaded the old weights are intact: resume
        serving them. Otherwise stay paused (mixed weights must never serve). With ``[lora]``
        nothing was paused and the installed versions serve on."""
        if self._adapters is not None:
            await self._adapters.abort(version)
            return
        update, self._update = self._update, None
        try:
            await self._rpc("asyncrl_finish_reload")
        finally:
            if self._turn.state != "awake":  # woken for this refit: it stays asleep
                self._log.error("weight_update_failed_asleep", version=version,
                                state=self._turn.state)  # fmt: skip
            elif not loaded_any and (update is None or not update.failed):
                await self._bounded("resume_generation", self._require().resume_generation())
                self._log.warning("weight_update_aborted", version=version, serving=self.version)
            else:
                self._log.error("weight_update_failed_paused", version=version)

    async def finish_weight_update(
        self, version: int, *, reset_prefix_cache: bool, job: str = ""
    ) -> None:
        """After the last bucket (the reload is closed and the scales are set): keep blocks of
        older weights from being reused, label the version and resume scheduling.

        Raises:
            RefitError: no matching begin, the last bucket (or any bucket: fewer tensors than
                the manifest's) never loaded, or the prefix-cache reset was refused.
        """
        llm = self._require()
        if self._adapters is not None:
            move = await self._adapters.finish(version, job)
            waking = self._turn.state == "weights"
            if waking:  # woken for this refit: the cache, then serve
                await self._wake_cache(None)
                await self._bounded("resume_generation", llm.resume_generation())
                self._turn.woke()
            if not job:
                self.version = version
            moved = {"moved": await self._move_in_flight(version, job)} if move else {}
            self.last_refit = {**self._adapters.last_refit, **moved, "woke": waking,
                               "wake_s": self._wake_s if waking else 0.0}  # fmt: skip
            return
        update = self._update
        if update is None or update.version != version:
            raise RefitError(f"finish_weight_update({version}) without a matching begin")
        finishing = time.perf_counter()
        self._update = None
        if update.failed or not update.finished or update.tensors != update.expected:
            raise RefitError(
                f"weights v{version} were loaded only in part ({update.tensors} of the "
                f"manifest's {update.expected} tensors); the engine stays paused until a "
                "complete refit"
            )
        waking = self._turn.state == "weights"
        if waking:
            await self._wake_cache(update.kv_scales)
        if reset_prefix_cache:
            await self._invalidate_prefix_cache(version)
        if hasattr(llm, "update_weight_version"):  # vLLM >= 0.30: label output spans
            await self._bounded("update_weight_version", llm.update_weight_version(str(version)))
        await self._bounded("resume_generation", llm.resume_generation())
        if waking:
            self._turn.woke()
        self.version = version
        done = time.perf_counter()
        self.last_refit = {
            "version": version,
            "mode": update.mode,
            "tensors": update.tensors,
            "direct": update.direct,
            "batched": update.batched,
            "mirrored": update.mirrored,
            "reprefilled": update.reprefilled,
            "woke": waking,
            "wake_s": self._wake_s if waking else 0.0,
            "bytes": update.nbytes,
            "seconds": done - update.started,
            # where the time went: the pause, the bucket calls (wall, and inside the worker),
            # and invalidation + resume; the rest is waiting for the trainer's buckets
            "pause_s": update.pause_s,
            "loads_s": update.loads_s,
            "worker_s": update.worker_s,
            "resume_s": done - finishing,
        }
        self._log.info("weights_loaded", redispatched=update.redispatched, **self.last_refit)
