"""The inbox of ``asyncrl jobs`` (asyncrl/run/jobs_inbox.py): a request reaches the run whole
and its answer comes back to the one who asked; hostile request files are answered with
their error and change nothing; nothing is left once the run ends."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from asyncrl.run import jobs_inbox
from asyncrl.run.jobs_inbox import Inbox, JobAnswer, JobRequest, ask

@pytest.mark.anyio
async def test_requests_are_answered_in_order_and_hostile_ones_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_inbox, "INBOX_POLL_S", 0.01)
    monkeypatch.setattr(jobs_inbox, "MAX_REQUEST_BYTES", 4096)
    seen: list[JobRequest] = []

    async def handle(request: JobRequest) -> JobAnswer:
        seen.append(request)
        return JobAnswer(ok=True, jobs=[{"job": request.job, "n": len(seen)}])

    async with Inbox(str(tmp_path)) as inbox:
        inbox_dir = tmp_path / "jobs.d" / "inbox"
        assert oct(inbox_dir.stat().st_mode & 0o777) == "0o700"
        hostile = {"0-a.json": b"\x00not json", "0-b.json": b'{"op": "add", "colour": 1}',
                   "0-c.json": b'{"op": "delete"}', "0-d.json": b" " * 5000}  # fmt: skip
        for name, data in hostile.items():
            (inbox_dir / name).write_bytes(data)
        async with anyio.create_task_group() as tg:
            tg.start_soon(inbox.serve, handle)
            add = JobRequest(op="add", job="math", table={"run": {"seed": 3}})
            answer = await anyio.to_thread.run_sync(lambda: ask(str(tmp_path), add))
            listed = await anyio.to_thread.run_sync(
                lambda: ask(str(tmp_path), JobRequest(op="list")))
            tg.cancel_scope.cancel()
        assert seen == [add, JobRequest(op="list")]  # the hostile ones reached no handler
        assert answer == JobAnswer(ok=True, jobs=[{"job": "math", "n": 1}])
        assert listed.jobs == [{"job": "", "n": 2}]
        answers = tmp_path / "jobs.d" / "answers"
        errors = {p.name: p.read_text() for p in answers.iterdir()}
        assert sorted(errors) == sorted(hostile)  # each answered with its error...
        assert '"ok":false' in errors["0-b.json"] and "colour" in errors["0-b.json"]
        assert "over 4096 bytes" in errors["0-d.json"]
        assert list(inbox_dir.iterdir()) == []  # ...and taken out
        for answer in answers.iterdir():  # as the one who asked would
            answer.unlink()
    assert not (tmp_path / "jobs.d").exists()


@pytest.mark.anyio
async def test_asking_where_no_run_answers(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run of jobs is running in"):
        ask(str(tmp_path), JobRequest(op="list"))
    async with Inbox(str(tmp_path)):  # a run that does not read its inbox
        with pytest.raises(TimeoutError, match="did not answer within 0 s"):
            ask(str(tmp_path), JobRequest(op="list"), timeout_s=0.1)
        assert list((tmp_path / "jobs.d" / "inbox").iterdir()) == []  # taken back
