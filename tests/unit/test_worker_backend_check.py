"""A backend is checked against its group's protocol once, when the worker creates it.

Small fake backends break the protocol one way each (a method missing, misspelt, of the wrong
kind, not callable); the check must name the plugin, the entry-point group and the method in
one ``PluginError``, suggest the near name, and resolve the optional methods once. The shipped
backends must pass it (a check too strict would stop every real run at start-up).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.backend import (
    EngineWatch,
    GenerationBackend,
    KVCalibration,
    Reprefill,
    TrainingBackend,
    WorkerContext,
)
from asyncrl.registry import check_plugin
from asyncrl.errors import PluginError
from asyncrl.wire.messages import Init
from asyncrl.worker.rollout_runtime import RolloutRuntime
from asyncrl.worker.trainer_runtime import TrainerRuntime

GEN = "asyncrl.generation_backends"
TRAIN = "asyncrl.training_backends"
GEN_METHODS = [
    "start", "generate", "abort", "score", "begin_weight_update", "load_weight_bucket",
    "abort_weight_update", "finish_weight_update", "close",
]
"""The GenerationBackend contract, written out independently of the protocol class."""
TRAIN_METHODS = [
    "start", "compute_logprobs", "begin_step", "train_chunk", "finish_step", "weight_specs",
    "iter_weights", "save_state", "load_state", "close",
]


def _async_method() -> Any:
    async def method(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    return method


def _sync_method() -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    return method


def _generator(*, drop: str = "", extra: dict[str, Any] | None = None) -> type:
    """A generation backend class with every method but ``drop``, plus ``extra``."""
    body = {name: _async_method() for name in GEN_METHODS if name != drop}
    return type("FakeGenerator", (), {**body, **(extra or {})})


def _trainer(*, drop: str = "", extra: dict[str, Any] | None = None) -> type:
    body = {name: _sync_method() for name in TRAIN_METHODS if name != drop}
    return type("FakeTrainer", (), {**body, **(extra or {})})


def _check_gen(backend: Any) -> dict[str, Any]:
    return check_plugin(backend, GenerationBackend, plugin="fake", group=GEN,
                         optional=(EngineWatch,))


def test_the_contract_lists_match_the_protocols() -> None:
    """The lists above are the documented contract: a method added to or dropped from a
    protocol must be a decision, seen here (and in docs/plugins.md)."""
    public = lambda p: sorted(n for n in vars(p) if not n.startswith("_") and callable(vars(p)[n]))  # noqa: E731
    assert public(GenerationBackend) == sorted(GEN_METHODS)
    assert public(TrainingBackend) == sorted(TRAIN_METHODS)
    assert public(EngineWatch) == ["watch"] and public(KVCalibration) == ["calibrate_kv_scales"]
    assert public(Reprefill) == ["reprefill_in_flight"]


def test_a_complete_backend_passes_and_its_optional_methods_resolve_once() -> None:
    assert _check_gen(_generator()()) == {"watch": None}
    backend = _generator(extra={"watch": _async_method()})()
    found = _check_gen(backend)
    assert found["watch"] is not None and found["watch"].__self__ is backend
    trainer = _trainer(extra={"calibrate_kv_scales": _sync_method()})()
    found = check_plugin(trainer, TrainingBackend, plugin="t", group=TRAIN,
                          optional=(KVCalibration,))
    assert found["calibrate_kv_scales"].__self__ is trainer


@pytest.mark.parametrize("missing", GEN_METHODS)
def test_a_missing_method_names_the_plugin_the_group_and_the_method(missing: str) -> None:
    with pytest.raises(PluginError) as err:
        _check_gen(_generator(drop=missing)())
    text = str(err.value)
    assert text.startswith("generation backend 'fake' (asyncrl.generation_backends: ")
    assert "FakeGenerator) does not implement GenerationBackend" in text
    assert f"no method {missing!r}" in text
    assert "did you mean" not in text  # nothing near: no guess
    assert "Fix: define it as asyncrl.backend.GenerationBackend says" in text


def test_a_misspelt_method_gets_a_did_you_mean() -> None:
    backend = _generator(drop="abort_weight_update", extra={"abort_weights_update": _async_method()})
    with pytest.raises(PluginError, match=r"no method 'abort_weight_update' \(did you mean "
                                          r"'abort_weights_update'\?\)"):
        _check_gen(backend())
    with pytest.raises(PluginError, match=r"no method 'compute_logprobs' \(did you mean "
                                          r"'compute_logprob'\?\)"):
        check_plugin(_trainer(drop="compute_logprobs",
                               extra={"compute_logprob": _sync_method()})(),
                      TrainingBackend, plugin="t", group=TRAIN)


def test_a_sync_method_where_async_is_required_and_the_reverse() -> None:
    with pytest.raises(PluginError, match=r"'score' must be `async def`"):
        _check_gen(_generator(extra={"score": _sync_method()})())
    with pytest.raises(PluginError, match=r"'train_chunk' must be a plain method, not `async def`"):
        check_plugin(_trainer(extra={"train_chunk": _async_method()})(), TrainingBackend,
                      plugin="t", group=TRAIN)
    with pytest.raises(PluginError, match=r"'watch' must be `async def`"):  # optional, present
        _check_gen(_generator(extra={"watch": _sync_method()})())


def test_every_problem_is_in_one_error() -> None:
    backend = _generator(drop="generate", extra={"abort": 3, "score": _sync_method()})()
    with pytest.raises(PluginError) as err:
        _check_gen(backend)
    text = str(err.value)
    assert "no method 'generate'" in text
    assert "'abort' is not callable (it is a int)" in text
    assert "'score' must be `async def`" in text
    assert "Fix: define them" in text


def _wctx(group: str) -> WorkerContext:
    return WorkerContext(group=group, rank=0, world_size=1, local_rank=0,
                         config=None, run_dir="")  # type: ignore[arg-type]


INIT = Init(run_id="r", config={}, data_address="")


@pytest.mark.asyncio
async def test_the_runtime_refuses_a_backend_before_starting_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load`` creates, checks, then starts: a backend that fails the check is never
    started nor kept (so not closed either), and the error is the check's."""
    from asyncrl import registry

    started: list[str] = []

    async def start(self: Any) -> dict[str, Any]:
        started.append("start")
        return {}

    broken = _generator(drop="abort", extra={"start": start, "abrot": _async_method()})
    monkeypatch.setattr(registry, "load", lambda group, name: lambda ctx: broken())
    monkeypatch.setattr(RolloutRuntime, "backend_name", staticmethod(lambda config: "fake"))
    rt = RolloutRuntime(None, None, INIT, _wctx("rollout"))
    with pytest.raises(PluginError, match=r"generation backend 'fake' .* no method 'abort' "
                                          r"\(did you mean 'abrot'\?\)"):
        await rt.load()
    assert started == [] and rt.backend is None


