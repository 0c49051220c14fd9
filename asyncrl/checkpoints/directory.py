"""Checkpoints on disk: layout, atomic commit, retention, and the checks before a resume.

::

    <checkpoint.dir>/
        step-00000020/              one checkpoint, named by the trainer version it holds
            manifest.json           written last: format, step, config, fingerprints, and the
                                    size and SHA-256 of every other file (and of itself)
            controller.msgpack      the controller's state (ControllerState, msgpack)
            trainer/                TrainingBackend.save_state (every rank writes its part)
            model/                  the policy as a Hugging Face directory (optional)
        step-00000030/
        .tmp-step-00000040-<pid>/   a save in progress (or a crashed one: removed on start)
        .trash-step-00000010-<pid>-<n>/  a checkpoint being deleted (removed on start)
        step-00000050.rejected-no-manifest/  set aside: a step-* directory that failed its
                                    checks, kept for its owner to look at

A save writes everything into ``.tmp-...``, fsyncs every file, writes ``manifest.json`` last,
renames the directory to ``step-...`` and fsyncs the parent: a crash at any moment leaves
either the new checkpoint whole or no trace of it, and the older ones untouched. Retention
(and a save replacing a checkpoint of its own step) renames a checkpoint to ``.trash-...``
before deleting it, so asyncrl never leaves a ``step-...`` directory without its manifest.

A ``step-...`` directory without a manifest is therefore damage (a lost or deleted
``manifest.json``), and **is never deleted**: it is no checkpoint (retention neither counts
nor deletes it), each start warns about it, ``--resume latest`` refuses to pass over it when
it is the newest (:func:`resolve`: resuming an older one silently would drop its steps), and
a save of its step sets it aside as ``<name>.rejected-no-manifest`` (:func:`set_aside`).

Every file is hashed while it is made durable (:func:`asyncrl.checkpoints.checksums.seal_tree`), and
:meth:`Checkpoint.verify` checks them all before a resume loads anything: a flipped bit in a
trainer shard is refused with the file's name, never trained on.

This module does file I/O only (no sockets, no torch); the pipeline decides when to save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import structlog

from asyncrl.policy.groups import CompletedSample, Group, Part
from asyncrl.policy.live import LiveGroups
from asyncrl.checkpoints.checksums import HASH, digest_bytes, seal_tree, verify_tree
from asyncrl.errors import AsyncRLError
from asyncrl.procs.process import pid_exists

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "ControllerState",
    "FORMAT",
    "READABLE_FORMATS",
    "SavedGroup",
    "commit",
    "decode_state",
    "encode_state",
    "restore",
    "snapshot",
    "latest",
    "list_checkpoints",
    "open_checkpoint",
    "prune",
    "read_best",
    "write_best",
    "remove_stale",
    "resolve",
    "set_aside",
    "start_save",
]

log = structlog.get_logger("asyncrl.checkpoints.directory")

FORMAT = 3
"""Bump when a checkpoint written by this version cannot be read by an older one, or the
reverse. 2: a checksum of every file and fingerprints of the model and data (1 had a hash of
``controller.msgpack`` only). 3: a saved sample may carry a per-token loss mask, its own
prompt and the sequences an episode split off (an older asyncrl would drop them silently and
train inserted observation tokens after the wrong prompt, so it must refuse format 3). From
2 on, every format keeps ``manifest_sha256``: the SHA-256 of the manifest's other keys as
compact JSON with sorted keys, checked before the format."""
READABLE_FORMATS = (2, 3)
"""What this version resumes: a format-2 checkpoint's samples have no masks (all train)."""
MANIFEST = "manifest.json"
_SELF = f"manifest_{HASH}"
"""The manifest's own digest: of its other keys, as compact JSON with sorted keys."""
CONTROLLER_FILE = "controller.msgpack"
TRAINER_DIR = "trainer"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_TMP_DIR = re.compile(r"^\.tmp-step-\d{8}-(\d+)$")

class CheckpointError(AsyncRLError):
    """A checkpoint cannot be resumed or exported (missing, corrupt, from another run or
    finished). The message names the checkpoint, the problem and the fix."""


