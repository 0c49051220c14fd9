"""What was trained, on disk (``run.save_samples``): one JSON line per sequence a step sent to
the trainer, in ``<run.output_dir>/samples-NNNNN.jsonl`` (docs/observability.md, "Trained
samples").

::

    train pump ──put(step, groups, advantages)──► stream (2 steps) ──► writer task (run)
      (the step's optimizer step taken)            full? put waits        │ to_thread: lines
                                                                          ▼ built, encoded, written
    checkpoint ──flushed()── waits until every step put so far is     samples-00000.jsonl,
                              written (a resume keeps what it covers)  samples-00001.jsonl, ...

The lines are made from the step's groups in the order :func:`~asyncrl.policy.grpo.pack_groups`
packed them (each sample's sequences: those its episode split off, then its own), with the
advantage each sequence trained with. Files are numbered from ``00000``; each holds whole
steps, and the one a step took past :data:`SAMPLES_FILE_MB` is the last to get lines (the next
step starts the next file). When the writer starts it removes the lines of every step after
the one the run starts from (a resume from step k keeps steps 1..k, a fresh run none): the
files hold each step once, in order, whatever was written after the checkpoint and however
the last run ended (a torn last line included). A write that finds the disk full is cut back
to the last whole step and raises :class:`~asyncrl.errors.NoSpaceError`: the run stops (the
lines are never silently lost).

Writing never blocks the event loop: lines are built and encoded (msgspec) in a worker thread,
one step at a time; the pump waits (not the loop) only when two steps are queued.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import numpy as np
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from asyncrl.policy.groups import Group
from asyncrl.procs.space import is_no_space, no_space
from asyncrl.sinks.jsonl import cut_torn_line

__all__ = [
    "SAMPLES_FILE_MB", "SampleExport", "SampleFiles", "SampleLine", "sample_files", "step_lines",
]  # fmt: skip

SAMPLES_FILE_MB = 256.0
"""A samples file that has reached this many MiB gets no more steps (a step's lines stay in
one file); the next step starts the next number. Once the config key ``run.samples_file_mb``
(issue 50: nobody set it): 256 MiB is a few hundred steps of a small model's samples, a file
an editor or ``jq`` still opens whole."""

log = structlog.get_logger("asyncrl.obs.sample_export")

QUEUE_STEPS = 2
"""Steps queued for the writer before :meth:`SampleExport.put` waits."""
WRITE_BYTES = 1 << 20
"""Lines are written in pieces of about this size (one ``write`` each)."""
_NAME = re.compile(r"samples-(\d{5,})\.jsonl")
_Item = tuple[int, list[Group], list[np.ndarray]]


class SampleLine(msgspec.Struct, kw_only=True):
    """One line of a samples file: a sequence the trainer got in step :attr:`step`. Read one
    with ``msgspec.json.decode(line, type=SampleLine)`` (or any JSON reader)."""

    step: int
    """The optimizer step that trained it, from 1 (``metrics.jsonl``'s ``train`` records)."""
    episode: str
    """The sample's id, ``<group>/<index>``: a multi-turn episode's id, and a gateway
    session's ``episode`` (``POST /rl/sessions`` answers it; a session offered again under a
    new session id keeps it)."""
    group: str
    """Its prompt group (the ``samples_per_prompt`` samples whose rewards the advantage
    compares)."""
    prompt_id: str
    """The prompt's id in the data set (``train:<index>`` or the data's own)."""
    part: int
    """Which of the sample's sequences, from 0: an episode whose chat template did not keep
    earlier turns as a prefix trains several (``episode_splits``); the last is its own."""
    parts: int
    """How many sequences the sample trains (1 for a single-turn sample)."""
    prompt_ids: list[int]
    """The sequence's prompt, as the trainer got it."""
    token_ids: list[int]
    """The response: the generated tokens, and a multi-turn sequence's inserted ones."""
    loss_mask: list[int]
    """One per ``token_ids``: 1 where the token trains (generated), 0 where it does not (a tool
    result or user turn the controller inserted, or ``episode.on_truncation = "mask"``)."""
    logprobs: list[float]
    """One per ``token_ids``: the behaviour (generator's) logprob of each, float32 values
    (``numpy.float32`` of each is exact); a placeholder where ``loss_mask`` is 0."""
    versions: list[int] | None
    """One per ``token_ids``: the weight version that generated each token (-1 on inserted
    ones); ``null`` when the engine did not say (then every token counts as
    :attr:`start_version`, the oldest it can be)."""
    start_version: int
    """The generators' weight version when the group was dispatched."""
    reward: float
    components: dict[str, float]
    """The reward's named parts (``Score.components``), if any."""
    correct: bool
    advantage: float
    """The advantage the sequence trained with (``grpo.advantage_estimator``, with a KL
    penalty in the reward when ``loss.kl_in = "reward"``), before ``loss.aggregation =
    "sequence_mean"`` divides it by the sequence's trained tokens."""
    finish_reason: str
    """Why generation ended (``stop``, ``length``, ``abort``...); an episode's truncation
    reason (``max_turns``, ``deadline``...) on its own sequence."""


class _Step(msgspec.Struct):
    step: int


_ENCODER = msgspec.json.Encoder()
_STEP = msgspec.json.Decoder(_Step)


def step_lines(
    step: int, groups: Sequence[Group], advantages: Sequence[np.ndarray]
) -> Iterator[SampleLine]:
    """The lines of step ``step`` (from 1): each sequence of the scored ``groups`` in
    :func:`~asyncrl.policy.grpo.pack_groups`' order, with its advantage from ``advantages``
    (each chunk's per-sequence advantages, in the same order).

    Raises:
        ValueError: ``advantages`` does not hold one value per sequence (a caller's bug).
    """
    adv = np.concatenate(advantages).tolist() if advantages else []
    count = sum(len(s.earlier) + 1 for g in groups for s in g.samples)
    if count != len(adv):
        raise ValueError(f"step {step}: {len(adv)} advantages for {count} sequences")
    i = 0
    for g in groups:
        group_prompt = np.asarray(g.prompt_ids, np.int32)
        for index, s in enumerate(g.samples):
            sequences = s.sequences(group_prompt)
            versions = [p.versions for p in s.earlier] + [s.versions]
            for part, ((prompt, tokens, logprobs, mask), v) in enumerate(zip(sequences, versions)):
                token_ids = np.asarray(tokens).tolist()
                yield SampleLine(
                    step=step, episode=f"{g.group_id}/{index}", group=g.group_id,
                    prompt_id=g.prompt_id, part=part, parts=len(sequences),
                    prompt_ids=np.asarray(prompt).tolist(), token_ids=token_ids,
                    loss_mask=np.asarray(mask).tolist(), logprobs=np.asarray(logprobs).tolist(),
                    versions=_versions(v, len(token_ids)), start_version=g.start_version,
                    reward=float(s.reward), components=dict(s.components),
                    correct=bool(s.correct), advantage=adv[i], finish_reason=s.finish_reason,
                )  # fmt: skip
                i += 1


def _versions(versions: Any, n: int) -> list[int] | None:
    """Each token's version as a list, ``None`` when not recorded (or not one per token)."""
    if versions is None or len(versions) != n:
        return None
    return np.asarray(versions).tolist()  # type: ignore[no-any-return]


def sample_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The samples files in ``directory``, in order (``samples-00000.jsonl`` first)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _NAME.fullmatch(n))]
    return [Path(directory, n) for _, n in sorted(found)]


