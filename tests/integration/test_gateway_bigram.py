"""The gateway end to end: a real controller (bigram backends in real processes) whose episodes
are sessions of agent programs: agents that call in with the official ``openai`` client, and
managed agents the controller starts per session, some of which hang, die or leave children
behind. What the runs must show: every step trains on sessions, evaluations run as sessions,
a broken agent fails or truncates its session but never the run, and nothing is left behind
(no process, no key file).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip(
    "asyncrl_example_backend", reason="pip install -e plugins/asyncrl-example-backend"
)
openai = pytest.importorskip("openai")

import asyncrl  # noqa: E402
from asyncrl.config import Config  # noqa: E402
from asyncrl.policy import failures as failure_policy  # noqa: E402
from integration_support import alive, assert_nothing_left, read_metrics, worker_pids  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_stray_processes")]


async def _gateway(out: Path) -> tuple[str, str]:
    """The gateway's URL and admin key, once it listens (from the files it writes)."""
    info = out / "gateway.json"
    with anyio.fail_after(60):
        while not info.exists():
            await anyio.sleep(0.05)
    data = json.loads(info.read_text())
    return data["url"], Path(data["key_file"]).read_text().strip()


async def _agents(out: Path, seen: dict[str, int], workers: int = 8) -> None:
    """Agents that call in: take a session, ask twice (the second time after a user turn),
    end it with a reward (their own, or the environment's), until the run ends."""
    url, admin = await _gateway(out)
    head = {"Authorization": f"Bearer {admin}"}

    async def worker(http: httpx.AsyncClient) -> None:
        while True:
            try:
                r = await http.post(f"{url}/rl/sessions", headers=head, json={"wait_s": 1})
            except httpx.TransportError:
                return  # the run ended
            if r.status_code == 503:
                if r.json()["error"]["code"] == "run_ending":
                    return
                continue
            assert r.status_code == 201, r.text
            info = r.json()
            oa = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                    max_retries=0, http_client=http)  # fmt: skip
            messages = list(info["prompt"]["messages"])
            try:
                for _ in range(2):
                    resp = await oa.chat.completions.create(model="bigram", messages=messages,
                                                            max_tokens=4)  # fmt: skip
                    assert resp.weight_version >= 0  # type: ignore[attr-defined]
                    messages += [resp.choices[0].message.model_dump(),
                                 {"role": "user", "content": "again"}]  # fmt: skip
            except openai.APIStatusError as exc:
                assert exc.status_code == 410, exc  # its episode was cancelled (the run ends)
                continue
            except openai.APIConnectionError:
                return  # the run ended
            seen["sessions"] += 1
            seen["eval"] += info["evaluation"]
            answer = messages[-2]["content"] or ""
            mine = seen["sessions"] % 2 == 0
            body = {"reward": float(info["prompt"]["messages"][0]["content"] in answer)} if mine else {}
            r = await http.post(f"{url}/rl/sessions/{info['session_id']}/reward", headers=head,
                                json=body)  # fmt: skip
            assert r.status_code in (200, 410), r.text

    async with httpx.AsyncClient(timeout=60) as http:
        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(worker, http)


async def test_agents_calling_in_train_and_evaluate(make_config: Callable[..., Config]) -> None:
    num_steps = 3
    cfg = make_config(
        run={"num_steps": num_steps}, grpo={"max_new_tokens": 4},
        gateway={"enabled": True}, episode={"max_turns": 3, "max_context_tokens": 64},
    )  # fmt: skip
    out = Path(cfg.run.output_dir)
    seen = {"sessions": 0, "eval": 0}
    async with asyncrl.Controller(cfg) as ctl:
        pids = worker_pids(ctl)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_agents, out, seen)
            summary = await ctl.train()  # the agents see the run end by themselves
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, num_steps + 1))
    P, N = cfg.grpo.prompts_per_step, cfg.grpo.samples_per_prompt
    assert sum(r["episodes"] for r in train) >= num_steps * P * N
    assert all(r["episode_turns_mean"] == 2.0 for r in train if r["episodes"])
    assert all(r["episode_failed"] == 0 and r["episode_splits"] == 0 for r in train)
    assert sum(r["gateway_calls"] for r in train) >= 2 * num_steps * P * N
    assert all(r["gateway_restarts"] == 0 for r in train)
    assert [e["label"] for e in summary.evals] == ["start", "end"]
    assert seen["eval"] == 2 * cfg.eval.num_prompts
    assert not (out / "gateway.json").exists() and not (out / "gateway.key").exists()
    assert_nothing_left(ctl, pids.values())