# --------------------------------------------------------------------------- controller state
def _i32(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype=np.int32).tobytes()


def _f32(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def _array(data: bytes, dtype: type) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).copy()


class SavedPart(msgspec.Struct, array_like=True, gc=False):
    """An episode's sequence split off before its sample's own (format 3)."""

    prompt_ids: bytes  # int32
    token_ids: bytes  # int32
    logprobs: bytes  # float32
    loss_mask: bytes  # uint8
    finish_reason: str
    versions: bytes | None = None
    """int32, one per token; ``None``: not recorded (an asyncrl before protocol 9)."""

    @classmethod
    def of(cls, part: Part) -> SavedPart:
        mask = part.trained_mask().tobytes()
        args = (_i32(part.prompt_ids), _i32(part.token_ids), _f32(part.logprobs), mask)
        return cls(*args, part.finish_reason, _maybe_i32(part.versions))

    def part(self) -> Part:
        return Part(
            _array(self.prompt_ids, np.int32), _array(self.token_ids, np.int32),
            _array(self.logprobs, np.float32), _array(self.loss_mask, np.uint8),
            self.finish_reason, _maybe_array(self.versions),
        )  # fmt: skip


def _maybe_i32(a: Any) -> bytes | None:
    return None if a is None else _i32(a)


def _maybe_array(data: bytes | None) -> np.ndarray | None:
    return None if data is None else _array(data, np.int32)


class SavedSample(msgspec.Struct, array_like=True, gc=False):
    token_ids: bytes  # int32
    logprobs: bytes  # float32
    finish_reason: str
    reward: float
    correct: bool
    loss_mask: bytes | None = None
    """uint8, one per token (format 3); ``None``: every token trains (format 2 had none)."""
    prompt_ids: bytes | None = None
    """int32: the sample's own prompt (format 3); ``None``: its group's."""
    earlier: list[SavedPart] = []
    """The episode's sequences split off before this one (format 3)."""
    versions: bytes | None = None
    """int32, the version of each token; ``None``: not recorded (an older asyncrl wrote it,
    or reads it and drops this field: its tokens then count at their group's start version,
    the oldest they can be, so the format stays 3)."""
    components: dict[str, float] = {}
    """The score's named parts (``grpo.reward_weights`` trains on them); empty when an older
    asyncrl wrote the checkpoint."""

    @classmethod
    def of(cls, sample: CompletedSample) -> SavedSample:
        mask = None if sample.loss_mask is None else sample.trained_mask().tobytes()
        prompt = None if sample.prompt_ids is None else _i32(sample.prompt_ids)
        return cls(
            _i32(sample.token_ids), _f32(sample.logprobs), sample.finish_reason,
            float(sample.reward), bool(sample.correct), mask, prompt,
            [SavedPart.of(p) for p in sample.earlier], _maybe_i32(sample.versions),
            dict(sample.components),
        )  # fmt: skip

    def sample(self) -> CompletedSample:
        mask, prompt = self.loss_mask, self.prompt_ids
        return CompletedSample(
            _array(self.token_ids, np.int32), _array(self.logprobs, np.float32),
            self.finish_reason, self.reward, self.correct,
            loss_mask=None if mask is None else _array(mask, np.uint8),
            prompt_ids=None if prompt is None else _array(prompt, np.int32),
            earlier=tuple(p.part() for p in self.earlier), versions=_maybe_array(self.versions),
            components=dict(self.components),
        )  # fmt: skip


