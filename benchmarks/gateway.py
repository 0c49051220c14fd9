"""The gateway's overhead per call, at 1 and at 1,000 concurrent sessions: latency, loop lag.

    .venv/bin/python benchmarks/gateway.py                  # ~3.5 min on 2 cores
    .venv/bin/python benchmarks/gateway.py --quick          # a ~1-minute look (--verbose: progress)
    .venv/bin/python benchmarks/gateway.py --machine 2core  # benchmarks/results/gateway-2core.json
    .venv/bin/python benchmarks/gateway.py --sessions 1000 --seconds 120  # one setting, longer
    .venv/bin/python benchmarks/gateway.py --sessions 1000 --hostile      # beside a hostile client
    python3 benchmarks/gateway.py --agent-procs 8 --sessions 1000 --seconds 40 --client raw
        # the GPU host's 16 cores (after source benchmarks/gpu/cpu_env.sh): docs/gateway.md

A real run: the embedded :class:`asyncrl.Controller` with ``[gateway] enabled = true``, the
example (bigram) trainer and rollout ranks as real processes, on the testing environment
``repeat-digit`` (its prompts; the agents post the rewards). Every episode is a session that an
agent takes with ``POST /rl/sessions``; each agent here is a loop that takes a session, makes
4 chat calls (``POST {base_url}/chat/completions``, ``max_tokens = --turn-tokens``; between
calls it appends the reply and a user message ``"again"``) and ends it with
``POST /rl/sessions/<id>/reward`` ``{"reward": 1.0}``, then takes the next one.

Two settings, each a fresh pair of interpreters (children of this script):

- **1 session**: one agent; ``grpo`` 1 prompt x 4 samples a step (steps, refits and all, but
  never a second session at once): the gateway's own cost on an idle controller;
- **1,000 sessions**: 1,000 agents; ``--prompts`` x ``--samples`` episodes a step (64 x 16 =
  1,024) and ``pipeline.max_inflight_samples`` as many, with the ``gated`` sampler (W = 2),
  so the next step's sessions open while the last ones finish: about 1,000 sessions are held
  throughout (the figures say how many were).

Each turn generates at most ``--turn-tokens`` tokens (it stops at the end token: about 1 in
20 of an untrained bigram's) at ``--token-delay`` s a token (~0.8 s a call by default, as
``benchmarks/episodes.py``; an LLM's turn takes seconds). The gateway serves at most 2,048
requests at once here (``Guards.max_concurrent_requests``; no 429 at 1,000 agents).

The controller's child starts the load generator (the agents) as child interpreters of its
own (``--agent-procs``; 8 on the GPU host's 16 cores), so the agents' CPU is not spent on the
controller's loop (on 2 cores they still share the machine with it, the trainer and the
rollout ranks). Their garbage collector is off (``--agents-gc on`` to compare): its pauses
stalled their loops up to 111 ms, a tail charged to the gateway. Both sides run on
``--loop`` (default: uvloop where installed, as ``asyncrl.launch.EVENT_LOOP = "auto"`` gives
``asyncrl run``). Two clients (``--client``):

- ``raw`` (:class:`RawHTTP`): one keep-alive HTTP/1.1 connection per agent, each request
  written in one send, each answer read with httptools: about 0.1 ms of its own, so the
  client overhead is what the gateway adds;
- ``httpx`` (default): an ``httpx.AsyncClient`` per agent with one keep-alive connection, as
  a fleet of agent programs would (one SSL context shared: httpx would load the CA bundle
  per client); it adds ~1.2-1.4 ms a call in the agent's process. httpx rather than the
  official ``openai.AsyncOpenAI``, which wraps httpx and adds its pydantic models, retries
  and headers on every call (the gateway sees the same request either way;
  ``tests/integration/test_gateway_bigram.py`` runs the ``openai`` client against it). Not
  one shared client with a pool of 1,000 connections (``--shared-client``): httpcore's pool
  scans its requests and connections on every request and response, and at 1,000 agents on
  2 cores the load generator's loop then ran ~20 calls/s.

Warm-up: the measurement starts once the run has ended step ``--warmup-steps`` (default 2,
as in ``benchmarks/episodes.py``: start-up, the agents' first claims and the first fill are
out; 1 for the 1-session setting, whose steps are short) and lasts ``--seconds`` (1,000
sessions) or ``--single-seconds`` (1 session); then the agents stop and the run is cancelled.
Only calls that began and ended inside that window count (the calls the stop drops show as
uvicorn's ``ClientDisconnect`` tracebacks, which the benchmark silences once the window is
over). Measured per call:

- **client overhead** = the latency the agent sees (from just before ``client.post`` to the
  response read, JSON not yet parsed) minus ``Server-Timing``'s ``generate`` (the time the
  call's episode spent in ``Episode.sample``, the engine's part: what calling the engine
  directly would cost, placing the requests on the rollout workers included). It is all that
  the HTTP path adds: the client's encoding and its loop, loopback TCP, uvicorn's parsing,
  Starlette's routing, the hand-off to the episode's task and back, the reply's encoding,
  and every wait for the controller's loop (or a core) on the way;
- **server overhead** = ``Server-Timing``'s ``total`` minus ``generate``: the handler's part
  of it (from the request's arrival in the handler to its answer: auth, body, decoding, the
  hand-off both ways, the conversation's bookkeeping, the reply built), without HTTP parsing,
  the socket and the client;

each as p50, p99 and max (targets: p50 <= 2 ms, p99 <= 10 ms); their difference, latency
minus ``total`` ("outside the handler"), is the client's and uvicorn's share; and over the
window:

- **calls/s**: calls that ended with a 200 in the window, over its length; **sessions held**:
  the agents' sessions between claim and reward, sampled every 100 ms (mean, p10, max), and
  the controller's ``inflight_samples``;
- **loop lag**: how late a 10 ms sleep wakes on the controller's loop, sampled in the
  controller's process as :class:`~asyncrl.obs.watchdog.LoopLag` does (p50, p99, max), and
  how busy the loop's thread was (its CPU time over the window);
- **agents' loop**: the same lag probe on the load generator's loop, and its process's CPU
  time over the window: a late client loop adds to the client overhead, not to the server's;
- claims and rewards: their latency (p50, p99), and every non-200 answer by status.

``--hostile`` adds a hostile client beside the agents (``benchmarks/hostile_client.py``: the
largest bodies the gateway reads, back to back, and slow connections), from the start of the
run; the window's figures then say what it cost the others, and what it was told.

Results are printed and written to ``--out`` (default ``benchmarks/results/gateway-<machine>.json``
with ``--machine``, else ``runs/benchmarks/gateway.json``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import importlib.util
import json
import logging
import os
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import hostile_client  # benchmarks/, beside this script
from results_file import write_results

CALLS = 4
"""Chat calls a session."""
MAX_CONCURRENT_REQUESTS = 2048


# --------------------------------------------------------------------------- the run
def config(model: Path, out: Path, args: argparse.Namespace, sessions: int) -> dict[str, Any]:
    """The run's config: ``sessions`` 1 is a small run (1 x 4 a step), else the full one."""
    prompts, samples = (1, 4) if sessions == 1 else (args.prompts, args.samples)
    episodes = prompts * samples
    return {
        "model": {"path": str(model)},
        "environment": {"name": "repeat-digit"},
        "run": {"num_steps": 100_000, "seed": 0, "output_dir": str(out)},  # cancelled first
        "cluster": {"trainer_ranks": 1, "rollout_ranks": args.ranks, "shutdown_grace_s": 5.0},
        "grpo": {"prompts_per_step": prompts, "samples_per_prompt": samples,
                 "max_new_tokens": args.turn_tokens},  # fmt: skip
        "episode": {"max_turns": CALLS, "max_context_tokens": 1024},
        "pipeline": {
            "sampler": {"name": "gated", "max_staleness_versions": 2},
            "min_groups_for_streaming_train": max(1, prompts // 4),
            "max_inflight_samples": episodes,
        },
        "refit": {"bucket_size_mb": 1, "verify_every_steps": 0},
        "trainer": {"backend": "bigram", "options": {"lr": 0.5}},
        "generator": {"backend": "bigram", "options": {"token_delay_s": args.token_delay}},
        "gateway": {"enabled": True},  # its guards: controller_child
        "eval": {"num_prompts": 0},
        # the hostile client's sessions end before their first turn (a call over the context
        # does): each one's group is dropped, and the run would stop after 16 of them
        **({"failures": {"max_failed_groups": 1_000_000}} if args.hostile else {}),
    }


async def controller_child(args: argparse.Namespace) -> None:
    """One setting (``--child controller``): the controller, with the agents' interpreter
    as its child; the window's figures as JSON to ``--child-out``."""
    import asyncrl
    import asyncrl.obs.log
    from asyncrl.config import from_dict
    from asyncrl.obs import collector
    from asyncrl_example_backend.model import write_model_dir
    from asyncrl_gateway import server

    asyncrl.obs.log.configure("console", level="error")  # a program's choice
    # read when the run starts: the gateway's request cap, the collector's clock
    server.GUARDS = server.Guards(max_concurrent_requests=MAX_CONCURRENT_REQUESTS)
    if args.gc_young_interval is not None:
        collector.GC_YOUNG_INTERVAL_S = args.gc_young_interval
    sessions = args.child_sessions
    warmup = 1 if sessions == 1 else args.warmup_steps
    seconds = args.single_seconds if sessions == 1 else args.seconds
    lags: list[tuple[float, float]] = []
    load: list[tuple[float, int, int]] = []  # at, step, inflight_samples
    pauses: list[Pause] = []  # the collector's
    gc.callbacks.append(gc_timer(pauses, census=args.gc_census))
    window: dict[str, float] = {}
    ctl: Any = None


    async def load_probe() -> None:
        while True:
            await anyio.sleep(0.1)
            try:
                status = ctl.status() if ctl is not None else None
            except RuntimeError:  # not running yet, or over
                status = None
            if status is not None:
                load.append((time.monotonic(), status.step, status.inflight_samples))

    async def conduct(agents: list[subprocess.Popen[bytes]], stop: anyio.CancelScope) -> None:
        """Wait out the warm-up, measure, then stop the agents and the run."""
        deadline = time.monotonic() + args.warmup_timeout
        while not load or load[-1][1] < warmup:
            if any(a.poll() is not None for a in agents):
                raise SystemExit(f"the agents exited ({[a.returncode for a in agents]}) "
                                 "during warm-up")  # fmt: skip
            if args.verbose and len(load) % 50 == 0 and load:
                print(f"  controller: step {load[-1][1]}, {load[-1][2]} in flight", flush=True)
            if time.monotonic() > deadline:
                raise SystemExit(f"step {warmup} not reached in {args.warmup_timeout:g} s")
            await anyio.sleep(0.05)
        profile = cProfile.Profile(time.thread_time) if args.profile else None
        window["start"], window["cpu0"] = time.monotonic(), time.thread_time()
        print(f"  [{sessions}] step {load[-1][1]}: measuring {seconds:g} s", flush=True)
        if profile is not None:
            profile.enable()
        await anyio.sleep(seconds)
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{args.profile}.{sessions}")
        window["end"], window["cpu1"] = time.monotonic(), time.thread_time()
        # the agents drop their calls in flight: uvicorn would log each one's ClientDisconnect
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        for a in agents:
            assert a.stdin is not None
            a.stdin.write(b"stop\n")
            a.stdin.close()
        for a in agents:
            await anyio.to_thread.run_sync(a.wait)
        stop.cancel()

    with tempfile.TemporaryDirectory(prefix="asyncrl-gateway-") as tmp_name:
        tmp = Path(tmp_name)
        data = config(write_model_dir(tmp / "model"), tmp / "run", args, sessions)
        procs = max(1, min(args.agent_procs, sessions))
        outs = [tmp / f"agents-{i}.json" for i in range(procs)]
        hostile_out = tmp / "hostile.json"
        agents = [subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", "agents",
             "--child-sessions", str(sessions // procs + (i < sessions % procs)),
             "--child-out", str(out), "--gateway-dir", str(tmp / "run"),
             "--turn-tokens", str(args.turn_tokens), "--loop", args.loop,
             "--agents-gc", args.agents_gc, "--client", args.client]
            + ["--verbose"] * (args.verbose and i == 0) + ["--shared-client"] * args.shared_client,
            stdin=subprocess.PIPE) for i, out in enumerate(outs)]  # fmt: skip
        if args.hostile:
            agents.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", "hostile",
                 "--child-out", str(hostile_out), "--gateway-dir", str(tmp / "run"),
                 "--hostile-big", str(args.hostile_big), "--hostile-slow",
                 str(args.hostile_slow)], stdin=subprocess.PIPE))  # fmt: skip
        try:
            async with anyio.create_task_group() as probes:
                probes.start_soon(lag_probe, lags)
                probes.start_soon(load_probe)
                async with asyncrl.Controller(from_dict(data)) as ctl:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(conduct, agents, tg.cancel_scope)
                        await ctl.train()
                        raise SystemExit("the run ended before the measurement did")
                probes.cancel_scope.cancel()
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                    a.wait()
        if any(a.returncode != 0 for a in agents):
            raise SystemExit(f"the agents exited with {[a.returncode for a in agents]}")
        raw = merge([json.loads(out.read_text()) for out in outs])
        hostile = json.loads(hostile_out.read_text()) if args.hostile else None
    out = summarize(raw, lags, load, window, sessions)
    if hostile is not None:
        out["hostile"] = hostile
    if CENSUS:
        out["gc_census_types"] = dict(CENSUS.most_common(40))
    out["gc_pauses_ms"] = gc_summary([p for p in pauses if window["start"] <= p.at <= window["end"]])
    args.child_out.write_text(json.dumps(out))


