"""The gateway's pure parts against hand computations and brute force: where a stop sequence
cuts a turn, what a call adds to a conversation (or that the agent rewrote it), replies with
tool calls, the session table's lobby and keys; and the agent shim, which must take the agent's
whole process group down when its owner dies however it dies."""

from __future__ import annotations

import functools
import gc
import json
import random
import signal
import subprocess
import sys
import time
import weakref

import anyio
import msgspec
import pytest

from asyncrl.env.episode import EpisodeLimit
from asyncrl.env.tool_parsers import HERMES
from asyncrl.environment import Prompt
from asyncrl_gateway import agent_shim
from asyncrl_gateway.conversation import ChatLog, Continue, ModelReply, Restart, cut_at_stop, reply_of
from asyncrl_gateway.schema import GatewayError, Message, ToolDef
from asyncrl_gateway.sessions import HttpCall, Finish, SessionTable


# ------------------------------------------------------------------------------ stop sequences
def _brute_cut(pieces: list[str], stops: list[str]) -> tuple[int, str] | None:
    """The fewest tokens whose text holds the earliest stop sequence, by trying every count."""
    full = "".join(pieces)
    hits = [(full.find(s), s) for s in stops if s and full.find(s) >= 0]
    if not hits:
        return None
    at, stop = min(hits)
    for k in range(1, len(pieces) + 1):
        if len("".join(pieces[:k])) >= at + len(stop):
            return k, full[:at]
    raise AssertionError("unreachable")


def test_cut_at_stop_matches_brute_force_on_random_turns() -> None:
    rng = random.Random(0)
    alphabet = ["a", "b", "ab", "ba", "abc", "c", " ", "\n", "bc"]
    found = 0
    for _ in range(3000):
        pieces = [rng.choice(alphabet) for _ in range(rng.randint(0, 12))]
        stops = ["".join(rng.choice("abc \n") for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 3))]  # fmt: skip
        got = cut_at_stop(lambda k: "".join(pieces[:k]), len(pieces), stops)
        want = _brute_cut(pieces, stops)
        assert got == want, (pieces, stops)
        found += want is not None
    assert found > 1000  # most turns had a stop sequence to find


# ------------------------------------------------------------------------------ conversations
def _m(role: str, content: str | None = None, **kw: object) -> Message:
    return msgspec.convert({"role": role, "content": content, **kw}, Message)


def _call_message(cid: str, args: dict[str, object]) -> Message:
    return _m("assistant", None, tool_calls=[{"id": cid, "type": "function", "function": {
        "name": "calc", "arguments": json.dumps(args)}}])  # fmt: skip


def test_a_tool_loop_goes_on_and_an_edited_history_restarts() -> None:
    log = ChatLog()
    first = [_m("system", "be brief"), _m("user", "1+2?")]
    assert isinstance(log.plan(first, None), Restart)  # the first call starts the record
    log.restarted(first, None)
    reply = ModelReply(None, (("c1", "calc", '{"expression": "1+2"}'),), "tool_calls")
    log.replied([reply])
    # the agent echoes the reply with its arguments spaced differently and extra fields
    echoed = msgspec.convert({"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc",
         "arguments": '{ "expression" : "1+2" }'}}]}, Message)  # fmt: skip
    tool = _m("tool", "3", tool_call_id="c1")
    plan = log.plan([*first, echoed, tool], None)
    assert isinstance(plan, Continue) and plan.new == [tool] and plan.choice is None
    log.observed([tool])
    log.replied([ModelReply("3", (), "stop")])
    # asking again with nothing new where a reply was given: a new segment
    assert isinstance(log.plan([*first, echoed, tool], None), Restart)
    # the answer echoed with text parts, then a user turn: goes on
    parts = msgspec.convert({"role": "assistant", "content": [{"type": "text", "text": "3"}]},
                            Message)  # fmt: skip
    user = _m("user", "and 2+2?")
    plan = log.plan([*first, echoed, tool, parts, user], None)
    assert isinstance(plan, Continue) and plan.new == [user]
    # a dropped message, an edited one, other tools: each rewrites what was recorded
    assert isinstance(log.plan([first[1], echoed, tool, parts, user], None), Restart)
    edited = [first[0], _m("user", "1+3?"), echoed, tool, parts, user]
    assert "message 1" in log.plan(edited, None).why  # type: ignore[union-attr]
    tools = msgspec.convert([{"type": "function", "function": {"name": "calc"}}], list[ToolDef])
    assert log.plan([*first, echoed, tool, parts, user], tools).why == "the tools changed"  # type: ignore[union-attr]