class SavedGroup(msgspec.Struct, array_like=True, gc=False):
    """A complete, untrained group with its samples, logprobs, loss masks and rewards."""

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
            [SavedSample.of(s) for s in group.samples],
        )

    def group(self) -> Group:
        return Group(
            self.group_id,
            self.prompt_id,
            self.prompt_ids,
            self.start_version,
            self.target_step,
            dispatched_at=0.0,
            samples=[s.sample() for s in self.samples],
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
    """:meth:`asyncrl.policy.live.LiveGroups.state_dict` (versions, counters, prompt-stream
    cursor, the sampler's state, the prompt ledger, ready groups, prompts to dispatch
    again)."""
    groups: list[SavedGroup]
    """The ready groups' payloads, in the scheduler's order."""
    evals: list[dict[str, Any]] = []
    """Held-out evaluations so far."""


def snapshot(table: LiveGroups) -> ControllerState:
    """The run's live groups at a step boundary (no open step, no refit): the table's state
    (with the prompt ledger) and the ready groups' samples, in the table's order."""
    return ControllerState(
        step=table.trainer_version,
        finished=table.finished,
        scheduler=table.state_dict(),
        groups=[SavedGroup.of(g) for g in table.ready_groups()],
    )


def restore(table: LiveGroups, state: ControllerState) -> tuple[int, set[int]]:
    """Load a :func:`snapshot` into a fresh table (nothing dispatched yet). Returns where the
    prompt stream goes on: the first position to read, and the positions before the old
    frontier to skip (those not dispatched again).

    Raises:
        CheckpointError: the state lists ready groups without their samples.
    """
    records = {g.index: g.group() for g in state.groups}
    ready = {int(g["index"]) for g in state.scheduler.get("ready", [])}
    if ready != records.keys():
        missing = [f"g{i}" for i in sorted(ready - records.keys())]
        raise CheckpointError(
            f"the checkpoint of step {state.step} lists ready groups {missing[:5]} without "
            "their samples. Fix: resume from an older checkpoint"
        )
    table.load_state_dict(state.scheduler, records)
    again = {int(i) for i, _ in state.scheduler["redispatch"]}
    frontier = table.next_index
    start = min(again | {frontier})
    return start, set(range(start, frontier)) - again


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

    def verify(self) -> None:
        """Check every file against the manifest's sizes and digests, and that no other file
        is there. Blocking: it reads every byte (docs/checkpointing.md has the speed); run it
        in a worker thread.

        Raises:
            CheckpointError: the first files that differ, named, with the fix.
        """
        self._check(lambda: verify_tree(self.path, self.manifest["files"], exclude=(MANIFEST,)))

    def verify_copy(self, part: str, copy: str | os.PathLike[str]) -> None:
        """Check ``copy``, a copy of the checkpoint's directory ``part`` (e.g. ``model``),
        against the manifest: what an export hands out is what the save wrote.

        Raises:
            CheckpointError: the first files that differ, named, with the fix (an older
                checkpoint to export).
        """
        prefix = part.rstrip("/") + "/"
        files = self.manifest["files"]
        listed = {k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix)}
        self._check(lambda: [prefix + p for p in verify_tree(copy, listed)], export=True)

    def _check(self, problems_of: Callable[[], list[str]], *, export: bool = False) -> None:
        try:
            problems = problems_of()
        except OSError as exc:
            raise _corrupt(self.path, f"a file cannot be read: {exc}", export=export) from None
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise _corrupt(self.path, "; ".join(problems[:3]) + more, export=export)

    def state(self) -> ControllerState:
        """The controller's state, checked against the manifest's size and digest."""
        file = self.path / CONTROLLER_FILE
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise _corrupt(self.path, f"cannot read {CONTROLLER_FILE}: {exc}") from None
        want = self.manifest["files"].get(CONTROLLER_FILE) or {}
        if len(data) != want.get("bytes") or digest_bytes(data) != want.get(HASH):
            raise _corrupt(self.path, f"{CONTROLLER_FILE} does not match its {HASH} in the "
                           "manifest")  # fmt: skip
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
    return _step_dirs(root, lambda p: (p / MANIFEST).is_file())


