"""A vLLM general plugin (entry point ``vllm.general_plugins: asyncrl_idle_spin``) that lets
the engine's processes sleep between engine steps on the CPU build.

vLLM's shared-memory queue readers poll (``sched_yield``) for ``busy_loop_s = 1`` s after
every message before they sleep. An RL step on a small CPU host is shorter than that, so the
engine worker and engine core never sleep and hold cores the trainer needs (measured on 2
cores: the worker 84% of a core, the engine core 11%, while idle). vLLM loads general plugins
in the engine core and in every worker; this one acts only where the backend set
``ASYNCRL_VLLM_IDLE_SPIN_S`` in the engine's environment (``generator.options.
cpu_idle_spin_s``), so other vLLM users on the machine are untouched. It also shortens the
re-check of a sleeping reader from 5 s to 2 ms: the wake-up ping travels on a socket that
drops it when one is already pending, and a dropped ping stalled the engine 5 s.
"""

from __future__ import annotations

import os

__all__ = ["ENV_VAR", "apply"]

ENV_VAR = "ASYNCRL_VLLM_IDLE_SPIN_S"
RECHECK_MS = 2


def apply() -> None:
    """Patch ``SpinCondition.wait`` in this process (idempotent; a no-op without the
    environment variable)."""
    value = os.environ.get(ENV_VAR)
    if not value:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = float(value)
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
    cls = shm_broadcast.SpinCondition
    if getattr(cls.wait, "_asyncrl_spin", None) is not None:
        return
    original = cls.wait

    def wait(self, timeout_ms=None):  # type: ignore[no-untyped-def]
        self.busy_loop_s = spin
        return original(self, timeout_ms)

    wait._asyncrl_spin = spin  # type: ignore[attr-defined]
    cls.wait = wait


def active() -> float | None:
    """The spin this process runs with (``None``: vLLM's own)."""
    from vllm.distributed.device_communicators import shm_broadcast

    return getattr(shm_broadcast.SpinCondition.wait, "_asyncrl_spin", None)
