"""Managed agents: the command ``gateway.agent`` run once per session.

The agent is started in a process group of its own under :mod:`asyncrl.gateway.agent_shim`
(which kills the group if the controller exits), with ``OPENAI_BASE_URL`` (its session's
``/s/<id>/v1``), ``OPENAI_API_KEY`` (the session's key), ``ASYNCRL_SESSION_ID`` and
``ASYNCRL_PROMPT_ID`` set, and the prompt on its stdin as one JSON object::

    {"session_id": "...", "prompt_id": "...", "messages": [...], "evaluation": false}

(``messages``: the prompt's chat messages, or its text as one user message). Its stdout and
stderr go to ``<run.output_dir>/logs/agents/<session>.log``. It exits 0 once it has its
answer: the session ends and the environment scores the last reply. Any other exit fails the
session (its group runs again under ``[failures]``). When the session ends first (its reward,
its deadline, the run stopping), the agent's process group is killed; nothing it started
outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import structlog

from asyncrl.gateway import agent_shim
from asyncrl.gateway.schema import GatewayError
from asyncrl.gateway.sessions import Finish, Session, SessionTable
from asyncrl.procs.process import kill_process_group

__all__ = ["ManagedAgents"]

log = structlog.get_logger("asyncrl.gateway.agents")

REAP_S = 5.0
"""Bound on waiting for a killed agent's exit status."""
STDIN_S = 10.0
"""Bound on handing the prompt to an agent that does not read its stdin."""
TAIL_BYTES = 600
"""The end of a failed agent's log, in the warning."""


class ManagedAgents:
    """Starts and ends the managed agent of each session.

    Args:
        command: ``gateway.agent`` (argv).
        env: ``gateway.agent_env``.
        log_dir: where each agent's output goes.
        keep_logs: keep the logs of agents that exited 0 too.
        base_url: the gateway's URL once it listens.
    """

    def __init__(
        self, command: Sequence[str], env: Mapping[str, str], log_dir: str, keep_logs: bool,
        base_url: Callable[[], str],
    ) -> None:
        self._command, self._env = list(command), dict(env)
        self._log_dir, self._keep = Path(log_dir), keep_logs
        self._base_url = base_url

    async def run(
        self, session: Session, table: SessionTable, *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run ``session``'s agent until it exits (then end the session with it) or until
        cancelled (then kill its process group).

        Cancellation: the agent's process group is killed and reaped.
        """
        self._log_dir.mkdir(parents=True, exist_ok=True)
        path = self._log_dir / f"{session.id}.log"
        env = {**os.environ, **self._env,
               "OPENAI_BASE_URL": f"{self._base_url()}/s/{session.id}/v1",
               "OPENAI_API_KEY": session.key, "ASYNCRL_SESSION_ID": session.id,
               "ASYNCRL_PROMPT_ID": session.prompt.id,
               agent_shim.OWNER_ENV: str(os.getpid())}  # fmt: skip
        with open(path, "wb") as out:
            process = await anyio.open_process(
                [sys.executable, agent_shim.__file__, *self._command], stdin=subprocess.PIPE,
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        task_status.started()
        code: int | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._hand_prompt, process, session)
                code = await process.wait()
        finally:
            with anyio.CancelScope(shield=True):
                kill_process_group(process.pid, signal.SIGKILL)  # what it left running too
                with anyio.move_on_after(REAP_S):
                    await process.wait()
        self._ended(session, code, path)

    def _ended(self, session: Session, code: int, path: Path) -> None:
        """The agent exited by itself with ``code``: end its session with that."""
        failure = None
        if code != 0:
            failure = f"the agent exited with code {code}"
        elif not session.answered:
            failure = "the agent exited 0 without an answered call (nothing to train)"
        if failure is None:
            finish = Finish()
            if not self._keep:
                path.unlink(missing_ok=True)
        else:
            finish = Finish(abandon=f"{failure} (its output: {path})")
            log.warning("agent_failed", session=session.id, why=failure, log=str(path),
                        tail=_tail(path))  # fmt: skip
        try:
            session.finish(finish)
        except GatewayError:
            pass  # the session ended first (a reward posted, its deadline)

    async def _hand_prompt(self, process: anyio.abc.Process, session: Session) -> None:
        prompt = session.prompt
        data = msgspec.json.encode({"session_id": session.id, "prompt_id": prompt.id,
                                    "messages": prompt.chat(), "evaluation": session.evaluation})  # fmt: skip
        assert process.stdin is not None
        with anyio.move_on_after(STDIN_S):
            try:
                await process.stdin.send(data + b"\n")
                await process.stdin.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # it does not read its stdin: fine


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
