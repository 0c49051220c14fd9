"""Worker extension: the code asyncrl runs inside vLLM's worker processes.

vLLM appends :class:`AsyncRLWorkerExtension` to its worker class's bases
(``worker_extension_cls``), so these methods see ``self.model_runner``, ``self.vllm_config``
and ``self.device``; the backend calls them with ``AsyncLLM.collective_rpc("asyncrl_...")``.
Every name is prefixed ``asyncrl_``: a name the worker already has makes engine start fail.
Arguments and results are plain lists, dicts, strings and numbers (msgpack; nothing pickled).

A refit is ``asyncrl_begin_reload`` → ``asyncrl_load_bucket`` × N → ``asyncrl_finish_reload``
→ ``asyncrl_set_kv_scales``. With vLLM's layerwise reload (``vllm.model_executor.model_loader.
reload``, present in 0.26 and 0.32) the model's checkpoint-format parameters are restored on
the meta device, loads are buffered per layer, and once a layer has all its weights it is
materialised, loaded, re-processed (the CPU build prepacks linear weights here) and copied
into the original kernel tensors. Buffered tensors are kept *by reference* until their layer
completes, which is why every tensor read from a bucket is a fresh copy: the sender rewrites
the bucket file as soon as the load call returns.

Importing this module in a worker also arms ``PR_SET_PDEATHSIG`` (SIGKILL) when the worker
belongs to an asyncrl engine, so a worker dies with the process that spawned it (the engine
core on the CPU build, the backend process itself with vLLM's in-process executor).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .kv_scales import resolve_kv_scales
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


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


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


class AsyncRLWorkerExtension:
    """Mixed into vLLM's worker class. State lives in ``_asyncrl_*`` attributes."""

    _asyncrl_mode: str | None = None
    """``layerwise`` or ``plain`` while a reload is open, else ``None``."""

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
        }

    def asyncrl_begin_reload(self, mode: str) -> str:
        """Open a reload. ``mode``: ``auto``, ``layerwise`` or ``plain``. Returns the mode used.
        A reload left open by a failed refit is finalized first."""
        if self._asyncrl_mode is not None:
            self.asyncrl_finish_reload()
        helpers = _reload_helpers()
        if mode == "auto":
            mode = "layerwise" if helpers is not None else "plain"
        if mode == "layerwise":
            if helpers is None:
                raise RuntimeError("this vLLM has no layerwise reload; use weight_load_mode=plain")
            with self._asyncrl_config():
                helpers[0](self._asyncrl_model())
        elif mode != "plain":
            raise ValueError(f"unknown weight load mode {mode!r}")
        self._asyncrl_mode = mode
        return mode

    def asyncrl_load_bucket(self, path: str, entries: list[list[Any]]) -> dict[str, Any]:
        """Load the tensors described by ``entries`` (``[name, dtype, shape, offset, nbytes]``,
        Hugging Face names) from the bucket file at ``path``. The file is mapped read-only
        and every tensor is copied out before this returns."""
        if self._asyncrl_mode is None:
            raise RuntimeError("asyncrl_load_bucket called without asyncrl_begin_reload")
        start = time.perf_counter()
        weights: list[tuple[str, torch.Tensor]] = []
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for name, dtype_name, shape, offset, nbytes in entries:
                    dtype = _dtype(dtype_name)
                    numel = 1
                    for dim in shape:
                        numel *= int(dim)
                    if nbytes != numel * dtype.itemsize or offset < 0 or offset + nbytes > size:
                        raise ValueError(
                            f"{name}: {nbytes} bytes at {offset} do not hold {dtype_name}"
                            f"{list(shape)} inside a {size}-byte bucket"
                        )
                    raw = torch.empty(nbytes, dtype=torch.uint8)
                    raw.numpy()[:] = np.frombuffer(mm, np.uint8, count=nbytes, offset=offset)
                    tensor = raw.view(dtype).reshape(shape)
                    weights.append((name, tensor.to(self.device)))  # type: ignore[attr-defined]
        model = self._asyncrl_model()
        with self._asyncrl_config():
            loaded = model.load_weights(iter(weights))  # type: ignore[operator]
        self._asyncrl_sync()
        return {
            "tensors": len(weights),
            "loaded": len(loaded) if loaded is not None else -1,
            "seconds": time.perf_counter() - start,
        }

    def asyncrl_finish_reload(self) -> str | None:
        """Close the open reload: process the layers still pending and put back the kernel
        tensors of layers that received nothing. Returns the mode that was open."""
        mode, self._asyncrl_mode = self._asyncrl_mode, None
        if mode == "layerwise":
            helpers = _reload_helpers()
            assert helpers is not None
            with self._asyncrl_config():
                helpers[1](self._asyncrl_model(), self.model_config)  # type: ignore[attr-defined]
        self._asyncrl_sync()
        return mode

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