def test_several_choices_wait_for_the_one_the_agent_goes_on_with() -> None:
    log = ChatLog()
    first = [_m("user", "hi")]
    log.restarted(first, None)
    log.replied([ModelReply("a"), ModelReply("b"), ModelReply("c")])
    nxt = _m("user", "more")
    plan = log.plan([*first, _m("assistant", "b"), nxt], None)
    assert isinstance(plan, Continue) and plan.choice == 1 and plan.new == [nxt]
    assert isinstance(log.plan([*first, _m("assistant", "d"), nxt], None), Restart)
    assert isinstance(log.plan([*first, _m("assistant", "b")], None), Restart)  # nothing after it
    log.chose(1)
    log.observed([nxt])
    assert isinstance(log.plan([*first, _m("assistant", "b"), nxt], None), Continue)


def test_replies_read_tool_calls_or_return_the_text() -> None:
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'
    r = reply_of(f"Let me add.\n{call}", "stop", HERMES)
    assert r.finish_reason == "tool_calls" and r.content == "Let me add."
    ((cid, name, args),) = r.tool_calls
    assert name == "calc" and json.loads(args) == {"expression": "1+2"} and cid
    assert reply_of(call, "stop", None) == ModelReply(call, (), "stop")  # tool_choice "none"
    broken = '<tool_call>\n{"name": "calc", "arguments": {</tool_call>'
    assert reply_of(broken, "length", HERMES) == ModelReply(broken, (), "length")  # as text


# ------------------------------------------------------------------------------ sessions
@pytest.mark.asyncio
async def test_the_lobby_hands_out_sessions_in_order_or_by_prompt() -> None:
    table = SessionTable()
    p = [Prompt(id=f"p{i}", text="x") for i in range(3)]
    a = table.open(p[0], "g0/0", evaluation=False, claimed=False)
    b = table.open(p[1], "g1/0", evaluation=False, claimed=False)
    c = table.open(p[1], "g1/1", evaluation=True, claimed=False)
    assert (await table.claim("p1", 0)) is b and (await table.claim(None, 0)) is a
    assert table.counts() == {"waiting": 1, "active": 2}
    with pytest.raises(GatewayError) as e:
        await table.claim("p0", 0)
    assert e.value.status == 503 and e.value.code == "no_session"
    async with anyio.create_task_group() as tg:  # a claim waits for the next episode
        got = []

        async def claim() -> None:
            got.append(await table.claim("p2", 5))

        tg.start_soon(claim)
        await anyio.sleep(0.01)
        d = table.open(p[2], "g2/0", evaluation=False, claimed=False)
    assert got == [d] and c.claimed is False
    # keys: a live one is known; an ended one is remembered (410 for it, not 401)
    assert table.is_session_key(a.key) and not table.is_session_key("sk-arl-nope")
    await table.close(a, "it was scored")
    assert not table.is_session_key(a.key) and table.knows_digest(a.key_digest)
    with pytest.raises(GatewayError) as e:
        table.get(a.id)
    assert e.value.status == 410 and "it was scored" in str(e.value)
    table.shut()
    with pytest.raises(GatewayError) as e:
        await table.claim("nothing", 5)
    assert e.value.code == "run_ending"
    for s in (b, c, d):
        await table.close(s, "the test ended")
    assert len(table) == 0


