"""Managed agents: the command ``gateway.agent`` run once per session.

The agent is started in a process group of its own under :mod:`asyncrl_gateway.agent_shim`
(which ends everything the agent started when the agent exits, or the controller), with ``OPENAI_BASE_URL`` (its session's
``/s/<id>/v1``), ``OPENAI_API_KEY`` (the session's key), ``ASYNCRL_SESSION_ID`` and
``ASYNCRL_PROMPT_ID`` set, and the prompt on its stdin as one JSON object::

    {"session_id": "...", "prompt_id": "...", "messages": [...], "evaluation": false}

(``messages``: the prompt's chat messages, or its text as one user message). Its stdout and
stderr go to ``<run.output_dir>/logs/agents/<session>.log``. It exits 0 once it has its
answer: the session ends and the environment scores the last reply. Any other exit fails the
session (its group runs again under ``[failures]``). When the session ends first (its reward,
its deadline, the run stopping), the shim is told (SIGTERM) and ends everything the agent
started, in its group or not (the shim is their subreaper); the controller SIGKILLs the
shim's group if it is not gone within :data:`END_S`. Nothing the agent started outlives its
session.

The command is :func:`~asyncrl_gateway.agent_command.agent_command` of ``gateway.agent``, run
in ``gateway.agent_dir``; at most ``gateway.max_agents`` agents run at once, and a session
beyond that waits for a slot before its agent starts (its deadlines start with its agent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import structlog

from asyncrl.plugin.common import kill_process_group
from asyncrl_gateway import agent_shim
from asyncrl_gateway.agent_command import agent_command, agent_environment
from asyncrl_gateway.config import GatewayConfig
from asyncrl_gateway.schema import GatewayError
from asyncrl_gateway.sessions import Finish, Session, SessionTable

__all__ = ["ManagedAgents"]

log = structlog.get_logger("asyncrl_gateway.agents")

END_S = 5.0
"""Bound on the shim's end of an agent it was told to end (a scan of ``/proc`` and a SIGKILL
to each process: milliseconds), before the controller SIGKILLs the shim's group."""
REAP_S = 5.0
"""Bound on waiting for a killed agent's exit status."""
STDIN_S = 10.0
"""Bound on handing the prompt to an agent that does not read its stdin."""
TAIL_BYTES = 600
"""The end of a failed agent's log, in the warning."""


class ManagedAgents:
    """Starts and ends the managed agent of each session.

    Args:
        config: ``[gateway]`` (``agent``, ``agent_env``, ``agent_dir``, ``max_agents``,
            ``keep_agent_logs``).
        log_dir: where each agent's output goes.
        base_url: the gateway's URL once it listens.
    """

    def __init__(self, config: GatewayConfig, log_dir: str, base_url: Callable[[], str]) -> None:
        self._command = agent_command(config.agent, config.agent_dir)
        self._cwd, self._env = config.agent_dir, dict(config.agent_env)
        self._log_dir, self._keep = Path(log_dir), config.keep_agent_logs
        self._base_url = base_url
        self._slots = anyio.Semaphore(config.agents_at_once())

    async def run(
        self, session: Session, table: SessionTable, *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Wait for a slot (``gateway.max_agents``), then run ``session``'s agent until it
        exits (then end the session with it) or until cancelled (then end it and everything
        it started). ``task_status`` is given once the agent has started: the session's
        deadlines count from then.

        Cancellation: while waiting, stops waiting; once started, the agent and everything it
        started are ended (the shim's end, then SIGKILL to its group) and reaped.
        """
        async with self._slots:
            session.claim()  # handed out now: the wait for a slot takes nothing from it
            code, path = await self._run(session, task_status)
        self._ended(session, code, path)

    async def _run(
        self, session: Session, task_status: anyio.abc.TaskStatus[None]
    ) -> tuple[int, Path]:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        path = self._log_dir / f"{session.id}.log"
        env = {**agent_environment(self._env),
               "OPENAI_BASE_URL": f"{self._base_url()}/s/{session.id}/v1",
               "OPENAI_API_KEY": session.key, "ASYNCRL_SESSION_ID": session.id,
               "ASYNCRL_PROMPT_ID": session.prompt.id,
               agent_shim.OWNER_ENV: str(os.getpid())}  # fmt: skip
        with open(path, "wb") as out:
            process = await anyio.open_process(
                [sys.executable, agent_shim.__file__, *self._command], stdin=subprocess.PIPE,
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self._cwd,
                start_new_session=True,
            )  # fmt: skip
        task_status.started()
        code: int | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._hand_prompt, process, session)
                code = await process.wait()  # the shim's: after it ended what the agent left
        finally:
            with anyio.CancelScope(shield=True):
                if code is None:  # the session ended first: the shim ends the agent's tree
                    try:
                        process.terminate()
                    except ProcessLookupError:
                        pass
                    with anyio.move_on_after(END_S):
                        await process.wait()
                kill_process_group(process.pid, signal.SIGKILL)  # its group: a last resort
                with anyio.move_on_after(REAP_S):
                    await process.wait()
        assert code is not None  # set unless the wait raised
        return code, path

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
