"""Checkpoints on disk: layout, atomic commit, retention, and the checks before a resume.

::

    <checkpoint.dir>/
        step-00000020/              one checkpoint, named by the trainer version it holds
            manifest.json           written last: format, step, config, hashes (below)
            controller.msgpack      the controller's state (ControllerState, msgpack)
            trainer/                TrainingBackend.save_state (every rank writes its part)
            model/                  the policy as a Hugging Face directory (optional)
        step-00000030/
        .tmp-step-00000040-<pid>/   a save in progress (or a crashed one: removed on start)

A save writes everything into ``.tmp-...``, fsyncs every file, writes ``manifest.json`` last,
renames the directory to ``step-...`` and fsyncs the parent: a crash at any moment leaves
either the new checkpoint whole or no trace of it, and the older ones untouched. A directory
without a manifest is never taken for a checkpoint. Retention deletes a checkpoint's manifest
first, so a half-deleted directory is no checkpoint either.

This module does file I/O only (no sockets, no torch); the pipeline decides when to save.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import structlog

from .buffer import CompletedSample, Group
from .errors import AsyncRLError
from .process import pid_exists

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "ControllerState",
    "FORMAT",
    "SavedGroup",
    "compare_configs",
    "commit",
    "decode_state",
    "encode_state",
    "latest",
    "list_checkpoints",
    "open_checkpoint",
    "prune",
    "read_best",
    "write_best",
    "remove_stale",
    "resolve",
    "start_save",
]

log = structlog.get_logger("asyncrl.checkpoint")

FORMAT = 1
"""Bump when a checkpoint written by this version cannot be read by an older one."""
MANIFEST = "manifest.json"
CONTROLLER_FILE = "controller.msgpack"
TRAINER_DIR = "trainer"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_TMP_DIR = re.compile(r"^\.tmp-step-\d{8}-(\d+)$")

STRICT_FIELDS = (
    "run.seed",
    "grpo.prompts_per_step",
    "grpo.samples_per_prompt",
    "pipeline.sampler",
    "environment.name",
    "environment.options",
    "trainer.backend",
    "trainer.options",
    "cluster.trainer_ranks",
)
"""Settings a resumed run must share with the checkpoint: the prompt stream's order and
grouping, the staleness policy whose state is saved, and the trainer state's layout."""


class CheckpointError(AsyncRLError):
    """A checkpoint cannot be resumed or exported (missing, corrupt, from another run or
    finished). The message names the checkpoint, the problem and the fix."""


# --------------------------------------------------------------------------- controller state
class SavedSample(msgspec.Struct, array_like=True, gc=False):
    token_ids: bytes  # int32
    logprobs: bytes  # float32
    finish_reason: str
    reward: float
    correct: bool


class SavedGroup(msgspec.Struct, array_like=True, gc=False):
    """A complete, untrained group with its samples, logprobs and rewards."""

    group_id: str
    index: int
    prompt_id: str
    prompt_ids: list[int]
    start_version: int
    target_step: int | None
    end_version: int | None
    samples: list[SavedSample]

    @classmethod
    def of(cls, group: Group) -> SavedGroup:
        return cls(
            group.group_id,
            group.index,
            group.prompt_id,
            list(group.prompt_ids),
            group.start_version,
            group.target_step,
            group.end_version,
            [
                SavedSample(
                    np.ascontiguousarray(s.token_ids, dtype=np.int32).tobytes(),
                    np.ascontiguousarray(s.logprobs, dtype=np.float32).tobytes(),
                    s.finish_reason,
                    float(s.reward),
                    bool(s.correct),
                )
                for s in group.samples
            ],
        )

    def group(self) -> Group:
        return Group(
            self.group_id,
            self.prompt_id,
            self.prompt_ids,
            self.start_version,
            self.target_step,
            dispatched_at=0.0,
            samples=[
                CompletedSample(
                    np.frombuffer(s.token_ids, dtype=np.int32).copy(),
                    np.frombuffer(s.logprobs, dtype=np.float32).copy(),
                    s.finish_reason,
                    s.reward,
                    s.correct,
                )
                for s in self.samples
            ],
            end_version=self.end_version,
            index=self.index,
        )