@dataclass
class Pause:
    """One collection: when it ended, its generation, its wall and thread-CPU seconds (a
    collection whose finalizers let other threads run takes longer than its own CPU), the
    objects it found unreachable, and (``--gc-census``) how many it had to examine."""

    at: float
    generation: int
    wall: float
    cpu: float
    collected: int
    examined: int | None


CENSUS: collections.Counter[str] = collections.Counter()
"""``--gc-census``: the types of the objects the collections examined, over the run."""


def gc_timer(pauses: list[Pause], census: bool = False) -> Any:
    """A ``gc.callbacks`` entry that records each collection (:class:`Pause`). ``census``
    counts the objects of the generations collected first (costly: outside the timing)."""
    started = [0.0, 0.0]
    examined: list[int | None] = [None]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            if census:
                objects = [o for g in range(info["generation"] + 1) for o in gc.get_objects(g)]
                examined[0] = len(objects)
                CENSUS.update(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
                del objects
            started[:] = time.monotonic(), time.thread_time()
            return
        now, cpu = time.monotonic(), time.thread_time()
        pauses.append(Pause(now, info["generation"], now - started[0], cpu - started[1],
                            info["collected"], examined[0]))  # fmt: skip

    return callback


def gc_summary(pauses: list[Pause]) -> dict[str, Any]:
    """Per generation: how many collections, their wall time's quantiles (ms), the mean
    thread-CPU time (ms), objects found unreachable and (census) examined."""
    out: dict[str, Any] = {}
    for g in range(3):
        mine = [p for p in pauses if p.generation == g]
        out[f"gen{g}"] = {"count": len(mine), **quantiles([p.wall for p in mine])}
        if mine:
            out[f"gen{g}"]["cpu_mean"] = 1e3 * float(np.mean([p.cpu for p in mine]))
            out[f"gen{g}"]["collected_mean"] = float(np.mean([p.collected for p in mine]))
            if mine[0].examined is not None:
                out[f"gen{g}"]["examined_mean"] = float(np.mean([p.examined for p in mine]))
    return out


async def lag_probe(lags: list[tuple[float, float]]) -> None:
    """How late a 10 ms sleep wakes on this loop, forever: ``(when, lateness)`` into ``lags``."""
    while True:
        t = time.monotonic()
        await anyio.sleep(0.01)
        now = time.monotonic()
        lags.append((now, now - t - 0.01))


# --------------------------------------------------------------------------- the agents
async def agents_child(args: argparse.Namespace) -> None:
    """The load generator (``--child agents``): ``--child-sessions`` agents until a line on
    stdin; every call's timings as JSON to ``--child-out``."""
    import httpx

    if args.agents_gc == "off":  # its pauses would be charged to the gateway (--agents-gc)
        gc.disable()
    info_path = args.gateway_dir / "gateway.json"
    with anyio.fail_after(300):
        while not info_path.exists():
            await anyio.sleep(0.05)
    info = json.loads(info_path.read_text())
    url = info["url"]
    admin = {"Authorization": f"Bearer {Path(info['key_file']).read_text().strip()}"}
    n = args.child_sessions
    calls: list[tuple[float, float, float, float]] = []  # sent, answered, generate, total (s)
    claims: list[tuple[float, float]] = []  # sent, answered
    rewards: list[tuple[float, float]] = []
    errors: dict[str, int] = {}
    held = [0]
    samples: list[tuple[float, int, float]] = []  # at, sessions held, process CPU s
    lags: list[tuple[float, float]] = []

    def error(what: str) -> None:
        errors[what] = errors.get(what, 0) + 1

    async def agent(http: Any) -> None:
        while True:
            t0 = time.monotonic()
            try:
                status, _, answer = await http.post(f"{url}/rl/sessions", admin, {"wait_s": 30})
            except (httpx.TransportError, OSError, anyio.EndOfStream) as exc:
                error(f"claim {type(exc).__name__}")
                await anyio.sleep(0.1)
                continue
            if status != 201:
                error(f"claim {status}")
                continue
            claims.append((t0, time.monotonic()))
            held[0] += 1
            try:
                await session(http, json.loads(answer))
            finally:
                held[0] -= 1

    async def session(http: Any, s: dict[str, Any]) -> None:
        head = {"Authorization": f"Bearer {s['api_key']}"}
        chat = f"{s['base_url']}/chat/completions"
        messages = list(s["prompt"]["messages"])
        for i in range(CALLS):
            body = {"model": "bigram", "messages": messages, "max_tokens": args.turn_tokens}
            t0 = time.monotonic()
            try:
                status, headers, answer = await http.post(chat, head, body)
            except (httpx.TransportError, OSError, anyio.EndOfStream) as exc:
                error(f"chat {type(exc).__name__}")
                return
            t1 = time.monotonic()
            if status != 200:
                error(f"chat {status}")
                return
            timing = dict(
                (part.split(";dur=")[0].strip(), float(part.split(";dur=")[1]))
                for part in headers["server-timing"].split(",")
            )  # fmt: skip
            calls.append((t0, t1, timing["generate"] / 1e3, timing["total"] / 1e3))
            messages.append(json.loads(answer)["choices"][0]["message"])
            if i < CALLS - 1:
                messages.append({"role": "user", "content": "again"})
        t0 = time.monotonic()
        try:
            status, _, _ = await http.post(f"{url}/rl/sessions/{s['session_id']}/reward", admin,
                                           {"reward": 1.0})  # fmt: skip
        except (httpx.TransportError, OSError, anyio.EndOfStream) as exc:
            error(f"reward {type(exc).__name__}")
            return
        if status != 200:
            error(f"reward {status}")
            return
        rewards.append((t0, time.monotonic()))

    async def sampler() -> None:
        while True:
            samples.append((time.monotonic(), held[0], time.process_time()))
            if args.verbose and len(samples) % 50 == 0:
                print(f"  agents: {held[0]} sessions held, {len(claims)} claims, {len(calls)} "
                      f"calls, {len(rewards)} rewards, errors {errors}", flush=True)
            await anyio.sleep(0.1)

    tls = ssl.create_default_context()  # made once: httpx would load the CAs per client

    def client(connections: int) -> Any:
        if args.client == "raw":
            return RawHTTP(url)
        limits = httpx.Limits(max_connections=connections,
                              max_keepalive_connections=connections)  # fmt: skip
        return Httpx(httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0), verify=tls))

    async def own_client() -> None:
        async with client(1) as http:
            await agent(http)

    async with contextlib.AsyncExitStack() as stack:
        shared = await stack.enter_async_context(client(n + 16)) if args.shared_client else None
        async with anyio.create_task_group() as tg:
            tg.start_soon(lag_probe, lags)
            tg.start_soon(sampler)
            for _ in range(n):
                tg.start_soon(own_client) if shared is None else tg.start_soon(agent, shared)
            await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
    args.child_out.write_text(json.dumps({"calls": calls, "claims": claims, "rewards": rewards,
                                          "errors": errors, "samples": samples, "lags": lags}))


