"""Jobs changed from another shell (docs/jobs.md): ``asyncrl jobs add|stop|list CONFIG`` hand a
request to the running run through its directory, and the controller answers beside it.

::

    asyncrl jobs add CONFIG NAME ─► <run.output_dir>/jobs.d/inbox/<id>.json   (written whole:
                                                                               a rename)
    controller (every INBOX_POLL_S) ── reads it, acts (Jobs.add / stop / list) ──►
        <run.output_dir>/jobs.d/answers/<id>.json ── the command reads it, removes it, prints

Why files and not a socket: the run directory is the user's already (its permissions are the
access control; nothing listens, so nothing is reachable from the network or by another user
who cannot write there), a request survives a busy controller (it is read at its next poll),
and nothing is left to secure or to remove but the directory, which the run removes as it
ends. A request is at most :data:`MAX_REQUEST_BYTES`; one that does not decode is answered
with the error (the command prints it) and changes nothing.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
import structlog

__all__ = ["INBOX_DIR", "Inbox", "JobAnswer", "JobRequest", "ask"]

log = structlog.get_logger("asyncrl.run.jobs_inbox")

INBOX_DIR = "jobs.d"
"""Under ``run.output_dir``: ``inbox/`` (requests) and ``answers/``; there while the run is."""
INBOX_POLL_S = 0.25
"""How often the controller looks for requests (a command's answer comes within this)."""
PICKUP_S = 1.0
"""As the run ends, how long an answer written last may wait for the one who asked (who looks
every 50 ms) before the inbox goes with its answers."""
MAX_REQUEST_BYTES = 1 << 20
MAX_PER_POLL = 16
"""Requests read at one look: the rest wait for the next (a flood holds the loop no longer)."""


class JobRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What ``asyncrl jobs`` asks of the run."""

    op: Literal["add", "stop", "list"]
    job: str = ""
    """The job to add or stop."""
    table: dict[str, Any] = {}
    """``add``: the job's ``[jobs.<name>]`` table, paths absolute."""


class JobAnswer(msgspec.Struct, kw_only=True):
    """The run's answer: ``ok``, or the ``error`` (the command's one line); ``jobs``: where
    each stands after the request (``Controller.jobs.list()``)."""

    ok: bool
    error: str = ""
    jobs: list[dict[str, Any]] = []


class Inbox:
    """The controller's end: made when a run of jobs starts, removed (with what is in it) when
    it ends. Use as ``async with``."""

    def __init__(self, output_dir: str) -> None:
        self.root = Path(output_dir, INBOX_DIR)
        self._requests, self._answers = self.root / "inbox", self.root / "answers"

    async def __aenter__(self) -> Inbox:
        shutil.rmtree(self.root, ignore_errors=True)  # a killed run's requests: not ours
        for d in (self._requests, self._answers):
            d.mkdir(parents=True, mode=0o700)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Remove the inbox once the answers written last were taken (at most
        :data:`PICKUP_S` after them; shielded: the run is ending)."""
        with anyio.CancelScope(shield=True):
            while True:
                written = [p.stat().st_mtime for p in self._answers.glob("*.json")]
                if not written or time.time() > max(written) + PICKUP_S:
                    break
                await anyio.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)

    async def serve(self, handle: Callable[[JobRequest], Awaitable[JobAnswer]]) -> None:
        """Answer each request with ``handle``'s answer (its error, for one that does not
        decode), in the order they came, until cancelled."""
        while True:
            for name, request in await anyio.to_thread.run_sync(self._take):
                # taken, it is answered however the run ends meanwhile (a stop of the last
                # job ends it): the one who asked waits for that answer
                with anyio.CancelScope(shield=True):
                    if isinstance(request, str):
                        answer = JobAnswer(ok=False, error=request)
                    else:
                        answer = await handle(request)
                    await anyio.to_thread.run_sync(self._answer, name, answer)
            await anyio.sleep(INBOX_POLL_S)

    def _take(self) -> list[tuple[str, JobRequest | str]]:
        out: list[tuple[str, JobRequest | str]] = []
        for path in sorted(self._requests.glob("*.json"))[:MAX_PER_POLL]:
            try:
                if path.stat().st_size > MAX_REQUEST_BYTES:
                    raise ValueError(f"is over {MAX_REQUEST_BYTES} bytes")
                request: JobRequest | str = msgspec.json.decode(path.read_bytes(),
                                                                type=JobRequest)  # fmt: skip
            except (OSError, ValueError, msgspec.DecodeError) as exc:
                request = f"request {path.name}: {exc}"
                log.warning("job_request_refused", file=path.name, error=str(exc))
            path.unlink(missing_ok=True)
            out.append((path.stem, request))
        return out

    def _answer(self, name: str, answer: JobAnswer) -> None:
        _write_whole(self._answers / f"{name}.json", msgspec.json.encode(answer))


def ask(output_dir: str, request: JobRequest, *, timeout_s: float = 60.0) -> JobAnswer:
    """Hand ``request`` to the run in ``output_dir`` and wait for its answer (blocking: a
    command's).

    Raises:
        FileNotFoundError: no run of jobs has its inbox there, or the run ended before it
            answered.
        TimeoutError: no answer within ``timeout_s`` (the request is taken back)."""
    root = Path(output_dir, INBOX_DIR)
    if not (root / "inbox").is_dir():
        raise FileNotFoundError(f"no run of jobs is running in {output_dir} (no {root})")
    name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    request_path = root / "inbox" / f"{name}.json"
    answer_path = root / "answers" / f"{name}.json"
    _write_whole(request_path, msgspec.json.encode(request))
    deadline = time.monotonic() + timeout_s
    while not answer_path.exists():
        if not request_path.exists() and not root.exists():
            raise FileNotFoundError(f"the run in {output_dir} ended before it answered")
        if time.monotonic() > deadline:
            request_path.unlink(missing_ok=True)
            raise TimeoutError(f"the run in {output_dir} did not answer within {timeout_s:.0f} s")
        time.sleep(0.05)
    data = answer_path.read_bytes()
    answer_path.unlink(missing_ok=True)
    return msgspec.json.decode(data, type=JobAnswer)


def _write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path``, seen by a reader whole or not at all (written aside, renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, path)
