"""A plugin's optional capabilities are checked once, when it loads, and then used directly.

For each capability of an environment (``score_async``, ``score_on_loop``, ``take_metrics``,
``tools``, ``rewards``; ``score`` and ``run_episode`` of the wrong kind too), of a metrics sink
(``check_options``, ``synchronous``), of a sampler (its protocol's members) and of a training
backend (``loss_inputs``): one of the wrong kind fails where the real part takes the plugin,
with one error naming the plugin and the member; one of the right kind is what the part then
uses (an environment's ``score_async`` is awaited, its ``take_metrics`` figures are in the
step's metrics, its tools are the run's).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asyncrl.config import from_dict
from asyncrl.data.rewards import Reward
from asyncrl.env.capabilities import check_environment
from asyncrl.env.tools import tool
from asyncrl.environment import Prompt, Score
from asyncrl.errors import ConfigError, PluginError
from asyncrl.run.context import RunContext
from asyncrl.run.episodes import build_runner
from asyncrl.run.scoring import Scorer
from asyncrl.run.wake import Signal
from scoring_support import DigitsTokenizer, group_of

PROMPT = Prompt(id="p", text="x")


class Base:
    """The least environment: prompts, and ``score`` (the length of the completion)."""

    def dataset(self, split: str) -> list[Prompt]:
        return [PROMPT]

    def score(self, prompt: Prompt, completion: str) -> Score:
        return Score(reward=float(len(completion)))


def _env(**members: Any) -> Any:
    """An environment of a class of its own (``Judge``) with ``members`` added to ``Base``."""
    return type("Judge", (Base,), members)()


def _contract_error(exc: pytest.ExceptionInfo[PluginError], *members: str) -> str:
    text = str(exc.value)
    assert text.startswith("environment 'judge' (test_plugin_capabilities.Judge) does not keep "
                           "the environment contract: "), text  # fmt: skip
    for member in members:
        assert repr(member) in text, (member, text)
    assert "(docs/environments.md, 'Optional capabilities')" in text
    return text


# ------------------------------------------------------------------------------ scoring
def _scorer(env: Any) -> Scorer:
    return Scorer(env, DigitsTokenizer(), "judge", timeout_s=5.0)  # type: ignore[arg-type]


async def _plain_score_async(self: Any, prompt: Prompt, completion: str) -> Score:
    return Score(reward=0.0)


@pytest.mark.parametrize(("members", "member", "says"), [
    ({"score_async": lambda self, p, c: Score(reward=1.0)}, "score_async",
     "'score_async' must be `async def` (the controller awaits it on its event loop)"),
    ({"score_async": 3}, "score_async", "'score_async' is not callable (it is a int)"),
    ({"score": _plain_score_async}, "score",
     "'score' must be a plain method, not `async def` (it runs on a worker thread; an async "
     "one is named score_async)"),
    ({"score_on_loop": 1}, "score_on_loop",
     "'score_on_loop' must be a bool (True or False), got 1 (a int)"),
    ({"score_on_loop": "yes"}, "score_on_loop", "got 'yes' (a str)"),
])  # fmt: skip
def test_a_scoring_capability_of_the_wrong_kind_stops_the_scorer(
    members: dict[str, Any], member: str, says: str
) -> None:
    with pytest.raises(PluginError) as err:
        _scorer(_env(**members))
    assert says in _contract_error(err, member)


def test_an_environment_with_nothing_to_score_with_is_refused_with_a_guess() -> None:
    class Judge:
        def dataset(self, split: str) -> list[Prompt]:
            return [PROMPT]

        def scor(self, prompt: Prompt, completion: str) -> Score:
            return Score(reward=0.0)

    with pytest.raises(PluginError) as err:
        _scorer(Judge())
    text = str(err.value)
    assert "environment 'judge'" in text and "Judge) does not keep" in text
    assert ("no way to score a completion: no method 'score', 'score_async' or 'run_episode' "
            "(did you mean 'scor'?)") in text  # fmt: skip


def test_a_missing_dataset_is_named_with_a_guess() -> None:
    class Judge:
        def datasets(self, split: str) -> list[Prompt]:
            return [PROMPT]

    with pytest.raises(PluginError, match=r"no method 'dataset' \(did you mean 'datasets'\?\)"):
        check_environment(Judge(), "judge")


@pytest.mark.asyncio
async def test_score_async_is_awaited_and_score_never_called() -> None:
    calls: list[str] = []

    def score(self: Any, prompt: Prompt, completion: str) -> Score:
        raise AssertionError("score() called although the environment has score_async")

    async def score_async(self: Any, prompt: Prompt, completion: str) -> Score:
        calls.append(completion)
        return Score(reward=float(completion), correct=completion == "7")

    scorer = _scorer(_env(score=score, score_async=score_async))
    assert not scorer.cheap
    done = await scorer.threaded(group_of(PROMPT, [[7], [3]]))
    assert sorted(calls) == ["3", "7"]
    assert [(s.reward, s.correct) for s in done] == [(7.0, True), (3.0, False)]


@pytest.mark.asyncio
async def test_score_on_loop_true_lets_a_cheap_score_run_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncrl.run import scoring

    monkeypatch.setattr(scoring, "INLINE_SCORE_MAX_S", 60.0)  # any measured cost is cheap
    for on_loop, cheap in ((False, False), (True, True)):
        scorer = _scorer(_env(score_on_loop=on_loop))
        await scorer.threaded(group_of(PROMPT, [[1]]))  # the first group measures the cost
        assert scorer.cheap is cheap


# ------------------------------------------------------------------------------ episodes
@tool
async def calc(expression: str) -> str:
    """Evaluate an expression.

    Args:
        expression: digits and + - * /.
    """
    return expression


def _runner(env: Any, model_dir: Path) -> Any:
    config = from_dict({"model": {"path": str(model_dir)}, "environment": {"name": "judge"}})
    ctx = RunContext(
        config, None, [], None, None, None, serving=lambda: [], changed=Signal(), committed=Signal(),  # type: ignore[arg-type]
        failures=None, probes=None, metrics=None, now=time.perf_counter,  # type: ignore[arg-type]
    )  # fmt: skip
    tokenizer = type("Tok", (), {"chat_template": object()})()
    return build_runner(ctx, env, tokenizer=tokenizer, asker=None, fail_group=lambda *a: {})  # type: ignore[arg-type]


async def _run_episode(self: Any, prompt: Prompt, episode: Any) -> Score:
    return Score(reward=0.0)


def _episodic(**members: Any) -> Any:
    return _env(**{"run_episode": _run_episode, **members})


@pytest.mark.parametrize(("members", "member", "says"), [
    ({"take_metrics": {"a": 1.0}}, "take_metrics", "'take_metrics' is not callable (it is a dict)"),
    ({"take_metrics": _plain_score_async}, "take_metrics",
     "'take_metrics' must be a plain method, not `async def` (the controller calls it once a "
     "step, on its event loop)"),
    ({"tools": calc}, "tools",
     "'tools' must be a list or tuple of @tool functions (asyncrl.plugin.environment.tool), "
     "got a Tool"),
    ({"tools": [calc, calc.fn]}, "tools",
     "'tools'[1] is the function 'calc', not a tool: decorate it with @tool"),
    ({"tools": (calc, "calc")}, "tools", "'tools'[1] is a str, not a tool"),
    ({"tools": [calc, calc]}, "tools", "'tools': two tools are named 'calc': rename one"),
    ({"run_episode": lambda self, p, e: None}, "run_episode",
     "'run_episode' must be `async def` (the controller awaits it on its event loop)"),
])  # fmt: skip
def test_an_episode_capability_of_the_wrong_kind_stops_the_runner(
    members: dict[str, Any], member: str, says: str, model_dir: Path
) -> None:
    with pytest.raises(PluginError) as err:
        _runner(_episodic(**members), model_dir)
    assert says in _contract_error(err, member)


def test_take_metrics_figures_are_in_the_step_metrics(model_dir: Path) -> None:
    taken: list[int] = []

    def take_metrics(self: Any) -> dict[str, float]:
        taken.append(1)
        return {"judge_calls": float(len(taken))}

    env = _episodic(take_metrics=take_metrics)
    runner = _runner(env, model_dir)
    assert taken == []  # found at load, not called
    assert runner.take_metrics()["judge_calls"] == 1.0  # once a step
    env.take_metrics = None  # found once, at load: never looked up on the environment again
    assert runner.take_metrics()["judge_calls"] == 2.0
    assert "judge_calls" not in _runner(_episodic(), model_dir).take_metrics()


def test_the_environment_tools_are_the_runs(model_dir: Path) -> None:
    runner = _runner(_episodic(tools=(calc,)), model_dir)
    assert runner._tools.names() == ["calc"]  # noqa: SLF001
    assert "tool_busy" in runner.take_metrics()
    assert _runner(_episodic(tools=[]), model_dir)._tools is None  # noqa: SLF001


# ------------------------------------------------------------------------------ rewards
def test_rewards_of_the_wrong_kind_are_refused_where_they_are_fingerprinted() -> None:
    from asyncrl.checkpoints.resume_rule import code_fingerprints

    with pytest.raises(PluginError) as err:
        code_fingerprints(_env(rewards=[len]), name="judge")
    assert ("'rewards' must be a list or tuple of reward functions as "
            "asyncrl.data.rewards.load_rewards makes them") in _contract_error(err, "rewards")
    assert "got a list of builtin_function_or_method" in str(err.value)
    with pytest.raises(PluginError, match="'rewards' must be .* got a dict"):
        check_environment(_env(rewards={"a": 1}), "judge")


def test_rewards_are_what_is_fingerprinted() -> None:
    from asyncrl.checkpoints.resume_rule import code_fingerprints

    def exact(completion: str) -> float:
        return 1.0

    reward = Reward("a", 1.0, exact, ("completion",), False, "t:exact", None)
    parts = check_environment(_env(rewards=[reward]), "judge")
    assert parts.rewards == (reward,)
    code = code_fingerprints(_env(rewards=[reward]), name="judge")
    assert code["t:exact"].startswith("test_plugin_capabilities.py sha256 ")


# ------------------------------------------------------------------------------ sinks
def test_a_sink_of_the_wrong_kind_is_refused_when_it_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncrl import registry
    from asyncrl.sinks import SinkPlugin, load_sinks

    def make(options: dict[str, Any], **kwargs: Any) -> Any:
        return None

    async def check(options: dict[str, Any]) -> None: ...

    make.synchronous = "yes"  # type: ignore[attr-defined]
    make.check_options = 3  # type: ignore[attr-defined]
    with pytest.raises(PluginError) as err:
        SinkPlugin.of(make, "csv")
    assert str(err.value) == (
        "metrics sink 'csv' (asyncrl.metrics_sinks): 'check_options' is not callable (it is a "
        "int); 'synchronous' must be a bool (True or False), got 'yes'. Fix: make them what "
        "asyncrl.plugin.sink.SinkPlugin says"
    )
    with pytest.raises(PluginError, match="'check_options' must be a plain function"):
        SinkPlugin.of(SinkPlugin(make=make, check_options=check), "csv")
    seen: list[dict[str, Any]] = []
    make.synchronous = True  # type: ignore[attr-defined]
    make.check_options = seen.append  # type: ignore[attr-defined]
    real = registry.load
    monkeypatch.setattr(registry, "load", lambda group, name, field=None: (
        make if name == "csv" else real(group, name, field)))  # fmt: skip
    loaded = load_sinks(["csv"], {"csv": {"path": "x.csv"}})
    assert seen == [{"path": "x.csv"}]  # its check_options, called at load
    assert loaded["csv"].synchronous is True
    del make.synchronous, make.check_options  # type: ignore[attr-defined]
    assert SinkPlugin.of(make, "csv").synchronous is False


# ------------------------------------------------------------------------------ samplers
class _Knobs(msgspec.Struct, tag="broken", tag_field="name", frozen=True,
             forbid_unknown_fields=True):  # fmt: skip
    pass


class _Sampler:
    name = "broken"
    max_staleness = 1
    over_dispatch = 1.0

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step

    def admit(self, view: Any) -> tuple[bool, int | None]:
        return True, None

    def select(self, view: Any, min_groups: int, max_groups: int) -> list[Any]:
        return []

    def evict(self, view: Any) -> list[Any]:
        return []

    def should_abort_inflight(self, group: Any, trainer_version: int) -> bool:
        return False

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None: ...


def _make(monkeypatch: pytest.MonkeyPatch, **members: Any) -> Any:
    from asyncrl import registry
    from asyncrl.policy.sampler_choice import make_sampler
    from asyncrl.policy.samplers import SamplerPlugin

    cls = type("Broken", (_Sampler,), members)
    plugin = SamplerPlugin(config=_Knobs, create=lambda config: cls())
    monkeypatch.setattr(registry, "load", lambda group, name, field=None: plugin)
    return make_sampler({"name": "broken"})


def test_a_sampler_of_the_wrong_kind_is_refused_naming_each_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def admit(self: Any, view: Any) -> tuple[bool, int | None]:
        return True, None

    with pytest.raises(ConfigError) as err:
        _make(monkeypatch, evict=None, evicts=_Sampler.evict, admit=admit, max_staleness="1",
              describe=3)  # fmt: skip
    text = str(err.value)
    assert text.startswith("pipeline.sampler.name: the sampler 'broken' "
                           "(test_plugin_capabilities.Broken) does not implement "
                           "asyncrl.policy.samplers.Sampler: ")  # fmt: skip
    assert "'admit' must be a plain method, not `async def`" in text
    assert "no method 'evict' (did you mean 'evicts'?)" in text
    assert "'describe' is not callable (it is a int)" in text
    assert "'max_staleness' must be a int, got '1'" in text
    with pytest.raises(ConfigError, match="pipeline.sampler.in_flight_at_refit: sampler "
                                          "'broken' chose 'drop'"):
        _make(monkeypatch, in_flight_at_refit="drop")
    assert isinstance(_make(monkeypatch), _Sampler)


# ------------------------------------------------------------------------------ loss inputs
@pytest.mark.parametrize(("loss_inputs", "says"), [
    ("proximal_logprobs", "its loss_inputs must be a set of field names (proximal_logprobs, "
                          "reference_logprobs), got 'proximal_logprobs' (a str)"),
    (frozenset({"proximal_logprob"}), "its loss_inputs names 'proximal_logprob' (did you mean "
                                      "'proximal_logprobs'?), which is no optional TrainBatch "
                                      "field"),
])  # fmt: skip
def test_loss_inputs_of_the_wrong_kind_stop_the_trainer_worker(
    loss_inputs: Any, says: str, model_dir: Path
) -> None:
    rt = _trainer_runtime(model_dir, loss_inputs)
    with pytest.raises(PluginError) as err:
        rt._check_loss_inputs()  # noqa: SLF001
    assert str(err.value).startswith("training backend 'bigram' (asyncrl.training_backends): ")
    assert says in str(err.value)


def test_loss_inputs_are_read_once_when_the_backend_is_adopted(model_dir: Path) -> None:
    rt = _trainer_runtime(model_dir, ["proximal_logprobs"], proximal=True)
    rt.backend.loss_inputs = ()  # read at adoption: not looked up again
    rt._check_loss_inputs()  # noqa: SLF001
    with pytest.raises(PluginError, match="does not read proximal_logprobs"):
        _trainer_runtime(model_dir, None, proximal=True)._check_loss_inputs()  # noqa: SLF001
    with pytest.raises(PluginError, match="'loss_inputs' must be an attribute, not a method"):
        _trainer_runtime(model_dir, lambda self: ())


def _trainer_runtime(model_dir: Path, loss_inputs: Any, *, proximal: bool = False) -> Any:
    from asyncrl.backend import WorkerContext
    from asyncrl.wire.messages import Init
    from asyncrl.worker.trainer_runtime import TrainerRuntime
    from test_worker_backend_check import _trainer

    data: dict[str, Any] = {"model": {"path": str(model_dir)}, "environment": {"name": "x"},
                            "trainer": {"backend": "bigram"}}  # fmt: skip
    if proximal:
        data |= {"loss": {"proximal_policy": "current"}, "grpo": {"update_epochs": 2}}
    wctx = WorkerContext(group="trainer", rank=0, world_size=1, local_rank=0,
                         config=from_dict(data), run_dir="")  # fmt: skip
    rt = TrainerRuntime(None, None, Init(run_id="r", config={}, data_address=""), wctx)
    extra = {} if loss_inputs is None else {"loss_inputs": loss_inputs}
    rt.adopt(_trainer(extra=extra)(), plugin="bigram")
    rt.thread.close()
    return rt