@pytest.mark.asyncio
async def test_the_trainer_runtime_creates_and_checks_on_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from asyncrl import registry

    made_on: list[int] = []

    def factory(ctx: WorkerContext) -> Any:
        made_on.append(threading.get_ident())
        return _trainer(extra={"begin_step": _async_method()})()

    monkeypatch.setattr(registry, "load", lambda group, name: factory)
    monkeypatch.setattr(TrainerRuntime, "backend_name", staticmethod(lambda config: "t"))
    rt = TrainerRuntime(None, None, INIT, _wctx("trainer"))
    try:
        with pytest.raises(PluginError, match=r"training backend 't' \(asyncrl.training_backends"
                                              r": .*'begin_step' must be a plain method"):
            await rt.load()
    finally:
        await rt.close()
    assert made_on and made_on[0] != threading.get_ident() and rt.backend is None


@pytest.mark.asyncio
async def test_a_sampler_that_reprefills_needs_a_backend_that_can(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, model_dir: Any
) -> None:
    """``in_flight_at_refit = "reprefill"`` on a backend without ``reprefill_in_flight``: the
    worker refuses before starting it, naming the knob and the fix; with one, it starts."""
    from asyncrl import registry
    from asyncrl.config import from_dict
    from asyncrl.errors import ConfigError

    config = from_dict({
        "model": {"path": str(model_dir)}, "environment": {"name": "repeat-digit"},
        "run": {"output_dir": str(tmp_path / "out")},
        "trainer": {"backend": "bigram"}, "generator": {"backend": "bigram"},
        "pipeline": {"sampler": {"name": "gated", "in_flight_at_refit": "reprefill"}},
    })  # fmt: skip
    started: list[str] = []

    async def start(self: Any) -> dict[str, Any]:
        started.append("start")
        return {}

    for extra, refused in (({}, True), ({"reprefill_in_flight": _async_method()}, False)):
        backend = _generator(extra={"start": start, **extra})
        monkeypatch.setattr(registry, "load", lambda group, name, b=backend: lambda ctx: b())
        wctx = WorkerContext(group="rollout", rank=0, world_size=1, local_rank=0,
                             config=config, run_dir="")  # fmt: skip
        sockets = SimpleNamespace(socket=lambda *args, **kwargs: None)  # no data socket here
        rt = RolloutRuntime(sockets, None, INIT, wctx)
        if refused:
            with pytest.raises(ConfigError, match=r"pipeline.sampler.in_flight_at_refit: generator "
                                                  r"backend 'bigram' cannot re-prefill .* Fix: set "
                                                  r"it to \"continue\""):
                await rt.load()
            assert started == []
        else:
            await rt.load()
            assert started == ["start"]


def test_the_shipped_backends_pass() -> None:
    from asyncrl_example_backend.generation import BigramGenerator
    from asyncrl_example_backend.training import BigramTrainer
    from asyncrl_vllm.backend import VLLMBackend

    assert _check_gen(BigramGenerator) == {"watch": None}
    assert _check_gen(VLLMBackend)["watch"] is VLLMBackend.watch
    assert check_plugin(BigramTrainer, TrainingBackend, plugin="bigram", group=TRAIN,
                         optional=(KVCalibration,)) == {"calibrate_kv_scales": None}
    from asyncrl_deepspeed.backend import DeepSpeedBackend
    from asyncrl_fsdp.backend import FSDPBackend

    for cls in (FSDPBackend, DeepSpeedBackend):
        found = check_plugin(cls, TrainingBackend, plugin=cls.__name__, group=TRAIN,
                              optional=(KVCalibration,))
        assert found["calibrate_kv_scales"] is not None