async def hostile_child(args: argparse.Namespace) -> None:
    """The hostile client (``--child hostile``, ``hostile_client.py``) until a line on stdin."""
    info_path = args.gateway_dir / "gateway.json"
    with anyio.fail_after(300):
        while not info_path.exists():
            await anyio.sleep(0.05)
    info = json.loads(info_path.read_text())
    key = Path(info["key_file"]).read_text().strip()
    await hostile_client.run(info["url"], key, args.hostile_big, args.hostile_slow,
                             args.child_out)  # fmt: skip


class Httpx:
    """``post(url, headers, body) -> (status, headers, body bytes)`` on an ``httpx.AsyncClient``."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def __aenter__(self) -> Httpx:
        await self._client.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._client.__aexit__(*exc)

    async def post(self, url: str, headers: dict[str, str],
                   body: Any) -> tuple[int, Any, bytes]:  # fmt: skip
        r = await self._client.post(url, headers=headers, json=body)
        return r.status_code, r.headers, r.content


class RawHTTP:
    """The least client there is (``--client raw``): one keep-alive HTTP/1.1 connection, each
    request written in one send, each answer (``Content-Length``) read with httptools, the
    parser uvicorn uses. What httpx adds to a call (~1 ms: its request and response models,
    its pool, the head and the body written apart) is then not counted as the gateway's."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._stream: Any = None
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._complete = False

    async def __aenter__(self) -> RawHTTP:
        self._stream = await anyio.connect_tcp(self._host, self._port)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stream.aclose()

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._complete = True

    async def post(self, url: str, headers: dict[str, str],
                   body: Any) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        import httptools

        data = json.dumps(body).encode()
        path = urllib.parse.urlsplit(url).path
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        await self._stream.send(
            f"POST {path} HTTP/1.1\r\nhost: {self._host}:{self._port}\r\ncontent-type: "
            f"application/json\r\ncontent-length: {len(data)}\r\n{head}\r\n".encode() + data
        )  # fmt: skip
        self._headers, self._body, self._complete = {}, [], False
        parser = httptools.HttpResponseParser(self)
        while not self._complete:
            parser.feed_data(await self._stream.receive())
        return parser.get_status_code(), self._headers, b"".join(self._body)