@dataclass(frozen=True)
class Cut:
    """What :meth:`SampleFiles.keep_through` removed."""

    files: int
    bytes: int


class SampleFiles:
    """The samples files of one run directory: cut back to a step, then appended step by
    step. Blocking file I/O, one thread at a time (:class:`SampleExport` runs it in a worker
    thread)."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.path = ""
        """The file being appended to ("" before the first)."""
        self._number = -1
        self._fd = -1
        self._size = 0

    def keep_through(self, step: int) -> Cut:
        """Remove every line of the steps after ``step`` (0: all of them), and a torn last
        line; the next step's lines go to the last file left (or to a new one)."""
        os.makedirs(self.directory, exist_ok=True)
        files = sample_files(self.directory)
        kept = 0
        for path in files:  # a file holds whole steps, in order: one file may need a cut
            first = _first_step(path)
            if first is None or first > step:
                break
            kept += 1
        removed = 0
        for path in files[kept:]:  # they start after ``step`` (or hold no whole line)
            removed += path.stat().st_size
            path.unlink()
        self.close()
        self._number = -1
        if kept:
            self._open(_number(files[kept - 1]))
            removed += self._cut_after(step)
        return Cut(files=len(files) - kept, bytes=removed)

    def write_step(
        self, step: int, groups: Sequence[Group], advantages: Sequence[np.ndarray]
    ) -> int:
        """Append step ``step``'s lines (:func:`step_lines`), all or none; returns the lines.

        Raises:
            NoSpaceError: the file system is full (the file ends with the previous step).
            OSError: another failed write (the same).
        """
        if self._fd < 0 or self._size >= self.max_bytes:
            self._open(self._number + 1)
        start, lines, pending, size, encoded = self._size, 0, [], 0, 0
        try:
            for line in step_lines(step, groups, advantages):
                data = _ENCODER.encode(line) + b"\n"
                pending.append(data)
                size += len(data)
                encoded += len(data)
                lines += 1
                # hand the GIL over after each line: the event loop waits for a line's work,
                # not for the interpreter's 5 ms switch interval (loop lag p99 under load:
                # 32-37 ms without, 6-11 ms with; 4-6 ms with no export)
                time.sleep(0)
                if size >= WRITE_BYTES:
                    self._write(b"".join(pending))
                    pending, size = [], 0
            if pending:
                self._write(b"".join(pending))
        except BaseException as exc:
            os.ftruncate(self._fd, start)  # back to the last whole step
            self._size = start
            if isinstance(exc, OSError) and is_no_space(exc):
                raise no_space(
                    self.path, encoded, f"the trained samples of step {step} in",
                    "free space on that file system, or point run.output_dir at one with more "
                    "room (or set run.save_samples = false), then resume (the file ends with "
                    "the last whole step)", at_least=True,
                ) from None
            raise
        return lines

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write(self, data: bytes) -> None:
        written = os.write(self._fd, data)
        self._size += written
        if written != len(data):  # a short write: the disk filled up within the piece
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def _open(self, number: int) -> None:
        self.close()
        self._number = number
        self.path = os.path.join(self.directory, f"samples-{number:05d}.jsonl")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _cut_after(self, step: int) -> int:
        """Truncate the open file before its first line of a step after ``step`` (and a torn
        last line); returns the bytes cut."""
        cut = cut_torn_line(self._fd)
        offset = 0
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            for line in f:
                found = _step_of(line)
                if found is None or found > step:
                    break
                offset += len(line)
        cut += os.fstat(self._fd).st_size - offset
        os.ftruncate(self._fd, offset)
        self._size = offset
        return cut


