"""The gateway driven by the official ``openai`` client as black-box agents: multi-turn tool
use (sync and async clients, streamed and not), several choices (``n``), stop sequences, text
completions, and agents that rewrite their history. What trains must be exactly what the
engine sampled: checked on 1,200 sessions against the engine's own log, not against anything
the gateway computed.

The check (:func:`assert_token_exact`): every run of trained tokens in a session's samples was
sampled by one engine request of that session whose prompt is *exactly* the sample's tokens
before the run, and is that request's ids (all of them, or a prefix where a stop sequence cut
the turn) with its logprobs; and a session whose agent never rewrote its history trains every
reply it was given, in order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import numpy as np
import pytest

import gateway_support as gs
from asyncrl_gateway.config import GatewayConfig

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.asyncio

SESSIONS = 1200
CONCURRENT = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> gs.Model:
    return gs.make_model(tmp_path_factory.mktemp("gw-model"))


# ---------------------------------------------------------------------------------------- agents
def _assistant(msg: Any) -> dict[str, Any]:
    """An SDK message echoed back as the SDK gives it (every field, ``None``s included)."""
    return msg.model_dump()


def _tool_results(calls: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    out = []
    for cid, _, arguments in calls:
        a, b = json.loads(arguments)["expression"].split("+")
        out.append({"role": "tool", "tool_call_id": cid, "content": str(int(a) + int(b))})
    return out


def _calls(msg: Any) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or ()]


async def chat_agent(oa: Any, messages: list[dict[str, Any]], rng: random.Random, *,
                     stream: bool, n: int = 1, stop: list[str] | None = None,
                     rewrite: bool = False) -> dict[str, Any]:  # fmt: skip
    """A tool loop with the async client; returns what it saw."""
    seen: dict[str, Any] = {"calls": 0, "rewrote": False, "used": []}
    for _ in range(5):
        kw: dict[str, Any] = {"model": "any", "messages": messages, "tools": [gs.CALC_TOOL]}
        if n > 1:
            kw["n"] = n
        if stop:
            kw["stop"] = stop
        if stream:
            message, calls = await _streamed(oa, kw)
        else:
            resp = await oa.chat.completions.create(**kw)
            assert resp.weight_version == 0  # type: ignore[attr-defined]
            msg = resp.choices[rng.randrange(len(resp.choices))].message
            message, calls = _assistant(msg), _calls(msg)
        seen["calls"] += 1
        seen["used"].append((message.get("content") or "", calls))
        messages.append(message)
        if not calls:
            break
        messages.extend(_tool_results(calls))
        if rewrite and len(messages) > 4 and not seen["rewrote"]:
            del messages[1:3]  # drop the first exchange: a context summary would
            seen["rewrote"] = True
    return seen


async def _streamed(oa: Any, kw: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """A streamed reply put together from its chunks, as an agent framework does."""
    content, calls = "", {}
    stream = await oa.chat.completions.create(stream=True, **kw)
    async for chunk in stream:
        if not chunk.choices or chunk.choices[0].index != 0:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments)
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": nm, "arguments": a}}
                             for i, nm, a in calls.values()]  # fmt: skip
    return msg, list(calls.values())


def sync_agent(base_url: str, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same loop with the sync client (run in a thread)."""
    oa = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    seen: dict[str, Any] = {"calls": 0, "used": []}
    try:
        for _ in range(5):
            resp = oa.chat.completions.create(model="any", messages=messages, tools=[gs.CALC_TOOL])
            msg = resp.choices[0].message
            seen["calls"] += 1
            seen["used"].append((msg.content or "", _calls(msg)))
            messages.append(_assistant(msg))
            if not msg.tool_calls:
                break
            messages.extend(_tool_results(_calls(msg)))
    finally:
        oa.close()
    return seen


async def completion_agent(oa: Any, question: str, *, stream: bool) -> dict[str, Any]:
    """A ReAct-style text agent on /v1/completions: it writes its own prompt each call."""
    prompt: Any = f"Question: {question}\nAnswer:"
    seen: dict[str, Any] = {"calls": 0, "used": []}
    for i in range(3):
        if stream:
            text = ""
            async for chunk in await oa.completions.create(model="any", prompt=prompt,
                                                           max_tokens=24, stream=True):  # fmt: skip
                text += chunk.choices[0].text if chunk.choices else ""
        else:
            resp = await oa.completions.create(model="any", prompt=prompt, max_tokens=24)
            text = resp.choices[0].text
        seen["calls"] += 1
        seen["used"].append((text, []))
        prompt = f"{prompt}{text}\nObservation: {i}\nAnswer:"
    return seen