@pytest.mark.asyncio
async def test_waiting_claims_are_served_oldest_first_one_per_session() -> None:
    """Each session that opens goes to the oldest claim that wants it, and wakes only that one;
    a claim cancelled as it was handed a session passes the session on."""
    table = SessionTable()
    p = [Prompt(id=f"p{i}", text="x") for i in range(2)]
    got: dict[str, object] = {}

    async def claim(name: str, prompt_id: str | None) -> None:
        got[name] = await table.claim(prompt_id, 5)

    async with anyio.create_task_group() as tg:
        for name, prompt_id in (("a", None), ("b", "p1"), ("c", None)):
            tg.start_soon(claim, name, prompt_id)
            await anyio.sleep(0.01)
        s1 = table.open(p[1], "g1/0", evaluation=False, claimed=False)  # a is the oldest
        await anyio.sleep(0.01)
        assert got == {"a": s1}
        s0 = table.open(p[0], "g0/0", evaluation=False, claimed=False)  # b wants p1: c
        await anyio.sleep(0.01)
        assert got == {"a": s1, "c": s0}
        s2 = table.open(p[1], "g1/1", evaluation=False, claimed=False)
    assert got == {"a": s1, "c": s0, "b": s2} and all(s.claimed for s in (s0, s1, s2))
    assert table.counts() == {"waiting": 0, "active": 3}
    first = anyio.CancelScope()

    async def cancelled_claim() -> None:
        with first:
            got["first"] = await table.claim(None, 5)

    async with anyio.create_task_group() as tg:  # handed a session, cancelled before it woke
        tg.start_soon(cancelled_claim)
        await anyio.sleep(0.01)
        tg.start_soon(claim, "second", None)
        await anyio.sleep(0.01)
        first.cancel()  # it goes, but has not yet woken to see it...
        s3 = table.open(p[0], "g0/1", evaluation=False, claimed=False)  # ...when it gets this
        # one: its wait raises, and the session passes to the second
    assert "first" not in got and got["second"] is s3 and s3.claimed
    again = anyio.CancelScope()

    async def claim_again() -> None:
        with again:
            got["again"] = await table.claim(None, 5)

    async with anyio.create_task_group() as tg:  # handed one that ends before it wakes
        tg.start_soon(claim_again)
        await anyio.sleep(0.01)
        again.cancel()
        s4 = table.open(p[0], "g0/2", evaluation=False, claimed=False)
        await table.close(s4, "its episode was cancelled")
    assert "again" not in got and table.counts()["waiting"] == 0  # not back in the lobby
    for s in (s0, s1, s2, s3):
        await table.close(s, "the test ended")


@pytest.mark.asyncio
async def test_an_ended_session_is_freed_without_the_cyclic_collector() -> None:
    """The serve function an episode registers holds its session (as the gateway's does):
    the session lets go of it when it ends, so nothing but reference counts is needed."""
    table = SessionTable()
    s = table.open(Prompt(id="p", text="x"), "g/0", evaluation=False, claimed=True)
    s.serve_with(functools.partial(_serve_for, s))
    await table.close(s, "done")
    ref = weakref.ref(s)
    gc.disable()
    try:
        del s
        assert ref() is None
    finally:
        gc.enable()


async def _serve_for(session: object, call: HttpCall) -> None:
    await _serve(call)


async def _serve(call: HttpCall) -> None:
    """A session's serve function: ``"hang"`` waits until cancelled, ``"limit"`` ends the
    episode, anything else is answered at once."""
    with anyio.CancelScope() as scope:
        if call.serving(scope):
            if call.request == "hang":
                await anyio.sleep_forever()
            elif call.request == "limit":
                call.fail(GatewayError(400, "limit"))
                call.raised = EpisodeLimit("turns", "too many")
            call.answer("ok")
    if call.cancelled is not None:
        call.fail(call.cancelled)


@pytest.mark.asyncio
async def test_one_call_at_a_time_an_idle_deadline_and_an_end_that_cancels_the_call() -> None:
    table = SessionTable()
    s = table.open(Prompt(id="p", text="x"), "g/0", evaluation=False, claimed=True)
    s.serve_with(_serve)
    assert await s.next(0.05) is None  # idle: no call came
    first, second = HttpCall("chat", "hang"), HttpCall("chat", "quick")
    async with anyio.create_task_group() as tg:
        s.take(first)
        tg.start_soon(s.serve, first)
        with pytest.raises(GatewayError) as e:
            s.take(second)
        assert e.value.status == 409
        with anyio.move_on_after(0.2) as waited:  # a call runs: the idle deadline waits
            await s.next(0.02)
        assert waited.cancelled_caught
        s.finish(Finish(reward=1.0))  # ends it: the call in progress is cancelled and failed
    assert first.error is not None and first.error.status == 410 and s.answered == 0
    assert isinstance(await s.next(5), Finish)
    for late in (lambda: s.finish(Finish(reward=0.0)), lambda: s.take(second)):
        with pytest.raises(GatewayError) as e:
            late()
        assert e.value.status == 410
    await table.close(s, "done")


