"""A gateway over a scripted engine, for the gateway's tests: the real :class:`Gateway`,
:class:`GatewayServer` (uvicorn on 127.0.0.1), sessions, trajectories (the Qwen2.5 template of
``gateway_model``) and episodes; only the engine and the episode runner are stand-ins.

The engine (:class:`ScriptedEngine`) samples a turn as a real one would hand it back: token
ids (a Hermes tool call, an answer, or random text, drawn per request), logprobs, an end
token unless cut at the token limit, and the weight version; it keeps every request it got
and every turn it sampled, which the tests compare with what was recorded.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import numpy as np

from asyncrl.data.chat import ChatTemplate
from asyncrl.data.prompts import Tokenizer
from asyncrl.env.episode import Episode, EpisodeLimit, Generated, Limits
from asyncrl.env.segments import TrajectorySample
from asyncrl.env.tool_parsers import HERMES
from asyncrl.env.trajectory import Trajectory
from asyncrl.environment import Prompt, Score
from asyncrl_gateway.config import GatewayConfig
from asyncrl_gateway.gateway import Gateway
from asyncrl_gateway.server import GatewayServer, Guards
import gateway_model as gm

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate a sum like 12+34.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}  # fmt: skip


@dataclass
class Model:
    tok: Tokenizer
    template: ChatTemplate
    end_id: int


def make_model(path: Path) -> Model:
    fam = gm.QWEN25_FAMILY
    corpus = [*gm.corpus(), json.dumps(CALC_TOOL), '<tool_call>\n{"name": "calc", '
              '"arguments": {"expression": "12+34"}}\n</tool_call>', "The answer is 46."]  # fmt: skip
    d = gm.model_dir(path, fam.template, fam.tokens, corpus=corpus,
                               specials=fam.specials, nfc=fam.nfc, vocab_size=1000)  # fmt: skip
    template = ChatTemplate.from_model(str(d))
    assert template is not None
    vocab = json.loads((d / "tokenizer.json").read_text())
    end = next(t["id"] for t in vocab["added_tokens"] if t["content"] == fam.end)
    return Model(Tokenizer(str(d / "tokenizer.json"), end, template), template, end)


@dataclass
class Request:
    """One engine request: what it was sent and what it sampled."""

    episode: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


class ScriptedEngine:
    """Samples a turn per request (see the module docstring)."""

    def __init__(self, model: Model, seed: int = 0, *, tool_rate: float = 0.5,
                 delay_s: float = 0.0) -> None:  # fmt: skip
        self._m, self._rng = model, random.Random(seed)
        self.tool_rate, self.delay_s = tool_rate, delay_s
        self.version = 0
        self.requests: list[Request] = []

    def _text(self) -> str:
        r = self._rng.random()
        if r < self.tool_rate:
            a, b = self._rng.randint(1, 99), self._rng.randint(1, 99)
            return f'<tool_call>\n{{"name": "calc", "arguments": {{"expression": "{a}+{b}"}}}}\n</tool_call>'
        if r < self.tool_rate + 0.25:
            return f"The answer is {self._rng.randint(0, 200)}."
        return gm.random_text(self._rng, 1, 12)

    async def generate(self, episode: str, prompt_ids: list[int], max_tokens: int) -> Generated:
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        else:
            await anyio.lowlevel.checkpoint()
        ids = self._m.tok.encode_rendered(self._text()) + [self._m.end_id]
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        lps = [-self._rng.random() * 3 for _ in ids]
        self.requests.append(Request(episode, list(prompt_ids), list(ids), lps))
        return Generated(np.array(ids, np.int32), np.array(lps, np.float32), reason, self.version)


@dataclass
class Played:
    """One episode the harness ran: its score (or what ended it) and its record."""

    episode: str
    prompt: Prompt
    score: Score | None = None
    error: BaseException | None = None
    samples: list[TrajectorySample] = field(default_factory=list)


class Env:
    """The run's environment: prompts, and ``score`` (1 when the answer names the sum)."""

    def __init__(self, n: int = 50) -> None:
        self.prompts = [Prompt(id=f"p{i}", messages=[{"role": "user", "content": f"{i}+{i}?"}],
                               answer=str(2 * i)) for i in range(n)]  # fmt: skip

    def dataset(self, split: str) -> list[Prompt]:
        return self.prompts

    def score(self, prompt: Prompt, completion: str) -> Score:
        return Score(reward=float(str(prompt.answer) in completion))


class Harness:
    """The gateway and its server on a scripted engine; :meth:`play` runs episodes as the
    episode runner would (each one's task calls ``run_episode``)."""

    def __init__(self, model: Model, engine: ScriptedEngine, config: GatewayConfig,
                 out: Path, *, agents: Any = None, limits: Limits | None = None,
                 guards: Guards | None = None) -> None:  # fmt: skip
        self.model, self.engine = model, engine
        self.env = Env()
        self.limits = limits or Limits(max_turns=12, max_context_tokens=4000, max_turn_tokens=64)
        self.gateway = Gateway(config, self.env, tokenizer=model.tok, parser=HERMES,
                               model_name="tiny", score_timeout_s=5.0,
                               agents=agents)  # fmt: skip
        self.server = GatewayServer(self.gateway, config, str(out), guards)
        self.played: list[Played] = []
        self._tg: Any = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.server.admin_key}"}

    def start(self, prompt: Prompt, name: str, *, evaluation: bool = False) -> Played:
        """Start one episode (as the runner does for each of a group's)."""
        played = Played(name, prompt)
        self.played.append(played)
        self._tg.start_soon(self._play, played, evaluation)
        return played

    async def _play(self, played: Played, evaluation: bool) -> None:
        m = self.model
        record = Trajectory(m.template, m.tok, played.prompt.messages or [], episode=played.episode,
                            end_token_ids=[m.end_id])  # fmt: skip

        async def source(prompt_ids: list[int], max_tokens: int) -> Generated:
            return await self.engine.generate(played.episode, prompt_ids, max_tokens)

        episode = Episode(episode_id=played.episode, prompt=played.prompt, record=record,
                          source=source, limits=self.limits, evaluation=evaluation)  # fmt: skip
        try:
            played.score = await self.gateway.run_episode(played.prompt, episode)
        except (Exception, EpisodeLimit) as exc:  # noqa: BLE001 - the test reads it
            played.error = exc
        played.samples = record.samples()


@asynccontextmanager
async def running(harness: Harness) -> AsyncIterator[Harness]:
    """The harness's server listening and its episode task group open; on exit both end."""
    async with anyio.create_task_group() as tg:
        await tg.start(harness.server.serve)
        async with anyio.create_task_group() as episodes:
            harness._tg = episodes
            yield harness
            episodes.cancel_scope.cancel()
        tg.cancel_scope.cancel()


def trained_turns(sample: TrajectorySample) -> list[list[int]]:
    """The runs of trained (mask 1) tokens of a sample, in order: one per kept turn."""
    runs: list[list[int]] = []
    prev = 0
    for tok, m in zip(sample.response_ids.tolist(), sample.loss_mask.tolist()):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(tok)
        prev = m
    return runs


AgentFn = Callable[..., Awaitable[Any]]
