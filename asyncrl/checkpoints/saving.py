"""When and how the run saves itself: checkpoints and Hugging Face exports at step boundaries.

The train pump calls :meth:`Checkpointer.after_step` once each step's refit is done (no step
open, the rollout gate open). The controller's state is snapshotted there, in one synchronous
piece, so it matches the trainer's weights exactly; the trainer ranks then write their state
while generation goes on (only the next step waits), and the controller commits the
checkpoint atomically (:mod:`asyncrl.checkpoints.directory`).

A save that fails (a trainer that cannot write) leaves the previous checkpoint as it was, is
logged and counted, and the run goes on; :data:`MAX_SAVE_FAILURES` failures in a row stop
it. A full disk (ENOSPC) stops the run at once with a :class:`~asyncrl.errors.NoSpaceError`
(the previous checkpoint is still whole): it does not empty itself between saves, and every
step trained after it would be lost to the next crash.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from asyncrl.checkpoints import directory as ckpt
from asyncrl.checkpoints import resume_rule
from asyncrl.config.modes import run_steps
from asyncrl.procs import space
from asyncrl import registry
from asyncrl.config import Config, to_dict
from asyncrl.errors import (
    NonFiniteError, NoSpaceError, PluginError, RemoteCallError, RunError, flatten,
)  # fmt: skip
from asyncrl.config.service_sections import harmless_keys, removed_keys
from asyncrl.wire.messages import ExportModel, LoadState, SaveState
from asyncrl.wire.rpc import ControlPlane

__all__ = ["MAX_SAVE_FAILURES", "Checkpointer", "Resume", "open_resume", "reward_code_of"]

log = structlog.get_logger("asyncrl.checkpoints.saving")

MAX_SAVE_FAILURES = 3
"""Failed periodic saves in a row that stop the run (an I/O error, a trainer that cannot
write): the run goes on after fewer, and the third stops it (0 and 1: the first), as does a
failed final save, or a full disk at once. Three: a passing hiccup of a network file system
costs a checkpoint or two, not the run, while a broken one stops it within three checkpoint
intervals. Once the config key ``checkpoint.max_failures`` (issue 50)."""


def run_fingerprints(
    cfg: Config, train_prompts: Sequence[Any], code: dict[str, str] | None = None
) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run beyond its config (the model's files,
    the chat template's text, the train split, the reward code ``code``:
    :func:`reward_code_of`): :func:`asyncrl.checkpoints.resume_rule.fingerprints`."""
    return resume_rule.fingerprints(
        cfg.model.path, cfg.model.chat_template, train_prompts, code
    )


def reward_code_of(cfg: Config, environment: Any) -> dict[str, str]:
    """The reward code of ``environment`` (:func:`asyncrl.checkpoints.resume_rule.code_fingerprints`),
    with the module of its factory as ``environment.name``'s entry point names it. Blocking
    (reads a few source files and the entry points): run it in a worker thread, once, as the
    run starts (the controller hands it to :func:`open_resume` and the :class:`Checkpointer`)."""
    modules = []
    try:
        found = registry.available("asyncrl.environments").get(cfg.environment.name)
    except PluginError:  # registered twice: the run was refused before this
        found = None
    if found is not None:
        modules.append(found.value.partition(":")[0].strip())
    return resume_rule.code_fingerprints(environment, modules, name=cfg.environment.name)