AGENT = """\
import json, os, signal, subprocess, sys, time, urllib.request
prompt = json.loads(sys.stdin.readline())
index = int(prompt["prompt_id"].rpartition(":")[2])
mode = {0: "hang", 1: "die", 2: "fail", 3: "orphan", 4: "daemon"}.get(index % 8, "ok")

def left(pid):  # a process in a session of its own, out of the agent's group: noted
    open(os.path.join(os.environ["PIDS_DIR"], str(pid)), "w").close()

def ask(messages):
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": messages, "max_tokens": 4}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["message"]

messages = prompt["messages"]
messages.append(ask(messages))
print("asked once", mode, flush=True)
if mode == "hang":
    time.sleep(3600)
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "fail":
    sys.exit(3)
if mode == "orphan":  # a child that would outlive the agent, and the agent hangs
    left(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                          start_new_session=True).pid)
    time.sleep(3600)
if mode == "daemon":  # a daemon's double fork (setsid, then orphaned); the agent ends well
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        left(pid)
        os._exit(0)
    os.wait()
messages += [{"role": "user", "content": "again"}]
messages.append(ask(messages))
print("done", flush=True)
"""


async def test_managed_agents_that_hang_die_or_fail_do_not_stop_the_run(
    make_config: Callable[..., Config], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also: the command ``["python", "agent.py"]`` runs beside its directory
    (``gateway.agent_dir``, the config file's by default) whatever the working directory, and
    what agents left in sessions of their own is gone after the run."""
    (tmp_path / "agent.py").write_text(AGENT)
    pids = tmp_path / "pids"
    pids.mkdir()
    assert Path.cwd() != tmp_path
    cfg = make_config(
        run={"num_steps": 2}, grpo={"max_new_tokens": 4, "prompts_per_step": 4},
        # as many agents at once as sessions in flight: the run's time is its hung agents'
        # deadlines (plugins/asyncrl-gateway/tests/test_managed_agents.py tests the cap)
        gateway={"enabled": True, "agent": ["python", "agent.py"], "agent_dir": str(tmp_path),
                 "agent_env": {"PIDS_DIR": str(pids)}, "max_agents": 32,
                 "session_timeout_s": 4.0, "claim_timeout_s": 2.0, "idle_timeout_s": 30.0},
        episode={"max_turns": 3, "max_context_tokens": 64, "on_truncation": "zero"},
        failures={"generation_retries": 2, "max_failed_groups": 64},
        eval={"num_prompts": 0},
    )  # fmt: skip
    monkeypatch.setattr(failure_policy, "RETRY_BACKOFF_S", 0.05)
    async with asyncrl.Controller(cfg) as ctl:
        workers = worker_pids(ctl)
        summary = await ctl.train()
    train = [r for r in read_metrics(cfg) if r["kind"] == "train"]
    assert len(train) == 2 and len(summary.steps) == 2
    truncated = sum(r.get("episode_truncated_deadline", 0) for r in train)
    failed = sum(r["episode_failed"] for r in train)
    assert truncated > 0, train  # hung agents (and the orphan maker) past session_timeout_s
    assert failed > 0, train  # agents killed by a signal or exiting 3
    logs = list((Path(cfg.run.output_dir) / "logs" / "agents").glob("*.log"))
    # the agents that did not exit 0 keep their output (gateway.keep_agent_logs is off)
    assert len(logs) >= failed + truncated
    assert not [p for p in logs if "done" in p.read_text()]
    left = [int(p.name) for p in pids.iterdir()]
    assert len(left) >= 4, left  # orphan makers and daemons, each step
    assert alive(left) == [], f"processes the agents left in sessions of their own: {left}"
    assert_nothing_left(ctl, workers.values())
