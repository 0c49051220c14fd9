"""``[lora]`` in the vLLM backend: adapter versions served beside each other, installed from
memory at each refit (docs/lora.md).

With a rank in ``[lora]`` the engine keeps ``model.path``'s weights as they are and serves the
trained adapter as vLLM LoRA adapters, one per weight *version*. A refit moves the adapter's
tensors only, through the same buckets and transfers as full weights:

::

    begin_weight_update(v, manifest)  check the manifest against the checkpoint's shapes
                                      (every target's lora_A [r, in] and lora_B [out, r]) and
                                      that a slot is free (AdapterLeases); no pause
    load_weight_bucket(b)             the workers copy the bucket's tensors out (staged); the
                                      last bucket's call also removes the old versions nobody
                                      holds, builds v's adapter from the staged tensors with
                                      vLLM's own classes and registers it
    finish_weight_update(v)           the lease table installs v: new requests start on it

A one-bucket adapter refit is one call into the engine's workers: each call waits for the
engine's current step to end, which on a busy engine costs more than the work (on an H100
serving requests, three calls took 30-50 ms where their work took 10). The version that was
newest until the install is removed at the next refit's call if nobody held it then (it could
still be leased until the install), or when its last request ends.

Nothing is written to disk: the adapter's path is a name vLLM never reads (it only opens the
path of an adapter it does not have registered, which the lease table rules out). Requests
start on the newest version and keep it until they end (:class:`AdapterLeases`); every token of
a sample is tagged with its request's version. With ``in_flight_at_refit = "reprefill"`` a
refit ends the requests in flight once its version is installed, and each sample goes on from
its tokens so far as a new request on the new version (the backend's ``_move_in_flight``).
The engine is never paused and its prefix cache is kept: vLLM keys cached blocks by adapter,
so no version reads another's blocks.

Version 0 is the base with the initial adapter: none (a fresh adapter's ``lora_B`` is zero, so
the policy is the base) or ``lora.init_path``, which the engine loads from its directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.plugin.backend import Adapter, AdapterError, AdapterLeases, RefitError, TensorEntry
from asyncrl.plugin.common import Config, config_error

from .manifest import bucket_entries, expected_problems
from .options import VLLMOptions

__all__ = [
    "ADAPTER_PREFIX",
    "EngineAdapters",
    "MAX_LORA_RANKS",
    "adapter_manifest_problems",
    "adapter_slots",
    "check_adapter_config",
    "lora_engine_args",
]

ADAPTER_PREFIX = "base_model.model."
"""PEFT's saved names: this, the module's path, then ``.lora_A.weight`` or ``.lora_B.weight``."""

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (0.26 and 0.32); the engine takes the least one
that holds ``lora.rank``."""

UNREAD_PATH = "/nonexistent/asyncrl-in-memory-adapter"
"""The path of every in-memory adapter: absolute (a relative path that does not exist is taken
for a Hugging Face Hub name and downloaded) and never read."""


def adapter_slots(config: Config, lora_slots: int) -> int:
    """Adapter versions one engine holds at once (vLLM's ``max_loras``): the option
    ``lora_slots``, else the sampler's staleness bound + 2 (the newest, and every version a
    request still in flight may hold)."""
    return lora_slots or config.sampler.max_staleness + 2


def check_adapter_config(config: Config, options: VLLMOptions) -> None:
    """What a ``[lora]`` run needs of this backend, before any engine starts.

    Raises:
        ConfigError: a rank above vLLM's largest, too few slots, or an FP8 KV cache.
    """
    lora = config.lora
    if config.jobs and not lora.enabled:
        raise config_error("lora.rank", "is 0, but the run has jobs: the vLLM engine serves "
                           "each job by an adapter of its own", "set lora.rank (8 to 128)")  # fmt: skip
    if config.jobs:
        need = sum(job.config.sampler.max_staleness + 1 for job in config.job_list.values()) + 1
        if adapter_slots(config, options.lora_slots) < need:
            raise config_error(
                "generator.options.lora_slots",
                f"is {options.lora_slots or 'the default'}, but the run's {len(config.jobs)} "
                f"jobs need {need} adapter slots (each its newest version and those its "
                "requests in flight may hold: its staleness bound + 1, and one for a refit)",
                f"set generator.options.lora_slots = {need} (docs/jobs.md)",
            )
    if lora.rank > MAX_LORA_RANKS[-1]:
        raise config_error("lora.rank", f"{lora.rank} is above the {MAX_LORA_RANKS[-1]} vLLM "
                           "serves", f"use a rank of at most {MAX_LORA_RANKS[-1]}")  # fmt: skip
    if options.lora_slots == 1:
        raise config_error("generator.options.lora_slots", "is 1: a refit needs a slot for the "
                           "new version beside the one requests in flight hold",
                           "use at least 2, or 0 for the sampler's staleness bound + 2")  # fmt: skip
    kv = options.kv_cache_dtype
    if kv.startswith("fp8"):
        raise config_error("generator.options.kv_cache_dtype", f"is {kv!r}, but FP8 KV-cache "
                           "scales are one set per engine and [lora] serves several adapter "
                           "versions at once", "use kv_cache_dtype = \"auto\" with [lora]")  # fmt: skip


