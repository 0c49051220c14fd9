"""What the engine's processes inherit and what they may leave behind (standard library only).

vLLM spawns its engine core and workers from the backend's process: :func:`environ` sets their
environment for the spawn (without torchrun's variables, :data:`TORCHRUN_VARS`), and when they
die without closing, :func:`unlink_shm` removes the shared-memory queues :func:`mapped_shm`
found them using. The engine's ipc sockets go to a private directory the backend removes.
"""

from __future__ import annotations

import contextlib
import multiprocessing.resource_tracker
import os
from collections.abc import Iterator, Mapping

__all__ = ["TORCHRUN_VARS", "environ", "gpu_first", "mapped_shm", "unlink_shm"]


# torchrun's variables describe *our* rank, not the engine's own one-rank world. With
# TORCHELASTIC_USE_AGENT_STORE=True inherited, torch's tcp:// rendezvous inside vLLM's engine
# connects as a client to a store nobody hosts and hangs until its 10-minute timeout (seen on
# an H200 with vLLM 0.26), so the engine's processes are spawned without them.
TORCHRUN_VARS = (
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE",
)


def gpu_first(gpu: int, visible: str | None, count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine that must run on ``gpu`` (an index among the GPUs
    this process sees: ``visible``, the current ``CUDA_VISIBLE_DEVICES`` or ``None`` for all
    ``count``). vLLM takes the first visible GPU; the others stay visible after it, so the
    engine can still map CUDA IPC memory of a trainer on another GPU.

    Raises:
        ValueError: ``gpu`` is not one of the visible GPUs.
    """
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [
        str(i) for i in range(count)
    ]
    if not 0 <= gpu < len(devices):
        raise ValueError(
            f"cluster.rollout_gpus asks for GPU {gpu}, but this node shows {len(devices)} "
            f"({', '.join(devices) or 'none'})"
        )
    return ",".join([devices[gpu], *(d for i, d in enumerate(devices) if i != gpu)])


@contextlib.contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for ``None``, remove) environment variables while the engine's processes are
    spawned (they inherit them), then put the old values back."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mapped_shm(pids: list[int]) -> list[str]:
    """Paths under /dev/shm that the processes ``pids`` have mapped."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/"):
                        found.add(path.removesuffix(" (deleted)"))
        except OSError:
            continue
    return sorted(found)


def unlink_shm(paths: list[str]) -> None:
    """Remove the engine's leftover shared memory (after its processes are gone) and tell
    multiprocessing's resource tracker, which would otherwise try again at exit."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            continue
        try:
            name = "/" + os.path.basename(path)
            multiprocessing.resource_tracker.unregister(name, "shared_memory")
        except Exception:  # noqa: BLE001 - best effort: the tracker only warns later
            pass