# --------------------------------------------------------------------------- the figures
def merge(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """The agents' processes' records as one: rows pooled, errors added, and the 100 ms
    samples (sessions held, CPU seconds) added up sample by sample (they start together)."""
    out: dict[str, Any] = {k: [r for raw in raws for r in raw[k]]
                           for k in ("calls", "claims", "rewards", "lags")}  # fmt: skip
    errors: dict[str, int] = {}
    for raw in raws:
        for k, v in raw["errors"].items():
            errors[k] = errors.get(k, 0) + v
    n = min(len(raw["samples"]) for raw in raws)
    out["errors"] = errors
    out["samples"] = [(raws[0]["samples"][i][0], sum(raw["samples"][i][1] for raw in raws),
                       sum(raw["samples"][i][2] for raw in raws)) for i in range(n)]  # fmt: skip
    return out


def quantiles(xs: Any, scale: float = 1e3) -> dict[str, float]:
    """p50, p90, p99, p99.9 and max of ``xs`` (seconds), in milliseconds."""
    a = np.asarray(xs, float) * scale
    if not a.size:
        return {}
    q = np.quantile(a, [0.5, 0.9, 0.99, 0.999])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "p99_9": float(q[3]),
            "max": float(a.max()), "mean": float(a.mean())}  # fmt: skip