# ---------------------------------------------------------------------------------------- checks
def assert_token_exact(played: gs.Played, requests: list[gs.Request]) -> int:
    """The check of the module docstring; returns the trained turns checked."""
    mine = [r for r in requests if r.episode == played.episode]
    checked = 0
    for s in played.samples:
        ids = s.token_ids.tolist()
        pos = s.prompt_len
        lps = s.logprobs
        mask = s.loss_mask.tolist()
        i = 0
        while i < len(mask):
            if not mask[i]:
                i += 1
                continue
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            run = ids[pos + i : pos + j]
            context = ids[: pos + i]
            sources = [r for r in mine if r.prompt_ids == context and r.token_ids[: len(run)] == run]
            assert sources, (f"{played.episode}: trained tokens at {pos + i} were sampled by no "
                             "request from that context")  # fmt: skip
            want = np.asarray(sources[0].logprobs[: len(run)], np.float32)
            np.testing.assert_array_equal(lps[i:j], want)
            checked += 1
            i = j
    return checked


def assert_agent_view(played: gs.Played, seen: dict[str, Any], model: gs.Model) -> None:
    """The trained turns are the replies the agent went on with, in order: a plain reply's
    text is the turn's text (its end token left out), a tool call's arguments are in the
    turn's text, and a turn cut at a stop sequence holds it in its last token only."""
    runs = [run for s in played.samples for run in gs.trained_turns(s)]
    used = seen["used"]
    assert len(runs) == len(used), (played.episode, len(runs), len(used))
    if seen["kind"] == "n":  # the last call's choice is not known: the first one trains
        runs, used = runs[:-1], used[:-1]
    tok = model.tok
    for run, (content, calls) in zip(runs, used):
        body = run[:-1] if run[-1] == model.end_id else run
        text = tok.decode_verbatim(body)
        if seen["kind"] == "stop" and "answer" in text:
            assert "answer" not in tok.decode_verbatim(body[:-1]), (played.episode, text)
            assert text.startswith(content + "answer"), (played.episode, text, content)
        elif calls:
            for _, name, arguments in calls:
                assert f'"name": "{name}", "arguments": {arguments}' in text, (text, arguments)
        else:
            assert text == content, (played.episode, text, content)


async def _run(model: gs.Model, tmp_path: Path, sessions: int, seed: int) -> tuple[gs.Harness, list[dict[str, Any]]]:
    engine = gs.ScriptedEngine(model, seed)
    harness = gs.Harness(model, engine, GatewayConfig(enabled=True), tmp_path)
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    kinds = ["async", "stream", "sync", "n", "stop", "completion", "completion-stream",
             "rewrite"]  # fmt: skip
    async with gs.running(harness):
        prompts = harness.env.prompts
        for i in range(sessions):
            harness.start(prompts[i % len(prompts)], f"g{i // 4}/{i % 4}")
        limit = anyio.Semaphore(CONCURRENT)
        async with httpx.AsyncClient(timeout=60) as http:

            async def one(i: int) -> None:
                async with limit:
                    r = await http.post(f"{harness.url}/rl/sessions", headers=harness.admin,
                                        json={"wait_s": 30})  # fmt: skip
                    assert r.status_code == 201, r.text
                    info = r.json()
                    kind = kinds[i % len(kinds)]
                    messages = list(info["prompt"]["messages"])
                    oa = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                            max_retries=0, http_client=shared)  # fmt: skip
                    agent_rng = random.Random(rng.random())
                    if kind == "sync":
                        seen = await anyio.to_thread.run_sync(sync_agent, info["base_url"],
                                                              info["api_key"], messages)  # fmt: skip
                    elif kind.startswith("completion"):
                        seen = await completion_agent(oa, messages[0]["content"],
                                                      stream=kind.endswith("stream"))
                    else:
                        seen = await chat_agent(oa, messages, agent_rng, stream=kind == "stream",
                                                n=2 if kind == "n" else 1,
                                                stop=["answer"] if kind == "stop" else None,
                                                rewrite=kind == "rewrite")  # fmt: skip
                    seen.update(kind=kind, episode=info["episode"])
                    results.append(seen)
                    r = await http.post(f"{harness.url}/rl/sessions/{info['session_id']}/reward",
                                        headers=harness.admin, json={"reward": 1.0})  # fmt: skip
                    assert r.status_code == 200, r.text

            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as shared:
                async with anyio.create_task_group() as tg:
                    for i in range(sessions):
                        tg.start_soon(one, i)
        with anyio.fail_after(30):
            while any(p.score is None and p.error is None for p in harness.played):
                await anyio.sleep(0.05)
    return harness, results


