"""Managed agents start and end as users expect: ``gateway.agent`` resolved against the config
file's directory with ``python`` the run's interpreter, checked before the run (a broken
command is one config error), at most ``gateway.max_agents`` running at once, and every
process an agent started ended with its session, one that left its process group and session
(``setsid``) included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from asyncrl.config import load_config
from asyncrl.environment import Prompt
from asyncrl.errors import ConfigError
from asyncrl_gateway import agent_shim
from asyncrl_gateway.agent_command import agent_command, check_agent
from asyncrl_gateway.agents import ManagedAgents
from asyncrl_gateway.config import GatewayConfig, gateway_config
from asyncrl_gateway.sessions import SessionTable

# model_dir: the fixture in conftest.py


# ------------------------------------------------------------------------------ the command
def test_the_command_is_resolved_against_the_config_file_s_directory(
    tmp_path: Path, model_dir: Path
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    path = conf / "run.toml"
    path.write_text(f'[model]\npath = "{model_dir}"\n[environment]\nname = "arithmetic"\n'
                    '[gateway]\nenabled = true\nagent = ["python", "agent.py"]\n')  # fmt: skip
    gateway = gateway_config(load_config(path))
    assert gateway.agent_dir == str(conf)  # wherever the run was started from
    assert gateway.agent == ["python", "agent.py"]  # kept as written (resume compares it)
    moved = gateway_config(load_config(path, {"gateway.agent_dir": "agents"}))
    assert moved.agent_dir == str(conf / "agents")
    assert agent_command(["python", "agent.py"], "/d") == [sys.executable, "agent.py"]
    assert agent_command(["python3", "-m", "a.b"], "/d") == [sys.executable, "-m", "a.b"]
    assert agent_command(["./run.sh", "x"], "/d") == ["/d/./run.sh", "x"]
    assert agent_command(["bin/agent"], "/d") == ["/d/bin/agent"]
    assert agent_command(["/usr/bin/env", "node", "a.js"], "/d") == ["/usr/bin/env", "node", "a.js"]
    assert agent_command(["node", "a.js"], "/d") == ["node", "a.js"]  # on PATH
    assert agent_command(["python3.11", "a.py"], "/d") == ["python3.11", "a.py"]  # on PATH too


def test_the_cap_is_checked_and_defaults_to_4_per_core() -> None:
    assert GatewayConfig(max_agents=3).agents_at_once() == 3
    assert GatewayConfig().agents_at_once() == 4 * len(os.sched_getaffinity(0))
    (negative,) = GatewayConfig(max_agents=-1).problems()
    assert str(negative).startswith("gateway.max_agents: must be >= 0, got -1. Fix:")


def _check(directory: Path, agent: list[str], **kw: object) -> str:
    """``check_agent``'s error for ``agent`` run from ``directory`` (``""``: none)."""
    try:
        anyio.run(check_agent, GatewayConfig(agent=agent, agent_dir=str(directory), **kw))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_a_broken_agent_command_is_named_with_its_fix(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(
        "import json, os\nimport anyio.abc\nfrom msgspec import json as j\n"
        "try:\n    import no_such_module_a\nexcept ImportError:\n    pass\n"
        "print('never run by the check')\nraise SystemExit(3)\n"
    )
    (tmp_path / "needs.py").write_text("import os\nimport no_such_module_a.sub, json\n"
                                       "from no_such_module_b import x\n")  # fmt: skip
    (tmp_path / "broken.py").write_text("def f(:\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "agent.py").write_text("import no_such_module_c\n")
    (pkg / "ok.py").write_text("import json\nimport pkg.agent_util\n")  # from the directory
    (pkg / "agent_util.py").write_text("")
    assert _check(tmp_path, ["python", "good.py"]) == ""
    assert _check(tmp_path, ["python", "-u", "-W", "error", "good.py", "--flag"]) == ""
    assert _check(tmp_path, ["python", "-m", "pkg.ok"]) == ""
    assert _check(tmp_path, ["python", "-c", "import json"]) == ""
    assert _check(tmp_path, ["true"]) == ""  # `true --help` exits 0

    missing = _check(tmp_path / "pkg", ["python", "good.py"])
    assert missing.startswith(f"gateway.agent: the agent's script 'good.py' is not in "
                              f"{tmp_path / 'pkg'} (the agent runs there). Fix: put it "
                              "there")  # fmt: skip
    needs = _check(tmp_path, ["python", "needs.py"])
    assert needs.startswith(f"gateway.agent: {sys.executable} cannot run the agent (checked "
                            f"in {tmp_path}): No module named 'no_such_module_a', "
                            "'no_such_module_b'. Fix: install what it needs")  # fmt: skip
    assert "SyntaxError" in _check(tmp_path, ["python", "broken.py"])
    assert "No module named 'no_such_module_c'" in _check(tmp_path, ["python", "-m", "pkg.agent"])
    assert "No module named 'pkg.nope'" in _check(tmp_path, ["python", "-m", "pkg.nope"])
    code = ["python", "-c", "import no_such_module_d"]
    assert "No module named 'no_such_module_d'" in _check(tmp_path, code)
    assert _check(tmp_path, ["no-such-agent-program"]).startswith(
        "gateway.agent: the program 'no-such-agent-program' is not found on PATH. Fix:")
    assert _check(tmp_path, ["./nope.sh"]).startswith(
        f"gateway.agent: the program {tmp_path}/./nope.sh is not an executable file. Fix:")
    fails = tmp_path / "fails.sh"
    fails.write_text("#!/bin/sh\necho \"Error: Cannot find module 'agent.js'\" >&2\nexit 1\n")
    fails.chmod(0o755)
    failing = _check(tmp_path, ["./fails.sh", "agent.js"])
    assert failing.startswith(f"gateway.agent: `./fails.sh agent.js --help` (run in {tmp_path} "
                              "to check the agent) exited with code 1: Error: Cannot find "
                              "module 'agent.js'. Fix:")  # fmt: skip
    assert "gateway.check_agent = false" in failing
    # only the program is looked up
    assert _check(tmp_path, ["./fails.sh"], check_agent=False) == ""
    assert _check(tmp_path, ["python", "needs.py"], check_agent=False) == ""
    assert _check(tmp_path, ["no-such-agent-program"], check_agent=False) != ""
    assert _check(tmp_path / "gone", ["python", "good.py"]).startswith(
        f"gateway.agent_dir: {tmp_path / 'gone'} is not a directory")
    # an agent's own environment is the one checked
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "no_such_module_a.py").write_text("")
    assert _check(tmp_path, ["python", "-c", "import no_such_module_a"],
                  agent_env={"PYTHONPATH": str(tmp_path / "lib")}) == ""  # fmt: skip


# ------------------------------------------------------------------------------ the cap
def test_at_most_max_agents_run_at_once_and_a_waiting_session_s_clock_starts_with_its_agent(
    tmp_path: Path,
) -> None:
    log = tmp_path / "spans"
    agent = ("import os, sys, time\n"
             f"with open({str(log)!r}, 'a') as f: f.write(f'{{time.time()}} 1\\n')\n"
             "time.sleep(0.3)\n"
             f"with open({str(log)!r}, 'a') as f: f.write(f'{{time.time()}} -1\\n')\n")  # fmt: skip
    config = GatewayConfig(agent=["python", "-c", agent], agent_dir=str(tmp_path), max_agents=2)
    agents = ManagedAgents(config, str(tmp_path / "logs"), base_url=lambda: "http://x")
    table = SessionTable()

    async def main() -> list[float]:
        sessions = [table.open(Prompt(id=f"p{i}", text="x"), f"g/{i}", evaluation=False,
                               claimed=True) for i in range(6)]  # fmt: skip
        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(agents.run, s, table)
        return [s.claimed_at for s in sessions]

    claimed = anyio.run(main)
    events = sorted((float(t), int(d)) for t, d in map(str.split, log.read_text().splitlines()))
    running, most = 0, 0
    for _, delta in events:
        running += delta
        most = max(most, running)
    assert len(events) == 12 and most == 2, events
    # three waves of 0.3 s: the last sessions were handed out when their agents started
    assert sorted(claimed)[-1] - sorted(claimed)[0] >= 0.55


# ------------------------------------------------------------------------------ the reaping
GRANDCHILD = """
import os, sys, time
pid = os.fork()
if pid == 0:  # a daemon's double fork: a session of its own, then orphaned
    os.setsid()
    if os.fork() == 0:
        with open({pids!r}, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    os._exit(0)
os.waitpid(pid, 0)
while not (os.path.exists({pids!r}) and os.path.getsize({pids!r})):
    time.sleep(0.01)
time.sleep(0.1 if {exits!r} else 60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("end", ["the agent exits", "the session ends", "the owner is killed"])
def test_a_grandchild_that_left_the_agent_s_session_ends_with_it(tmp_path: Path, end: str) -> None:
    """The shim, its owner standing in for the controller: an agent whose grandchild calls
    ``setsid`` (out of the group a group kill reaches) and is orphaned. However the session
    ends, the grandchild is gone with the shim."""
    pids = str(tmp_path / "pids")
    agent = GRANDCHILD.format(pids=pids, exits=end == "the agent exits")
    owner_code = (f"import os, subprocess, sys, time; env = dict(os.environ, "
                  f"{agent_shim.OWNER_ENV}=str(os.getpid())); shim = subprocess.Popen("
                  f"[sys.executable, {agent_shim.__file__!r}, sys.executable, '-c', {agent!r}], "
                  f"env=env, start_new_session=True); print(shim.pid, flush=True); "
                  f"sys.stdin.readline(); shim.terminate(); print(shim.wait(), flush=True); "
                  f"time.sleep(60)")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert owner.stdin is not None and owner.stdout is not None
    try:
        shim = int(owner.stdout.readline())
        deadline = time.monotonic() + 20
        while not (os.path.exists(pids) and os.path.getsize(pids)):
            assert time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.02)
        grandchild = int(Path(pids).read_text())
        assert os.getsid(grandchild) != os.getsid(shim)  # out of the agent's session
        if end == "the session ends":
            owner.stdin.write("\n")
            owner.stdin.flush()
            assert int(owner.stdout.readline()) == 128 + signal.SIGTERM
        elif end == "the owner is killed":
            owner.kill()
            owner.wait()
        deadline = time.monotonic() + 10
        while _alive(grandchild) or _alive(shim):
            assert time.monotonic() < deadline, f"{end}: the grandchild outlived its agent"
            time.sleep(0.02)
    finally:
        owner.kill()
        owner.communicate()  # waits, and closes its pipes