def lora_engine_args(config: Config, options: VLLMOptions) -> dict[str, Any]:
    """vLLM's engine arguments for ``[lora]``: ``max_loras`` the slots, one more adapter
    registered on the host (the version being installed, before the lease table lets an
    old one go), and the least ``max_lora_rank`` that holds the rank."""
    slots = adapter_slots(config, options.lora_slots)
    rank = next(r for r in MAX_LORA_RANKS if r >= config.lora.rank)
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots + 1,
            "max_lora_rank": rank}  # fmt: skip


def adapter_manifest_problems(
    manifest: list[Any], shapes: dict[str, list[int]], *, rank: int, targets: tuple[str, ...],
    dtype: str,
) -> list[str]:  # fmt: skip
    """Everything wrong with an adapter refit's ``manifest`` (entries with ``name``, ``dtype``,
    ``shape``) for an engine started from a checkpoint of ``shapes``: each target linear
    layer ``W [out, in]`` must get ``lora_A [rank, in]`` and ``lora_B [out, rank]``, in
    ``dtype``, and nothing else may come. At most three of each kind are listed."""
    expected: dict[str, list[int]] = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(shape) == 2 and module.rsplit(".", 1)[-1] in targets:
            out_features, in_features = shape
            expected[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = [rank, in_features]
            expected[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = [out_features, rank]
    return expected_problems(manifest, expected, dtype=dtype,
                             foreign="not a LoRA tensor of a target module")


@dataclass
class _Install:
    job: str
    version: int
    lora_id: int
    """The engine's id for the adapter being installed (a new one: ids are never reused)."""
    started: float
    expected: int
    staged: int = 0
    nbytes: int = 0
    failed: bool = False
    added: bool = False
    """The last bucket's call registered the adapter in the workers."""
    adding: bool = False
    """The last bucket's call was made: the workers may have registered the adapter even if
    its answer never came (a timeout)."""
    removed: list[Adapter] = field(default_factory=list)
    """Adapters that call removed first."""
    first_load: float | None = None
    loads_s: float = 0.0
    """From the first bucket's call to the last one's answer."""
    worker_s: float = 0.0
    """Seconds the workers spent in the bucket calls (summed over buckets)."""
    worker_add_s: float = 0.0
    """Of which building and registering the adapter."""
    move: bool = False
    """The requests in flight go on under this version once it is installed (the sampler's
    ``in_flight_at_refit = "reprefill"``)."""


class EngineAdapters:
    """The adapter versions of one engine, of every job it serves (a single-job run's job is
    ``""``): the lease table, the refit in progress and the calls that install and remove
    adapters in the engine's workers (``rpc``: the backend's ``collective_rpc`` wrapper,
    bounded by ``rpc_timeout_s``). Every job's adapters have the run's ``[lora]`` rank and
    targets; a job's version 0 is the bare base until its first refit installs one.

    Args:
        config: the run's config (``[lora]``, ``model``).
        options: the backend's ``[generator.options]``.
        rpc: ``await rpc(method, *args)`` on every worker; returns their answers.
        log: the backend's logger.
    """

    def __init__(self, config: Config, options: VLLMOptions, rpc: Any, log: Any) -> None:
        self._config = config
        self._rpc = rpc
        self._log = log
        self.leases = AdapterLeases(adapter_slots(config, options.lora_slots))
        self._peft = config.lora.peft_config(config.model.path)
        self._targets = config.lora.targets(config.model.path)
        self._install: _Install | None = None
        self._unload_later: list[Adapter] = []
        """Adapters the lease table let go at an install but still registered in the engine:
        removed by the next refit's last call."""
        self.last_refit: dict[str, Any] = {}

    # ------------------------------------------------------------------ requests
    def lease(self, request_id: str, job: str = "") -> tuple[int, Any]:
        """``request_id`` starts on ``job``'s newest version: ``(version, LoRARequest)``, the
        request ``None`` while version 0 is the bare base (a fresh adapter).

        Raises:
            AdapterError: ``job`` was closed (:meth:`close_job`)."""
        if self.leases.closed(job):
            raise AdapterError(f"request {request_id!r} is of job {job!r}, which was closed")
        if self.leases.newest(job) is None:
            return 0, None
        adapter = self.leases.lease(request_id, job=job)
        return adapter.version, lora_request(adapter, self._path(adapter))

    async def release(self, request_id: str) -> None:
        """``request_id`` ended: its lease ends, and a version nobody holds any more (with a
        newer one installed) is removed from the engine. Shielded: it runs to its end when the
        request was cancelled."""
        import anyio

        unload = self.leases.release(request_id)
        if unload:
            with anyio.CancelScope(shield=True):
                await self._remove(unload)

    @staticmethod
    def versions(version: int, n: int) -> np.ndarray:
        """Every token's version: its request's (the adapter never changes under it)."""
        return np.full(n, version, np.int32)

    # ------------------------------------------------------------------ start
    async def start(self, llm: Any) -> None:
        """Version 0: ``lora.init_path``'s adapter, loaded by vLLM from that directory; nothing
        for a fresh adapter (its policy is the base)."""
        if not self._config.lora.init_path:
            return
        self.leases.check_install(0)
        adapter = Adapter("", 0, self.leases.new_id())
        await llm.add_lora(lora_request(adapter, self._config.lora.init_path))
        self.leases.install(0, lora_id=adapter.lora_id)

    def _path(self, adapter: Adapter) -> str:
        if adapter.version == 0 and not adapter.job and self._config.lora.init_path:
            return self._config.lora.init_path
        return f"{UNREAD_PATH}/{adapter.lora_id}"

    async def close_job(self, job: str) -> None:
        """``job`` ended: its requests are refused from now on, and its adapters are removed
        from the engine as their last requests end (those none holds, now)."""
        await self._remove(self.leases.close(job))

    # ------------------------------------------------------------------ refit
    def begin(
        self, version: int, manifest: list[TensorEntry], shapes: dict[str, list[int]],
        job: str = "",
    ) -> None:  # fmt: skip
        """Check the manifest and that a slot is free for ``job``'s ``version``, touching
        nothing.

        Raises:
            RefitError: the manifest does not fit the engine's model (what, listed), or every
                slot is held by versions requests are still using (the fix named).
        """
        cfg = self._config
        problems = adapter_manifest_problems(
            manifest, shapes, rank=cfg.lora.rank, targets=self._targets, dtype=cfg.model.dtype
        )
        if problems:
            raise RefitError(f"the adapter of {Adapter(job, version, 0)} does not fit the "
                             f"engine's model ({cfg.model.path}): "
                             + "; ".join(problems))  # fmt: skip
        try:
            self.leases.check_install(version, job=job)
        except AdapterError as exc:
            raise RefitError(str(exc)) from None
        self._install = _Install(job, version, self.leases.new_id(), time.perf_counter(),
                                 expected=len(manifest))  # fmt: skip

    async def load(self, bucket: Any) -> None:
        """Copy the bucket's tensors into the workers' staging (the bucket is free after); the
        last bucket's call also builds and registers the adapter, after removing the versions
        that can go now (older than the newest, held by nobody: nothing can lease them).

        Raises:
            RefitError: no matching :meth:`begin`, a bucket missing before the last, or the
                workers refused the adapter (the versions installed serve on, untouched).
        """
        install = self._install
        if install is None or install.version != bucket.version:
            raise RefitError(f"bucket {bucket.index} of v{bucket.version} arrived without "
                             f"begin_weight_update({bucket.version})")  # fmt: skip
        entries = bucket_entries(bucket)
        if install.first_load is None:
            install.first_load = time.perf_counter()
        version = install.version
        extra: list[Any] = []
        if bucket.last:
            if install.failed or install.staged + len(entries) != install.expected:
                install.failed = True
                raise RefitError(f"the adapter of v{version} arrived only in part "
                                 f"({install.staged + len(entries)} of the manifest's "
                                 f"{install.expected} tensors)")  # fmt: skip
            install.removed = list(self._unload_later)
            extra = [[install.lora_id, self._peft], [a.lora_id for a in install.removed]]
            install.adding = True
        try:
            answers = await self._rpc("asyncrl_stage_adapter", bucket.transport, bucket.handle,
                                      entries, bucket.index == 0, *extra)  # fmt: skip
        except Exception as exc:
            install.failed = True
            if bucket.last:
                raise RefitError(f"the engine refused the adapter of v{version}: {exc}") from exc
            raise
        install.staged += len(entries)
        install.nbytes += sum(e.nbytes for e in bucket.entries)
        install.worker_s += max(float(a["seconds"]) for a in answers)
        if bucket.last:
            install.added = True
            self._unload_later = []
            install.worker_add_s = max(float(a["added"]["seconds"]) for a in answers)
        install.loads_s = time.perf_counter() - install.first_load

    def move_in_flight(self) -> None:
        """The requests in flight are to go on under the version being installed, once it is
        (:meth:`finish` says so to the backend, which moves them).

        Raises:
            RefitError: no refit in progress.
        """
        if self._install is None:
            raise RefitError("reprefill_in_flight() outside a refit (no adapter is being "
                             "installed)")  # fmt: skip
        self._install.move = True

    async def finish(self, version: int, job: str = "") -> bool:
        """Install ``job``'s ``version`` in the lease table (its new requests start on it); the
        adapters it lets go are removed by the next refit's last call, or as their last
        request ends.
        Returns whether the requests in flight are to move to it (:meth:`move_in_flight`).

        Raises:
            RefitError: no matching begin, or the adapter was not added (a bucket missing).
        """
        install, self._install = self._install, None
        if install is None or (install.job, install.version) != (job, version):
            raise RefitError(f"finish_weight_update({Adapter(job, version, 0)}) without a "
                             "matching begin")  # fmt: skip
        if not install.added:
            await self.abort(version)
            raise RefitError(f"the adapter of v{version} was never added: its last bucket did "
                             "not arrive")  # fmt: skip
        unload = self.leases.install(version, job=job, lora_id=install.lora_id)
        self._unload_later = [a for a in unload if a not in install.removed]
        done = time.perf_counter()
        self.last_refit = {
            "version": version, "adapter": True, "tensors": install.staged,
            "bytes": install.nbytes, "seconds": done - install.started,
            "loads_s": install.loads_s, "worker_s": install.worker_s,
            "worker_add_s": install.worker_add_s,
            "resident": [str(a) for a in self.leases.resident()],
            "removed": [str(a) for a in install.removed],
            "unload_later": [str(a) for a in self._unload_later],
            **({"job": job} if job else {}),
        }  # fmt: skip
        self._log.info("adapter_installed", **self.last_refit)
        return install.move

    async def abort(self, version: int) -> None:
        """Drop what was staged (and the adapter, if the last call was made: it may have added
        it though it failed or timed out); the installed versions serve on, untouched."""
        install, self._install = self._install, None
        await self._rpc("asyncrl_drop_staged_adapter")
        if install is not None and install.adding:
            await self._rpc("asyncrl_remove_adapters", [install.lora_id])
        job = install.job if install is not None else ""
        self._log.warning("adapter_update_aborted", version=version, job=job,
                          serving=str(self.leases.newest(job)))  # fmt: skip

    async def _remove(self, adapters: list[Adapter]) -> None:
        if adapters:
            await self._rpc("asyncrl_remove_adapters", [a.lora_id for a in adapters])


def lora_request(adapter: Adapter, path: str) -> Any:
    """vLLM's request for ``adapter`` (its engine id, never given to another), named apart
    from every other adapter (vLLM tells adapters apart by name). The fields after the first
    three go by keyword: 0.26 has one more of them in the middle than 0.32."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"asyncrl-{adapter.job or 'run'}-v{adapter.version}", adapter.lora_id,
                       lora_path=path)  # fmt: skip