def summarize(raw: dict[str, Any], lags: list[tuple[float, float]],
              load: list[tuple[float, int, int]], window: dict[str, float],
              sessions: int) -> dict[str, Any]:  # fmt: skip
    """The window's figures (calls that began and ended in it)."""
    start, end = window["start"], window["end"]
    span = end - start
    inside = lambda rows: [r for r in rows if start <= r[0] and r[1] <= end]  # noqa: E731
    calls = np.array(inside(raw["calls"]), float).reshape(-1, 4)
    latency = calls[:, 1] - calls[:, 0]
    generate, total = calls[:, 2], calls[:, 3]
    at = lambda rows: [r for r in rows if start <= r[0] <= end]  # noqa: E731
    held = [h for _, h, _ in at(raw["samples"])]
    cpu = [(t, c) for t, _, c in at(raw["samples"])]
    inflight = [i for _, _, i in at(load)]
    steps = [s for _, s, _ in at(load)]
    agent_lag = [lag for _, lag in at(raw["lags"])]
    loop_lag = [lag for _, lag in at(lags)]
    return {
        "sessions": sessions,
        "window_s": span,
        "steps": [min(steps), max(steps)] if steps else [],
        "calls": len(calls),
        "calls_per_s": len(calls) / span,
        "sessions_ended_per_s": len(at(raw["rewards"])) / span,
        "sessions_held_mean": float(np.mean(held)) if held else 0.0,
        "sessions_held_p10": float(np.quantile(held, 0.1)) if held else 0.0,
        "sessions_held_max": int(max(held, default=0)),
        "inflight_samples_mean": float(np.mean(inflight)) if inflight else 0.0,
        "client_overhead_ms": quantiles(latency - generate),
        "server_overhead_ms": quantiles(total - generate),
        "client_latency_ms": quantiles(latency),
        "generate_ms": quantiles(generate),
        "outside_handler_ms": quantiles(latency - total),
        "loop_lag_ms": quantiles(loop_lag),
        "loop_lag_samples": len(loop_lag),
        "loop_busy": (window["cpu1"] - window["cpu0"]) / span,
        "agents_loop_lag_ms": quantiles(agent_lag),
        "agents_cpu": (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]) if len(cpu) > 1 else None,
        "claim_ms": quantiles([b - a for a, b in inside(raw["claims"])]),
        "reward_ms": quantiles([b - a for a, b in inside(raw["rewards"])]),
        "errors": raw["errors"],
    }