async def test_recorded_tokens_are_the_sampled_tokens_on_1200_sessions(
    model: gs.Model, tmp_path: Path
) -> None:
    harness, results = await _run(model, tmp_path, SESSIONS, seed=1)
    assert len(results) == SESSIONS
    errors = [(p.episode, p.error) for p in harness.played if p.error is not None]
    assert not errors, errors[:3]
    turns = sum(assert_token_exact(p, harness.engine.requests) for p in harness.played)
    by_episode = {r["episode"]: r for r in results}
    for p in harness.played:
        assert_agent_view(p, by_episode[p.episode], model)
    kept_calls = sum(r["calls"] for r in results)
    # every call trains one turn: a call with n = 2 keeps the choice the agent went on with
    # (or the first, for its last call); a rewritten history trains what came before as a
    # segment of its own, so nothing is lost there either
    assert turns == kept_calls, (turns, kept_calls)
    by_kind: dict[str, int] = {}
    for r in results:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + r["calls"]
    assert all(v > 0 for v in by_kind.values()), by_kind
    multi = sum(1 for r in results if r["calls"] > 1)
    assert multi > SESSIONS // 4, multi  # multi-turn tool use, not single calls
    assert harness.gateway.stats["restarts"] >= sum(1 for r in results if r.get("rewrote"))


async def test_an_agent_that_keeps_its_own_token_stream_goes_on_from_it_exactly(
    model: gs.Model, tmp_path: Path
) -> None:
    """Token-in, token-out (vLLM's ``return_token_ids``): an agent that writes each prompt as
    the last prompt's ids, the reply's ids and its observation's ids trains one sample whose
    tokens are exactly its own stream; no segment is restarted."""
    engine = gs.ScriptedEngine(model, 7, tool_rate=0.0)
    harness = gs.Harness(model, engine, GatewayConfig(enabled=True), tmp_path)
    tok = model.tok
    streams: dict[str, list[int]] = {}
    async with gs.running(harness):
        for i in range(24):
            harness.start(harness.env.prompts[i], f"g{i}/0")
        async with httpx.AsyncClient(timeout=60) as http:

            async def agent() -> None:
                r = await http.post(f"{harness.url}/rl/sessions", headers=harness.admin, json={})
                info = r.json()
                oa = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                        max_retries=0, http_client=http)  # fmt: skip
                prompt = tok.encode_rendered(f"Question: {info['prompt']['id']}\nAnswer:")
                for i in range(3):
                    resp = await oa.completions.create(model="any", prompt=prompt, max_tokens=16,
                                                       extra_body={"return_token_ids": True})  # fmt: skip
                    assert resp.prompt_token_ids == prompt  # type: ignore[attr-defined]
                    stream = prompt + resp.choices[0].token_ids  # type: ignore[attr-defined]
                    prompt = stream + tok.encode_rendered(f"\nObservation: {i}\nAnswer:")
                streams[info["episode"]] = stream
                r = await http.post(f"{harness.url}/rl/sessions/{info['session_id']}/reward",
                                    headers=harness.admin, json={"reward": 0.5})  # fmt: skip
                assert r.status_code == 200, r.text

            async with anyio.create_task_group() as tg:
                for _ in range(24):
                    tg.start_soon(agent)
        with anyio.fail_after(10):
            while any(p.score is None and p.error is None for p in harness.played):
                await anyio.sleep(0.02)
    assert harness.gateway.stats["restarts"] == 0
    for p in harness.played:
        assert p.error is None and len(p.samples) == 1, (p.episode, p.error)
        (sample,) = p.samples
        assert sample.token_ids.tolist() == streams[p.episode]
        assert len(gs.trained_turns(sample)) == 3
        assert assert_token_exact(p, engine.requests) == 3
