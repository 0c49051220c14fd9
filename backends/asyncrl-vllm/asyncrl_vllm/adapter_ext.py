"""The worker side of ``[lora]``: adapters built from received tensors, never from a file.

vLLM adds a LoRA adapter only by reading a directory. :class:`WorkerAdapters` (mixed into
:class:`~asyncrl_vllm.ext.AsyncRLWorkerExtension`) builds it from the tensors of a refit
instead, with vLLM's own classes, as its loader would from the directory's files:
``PEFTHelper.from_dict`` (the ``adapter_config.json`` the backend sends), its ``validate_legal``
against the engine's LoRA limits, ``LoRAModel.from_lora_tensors`` with the model's weight-name
mapper (0.32: ``get_rename_mapper``; 0.26: ``get_unstacked_mapper``, what each version's loader
calls), and the LoRA manager's ``add_adapter``. Two checks vLLM does not make:

- every received tensor names a LoRA module the model has: vLLM drops a name that matches none
  without a word, and the adapter would silently not be served ("an adapter never delivered");
- the tensors are a copy of the bucket (staged when the bucket arrives, on the engine's
  device): vLLM keeps references and scales ``lora_B`` in place, and the sender refills the
  bucket after each call.

The adapter is built and kept on the engine's device (vLLM's own loader keeps it in host
memory and copies it in when a batch first uses it): on an H100 the host round trip of a
0.5B model's rank-8 adapter (336 tensors) cost tens of milliseconds per refit.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .bucket_views import bucket_weights

__all__ = ["WorkerAdapters"]


class WorkerAdapters:
    """``asyncrl_*`` adapter methods of the worker extension. State: ``_asyncrl_staged``."""

    def _asyncrl_lora_manager(self) -> Any:
        manager = getattr(self.model_runner, "lora_manager", None)  # type: ignore[attr-defined]
        if manager is None:
            raise RuntimeError("the engine was started without LoRA (enable_lora)")
        return manager

    def asyncrl_stage_adapter(
        self,
        transport: str,
        handle: bytes,
        entries: list[list[Any]],
        first: bool,
        install: list[Any] | None = None,
        remove: list[int] = (),  # type: ignore[assignment]
    ) -> dict[str, Any]:
        """Copy the tensors ``entries`` describe out of the bucket behind ``handle`` into this
        worker's staging, on the engine's device: one copy of the bucket's used bytes, which
        the staged tensors are views of (vLLM scales ``lora_B`` in place; the sender refills
        the bucket once this returns). ``first`` empties the staging first. With ``install``
        (``[lora_id, peft_config]``, the refit's last bucket) the staged tensors become that
        adapter (:meth:`asyncrl_add_adapter`), after the adapters ``remove`` are removed: a
        one-bucket adapter refit is one call into the engine."""
        start = time.perf_counter()
        staged = self.__dict__.setdefault("_asyncrl_staged", {})
        if first:
            staged.clear()
        memory, _ = self._asyncrl_open(transport, handle)  # type: ignore[attr-defined]
        device = torch.device(self.device)  # type: ignore[attr-defined]
        span = max((int(e[3]) + int(e[4]) for e in entries), default=0)
        copy = memory[:span].to(device, copy=True)
        if memory.device.type == "cuda":
            torch.cuda.synchronize(memory.device)  # read before the sender refills it
        for name, tensor in bucket_weights(entries, memory, copy, device, "view"):
            staged[name] = tensor
        out: dict[str, Any] = {"staged": len(staged)}
        if install is not None:
            self.asyncrl_remove_adapters(list(remove))
            out["added"] = self.asyncrl_add_adapter(int(install[0]), install[1])
        self._asyncrl_sync()  # type: ignore[attr-defined]
        out["seconds"] = time.perf_counter() - start
        return out

    def asyncrl_drop_staged_adapter(self) -> None:
        self.__dict__.pop("_asyncrl_staged", None)

    def asyncrl_add_adapter(self, lora_id: int, peft_config: dict[str, Any]) -> dict[str, Any]:
        """Build the staged tensors into adapter ``lora_id`` (``peft_config``: its
        ``adapter_config.json``) on the engine's device and register it with the engine's
        LoRA manager; the staging is emptied either way.

        Raises:
            ValueError: the engine's LoRA limits refuse the adapter (rank, features), or a
                tensor names no LoRA module of the model (the names are listed).
        """
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        start = time.perf_counter()
        tensors = self.__dict__.pop("_asyncrl_staged", None)
        if not tensors:
            raise ValueError(f"adapter {lora_id}: no tensor was staged")
        manager = self._asyncrl_lora_manager()
        models = manager._adapter_manager
        helper = PEFTHelper.from_dict(
            {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        helper.validate_legal(manager.lora_config)
        mapper = getattr(models.model, "hf_to_vllm_mapper", None)
        if mapper is not None:  # what this vLLM's own loader applies to adapter names
            names_only = getattr(mapper, "get_rename_mapper", None)
            mapper = names_only() if names_only else mapper.get_unstacked_mapper()
        adapter = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=helper,
            device=str(self.device),  # type: ignore[attr-defined]
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper, skip_prefixes=getattr(models.model, "lora_skip_prefixes", None),
        )  # fmt: skip
        known = _expected_modules(models)
        stray = sorted(m for m in adapter.loras if m.rsplit(".", 1)[-1] not in known)
        if stray or 2 * len(adapter.loras) != len(tensors):
            raise ValueError(
                f"adapter {lora_id}: {len(tensors)} tensors became {len(adapter.loras)} LoRA "
                f"modules; not LoRA modules of this model: {stray[:5]} (vLLM's LoRA modules: "
                f"{sorted(known)})"
            )
        if lora_id in models.list_adapters():
            models.remove_adapter(lora_id)
        models.add_adapter(adapter)
        return {"seconds": time.perf_counter() - start, "modules": len(adapter.loras)}

    def asyncrl_remove_adapters(self, lora_ids: list[int]) -> list[int]:
        """Remove these adapters (those registered); returns the ids still registered."""
        manager = self._asyncrl_lora_manager()
        for lora_id in lora_ids:
            manager.remove_adapter(lora_id)
        return sorted(manager.list_adapters())

    def asyncrl_adapters(self) -> list[int]:
        """The adapter ids registered in this worker."""
        return sorted(self._asyncrl_lora_manager().list_adapters())


def _expected_modules(models: Any) -> set[str]:
    """The module names (last component) vLLM serves adapters on, its packed layers' parts
    spelled out (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``), as its loader lists them."""
    packed = models.packed_modules_mapping
    out: set[str] = set()
    for module in models.supported_lora_modules:
        out.update(packed.get(module, [module]))
        out.add(module)
    return out