def fmt(q: dict[str, float]) -> str:
    if not q:
        return "(none)"
    return f"p50 {q['p50']:.2f}, p99 {q['p99']:.2f}, max {q['max']:.1f} ms"


def report(results: dict[str, Any]) -> None:
    for r in results["settings"]:
        print(
            f"\n{r['sessions']} concurrent session(s) (held: mean {r['sessions_held_mean']:.0f}, "
            f"p10 {r['sessions_held_p10']:.0f}, max {r['sessions_held_max']}; controller "
            f"in flight {r['inflight_samples_mean']:.0f}), steps {r['steps']}, "
            f"{r['window_s']:.0f} s window\n"
            f"  calls: {r['calls']} ({r['calls_per_s']:.1f}/s; sessions ended "
            f"{r['sessions_ended_per_s']:.1f}/s)\n"
            f"  client overhead (latency - generate): {fmt(r['client_overhead_ms'])}\n"
            f"  server overhead (total - generate):   {fmt(r['server_overhead_ms'])}\n"
            f"  outside the handler (latency - total): {fmt(r['outside_handler_ms'])}\n"
            f"  client latency: {fmt(r['client_latency_ms'])}; generate: {fmt(r['generate_ms'])}\n"
            f"  controller loop lag: {fmt(r['loop_lag_ms'])} ({r['loop_lag_samples']} samples), "
            f"loop thread {100 * r['loop_busy']:.0f}% busy\n"
            f"  garbage collections: " + "; ".join(
                f"{g} {q['count']} ({fmt(q)}; CPU {q['cpu_mean']:.1f} ms, "
                f"{q['collected_mean']:.0f} collected"
                + (f", {q['examined_mean']:.0f} examined" if "examined_mean" in q else "") + ")"
                for g, q in r.get("gc_pauses_ms", {}).items() if q["count"]) + "\n"
            f"  agents' loop lag: {fmt(r['agents_loop_lag_ms'])}, agents' process "
            f"{100 * (r['agents_cpu'] or 0):.0f}% of a CPU\n"
            f"  claim: {fmt(r['claim_ms'])}; reward: {fmt(r['reward_ms'])}\n"
            f"  non-200 answers: {r['errors'] or 'none'}"
        )  # fmt: skip
        if "hostile" in r:
            h = r["hostile"]
            print("  hostile client (the whole run): " + "; ".join(
                f"{k} x{b['n']} {b['status']} (p50 {b['s_p50'] or 0:.2f} s, max "
                f"{b['s_max'] or 0:.2f} s)" for k, b in h["bodies"].items()) + f"; {h['claims']} "
                "sessions taken; slow connections cut: " + "; ".join(
                f"{m} {c['cut']}x after p50 {c['after_s_p50'] or 0:.1f} s, told {c['answers']}"
                for m, c in h["slow"].items()) + f"; errors {h['errors'] or 'none'}")  # fmt: skip


