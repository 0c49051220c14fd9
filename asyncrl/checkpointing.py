"""When and how the run saves itself: checkpoints and Hugging Face exports at step boundaries.

The train pump calls :meth:`Checkpointer.after_step` once each step's refit is done (no step
open, the rollout gate open). The controller's state is snapshotted there, in one synchronous
piece, so it matches the trainer's weights exactly; the trainer ranks then write their state
while generation goes on (only the next step waits), and the controller commits the
checkpoint atomically (:mod:`asyncrl.checkpoint`).

A save that fails (a full disk, a trainer that cannot write) leaves the previous checkpoint as
it was, is logged and counted, and the run goes on; ``checkpoint.max_failures`` failures in a
row stop it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from . import checkpoint as ckpt
from .buffer import Group
from .config import Config, to_dict
from .errors import RunError
from .messages import ExportModel, SaveState
from .rpc import ControlPlane
from .schedule import Scheduler

__all__ = ["Checkpointer", "model_config", "open_resume", "restore_state", "snapshot_state"]

log = structlog.get_logger("asyncrl.checkpointing")


def model_config(model_path: str) -> dict[str, Any] | None:
    """The starting model's ``config.json`` (what a resumed run must start from too)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def snapshot_state(sched: Scheduler, ready: dict[str, Group]) -> ckpt.ControllerState:
    """The controller's state at a step boundary: the scheduler's (with the prompt ledger)
    and the ready groups' samples, in the scheduler's order."""
    scheduler = sched.state_dict()
    return ckpt.ControllerState(
        step=sched.trainer_version,
        finished=sched.finished,
        scheduler=scheduler,
        groups=[ckpt.SavedGroup.of(ready[f"g{g['index']}"]) for g in scheduler["ready"]],
    )


def restore_state(state: ckpt.ControllerState, sched: Scheduler) -> dict[str, Group]:
    """Load ``state`` into the fresh ``sched``; returns the ready groups by id."""
    payloads = {g.group_id: g for g in state.groups}
    restored = sched.load_state_dict(state.scheduler)
    missing = [gid for gid in restored if gid not in payloads]
    if missing or len(payloads) != len(restored):
        raise ckpt.CheckpointError(
            f"the checkpoint of step {state.step} lists ready groups {missing[:5]} without "
            "their samples. Fix: resume from an older checkpoint"
        )
    return {gid: payloads[gid].group() for gid in restored}