@pytest.mark.asyncio
async def test_the_idle_deadline_counts_from_the_hand_out_not_from_the_lobby() -> None:
    """A session that waited in the lobby longer than the idle deadline still gives its agent
    the whole idle deadline once handed out."""
    table = SessionTable()
    s = table.open(Prompt(id="p", text="x"), "g/0", evaluation=False, claimed=False)
    s.serve_with(_serve)
    await anyio.sleep(0.12)  # in the lobby for 0.12 s
    assert await table.claim(None, 0) is s
    began = anyio.current_time()
    assert await s.next(0.1) is None  # no call: idle, 0.1 s after the hand-out
    assert 0.09 <= anyio.current_time() - began < 0.5
    await table.close(s, "done")


@pytest.mark.asyncio
async def test_a_session_never_called_goes_back_to_the_front_of_the_lobby_with_new_keys() -> None:
    table = SessionTable()
    p = [Prompt(id=f"p{i}", text="x") for i in range(2)]
    s = table.open(p[0], "g0/0", evaluation=False, claimed=False)
    s.serve_with(_serve)
    assert await table.claim(None, 0) is s
    old_id, old_key, old_digest = s.id, s.key, s.key_digest
    began = anyio.current_time()
    assert await s.first_call(0.1) is False  # nobody called within 0.1 s of the hand-out
    assert 0.09 <= anyio.current_time() - began < 0.5
    later = table.open(p[1], "g1/0", evaluation=False, claimed=False)
    table.reoffer(s, "no call came within gateway.claim_timeout_s")
    assert s.id != old_id and s.key != old_key and not s.claimed
    assert table.counts() == {"waiting": 2, "active": 0}
    # its old id and key: 410 with the reason, not 404 or 401
    with pytest.raises(GatewayError) as e:
        table.get(old_id)
    assert e.value.status == 410 and "claim_timeout_s" in str(e.value)
    assert not table.is_session_key(old_key) and table.knows_digest(old_digest)
    assert table.get(s.id) is s and table.is_session_key(s.key)
    # it was admitted first: the next claim gets it, not the one opened since
    assert await table.claim(None, 0) is s
    began = anyio.current_time()  # its first-call deadline starts again at this hand-out
    call = HttpCall("chat", "quick")
    s.take(call)
    await s.serve(call)
    assert await s.first_call(0.1) is True and anyio.current_time() - began < 0.05
    assert call.result == "ok"
    for x in (s, later):
        await table.close(x, "the test ended")
    assert len(table) == 0


@pytest.mark.asyncio
async def test_a_session_ended_before_its_first_call_is_not_offered_again() -> None:
    """A session given back (or rewarded) before any call counts as called: its episode
    ends with it rather than offering it again."""
    table = SessionTable()
    s = table.open(Prompt(id="p", text="x"), "g/0", evaluation=False, claimed=False)
    assert await table.claim(None, 0) is s
    s.finish(Finish(abandon="given back"))
    assert await s.first_call(5) is True
    assert (await s.next(5)).abandon == "given back"
    await table.close(s, "done")


@pytest.mark.asyncio
async def test_a_call_that_ends_the_episode_raises_in_its_task_and_an_end_waits_for_a_call() -> None:
    table = SessionTable()
    s = table.open(Prompt(id="p", text="x"), "g/0", evaluation=False, claimed=True)
    s.serve_with(_serve)
    ok, limit = HttpCall("chat", "quick"), HttpCall("chat", "limit")
    for call in (ok, limit):
        s.take(call)
        await s.serve(call)
    assert ok.result == "ok" and limit.error is not None and s.answered == 1
    with pytest.raises(EpisodeLimit):
        await s.next(5)
    hang = HttpCall("chat", "hang")
    async with anyio.create_task_group() as tg:
        s.take(hang)
        tg.start_soon(s.serve, hang)
        await anyio.sleep(0.01)
        await table.close(s, "its episode was cancelled")  # cancels the call, waits for it
        assert hang.finished.is_set() and hang.error is not None and hang.error.status == 410
        assert "its episode was cancelled" in str(hang.error)