def latest(root: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def without_manifest(root: str | os.PathLike[str]) -> list[Path]:
    """``step-*`` directories under ``root`` that have no manifest (damage: asyncrl never
    leaves one), oldest first."""
    return _step_dirs(root, lambda p: p.is_dir() and not (p / MANIFEST).exists())


def _step_dirs(root: str | os.PathLike[str], keep: Callable[[Path], bool]) -> list[Path]:
    """The ``step-N`` entries under ``root`` that ``keep`` takes, by step, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and keep(p)]  # fmt: skip
    return [p for _, p in sorted(found)]


def _newest(root: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint under ``root``.

    Raises:
        CheckpointError: a ``step-*`` directory newer than it (or with none) has no manifest:
            resuming an older one would pass over it without a word.
    """
    found = latest(root)
    broken = without_manifest(root)
    if broken and (found is None or _step_of(broken[-1]) > _step_of(found)):
        raise _corrupt(
            broken[-1],
            f"it has no {MANIFEST}, so none of its files can be checked (a save never leaves "
            f"a checkpoint so: it was lost or deleted since). It is newer than "
            f"{'every checkpoint' if found is None else found.name} and kept as it is",
        )
    return found


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def resolve(spec: str, root: str | os.PathLike[str]) -> Path:
    """The checkpoint ``spec`` names: ``latest`` (the newest under ``root``), a checkpoint
    directory, or a directory of checkpoints (its newest).

    Raises:
        CheckpointError: nothing there, naming what was looked at and the fix; the newest
            ``step-*`` directory has no manifest (refused rather than passed over: it is
            damage, and resuming an older checkpoint would drop its steps without a word).
    """
    if spec == "latest":
        found = _newest(root)
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
    inside = _newest(path)
    if inside is not None:
        return inside
    if path.is_dir() and _STEP_DIR.match(path.name):
        raise _corrupt(path, f"it has no {MANIFEST}, so none of its files can be checked (a "
                       "save never leaves a checkpoint so: it was lost or deleted since)")
    raise CheckpointError(
        f"{spec}: no checkpoint there (no {MANIFEST}, and no step-* checkpoint inside). Fix: "
        "pass a checkpoint directory (step-NNNNNNNN) or the directory that holds them"
    )


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a checkpoint's manifest (format, fields, its own digest) and that its
    parts are there; :meth:`Checkpoint.verify` checks the files' contents.

    Raises:
        CheckpointError: missing, unreadable or altered manifest, another format, a missing
            part.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise _corrupt(path, f"it has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise _corrupt(path, f"{MANIFEST} is unreadable: {exc}") from None
    if not isinstance(manifest, dict):
        raise _corrupt(path, f"{MANIFEST} is not a JSON object")
    if _SELF in manifest and _self_digest(manifest) != manifest[_SELF]:
        raise _corrupt(path, f"{MANIFEST} does not match its own {HASH} (it was altered)")
    if "format" in manifest and manifest["format"] not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {path} has format {manifest['format']}; this asyncrl reads formats "
            f"{' and '.join(map(str, READABLE_FORMATS))} (format 2 added a checksum of every "
            "file and the model's and data's fingerprints, 3 the loss masks and episode "
            "prompts of saved samples). Fix: resume or export it with the asyncrl version that "
            "wrote it "
            f"({manifest.get('asyncrl_version', 'unknown')}), or start the run again"
        )
    need = ("format", "step", "finished", "config", "fingerprints", "files", _SELF)
    missing = [k for k in need if k not in manifest]
    if missing:
        raise _corrupt(path, f"{MANIFEST} lacks {', '.join(missing)}")
    parts = (CONTROLLER_FILE, TRAINER_DIR) + ((MODEL_DIR,) if manifest.get("has_model") else ())
    for part in parts:
        if not (path / part).exists():
            raise _corrupt(path, f"{part} is missing")
    return Checkpoint(path, manifest)


def _corrupt(path: Path, problem: str, *, export: bool = False) -> CheckpointError:
    older = [p for p in list_checkpoints(path.parent) if p != path]
    if export:
        fix = (f"export an older checkpoint, e.g. asyncrl export {older[-1]} OUT" if older
               else "export the model at the end of a run again (export.at_end)")  # fmt: skip
    elif older:
        fix = f"resume from an older checkpoint, e.g. --resume {older[-1]}"
    else:
        fix = "start the run again without --resume"
    return CheckpointError(f"checkpoint {path} is corrupt: {problem}. Fix: {fix}")


def _self_digest(manifest: dict[str, Any]) -> str:
    rest = {k: v for k, v in manifest.items() if k != _SELF}
    return digest_bytes(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


# --------------------------------------------------------------------------- saving
def remove_stale(root: str | os.PathLike[str]) -> list[Path]:
    """Remove saves that never finished (``.tmp-*`` of a process that is gone) and deletions
    that did not (``.trash-*``); returns what was removed. A ``step-*`` directory without a
    manifest is kept (it is damage, not asyncrl's: see the module's docstring), with a
    warning naming it."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        tmp = _TMP_DIR.match(p.name)
        if (tmp and not pid_exists(int(tmp.group(1)))) or p.name.startswith(".trash-"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("stale_checkpoint_dirs_removed", paths=[str(p) for p in removed])
    broken = without_manifest(root)
    if broken:
        log.warning(
            "checkpoint_without_manifest_kept", paths=[str(p) for p in broken],
            problem=f"no {MANIFEST}: its files cannot be checked, so it is no checkpoint; it is "
            "kept as it is (retention neither counts nor deletes it). Fix: restore its "
            f"{MANIFEST} if you have a copy, else move it out of {root} once you no longer "
            "need its files",
        )  # fmt: skip
    return removed


def set_aside(path: Path, reason: str) -> Path:
    """Rename ``path`` to ``<name>.rejected-<reason>`` (``-2``, ``-3``... when taken) beside
    it, never deleting it: no longer a ``step-*`` name, it is no checkpoint, and retention
    and :func:`remove_stale` leave it alone. Logged as a warning naming both paths."""
    target = path.with_name(f"{path.name}.rejected-{reason}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.rejected-{reason}-{n}")
    path.rename(target)
    _fsync_dir(path.parent)
    log.warning("checkpoint_set_aside", path=str(path), moved_to=str(target), problem=reason)
    return target


def _discard(path: Path) -> None:
    """Delete checkpoint ``path``: renamed to ``.trash-...`` first (atomic), so that no crash
    leaves a ``step-*`` directory without its manifest (a ``.trash-*`` is removed on start)."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    path.rename(trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


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
    fingerprints: dict[str, Any] | None = None,
    has_model: bool,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the controller's state into ``tmp``; hash every file and make it durable (the
    trainer's and the model's were written by other processes); write the manifest with the
    files' digests, ``fingerprints`` (:func:`asyncrl.checkpoints.resume_rule.fingerprints`) and its own
    digest; rename ``tmp`` to its final name (replacing a checkpoint of the same step).
    Blocking: run it in a worker thread."""
    _write_durable(tmp / CONTROLLER_FILE, state)
    files = seal_tree(tmp, exclude=(MANIFEST,))
    manifest = {
        "format": FORMAT,
        "step": step,
        "finished": finished,
        "created": time.time(),
        "asyncrl_version": _asyncrl_version(),
        "has_model": has_model,
        "config": config,
        "fingerprints": fingerprints or {},
        "files": files,
        **(extra or {}),
    }
    manifest[_SELF] = _self_digest(manifest)
    _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = tmp.parent / step_name(step)
    if (final / MANIFEST).exists():  # e.g. an on-demand save at the step a periodic one saved
        _discard(final)
    elif final.exists():  # no manifest: damage, kept for its owner
        set_aside(final, "no-manifest")
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
    """Delete all but the newest ``keep_last`` checkpoints (and those in ``keep``). Only
    checkpoints count and go: a ``step-*`` directory without a manifest and one set aside
    (:func:`set_aside`) are neither counted nor touched. Each is renamed to ``.trash-...``
    before it is deleted, so an interrupted deletion leaves no checkpoint-looking directory."""
    protect = {Path(p).resolve() for p in keep}
    found = list_checkpoints(root)
    doomed = [p for p in found[: max(0, len(found) - keep_last)] if p.resolve() not in protect]
    for p in doomed:
        _discard(p)
    return doomed


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
