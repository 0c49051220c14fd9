"""The vLLM backend's side of a refit (mixed into :class:`~asyncrl_vllm.backend.VLLMBackend`).

::

    begin_weight_update(v, manifest)  check the manifest against the checkpoint's safetensors
                                      headers and model.dtype (refuse before pausing); pause
                                      (keep in-flight requests); open a reload in the workers
    load_weight_bucket(b)             collective_rpc("asyncrl_load_bucket", transport, handle,
                                      entries), one per bucket
    finish_weight_update(v, scales)   collective_rpc("asyncrl_finish_reload", scales): finalize,
                                      then the scales; invalidate the prefix cache (a new cache
                                      salt, or a reset); label the version; resume
    abort_weight_update(v, loaded_any)  close the reload; resume on the old weights if nothing
                                      was loaded, else stay paused

See docs/refit.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from asyncrl.backend import WeightBucketView
from asyncrl.errors import RefitError
from asyncrl.messages import TensorEntry

from .manifest import checkpoint_shapes, manifest_problems

__all__ = ["EngineWeights"]


@dataclass
class _Update:
    version: int
    mode: str
    started: float
    tensors: int = 0
    nbytes: int = 0
    direct: int = 0
    """Tensors written through the compiled copy plan (the rest went through load_weights)."""
    failed: bool = False


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

    async def _invalidate_prefix_cache(self, version: int) -> None:
        """Make sure no block computed by older weights is reused (see the option
        ``prefix_cache_after_refit``)."""
        if self.options.prefix_cache_after_refit == "salt":
            self._salt = f"asyncrl-w{version}"
            return
        if not await self._bounded(
            "reset_prefix_cache", self._require().reset_prefix_cache(reset_running_requests=True)
        ):
            raise RefitError(f"vLLM did not reset the prefix cache after loading v{version}")

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix; running requests are preempted and re-prefilled.

        Raises:
            RuntimeError: vLLM reported that the reset did not happen.
        """
        llm = self._require()
        if not await self._bounded(
            "reset_prefix_cache", llm.reset_prefix_cache(reset_running_requests=True)
        ):
            raise RuntimeError("vLLM did not reset the prefix cache (reset_prefix_cache -> False)")

    # ------------------------------------------------------------------ refit
    async def begin_weight_update(self, version: int, manifest: list[TensorEntry]) -> None:
        """Check ``manifest`` against the checkpoint the engine started from (names, shapes,
        the engine's dtype) and refuse it, touching nothing, if it does not fit. Then freeze
        scheduling (in-flight requests are kept with their KV) and open a reload in the
        workers. A refit left half-done (a failed or cancelled one) is closed first.

        Raises:
            RefitError: the manifest does not fit this engine (the message lists what).

        Cancellation: the engine may stay paused; the next refit resumes it.
        """
        llm = self._require()
        if self._shapes is None:
            self._shapes = checkpoint_shapes(self.ctx.config.model.path)
        problems = manifest_problems(
            manifest, self._shapes, dtype=self.ctx.config.model.dtype, tied=self._tied
        )
        if problems:
            raise RefitError(
                f"the weights of v{version} do not fit the engine's model "
                f"({self.ctx.config.model.path}): " + "; ".join(problems)
            )
        started = time.perf_counter()
        # AsyncLLM.pause_generation is the engine core's pause plus a cosmetic 20 ms sleep
        # (vLLM: "not required for correctness"), a fixed cost on every refit
        core = getattr(llm, "engine_core", None)
        pause = (
            core.pause_scheduler_async(mode="keep", clear_cache=False)
            if hasattr(core, "pause_scheduler_async")
            else llm.pause_generation(mode="keep", clear_cache=False)
        )
        await self._bounded("pause_generation", pause)
        self._update = None
        mode = (await self._rpc("asyncrl_begin_reload", self.options.weight_load_mode))[0]
        self._update = _Update(version=version, mode=mode, started=started)

    async def load_weight_bucket(self, bucket: WeightBucketView) -> None:
        """Load every tensor of ``bucket`` (Hugging Face names). The workers open the bucket
        through its transfer (:mod:`asyncrl.transfers`) and are done reading it when this
        returns, so the sender may reuse it."""
        update = self._update
        if update is None or update.version != bucket.version:
            raise RefitError(
                f"bucket {bucket.index} of v{bucket.version} arrived without "
                f"begin_weight_update({bucket.version})"
            )
        entries = [
            [e.name, e.dtype, list(e.shape), int(e.offset), int(e.nbytes)] for e in bucket.entries
        ]
        try:
            out = await self._rpc("asyncrl_load_bucket", bucket.transport, bucket.handle, entries)
        except BaseException:
            update.failed = True
            raise
        update.tensors += len(entries)
        update.nbytes += sum(e.nbytes for e in bucket.entries)
        update.direct += out[0].get("direct", 0)

    async def abort_weight_update(self, version: int, *, loaded_any: bool) -> None:
        """Close the reload. Without any bucket loaded the old weights are intact: resume
        serving them. Otherwise stay paused (mixed weights must never serve)."""
        update, self._update = self._update, None
        try:
            await self._rpc("asyncrl_finish_reload")
        finally:
            if not loaded_any and (update is None or not update.failed):
                await self._bounded("resume_generation", self._require().resume_generation())
                self._log.warning("weight_update_aborted", version=version, serving=self.version)
            else:
                self._log.error("weight_update_failed_paused", version=version)

    async def finish_weight_update(
        self, version: int, *, reset_prefix_cache: bool, kv_scales: dict[str, float] | None
    ) -> None:
        """Finalize the reload, apply KV-cache scales (after the weights: finalizing resets
        them to 1.0), reset the prefix cache if asked and resume scheduling.

        Raises:
            RefitError: no matching begin, a bucket failed to load (the engine then stays
                paused until a complete refit), bad scale names, or the prefix-cache reset
                was refused.
        """
        llm = self._require()
        update = self._update
        if update is None or update.version != version:
            raise RefitError(f"finish_weight_update({version}) without a matching begin")
        self._update = None
        fp8 = self.options.kv_cache_dtype.startswith("fp8")
        if fp8 and not kv_scales and not update.failed:
            # finalizing resets every scale to 1.0: an FP8 engine must never serve on that
            await self._rpc("asyncrl_finish_reload", None)
            raise RefitError(
                f"the refit to v{version} carried no KV-cache scales into an FP8 KV cache "
                f"(kv_cache_dtype={self.options.kv_cache_dtype!r}); the engine stays paused. The "
                "trainer must calibrate them (the controller does when the generator reports an "
                "fp8 kv_cache_dtype)"
            )
        scales = {k: float(v) for k, v in kv_scales.items()} if kv_scales else None
        try:
            finished = (await self._rpc("asyncrl_finish_reload", scales))[0]
        except Exception as exc:
            if scales and "KV scale" in str(exc):
                raise RefitError(f"setting KV-cache scales for v{version} failed: {exc}") from exc
            raise
        if update.failed:
            raise RefitError(
                f"weights v{version} were loaded only in part; the engine stays paused until a "
                "complete refit"
            )
        if reset_prefix_cache:
            await self._invalidate_prefix_cache(version)
        if hasattr(llm, "update_weight_version"):  # vLLM >= 0.30: label output spans
            await self._bounded("update_weight_version", llm.update_weight_version(str(version)))
        await self._bounded("resume_generation", llm.resume_generation())
        self.version = version
        self.last_refit = {
            "version": version,
            "mode": update.mode,
            "tensors": update.tensors,
            "direct": update.direct,
            "bytes": update.nbytes,
            "seconds": time.perf_counter() - update.started,
        }
        self._log.info(
            "weights_loaded", redispatched=finished["redispatched"], **self.last_refit
        )
