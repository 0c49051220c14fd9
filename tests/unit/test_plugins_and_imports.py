"""Entry-point registry behaviour and the torch-free core."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

import asyncrl
from asyncrl import plugins
from asyncrl.errors import PluginError


def test_import_asyncrl_does_not_import_torch_or_engines() -> None:
    code = (
        "import sys, asyncrl, asyncrl.run.controller, asyncrl.run.loops, asyncrl.worker.runtime, asyncrl.launch;"
        # what a training backend's check_config loads in the controller
        "import asyncrl.policy.packing, asyncrl.training, asyncrl.training.options, asyncrl_fsdp,"
        " asyncrl_deepspeed, asyncrl_fsdp.options, asyncrl_deepspeed.options;"
        "asyncrl.plugins.load('asyncrl.training_backends', 'deepspeed');"
        "print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_worker_imports_no_controller() -> None:
    """A worker process (``python -m asyncrl.launch --worker``, the rollout supervisor, a
    torchrun rank) imports asyncrl; the controller's modules are for rank 0 and an embedding
    application alone, imported when ``asyncrl.Controller`` is first asked for."""
    code = (
        "import sys, asyncrl, asyncrl.launch, asyncrl.worker.runtime;"
        "print(sorted(m for m in sys.modules if m.startswith(('asyncrl.run.controller',"
        " 'asyncrl.run.loops', 'asyncrl.gateway'))));"
        "from asyncrl import Controller; print(Controller.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "asyncrl.run.controller"]


def test_public_exports() -> None:
    for name in asyncrl.__all__:
        assert hasattr(asyncrl, name), name


def test_first_party_plugins_are_registered() -> None:
    assert "vllm" in plugins.available("asyncrl.generation_backends")
    assert {"fsdp2", "deepspeed"} <= set(plugins.available("asyncrl.training_backends"))
    assert "arithmetic" in plugins.available("asyncrl.environments")
    samplers = plugins.available("asyncrl.samplers")
    assert {"in_order", "gated", "oversampled", "ready_first", "dynamic"} <= set(samplers)
    from asyncrl.policy.samplers import SamplerPlugin

    for name in samplers:  # every registered sampler loads and names its own struct's tag
        plugin = plugins.load("asyncrl.samplers", name)
        assert isinstance(plugin, SamplerPlugin)
        assert plugin.config.__struct_config__.tag == name


def test_missing_plugin_names_install_hint() -> None:
    with pytest.raises(PluginError, match=r"no training backend named 'nope'.*installed: .*fsdp2"):
        plugins.load("asyncrl.training_backends", "nope")
    with pytest.raises(PluginError, match="unknown plugin group"):
        plugins.available("asyncrl.nothing")


def fake_eps(monkeypatch: pytest.MonkeyPatch, eps: list[EntryPoint]) -> None:
    monkeypatch.setattr(plugins, "entry_points", lambda group: [e for e in eps if e.group == group])


def test_duplicate_names_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    g = "asyncrl.environments"
    fake_eps(monkeypatch, [EntryPoint("x", "os:getcwd", g), EntryPoint("x", "os:getpid", g)])
    with pytest.raises(PluginError, match="registered twice"):
        plugins.load(g, "x")


def test_import_failure_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    g = "asyncrl.environments"
    fake_eps(monkeypatch, [EntryPoint("broken", "no_such_module_xyz:f", g)])
    with pytest.raises(PluginError, match="failed to import.*ModuleNotFoundError"):
        plugins.load(g, "broken")


def test_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    g = "asyncrl.environments"
    fake_eps(monkeypatch, [EntryPoint("a", "os:getcwd", g), EntryPoint("b", "os:getpid", g)])
    monkeypatch.setenv("ASYNCRL_PLUGINS", "asyncrl.environments:a")
    assert list(plugins.available(g)) == ["a"]
    import os

    assert plugins.load(g, "a") is os.getcwd


def test_require_names_the_config_field() -> None:
    assert plugins.require("asyncrl.training_backends", "fsdp2", "trainer.backend").name == "fsdp2"
    with pytest.raises(PluginError, match=r"generator.backend: no generation backend named 'vlm'"):
        plugins.require("asyncrl.generation_backends", "vlm", "generator.backend")