def measure(args: argparse.Namespace, sessions: int) -> dict[str, Any]:
    """One setting in a fresh interpreter (the controller's), which starts the agents'."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-gateway-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "controller",
               "--child-sessions", str(sessions), "--child-out", str(out)]  # fmt: skip
        cmd += ["--verbose"] * args.verbose + ["--shared-client"] * args.shared_client
        cmd += ["--loop", args.loop, "--agents-gc", args.agents_gc, "--client", args.client]
        cmd += ["--hostile"] * args.hostile
        cmd += ["--profile", args.profile] * bool(args.profile) + ["--gc-census"] * args.gc_census
        if args.gc_young_interval is not None:
            cmd += ["--gc-young-interval", str(args.gc_young_interval)]
        for flag in ("prompts", "samples", "ranks", "turn_tokens", "token_delay", "agent_procs",
                     "warmup_steps", "seconds", "single_seconds", "warmup_timeout",
                     "hostile_big", "hostile_slow"):  # fmt: skip
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        t = time.monotonic()
        subprocess.run(cmd, check=True)
        result = json.loads(out.read_text())
    result["run_s"] = time.monotonic() - t
    print(f"{sessions}:", json.dumps(result), flush=True)
    return result


def main(args: argparse.Namespace) -> None:
    results: dict[str, Any] = {
        "workload": {
            "environment": "repeat-digit (prompts only; the agents post reward 1.0)",
            "calls_per_session": CALLS,
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "single_session_run": "1 prompt x 4 samples a step",
            "rollout_ranks": args.ranks,
            "turn_tokens_max": args.turn_tokens,
            "token_delay_s": args.token_delay,
            "warmup_steps": args.warmup_steps,
            "seconds": args.seconds,
            "single_seconds": args.single_seconds,
            "max_concurrent_requests": MAX_CONCURRENT_REQUESTS,
            "agent_processes": args.agent_procs,
            "event_loop": args.loop,
            "agents_gc": args.agents_gc,
            "gc_young_interval_s": "the default (0.05)" if args.gc_young_interval is None
            else args.gc_young_interval,
            "http_parser": "httptools" if importlib.util.find_spec("httptools") else "h11",
            "client": "one keep-alive connection per agent, a raw HTTP/1.1 client (RawHTTP)"
            if args.client == "raw" else
            "one httpx.AsyncClient for all agents, a pool of as many connections"
            if args.shared_client else "httpx.AsyncClient per agent, one connection each",
            "quick": args.quick,
            "hostile": {"big_connections": args.hostile_big, "body_bytes":
                        hostile_client.MAX_BODY_BYTES, "slow_connections": args.hostile_slow}
            if args.hostile else None,
            "machine": args.machine or "",
            "cpus": os.cpu_count(),
        },
        "settings": [],
    }
    print("workload:", json.dumps(results["workload"]), flush=True)
    for n in args.sessions:
        results["settings"].append(measure(args, n))
    report(results)
    write_results(results, "gateway", args.out, args.machine)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 1000],
                        help="the settings: concurrent sessions (agents)")
    parser.add_argument("--prompts", type=int, default=64, help="groups a step (1,000 setting)")
    parser.add_argument("--samples", type=int, default=16, help="episodes a group")
    parser.add_argument("--ranks", type=int, default=2, help="rollout ranks")
    parser.add_argument("--turn-tokens", type=int, default=8,
                        help="at most this many tokens a call")
    parser.add_argument("--token-delay", type=float, default=0.1,
                        help="engine seconds a token (~0.8 s a call by default)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="steps before the window (the 1-session setting: 1)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="the window at many sessions")
    parser.add_argument("--single-seconds", type=float, default=90.0,
                        help="the window at 1 session (~1.2 calls/s: ~110 calls)")
    parser.add_argument("--warmup-timeout", type=float, default=300.0,
                        help="give up when the warm-up takes longer")
    parser.add_argument("--quick", action="store_true",
                        help="a look: warm-up 1 step, 20 s windows")
    parser.add_argument("--profile", default="",
                        help="cProfile the controller's thread (CPU time) over the window to "
                             "PROFILE.<sessions> (the figures then include its cost)")
    parser.add_argument("--gc-census", action="store_true",
                        help="count the objects each collection examines (slow, outside the "
                             "timing; for diagnosis)")
    parser.add_argument("--gc-young-interval", type=float, default=None,
                        help="asyncrl.obs.collector.GC_YOUNG_INTERVAL_S (default: its 0.05; "
                             "0: Python's own collector, to compare)")
    parser.add_argument("--agent-procs", type=int, default=1,
                        help="load generator processes (the agents split between them)")
    parser.add_argument("--shared-client", action="store_true",
                        help="all agents on one httpx.AsyncClient with a pool of as many "
                        "connections (slow in httpcore's pool at 1,000: see the docstring)")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"),
                        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
                        help="the event loop of the controller (default: EVENT_LOOP's 'auto', "
                        "what asyncrl run uses) and of the agents")
    parser.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                        help="the agents' HTTP client (raw: see RawHTTP)")
    parser.add_argument("--agents-gc", choices=("on", "off"), default="off",
                        help="the load generator's garbage collector (off: a 2-minute run's "
                        "agents make little cyclic garbage, and its pauses are the client's)")
    parser.add_argument("--hostile", action="store_true",
                        help="a hostile client beside the agents (hostile_client.py)")
    parser.add_argument("--hostile-big", type=int, default=1,
                        help="--hostile: connections sending the largest bodies back to back")
    parser.add_argument("--hostile-slow", type=int, default=60,
                        help="--hostile: slow connections (a third each: head, body, silent)")
    parser.add_argument("--verbose", action="store_true",
                        help="progress every 5 s (the agents' counts, the run's step)")
    parser.add_argument("--machine", default="", help="names the results file, e.g. 2core")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-sessions", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gateway-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.shared_client and parsed.client == "raw":
        parser.error("--shared-client is an httpx pool: not with --client raw")
    if parsed.quick:
        parsed.warmup_steps, parsed.seconds, parsed.single_seconds = 1, 20.0, 20.0
    loop = {"use_uvloop": parsed.loop == "uvloop"}
    if parsed.child == "controller":
        anyio.run(controller_child, parsed, backend_options=loop)
    elif parsed.child == "agents":
        anyio.run(agents_child, parsed, backend_options=loop)
    elif parsed.child == "hostile":
        anyio.run(hostile_child, parsed, backend_options=loop)
    else:
        main(parsed)