def _first_step(path: Path) -> int | None:
    """The step of ``path``'s first line; ``None`` without a whole, readable one."""
    with open(path, "rb") as f:
        line = f.readline()
    return _step_of(line) if line.endswith(b"\n") else None


def _step_of(line: bytes) -> int | None:
    """The ``step`` of a line; ``None`` for a line that is not one of ours (damaged)."""
    try:
        return _STEP.decode(line).step
    except msgspec.DecodeError:
        return None


def _number(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    assert match is not None  # sample_files listed it
    return int(match.group(1))


class SampleExport:
    """Writes each trained step's lines from the controller's loop without blocking it:
    :meth:`run` in the run's task group, :meth:`put` after each step's optimizer step (while
    :meth:`run` runs), :meth:`flushed` before a checkpoint (see the module docstring)."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.files = SampleFiles(directory, max_bytes)
        self._send: MemoryObjectSendStream[_Item] | None = None
        self._put = 0
        self._written = 0
        self._progress: anyio.Event | None = None
        """Set (and replaced) as each step is written, while :meth:`flushed` waits."""

    async def run(
        self,
        start_step: int,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Remove the lines of steps after ``start_step`` (the step the run starts from: a
        resumed run's checkpoint, else 0), then write each step :meth:`put` hands over.

        Raises:
            NoSpaceError: the disk is full (the files end with the last whole step).

        Cancellation: a step being written is finished first (its thread is waited for)."""
        send, receive = anyio.create_memory_object_stream[_Item](QUEUE_STEPS)
        try:
            with send, receive:
                self._cut(await anyio.to_thread.run_sync(self.files.keep_through, start_step),
                          start_step)  # fmt: skip
                self._send = send
                task_status.started()
                async for step, groups, advantages in receive:
                    await anyio.to_thread.run_sync(self.files.write_step, step, groups, advantages)
                    self._written += 1
                    if self._progress is not None:
                        self._progress.set()
                        self._progress = None
        finally:
            self._send = None
            self.files.close()

    def _cut(self, cut: Cut, start_step: int) -> None:
        where = self.files.directory
        if cut.bytes and start_step:
            log.info("samples_cut", kept_through_step=start_step, files_removed=cut.files,
                     bytes_removed=cut.bytes, directory=where)  # fmt: skip
        elif cut.bytes:
            log.warning("samples_removed", files=cut.files, bytes=cut.bytes, directory=where,
                        hint="a new run in this run.output_dir starts its samples files afresh; "
                        "give each run its own output_dir to keep them")  # fmt: skip

    async def put(
        self, step: int, groups: Sequence[Group], advantages: Sequence[np.ndarray]
    ) -> None:
        """Queue step ``step``'s lines (from 1); waits while :data:`QUEUE_STEPS` steps are
        queued. Cancellation: the step is not queued.

        Raises:
            RuntimeError: :meth:`run` is not running."""
        if self._send is None:
            raise RuntimeError("SampleExport.put() while its run() is not running")
        await self._send.send((step, list(groups), list(advantages)))
        self._put += 1

    async def flushed(self) -> None:
        """Wait until every step put so far is written. Cancellation: nothing changes."""
        target = self._put
        while self._written < target:
            if self._progress is None:
                self._progress = anyio.Event()
            await self._progress.wait()