class Checkpointer:
    """Saves checkpoints and exports for the loops; counts failed saves. ``train_prompts``:
    the environment's train split (its fingerprint goes into each manifest); ``code``: the
    run's reward code (:func:`reward_code_of`, taken as the run started; ``None``: not
    recorded, and a resume from these checkpoints does not compare it); ``before_save``:
    awaited before a checkpoint's state is taken, to bring what a resume from it keeps up to
    date (the trained samples' files: :meth:`asyncrl.obs.sample_export.SampleExport.flushed`)."""

    def __init__(
        self,
        config: Config,
        *,
        control: ControlPlane,
        trainers: list[str],
        metrics: Any,
        train_prompts: Sequence[Any],
        code: dict[str, str] | None = None,
        before_save: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self._before_save = before_save
        self._train_prompts = train_prompts
        self._code = code
        """The code the run imported, read when it started (an edit since is not this run's)."""
        self._fingerprints: dict[str, Any] | None = None
        """Computed once, at the first save (the run's model and data do not change)."""
        self.control = control
        self.trainers = trainers
        self.metrics = metrics
        self.failures = 0
        """Failed saves in a row."""
        self.last: Path | None = None
        """The last checkpoint this run committed."""
        self._requests: list[anyio.Event] = []
        self._closed = False

    async def resume(self, resume: Resume) -> None:
        """A resumed run: the trainers load the checkpoint's state, which is this run's last
        checkpoint until it saves one (recorded in the metrics file)."""
        checkpoint, state = resume.checkpoint, resume.state
        await self._call_trainers(LoadState(path=str(checkpoint.trainer_dir)))
        self.last = checkpoint.path
        if self.metrics is not None:
            self.metrics.write({"kind": "resume", "step": state.step,
                                "checkpoint": str(checkpoint.path),
                                "allowed_changes": resume.changes.allowed,
                                "changed_settings": resume.changes.harmless})  # fmt: skip
        log.info("run_resumed", step=state.step, checkpoint=str(checkpoint.path),
                 ready_groups=len(state.groups), redispatch=len(state.scheduler["redispatch"]))

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

    async def after_step(
        self, version: int, finished: bool, snapshot: Callable[[], ckpt.ControllerState]
    ) -> None:
        """At a step boundary (no step open, the gate open; the trainer at ``version``):
        checkpoint (the controller's state from ``snapshot()``) and export the trainer's
        weights as configured or requested."""
        save, export = self.due(version, finished)
        if save and self._before_save is not None:  # what a resume from it keeps is written
            await self._before_save()
        if save:  # the snapshot is one synchronous piece: it matches the weights
            await self.save(snapshot(), finished=finished)
        if export:
            name = "final" if finished else ckpt.step_name(version)
            await self.export(os.path.join(self.config.export.dir, name))

    async def export(self, path: str) -> None:
        """The trainer's current weights as a Hugging Face directory at ``path``."""
        start = time.perf_counter()
        try:
            await self._call_trainers(ExportModel(path=path, source_dir=self.config.model.path))
        except Exception as exc:
            leaf = space.full_leaf(exc)
            if leaf is None:
                raise
            size = space.model_size(self.config.model.path)
            raise space.no_space(
                space.failed_path(leaf, path),
                size.served_bytes(self.config.model.dtype) if size is not None else None,
                "the model export in", "free space there, or point export.dir at a file system "
                "with more room (or set export.at_end = false and export.every_steps = 0)",
            ) from leaf
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
            written = 0
            if tmp is not None:
                written = await anyio.to_thread.run_sync(_remove, tmp)
            self._failed(state.step, exc, finished, written, tmp)
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
        if self._fingerprints is None:
            self._fingerprints = run_fingerprints(self.config, self._train_prompts, self._code)
        path = ckpt.commit(
            tmp,
            state=ckpt.encode_state(state),
            step=state.step,
            finished=finished,
            config=to_dict(self.config),
            fingerprints=self._fingerprints,
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

    def _failed(
        self, step: int, exc: Exception, finished: bool, written: int = 0,
        tmp: Path | None = None,
    ) -> None:
        self.failures += 1
        limit = MAX_SAVE_FAILURES
        full = self._no_space(step, exc, written, tmp)
        exc = space.full_leaf(exc) or flatten(exc)[0]  # what a group of trainer calls hides
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        last = self.last or ckpt.latest(self.config.checkpoint.dir)
        fix = save_fix(exc, self.config.checkpoint.dir, last)
        log.error(
            "checkpoint_failed",
            step=step,
            error=f"{type(exc).__name__}: {first}",
            failures_in_a_row=self.failures,
            max_failures=limit,
            previous=str(last or "none"),
            fix=fix,
        )
        if self.metrics is not None:
            error = f"{type(exc).__name__}: {first}"
            try:
                self.metrics.write({"kind": "checkpoint_failed", "step": step, "error": error})
            except NoSpaceError:
                if full is None:
                    raise
        if full is not None:  # a full disk does not empty itself: stop now (docs/failures.md)
            raise full from exc
        if getattr(exc, "remote_type", "") == "NonFiniteError":  # weights do not heal either
            raise NonFiniteError(f"the checkpoint of step {step} was not saved: {first}") from exc
        if self.failures >= max(limit, 1) or finished:  # N failures in a row stop the run
            if finished:
                what = "the final checkpoint could not be saved"
            elif self.failures == 1:
                what = (f"the checkpoint of step {step} could not be saved (MAX_SAVE_FAILURES "
                        f"= {limit}: the first failure stops the run)")  # fmt: skip
            else:
                what = (f"{self.failures} checkpoint saves in a row failed (MAX_SAVE_FAILURES "
                        f"= {limit}, asyncrl.checkpoints.saving)")  # fmt: skip
            raise RunError(f"{what}; the last: {type(exc).__name__}: {first}. Fix: {fix}") from exc

    def _no_space(
        self, step: int, exc: BaseException, written: int, tmp: Path | None
    ) -> NoSpaceError | None:
        """``exc`` as a ``NoSpaceError`` if it is a full disk (else ``None``), naming the file
        that failed (else the save's directory, ``tmp``): the bytes needed are about the last
        checkpoint's size, at least one checkpoint of the model
        (:func:`asyncrl.procs.space.checkpoint_need`) and more than the failed save wrote."""
        leaf = space.full_leaf(exc)
        if leaf is None:
            return None
        cfg = self.config
        last = self.last or ckpt.latest(cfg.checkpoint.dir)
        size = space.model_size(cfg.model.path)
        previous = space.tree_bytes(last) if last else 0
        needed = max(previous, space.checkpoint_need(cfg, size), written + 1 if written else 0)
        resume = f"resume from {last}" if last else "start again (no checkpoint was saved)"
        where = space.failed_path(leaf, str(tmp or cfg.checkpoint.dir))
        if error_number(leaf) == errno.EDQUOT:  # the file system may have room: the user not
            need = f" ({space.size_text(needed)} needed)" if needed else ""
            return NoSpaceError(
                f"disk quota exceeded (EDQUOT) for the checkpoint of step {step} in {where}: "
                f"this user's quota on that file system is used up{need}. Fix: free space "
                f"within the quota (`quota -s` shows it) or ask for a "
                f"larger one, or point checkpoint.dir at a file system with room, then {resume}",
                path=where, needed_bytes=needed or None,
            )  # fmt: skip
        return space.no_space(
            where, needed or None,
            f"the checkpoint of step {step} in",
            f"free space in {cfg.checkpoint.dir}, or point checkpoint.dir at a file system with "
            f"more room, then {resume}",
            at_least=needed > previous,  # no checkpoint to size it by: lower bounds only
        )

    async def _call_trainers(self, request: Any) -> None:
        await self.control.call_each(
            self.trainers,
            [request] * len(self.trainers),
            timeout_s=self.config.cluster.call_timeout_s,
        )


_ERRNO = re.compile(r"\[Errno (\d+)\]")


def error_number(exc: BaseException) -> int | None:
    """The ``errno`` behind a failed save: of ``exc`` or the first ``OSError`` it was raised
    from, or, for a worker's failure, the last ``[Errno N]`` its message (else its traceback)
    quotes; ``None`` when there is none."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno:
            return cause.errno
        cause = cause.__cause__ or cause.__context__
    texts = [exc.remote_message, exc.remote_traceback] if isinstance(exc, RemoteCallError) \
        else [str(exc)]  # fmt: skip
    for text in texts:
        found = _ERRNO.findall(text or "")
        if found:
            return int(found[-1])
    return None


def save_fix(exc: BaseException, directory: str, last: Path | None) -> str:
    """The fix for a save that failed with ``exc`` in ``directory``, by its errno: each
    cause has its own (a file too large is not a directory to make writable)."""
    then = (f"then resume from {last}" if last
            else "then start again (no checkpoint was saved)")  # fmt: skip
    elsewhere = "or point checkpoint.dir elsewhere"
    number = error_number(exc)
    if number == errno.EFBIG:
        return (
            "a file of the save grew past the largest file allowed: this process's file-size "
            "limit (`ulimit -f` in the shell or job script that starts the run shows it; "
            "`ulimit -f unlimited` lifts it, as does the scheduler's own file-size setting) or "
            f"the largest file the file system of {directory} holds (4 GiB on FAT32); lift "
            f"the limit, or point checkpoint.dir at a file system without it, {then}"
        )
    if number in (errno.EACCES, errno.EPERM):
        return (f"make {directory} writable by this user (`ls -ld {directory}` shows its owner "
                f"and mode; chown or chmod it), {elsewhere}, {then}")  # fmt: skip
    if number == errno.EROFS:
        return (f"{directory} is on a read-only file system (mounted so, or remounted so by the "
                f"kernel after a disk error: see `dmesg`); remount it read-write, or point "
                f"checkpoint.dir at a writable file system, {then}")  # fmt: skip
    if number in (errno.ENOSPC, errno.EDQUOT):
        return (f"free space in {directory} (or, for EDQUOT, within your quota there: "
                f"`quota -s`), {elsewhere} with more room, {then}")  # fmt: skip
    if number == errno.EIO:
        return (f"the device or network file system under {directory} reported an I/O error "
                f"(see `dmesg` or the file server); repair it, {elsewhere}, {then}")  # fmt: skip
    return (f"find the cause in the error (a trainer's own log has its traceback); if it is "
            f"{directory}'s file system, repair it {elsewhere}; {then}")  # fmt: skip


def _remove(path: Path) -> int:
    """Remove ``path``; returns the bytes it held."""
    held = space.tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return held


@dataclass
class Resume:
    """A checkpoint accepted for a resume: verified, its state read, the changes logged."""

    checkpoint: ckpt.Checkpoint
    state: ckpt.ControllerState
    changes: resume_rule.Changes


def _refuse_finished(path: Any, step: int, cfg: Config, train_prompts: int) -> None:
    """Raises CheckpointError: the checkpoint at ``step`` ends the run already (its steps
    or its epochs), with how to train further."""
    steps = run_steps(cfg, train_prompts)
    export = "to export the model, run `asyncrl export` on the checkpoint"
    if step >= steps < cfg.run.num_steps:
        raise ckpt.CheckpointError(
            f"checkpoint {path} is at step {step}, and run.max_num_epochs = "
            f"{cfg.run.max_num_epochs} passes over the train split ({train_prompts} prompts, "
            f"{steps} steps) end the run there: it is finished. Fix: to train further, raise "
            f"run.max_num_epochs (e.g. --set run.max_num_epochs={cfg.run.max_num_epochs + 1}) "
            f"or set it to 0; {export}"
        )
    if step >= cfg.run.num_steps:
        raise ckpt.CheckpointError(
            f"checkpoint {path} is at step {step}, and run.num_steps is {cfg.run.num_steps}: "
            f"the run is finished. Fix: to train further, raise run.num_steps (e.g. --set "
            f"run.num_steps={step + cfg.run.num_steps}); {export}"
        )


def open_resume(
    cfg: Config,
    spec: str | None,
    *,
    train_prompts: Sequence[Any],
    allow_changed: Iterable[str] = (),
    code: dict[str, str] | None = None,
) -> Resume | None:
    """The checkpoint to resume, or ``None`` (``spec`` is ``None``). Checked before anything
    loads it: this run's settings against the checkpoint's (:mod:`asyncrl.checkpoints.resume_rule`;
    ``allow_changed`` names the strict changes accepted; ``code``: the run's reward code,
    :func:`reward_code_of`, ``None``: not compared), not finished, every file's size and
    digest. Saves that never finished are cleaned up first. Blocking: run it in a worker
    thread.

    Raises:
        CheckpointError: missing, corrupt (naming the file), saved with settings that change
            what it means (naming each, ``saved -> current``), or finished; each with the fix.
    """
    ckpt.remove_stale(cfg.checkpoint.dir)
    allow = [a.strip() for item in allow_changed for a in item.split(",") if a.strip()]
    if spec is None:
        if allow:
            raise ckpt.CheckpointError(
                f"--allow-changed {','.join(allow)} without --resume: it only applies to a "
                "resumed run. Fix: add --resume, or drop --allow-changed"
            )
        return None
    checkpoint = ckpt.open_checkpoint(ckpt.resolve(spec, cfg.checkpoint.dir))
    saved = {"config": checkpoint.manifest["config"],
             "fingerprints": checkpoint.manifest["fingerprints"]}  # fmt: skip
    current = {"config": to_dict(cfg),
               "fingerprints": run_fingerprints(cfg, train_prompts, code)}  # fmt: skip
    changes = resume_rule.compare(saved, current, allow, harmless_keys(cfg),
                                  removed_keys(cfg))  # fmt: skip
    for line in changes.not_compared:
        log.info("resume_not_compared", checkpoint=str(checkpoint.path), what=line)
    _refuse_changes(checkpoint, changes)
    _refuse_finished(checkpoint.path, checkpoint.step, cfg, len(train_prompts))
    start = time.perf_counter()
    checkpoint.verify()
    size = sum(f["bytes"] for f in checkpoint.manifest["files"].values())
    log.info("checkpoint_verified", path=str(checkpoint.path), files=len(
        checkpoint.manifest["files"]), bytes=size, seconds=round(time.perf_counter() - start, 3))
    if changes.allowed:
        log.warning("resumed_with_allowed_changes", changes=changes.allowed)
    if changes.harmless:
        log.info("resumed_with_changed_settings", changes=changes.harmless[:20])
    return Resume(checkpoint, checkpoint.state(), changes)


def _refuse_changes(checkpoint: ckpt.Checkpoint, changes: resume_rule.Changes) -> None:
    if changes.unknown:
        raise ckpt.CheckpointError(
            f"--allow-changed {','.join(changes.unknown)}: no setting of that name. Fix: name "
            "fields or sections as the config spells them (loss.clip_eps_low, loss, "
            f"trainer.options.lr), or one of {', '.join(resume_rule.FINGERPRINT_FIELDS)}, or "
            "all"
        )
    if not changes.refused:
        return
    more = len(changes.refused) - 8
    edited = [line.partition(": ")[0][len(resume_rule.CODE) + 1:] for line in changes.refused
              if line.startswith(resume_rule.CODE + ".")]  # fmt: skip
    code = (f"; for edited code ({', '.join(edited)}), restore the file the checkpoint was "
            "trained with, e.g. from version control" if edited else "")  # fmt: skip
    raise ckpt.CheckpointError(
        f"checkpoint {checkpoint.path} is from another run: "
        + "; ".join(changes.refused[:8])
        + (f"; and {more} more" if more > 0 else "")
        + ". These settings change what the checkpoint means (docs/checkpointing.md, "
        "'Resuming with changed settings'). Fix: restore them (the checkpoint's manifest.json "
        f"holds its config{code}), or accept the change with --allow-changed "
        f"{','.join(changes.names)} (allow_changed= when embedded), or start a new run in "
        "another checkpoint.dir"
    )
