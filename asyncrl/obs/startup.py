"""How a run spends the time from its launch to its first step, phase by phase.

Every process stamps what it sees on the wall clock (``time.time()``, comparable across the
processes of one host), and the controller puts the stamps together once step 1 is done::

    launch ─► controller ─► workers ready ─► first evaluation ─► step 1 (and its refit)
    (the launcher's start:        │ each worker: its process start, its imports, the
     asyncrl run, torchrun's      │ handshake, the backend plugin's import and factory,
     agent; an embedding          │ the backend's start (a vLLM engine's, a trainer's
     application: the             │ model load)
     controller's own start)

:meth:`Startup.record` is the ``startup`` record of ``metrics.jsonl`` (the timeline's start-up
lane) and :func:`describe` its console line. A worker's stamps travel in its ``Ready``
(:class:`~asyncrl.wire.messages.WorkerStamps`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from asyncrl.procs.process import stat_fields
from asyncrl.wire.messages import WorkerStamps

__all__ = ["Startup", "describe", "process_start_time"]


def process_start_time(pid: int = 0) -> float | None:
    """When process ``pid`` (0: this one) started, in seconds since the epoch (10 ms
    resolution; ``None`` where ``/proc`` cannot tell). Python and every import it did before
    this call come after it."""
    fields = stat_fields(pid or os.getpid()) or []
    try:
        ticks = int(fields[19])  # field 22, starttime: clock ticks after the boot
    except (ValueError, IndexError):
        return None
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Startup:
    """A run's start, on the wall clock (seconds since the epoch), up to its workers being
    ready: what the controller knows. The run's loops add the rest (:meth:`record`)."""

    launched: float
    """The launch: the launcher's process start, or the embedding controller's entry."""
    controller: float
    """The run clock's origin (``t`` = 0 in ``metrics.jsonl``): sockets bound, workers next."""
    ready: float
    """Every worker said ``Ready``."""
    workers: dict[str, WorkerStamps]

    def record(
        self,
        *,
        first_eval: tuple[float, float] | None,
        first_step: float,
        refit: tuple[float, float] | None,
    ) -> dict[str, Any]:
        """The ``startup`` record, given the rest on the run clock: the first evaluation
        (start, end), step 1's record written, step 1's refit (start, end). Times in it are
        seconds after the launch; ``phases`` add up to ``first_step_s``."""

        def at(t: float) -> float:  # wall clock -> seconds after the launch
            return round(t - self.launched, 3)

        def run(t: float) -> float:  # run clock -> wall clock
            return self.controller + t

        evaluated = run(first_eval[1]) if first_eval else self.ready
        return {
            "kind": "startup",
            "first_step_s": at(run(first_step)),
            "phases": {
                "launch": at(self.controller),
                "workers": round(self.ready - self.controller, 3),
                "first_eval": round(evaluated - self.ready, 3),
                "first_step": round(run(first_step) - evaluated, 3),
            },
            "controller_s": at(self.controller),
            "first_eval_s": [at(run(t)) for t in first_eval] if first_eval else None,
            "refit_s": [at(run(t)) for t in refit] if refit else None,
            "workers": {
                w: {"process_s": at(s.process), "ready_s": at(s.started),
                    **{k: round(v, 3) for k, v in s.phases().items()}}
                for w, s in sorted(self.workers.items())
            },  # fmt: skip
        }


def describe(record: dict[str, Any]) -> str:
    """One line: the time to the first step and where it went (the slowest worker's phases,
    which the others' overlap)."""
    p = record["phases"]
    parts = [f"launch {p['launch']:.1f} s", f"workers {p['workers']:.1f} s"]
    workers = record["workers"]
    if workers:
        name, w = max(workers.items(), key=lambda kv: kv[1]["ready_s"])
        inner = ", ".join(f"{k} {w[k]:.1f}" for k in ("imports", "plugin", "backend"))
        parts[-1] += f" ({name}: {inner})"
    if record["first_eval_s"] is not None:
        parts.append(f"first eval {p['first_eval']:.1f} s")
    step = f"step 1 {p['first_step']:.1f} s"
    if record["refit_s"] is not None:
        a, b = record["refit_s"]
        step += f" (refit {b - a:.2f} s)"
    parts.append(step)
    return f"first step {record['first_step_s']:.1f} s after the launch: " + ", ".join(parts)