# ------------------------------------------------------------------------------ the shim
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_shim_kills_the_agent_group_when_its_owner_is_killed(tmp_path: object) -> None:
    """An owner (standing in for the controller) starts the shim in a new session; the agent
    starts a grandchild; ``kill -9`` of the owner takes the whole group down."""
    pids = f"{tmp_path}/pids"
    agent = (f"import os, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
             f"'import time; time.sleep(60)']); open({pids!r}, 'w').write(f'{{os.getpid()}} "
             f"{{c.pid}}'); time.sleep(60)")  # fmt: skip
    owner_code = (f"import os, subprocess, sys, time; env = dict(os.environ, "
                  f"{agent_shim.OWNER_ENV}=str(os.getpid())); subprocess.Popen([sys.executable, "
                  f"{agent_shim.__file__!r}, sys.executable, '-c', {agent!r}], env=env, "
                  f"start_new_session=True); time.sleep(60)")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", owner_code])
    try:
        deadline = time.monotonic() + 20
        def read() -> list[str]:
            try:
                with open(pids) as f:
                    return f.read().split()
            except FileNotFoundError:
                return []

        while len(read()) < 2:
            assert time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.05)
        agent_pid, grandchild = map(int, read())
        assert _alive(agent_pid) and _alive(grandchild)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while _alive(agent_pid) or _alive(grandchild):
            assert time.monotonic() < deadline, "the agent outlived its owner"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()


# ------------------------------------------------------------------------------ preflight
def test_the_gateway_is_checked_before_anything_starts() -> None:
    """A managed agent needs an environment that scores (its command is checked apart:
    test_managed_agents.py); every session needs a chat template; the tool parser must be
    installed. Each mistake is one ConfigError (or PluginError) naming its field."""
    from types import SimpleNamespace

    from asyncrl.errors import ConfigError, PluginError
    from asyncrl_gateway.config import GatewayConfig
    from asyncrl_gateway.gateway import check_gateway

    class Prompts:  # its agents post the rewards: no score
        def dataset(self, split: str) -> list[Prompt]: ...

    class Scores(Prompts):
        def score(self, prompt: Prompt, completion: str) -> None: ...

    def config(agent: list[str], parser: str = "hermes") -> SimpleNamespace:
        return SimpleNamespace(services={"gateway": GatewayConfig(enabled=True, agent=agent)},
                               environment=SimpleNamespace(name="env"),
                               episode=SimpleNamespace(tool_parser=parser))  # fmt: skip

    templated = SimpleNamespace(chat_template=object())
    assert check_gateway(config([sys.executable]), Scores(), templated) is HERMES
    with pytest.raises(ConfigError, match="model.chat_template"):
        check_gateway(config([]), Scores(), SimpleNamespace(chat_template=None))
    with pytest.raises(ConfigError, match="gateway.agent.*no score"):
        check_gateway(config([sys.executable]), Prompts(), templated)
    with pytest.raises(PluginError, match="episode.tool_parser"):
        check_gateway(config([], parser="no-such-parser"), Scores(), templated)


def test_the_deadlines_are_checked_with_the_config() -> None:
    from asyncrl_gateway.config import GatewayConfig

    assert GatewayConfig().claim_timeout_s == 20.0 and GatewayConfig().problems() == []
    (zero,) = GatewayConfig(claim_timeout_s=0).problems()
    assert str(zero) == ("gateway.claim_timeout_s: must be > 0, got 0. Fix: set "
                         "gateway.claim_timeout_s to a number of seconds.")  # fmt: skip
    (longer,) = GatewayConfig(claim_timeout_s=30, session_timeout_s=10).problems()
    assert str(longer) == ("gateway.claim_timeout_s: is 30 s, longer than the whole session "
                           "(gateway.session_timeout_s = 10 s). Fix: set it below "
                           "gateway.session_timeout_s.")  # fmt: skip