class Checkpointer:
    """Saves checkpoints and exports for the pipeline; counts failed saves. ``ready`` is the
    pipeline's table of complete, untrained groups (shared)."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        trainers: list[str],
        scheduler: Scheduler,
        ready: dict[str, Group],
        metrics: Any,
    ) -> None:
        self.config = config
        self.sched = scheduler
        self.ready = ready
        self.control = control
        self.trainers = trainers
        self.metrics = metrics
        self.failures = 0
        """Failed saves in a row."""
        self.last: Path | None = None
        """The last checkpoint this run committed."""
        self._requests: list[anyio.Event] = []
        self._closed = False

    # ------------------------------------------------------------------ on demand
    def request(self) -> anyio.Event:
        """Ask for a checkpoint at the next step boundary (the end of the run counts as one);
        the returned event is set once it is committed, or once a save failed."""
        event = anyio.Event()
        if self._closed:
            event.set()
        else:
            self._requests.append(event)
        return event

    @property
    def requested(self) -> bool:
        return bool(self._requests)

    def close(self) -> None:
        """The run is over: answer requests that no step boundary will serve any more (their
        callers read :attr:`last`)."""
        self._closed = True
        requests, self._requests = self._requests, []
        for event in requests:
            event.set()

    # ------------------------------------------------------------------ the hook
    def due(self, version: int, finished: bool) -> tuple[bool, bool]:
        """``(checkpoint, export)``: what to write after weights ``version``."""
        ck, ex = self.config.checkpoint, self.config.export
        save = self.requested or (ck.every_steps > 0 and version % ck.every_steps == 0)
        save = save or (finished and ck.at_end)
        export = (ex.every_steps > 0 and version % ex.every_steps == 0) or (finished and ex.at_end)
        return save, export

    async def after_step(self) -> None:
        """At a step boundary (no step open, the gate open): checkpoint and export the
        trainer's weights as configured or requested."""
        version, finished = self.sched.trainer_version, self.sched.finished
        save, export = self.due(version, finished)
        if save:  # the snapshot is one synchronous piece: it matches the weights
            await self.save(snapshot_state(self.sched, self.ready), finished=finished)
        if export:
            name = "final" if finished else ckpt.step_name(version)
            await self.export(os.path.join(self.config.export.dir, name))

    async def export(self, path: str) -> None:
        """The trainer's current weights as a Hugging Face directory at ``path``."""
        start = time.perf_counter()
        await self._call_trainers(ExportModel(path=path, source_dir=self.config.model.path))
        seconds = time.perf_counter() - start
        log.info("model_exported", path=path, seconds=round(seconds, 3))
        if self.metrics is not None:
            self.metrics.write({"kind": "export", "path": path, "seconds": seconds})

    async def save(self, state: ckpt.ControllerState, *, finished: bool) -> Path | None:
        """Write one checkpoint of ``state`` and the trainer's state; returns its directory,
        or ``None`` when the save failed (and the run may go on)."""
        cfg = self.config.checkpoint
        requests, self._requests = self._requests, []
        start = time.perf_counter()
        tmp: Path | None = None
        log.debug("checkpoint_started", step=state.step)
        try:
            tmp = await anyio.to_thread.run_sync(ckpt.start_save, cfg.dir, state.step)
            await self._call_trainers(SaveState(path=str(tmp / ckpt.TRAINER_DIR)))
            if cfg.save_model:
                await self._call_trainers(
                    ExportModel(path=str(tmp / ckpt.MODEL_DIR), source_dir=self.config.model.path)
                )
            path = await anyio.to_thread.run_sync(self._commit, tmp, state, finished)
        except Exception as exc:  # noqa: BLE001 - a failed save is counted, not fatal
            if tmp is not None:
                await anyio.to_thread.run_sync(_remove, tmp)
            self._failed(state.step, exc, finished)
            path = None
        else:
            self.failures = 0
            self.last = path
            seconds = time.perf_counter() - start
            log.info("checkpoint_saved", path=str(path), step=state.step, seconds=round(seconds, 3))
            if self.metrics is not None:
                self.metrics.write(
                    {"kind": "checkpoint", "step": state.step, "path": str(path),
                     "seconds": seconds, "finished": finished}
                )
        finally:
            for event in requests:
                event.set()
        return path

    def note_eval(self, record: dict[str, Any]) -> None:
        """A held-out evaluation finished: if it is the best so far, record it in
        ``<checkpoint.dir>/best.json`` (with its checkpoint, if one of its step exists; that
        one is then kept by retention). Blocking: run it in a worker thread."""
        best = ckpt.read_best(self.config.checkpoint.dir)
        if best is not None and best["accuracy"] >= record["accuracy"]:
            return
        path = Path(self.config.checkpoint.dir) / ckpt.step_name(record["version"])
        entry = {
            "step": record["version"],
            "accuracy": record["accuracy"],
            "label": record["label"],
            "checkpoint": str(path) if (path / ckpt.MANIFEST).is_file() else None,
        }
        ckpt.write_best(self.config.checkpoint.dir, entry)
        log.info("best_so_far", **entry)
        self._prune()  # a checkpoint kept only for the old best may go now

    def _commit(self, tmp: Path, state: ckpt.ControllerState, finished: bool) -> Path:
        cfg = self.config.checkpoint
        ledger = state.scheduler["ledger"]
        path = ckpt.commit(
            tmp,
            state=ckpt.encode_state(state),
            step=state.step,
            finished=finished,
            config=to_dict(self.config),
            model_config=model_config(self.config.model.path),
            has_model=cfg.save_model,
            extra={"ledger": {"trained": sum(b - a for a, b in ledger["trained"]),
                              "repeated": ledger["num_repeated"]}},
        )
        self._prune()
        return path

    def _prune(self) -> None:
        """Keep the ``keep_last`` newest checkpoints and the best one (``best.json``)."""
        cfg = self.config.checkpoint
        best = ckpt.read_best(cfg.dir)
        keep = [Path(best["checkpoint"])] if best and best["checkpoint"] else []
        ckpt.prune(cfg.dir, cfg.keep_last, keep=keep)

    def _failed(self, step: int, exc: Exception, finished: bool) -> None:
        self.failures += 1
        limit = self.config.checkpoint.max_failures
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.error(
            "checkpoint_failed",
            step=step,
            error=f"{type(exc).__name__}: {first}",
            failures_in_a_row=self.failures,
            max_failures=limit,
            previous=str(self.last or ckpt.latest(self.config.checkpoint.dir) or "none"),
        )
        if self.metrics is not None:
            error = f"{type(exc).__name__}: {first}"
            self.metrics.write({"kind": "checkpoint_failed", "step": step, "error": error})
        if self.failures > limit or finished:
            what = (
                "the final checkpoint could not be saved"
                if finished
                else f"{self.failures} checkpoint saves in a row failed (checkpoint.max_failures"
                f" = {limit})"
            )
            raise RunError(
                f"{what}; the last: {type(exc).__name__}: {first}. Fix: free space in "
                f"{self.config.checkpoint.dir} (or point checkpoint.dir elsewhere) and resume "
                "from the last checkpoint"
            ) from exc

    async def _call_trainers(self, request: Any) -> None:
        await self.control.call_each(
            self.trainers,
            [request] * len(self.trainers),
            timeout_s=self.config.cluster.call_timeout_s,
        )


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def open_resume(
    cfg: Config, spec: str | None
) -> tuple[ckpt.Checkpoint, ckpt.ControllerState] | None:
    """The checkpoint to resume (checked: intact, this run's, not finished), or ``None``.
    Saves that never finished are cleaned up first."""
    ckpt.remove_stale(cfg.checkpoint.dir)
    if spec is None:
        return None
    checkpoint = ckpt.open_checkpoint(ckpt.resolve(spec, cfg.checkpoint.dir))
    errors, notes = ckpt.compare_configs(checkpoint.manifest["config"], to_dict(cfg))
    saved_model = checkpoint.manifest.get("model_config")
    if saved_model is not None and saved_model != model_config(cfg.model.path):
        errors.append(f"model.path: {cfg.model.path} is not the model the checkpoint started from")
    if errors:
        raise ckpt.CheckpointError(
            f"checkpoint {checkpoint.path} is from another run: "
            + "; ".join(errors[:8])
            + ". Fix: resume with the config the checkpoint was saved with (its manifest.json "
            "holds it), or start a new run in another checkpoint.dir"
        )
    if checkpoint.step >= cfg.run.num_steps:
        raise ckpt.CheckpointError(
            f"checkpoint {checkpoint.path} is at step {checkpoint.step}, and run.num_steps is "
            f"{cfg.run.num_steps}: the run is finished. Fix: to train further, raise "
            f"run.num_steps (e.g. --set run.num_steps={checkpoint.step + cfg.run.num_steps}); "
            "to export the model, run `asyncrl export` on the checkpoint"
        )
    if notes:
        log.warning("resumed_with_changed_settings", changes=notes[:20])
    return checkpoint, checkpoint.state()