class ControllerState(msgspec.Struct, kw_only=True):
    """Everything the controller needs to go on from a step boundary."""

    format: int = FORMAT
    step: int
    """The trainer version: optimizer steps taken."""
    finished: bool
    scheduler: dict[str, Any]
    """:meth:`asyncrl.schedule.Scheduler.state_dict` (versions, counters, prompt-stream
    cursor, the sampler's state, the prompt ledger, ready groups, prompts to dispatch
    again)."""
    groups: list[SavedGroup]
    """The ready groups' payloads, in the scheduler's order."""
    evals: list[dict[str, Any]] = []
    """Held-out evaluations so far."""


def encode_state(state: ControllerState) -> bytes:
    return msgspec.msgpack.encode(state)


def decode_state(data: bytes) -> ControllerState:
    return msgspec.msgpack.decode(data, type=ControllerState)


# --------------------------------------------------------------------------- on disk
@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory and its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def trainer_dir(self) -> Path:
        return self.path / TRAINER_DIR

    @property
    def model_dir(self) -> Path | None:
        return self.path / MODEL_DIR if self.manifest.get("has_model") else None

    def state(self) -> ControllerState:
        """The controller's state, checked against the manifest's size and hash."""
        file = self.path / CONTROLLER_FILE
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise _corrupt(self.path, f"cannot read {CONTROLLER_FILE}: {exc}") from None
        want = self.manifest.get("controller_sha256")
        if len(data) != self.manifest.get("controller_bytes") or _sha256(data) != want:
            raise _corrupt(self.path, f"{CONTROLLER_FILE} does not match its manifest hash")
        try:
            state = decode_state(data)
        except msgspec.DecodeError as exc:
            raise _corrupt(self.path, f"{CONTROLLER_FILE} does not decode: {exc}") from None
        if state.step != self.step:
            raise _corrupt(
                self.path, f"the state is of step {state.step}, the manifest's {self.step}"
            )
        return state


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Committed checkpoint directories under ``root`` (those with a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest(root: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(spec: str, root: str | os.PathLike[str]) -> Path:
    """The checkpoint ``spec`` names: ``latest`` (the newest under ``root``), a checkpoint
    directory, or a directory of checkpoints (its newest).

    Raises:
        CheckpointError: nothing there, naming what was looked at and the fix.
    """
    if spec == "latest":
        found = latest(root)
        if found is None:
            raise CheckpointError(
                f"--resume latest: no checkpoint in {root}. Fix: point --resume at a "
                "checkpoint directory, or start without --resume (checkpoints are saved every "
                "checkpoint.every_steps steps and at the end)"
            )
        return found
    path = Path(spec).expanduser().resolve()
    if (path / MANIFEST).is_file():
        return path
    inside = latest(path)
    if inside is not None:
        return inside
    if path.is_dir() and _STEP_DIR.match(path.name):
        raise _corrupt(path, f"it has no {MANIFEST} (a save that never finished)")
    raise CheckpointError(
        f"{spec}: no checkpoint there (no {MANIFEST}, and no step-* checkpoint inside). Fix: "
        "pass a checkpoint directory (step-NNNNNNNN) or the directory that holds them"
    )


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a checkpoint's manifest (format, fields, the controller file's size).

    Raises:
        CheckpointError: missing or unreadable manifest, another format, a missing part.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise _corrupt(path, f"it has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise _corrupt(path, f"{MANIFEST} is unreadable: {exc}") from None
    need = ("format", "step", "finished", "config", "controller_sha256", "controller_bytes")
    missing = [k for k in need if k not in manifest] if isinstance(manifest, dict) else need
    if missing:
        raise _corrupt(path, f"{MANIFEST} lacks {', '.join(missing)}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {manifest['format']}; this asyncrl reads format "
            f"{FORMAT}. Fix: resume it with the asyncrl version that wrote it "
            f"({manifest.get('asyncrl_version', 'unknown')})"
        )
    parts = (CONTROLLER_FILE, TRAINER_DIR) + ((MODEL_DIR,) if manifest.get("has_model") else ())
    for part in parts:
        if not (path / part).exists():
            raise _corrupt(path, f"{part} is missing")
    return Checkpoint(path, manifest)


def _corrupt(path: Path, problem: str) -> CheckpointError:
    older = [p for p in list_checkpoints(path.parent) if p != path]
    fix = (
        f"resume from an older checkpoint, e.g. --resume {older[-1]}"
        if older
        else "start the run again without --resume"
    )
    return CheckpointError(f"checkpoint {path} is corrupt: {problem}. Fix: {fix}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- saving
def remove_stale(root: str | os.PathLike[str]) -> list[Path]:
    """Remove saves that never finished (``.tmp-*`` of a process that is gone) and
    half-deleted checkpoints (no manifest); returns what was removed."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        tmp = _TMP_DIR.match(p.name)
        stale = (tmp and not pid_exists(int(tmp.group(1)))) or (
            _STEP_DIR.match(p.name) and not (p / MANIFEST).exists()
        ) or p.name.startswith(".trash-")
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("stale_checkpoint_dirs_removed", paths=[str(p) for p in removed])
    return removed


def start_save(root: str | os.PathLike[str], step: int) -> Path:
    """Create the temporary directory a save of ``step`` writes into (with ``trainer/``)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / TRAINER_DIR).mkdir(parents=True)
    return tmp


def commit(
    tmp: Path,
    *,
    state: bytes,
    step: int,
    finished: bool,
    config: dict[str, Any],
    model_config: dict[str, Any] | None,
    has_model: bool,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the controller's state and the manifest into ``tmp``, make every file durable,
    and rename ``tmp`` to its final name (replacing a checkpoint of the same step). Blocking:
    run it in a worker thread."""
    _write_durable(tmp / CONTROLLER_FILE, state)
    manifest = {
        "format": FORMAT,
        "step": step,
        "finished": finished,
        "created": time.time(),
        "asyncrl_version": _asyncrl_version(),
        "controller_sha256": _sha256(state),
        "controller_bytes": len(state),
        "has_model": has_model,
        "model_config": model_config,
        "config": config,
        **(extra or {}),
    }
    _fsync_tree(tmp)  # the trainer's and the model's files, written by other processes
    _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = tmp.parent / step_name(step)
    if final.exists():  # e.g. an on-demand save at the step the periodic one also saved
        trash = tmp.parent / f".trash-{final.name}-{os.getpid()}"
        (final / MANIFEST).unlink(missing_ok=True)
        final.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(tmp.parent)
    return final


BEST = "best.json"


def read_best(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``<root>/best.json``: the best held-out evaluation so far (step, accuracy, checkpoint
    or ``None``), or ``None`` before the first."""
    try:
        return json.loads((Path(root) / BEST).read_text())
    except (OSError, ValueError):
        return None


def write_best(root: str | os.PathLike[str], entry: dict[str, Any]) -> None:
    """Replace ``<root>/best.json`` atomically."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{BEST}.{os.getpid()}"
    _write_durable(tmp, json.dumps(entry, indent=1).encode())
    tmp.replace(root / BEST)
    _fsync_dir(root)


def _asyncrl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncrl")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


def prune(root: str | os.PathLike[str], keep_last: int, keep: Iterable[Path] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (and those in ``keep``); the
    manifest goes first, so an interrupted deletion leaves no checkpoint-looking directory."""
    protect = {Path(p).resolve() for p in keep}
    found = list_checkpoints(root)
    doomed = [p for p in found[: max(0, len(found) - keep_last)] if p.resolve() not in protect]
    for p in doomed:
        (p / MANIFEST).unlink(missing_ok=True)
        _fsync_dir(p)
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- resuming
def compare_configs(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(errors, notes)``: the strict fields (:data:`STRICT_FIELDS`) that differ, and every
    other setting that differs (allowed: timeouts, logging, ``run.num_steps``...), each as
    ``field: saved -> current``."""
    errors, notes = [], []
    old, new = _leaves(saved), _leaves(current)
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if a == b:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        strict = any(key == f or key.startswith(f + ".") for f in STRICT_FIELDS)
        (errors if strict else notes).append(line)
    return errors, notes


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}
