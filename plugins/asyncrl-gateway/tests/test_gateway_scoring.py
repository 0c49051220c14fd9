"""How the gateway scores a session that ends without a reward: with what the run's environment
has, found once when the gateway is built (``check_environment``): ``score_async`` awaited,
else ``score`` on a thread, each under ``failures.reward_timeout_s``; a capability of the wrong
kind stops the gateway from being built, naming the environment and the member."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncrl.environment import Prompt, Score
from asyncrl.errors import PluginError
from asyncrl_gateway.config import GatewayConfig
from asyncrl_gateway.gateway import Gateway, SessionFailed

pytestmark = pytest.mark.asyncio

PROMPT = Prompt(id="p", text="1+1?", answer="2")


class Prompts:
    """Prompts only: its agents post the rewards."""

    def dataset(self, split: str) -> list[Prompt]:
        return [PROMPT]


def _gateway(env: Any, timeout_s: float = 5.0) -> Gateway:
    return Gateway(GatewayConfig(enabled=True), env, tokenizer=None, parser=None,  # type: ignore[arg-type]
                   model_name="m", score_timeout_s=timeout_s, env_name="judge")  # fmt: skip


async def test_score_async_scores_the_last_answer_and_score_is_never_called() -> None:
    class Judge(Prompts):
        def score(self, prompt: Prompt, completion: str) -> Score:
            raise AssertionError("score() called although the environment has score_async")

        async def score_async(self, prompt: Prompt, completion: str) -> Score:
            await anyio.sleep(0)
            return Score(reward=float(completion == prompt.answer))

    gateway = _gateway(Judge())
    assert gateway.scores
    assert (await gateway._scored(PROMPT, "2")).reward == 1.0  # noqa: SLF001
    assert (await gateway._scored(PROMPT, "3")).reward == 0.0  # noqa: SLF001


async def test_score_async_past_its_deadline_fails_the_session() -> None:
    class Judge(Prompts):
        async def score_async(self, prompt: Prompt, completion: str) -> Score:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    with pytest.raises(SessionFailed, match=r"score_async\(\) did not return within 0.1 s "
                                            r"\(failures.reward_timeout_s\)"):
        await _gateway(Judge(), timeout_s=0.1)._scored(PROMPT, "2")  # noqa: SLF001


async def test_score_runs_on_a_thread_and_without_either_nothing_scores() -> None:
    class Plain(Prompts):
        def score(self, prompt: Prompt, completion: str) -> Score:
            return Score(reward=2.0)

    assert (await _gateway(Plain())._scored(PROMPT, "x")).reward == 2.0  # noqa: SLF001
    gateway = _gateway(Prompts())
    assert not gateway.scores
    with pytest.raises(SessionFailed, match="no score"):
        await gateway._scored(PROMPT, "x")  # noqa: SLF001


async def test_a_scoring_capability_of_the_wrong_kind_stops_the_gateway() -> None:
    class Judge(Prompts):
        def score_async(self, prompt: Prompt, completion: str) -> Score:
            return Score(reward=0.0)

    with pytest.raises(PluginError) as err:
        _gateway(Judge())
    text = str(err.value)
    assert text.startswith("environment 'judge' (test_gateway_scoring.")
    assert "'score_async' must be `async def` (the controller awaits it on its event loop)" in text
